"""The activations of the GLU family and their references: ``act(gate) · up`` in plain PyTorch (each as
transformers writes it) and in float64, shared by the GLU ops (``glu``), the experts (``moe``) and
``liger_gen.reference``; imports none of the family's ops.

    act = silu (SwiGLU) | gelu, gelu_tanh (GeGLU)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # the template's spellings
GELU_APPROXIMATIONS = ("none", "tanh")
# the activations a GLU kernel computes, by the name ``GLUMLP`` takes
GLU_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")

# ------------------------------------------------------------------------------------------------ references


def act_torch(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate)`` in plain PyTorch (in gate's dtype; float64 for the float64 forms) for an activation of
    ``ACTIVATIONS``; ValueError names an unknown one."""
    if activation == "silu":
        return F.silu(gate)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")


def glu_torch(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` in plain PyTorch, exactly as transformers' MLPs write it (differentiable by autograd).

    activation: "silu" (SwiGLU), "gelu" (GeGLU, erf) or "gelu_tanh" (GeGLU, tanh approximation).
    """
    return act_torch(gate, activation) * up


def glu_gate_up_torch(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)``, as Phi-3's MLP splits its projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return glu_torch(gate, up, activation)


def glu_float64(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Exact ``act(gate) · up`` in float64 (no intermediate rounding); differentiable by autograd."""
    return act_torch(gate.double(), activation) * up.double()


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in plain PyTorch: transformers' ``LlamaMLP`` activation, bit for bit."""
    return glu_torch(gate, up, "silu")


def swiglu_float64(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Exact ``silu(gate) · up`` in float64."""
    return glu_float64(gate, up, "silu")


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
