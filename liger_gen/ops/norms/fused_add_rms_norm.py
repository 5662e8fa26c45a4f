"""Residual add fused into RMSNorm: references, search space, tuning problem, custom ops and the public op.

The pre-norm decoder block (transformers' ``hidden_states = residual + hidden_states`` followed by the next
RMSNorm) in one pass over each row:

    s_ij    = x_ij + r_ij                          (rounded to s's dtype, as PyTorch's add)
    rstd_i  = 1 / sqrt(mean_j(s_ij²) + eps)        (always fp32)
    y_ij    = s_ij · rstd_i · (offset + w_j)

Backward: both x and r receive dsum = (gradient of y through the norm) + (upstream gradient of s), written
as two buffers (one per input, each in its input's dtype): a single buffer returned for both inputs can end up
as two aliasing ``.grad`` tensors, which the next backward's in-place accumulation corrupts.
Kernels: ``templates/fused_add_rms_norm.py.jinja``. Structure follows ``liger_gen/ops/norms/rms_norm.py``; the
RMSNorm references, space and checks come from ``row_norm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from liger_gen.codegen.problems import (FP32_OUT_TOL, REL_TOL, STAT_BYTES, Inputs, Problem, float64_grads, randn,
                                        reference_by_autograd, rel_l2)
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.norms.row_norm import (RMSNormKernelProblem, RowNormConfig, RowNormSpace, check_casting_mode,
                                          check_floating, check_row_input, check_row_params, check_row_width,
                                          rms_norm_float64, rms_norm_out_dtype, rms_norm_torch)
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import (check_float_arg, check_kernel_dtypes, check_same_device, describe,
                                   kernel_module, uses_triton)

OP = "fused_add_rms_norm"

# ------------------------------------------------------------------------------------------------ references


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             offset: float, casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in plain PyTorch, differentiable by autograd.

    Exactly transformers' decoder: ``hidden = residual + hidden`` (PyTorch's add: dtype promotion, one rounding),
    then ``rms_norm_torch`` of the sum with the given casting mode.
    """
    s = x + residual
    return rms_norm_torch(s, weight, eps, offset, casting_mode), s


