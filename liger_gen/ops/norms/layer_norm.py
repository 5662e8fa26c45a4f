"""LayerNorm (Ba, Kiros & Hinton, 2016): references, search space, tuning problem, custom ops and the public op.

    mean_i = mean_j(x_ij),   rstd_i = 1 / sqrt(mean_j((x_ij − mean_i)²) + eps)      (always fp32)
    y_ij   = (x_ij − mean_i) · rstd_i · w_j + b_j                                     (w, b each optional)

Same semantics as ``torch.nn.functional.layer_norm(x, (hidden,), weight, bias, eps)``. Kernels:
``templates/layer_norm.py.jinja``. Laid out like ``ops/norms/rms_norm.py``, the worked example; the space and
checks it shares with the other row norms are in ``row_norm``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from liger_gen.codegen.problems import FP32_OUT_TOL, REL_TOL, STAT_BYTES, Inputs, Problem, randn, reference_by_autograd
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.norms.row_norm import (DecoderNormProblem, RowNormConfig, RowNormSpace, check_floating,
                                          check_row_input, check_row_params, check_row_width)
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import (check_float_arg, check_kernel_dtypes, check_same_device, describe, kernel_module,
                                   uses_triton)

# ------------------------------------------------------------------------------------------------ references


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim in plain PyTorch: exactly ``F.layer_norm(x, (hidden,), weight, bias, eps)``."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm_float64(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                       eps: float = 1e-5) -> torch.Tensor:
    """Exact LayerNorm in float64 (no intermediate rounding): ``(x − mean)/sqrt(var + eps)·w + b``, biased var."""
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    xc = x64 - mean
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


@dataclass(frozen=True)
class LayerNormConfig(RowNormConfig):
    """Launch settings of one LayerNorm variant (``templates/layer_norm.py.jinja``): the row norms' fields
    (``RowNormConfig``).

    Each backward program writes one fp32 partial row of dW and one of dB, summed by a second pass in a fixed
    order (deterministic).
    """


class LayerNormSpace(RowNormSpace):
    """Search space, constraints and heuristic of LayerNorm for one row width (dims ``{"n_cols": N}``) and dtype.

    RMSNorm's params and constraints (the kernels have the same structure) and its heuristic except for the
    backward at 1025-8192 columns (``heuristic``), with two reductions per row in flight (mean and variance
    forward; the two dx coefficients backward). The per-thread register
    bounds are RMSNorm's measured ones, unmeasured here: LayerNorm's backward holds one more accumulator (dB),
    which the tuner's timing judges. One tuned entry serves all four weight/bias combinations: presence is a
    constexpr of the launch, not a render-time option, and the tuning problems measure the full affine case.
    """

    op = "layer_norm"
    template = "layer_norm"
    config_cls = LayerNormConfig
    REDUCTIONS_PER_ROW = 2
    # BLOCK_N -> (rows per backward tile: 8192 elements, warps) for rows 1025-8192 columns wide
    WIDE_BWD = {2048: (4, 8), 4096: (2, 16), 8192: (1, 8)}

    def heuristic(self):
        """RMSNorm's rule (``RowNormSpace.heuristic``), except the backward from 1025 to 8192 columns: 8K-element
        row tiles (4, 2 and 1 rows at 2048, 4096 and 8192 columns), one persistent program per SM and the next
        tile prefetched.

        LayerNorm's backward keeps two row sums and two accumulators (dW, dB) in flight, one more of each than
        RMSNorm's, and at these widths ran faster with fewer, larger programs: at 16384 x 4096 bf16 on the H200,
        0.1163 ms against 0.1592 for the shared rule, and 0.0987 against 0.1441 at 16384 x 2880
        (``benchmarks/sweeps/layer_norm_bwd.py``); the H200 tables' tuned entries at 2880-8192 columns hold the
        same shape of config. Falls back to the shared rule where the device's limits refuse it."""
        config = super().heuristic()
        if self.block_n not in self.WIDE_BWD:
            return config
        block_m, warps = self.WIDE_BWD[self.block_n]
        wide = dataclasses.replace(
            config, BLOCK_M_BWD=block_m, num_warps_bwd=self.fit_warps(warps, block_m * self.block_n),
            dw_strategy="persistent", PROGRAMS_PER_SM=1, TILES_PER_PROGRAM=1, BWD_PREFETCH=1, num_stages_bwd=1)
        return config if self.violations(wide) else wide


