"""Module swaps: norms, gated MLPs and squared-ReLU MLPs replaced by liger-gen modules holding the same
Parameters, MoE experts given liger-gen forwards or gates, and the replication rule that keeps an installed
forward bound to its own module under ``nn.DataParallel``."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from liger_gen.integrations.transformers.families import ModelFamily
from liger_gen.nn import GLUMLP, LayerNorm, RMSNorm, SquaredReLUMLP

# ------------------------------------------------------------------------------------------------ norms


class OffsetLayerNorm(LayerNorm):
    """liger-gen's LayerNorm with the weight stored as w − 1: ``layer_norm(x, 1 + weight, bias)`` (Nemotron's
    ``LayerNorm1P``; the offset is added to the (hidden,) weight, a vector next to the rows it scales)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from liger_gen.functional import layer_norm

        return layer_norm(input, None if self.weight is None else self.weight + 1.0, self.bias, self.eps)


def replace_norm(module: nn.Module, kind: str) -> nn.Module | None:
    """A liger-gen norm sharing ``module``'s Parameters, or None where the weight is not 1-D. An RMSNorm without
    a weight (Gemma 4's ``with_scale=False``) becomes one without a weight too. A torch ``nn.LayerNorm`` (a
    vision tower's, listed beside a family's RMSNorm classes) is a LayerNorm whatever the family's RMSNorm formula."""
    if isinstance(module, nn.LayerNorm) and kind in ("llama", "gemma", "fp32"):
        kind = "layer"
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    if weight is None and "weight" not in module._parameters and kind in ("llama", "fp32"):
        new = RMSNorm(1, eps=eps, casting_mode="gemma" if kind == "fp32" else "llama", elementwise_affine=False)
        new.train(module.training)
        return new
    if weight is None or weight.dim() != 1:
        return None
    if kind in ("layer", "layer1p"):
        bias = getattr(module, "bias", None)
        cls = OffsetLayerNorm if kind == "layer1p" else LayerNorm
        new = cls(weight.shape[0], eps=eps, bias=bias is not None, device="meta")
        new.weight = weight
        if bias is not None:
            new.bias = bias
    else:
        offset, casting = {"llama": (0.0, "llama"), "gemma": (1.0, "gemma"), "fp32": (0.0, "gemma")}[kind]
        new = RMSNorm(weight.shape[0], eps=eps, offset=offset, casting_mode=casting, device="meta")
        new.weight = weight
    new.train(module.training)
    return new


# ------------------------------------------------------------------------------------------------ MLPs


def activation_name(act: Any) -> str | None:
    """The ``GLU_ACTIVATIONS`` name of a transformers / torch activation module, or None for another one."""
    if act is nn.functional.silu:  # a function rather than a module (LFM2-MoE's experts)
        return "silu"
    name = type(act).__name__
    if name in ("SiLU", "SiLUActivation"):
        return "silu"
    if name in ("GELUTanh", "PytorchGELUTanh"):
        return "gelu_tanh"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if name == "GELUActivation" and getattr(act, "act", None) is nn.functional.gelu:
        return "gelu"
    return None


def _activation_of(module: nn.Module) -> str | None:
    act = module.__dict__["_modules"].get("act_fn") or module.__dict__["_modules"].get("activation_fn")
    return None if act is None else activation_name(act)


def _is_linear(module: nn.Module | None) -> bool:
    """Whether ``module`` is a projection GLUMLP can call: an ``nn.Linear``, or a module whose one child is an
    ``nn.Linear`` named ``linear`` (Gemma 4's clippable linears, which clamp its input and output: called whole,
    the clamps stay)."""
    return isinstance(module, nn.Linear) or (isinstance(getattr(module, "linear", None), nn.Linear)
                                             and list(dict(module.named_children())) == ["linear"])