def fused_add_rms_norm_float64(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (y, s) in float64 (no intermediate rounding).

    ``s = x + residual``; ``y = s / sqrt(mean(s²) + eps) · (offset + w)``.
    """
    s64 = x.double() + residual.double()
    rstd = torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
    return s64 * rstd * (offset + weight.double()), s64


# ------------------------------------------------------------------------------------------------ search space


@dataclass(frozen=True)
class FusedAddRMSNormConfig(RowNormConfig):
    """Launch settings of one fused add + RMSNorm variant (``templates/fused_add_rms_norm.py.jinja``): the row
    norms' fields (``RowNormConfig``), same meanings. BWD_PREFETCH=1 prefetches the next tile's dy, s and rstd
    (not ds, which feeds no reduction). No H200 measurement of this op is recorded here yet.
    """


class FusedAddRMSNormSpace(RowNormSpace):
    """Search space, constraints and heuristic of fused add + RMSNorm for one row width (dims ``{"n_cols": N}``).

    RMSNorm's params, heuristic and constraints (the kernels have the same structure), counting the extra
    streams: the forward streams two row-sized inputs (x, r) instead of one, the backward three (dy, ds, s)
    instead of two.
    """

    op = OP
    template = OP
    config_cls = FusedAddRMSNormConfig
    STREAMS = {"fwd": 2, "bwd": 3}
    # fp32 values per thread and streamed tile before the compiler spills: RMSNorm's budgets, kept as totals
    # (unmeasured for this op; the tuner's timing judges). Forward: x and r die into s as soon as they are added,
    # so the live set is RMSNorm's, 128. Backward: RMSNorm's 64 for each of two tiles (128 in all) shared by
    # three (dy, s and, at the end of a tile, ds) → 42; BWD_PREFETCH halves it (RowNormSpace.shape_violations).
    MAX_ELEMS_PER_THREAD_BWD = RowNormSpace.MAX_ELEMS_PER_THREAD_BWD * RowNormSpace.STREAMS["bwd"] // STREAMS["bwd"]
    # one row per single pass: with 1024 threads the backward holds 32 of each of its 3 tiles' values per thread
    # (65536 would need 64 > 42)
    MAX_N_COLS = 32768


# ------------------------------------------------------------------------------------------------ tuning


class FusedAddRMSNormProblem(RMSNormKernelProblem):
    """Fused add + RMSNorm at (rows, n_cols) in ``dtype`` on ``device``: inputs, float64 truth, checks, launchers.

    The backward is tuned with the sum's upstream gradient present (the residual stream continues in every
    decoder layer but the last).
    """

    SPACE = FusedAddRMSNormSpace
    OUTPUTS = ("y", "s")
    # fwd: x, r, w in; y, s, rstd out.  bwd: dy, ds, s, w, rstd in; dx, dr, dw out.
    BYTES_FORMULA = "9·R·H·s + 3·H·s + 2·R·4"

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        r, h = dims["rows"], dims["n_cols"]
        return Inputs({"x": randn(gen, (r, h), dtype, device), "residual": randn(gen, (r, h), dtype, device),
                       "w": randn(gen, (h,), dtype, device, 0.1, 1.0)},
                      grad_of=("x", "residual", "w"),
                      upstream={"y": randn(gen, (r, h), dtype, device), "s": randn(gen, (r, h), dtype, device)},
                      options={"eps": options.get("eps", 1e-6)})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        return reference_by_autograd(
            inputs, lambda t, o: fused_add_rms_norm_float64(t["x"], t["residual"], t["w"], o["eps"]), cls.OUTPUTS)

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        mn, m, n = dims["rows"] * dims["n_cols"], dims["rows"], dims["n_cols"]
        return {"fwd": 4 * mn * s + n * s + m * STAT_BYTES, "bwd": 5 * mn * s + 2 * n * s + m * STAT_BYTES}

    def build(self, inputs: Inputs) -> None:
        dtype, eps, m, n = self.dtype, self.eps, self.rows, self.dims["n_cols"]
        x, r, w = inputs.tensors["x"], inputs.tensors["residual"], inputs.tensors["w"]
        dy, ds = inputs.upstream["y"], inputs.upstream["s"]
        out_dtype = rms_norm_out_dtype(dtype, dtype, self.casting_mode)
        s_in = x + r  # the backward's input: the sum as PyTorch rounds it
        self.buffers = {
            "x": x, "r": r, "w": w, "dy": dy, "ds": ds, "s_in": s_in,
            "rstd_in": torch.rsqrt(s_in.float().pow(2).mean(-1) + eps),
            "y": torch.empty((m, n), dtype=out_dtype, device=self.device),
            "s": torch.empty((m, n), dtype=dtype, device=self.device),
            "rstd": torch.empty(m, dtype=torch.float32, device=self.device),
            "dx": torch.empty((m, n), dtype=dtype, device=self.device),
            "dr": torch.empty((m, n), dtype=dtype, device=self.device),
            "dw": torch.empty(n, dtype=dtype, device=self.device),
            "dw_partial": torch.empty((m, n), dtype=torch.float32, device=self.device),
        }
        # float64 truth: the forward from the exact sum (``reference``); the backward from the rounded sum the
        # kernel is given, as the gradient reaching that sum (through the norm, plus ds)
        ref = self.reference(Inputs(inputs.tensors, (), inputs.upstream, inputs.options))
        _, (dsum64, dw64) = float64_grads(lambda s, w: (rms_norm_float64(s, w, eps), s), (s_in, w), (0, 1), (dy, ds))
        self.ref = {"y": ref["y"], "s": ref["s"], "rstd": torch.rsqrt(ref["s"].pow(2).mean(-1) + eps),
                    "dx": dsum64, "dr": dsum64, "dw": dw64}
        tol = REL_TOL[dtype]
        # rstd against the exact sum: the rounding of s moves it by ~ the dtype's roundoff, hence the dtype's
        # tolerance here; ``check`` also holds rstd to FP32_OUT_TOL against the kernel's own rounded s
        self.tol = {"y": tol, "s": tol, "rstd": tol, "dx": tol, "dr": tol, "dw": tol}
        self.outputs = {"fwd": ("y", "s", "rstd"), "bwd": ("dx", "dr", "dw")}

    def check(self, module, phase: str) -> str | None:
        """The base check, plus: the forward's rstd equals 1/sqrt(mean(s²) + eps) of the s it wrote (fp32 tol)."""
        error = super().check(module, phase)
        if error is None and phase == "fwd":
            s64 = self.buffers["s"].double()
            err = rel_l2(self.buffers["rstd"], torch.rsqrt(s64.pow(2).mean(-1) + self.eps))
            if not err <= FP32_OUT_TOL:
                return f"rstd: relative L2 error {err:.3g} > {FP32_OUT_TOL:.1g} against the kernel's own s"
        return error

    def launcher(self, module, phase: str):
        b = self.buffers
        if phase == "fwd":
            return lambda: module.forward(b["x"], b["r"], b["w"], b["y"], b["s"], b["rstd"], self.eps, 0.0)
        if phase == "bwd":
            return lambda: module.backward(b["dy"], b["ds"], b["s_in"], b["w"], b["rstd_in"], b["dx"], b["dr"],
                                           b["dw"], b["dw_partial"], 0.0, self.limits.num_sms)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The model's residual adds before each decoder norm: one problem per token count at ``hidden_size``."""
    return [FusedAddRMSNormProblem(dtype, FusedAddRMSNormProblem.shape(model), r, device, seed=seed,
                                   **FusedAddRMSNormProblem.options(model)) for r in rows]


