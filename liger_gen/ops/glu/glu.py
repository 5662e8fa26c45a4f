"""Gated linear units (Shazeer, 2020, "GLU Variants Improve Transformer"): SwiGLU and GeGLU — search space,
tuning problems, custom ops, the public ops and the ``SwiGLUMLP`` module (``GLUMLP``, the MLP around existing
projections that ``apply_to`` installs, is in ``liger_gen.ops.glu.mlp``).

    y = act(gate) · up          act = silu (SwiGLU) | gelu, gelu_tanh (GeGLU); elementwise over (..., n_cols)

The value transformers' ``LlamaMLP`` / ``GemmaMLP`` compute as ``act_fn(gate_proj(x)) * up_proj(x)``; the
``*_gate_up`` variants take Phi-3's packed ``gate_up`` (last dim 2·n_cols, gate first) and return its gradient as
one tensor. Kernels: ``templates/glu.py.jinja`` (the activation is a render-time variant). SwiGLU and GeGLU
share the space, the problem, the kernels and the custom ops (``liger_gen::glu_*``, which take the activation);
each has its own op name, so its own spec and tuned table (``tuned/<gpu>/swiglu.json``, ``geglu.json``).

Rounding (as PyTorch eager on half-precision tensors): the activation is computed in fp32 and rounded to the
input dtype, the product is computed in fp32 and rounded again; the backward rounds dy·up to the input dtype
before multiplying by act'(gate), as autograd's mul backward does. float32 inputs see no intermediate rounding.
The references (plain PyTorch and float64) are the family's, in ``activations``.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from liger_gen.codegen.problems import REL_TOL, Inputs, Problem, chunk_rows, float64_grads, randn
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.glu.activations import (GLUPlan, act_torch, gelu_activation, glu_float64,
                                           glu_gate_up_torch, glu_torch)
from liger_gen.ops.glu.glu_space import GLUConfig, GLUSpace, MLPActivationProblem
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import check_kernel_dtypes, check_same_device, describe, kernel_module, uses_triton

# ------------------------------------------------------------------------------------------------ tuning


class GLUProblem(MLPActivationProblem):
    """SwiGLU at (rows, n_cols) in ``dtype`` on ``device``: inputs, float64 truth, checks and launchers.

    The truth is computed in float64 row chunk by row chunk (bounded temporaries); a problem keeps it as float32:
    that rounding (2^-24 relative) is far below every tolerance, and halves the memory of the 65536-row problems.
    """

    SPACE = GLUSpace
    ACTIVATION_CHOICES: tuple[str, ...] = ("silu",)
    # fwd: gate, up in; y out.  bwd: dy, gate, up in; dgate, dup out.
    BYTES_FORMULA = "8·R·I·s"
    LAUNCH_ARGS = {"fwd": ("gate", "up", "y"), "bwd": ("dy", "gate", "up", "dgate", "dup")}

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        shape = (dims["rows"], dims["n_cols"])
        return Inputs({"gate": randn(gen, shape, dtype, device, 2.0), "up": randn(gen, shape, dtype, device)},
                      grad_of=("gate", "up"), upstream={"y": randn(gen, shape, dtype, device)},
                      options={"activation": options.get("activation", cls.ACTIVATION_CHOICES[0])})

    @classmethod
    def reference(cls, inputs: Inputs, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
        """y, dgate and dup in ``dtype`` (float64 unless a caller stores them smaller), from float64 autograd of
        ``glu_float64`` over row chunks."""
        gate, up, dy = inputs.tensors["gate"], inputs.tensors["up"], inputs.upstream["y"]
        ref = {name: torch.empty(gate.shape, dtype=dtype, device=gate.device) for name in ("y", "dgate", "dup")}
        act = inputs.options["activation"]
        step = chunk_rows(gate.shape[-1], cls.REF_CHUNK_ELEMENTS)
        for start in range(0, gate.shape[0], step):
            rows = slice(start, start + step)
            (y,), (dg, du) = float64_grads(lambda g, u: glu_float64(g, u, act), (gate[rows], up[rows]), (0, 1),
                                           (dy[rows],))
            ref["y"][rows], ref["dgate"][rows], ref["dup"][rows] = y, dg, du
        return ref

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        mn_bytes = dims["rows"] * dims["n_cols"] * s
        return {"fwd": 3 * mn_bytes, "bwd": 5 * mn_bytes}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, activation: str | None = None,
                 seed: int = 0, limits=None):
        activation = activation or self.ACTIVATION_CHOICES[0]
        if activation not in self.ACTIVATION_CHOICES:
            raise ValueError(f"{self.op}: activation must be one of {self.ACTIVATION_CHOICES}, got {activation!r}")
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits, variant={"activation": activation})
        self.activation = activation
        m, n = self.rows, self.dims["n_cols"]
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator,
                                  {"activation": activation})
        self.buffers = {
            **inputs.tensors, "dy": inputs.upstream["y"],
            "y": torch.empty((m, n), dtype=dtype, device=self.device),
            "dgate": torch.empty((m, n), dtype=dtype, device=self.device),
            "dup": torch.empty((m, n), dtype=dtype, device=self.device),
        }
        self.ref = self.reference(inputs, torch.float32)
        tol = REL_TOL[dtype]
        self.tol = {"y": tol, "dgate": tol, "dup": tol}
        self.outputs = {"fwd": ("y",), "bwd": ("dgate", "dup")}


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The model's MLP activation: one problem per token count at ``intermediate_size``."""
    return [GLUProblem(dtype, model.intermediate_size, r, device, seed=seed) for r in rows]