def replace_mlp(module: nn.Module) -> tuple[nn.Module | None, str]:
    """(a GLUMLP, or for a non-gated squared-ReLU MLP (Nemotron's) a SquaredReLUMLP, holding ``module``'s
    projections, "") or (None, why it stays)."""
    children = dict(module.named_children())
    multipliers = {name: float(getattr(module, name)) for name in ("gate_multiplier", "down_multiplier")
                   if isinstance(getattr(module, name, None), (int, float))}
    if getattr(module, "limit", None) is not None:  # DeepSeek-V4's gate and up clamped to swiglu_limit
        return None, "gate and up clamped (swiglu_limit)"
    act = children.get("act_fn", children.get("activation_fn"))
    if type(act).__name__ == "ReLUSquaredActivation" and not {"gate_proj", "gate_up_proj"} & set(children) \
            and all(isinstance(children.get(n), nn.Linear) for n in ("up_proj", "down_proj")):
        # Nemotron: down_proj(relu2(up_proj(x))), not gated (a gated relu² has no kernel: it stays, below)
        new = SquaredReLUMLP(children["up_proj"], children["down_proj"])
        new.train(module.training)
        return new, ""
    activation = _activation_of(module)
    if activation is None:
        act = children.get("act_fn", children.get("activation_fn"))
        return None, f"activation {type(act).__name__}"
    dropout = float(getattr(module, "residual_dropout", 0.0) or 0.0)
    if isinstance(children.get("gate_up_proj"), nn.Linear) and isinstance(children.get("down_proj"), nn.Linear):
        if multipliers:
            return None, "multipliers on a packed gate_up_proj"
        new = GLUMLP(activation, children["down_proj"], gate_up_proj=children["gate_up_proj"], dropout=dropout)
    elif all(_is_linear(children.get(n)) for n in ("gate_proj", "up_proj", "down_proj")):
        new = GLUMLP(activation, children["down_proj"], gate_proj=children["gate_proj"],
                     up_proj=children["up_proj"], dropout=dropout, **multipliers)
    else:
        return None, "not a gated MLP"
    new.train(module.training)
    return new, ""