# ------------------------------------------------------------------------------------------------ tuning


class LayerNormProblem(DecoderNormProblem):
    """LayerNorm at (rows, n_cols) in ``dtype`` on ``device``: inputs, float64 truth, checks and launchers.

    ``has_weight`` / ``has_bias`` pick which of the kernels' constexpr branches run (both by default, as
    ``torch.nn.LayerNorm``); they are not render-time options, so they are not part of ``variant``.
    """

    SPACE = LayerNormSpace
    OUTPUTS = ("y",)
    # fwd: x, w, b in; y, mean, rstd out.  bwd: dy, x, w, mean, rstd in; dx, dw, db out.
    BYTES_FORMULA = "5·R·H·s + 5·H·s + 4·R·4"

    @classmethod
    def options(cls, model) -> dict:
        return {"eps": 1e-5}  # torch.nn.LayerNorm's default: models with LayerNorm do not share rms_norm_eps

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        """x with a nonzero mean, as activations have (the centring is part of what is checked); options
        ``has_weight`` / ``has_bias`` (default True) leave w / b out (None)."""
        r, h = dims["rows"], dims["n_cols"]
        x = randn(gen, (r, h), dtype, device, 1.0, 0.5)
        w = randn(gen, (h,), dtype, device, 0.1, 1.0) if options.get("has_weight", True) else None
        b = randn(gen, (h,), dtype, device, 0.1) if options.get("has_bias", True) else None
        grad_of = ("x",) + (("w",) if w is not None else ()) + (("b",) if b is not None else ())
        return Inputs({"x": x, "w": w, "b": b}, grad_of=grad_of, upstream={"y": randn(gen, (r, h), dtype, device)},
                      options={"eps": options.get("eps", 1e-5)})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        return reference_by_autograd(
            inputs, lambda t, o: (layer_norm_float64(t["x"], t["w"], t["b"], o["eps"]),), cls.OUTPUTS)

    @classmethod
    def phase_bytes(cls, dims, s: int, has_weight: bool = True, has_bias: bool = True) -> dict[str, int]:
        mn, m, n = dims["rows"] * dims["n_cols"], dims["rows"], dims["n_cols"]
        n_params = int(has_weight) + int(has_bias)
        return {"fwd": 2 * mn * s + n_params * n * s + 2 * m * STAT_BYTES,
                "bwd": 3 * mn * s + (int(has_weight) + n_params) * n * s + 2 * m * STAT_BYTES}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, has_weight: bool = True,
                 has_bias: bool = True, eps: float = 1e-5, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        self.has_weight, self.has_bias, self.eps = has_weight, has_bias, eps
        self.n_cols = self.dims["n_cols"]
        m, n = self.rows, self.n_cols
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator,
                                  {"eps": eps, "has_weight": has_weight, "has_bias": has_bias})
        x, w, b = inputs.tensors["x"], inputs.tensors["w"], inputs.tensors["b"]
        x64 = x.double()
        mean64 = x64.mean(-1, keepdim=True)
        rstd64 = torch.rsqrt((x64 - mean64).pow(2).mean(-1, keepdim=True) + eps)
        self.buffers = {
            "x": x, "dy": inputs.upstream["y"],
            "mean_in": mean64.squeeze(-1).float(), "rstd_in": rstd64.squeeze(-1).float(),
            "y": torch.empty((m, n), dtype=dtype, device=self.device),
            "mean": torch.empty(m, dtype=torch.float32, device=self.device),
            "rstd": torch.empty(m, dtype=torch.float32, device=self.device),
            "dx": torch.empty((m, n), dtype=dtype, device=self.device),
        }
        self.ref = {**self.reference(inputs), "mean": mean64.squeeze(-1), "rstd": rstd64.squeeze(-1)}
        tol = REL_TOL[dtype]
        self.tol = {"y": tol, "mean": FP32_OUT_TOL, "rstd": FP32_OUT_TOL, "dx": tol}
        bwd = ["dx"]
        if has_weight:
            self.buffers.update(w=w, dw=torch.empty(n, dtype=dtype, device=self.device))
            self.tol["dw"] = tol
            bwd.append("dw")
        if has_bias:
            self.buffers.update(b=b, db=torch.empty(n, dtype=dtype, device=self.device))
            self.tol["db"] = tol
            bwd.append("db")
        self.outputs = {"fwd": ("y", "mean", "rstd"), "bwd": tuple(bwd)}

    def key(self) -> str:
        affine = "+".join(name for name, on in (("weight", self.has_weight), ("bias", self.has_bias)) if on)
        return f"{super().key()}affine={affine or 'none'}"

    def launcher(self, module, phase: str):
        b = self.buffers
        w, bias = b.get("w"), b.get("b")
        if phase == "fwd":
            return lambda: module.forward(b["x"], w, bias, b["y"], b["mean"], b["rstd"], self.eps)
        if phase == "bwd":
            # scratch sized for this variant, allocated here so the timed closure only launches
            n_programs = module.num_bwd_programs(self.rows, self.limits.num_sms)
            partial = [torch.empty((n_programs, self.n_cols), dtype=torch.float32, device=self.device)
                       if on else None for on in (self.has_weight, self.has_bias)]
            return lambda: module.backward(b["dy"], b["x"], w, b["mean_in"], b["rstd_in"], b["dx"], b.get("dw"),
                                           b.get("db"), partial[0], partial[1], self.limits.num_sms)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")

    def bytes_moved(self, phase: str) -> int:
        return self.phase_bytes(self.problem_dims, self.element_size, self.has_weight, self.has_bias)[phase]


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """LayerNorm at the model's ``hidden_size``, one problem per token count, with weight and bias (the
    ``torch.nn.LayerNorm`` default). eps is PyTorch's default: it does not change the kernel's time."""
    return [LayerNormProblem(dtype, model.hidden_size, r, device, seed=seed) for r in rows]


