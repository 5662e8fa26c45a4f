"""Clamped SwiGLU, the activation of gpt-oss's experts (OpenAI, 2025, "gpt-oss-120b & gpt-oss-20b Model Card"):
references, search space, tuning problem, custom ops and the public ops.

    g = min(gate, limit),  u = clamp(up, −limit, limit),  y = (u + 1) · g · σ(α · g)

transformers' ``GptOssExperts._apply_gate`` computes it from the interleaved projection ``gate_up`` (gate in
the even columns, up in the odd ones) with α = ``config.swiglu_alpha`` (1.702) and limit =
``config.swiglu_limit`` (7.0). ``clamped_swiglu_gate_up`` takes that layout as it is and returns its gradient
interleaved in one tensor; ``clamped_swiglu`` takes gate and up apart. Kernels:
``templates/clamped_swiglu.py.jinja``; the space and launch settings are SwiGLU's (``GLUSpace``), under this
op's name and table.

Numerics: fp32 throughout, each output rounded once (more accurate than PyTorch's bf16 eager expression, which
rounds after each op). The plain CPU path is transformers' expression itself.
"""

from __future__ import annotations

import dataclasses

import math

import torch

from liger_gen.codegen.problems import Inputs, Problem, chunk_rows, float64_grads, randn
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.glu.activations import GLUPlan
from liger_gen.ops.glu.glu import GLUProblem, as_rows, check_gate_up_input, check_glu_inputs
from liger_gen.ops.glu.glu_space import GLUConfig, GLUSpace
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import check_float_arg, kernel_module, uses_triton

_FP32_MAX = 3.4028234663852886e38
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0

# ------------------------------------------------------------------------------------------------ references


