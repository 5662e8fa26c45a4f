"""Plain-PyTorch RMSNorm: the float64 truth for tests and the tuner, and the CPU path of the runtime."""

from __future__ import annotations

import torch

CASTING_MODES = ("llama", "gemma", "none")


def rms_norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, casting_mode: str) -> torch.dtype:
    """Output dtype as transformers computes it: Llama promotes x with w, Gemma and "none" keep x's dtype."""
    return torch.promote_types(x_dtype, w_dtype) if casting_mode == "llama" else x_dtype


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str) -> torch.Tensor:
    """RMSNorm in plain PyTorch with the rounding steps of each casting mode (differentiable by autograd).

    llama: transformers' LlamaRMSNorm — ``w · (x_fp32 · rstd).to(x.dtype)``; gemma: GemmaRMSNorm — all fp32,
    ``(x_fp32 · rstd · (offset + w_fp32)).to(x.dtype)``; none: rstd in fp32, products in x's dtype.
    """
    x_f32 = x.float()
    rstd = torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        normed = (x_f32 * rstd).to(x.dtype)
        out_dtype = rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode)
        # bf16·bf16 in PyTorch is an fp32 product rounded once, which is what this computes
        return ((weight.float() + offset) * normed.float()).to(out_dtype)
    if casting_mode == "gemma":
        return (x_f32 * rstd * (offset + weight.float())).to(x.dtype)
    if casting_mode == "none":
        return x * rstd.to(x.dtype) * (offset + weight.float()).to(x.dtype)
    raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Exact RMSNorm in float64 (no intermediate rounding): ``x / sqrt(mean(x²) + eps) · (offset + w)``."""
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * rstd * (offset + weight.double())
