"""RMSNorm (Zhang & Sennrich, 2019): references, search space, tuning problem, custom ops and the public op.

    rstd_i = 1 / sqrt(mean_j(x_ij²) + eps)          (always fp32)
    y_ij   = x_ij · rstd_i · (offset + w_j)

Kernels: ``templates/rms_norm.py.jinja``. This module is the worked example every other op module follows; the
references, the space and the checks it shares with the other row norms are in ``row_norm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import (FP32_OUT_TOL, REL_TOL, STAT_BYTES, Inputs, Problem, randn,
                                        reference_by_autograd)
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.norms.row_norm import (RMSNormKernelProblem, RowNormConfig, RowNormSpace, check_casting_mode,
                                          check_floating, check_row_input, check_row_params, check_row_width,
                                          rms_norm_float64, rms_norm_out_dtype, rms_norm_torch)
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import (check_float_arg, check_kernel_dtypes, check_same_device, kernel_module,
                                   uses_triton)

# ------------------------------------------------------------------------------------------------ search space


@dataclass(frozen=True)
class RMSNormConfig(RowNormConfig):
    """Launch settings of one RMSNorm variant (``templates/rms_norm.py.jinja``): the row norms' fields
    (``RowNormConfig``).

    Measured on an H200 (Triton 3.6, bf16, tuned table of 2026-11-29): every tuned entry with 16384 or more
    rows chose persistent + prefetch (backward 0.132 → 0.114 ms at 16384×4096), every 4096-row entry chose
    blocked without prefetch.
    """


class RMSNormSpace(RowNormSpace):
    """Search space, constraints and heuristic of RMSNorm for one row width (dims ``{"n_cols": N}``) and dtype:
    the row norms' (``RowNormSpace``), whose register budgets were measured on this op."""

    op = "rms_norm"
    template = "rms_norm"
    config_cls = RMSNormConfig


# ------------------------------------------------------------------------------------------------ tuning


class RMSNormProblem(RMSNormKernelProblem):
    """RMSNorm at (rows, n_cols) in ``dtype`` on ``device``: inputs, float64 truth, checks and launchers."""

    SPACE = RMSNormSpace
    OUTPUTS = ("y",)
    # fwd: x, w in; y, rstd out.  bwd: dy, x, w, rstd in; dx, dw out.
    BYTES_FORMULA = "5·R·H·s + 3·H·s + 2·R·4"

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        r, h = dims["rows"], dims["n_cols"]
        return Inputs({"x": randn(gen, (r, h), dtype, device), "w": randn(gen, (h,), dtype, device, 0.1, 1.0)},
                      grad_of=("x", "w"), upstream={"y": randn(gen, (r, h), dtype, device)},
                      options={"eps": options.get("eps", 1e-6)})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        return reference_by_autograd(inputs, lambda t, o: (rms_norm_float64(t["x"], t["w"], o["eps"]),), cls.OUTPUTS)

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        mn, m, n = dims["rows"] * dims["n_cols"], dims["rows"], dims["n_cols"]
        return {"fwd": 2 * mn * s + n * s + m * STAT_BYTES, "bwd": 3 * mn * s + 2 * n * s + m * STAT_BYTES}

    def build(self, inputs: Inputs) -> None:
        dtype, eps, m, n = self.dtype, self.eps, self.rows, self.dims["n_cols"]
        x, w = inputs.tensors["x"], inputs.tensors["w"]
        self.buffers = {
            "x": x, "w": w, "dy": inputs.upstream["y"],
            "rstd_in": torch.rsqrt(x.float().pow(2).mean(-1) + eps),
            "y": torch.empty((m, n), dtype=rms_norm_out_dtype(dtype, dtype, self.casting_mode), device=self.device),
            "rstd": torch.empty(m, dtype=torch.float32, device=self.device),
            "dx": torch.empty((m, n), dtype=dtype, device=self.device),
            "dw": torch.empty(n, dtype=dtype, device=self.device),
            "dw_partial": torch.empty((m, n), dtype=torch.float32, device=self.device),
        }
        self.ref = {**self.reference(inputs), "rstd": torch.rsqrt(x.double().pow(2).mean(-1) + eps)}
        tol = REL_TOL[dtype]
        self.tol = {"y": tol, "rstd": FP32_OUT_TOL, "dx": tol, "dw": tol}
        self.outputs = {"fwd": ("y", "rstd"), "bwd": ("dx", "dw")}

    def launcher(self, module, phase: str):
        b = self.buffers
        if phase == "fwd":
            return lambda: module.forward(b["x"], b["w"], b["y"], b["rstd"], self.eps, 0.0)
        if phase == "bwd":
            return lambda: module.backward(b["dy"], b["x"], b["w"], b["rstd_in"], b["dx"], b["dw"], b["dw_partial"],
                                           0.0, self.limits.num_sms)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The model's decoder norms: one problem per token count at ``hidden_size``."""
    return [RMSNormProblem(dtype, RMSNormProblem.shape(model), r, device, seed=seed, **RMSNormProblem.options(model))
            for r in rows]