class GeGLUSpace(GLUSpace):
    """GeGLU's search space: SwiGLU's params, constraints and heuristic under GeGLU's op name (its table)."""

    op = "geglu"


class GeGLUProblem(GLUProblem):
    """GeGLU at (rows, n_cols): ``activation`` "gelu_tanh" (default, Gemma) or "gelu"."""

    SPACE = GeGLUSpace
    ACTIVATION_CHOICES = ("gelu_tanh", "gelu")


def geglu_tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """GeGLU at ``intermediate_size`` per token count, tanh approximation (Gemma's). Entries of one
    approximation serve the other too (tables prefer the same variant, then any variant of the same dims): the
    kernels differ only in a few flops per element of a memory-bound stream."""
    return [GeGLUProblem(dtype, model.intermediate_size, r, device, seed=seed) for r in rows]


_CUSTOM_OPS = ("liger_gen::glu_fwd", "liger_gen::glu_bwd", "liger_gen::glu_gate_up_fwd", "liger_gen::glu_gate_up_bwd")
SPECS = {spec.name: spec for spec in (
    OpSpec("swiglu", GLUSpace, GLUProblem, tuning_problems, custom_ops=_CUSTOM_OPS),
    OpSpec("geglu", GeGLUSpace, GeGLUProblem, geglu_tuning_problems, custom_ops=_CUSTOM_OPS),
)}
#: the space's names where callers have always imported them from (``glu_space`` holds them)
SPACE_NAMES = (GLUConfig, GLUSpace)
# the space (and so the table) of each activation
_SPACE_OF = {"silu": GLUSpace, "gelu": GeGLUSpace, "gelu_tanh": GeGLUSpace}


# ------------------------------------------------------------------------------------------------ kernels


def glu_fwd_into(gate: torch.Tensor, up: torch.Tensor, y: torch.Tensor, activation: str) -> None:
    """y = act(gate) · up for 2-D gate, up, y with unit column stride (any row strides, views allowed)."""
    rows, n_cols = gate.shape
    if gate.numel() == 0:
        return
    if uses_triton(gate):
        module, _, _ = kernel_module(_SPACE_OF[activation], gate, n_cols, rows, activation=activation)
        module.forward(gate, up, y)
    else:  # CPU without the interpreter: plain PyTorch (only reached when the custom op is called directly)
        y.copy_(glu_torch(gate, up, activation))


