"""The activations of the GLU family and their references: ``act(gate) · up`` in plain PyTorch (each as
transformers writes it) and in float64, shared by the GLU ops (``glu``), the experts (``moe``) and
``liger_gen.reference``; and ``GLUPlan``, the per-call-shape plan of the family's elementwise kernels (``glu``,
``clamped_swiglu``, ``squared_relu``). Imports none of the family's ops.

    act = silu (SwiGLU) | gelu, gelu_tanh (GeGLU)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from liger_gen.runtime import plans

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


class GLUPlan(plans.Plan):
    """One validated call shape of an elementwise GLU op on the Triton path (``glu``'s SwiGLU/GeGLU,
    ``clamped_swiglu``), whose gate and up (or packed gate_up) reshape to row views: the kernel module, the output
    layout and the launches of its ``forward(gate, up, y, *extra)`` / ``backward(dy, gate, up, dgate, dup,
    *extra)``, recorded (``liger_gen.runtime.plans``). The plan takes the tensors in their own shape (the
    launches view them as rows): no view nodes around the op.

    An op's subclass sets ``BACKWARD`` and ``GRAD_INPUTS``; a packed form sets ``PACKED`` (one gate_up in, its
    gradient one tensor out) and ``halves`` (how gate and up sit in the packed rows). ``tail`` is the op's
    trailing scalar arguments, ``extra`` what its kernels take after the tensors. A one-input op (``squared_relu``:
    ``forward(x, y)`` / ``backward(dy, x, dx)``) is a packed form whose ``halves`` is its one row view.
    """

    __slots__ = ("shape", "out_shape", "rows", "n_cols", "dtype", "device", "module", "extra")
    PACKED = False

    def __init__(self, gate2d: torch.Tensor, module, tail: tuple, extra: tuple, shape: torch.Size,
                 out_shape: tuple):
        super().__init__(gate2d.device, tail)
        self.rows, self.n_cols = gate2d.shape  # gate (or gate_up's first half) as (rows, n_cols)
        self.shape, self.out_shape = shape, out_shape
        self.dtype, self.device = gate2d.dtype, gate2d.device
        self.module, self.extra = module, extra

    def inputs(self, *args):
        return args[:len(args) - len(self.tail)]

    def halves(self, tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """gate and up (or their gradients) as (rows, n_cols) views."""
        return tensors[0].view(self.rows, self.n_cols), tensors[1].view(self.rows, self.n_cols)

    def forward(self, *tensors):
        y = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        self.fwd((*tensors, y), self._launch_fwd, tensors, y)
        return y

    def _launch_fwd(self, tensors, y):
        self.module.forward(*self.halves(tensors), y.view(self.rows, self.n_cols), *self.extra)

    def backward(self, dy, *args):
        tensors = self.inputs(*args)
        grads = tuple(torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in tensors)
        launches = self.launches_for((dy.shape, dy.stride(), dy.dtype))
        launches((dy, *tensors, *grads), self._launch_bwd, dy, tensors, grads)
        return grads[0] if self.PACKED else grads

    def _launch_bwd(self, dy, tensors, grads):
        dy = dy.reshape(self.rows, self.n_cols)
        if dy.stride(-1) != 1:  # e.g. the expanded gradient of y.sum()
            dy = dy.contiguous()
        self.module.backward(dy, *self.halves(tensors), *self.halves(grads), *self.extra)