def clamped_swiglu_torch(gate: torch.Tensor, up: torch.Tensor, alpha: float = GPT_OSS_ALPHA,
                         limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = gate.clamp(max=limit)`` in plain
    PyTorch, exactly as transformers' ``GptOssExperts._apply_gate`` writes it (differentiable by autograd)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu_gate_up_torch(gate_up: torch.Tensor, alpha: float = GPT_OSS_ALPHA,
                                 limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """``clamped_swiglu_torch(gate_up[..., ::2], gate_up[..., 1::2], alpha, limit)``: GPT-OSS's interleaved
    layout."""
    return clamped_swiglu_torch(gate_up[..., ::2], gate_up[..., 1::2], alpha, limit)


def clamped_swiglu_float64(gate: torch.Tensor, up: torch.Tensor, alpha: float = GPT_OSS_ALPHA,
                           limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """Exact clamped SwiGLU in float64 (no intermediate rounding); differentiable by autograd."""
    return clamped_swiglu_torch(gate.double(), up.double(), alpha, limit)


# ------------------------------------------------------------------------------------------------ space


class ClampedSwiGLUSpace(GLUSpace):
    """SwiGLU's params and constraints for the clamped kernels (dims ``{"n_cols": intermediate}``), under this
    op's name (its table) and template; SwiGLU's heuristic with a narrower backward tile."""

    op = "clamped_swiglu"
    template = "clamped_swiglu"
    config_cls = GLUConfig
    BWD_TILE = 512  # elements per backward program of the heuristic (one row of 512 columns at most)

    def heuristic(self) -> GLUConfig:
        """SwiGLU's forward; backward tiles of ``BWD_TILE`` elements (one row deep from 512 columns up, rows
        stacked to 512 elements below; SwiGLU's backward where that needs more than 16 rows: n_cols <= 16),
        4 warps at most.

        The backward reads the interleaved gate_up with stride 2 and keeps more values live than SwiGLU's; on
        the H200 the tuned backward tiles at widths 768 to 28672 were 128 to 1024 elements (mostly 512 x 1) and
        ran 1.2-1.6x SwiGLU's 1024 x 2 rule (``benchmarks/results/h200_2026-12-02/tables``)."""
        base = super().heuristic()
        block_n = min(self.max_block_n, self.BWD_TILE)
        block_m = max(1, self.BWD_TILE // block_n)
        config = dataclasses.replace(base, BLOCK_N_BWD=block_n, BLOCK_M_BWD=block_m,
                                     num_warps_bwd=self.fit_warps(4, block_m * block_n))
        problems = self.violations(config)
        return base if problems else config


# ------------------------------------------------------------------------------------------------ tuning


class ClampedSwiGLUProblem(GLUProblem):
    """Clamped SwiGLU at (rows, n_cols) in GPT-OSS's interleaved layout: one (rows, 2·n_cols) gate_up input,
    y (rows, n_cols), and the interleaved gradient of gate_up. Gate values ~ N(0, 4²) and up ~ N(0, 4²), so
    that a share of both passes each clamp (7 = 1.75 σ)."""

    SPACE = ClampedSwiGLUSpace
    ACTIVATION_CHOICES = ("clamped_silu",)
    OUTPUTS = ("y",)
    BYTES_FORMULA = "8·R·I·s"

    @classmethod
    def options(cls, model) -> dict:
        return {"alpha": GPT_OSS_ALPHA, "limit": GPT_OSS_LIMIT}

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        rows, n = dims["rows"], dims["n_cols"]
        return Inputs({"gate_up": randn(gen, (rows, 2 * n), dtype, device, 4.0)}, grad_of=("gate_up",),
                      upstream={"y": randn(gen, (rows, n), dtype, device)},
                      options={"alpha": float(options.get("alpha", GPT_OSS_ALPHA)),
                               "limit": float(options.get("limit", GPT_OSS_LIMIT))})

    @classmethod
    def reference(cls, inputs: Inputs, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
        """y and the interleaved dgate_up in ``dtype``, from float64 autograd over row chunks."""
        gate_up, dy = inputs.tensors["gate_up"], inputs.upstream["y"]
        alpha, limit = inputs.options["alpha"], inputs.options["limit"]
        ref = {"y": torch.empty(dy.shape, dtype=dtype, device=dy.device),
               "dgate_up": torch.empty(gate_up.shape, dtype=dtype, device=dy.device)}
        step = chunk_rows(gate_up.shape[-1], cls.REF_CHUNK_ELEMENTS)
        for start in range(0, gate_up.shape[0], step):
            rows = slice(start, start + step)
            (y,), (dgu,) = float64_grads(
                lambda gu: clamped_swiglu_float64(gu[..., ::2], gu[..., 1::2], alpha, limit), (gate_up[rows],),
                (0,), (dy[rows],))
            ref["y"][rows], ref["dgate_up"][rows] = y, dgu
        return ref

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seed: int = 0, limits=None):
        Problem.__init__(self, dtype, dims, rows, device, seed=seed, limits=limits)
        m, n = self.rows, self.dims["n_cols"]
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {})
        self.alpha, self.limit = inputs.options["alpha"], inputs.options["limit"]
        gate_up = inputs.tensors["gate_up"]
        d_gate_up = torch.empty_like(gate_up)
        self.buffers = {"gate_up": gate_up, "dy": inputs.upstream["y"], "y": torch.empty((m, n), dtype=dtype,
                                                                                         device=self.device),
                        "dgate_up": d_gate_up}
        self.ref = self.reference(inputs, torch.float32)
        tol = self.tolerance()
        self.tol = {"y": tol, "dgate_up": tol}
        self.outputs = {"fwd": ("y",), "bwd": ("dgate_up",)}

    def tolerance(self) -> float:
        from liger_gen.codegen.problems import REL_TOL

        return REL_TOL[self.dtype]

    def launcher(self, module, phase: str):
        b = self.buffers
        gate, up = b["gate_up"][:, ::2], b["gate_up"][:, 1::2]
        if phase == "fwd":
            return lambda: module.forward(gate, up, b["y"], self.alpha, self.limit)
        if phase == "bwd":
            dgate, dup = b["dgate_up"][:, ::2], b["dgate_up"][:, 1::2]
            return lambda: module.backward(b["dy"], gate, up, dgate, dup, self.alpha, self.limit)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """One problem per token count at the model's ``intermediate_size`` (the experts' width)."""
    return [ClampedSwiGLUProblem(dtype, model.intermediate_size, r, device, seed=seed) for r in rows]


_CUSTOM_OPS = ("liger_gen::clamped_swiglu_fwd", "liger_gen::clamped_swiglu_bwd",
               "liger_gen::clamped_swiglu_gate_up_fwd", "liger_gen::clamped_swiglu_gate_up_bwd")
SPEC = OpSpec("clamped_swiglu", ClampedSwiGLUSpace, ClampedSwiGLUProblem, tuning_problems, custom_ops=_CUSTOM_OPS)
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ kernels


def _module(gate: torch.Tensor):
    module, _, _ = kernel_module(ClampedSwiGLUSpace, gate, gate.shape[1], gate.shape[0])
    return module


def _fwd_into(gate, up, y, alpha: float, limit: float) -> None:
    """y = clamped SwiGLU of 2-D gate and up sharing one column stride (views of gate_up allowed)."""
    if gate.numel() == 0:
        return
    if uses_triton(gate):
        _module(gate).forward(gate, up, y, alpha, limit)
    else:  # CPU without the interpreter: transformers' expression (only when the custom op is called directly)
        y.copy_(clamped_swiglu_torch(gate, up, alpha, limit))


def _bwd_into(dy, gate, up, dgate, dup, alpha: float, limit: float) -> None:
    """dgate, dup written into the given (rows, n_cols) outputs (views of one interleaved buffer allowed)."""
    if gate.numel() == 0:
        return
    if dy.stride(-1) != 1:  # e.g. the expanded gradient of y.sum()
        dy = dy.contiguous()
    if uses_triton(gate):
        _module(gate).backward(dy, gate, up, dgate, dup, alpha, limit)
        return
    with torch.enable_grad():  # the formulas autograd runs for transformers' expression
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        dg, du = torch.autograd.grad(clamped_swiglu_torch(g, u, alpha, limit), (g, u), dy)
    dgate.copy_(dg)
    dup.copy_(du)


def _fwd_impl(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _fwd_into(gate, up, y, alpha, limit)
    return y


def _bwd_impl(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float,
              limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    _bwd_into(dy, gate, up, dgate, dup, alpha, limit)
    return dgate, dup


def _gate_up_fwd_impl(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return _fwd_impl(gate_up[:, ::2], gate_up[:, 1::2], alpha, limit)


def _gate_up_bwd_impl(dy: torch.Tensor, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The interleaved gradient of gate_up as one tensor: the kernel writes both column sets in place."""
    d_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    _bwd_into(dy, gate_up[:, ::2], gate_up[:, 1::2], d_gate_up[:, ::2], d_gate_up[:, 1::2], alpha, limit)
    return d_gate_up


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape)


clamped_swiglu_fwd = Kernel("clamped_swiglu_fwd", _fwd_impl, lambda gate, up, alpha, limit: _fake_like(gate))
clamped_swiglu_bwd = Kernel("clamped_swiglu_bwd", _bwd_impl,
                            lambda dy, gate, up, alpha, limit: (_fake_like(gate), _fake_like(up)))
clamped_swiglu_gate_up_fwd = Kernel(
    "clamped_swiglu_gate_up_fwd", _gate_up_fwd_impl,
    lambda gate_up, alpha, limit: gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2)))
clamped_swiglu_gate_up_bwd = Kernel("clamped_swiglu_gate_up_bwd", _gate_up_bwd_impl,
                                    lambda dy, gate_up, alpha, limit: _fake_like(gate_up))


def _save(ctx, inputs, output):
    *tensors, alpha, limit = inputs
    saved(ctx, *tensors)
    ctx.alpha, ctx.limit = alpha, limit


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = clamped_swiglu_bwd.run(ctx, dy, gate, up, ctx.alpha, ctx.limit)
    return dgate, dup, None, None


def _gate_up_backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return clamped_swiglu_gate_up_bwd.run(ctx, dy, gate_up, ctx.alpha, ctx.limit), None, None


clamped_swiglu_2d = Differentiable(clamped_swiglu_fwd, _save, _backward,
                                   reference="liger_gen.reference.clamped_swiglu_torch")
clamped_swiglu_gate_up_2d = Differentiable(clamped_swiglu_gate_up_fwd, _save, _gate_up_backward,
                                           reference="liger_gen.reference.clamped_swiglu_gate_up_torch")


# ------------------------------------------------------------------------------------------------ input checks


def _check_float(op: str, name: str, value, positive: bool) -> float:
    value = check_float_arg(op, name, value)
    if not math.isfinite(value) or (positive and value <= 0.0) or abs(value) > _FP32_MAX:
        raise ValueError(f"{op}: {name} must be a finite number{' > 0' if positive else ''} within float32's "
                         f"range (the kernels compute in fp32), got {value}")
    return value


def _shared_column_stride(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D (rows, n) views of gate and up with one column stride; contiguous copies where they differ."""
    n = gate.shape[-1]
    g = gate.reshape(math.prod(gate.shape[:-1]), n)
    u = up.reshape(math.prod(up.shape[:-1]), n)
    if n > 1 and g.stride(1) != u.stride(1):
        g, u = g.contiguous(), u.contiguous()
    return g, u


# ------------------------------------------------------------------------------------------------ eager plans


def _checked(gate, up, alpha, limit) -> tuple[float, float, bool]:
    """``clamped_swiglu``'s checks: alpha and limit as floats, and whether the kernels take the call."""
    op = "clamped_swiglu"
    kernel = check_glu_inputs(op, gate, up)
    return _check_float(op, "alpha", alpha, True), _check_float(op, "limit", limit, True), kernel


def _gate_up_checked(gate_up, alpha, limit) -> tuple[float, float, bool]:
    """``clamped_swiglu_gate_up``'s checks: alpha and limit as floats, and whether the kernels take the call."""
    op = "clamped_swiglu_gate_up"
    kernel = check_gate_up_input(op, gate_up)
    return _check_float(op, "alpha", alpha, True), _check_float(op, "limit", limit, True), kernel


def _is_view(t: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``rows`` (a reshape of t) is a view of t (no copy was made)."""
    return rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


class _Plan(GLUPlan):
    """``GLUPlan`` of ``clamped_swiglu`` whose (rows, n) views of gate and up share one column stride (as
    ``_shared_column_stride`` leaves them without a copy); alpha and limit are its tail and its kernels' extra
    arguments."""

    __slots__ = ()
    BACKWARD = clamped_swiglu_bwd
    GRAD_INPUTS = (0, 1)

    def __init__(self, gate2d: torch.Tensor, alpha: float, limit: float, shape: torch.Size, out_shape: tuple):
        super().__init__(gate2d, _module(gate2d), (alpha, limit), (alpha, limit), shape, out_shape)


class _GateUpPlan(_Plan):
    """``_Plan`` of ``clamped_swiglu_gate_up``: gate and up are the even and odd columns of one gate_up with unit
    column stride, whose gradient is one interleaved tensor."""

    __slots__ = ()
    BACKWARD = clamped_swiglu_gate_up_bwd
    GRAD_INPUTS = (0,)
    PACKED = True

    def halves(self, tensors) -> tuple[torch.Tensor, torch.Tensor]:
        packed = tensors[0].view(self.rows, 2 * self.n_cols)
        return packed[:, ::2], packed[:, 1::2]


def _key(gate, up, alpha, limit):
    return plans.meta(gate), plans.meta(up), plans.number(alpha), plans.number(limit)


def _prepare(gate, up, alpha, limit) -> _Plan | None:
    alpha, limit, kernel = _checked(gate, up, alpha, limit)
    if not kernel or not gate.numel():
        return None  # the full path (the plain-PyTorch path, or nothing to launch)
    g, u = _shared_column_stride(gate, up)
    if not (_is_view(gate, g) and _is_view(up, u)):
        return None  # the full path (copies first)
    return _Plan(g, alpha, limit, gate.shape, gate.shape)


def _full(gate, up, alpha, limit):
    alpha, limit, kernel = _checked(gate, up, alpha, limit)
    if not kernel:
        return clamped_swiglu_torch(gate, up, alpha, limit).contiguous()
    g, u = _shared_column_stride(gate, up)
    return clamped_swiglu_2d(g, u, alpha, limit).view(gate.shape)


def _gate_up_key(gate_up, alpha, limit):
    return plans.meta(gate_up), plans.number(alpha), plans.number(limit)


def _gate_up_prepare(gate_up, alpha, limit) -> _GateUpPlan | None:
    alpha, limit, kernel = _gate_up_checked(gate_up, alpha, limit)
    if not kernel or not gate_up.numel():
        return None  # the full path (the plain-PyTorch path, or nothing to launch)
    width = gate_up.shape[-1]
    packed = as_rows(gate_up, width)
    if not _is_view(gate_up, packed) or packed.stride(-1) != 1:
        return None  # the full path (copies first)
    return _GateUpPlan(packed[:, ::2], alpha, limit, gate_up.shape, (*gate_up.shape[:-1], width // 2))


def _gate_up_full(gate_up, alpha, limit):
    alpha, limit, kernel = _gate_up_checked(gate_up, alpha, limit)
    if not kernel:
        return clamped_swiglu_gate_up_torch(gate_up, alpha, limit).contiguous()
    width = gate_up.shape[-1]
    return clamped_swiglu_gate_up_2d(as_rows(gate_up, width), alpha, limit).view(*gate_up.shape[:-1], width // 2)


clamped_swiglu_planned = PlannedOp(clamped_swiglu_2d, key=_key, prepare=_prepare, full=_full)
"""``clamped_swiglu`` (gate, up, alpha, limit) through per-call-shape plans (``binding.PlannedOp``)."""
clamped_swiglu_gate_up_planned = PlannedOp(clamped_swiglu_gate_up_2d, key=_gate_up_key, prepare=_gate_up_prepare,
                                           full=_gate_up_full)
"""``clamped_swiglu_gate_up`` (gate_up, alpha, limit) through per-call-shape plans (``binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public ops


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float = GPT_OSS_ALPHA,
                   limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """Clamped SwiGLU (gpt-oss): ``(clamp(up, -limit, limit) + 1) · g · sigmoid(alpha · g)``, ``g = min(gate,
    limit)``, elementwise — transformers' ``GptOssExperts._apply_gate`` after it splits its projection.

    Gradients follow ``torch.clamp``'s: none flows to gate above ``limit`` or to up outside [−limit, limit].
    Every intermediate is fp32 and each output is rounded once to the input dtype.

    Args:
        gate: (..., intermediate) float32, bfloat16 or float16, any strides (strided views such as
            ``gate_up[..., ::2]`` are read in place when up has the same column stride).
        up: the same shape, dtype and device as gate.
        alpha: the sigmoid's scale α > 0 (gpt-oss: 1.702, ``config.swiglu_alpha``).
        limit: the clamp bound > 0 (gpt-oss: 7.0, ``config.swiglu_limit``).

    Returns:
        y of gate's shape and dtype, contiguous. Differentiable in gate and up.

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run plain PyTorch (transformers'
    expression), or the same kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 runs on the
    plain path only.

    Raises:
        TypeError: gate or up not a floating tensor, their dtypes differ, float64 on the kernel path, alpha or
            limit not a real number.
        ValueError: gate is 0-dim, the shapes differ, the tensors are on different devices, alpha or limit not
            finite, > 0 and within float32's range.
    """
    return clamped_swiglu_planned(gate, up, alpha, limit)


def clamped_swiglu_gate_up(gate_up: torch.Tensor, alpha: float = GPT_OSS_ALPHA,
                           limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """Clamped SwiGLU of GPT-OSS's interleaved projection: ``clamped_swiglu(gate_up[..., ::2],
    gate_up[..., 1::2], alpha, limit)``, with the gradient of gate_up written interleaved as one tensor (no
    split, no scatter).

    Args:
        gate_up: (..., 2·intermediate) float32, bfloat16 or float16, any strides; gate in the even columns of
            the last dim, up in the odd ones.
        alpha, limit: as in ``clamped_swiglu``.

    Returns:
        y (..., intermediate) in gate_up's dtype, contiguous. Differentiable in gate_up.

    Raises:
        TypeError: gate_up not a floating tensor, float64 on the kernel path, alpha or limit not a real number.
        ValueError: gate_up is 0-dim or its last dim is odd; alpha or limit not finite and > 0.
    """
    return clamped_swiglu_gate_up_planned(gate_up, alpha, limit)
