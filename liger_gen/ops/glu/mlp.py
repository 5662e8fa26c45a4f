"""``GLUMLP``: the gated MLP around existing projections that ``liger_gen.apply_to`` installs in every family it
patches, with its product in one GLU kernel; and that product's in-place backward (the gradients written over the
MLP's own gate and up activations). When its projections are ``liger_gen.nn.Float8Linear`` (``apply_to(model,
fp8=True)``), the product runs ``glu_fp8``'s kernels: they write the down projection's FP8 operands with h and the
gate and up projections' with their gradients, and the projections quantize nothing.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn
from torch.nn.modules import module as nn_module  # the global hook registries

from liger_gen.ops.glu.activations import GLU_ACTIVATIONS
from liger_gen.ops.glu.glu import (as_rows, check_gate_up_input, check_glu_inputs, geglu, geglu_gate_up,
                                   glu_bwd_into, glu_fwd_into, split_gate_up, swiglu, swiglu_gate_up)
from liger_gen.ops.glu.glu_fp8 import glu_fp8_product, overwritten_saved_tensors
from liger_gen.runtime.fp8 import E4M3, Float8Recipe, fp8_unsupported_reason
from liger_gen.runtime.fp8_operands import LAST_INPUT, eager_tensor
from liger_gen.runtime.ops import no_double_backward, transforms_active, use_custom_op


def glu_product(gate: torch.Tensor, up: torch.Tensor, activation: str, overwrite: bool = False) -> torch.Tensor:
    """``act(gate) * up`` for an activation of ``GLU_ACTIVATIONS``: swiglu or geglu. ``overwrite``: the caller owns
    gate and up (nothing else reads them after this call), so the backward may write the gradients over them
    (``_GLUOverwrite``); taken only where that is safe to check, else the usual op runs."""
    op = "swiglu" if activation == "silu" else "geglu"
    if overwrite and _owned(gate, up) and check_glu_inputs(op, gate, up) and gate.numel():
        n_cols = gate.shape[-1]
        return _GLUOverwrite.apply(as_rows(gate, n_cols), as_rows(up, n_cols), activation).view(gate.shape)
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


def glu_gate_up_product(gate_up: torch.Tensor, activation: str, overwrite: bool = False) -> torch.Tensor:
    """``act(gate) * up`` of a packed ``gate_up`` (gate first) for an activation of ``GLU_ACTIVATIONS``;
    ``overwrite`` as in ``glu_product``."""
    op = "swiglu_gate_up" if activation == "silu" else "geglu_gate_up"
    if overwrite and _owned(gate_up) and check_gate_up_input(op, gate_up) and gate_up.numel():
        width = gate_up.shape[-1]
        packed = as_rows(gate_up, width)
        gate, up = split_gate_up(packed)
        return _GLUOverwrite.apply(gate, up, activation, packed).view(*gate_up.shape[:-1], width // 2)
    if activation == "silu":
        return swiglu_gate_up(gate_up)
    return geglu_gate_up(gate_up, approximate="tanh" if activation == "gelu_tanh" else "none")


def _owned(*tensors) -> bool:
    """Whether the backward of the GLU may write its gradients over ``tensors`` (the op's own checks come after):
    eager autograd with gradients wanted (a traced graph uses the custom op, which may not mutate its inputs; a
    torch.func transform holds wrapped tensors, whose graph is not the one checked here), plain tensors that are
    not leaves (a leaf's gradient would share its data), made by an op that keeps no reference to its output for
    its own backward."""
    if use_custom_op() or not torch.is_grad_enabled() or transforms_active():
        return False
    return all(type(t) is torch.Tensor and t.grad_fn is not None and _made_by_an_op_that_keeps_no_output(t.grad_fn)
               for t in tensors)


def _hooked(modules, tensors) -> bool:
    """Whether a hook could see the gradients of ``tensors`` (the projections' outputs) before ``modules``'
    backward does: a tensor hook on them, a forward or backward hook on the modules (a forward hook can register
    tensor hooks on their output), or a global module hook."""
    if nn_module._global_forward_hooks or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        return True
    if any(getattr(t, "_backward_hooks", None) for t in tensors):
        return True
    return any(m._forward_hooks or m._backward_hooks or m._backward_pre_hooks for module in modules
               for m in module.modules())


# autograd nodes of the ops a projection ends with that do not save their own output for their backward (a
# matmul, a bias or LoRA sum, a scale, the FP8 linear layer's eager node), and the views between them and the GLU:
# their output may be overwritten after they ran. Anything else (tanh, sigmoid, exp, an unknown custom Function)
# keeps the buffered backward.
_NO_SAVED_OUTPUT = frozenset(("AddmmBackward0", "MmBackward0", "BmmBackward0", "AddBackward0", "AddBackward1",
                              "SubBackward0", "SubBackward1", "MulBackward0", "MulBackward1", "DivBackward0",
                              "DivBackward1", "LinearBackward0", "Differentiable_fp8_linearBackward"))
_VIEWS = frozenset(("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "SliceBackward0",
                    "SplitBackward0", "SplitWithSizesBackward0", "AsStridedBackward0", "TransposeBackward0",
                    "TBackward0", "UnsqueezeBackward0", "SqueezeBackward0"))


def _made_by_an_op_that_keeps_no_output(node) -> bool:
    for _ in range(8):  # a few views deep at most
        name = type(node).__name__
        if name in _NO_SAVED_OUTPUT:
            return True
        if name not in _VIEWS or not node.next_functions or node.next_functions[0][0] is None:
            return False
        node = node.next_functions[0][0]
    return False


class _GLUOverwrite(torch.autograd.Function):
    """``act(gate) · up`` (2-D views with unit column stride) whose backward writes dgate over gate and dup over up
    and returns them: no gradient buffers, so a decoder layer's MLP backward needs two (rows × intermediate)
    buffers less at its peak (Liger-Kernel's SwiGLU does the same). For callers that own gate and up
    (``GLUMLP``, which made them a line earlier). The write bumps both tensors' version counters, so an autograd
    node that saved them too, or a second backward through the same graph (``retain_graph=True``), fails with
    PyTorch's in-place error instead of reading gradients as activations. ``packed``: the (rows, 2·n) tensor
    gate and up are the halves of (its gradient is returned whole)."""

    @staticmethod
    def forward(ctx, gate, up, activation, packed=None):
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        glu_fwd_into(gate, up, y, activation)
        ctx.save_for_backward(*((packed,) if packed is not None else (gate, up)))
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        no_double_backward("glu", "liger_gen.reference.glu_torch")
        saved_tensors = overwritten_saved_tensors(ctx)
        gate, up = saved_tensors if len(saved_tensors) == 2 else split_gate_up(saved_tensors[0])
        glu_bwd_into(dy, gate, up, gate, up, ctx.activation)
        for t in saved_tensors:
            torch.autograd.graph.increment_version(t)
        if len(saved_tensors) == 1:  # the packed input's gradient, whole (gate and up are its halves)
            return None, None, None, saved_tensors[0]
        return gate, up, None, None


class GLUMLP(nn.Module):
    """A gated MLP around existing projections: ``dropout(down_proj(act(gate) * up))`` with the product in one
    liger-gen kernel, for transformers' MLP modules of every family ``liger_gen.apply_to`` patches.

    Args:
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU), see ``GLU_ACTIVATIONS``.
        down_proj: the output projection (``nn.Linear``, intermediate → hidden).
        gate_proj, up_proj: the two input projections (Llama's layout), or
        gate_up_proj: one packed projection whose output holds gate then up (Phi-3's and GLM-4's layout).
        dropout: dropout probability after down_proj in training mode (Seed-OSS's residual dropout; 0: none).
        gate_multiplier, down_multiplier: scale the gate before the activation and the output after down_proj
            (Falcon-H1's ``mlp_multipliers``: ``down_proj(up · act(gate · g)) · d``; 1: none).

    The projections are the modules given (no new parameters): the state_dict keys and the Parameter objects
    are the original MLP's. Shape: (..., hidden) → (..., hidden).

    Memory: in eager training on the kernel path the backward writes the gradients of gate and up over those two
    activations (which only this forward holds) instead of allocating two more (rows × intermediate) buffers.
    A second backward through the same graph (``retain_graph=True``) then raises RuntimeError saying so; set the
    attribute ``in_place_backward = False`` to keep the activations. Forward hooks on the projections, and
    torch.compile (which runs the custom op), switch the in-place backward off by themselves.

    FP8: when ``down_proj`` is a ``liger_gen.nn.Float8Linear`` (``apply_to(model, fp8=True)``) and the product is
    bf16, eager calls run ``glu_fp8``'s kernels, which also write the down projection's FP8 operands of h, and,
    when the gate and up projections are ``Float8Linear`` layers with e4m3 gradients whose weights train, their
    gradients' operands in the backward: those projections then quantize nothing. The values are the same.

    Raises:
        ValueError: an unknown activation; not exactly one of (gate_proj and up_proj) or gate_up_proj; dropout
            outside [0, 1]; gate_multiplier with gate_up_proj.
        TypeError: a projection that is not an nn.Module; dropout or a multiplier not a finite real number.
    """

    def __init__(self, activation: str, down_proj: nn.Module, *, gate_proj: nn.Module | None = None,
                 up_proj: nn.Module | None = None, gate_up_proj: nn.Module | None = None, dropout: float = 0.0,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0):
        super().__init__()
        if activation not in GLU_ACTIVATIONS:
            raise ValueError(f"GLUMLP: activation must be one of {GLU_ACTIVATIONS}, got {activation!r}")
        packed, separate = gate_up_proj is not None, gate_proj is not None and up_proj is not None
        if packed == separate or (packed and (gate_proj is not None or up_proj is not None)):
            raise ValueError("GLUMLP: give gate_proj and up_proj, or gate_up_proj alone")
        for name, module in (("down_proj", down_proj), ("gate_proj", gate_proj), ("up_proj", up_proj),
                             ("gate_up_proj", gate_up_proj)):
            if module is not None and not isinstance(module, nn.Module):
                raise TypeError(f"GLUMLP: {name} must be an nn.Module, got {type(module).__name__}")
        if down_proj is None:
            raise TypeError("GLUMLP: down_proj must be an nn.Module, got None")
        for name, value in (("dropout", dropout), ("gate_multiplier", gate_multiplier),
                            ("down_multiplier", down_multiplier)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"GLUMLP: {name} must be a finite real number, got {value!r}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"GLUMLP: dropout must be a probability in [0, 1], got {dropout}")
        self.activation, self.dropout = activation, float(dropout)
        self.gate_multiplier, self.down_multiplier = float(gate_multiplier), float(down_multiplier)
        if gate_up_proj is not None and self.gate_multiplier != 1.0:
            raise ValueError("GLUMLP: gate_multiplier needs separate gate_proj and up_proj")
        if gate_up_proj is not None:
            self.gate_up_proj = gate_up_proj
        else:
            self.gate_proj, self.up_proj = gate_proj, up_proj
        self.down_proj = down_proj
        self.in_place_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "gate_up_proj" in self._modules:
            gate, up = self.gate_up_proj(x), None
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if self.gate_multiplier != 1.0:
                gate = gate * self.gate_multiplier
        plan = self._fp8_plan(gate, up)
        if plan is not None:
            cols, grads = plan
            overwrite = self._may_overwrite() and _owned(*((gate,) if up is None else (gate, up)))
            h, operands = glu_fp8_product(gate, up, self.activation, cols=cols, grads=grads, overwrite=overwrite)
            LAST_INPUT.offer(h, operands)  # the down projection takes them instead of quantizing h
        elif up is None:
            h = glu_gate_up_product(gate, self.activation, overwrite=self._may_overwrite())
        else:
            h = glu_product(gate, up, self.activation, overwrite=self._may_overwrite())
        y = self.down_proj(h)
        if self.down_multiplier != 1.0:
            y = y * self.down_multiplier
        return nn.functional.dropout(y, p=self.dropout, training=self.training) if self.dropout else y

    def _fp8_plan(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> tuple[bool, bool] | None:
        """(cols, grads) when the product should write FP8 operands, else None: eager autograd (or no grad), a
        non-empty bf16 product on a device with FP8 GEMMs, and an FP8 down projection (``Float8Linear``, which has
        a ``Float8Recipe``). ``cols``: also h's columns operand, which the down projection keeps for its weight
        gradient. ``grads``: the backward also writes the gate and up projections' gradient operands, when
        those are FP8 layers whose weights take a gradient with e4m3 gradients, the gate is theirs as is (no
        ``gate_multiplier``), and no hook could change a gradient between the GLU's backward and theirs (a
        tensor hook on gate or up, a hook on those projections or a global one: an in-place write through
        ``.data`` would not be seen, and the operands would be stale)."""
        recipe = getattr(self.down_proj, "recipe", None)
        if not isinstance(recipe, Float8Recipe) or gate.dtype != torch.bfloat16 or not gate.numel() \
                or not eager_tensor(gate) or fp8_unsupported_reason(gate.device) is not None:
            return None
        grad = torch.is_grad_enabled()
        weight = getattr(self.down_proj, "weight", None)
        cols = grad and recipe.keep_fp8_for_backward and weight is not None and weight.requires_grad
        names = ("gate_up_proj",) if "gate_up_proj" in self._modules else ("gate_proj", "up_proj")
        producers = [self._modules[n] for n in names]
        grads = grad and gate.requires_grad and self.gate_multiplier == 1.0 and all(
            isinstance(getattr(m, "recipe", None), Float8Recipe) and m.recipe.grad_dtype == E4M3
            and getattr(m, "weight", None) is not None and m.weight.requires_grad for m in producers) \
            and not _hooked(producers, (gate,) if up is None else (gate, up))
        return bool(cols), bool(grads)

    def _may_overwrite(self) -> bool:
        """Whether the backward may write over the projections' outputs: ``in_place_backward`` is on and nothing but
        this forward sees them (no forward hooks on the projections, module-level or global: a hook could keep the
        tensors the backward overwrites)."""
        if not getattr(self, "in_place_backward", True) or nn_module._global_forward_hooks:
            return False  # (a GLUMLP pickled before the attribute existed has none: the default)
        names = ("gate_up_proj",) if "gate_up_proj" in self._modules else ("gate_proj", "up_proj")
        return not any(m._forward_hooks for n in names for m in self._modules[n].modules())

    def extra_repr(self) -> str:
        extra = [f"activation={self.activation!r}"] + ([f"dropout={self.dropout}"] if self.dropout else [])
        extra += [f"{n}={v}" for n, v in (("gate_multiplier", self.gate_multiplier),
                                           ("down_multiplier", self.down_multiplier)) if v != 1.0]
        return ", ".join(extra)