SPEC = OpSpec(OP, FusedAddRMSNormSpace, FusedAddRMSNormProblem, tuning_problems,
              custom_ops=("liger_gen::fused_add_rms_norm_fwd", "liger_gen::fused_add_rms_norm_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
              casting_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, s (rows, n_cols) and rstd (rows,) fp32 for 2-D x and residual of one shape with unit column stride."""
    rows, n_cols = x.shape
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = torch.empty((rows, n_cols), dtype=s_dtype, device=x.device)
    y = torch.empty((rows, n_cols), dtype=rms_norm_out_dtype(s_dtype, weight.dtype, casting_mode), device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, s, rstd.fill_(float("inf"))
    if uses_triton(x):
        module, _, _ = kernel_module(FusedAddRMSNormSpace, s, n_cols, rows, casting_mode=casting_mode)
        module.forward(x, residual, weight, y, s, rstd, eps, offset)
    else:  # CPU without the interpreter: plain PyTorch (only reached when the op is called directly)
        torch.add(x, residual, out=s)
        y.copy_(rms_norm_torch(s, weight, eps, offset, casting_mode))
        rstd.copy_(torch.rsqrt(s.float().pow(2).mean(-1) + eps))
    return y, s, rstd


def _bwd_impl(dy: torch.Tensor, ds: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor, offset: float, casting_mode: str, x_dtype: torch.dtype,
              residual_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dresidual (rows, n_cols; each in its input's dtype; equal values: the gradient reaching s) and dW
    (n_cols,) in weight's dtype. ``ds`` is the sum's upstream gradient, or None when the sum was not used."""
    rows, n_cols = s.shape
    dx = torch.empty((rows, n_cols), dtype=x_dtype, device=s.device)
    dr = torch.empty((rows, n_cols), dtype=residual_dtype, device=s.device)
    if s.numel() == 0:
        return dx, dr, torch.zeros_like(weight)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if ds is not None and ds.stride(-1) != 1:
        ds = ds.contiguous()
    dw = torch.empty_like(weight)
    if uses_triton(s):
        module, _, limits = kernel_module(FusedAddRMSNormSpace, s, n_cols, rows, casting_mode=casting_mode)
        dw_partial = torch.empty((module.num_bwd_programs(rows, limits.num_sms), n_cols), dtype=torch.float32,
                                 device=s.device)
        module.backward(dy, ds, s, weight, rstd, dx, dr, dw, dw_partial, offset, limits.num_sms)
    else:  # the kernel's formulas in PyTorch (only reached when the op is called directly on the CPU)
        normed = s.float() * rstd[:, None]
        g = dy.float() * (weight.float() + offset)
        dsum = (g - normed * (g * normed).mean(-1, keepdim=True)) * rstd[:, None]
        if ds is not None:
            dsum = dsum + ds.float()
        dx.copy_(dsum)
        dr.copy_(dsum)
        normed_w = normed if casting_mode == "gemma" else normed.to(s.dtype).float()
        dw.copy_((dy.float() * normed_w).sum(0))
    return dx, dr, dw


def _fwd_fake(x, residual, weight, eps, offset, casting_mode):
    rows, n_cols = x.shape
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    y = x.new_empty((rows, n_cols), dtype=rms_norm_out_dtype(s_dtype, weight.dtype, casting_mode))
    return y, x.new_empty((rows, n_cols), dtype=s_dtype), x.new_empty((rows,), dtype=torch.float32)


def _bwd_fake(dy, ds, s, weight, rstd, offset, casting_mode, x_dtype, residual_dtype):
    return (s.new_empty(s.shape, dtype=x_dtype), s.new_empty(s.shape, dtype=residual_dtype),
            torch.empty_like(weight))


fused_add_rms_norm_fwd = Kernel("fused_add_rms_norm_fwd", _fwd_impl, _fwd_fake)
fused_add_rms_norm_bwd = Kernel("fused_add_rms_norm_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    x, residual, weight, _eps, offset, casting_mode = inputs
    _, s, rstd = output
    saved(ctx, s, weight, rstd)
    ctx.offset, ctx.casting_mode = offset, casting_mode
    ctx.dtypes = (x.dtype, residual.dtype)


def _sum_only_grads(ds: torch.Tensor | None, x_dtype: torch.dtype,
                    residual_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dresidual) when only the sum was used: its gradient passes straight through, a distinct buffer per
    input (see the module docstring); weight gets no gradient, as in PyTorch."""
    if ds is None:
        return None, None
    return ds.to(x_dtype), ds.to(residual_dtype, copy=True)


def _backward(ctx, dy, ds, _drstd):
    # gradients are not materialised: an unused sum costs nothing (the kernel skips the ds stream) and an unused
    # y skips the kernel
    s, weight, rstd = ctx.saved_tensors
    x_dtype, residual_dtype = ctx.dtypes
    if dy is None:
        return _sum_only_grads(ds, x_dtype, residual_dtype) + (None, None, None, None)
    dx, dr, dw = fused_add_rms_norm_bwd.run(ctx, dy, ds, s, weight, rstd, ctx.offset, ctx.casting_mode,
                                            x_dtype, residual_dtype)
    return dx, dr, (dw if ctx.needs_input_grad[2] else None), None, None, None


fused_add_rms_norm_2d = Differentiable(fused_add_rms_norm_fwd, _save, _backward,
                                       reference="liger_gen.reference.fused_add_rms_norm_torch", outputs=2)
"""(y, s, rstd) for 2-D x and residual of one shape with unit column stride, differentiable in x, residual and
weight."""


# ------------------------------------------------------------------------------------------------ eager plan


class _Plan(plans.Plan):
    """One validated call shape of ``fused_add_rms_norm`` on the Triton path (contiguous x and residual, weight
    with unit stride): the kernel module, the output layout and the launches of ``_fwd_impl`` and ``_bwd_impl``
    with the same arguments, recorded (``liger_gen.runtime.plans``). The plan takes x and residual in their own
    shape (the launches view them as rows), so the outputs need no view nodes."""

    __slots__ = ("shape", "rows", "n_cols", "x_dtype", "r_dtype", "s_dtype", "out_dtype", "device", "eps",
                 "offset", "casting_mode", "module", "num_sms", "n_programs")
    BACKWARD = fused_add_rms_norm_bwd
    GRAD_INPUTS = (0, 1, 2)

    def __init__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                 casting_mode: str):
        super().__init__(x.device, (eps, offset, casting_mode))
        self.shape, self.n_cols = x.shape, x.shape[-1]
        self.rows = math.prod(x.shape[:-1])
        self.x_dtype, self.r_dtype, self.device = x.dtype, residual.dtype, x.device
        self.s_dtype = torch.promote_types(x.dtype, residual.dtype)
        self.out_dtype = rms_norm_out_dtype(self.s_dtype, weight.dtype, casting_mode)
        self.eps, self.offset, self.casting_mode = eps, offset, casting_mode
        like_s = x if x.dtype == self.s_dtype else residual if residual.dtype == self.s_dtype \
            else torch.empty(0, dtype=self.s_dtype, device=x.device)
        self.module, _, limits = kernel_module(FusedAddRMSNormSpace, like_s, self.n_cols, self.rows,
                                               casting_mode=casting_mode)
        self.num_sms = limits.num_sms
        self.n_programs = self.module.num_bwd_programs(self.rows, limits.num_sms)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.rows, self.n_cols)

    def inputs(self, x, residual, weight, eps, offset, casting_mode):
        return x, residual, weight

    def needs_grad(self, inputs) -> bool:
        return inputs[0].requires_grad or inputs[1].requires_grad or inputs[2].requires_grad

    def forward(self, x, residual, weight):
        y = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        s = torch.empty(self.shape, dtype=self.s_dtype, device=self.device)
        rstd = torch.empty((self.rows,), dtype=torch.float32, device=self.device)
        self.fwd((x, residual, weight, y, s, rstd), self._launch_fwd, x, residual, weight, y, s, rstd)
        return y, s, rstd

    def _launch_fwd(self, x, residual, weight, y, s, rstd):
        self.module.forward(self._rows(x), self._rows(residual), weight, self._rows(y), self._rows(s), rstd,
                            self.eps, self.offset)

    def backward(self, dy, ds, s, weight, rstd, offset, casting_mode, x_dtype, residual_dtype):
        key = (dy.shape, dy.stride(), dy.dtype) + ((None,) if ds is None else (ds.shape, ds.stride(), ds.dtype))
        launches = self.launches_for(key)
        dx = torch.empty(self.shape, dtype=self.x_dtype, device=self.device)
        dr = torch.empty(self.shape, dtype=self.r_dtype, device=self.device)
        dw = torch.empty_like(weight)
        dw_partial = torch.empty((self.n_programs, self.n_cols), dtype=torch.float32, device=self.device)
        launches((dy, ds, s, weight, rstd, dx, dr, dw, dw_partial), self._launch_bwd, dy, ds, s, weight, rstd, dx,
                 dr, dw, dw_partial)
        return dx, dr, dw

    def _launch_bwd(self, dy, ds, s, weight, rstd, dx, dr, dw, dw_partial):
        dy2 = dy.reshape(self.rows, self.n_cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        ds2 = None if ds is None else ds.reshape(self.rows, self.n_cols)
        if ds2 is not None and ds2.stride(-1) != 1:
            ds2 = ds2.contiguous()
        self.module.backward(dy2, ds2, self._rows(s), weight, rstd, self._rows(dx), self._rows(dr), dw, dw_partial,
                             self.offset, self.num_sms)


def _key(x, residual, weight, eps, offset, casting_mode):
    if type(eps) not in plans.NUMBERS or type(offset) not in plans.NUMBERS or type(casting_mode) is not str \
            or eps != eps:
        return None
    return plans.meta(x), plans.meta(residual), plans.meta(weight), eps, offset, casting_mode


def _checked(x, residual, weight, eps, offset, casting_mode):
    """``fused_add_rms_norm``'s checks: (eps, offset) as floats, and whether the kernels take the call (else the
    plain-PyTorch path)."""
    op = OP
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    eps, offset = check_float_arg(op, "eps", eps), check_float_arg(op, "offset", offset)
    check_casting_mode(op, casting_mode)
    check_row_input(op, x)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)} (no broadcasting); "
                         f"got {describe('residual', residual)} and {describe('x', x)}")
    check_row_params(op, x, weight=weight)
    check_same_device(op, x=x, residual=residual, weight=weight)
    check_floating(op, x=x, residual=residual, weight=weight)
    if not uses_triton(x):
        return eps, offset, False
    check_kernel_dtypes(op, x=x, residual=residual, weight=weight)
    check_row_width(op, FusedAddRMSNormSpace, x)
    return eps, offset, True


def _prepare(x, residual, weight, eps, offset, casting_mode) -> _Plan | None:
    eps, offset, kernel = _checked(x, residual, weight, eps, offset, casting_mode)
    if kernel and x.numel() and x.is_contiguous() and residual.is_contiguous() and weight.stride(-1) == 1:
        return _Plan(x, residual, weight, eps, offset, casting_mode)
    return None  # the full path (the plain-PyTorch path, nothing to launch, or copies first)


def _full(x, residual, weight, eps, offset, casting_mode):
    eps, offset, kernel = _checked(x, residual, weight, eps, offset, casting_mode)
    if not kernel:
        return fused_add_rms_norm_torch(x, residual, weight, eps, offset, casting_mode)
    hidden = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    x2d, r2d = x.reshape(rows, hidden), residual.reshape(rows, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if r2d.stride(-1) != 1:
        r2d = r2d.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    y, s = fused_add_rms_norm_2d(x2d, r2d, weight, eps, offset, casting_mode)[:2]
    return y.view(x.shape), s.view(x.shape)


fused_add_rms_norm_planned = PlannedOp(fused_add_rms_norm_2d, key=_key, prepare=_prepare, full=_full)
"""``fused_add_rms_norm`` through per-call-shape plans (``liger_gen.runtime.binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       offset: float = 0.0, casting_mode: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm in one pass: the pre-norm decoder's ``hidden = residual + hidden; norm(hidden)``.

    ``s = x + residual`` (PyTorch's add: computed in fp32, rounded once to s's dtype), then RMSNorm of s
    (Zhang & Sennrich, 2019): ``y = s / sqrt(mean(s², dim=-1) + eps) · (offset + weight)``, statistics in fp32,
    exactly as ``liger_gen.ops.norms.rms_norm.rms_norm(s, ...)``.

    Args:
        x: (..., hidden) float32, bfloat16 or float16 (e.g. the attention or MLP output); any strides.
        residual: the residual stream, same shape as x; any strides. Its dtype may differ from x's: like
            PyTorch's ``x + residual``, s then has the promoted dtype (``torch.promote_types``), e.g. a bf16 x
            with an fp32 residual gives an fp32 s, and each input's gradient comes back in its own dtype.
        weight: (hidden,) floating, on x's device.
        eps: added to the mean square before the reciprocal square root.
        offset: added to weight (Gemma stores w − 1 and uses offset=1.0).
        casting_mode: "llama", "gemma" or "none", as in ``rms_norm`` with s in place of x: "llama" — s·rstd in
            fp32, rounded to s's dtype, times weight, output in the promoted dtype of s and weight; "gemma" —
            everything in fp32, output in s's dtype; "none" — rstd in fp32, the products in s's dtype.

    Returns:
        (y, s): y = RMSNorm(s) of x's shape (dtype as above) and the sum s of x's shape, to be carried as the
        next residual. Both are differentiable; x and residual both receive the gradient reaching s (through
        the norm plus s's own upstream gradient, which may be absent), weight receives dW.

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run plain PyTorch, or the same
    Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 is accepted on the plain-PyTorch
    path only. Values are not checked (no NaN/Inf scan: that would need a host sync).

    Raises:
        TypeError: x, residual or weight is not a tensor or has a non-floating dtype, float64 on the kernel path,
            or eps / offset is not a number.
        ValueError: residual's shape differs from x's (no broadcasting), weight is not (hidden,), the tensors are
            on different devices, hidden exceeds the kernel's limit (32768), or casting_mode is unknown.
    """
    return fused_add_rms_norm_planned(x, residual, weight, eps, offset, casting_mode)