def glu_bwd_into(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor, dup: torch.Tensor,
                  activation: str) -> None:
    """dgate, dup of y = act(gate) · up, written into the given (rows, n_cols) outputs (views allowed)."""
    rows, n_cols = gate.shape
    if gate.numel() == 0:
        return
    if dy.stride(-1) != 1:  # e.g. the expanded gradient of y.sum()
        dy = dy.contiguous()
    if uses_triton(gate):
        module, _, _ = kernel_module(_SPACE_OF[activation], gate, n_cols, rows, activation=activation)
        module.backward(dy, gate, up, dgate, dup)
    else:  # the backward formulas autograd runs for act(gate) * up, which is what the kernel reproduces
        # both results before either store: dgate and dup may be gate and up themselves (_GLUOverwrite); the
        # halves of a packed gate_up are strided views, on which PyTorch's CPU gelu_backward takes a scalar path
        # whose erf rounds differently in bf16 from the vectorised one autograd runs on a whole tensor
        gate, up = gate.contiguous(), up.contiguous()
        d_up = dy * act_torch(gate, activation)
        da = dy * up
        if activation == "silu":
            d_gate = torch.ops.aten.silu_backward(da, gate)
        else:
            approximate = "tanh" if activation == "gelu_tanh" else "none"
            d_gate = torch.ops.aten.gelu_backward(da, gate, approximate=approximate)
        dup.copy_(d_up)
        dgate.copy_(d_gate)


def _fwd_impl(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    glu_fwd_into(gate, up, y, activation)
    return y


def _bwd_impl(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    glu_bwd_into(dy, gate, up, dgate, dup, activation)
    return dgate, dup


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a (rows, 2·n_cols) tensor as views (no copy)."""
    n_cols = gate_up.shape[-1] // 2
    return gate_up[:, :n_cols], gate_up[:, n_cols:]


def _gate_up_fwd_impl(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = split_gate_up(gate_up)
    return _fwd_impl(gate, up, activation)


def _gate_up_bwd_impl(dy: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradient of the packed input as one (rows, 2·n_cols) tensor: the kernel writes both halves in place."""
    d_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    gate, up = split_gate_up(gate_up)
    dgate, dup = split_gate_up(d_gate_up)
    glu_bwd_into(dy, gate, up, dgate, dup, activation)
    return d_gate_up


# ------------------------------------------------------------------------------------------------ binding
# One set of custom ops for every activation (a render-time variant of the template), bound once each.


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape)


glu_fwd = Kernel("glu_fwd", _fwd_impl, lambda gate, up, activation: _fake_like(gate))
glu_bwd = Kernel("glu_bwd", _bwd_impl, lambda dy, gate, up, activation: (_fake_like(gate), _fake_like(up)))
glu_gate_up_fwd = Kernel("glu_gate_up_fwd", _gate_up_fwd_impl,
                         lambda gate_up, activation: gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2)))
glu_gate_up_bwd = Kernel("glu_gate_up_bwd", _gate_up_bwd_impl, lambda dy, gate_up, activation: _fake_like(gate_up))


def _save(ctx, inputs, output):
    *tensors, activation = inputs  # (gate, up) or (gate_up,): never the activation, which the backward recomputes
    saved(ctx, *tensors)
    ctx.activation = activation


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = glu_bwd.run(ctx, dy, gate, up, ctx.activation)
    return dgate, dup, None


def _gate_up_backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return glu_gate_up_bwd.run(ctx, dy, gate_up, ctx.activation), None


glu_2d = Differentiable(glu_fwd, _save, _backward, reference="liger_gen.reference.glu_torch")
"""act(gate) · up of 2-D gate, up with unit column stride, differentiable in both."""
glu_gate_up_2d = Differentiable(glu_gate_up_fwd, _save, _gate_up_backward,
                                reference="liger_gen.reference.glu_gate_up_torch")
"""act(gate) · up of a 2-D packed gate_up with unit column stride, differentiable in it."""


# ------------------------------------------------------------------------------------------------ input checks