SPEC = OpSpec("rms_norm", RMSNormSpace, RMSNormProblem, tuning_problems,
              custom_ops=("liger_gen::rms_norm_fwd", "liger_gen::rms_norm_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, n_cols): itself when 2-D, else a view (x is contiguous there; see ``rms_norm``)."""
    return x if x.dim() == 2 else x.view(math.prod(x.shape[:-1]), x.shape[-1])


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
              casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y of x's shape and rstd (rows,) fp32, for x 2-D with unit column stride or N-D contiguous. Rows are
    flattened here, inside the op, so autograd records no view nodes around it."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode), device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, rstd.fill_(float("inf"))
    if uses_triton(x):
        module, _, _ = kernel_module(RMSNormSpace, x, n_cols, rows, casting_mode=casting_mode)
        module.forward(x2, weight, _rows(y), rstd, eps, offset)
    else:  # CPU without the interpreter: plain PyTorch (only reached when the op is called directly)
        y.copy_(rms_norm_torch(x, weight, eps, offset, casting_mode))
        rstd.copy_(torch.rsqrt(x2.float().pow(2).mean(-1) + eps))
    return y, rstd


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
              casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """dx of x's shape (contiguous) in x's dtype and dW (n_cols,) in weight's dtype; dy has x's shape, any
    strides."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight)
    dy2 = dy.reshape(rows, n_cols)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    dw = torch.empty_like(weight)
    dx2 = _rows(dx)
    if uses_triton(x):
        module, _, limits = kernel_module(RMSNormSpace, x, n_cols, rows, casting_mode=casting_mode)
        dw_partial = torch.empty((module.num_bwd_programs(rows, limits.num_sms), n_cols), dtype=torch.float32,
                                 device=x.device)
        module.backward(dy2, x2, weight, rstd, dx2, dw, dw_partial, offset, limits.num_sms)
    else:  # the kernel's formulas in PyTorch (only reached when the op is called directly on the CPU)
        normed = x2.float() * rstd[:, None]
        g = dy2.float() * (weight.float() + offset)
        dx2.copy_((g - normed * (g * normed).mean(-1, keepdim=True)) * rstd[:, None])
        normed_w = normed if casting_mode == "gemma" else normed.to(x.dtype).float()
        dw.copy_((dy2.float() * normed_w).sum(0))
    return dx, dw


def _fwd_fake(x, weight, eps, offset, casting_mode):
    y = x.new_empty(x.shape, dtype=rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode))
    return y, x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32)


def _bwd_fake(dy, x, weight, rstd, offset, casting_mode):
    return x.new_empty(x.shape), torch.empty_like(weight)


rms_norm_fwd = Kernel("rms_norm_fwd", _fwd_impl, _fwd_fake)
rms_norm_bwd = Kernel("rms_norm_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    x, weight, _eps, offset, casting_mode = inputs
    saved(ctx, x, weight, output[1])
    ctx.offset, ctx.casting_mode = offset, casting_mode


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd.run(ctx, dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
    return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None


rms_norm_2d = Differentiable(rms_norm_fwd, _save, _backward, reference="liger_gen.reference.rms_norm_torch",
                           outputs=1)
"""(y, rstd) of x (2-D with unit column stride, or N-D contiguous; rows are the leading dims), differentiable in x
and weight."""


# ------------------------------------------------------------------------------------------------ eager plan


class _Plan(plans.Plan):
    """One validated call shape of ``rms_norm`` on the Triton path (x 2-D with unit column stride or contiguous,
    weight with unit stride): the kernel module, the output layout and the launches of ``_fwd_impl`` and
    ``_bwd_impl`` with the same arguments, recorded (``liger_gen.runtime.plans``)."""

    __slots__ = ("shape", "rows", "n_cols", "x_dtype", "out_dtype", "device", "eps", "offset", "casting_mode",
                 "module", "num_sms", "n_programs")
    BACKWARD = rms_norm_bwd
    GRAD_INPUTS = (0, 1)

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str):
        super().__init__(x.device, (eps, offset, casting_mode))
        self.shape, self.n_cols = x.shape, x.shape[-1]
        self.rows = math.prod(x.shape[:-1])
        self.x_dtype, self.device = x.dtype, x.device
        self.out_dtype = rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode)
        self.eps, self.offset, self.casting_mode = eps, offset, casting_mode
        self.module, _, limits = kernel_module(RMSNormSpace, x, self.n_cols, self.rows, casting_mode=casting_mode)
        self.num_sms = limits.num_sms
        self.n_programs = self.module.num_bwd_programs(self.rows, limits.num_sms)

    def inputs(self, x, weight, eps, offset, casting_mode):
        return x, weight

    def needs_grad(self, inputs) -> bool:
        return inputs[0].requires_grad or inputs[1].requires_grad

    def forward(self, x, weight):
        y = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        rstd = torch.empty((self.rows,), dtype=torch.float32, device=self.device)
        self.fwd((x, weight, y, rstd), self._launch_fwd, x, weight, y, rstd)
        return y, rstd

    def _launch_fwd(self, x, weight, y, rstd):
        self.module.forward(_rows(x), weight, _rows(y), rstd, self.eps, self.offset)

    def backward(self, dy, x, weight, rstd, offset, casting_mode):
        launches = self.launches_for((dy.shape, dy.stride(), dy.dtype))
        dx = torch.empty(self.shape, dtype=self.x_dtype, device=self.device)
        dw = torch.empty((self.n_cols,), dtype=weight.dtype, device=self.device)
        dw_partial = torch.empty((self.n_programs, self.n_cols), dtype=torch.float32, device=self.device)
        launches((dy, x, weight, rstd, dx, dw, dw_partial), self._launch_bwd, dy, x, weight, rstd, dx, dw,
                 dw_partial)
        return dx, dw

    def _launch_bwd(self, dy, x, weight, rstd, dx, dw, dw_partial):
        dy2 = dy.reshape(self.rows, self.n_cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        self.module.backward(dy2, _rows(x), weight, rstd, _rows(dx), dw, dw_partial, self.offset, self.num_sms)

    def result(self, outputs, *args):
        return outputs[0]


def _key(x, weight, eps, offset, casting_mode):
    if type(eps) not in plans.NUMBERS or type(offset) not in plans.NUMBERS or type(casting_mode) is not str \
            or eps != eps or type(x) not in plans.PLAIN or type(weight) not in plans.PLAIN:
        return None
    return (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype, weight.device, eps,
            offset, casting_mode)


def _checked(x, weight, eps, offset, casting_mode):
    """``rms_norm``'s checks: (x, weight, eps, offset) as the kernels take them, and whether they do (else the
    plain-PyTorch path)."""
    op = "rms_norm"
    if not isinstance(x, torch.Tensor) or not (weight is None or isinstance(weight, torch.Tensor)):
        raise TypeError(f"{op}: x must be a tensor and weight a tensor or None, got {type(x).__name__} and "
                        f"{type(weight).__name__}")
    eps, offset = check_float_arg(op, "eps", eps), check_float_arg(op, "offset", offset)
    check_casting_mode(op, casting_mode)
    hidden = check_row_input(op, x)
    if weight is None:
        if offset != 0.0:
            raise ValueError(f"{op}: offset={offset} needs a weight (it is added to the weight); got weight=None")
        weight = x.new_ones(hidden)  # no scale: a product with 1 rounds to the normalised value itself
    check_row_params(op, x, weight=weight)
    check_same_device(op, x=x, weight=weight)
    check_floating(op, x=x, weight=weight)
    if not uses_triton(x):
        return x, weight, eps, offset, False
    check_kernel_dtypes(op, x=x, weight=weight)
    check_row_width(op, RMSNormSpace, x)
    return x, weight, eps, offset, True


def _prepare(x, weight, eps, offset, casting_mode) -> _Plan | None:
    x, weight, eps, offset, kernel = _checked(x, weight, eps, offset, casting_mode)
    if not kernel or not x.numel() or weight.stride(-1) != 1 or \
            (not (x.dim() == 2 and x.stride(-1) == 1) and not x.is_contiguous()):
        return None  # the full path (the plain-PyTorch path, nothing to launch, or a copy first)
    return _Plan(x, weight, eps, offset, casting_mode)


def _full(x, weight, eps, offset, casting_mode):
    x, weight, eps, offset, kernel = _checked(x, weight, eps, offset, casting_mode)
    if not kernel:
        return rms_norm_torch(x, weight, eps, offset, casting_mode)
    if not (x.dim() == 2 and x.stride(-1) == 1) and not x.is_contiguous():
        x = x.contiguous()  # the op flattens rows with a view: 2-D with unit column stride, or contiguous
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return rms_norm_2d(x, weight, eps, offset, casting_mode)[0]


rms_norm_planned = PlannedOp(rms_norm_2d, key=_key, prepare=_prepare, full=_full)
"""``rms_norm`` through per-call-shape plans (``liger_gen.runtime.binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0,
             casting_mode: str = "llama") -> torch.Tensor:
    """Root-mean-square layer norm over the last dim (Zhang & Sennrich, 2019).

    ``y = x / sqrt(mean(x², dim=-1) + eps) · (offset + weight)``, with the statistics always in fp32; without a
    weight (``torch.nn.RMSNorm(elementwise_affine=False)``) ``y = x / sqrt(mean(x²) + eps)``.

    Args:
        x: (..., hidden) float32, bfloat16 or float16; any leading dims, any strides.
        weight: (hidden,) floating, on x's device; or None (no elementwise scale: the output has x's dtype, and
            the kernels run with a weight of ones, whose gradient is not kept).
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
            limit (65536), casting_mode is unknown, or a nonzero offset without a weight.
    """
    return rms_norm_planned(x, weight, eps, offset, casting_mode)
