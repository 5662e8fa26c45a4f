"""torch.library custom ops that launch the tuned kernels.

``liger_gen::rms_norm_fwd`` and ``liger_gen::rms_norm_bwd`` take 2-D tensors (rows, n_cols) whose last dim has
unit stride; ``liger_gen.functional.rms_norm`` does the reshaping and the checks. Both ops have fake (meta)
implementations, so torch.compile traces them without a graph break, and neither does a host sync, so a step
that uses them can be captured in a CUDA graph.

The launch config is chosen once per (device, dtype, n_cols, rows, casting_mode) and memoised: a call costs a
dict lookup plus the Triton launch. The runtime never benchmarks on its own.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.reference import rms_norm_out_dtype, rms_norm_torch
from liger_gen.runtime import tables
from liger_gen.runtime.devices import current_gpu


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: CPU tensors then run the Triton kernels in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_triton(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the Triton kernels (CUDA, or CPU under the interpreter)."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreter_enabled())


@functools.lru_cache(maxsize=None)
def _device_info(device: torch.device) -> tuple[str | None, DeviceLimits]:
    """(canonical GPU name or None, limits) of a device; CPU means the interpreter."""
    if device.type == "cuda":
        gpu = current_gpu(device)
        return (gpu[0] if gpu else None), DeviceLimits.from_device(device)
    return None, DeviceLimits.interpreter()


@functools.lru_cache(maxsize=None)
def _rms_norm_module(config, casting_mode: str) -> ModuleType:
    """Rendered and imported kernel module of one config (rendering happens once per distinct config)."""
    return load_variant("rms_norm", config.template_params(casting_mode))


@functools.lru_cache(maxsize=4096)
def _rms_norm_variant(device: torch.device, dtype: torch.dtype, n_cols: int, rows: int, casting_mode: str,
                      heuristic_only: bool) -> tuple[ModuleType, int]:
    """The kernel module for one call shape and the device's SM count (memoised per shape)."""
    gpu, limits = _device_info(device)
    found = tables.lookup("rms_norm", dtype, n_cols, rows, gpu, limits)
    return _rms_norm_module(found["config"], casting_mode), limits.num_sms


def rms_norm_variant(x: torch.Tensor, casting_mode: str) -> tuple[ModuleType, int]:
    """Kernel module and SM count for a 2-D ``x`` (CUDA tensors always carry their device index)."""
    return _rms_norm_variant(x.device, x.dtype, x.shape[1], x.shape[0], casting_mode,
                             tables.heuristic_only_enabled())


def clear_caches() -> None:
    """Forget chosen variants (after writing tables or changing $LIGER_GEN_TUNED_DIR)."""
    _rms_norm_variant.cache_clear()
    _rms_norm_module.cache_clear()
    tables.clear_caches()


# ------------------------------------------------------------------------------------------------ RMSNorm


def _rms_norm_fwd_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                       casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y (rows, n_cols) and rstd (rows,) fp32 for a 2-D x with unit column stride."""
    rows, n_cols = x.shape
    y = torch.empty((rows, n_cols), dtype=rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode), device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, rstd.fill_(float("inf"))
    if uses_triton(x):
        module, _ = rms_norm_variant(x, casting_mode)
        module.forward(x, weight, y, rstd, eps, offset)
    else:  # CPU without the interpreter: plain PyTorch (only reached when the op is called directly)
        y.copy_(rms_norm_torch(x, weight, eps, offset, casting_mode))
        rstd.copy_(torch.rsqrt(x.float().pow(2).mean(-1) + eps))
    return y, rstd


@torch.library.custom_op("liger_gen::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y (rows, n_cols) and rstd (rows,) fp32 for a 2-D x with unit column stride."""
    return _rms_norm_fwd_impl(x, weight, eps, offset, casting_mode)


@rms_norm_fwd.register_fake
def _(x, weight, eps, offset, casting_mode):
    rows, n_cols = x.shape
    y = x.new_empty((rows, n_cols), dtype=rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode))
    return y, x.new_empty((rows,), dtype=torch.float32)


def _rms_norm_bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
                       casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (rows, n_cols) in x's dtype and dW (n_cols,) in weight's dtype."""
    rows, n_cols = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dw = torch.empty_like(weight)
    if uses_triton(x):
        module, num_sms = rms_norm_variant(x, casting_mode)
        dw_partial = torch.empty((module.num_bwd_programs(rows, num_sms), n_cols), dtype=torch.float32,
                                 device=x.device)
        module.backward(dy, x, weight, rstd, dx, dw, dw_partial, offset, num_sms)
    else:  # the kernel's formulas in PyTorch (only reached when the op is called directly on the CPU)
        normed = x.float() * rstd[:, None]
        g = dy.float() * (weight.float() + offset)
        dx.copy_((g - normed * (g * normed).mean(-1, keepdim=True)) * rstd[:, None])
        normed_w = normed if casting_mode == "gemma" else normed.to(x.dtype).float()
        dw.copy_((dy.float() * normed_w).sum(0))
    return dx, dw


@torch.library.custom_op("liger_gen::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
                 casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (rows, n_cols) in x's dtype and dW (n_cols,) in weight's dtype."""
    return _rms_norm_bwd_impl(dy, x, weight, rstd, offset, casting_mode)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset, casting_mode):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps, offset, casting_mode = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.casting_mode = casting_mode


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.liger_gen.rms_norm_bwd(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
    return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


class _RMSNormFunction(torch.autograd.Function):
    """Eager-mode binding of the same kernels: an autograd.Function costs far less host time per call than
    the custom-op dispatcher (measured on this project's CPU machine with the launches stubbed out: ~35 µs
    against ~150 µs per forward+backward), and eager training is host-bound for small and medium models."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode):
        y, rstd = _rms_norm_fwd_impl(x, weight, eps, offset, casting_mode)
        # inference-mode tensors cannot be saved for backward (e.g. x made under inference_mode, weight trained)
        ctx.save_for_backward(*(t.clone() if t.is_inference() else t for t in (x, weight)), rstd)
        ctx.offset = offset
        ctx.casting_mode = casting_mode
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():
            # the kernels have no second derivative; a graph built through them would silently miss a term
            raise RuntimeError("liger_gen rms_norm: double backward (create_graph=True) is not supported; use "
                               "liger_gen.reference.rms_norm_torch where second derivatives are needed")
        dx, dw = _rms_norm_bwd_impl(dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None


def rms_norm_2d(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str) -> torch.Tensor:
    """RMSNorm of a 2-D x with unit column stride, differentiable: the custom op while torch.compile traces
    (no graph break), the autograd.Function in eager mode. Both launch the same kernels."""
    if torch.compiler.is_compiling():
        return torch.ops.liger_gen.rms_norm_fwd(x, weight, eps, offset, casting_mode)[0]
    return _RMSNormFunction.apply(x, weight, eps, offset, casting_mode)