def _check_dtype(op: str, name: str, t: torch.Tensor, kernel: bool) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
    if kernel:
        check_kernel_dtypes(op, **{name: t})


def check_glu_inputs(op: str, gate, up) -> bool:
    """Validate (gate, up) of a GLU op; returns whether the Triton kernels take them (else plain PyTorch).

    TypeError: not tensors, non-floating or different dtypes, float64 on the kernel path. ValueError: 0-dim,
    different shapes, different devices.
    """
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError(f"{op}: gate and up must be tensors, got {type(gate).__name__} and {type(up).__name__}")
    if gate.dim() < 1:
        raise ValueError(f"{op}: gate must have at least one dim (..., intermediate); got {describe('gate', gate)}")
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate and up must have the same shape (no broadcasting); got "
                         f"{describe('gate', gate)} and {describe('up', up)}")
    check_same_device(op, gate=gate, up=up)
    kernel = uses_triton(gate)
    _check_dtype(op, "gate", gate, kernel)
    _check_dtype(op, "up", up, kernel)
    if gate.dtype != up.dtype:
        raise TypeError(f"{op}: gate and up must have the same dtype; got {describe('gate', gate)} and "
                        f"{describe('up', up)}")
    return kernel


def check_gate_up_input(op: str, gate_up) -> bool:
    """Validate a packed gate_up (..., 2·intermediate); returns whether the Triton kernels take it."""
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"{op}: gate_up must be a tensor, got {type(gate_up).__name__}")
    if gate_up.dim() < 1:
        raise ValueError(f"{op}: gate_up must have at least one dim (..., 2·intermediate); got "
                         f"{describe('gate_up', gate_up)}")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{op}: gate_up's last dim must be even (gate and up halves of 2·intermediate); got "
                         f"{describe('gate_up', gate_up)}")
    kernel = uses_triton(gate_up)
    _check_dtype(op, "gate_up", gate_up, kernel)
    return kernel


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t as (rows, n_cols) with unit column stride: a view when the strides allow it (e.g. a column slice of a
    bigger tensor), a copy otherwise (e.g. a transposed view)."""
    t2d = t.reshape(math.prod(t.shape[:-1]), n_cols)
    return t2d if t2d.stride(-1) == 1 or n_cols <= 1 else t2d.contiguous()


# ------------------------------------------------------------------------------------------------ eager plans


class _Plan(GLUPlan):
    """``GLUPlan`` of ``swiglu``/``geglu``: the activation is the plan's tail (rendered into its kernels)."""

    __slots__ = ()
    BACKWARD = glu_bwd
    GRAD_INPUTS = (0, 1)

    def __init__(self, gate: torch.Tensor, activation: str, shape: torch.Size, out_shape: tuple):
        rows, n_cols = gate.shape
        module = kernel_module(_SPACE_OF[activation], gate, n_cols, rows, activation=activation)[0]
        super().__init__(gate, module, (activation,), (), shape, out_shape)


class _GateUpPlan(_Plan):
    """``_Plan`` of the ``*_gate_up`` forms: gate and up are the halves of one gate_up, whose gradient is one
    tensor."""

    __slots__ = ()
    BACKWARD = glu_gate_up_bwd
    GRAD_INPUTS = (0,)
    PACKED = True

    def halves(self, tensors) -> tuple[torch.Tensor, torch.Tensor]:
        return split_gate_up(tensors[0].view(self.rows, 2 * self.n_cols))


def _op_name(activation: str, packed: bool) -> str:
    return ("swiglu" if activation == "silu" else "geglu") + ("_gate_up" if packed else "")