class ExpertsGate:
    """The ``_apply_gate`` of a fused experts module, computed by a liger-gen kernel: ``act(gate) * up`` of the
    packed (tokens, 2·I) projection (gate first) by the packed GLU kernel, or, for activation
    "clamped_swiglu", GPT-OSS's clamped SwiGLU of its interleaved projection with the experts' alpha and
    limit. A plain object so that a patched model pickles."""

    def __init__(self, activation: str, alpha: float | None = None, limit: float | None = None):
        self.activation, self.alpha, self.limit = activation, alpha, limit

    def __call__(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        if self.activation == "clamped_swiglu":
            from liger_gen.ops.glu.clamped_swiglu import clamped_swiglu_gate_up

            return clamped_swiglu_gate_up(gate_up_out, self.alpha, self.limit)
        from liger_gen.ops.glu.mlp import glu_gate_up_product

        return glu_gate_up_product(gate_up_out, self.activation)


class BatchedExpertsForward:
    """The ``forward`` of Llama 4's experts (tokens already grouped per expert, (E·n, H) in, (E·n, H) out): the
    same two ``bmm`` over the experts' ``gate_up_proj`` (E, H, 2·I) and ``down_proj`` (E, I, H), with the gate
    ``act(gate) * up`` of the first's output (gate and up its two halves) by liger-gen's packed GLU kernel. A
    plain object so that a patched model pickles."""

    def __init__(self, module: nn.Module, activation: str):
        self.module, self.activation = module, activation

    def rebound(self, module: nn.Module) -> "BatchedExpertsForward":
        """The same forward bound to ``module`` (a replica of the patched experts)."""
        return BatchedExpertsForward(module, self.activation)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from liger_gen.ops.glu.mlp import glu_gate_up_product

        m = self.module
        x = hidden_states.view(m.gate_up_proj.shape[0], -1, m.gate_up_proj.shape[1])
        gated = glu_gate_up_product(torch.bmm(x, m.gate_up_proj), self.activation)
        return torch.bmm(gated, m.down_proj).view(-1, m.down_proj.shape[-1])


class FusedExpertsForward:
    """The ``forward(hidden_states, top_k_index, top_k_weights)`` of a fused experts module with transformers'
    standard layout (``gate_up_proj`` (E, 2·I, H) with gate then up, ``down_proj`` (E, H, I), no bias):
    ``liger_gen.functional.moe_experts`` — deterministic permutations around the grouped GEMMs and the GLU
    kernel between them. A plain object so that a patched model pickles."""

    def __init__(self, module: nn.Module, activation: str):
        self.module, self.activation = module, activation

    def rebound(self, module: nn.Module) -> "FusedExpertsForward":
        """The same forward bound to ``module`` (a replica of the patched experts)."""
        return FusedExpertsForward(module, self.activation)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        from liger_gen.ops.glu.moe import moe_experts

        m = self.module
        if getattr(m, "_is_expert_parallel", False):  # sentinel ids of remote experts: transformers' own forward
            return type(m).forward(m, hidden_states, top_k_index, top_k_weights)
        return moe_experts(hidden_states, m.gate_up_proj, m.down_proj, top_k_index, top_k_weights, self.activation)


def is_patched_experts(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("_apply_gate"), ExpertsGate) or isinstance(
        module.__dict__.get("forward"), (BatchedExpertsForward, FusedExpertsForward))


def _fused_experts(module: nn.Module) -> FusedExpertsForward | None:
    """A ``FusedExpertsForward`` for experts in transformers' standard fused layout, else None."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    standard = (getattr(type(module), "_apply_gate", None) is _default_apply_gate
                and getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
                and not getattr(module, "is_transposed", True) and not getattr(module, "has_bias", True)
                and isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == down.dim() == 3
                and up.shape[0] == down.shape[0] and up.shape[1] == 2 * down.shape[2] and up.shape[2] == down.shape[1]
                and list(inspect.signature(type(module).forward).parameters)[1:] == ["hidden_states", "top_k_index",
                                                                                   "top_k_weights"])
    activation = activation_name(getattr(module, "act_fn", None)) if standard else None
    return None if activation is None else FusedExpertsForward(module, activation)


def experts_gate(module: nn.Module, family: ModelFamily
                  ) -> tuple[ExpertsGate | BatchedExpertsForward | FusedExpertsForward | None, str]:
    """(the liger-gen gate, or experts forward, for a fused experts module, "") or (None, why it stays)."""
    fused = _fused_experts(module)
    if fused is not None:
        return fused, ""
    own = getattr(type(module), "_apply_gate", None)
    if family.experts_gate == "batched" and not hasattr(module, "_apply_gate"):
        up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == down.dim() == 3
                and up.shape[2] == 2 * down.shape[1] and up.shape[0] == down.shape[0]):
            return None, "experts: not the batched (E, H, 2·I) / (E, I, H) layout"
        activation = activation_name(getattr(module, "act_fn", None))
        if activation is None:
            return None, f"experts: activation {type(getattr(module, 'act_fn', None)).__name__}"
        return BatchedExpertsForward(module, activation), ""
    if family.experts_gate == "clamped_swiglu" and callable(own):
        # GPT-OSS: its experts call their own _apply_gate on the interleaved projection in every implementation
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)):
            return None, "experts: no swiglu alpha/limit on the experts module"
        return ExpertsGate("clamped_swiglu", float(alpha), float(limit)), ""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None, "experts: this transformers release has no experts gate hook"
    if not hasattr(module, "_apply_gate"):
        return None, "experts: no gate hook (the experts loop computes the gate inline)"
    if own is not _default_apply_gate:
        return None, "experts: the family's own gate"
    if not (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)):
        return None, "experts: not a packed gate/up layout"
    activation = activation_name(getattr(module, "act_fn", None))
    if activation is None:
        return None, f"experts: activation {type(getattr(module, 'act_fn', None)).__name__}"
    if getattr(getattr(module, "config", None), "_experts_implementation", None) in (None, "eager"):
        return None, "experts: the eager experts loop computes the gate inline"
    return ExpertsGate(activation), ""


class _Replicate:
    """A patched module's ``_replicate_for_data_parallel``: ``nn.DataParallel`` copies a module's ``__dict__`` into
    each replica, so the forward ``apply_to`` installed would still be bound to the original module (its weights,
    its device); the replica gets its own, and so do its replicas."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self) -> nn.Module:
        replica = nn.Module._replicate_for_data_parallel(self.module)
        bound = replica.__dict__.get("forward")
        if callable(getattr(bound, "rebound", None)):
            replica.__dict__["forward"] = bound.rebound(replica)
        replica.__dict__["_replicate_for_data_parallel"] = _Replicate(replica)
        return replica


def install_forward(module: nn.Module, forward) -> None:
    """``module.forward = forward``, with replication for ``nn.DataParallel`` that rebinds it (``_Replicate``)."""
    module.forward = forward
    module._replicate_for_data_parallel = _Replicate(module)
