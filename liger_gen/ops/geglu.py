"""GeGLU (Shazeer, 2020, "GLU Variants Improve Transformer"): ``gelu(gate) · up``, as transformers' ``GemmaMLP``
computes it with ``hidden_act="gelu_pytorch_tanh"``.

Everything but the activation is SwiGLU's (``liger_gen.ops.swiglu``): the same template family
(``templates/glu.py.jinja`` with ``activation="gelu"`` or ``"gelu_tanh"``), space, problem and kernels; GeGLU only
has its own op name, so its tuned tables (``tuned/<gpu>/geglu.json``) and custom ops are separate.
"""

from __future__ import annotations

import torch

from liger_gen.ops.swiglu import (GELU_APPROXIMATIONS, GLUProblem, GLUSpace, _bwd_impl, _fake_like, _fwd_impl,
                                  _gate_up_bwd_impl, _gate_up_fwd_impl, _GLUFunction, _GLUGateUpFunction, as_rows,
                                  check_gate_up_input, check_glu_inputs, glu_float64, glu_gate_up_torch, glu_torch)
from liger_gen.runtime.ops import use_custom_op

# ------------------------------------------------------------------------------------------------ references


def gelu_activation(op: str, approximate: str) -> str:
    """The template's activation for PyTorch's ``approximate``; ValueError names the bad value."""
    if approximate == "tanh":
        return "gelu_tanh"
    if approximate == "none":
        return "gelu"
    raise ValueError(f"{op}: approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def geglu_torch(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in plain PyTorch: GemmaMLP's activation, bit for bit."""
    return glu_torch(gate, up, gelu_activation("geglu", approximate))


def geglu_float64(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """Exact ``gelu(gate) · up`` in float64 (the tanh approximation when ``approximate="tanh"``)."""
    return glu_float64(gate, up, gelu_activation("geglu", approximate))


# ------------------------------------------------------------------------------------------------ space, tuning


class GeGLUSpace(GLUSpace):
    """GeGLU's search space: SwiGLU's params, constraints and heuristic under GeGLU's op name."""

    op = "geglu"


SPACE = GeGLUSpace


class GeGLUProblem(GLUProblem):
    """GeGLU at (rows, n_cols): ``activation`` "gelu_tanh" (default, Gemma) or "gelu"."""

    op = "geglu"
    SPACE = GeGLUSpace
    ACTIVATION_CHOICES = ("gelu_tanh", "gelu")


PROBLEM = GeGLUProblem


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list:
    """GeGLU at ``intermediate_size`` per token count, tanh approximation (Gemma's). Entries of one
    approximation serve the other too (tables prefer the same variant, then any variant of the same dims): the
    kernels differ only in a few flops per element of a memory-bound stream."""
    return [GeGLUProblem(dtype, model.intermediate_size, r, device, seed=seed) for r in rows]


# ------------------------------------------------------------------------------------------------ binding


@torch.library.custom_op("liger_gen::geglu_fwd", mutates_args=())
def geglu_fwd(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(gate) · up for 2-D gate, up (rows, n_cols) with unit column stride."""
    return _fwd_impl(gate, up, gelu_activation("geglu", approximate))


@geglu_fwd.register_fake
def _(gate, up, approximate):
    return _fake_like(gate)


@torch.library.custom_op("liger_gen::geglu_bwd", mutates_args=())
def geglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of gelu(gate) · up, recomputing gelu from gate."""
    return _bwd_impl(dy, gate, up, gelu_activation("geglu", approximate))


@geglu_bwd.register_fake
def _(dy, gate, up, approximate):
    return _fake_like(gate), _fake_like(up)


@torch.library.custom_op("liger_gen::geglu_gate_up_fwd", mutates_args=())
def geglu_gate_up_fwd(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(gate) · up for a 2-D packed gate_up (rows, 2·n_cols) with unit column stride."""
    return _gate_up_fwd_impl(gate_up, gelu_activation("geglu_gate_up", approximate))


@geglu_gate_up_fwd.register_fake
def _(gate_up, approximate):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("liger_gen::geglu_gate_up_bwd", mutates_args=())
def geglu_gate_up_bwd(dy: torch.Tensor, gate_up: torch.Tensor, approximate: str) -> torch.Tensor:
    """The gradient of the packed gate_up, one (rows, 2·n_cols) tensor."""
    return _gate_up_bwd_impl(dy, gate_up, gelu_activation("geglu_gate_up", approximate))


@geglu_gate_up_bwd.register_fake
def _(dy, gate_up, approximate):
    return _fake_like(gate_up)


def _save_gate_up(ctx, inputs, output):
    gate, up, approximate = inputs
    ctx.save_for_backward(gate, up)  # never the activation: the backward recomputes it
    ctx.approximate = approximate


def _save_packed(ctx, inputs, output):
    gate_up, approximate = inputs
    ctx.save_for_backward(gate_up)
    ctx.approximate = approximate


def _geglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.liger_gen.geglu_bwd(dy, gate, up, ctx.approximate)
    return dgate, dup, None


def _geglu_gate_up_backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.liger_gen.geglu_gate_up_bwd(dy, gate_up, ctx.approximate), None


geglu_fwd.register_autograd(_geglu_backward, setup_context=_save_gate_up)
geglu_gate_up_fwd.register_autograd(_geglu_gate_up_backward, setup_context=_save_packed)


def geglu_2d(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(gate) · up of 2-D tensors with unit column stride, differentiable: the custom op while torch.compile
    traces, the autograd.Function in eager mode. Both launch the same kernels."""
    if use_custom_op():
        return torch.ops.liger_gen.geglu_fwd(gate, up, approximate)
    return _GLUFunction.apply(gate, up, gelu_activation("geglu", approximate))


def geglu_gate_up_2d(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(gate) · up of a 2-D packed gate_up with unit column stride, differentiable (see ``geglu_2d``)."""
    if use_custom_op():
        return torch.ops.liger_gen.geglu_gate_up_fwd(gate_up, approximate)
    return _GLUGateUpFunction.apply(gate_up, gelu_activation("geglu_gate_up", approximate))


# ------------------------------------------------------------------------------------------------ public ops


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
    op = "geglu"
    gelu_activation(op, approximate)
    if not check_glu_inputs(op, gate, up):
        return geglu_torch(gate, up, approximate)
    n_cols = gate.shape[-1]
    return geglu_2d(as_rows(gate, n_cols), as_rows(up, n_cols), approximate).view(gate.shape)


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
    op = "geglu_gate_up"
    activation = gelu_activation(op, approximate)
    if not check_gate_up_input(op, gate_up):
        return glu_gate_up_torch(gate_up, activation)
    width = gate_up.shape[-1]
    return geglu_gate_up_2d(as_rows(gate_up, width), approximate).view(*gate_up.shape[:-1], width // 2)