def _unit_view(t: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``rows`` (``as_rows`` of t) is a view of t with unit column stride (no copy was made)."""
    return rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and rows.stride(-1) == 1


def _glu_key(gate, up, activation):
    return plans.meta(gate), plans.meta(up), activation


def _glu_prepare(gate, up, activation) -> _Plan | None:
    if not check_glu_inputs(_op_name(activation, False), gate, up) or not gate.numel():
        return None  # the full path (the plain-PyTorch path, or nothing to launch)
    gate2, up2 = as_rows(gate, gate.shape[-1]), as_rows(up, gate.shape[-1])
    return _Plan(gate2, activation, gate.shape, gate.shape) if _unit_view(gate, gate2) and _unit_view(up, up2) \
        else None


def _glu_full(gate, up, activation):
    if not check_glu_inputs(_op_name(activation, False), gate, up):
        return glu_torch(gate, up, activation)
    n_cols = gate.shape[-1]
    return glu_2d(as_rows(gate, n_cols), as_rows(up, n_cols), activation).view(gate.shape)


def _gate_up_key(gate_up, activation):
    return plans.meta(gate_up), activation


def _gate_up_prepare(gate_up, activation) -> _GateUpPlan | None:
    if not check_gate_up_input(_op_name(activation, True), gate_up) or not gate_up.numel():
        return None  # the full path (the plain-PyTorch path, or nothing to launch)
    packed = as_rows(gate_up, gate_up.shape[-1])
    return _GateUpPlan(split_gate_up(packed)[0], activation, gate_up.shape,
                       (*gate_up.shape[:-1], gate_up.shape[-1] // 2)) if _unit_view(gate_up, packed) else None


def _gate_up_full(gate_up, activation):
    if not check_gate_up_input(_op_name(activation, True), gate_up):
        return glu_gate_up_torch(gate_up, activation)
    width = gate_up.shape[-1]
    return glu_gate_up_2d(as_rows(gate_up, width), activation).view(*gate_up.shape[:-1], width // 2)


glu_planned = PlannedOp(glu_2d, key=_glu_key, prepare=_glu_prepare, full=_glu_full)
"""``swiglu``/``geglu`` (gate, up, activation) through per-call-shape plans (``binding.PlannedOp``)."""
glu_gate_up_planned = PlannedOp(glu_gate_up_2d, key=_gate_up_key, prepare=_gate_up_prepare, full=_gate_up_full)
"""``swiglu_gate_up``/``geglu_gate_up`` (gate_up, activation) through per-call-shape plans."""


# ------------------------------------------------------------------------------------------------ public ops


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer, 2020): ``silu(gate) * up``, elementwise — transformers' ``LlamaMLP`` computes
    ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn = silu``; this is that product, one kernel.

    ``silu(g) = g / (1 + exp(-g))``. Numerics as PyTorch eager: silu in fp32, rounded to the input dtype, times
    up in fp32, rounded again; the backward matches autograd of that expression (dy·up rounded to the input
    dtype before silu's derivative). It saves only gate and up and recomputes silu from gate.

    Args:
        gate: (..., intermediate) float32, bfloat16 or float16; any leading dims, any strides (non-contiguous
            views such as column slices of a bigger tensor are read in place; transposed ones are copied).
        up: the same shape, dtype and device as gate.

    Returns:
        y of gate's shape and dtype, contiguous. Differentiable in gate and up.

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run plain PyTorch (bit-identical
    to transformers), or the same Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 is
    accepted on the plain-PyTorch path only.

    Raises:
        TypeError: gate or up is not a tensor, is not floating point, their dtypes differ, or float64 on the
            kernel path.
        ValueError: gate is 0-dim, the shapes differ (no broadcasting), or the tensors are on different devices.

    Not checked: NaN/inf values (they propagate as in PyTorch).
    """
    return glu_planned(gate, up, "silu")


def swiglu_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a packed projection: ``gate, up = gate_up.chunk(2, dim=-1); silu(gate) * up`` (Phi-3's MLP).

    The kernel reads the two halves in place and writes the gradient of gate_up as one (..., 2·intermediate)
    tensor (no split, no concatenation). Numerics as ``swiglu``.

    Args:
        gate_up: (..., 2·intermediate) float32, bfloat16 or float16, any strides; the first half of the last dim
            is gate, the second half up.

    Returns:
        y (..., intermediate) in gate_up's dtype, contiguous. Differentiable in gate_up.

    Raises:
        TypeError: gate_up is not a floating tensor, or float64 on the kernel path.
        ValueError: gate_up is 0-dim or its last dim is odd.
    """
    return glu_gate_up_planned(gate_up, "silu")



def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU (Shazeer, 2020): ``F.gelu(gate, approximate=approximate) * up``, elementwise — transformers'
    ``GemmaMLP`` computes ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn = gelu_pytorch_tanh``.

    ``gelu(g) = g/2 · (1 + erf(g/√2))`` (approximate="none") or ``g/2 · (1 + tanh(√(2/π)·(g + 0.044715·g³)))``
    (approximate="tanh", the default here because Gemma uses it; note ``F.gelu`` defaults to "none"). The kernel
    evaluates the tanh form as ``g · σ(2z)`` (the same function; no cancellation for negative g).
    Numerics as PyTorch eager: gelu in fp32, rounded to the input dtype, times up in fp32, rounded again; the
    backward matches autograd of that expression. It saves only gate and up and recomputes gelu from gate.

    Args:
        gate: (..., intermediate) float32, bfloat16 or float16; any leading dims, any strides.
        up: the same shape, dtype and device as gate.
        approximate: "tanh" or "none", as in ``torch.nn.functional.gelu``.

    Returns:
        y of gate's shape and dtype, contiguous. Differentiable in gate and up.

    CUDA tensors run the tuned Triton kernel; CPU tensors run plain PyTorch (bit-identical to transformers), or
    the Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 only on the plain path.

    Raises:
        TypeError: gate or up is not a tensor, is not floating point, their dtypes differ, or float64 on the
            kernel path.
        ValueError: approximate is not "none"/"tanh", gate is 0-dim, the shapes differ (no broadcasting), or the
            tensors are on different devices.

    Not checked: NaN/inf values (they propagate as in PyTorch).
    """
    return glu_planned(gate, up, gelu_activation("geglu", approximate))


def geglu_gate_up(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU of a packed projection: ``gate, up = gate_up.chunk(2, dim=-1); F.gelu(gate, approximate) * up``.

    The kernel reads the two halves in place and writes the gradient of gate_up as one (..., 2·intermediate)
    tensor (no split, no concatenation). Numerics as ``geglu``.

    Args:
        gate_up: (..., 2·intermediate) float32, bfloat16 or float16, any strides; first half gate, second up.
        approximate: "tanh" (default) or "none".

    Returns:
        y (..., intermediate) in gate_up's dtype, contiguous. Differentiable in gate_up.

    Raises:
        TypeError: gate_up is not a floating tensor, or float64 on the kernel path.
        ValueError: approximate is not "none"/"tanh", gate_up is 0-dim or its last dim is odd.
    """
    return glu_gate_up_planned(gate_up, gelu_activation("geglu_gate_up", approximate))


# ------------------------------------------------------------------------------------------------ module


class SwiGLUMLP(nn.Module):
    """Drop-in for transformers' ``LlamaMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the product
    in one liger_gen kernel.

    Args:
        config: a transformers config with ``hidden_size``, ``intermediate_size``, ``hidden_act`` ("silu" or
            "swish") and optionally ``mlp_bias`` (bias of the three projections; False if absent).

    Parameters ``gate_proj``, ``up_proj``, ``down_proj`` (nn.Linear) have LlamaMLP's names, shapes and state_dict
    keys. Shape: (..., hidden_size) → (..., hidden_size).

    Raises:
        ValueError: ``config.hidden_act`` is not silu/swish (the module would compute another activation).
    """

    def __init__(self, config):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"SwiGLUMLP: config.hidden_act must be 'silu' or 'swish', got {act!r}")
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def __getattr__(name: str):
    """``GLUMLP`` was defined here before it moved to ``liger_gen.ops.glu.mlp``, and a pickled model names a class
    by the module that defined it: it stays reachable here, so such pickles still load."""
    if name == "GLUMLP":
        return importlib.import_module("liger_gen.ops.glu.mlp").GLUMLP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
