"""Functional ops: drop-in replacements for the transformers / PyTorch computations they name."""

from __future__ import annotations

import math

import torch

from liger_gen.codegen.spaces import RMSNormSpace
from liger_gen.reference import CASTING_MODES, rms_norm_torch
from liger_gen.runtime.ops import rms_norm_2d, uses_triton

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _describe(name: str, t: torch.Tensor) -> str:
    return f"{name} of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
             casting_mode: str = "llama") -> torch.Tensor:
    """Root-mean-square layer norm over the last dim (Zhang & Sennrich, 2019).

    ``y = x / sqrt(mean(x², dim=-1) + eps) · (offset + weight)``, with the statistics always in fp32.

    Args:
        x: (..., hidden) float32, bfloat16 or float16; any leading dims, any strides.
        weight: (hidden,) floating, on x's device.
        eps: added to the mean square before the reciprocal square root.
        offset: added to weight (Gemma stores w − 1 and uses offset=1.0).
        casting_mode: "llama" — transformers' LlamaRMSNorm: x·rstd in fp32, rounded to x's dtype, times
            weight; the output has the promoted dtype of x and weight. "gemma" — GemmaRMSNorm: everything in
            fp32, output in x's dtype. "none" — rstd in fp32, the products in x's dtype.

    Returns:
        y of x's shape (dtype as above). Differentiable in x and weight.

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run plain PyTorch, or the same
    Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 is accepted on the plain-PyTorch
    path only.

    Raises:
        TypeError: x or weight is not a tensor or has a non-floating dtype, float64 on the kernel path, or eps /
            offset is not a number.
        ValueError: weight is not (hidden,), the tensors are on different devices, hidden exceeds the kernel's
            limit (65536), or casting_mode is unknown.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm: x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    for name, value in (("eps", eps), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"rms_norm: {name} must be a Python float, got {type(value).__name__} {value!r}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"rms_norm: casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    if x.dim() < 1:
        raise ValueError(f"rms_norm: x must have at least one dim (..., hidden); got {_describe('x', x)}")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"rms_norm: weight must have shape ({hidden},) to match x's last dim; "
                         f"got {_describe('weight', weight)} and {_describe('x', x)}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: x and weight must be on one device; got {_describe('x', x)} and "
                         f"{_describe('weight', weight)}")
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_floating_point():
            raise TypeError(f"rms_norm: {name} must be float32, bfloat16 or float16; got {_describe(name, t)}")
    if not uses_triton(x):
        return rms_norm_torch(x, weight, eps, offset, casting_mode)
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"rms_norm: the Triton kernel supports float32, bfloat16 and float16; got "
                            f"{_describe(name, t)} (float64 runs only on the plain-PyTorch CPU path)")
    if hidden > RMSNormSpace.MAX_N_COLS:
        raise ValueError(f"rms_norm: hidden size {hidden} exceeds the single-pass kernel's limit "
                         f"{RMSNormSpace.MAX_N_COLS}; got {_describe('x', x)}")
    x2d = x.reshape(math.prod(x.shape[:-1]), hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return rms_norm_2d(x2d, weight, float(eps), float(offset), casting_mode).view(x.shape)