SPEC = OpSpec("layer_norm", LayerNormSpace, LayerNormProblem, tuning_problems,
              custom_ops=("liger_gen::layer_norm_fwd", "liger_gen::layer_norm_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y (rows, n_cols) in x's dtype, mean and rstd (rows,) fp32, for a 2-D x with unit column stride."""
    rows, n_cols = x.shape
    y = torch.empty((rows, n_cols), dtype=x.dtype, device=x.device)
    mean = torch.empty((rows,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if x.numel() == 0:  # as torch.native_layer_norm: mean 0 and rstd NaN for rows of zero width
        return y, mean.zero_(), rstd.fill_(float("nan"))
    if uses_triton(x):
        module, _, _ = kernel_module(LayerNormSpace, x, n_cols, rows)
        module.forward(x, weight, bias, y, mean, rstd, eps)
    else:  # CPU without the interpreter: plain PyTorch (only reached when the op is called directly)
        var, m = torch.var_mean(x.float(), dim=-1, correction=0)
        mean.copy_(m)
        rstd.copy_(torch.rsqrt(var + eps))
        y.copy_(F.layer_norm(x, (n_cols,), weight, bias, eps))
    return y, mean, rstd


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (rows, n_cols) in x's dtype; dW, dB (n_cols,) in weight's / bias's dtype, or (0,) when absent."""
    rows, n_cols = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw = torch.empty_like(weight) if weight is not None else x.new_empty((0,))
    db = torch.empty_like(bias) if bias is not None else x.new_empty((0,))
    if x.numel() == 0:
        return dx, dw.zero_(), db.zero_()
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if uses_triton(x):
        module, _, limits = kernel_module(LayerNormSpace, x, n_cols, rows)
        n_programs = module.num_bwd_programs(rows, limits.num_sms)
        dw_partial, db_partial = (torch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device)
                                  if t is not None else None for t in (weight, bias))
        module.backward(dy, x, weight, mean, rstd, dx, dw if weight is not None else None,
                        db if bias is not None else None, dw_partial, db_partial, limits.num_sms)
    else:  # the kernel's formulas in PyTorch (only reached when the op is called directly on the CPU)
        xhat = (x.float() - mean[:, None]) * rstd[:, None]
        g = dy.float() * weight.float() if weight is not None else dy.float()
        dx.copy_((g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:, None])
        if weight is not None:
            dw.copy_((dy.float() * xhat).sum(0))
        if bias is not None:
            db.copy_(dy.float().sum(0))
    return dx, dw, db


def _fwd_fake(x, weight, bias, eps):
    rows, n_cols = x.shape
    return (x.new_empty((rows, n_cols)), x.new_empty((rows,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


def _bwd_fake(dy, x, weight, bias, mean, rstd):
    dw = torch.empty_like(weight) if weight is not None else x.new_empty((0,))
    db = torch.empty_like(bias) if bias is not None else x.new_empty((0,))
    return torch.empty_like(x, memory_format=torch.contiguous_format), dw, db


layer_norm_fwd = Kernel("layer_norm_fwd", _fwd_impl, _fwd_fake)
layer_norm_bwd = Kernel("layer_norm_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _, mean, rstd = output
    saved(ctx, x, weight, bias, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd.run(ctx, dy, x, weight, bias, mean, rstd)
    return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None,
            db if ctx.needs_input_grad[2] else None, None)


layer_norm_2d = Differentiable(layer_norm_fwd, _save, _backward, reference="torch.nn.functional.layer_norm",
                               outputs=1)
"""(y, mean, rstd) of a 2-D x with unit column stride, differentiable in x, weight and bias."""


# ------------------------------------------------------------------------------------------------ eager plan


class _Plan(plans.Plan):
    """One validated call shape of ``layer_norm`` on the Triton path (x 2-D with unit column stride or
    contiguous, weight and bias with unit stride or absent): the kernel module, the output layout and the
    launches of ``_fwd_impl`` and ``_bwd_impl`` with the same arguments, recorded (``liger_gen.runtime.plans``).
    The plan takes x in its own shape (the launches view it as rows), so the output needs no view node."""

    __slots__ = ("shape", "rows", "n_cols", "dtype", "device", "eps", "module", "num_sms", "n_programs")
    BACKWARD = layer_norm_bwd
    GRAD_INPUTS = (0, 1, 2)

    def __init__(self, x: torch.Tensor, eps: float):
        super().__init__(x.device, (eps,))
        self.shape, self.n_cols = x.shape, x.shape[-1]
        self.rows = math.prod(x.shape[:-1])
        self.dtype, self.device, self.eps = x.dtype, x.device, eps
        self.module, _, limits = kernel_module(LayerNormSpace, x, self.n_cols, self.rows)
        self.num_sms = limits.num_sms
        self.n_programs = self.module.num_bwd_programs(self.rows, limits.num_sms)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 2 else t.view(self.rows, self.n_cols)

    def inputs(self, x, weight, bias, eps):
        return x, weight, bias

    def forward(self, x, weight, bias):
        y = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        mean = torch.empty((self.rows,), dtype=torch.float32, device=self.device)
        rstd = torch.empty((self.rows,), dtype=torch.float32, device=self.device)
        self.fwd((x, weight, bias, y, mean, rstd), self._launch_fwd, x, weight, bias, y, mean, rstd)
        return y, mean, rstd

    def _launch_fwd(self, x, weight, bias, y, mean, rstd):
        self.module.forward(self._rows(x), weight, bias, self._rows(y), mean, rstd, self.eps)

    def backward(self, dy, x, weight, bias, mean, rstd):
        launches = self.launches_for((dy.shape, dy.stride(), dy.dtype))
        dx = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dw = torch.empty_like(weight) if weight is not None else x.new_empty((0,))
        db = torch.empty_like(bias) if bias is not None else x.new_empty((0,))
        dw_partial, db_partial = (torch.empty((self.n_programs, self.n_cols), dtype=torch.float32,
                                              device=self.device) if t is not None else None for t in (weight, bias))
        launches((dy, x, weight, bias, mean, rstd, dx, dw, db, dw_partial, db_partial), self._launch_bwd, dy, x,
                 weight, bias, mean, rstd, dx, dw, db, dw_partial, db_partial)
        return dx, dw, db

    def _launch_bwd(self, dy, x, weight, bias, mean, rstd, dx, dw, db, dw_partial, db_partial):
        dy2 = dy.reshape(self.rows, self.n_cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        self.module.backward(dy2, self._rows(x), weight, mean, rstd, self._rows(dx),
                             dw if weight is not None else None, db if bias is not None else None, dw_partial,
                             db_partial, self.num_sms)

    def result(self, outputs, *args):
        return outputs[0]


def _key(x, weight, bias, eps):
    if type(eps) not in plans.NUMBERS or eps != eps:
        return None
    return plans.meta(x), plans.meta_or_none(weight), plans.meta_or_none(bias), eps


def _checked(x, weight, bias, eps):
    """``layer_norm``'s checks: eps as a float, and whether the kernels take the call (else the plain-PyTorch
    path)."""
    op = "layer_norm"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor or None, got {type(t).__name__}")
    eps = check_float_arg(op, "eps", eps)
    check_row_input(op, x)
    check_row_params(op, x, weight=weight, bias=bias)
    check_same_device(op, x=x, weight=weight, bias=bias)
    check_floating(op, x=x, weight=weight, bias=bias)
    _check_param_dtypes(op, x, weight=weight, bias=bias)
    if not uses_triton(x):
        return eps, False
    check_kernel_dtypes(op, x=x, weight=weight, bias=bias)
    check_row_width(op, LayerNormSpace, x)
    return eps, True


def _prepare(x, weight, bias, eps) -> _Plan | None:
    eps, kernel = _checked(x, weight, bias, eps)
    if not kernel or not x.numel() or (not (x.dim() == 2 and x.stride(-1) == 1) and not x.is_contiguous()) \
            or any(t is not None and t.stride(-1) != 1 for t in (weight, bias)):
        return None  # the full path (the plain-PyTorch path, nothing to launch, or copies first)
    return _Plan(x, eps)


def _full(x, weight, bias, eps):
    eps, kernel = _checked(x, weight, bias, eps)
    if not kernel:
        return layer_norm_torch(x, weight, bias, eps)
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if weight is not None and weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    return layer_norm_2d(x2d, weight, bias, eps)[0].view(x.shape)


layer_norm_planned = PlannedOp(layer_norm_2d, key=_key, prepare=_prepare, full=_full)
"""``layer_norm`` through per-call-shape plans (``liger_gen.runtime.binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def _check_param_dtypes(op: str, x: torch.Tensor, **params: torch.Tensor | None) -> None:
    """PyTorch's rule: weight and bias have x's dtype, or are all float32 with a bfloat16/float16 x."""
    present = {k: v for k, v in params.items() if v is not None}
    if all(t.dtype == x.dtype for t in present.values()):
        return
    if x.dtype in (torch.bfloat16, torch.float16) and all(t.dtype == torch.float32 for t in present.values()):
        return
    raise TypeError(f"{op}: weight and bias must have x's dtype, or all be float32 when x is bfloat16 or "
                    f"float16 (as torch.nn.functional.layer_norm); got {describe('x', x)}; "
                    + "; ".join(describe(k, v) for k, v in present.items()))


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """Layer normalization over the last dim (Ba, Kiros & Hinton, 2016), as
    ``torch.nn.functional.layer_norm(x, (hidden,), weight, bias, eps)``.

    ``y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias`` with the biased variance; mean and rstd are
    computed and kept in fp32, and y is rounded once to x's dtype.

    Args:
        x: (..., hidden) float32, bfloat16 or float16; any leading dims, any strides.
        weight: (hidden,) or None (no scale), on x's device.
        bias: (hidden,) or None (no shift), on x's device.
        eps: added to the variance before the reciprocal square root.
        Weight and bias have x's dtype, or are float32 with a bfloat16/float16 x (mixed precision), as PyTorch
        allows.

    Returns:
        y of x's shape and dtype. Differentiable in x, weight and bias (the gradients have their input's dtype;
        dW and dB are reduced in fp32 in a fixed order, so they are deterministic).

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run ``F.layer_norm``, or the same
    Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 is accepted on the plain-PyTorch
    path only. Second derivatives are not supported (RuntimeError in backward with ``create_graph=True``, or
    under nested ``torch.func`` transforms); ``torch.func.grad``, ``vjp``, ``jacrev`` and ``vmap`` run the kernels,
    forward-mode transforms (``jvp``, ``jacfwd``) raise RuntimeError.
    Not checked: finiteness of the inputs (NaN/Inf propagate as in PyTorch; checking would need a host sync).

    Raises:
        TypeError: x, weight or bias is not a tensor (None allowed for weight and bias) or has a non-floating
            dtype, weight/bias dtypes break the rule above, float64 on the kernel path, or eps is not a number.
        ValueError: x has no dims, weight or bias is not (hidden,), the tensors are on different devices, or
            hidden exceeds the kernel's limit (65536).
    """
    return layer_norm_planned(x, weight, bias, eps)


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dim, running ``layer_norm``.

    A subclass of ``torch.nn.LayerNorm``: the same constructor, attributes (``normalized_shape``, ``eps``,
    ``elementwise_affine``), parameters (``weight``, ``bias``; None when absent), initialisation, state_dict
    and repr, so ``isinstance(m, torch.nn.LayerNorm)`` checks (weight-decay groups, init code) still hold.

    Args:
        normalized_shape: hidden size, as an int or a 1-tuple (only the last dim is normalised).
        eps: added to the variance.
        elementwise_affine: learn a per-element weight (ones) and, with ``bias=True``, a bias (zeros).
        bias: learn a bias (only with ``elementwise_affine=True``).
        device, dtype: of the parameters.

    Shape: input (..., hidden) → output of the same shape and dtype.

    Raises:
        ValueError: normalized_shape has more than one dim (construction), or the input's last dim is not
            normalized_shape[0] (forward).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        shape = ((normalized_shape,) if isinstance(normalized_shape, numbers.Integral)
                 else tuple(normalized_shape))
        if len(shape) != 1:
            raise ValueError(f"LayerNorm: normalized_shape must be an int or a 1-tuple (the last dim only), "
                             f"got {normalized_shape!r}")
        super().__init__(shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device,
                         dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.Tensor) and (input.dim() < 1 or input.shape[-1] != self.normalized_shape[0]):
            raise ValueError(f"LayerNorm: expected input of shape (*, {self.normalized_shape[0]}) for "
                             f"normalized_shape={self.normalized_shape}; got {describe('input', input)}")
        return layer_norm(input, self.weight, self.bias, self.eps)
