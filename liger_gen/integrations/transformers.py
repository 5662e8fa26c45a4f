"""Patch transformers models in place: one table of model families, each described as data.

``apply_to(model)`` walks the model and replaces, for the model's family (``config.model_type``):

- **Norms** → ``liger_gen.nn.RMSNorm`` (or ``liger_gen.nn.LayerNorm``) holding the same Parameters. A family's
  ``norm`` says which formula its norm classes compute: "llama" (``w · x̂`` with x̂ rounded to the input's dtype
  first), "gemma" (``(1 + w) · x̂`` in fp32, rounded once; weights stored as w − 1), "fp32" (``w · x̂`` in fp32,
  rounded once: OLMo 2, GPT-OSS) or "layer" (LayerNorm: Cohere 2 without bias, PhiMoE with bias). Every module of
  the listed classes is swapped: decoder norms, Gemma 2/3's sandwich norms, OLMo 2's post-norms, q/k norms
  (Qwen 3, Gemma 3, OLMo 2 over the whole projection). A norm whose weight is not 1-D (Cohere 2's per-head q/k
  norms) is left as it is.
- **Residual adds** (``fused_add_rms_norm=True``): where a decoder layer's forward reads ``h = residual + x;
  residual = h; h = self.<norm>(h)`` (the pre-norm block between attention and MLP), those three statements of
  the layer class's own code become one call that, for a norm ``apply_to`` replaced and marked
  (``fuse_residual``), runs ``liger_gen.functional.fused_add_rms_norm``: the add and the norm in one pass, the
  same values. The rest of the forward, and every wrapper around it (gradient checkpointing, hooks, accelerate's
  dispatch), is the release's own. The code change is process-wide, like the RoPE routing, and computes exactly
  the original statements for unmarked norms and for norms that hooks watch (forward or backward, module or
  global; looked up on every call). The rewrite is made only where the class's source file, parsed, compiles to
  the code that runs: a file changed since import leaves that layer unfused and listed in the report.
  ``restore_layers()`` undoes it.
- **Gated MLPs** → ``liger_gen.nn.GLUMLP`` holding the same projections: ``gate_proj``/``up_proj``/``down_proj``
  (Llama's layout) or ``gate_up_proj``/``down_proj`` (Phi-3, GLM-4), with the activation read from the module's
  own activation function: SiLU → SwiGLU, ``gelu_pytorch_tanh`` → GeGLU (tanh), exact GELU → GeGLU. Seed-OSS's
  residual dropout and Falcon-H1's gate and output multipliers are kept. An MLP with another activation stays.
- **MoE experts** (transformers' fused ``*Experts`` modules): in the standard layout (``gate_up_proj`` (E, 2·I,
  H), ``down_proj`` (E, H, I), no biases) their ``forward`` becomes ``liger_gen.functional.moe_experts``, whatever
  ``config._experts_implementation`` says; other layouts that call transformers' shared gate hook
  (``_apply_gate``) under the grouped and batched implementations get the packed GLU kernel there. The router and
  the auxiliary loss stay transformers'. GPT-OSS's experts call their own clamped SwiGLU gate (on the interleaved
  projection) in every implementation: it runs ``liger_gen.functional.clamped_swiglu_gate_up`` with their
  ``alpha`` and ``limit``. Llama 4's experts (two ``bmm`` over tokens grouped per expert, the gate computed
  inline) get a ``forward`` that runs the same ``bmm`` with the packed GLU kernel between them.
- **RoPE**: a family whose ``apply_rotary_pos_emb`` uses the rotate-half layout (full or partial rotary) has it
  routed to ``liger_gen.functional.rope`` (wrapped to keep transformers' signature). Attention modules call that
  function through their modeling module's globals, so this patch is process-wide: every model of that family in
  the process uses it afterwards (the function computes the same values); ``restore_rope()`` puts transformers'
  functions back. Where transformers has turned the function into a hub-kernel module (with the ``kernels``
  package installed, transformers 5.25 and later), it is replaced by a module of a subclass of that module's
  class whose ``forward`` is liger-gen's, so that models holding copies of it (rebuilt from the module-level
  object when unpickled) still pickle and load, and torch.compile traces it without a graph break; the routing
  then takes precedence over a hub kernel that ``kernels.kernelize`` maps to the function. Other layouts are
  mapped onto it: GPT-OSS's half-width tables are widened, the interleaved pairs of DeepSeek-V3, GLM-4 and
  Cohere 2 are de-interleaved (and, for GLM-4 and Cohere 2, interleaved back after the rotation). Llama 4's
  complex rotation (``apply_rotary_emb`` with a ``freqs_cis`` table) is the same rotation of interleaved pairs:
  its real and imaginary parts are the cos/sin tables.
- **The LM-head loss**: when ``labels`` are given and gradients are enabled (training, whatever the module's
  train/eval mode), the causal-LM ``forward`` computes the loss with
  ``liger_gen.functional.fused_linear_cross_entropy`` from the last hidden states and ``lm_head.weight``,
  without materialising the logits (``outputs.logits`` is None then). The family's logit transform is part of the
  loss: Gemma 2/3's final soft-capping (FLCE's ``softcap``), Granite's division by ``logits_scaling``, Cohere's
  ``logit_scale`` and Falcon-H1's ``lm_head_multiplier`` (the last three applied to the hidden states, the same
  product). The loss equals transformers'
  ``ForCausalLMLoss``: labels shifted left, ``ignore_index=-100``, mean over non-ignored tokens, or a sum divided
  by ``num_items_in_batch`` when the trainer passes it; MoE models add the router's load-balancing loss as
  transformers does when router logits are requested. Without labels, with gradients disabled or with
  ``use_cache=True`` the original forward runs and returns logits. ``return_dict=False`` gives transformers' tuple
  with None in the logits' place.
"""

from __future__ import annotations

import __future__
import dataclasses
import functools
import importlib
import inspect
import logging
import operator
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module  # the global hook registries

from liger_gen.nn import GLUMLP, LayerNorm, RMSNorm

logger = logging.getLogger("liger_gen")

# transformers releases the family table was checked against (the convergence tests run on them)
TESTED_TRANSFORMERS = ("4.51.3", "4.57.1", "5.0.0", "5.14.1", "5.17.0", "5.24.0", "5.25.0")


@dataclass(frozen=True)
class ModelFamily:
    """One family's modeling module and what liger-gen replaces in it (see the module docstring).

    model_type: ``config.model_type``. module: the modeling module. prefix: its class-name prefix ("Llama").
    norm: the formula of its norm classes ("llama", "gemma", "fp32", "layer"; None: not patched).
    norm_classes: the classes to swap (default ``<prefix>RMSNorm``). rope: whether its ``apply_rotary_pos_emb``
    is the rotate-half layout ``liger_gen.functional.rope`` computes; rope_keeps_dtype: whether that function
    casts its outputs back to q's and k's dtypes (OLMo 2/3) rather than promoting them with cos/sin's;
    rope_tables: "full" (cos/sin hold cat(freqs, freqs), as Llama's), "half" (one angle per pair, GPT-OSS),
    "interleaved" (each angle twice in a row, Cohere) or "complex" (one complex table ``freqs_cis`` of
    cos + i·sin per pair, passed as ``(xq, xk, freqs_cis)`` with q and k as (batch, seq, heads, head_dim):
    Llama 4's ``apply_rotary_emb``); rope_function: the name of the replaced function; rope_pairs: the function
    rotates interleaved pairs (x0, x1), (x2, x3), ... of the rotary dims and returns them in that layout (GLM-4,
    Cohere 2, Llama 4);
    interleaved_rope: the name of a second function that rotates interleaved pairs of a de-interleavable layout
    (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``), routed to liger-gen too. mlp: whether its gated MLP
    modules are patched. causal_lm: the causal-LM class names (default ``<prefix>ForCausalLM``). logits: the transform between
    ``lm_head`` and the loss (None, "softcap" from ``config.final_logit_softcapping``, "divide" by
    ``config.logits_scaling``, "multiply" by the model's ``logit_scale``, "lm_head_multiplier" by the base
    model's ``lm_head_multiplier``). experts_gate: how the family's experts compute their gate where it is not
    transformers' shared hook: "clamped_swiglu" (GPT-OSS's own ``_apply_gate``, from the experts' ``alpha`` and
    ``limit``) or "batched" (Llama 4: ``bmm`` over experts of pre-grouped tokens, gate and up as the two halves
    of ``gate_up_proj``'s output, computed inline). note: what stays transformers' own.
    """

    model_type: str
    prefix: str
    norm: str | None = "llama"
    norm_classes: tuple[str, ...] | None = None
    rope: bool = True
    rope_keeps_dtype: bool = False
    rope_tables: str = "full"
    rope_function: str = "apply_rotary_pos_emb"
    rope_pairs: bool = False
    interleaved_rope: str | None = None
    mlp: bool = True
    causal_lm: tuple[str, ...] | None = None
    logits: str | None = None
    experts_gate: str | None = None
    module: str | None = None
    note: str = ""

    @property
    def modeling_module(self) -> str:
        return self.module or f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    @property
    def norm_class_names(self) -> tuple[str, ...]:
        return self.norm_classes if self.norm_classes is not None else (f"{self.prefix}RMSNorm",)

    @property
    def causal_lm_classes(self) -> tuple[str, ...]:
        return self.causal_lm if self.causal_lm is not None else (f"{self.prefix}ForCausalLM",)


_F = ModelFamily
MODEL_FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    _F("llama", "Llama"),
    _F("llama4_text", "Llama4Text", module="transformers.models.llama4.modeling_llama4", experts_gate="batched",
       causal_lm=("Llama4ForCausalLM",), rope_function="apply_rotary_emb", rope_tables="complex", rope_pairs=True,
       rope_keeps_dtype=True),
    _F("mistral", "Mistral"),
    _F("ministral", "Ministral"),
    _F("mixtral", "Mixtral"),
    _F("qwen2", "Qwen2"),
    _F("qwen2_moe", "Qwen2Moe"),
    _F("qwen3", "Qwen3"),
    _F("qwen3_moe", "Qwen3Moe"),
    _F("qwen3_next", "Qwen3Next", norm="gemma",
       note="the gated linear-attention layers' gated RMSNorm is transformers' own"),
    _F("qwen3_5_text", "Qwen3_5", norm="gemma", module="transformers.models.qwen3_5.modeling_qwen3_5",
       note="the gated linear-attention layers' gated RMSNorm is transformers' own"),
    _F("qwen3_5_moe_text", "Qwen3_5Moe", norm="gemma", module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
       note="the gated linear-attention layers' gated RMSNorm is transformers' own"),
    _F("gemma", "Gemma", norm="gemma"),
    _F("gemma2", "Gemma2", norm="gemma", logits="softcap"),
    _F("gemma3_text", "Gemma3", norm="gemma", logits="softcap", module="transformers.models.gemma3.modeling_gemma3"),
    _F("phi3", "Phi3"),
    _F("phimoe", "Phimoe", norm="layer", norm_classes=("LayerNorm",)),
    _F("granite", "Granite", logits="divide"),
    _F("granitemoe", "GraniteMoe", logits="divide"),
    _F("olmo2", "Olmo2", norm="fp32", rope_keeps_dtype=True),
    _F("olmo3", "Olmo3", norm="fp32", rope_keeps_dtype=True),
    _F("glm4", "Glm4", rope_pairs=True),
    _F("smollm3", "SmolLM3"),
    _F("deepseek_v3", "DeepseekV3", interleaved_rope="apply_rotary_pos_emb_interleave"),
    _F("gpt_oss", "GptOss", norm="fp32", rope_tables="half", experts_gate="clamped_swiglu"),
    _F("cohere2", "Cohere2", norm="layer", norm_classes=("Cohere2LayerNorm",), rope_pairs=True,
       rope_tables="interleaved", rope_keeps_dtype=True, logits="multiply", note="per-head q/k norms stay"),
    _F("exaone4", "Exaone4"),
    _F("falcon_h1", "FalconH1", logits="lm_head_multiplier",
       note="the Mamba-2 mixer and the gated norm inside it stay transformers' own"),
    _F("seed_oss", "SeedOss"),
)}
# model types that are these families under another name in some transformers releases
_ALIASES = {"gemma3": "gemma3_text", "llama4": "llama4_text"}

_original_rope: dict[str, object] = {}  # modeling module name → transformers' apply_rotary_pos_emb
_patched_rope: dict[str, object] = {}  # modeling module name → its liger-gen wrapper (one object, so it pickles)


def family_of(model: nn.Module) -> ModelFamily:
    """The family entry of ``model``'s ``config.model_type``; ValueError naming the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    model_type = _ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if not isinstance(model_type, str) or model_type not in MODEL_FAMILIES:
        raise ValueError(f"liger_gen.apply_to: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_FAMILIES))}")
    return MODEL_FAMILIES[model_type]


# ------------------------------------------------------------------------------------------------ norms


def _replace_norm(module: nn.Module, kind: str) -> nn.Module | None:
    """A liger-gen norm sharing ``module``'s Parameters, or None where the weight is not 1-D."""
    weight = module.weight
    if weight is None or weight.dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    if kind == "layer":
        bias = getattr(module, "bias", None)
        new = LayerNorm(weight.shape[0], eps=eps, bias=bias is not None, device="meta")
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


def _replace_mlp(module: nn.Module) -> tuple[nn.Module | None, str]:
    """(a GLUMLP holding ``module``'s projections, "") or (None, why it stays)."""
    children = dict(module.named_children())
    multipliers = {name: float(getattr(module, name)) for name in ("gate_multiplier", "down_multiplier")
                   if isinstance(getattr(module, name, None), (int, float))}
    activation = _activation_of(module)
    if activation is None:
        act = children.get("act_fn", children.get("activation_fn"))
        return None, f"activation {type(act).__name__}"
    dropout = float(getattr(module, "residual_dropout", 0.0) or 0.0)
    if isinstance(children.get("gate_up_proj"), nn.Linear) and isinstance(children.get("down_proj"), nn.Linear):
        if multipliers:
            return None, "multipliers on a packed gate_up_proj"
        new = GLUMLP(activation, children["down_proj"], gate_up_proj=children["gate_up_proj"], dropout=dropout)
    elif all(isinstance(children.get(n), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
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
        from liger_gen.ops.glu.glu import glu_gate_up_product

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
        from liger_gen.ops.glu.glu import glu_gate_up_product

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


def _is_patched_experts(module: nn.Module) -> bool:
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


def _experts_gate(module: nn.Module, family: ModelFamily
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


# ------------------------------------------------------------------------------------------------ loss


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _signature(function) -> inspect.Signature:
    """The signature of a model class's forward, read once (binding a call to it happens every step). A plain
    dict rather than functools.lru_cache: torch.compile traces through an lru_cache wrapper with a warning."""
    signature = _SIGNATURES.get(function)
    if signature is None:
        signature = _SIGNATURES[function] = inspect.signature(function)
    return signature


def _logit_transform(model: nn.Module, family: ModelFamily) -> tuple[float | None, float | None]:
    """(multiplier of the hidden states, softcap) that reproduce the family's logits before the loss."""
    config = model.config
    if family.logits == "softcap":
        return None, getattr(config, "final_logit_softcapping", None)
    if family.logits == "divide":
        return 1.0 / float(config.logits_scaling), None
    if family.logits == "multiply":
        return float(getattr(model, "logit_scale", getattr(config, "logit_scale", 1.0))), None
    if family.logits == "lm_head_multiplier":
        return float(getattr(model.model, "lm_head_multiplier", config.lm_head_multiplier)), None
    return None, None


def _causal_lm_forward(self, family: ModelFamily, *args, **kwargs):
    """Causal-LM forward whose training loss never materialises the logits (see the module docstring).

    The call is bound to the original ``forward``'s signature, so positional and keyword arguments mean what
    they mean there; a call without labels, with gradients disabled or with ``use_cache=True`` runs the original
    forward unchanged.
    """
    original = type(self).forward
    signature = _signature(original)
    bound = signature.bind(self, *args, **kwargs)
    named = dict(bound.arguments)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    extra = dict(named.pop(var_keyword, {})) if var_keyword else {}  # **kwargs, **loss_kwargs (4.46), none (4.45)
    labels = named.get("labels")
    if labels is None or not torch.is_grad_enabled() or named.get("use_cache") or extra.get("use_cache"):
        return original(self, *args, **kwargs)
    # imported by every modeling module; an import statement here stops torch.compile in a process where nothing
    # imported transformers' lazy module attribute before (a patched model loaded with torch.load)
    modeling_outputs = sys.modules["transformers.modeling_outputs"]
    from liger_gen.functional import fused_linear_cross_entropy

    for name in ("self", "labels", "logits_to_keep", "num_logits_to_keep"):
        named.pop(name, None)  # use_cache (False or None here) goes on to the base model, as transformers passes it
    return_dict = named.pop("return_dict", None)  # a named parameter before transformers 4.51, else in **kwargs
    return_dict = extra.pop("return_dict", return_dict)
    shift_labels = extra.pop("shift_labels", None)
    num_items_in_batch = extra.pop("num_items_in_batch", None)  # a loss argument; base models before 4.48 reject it
    # router logits: asked by name, in **kwargs, or by the config (the base model reads the same three)
    router = named.get("output_router_logits", extra.get("output_router_logits"))
    router = bool(getattr(self.config, "output_router_logits", False) if router is None else router)
    if "return_dict" in _signature(type(self.model).forward).parameters:
        named["return_dict"] = True  # the base model returns a tuple when config.return_dict/its caller says so
    outputs = self.model(**named, **extra)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # tokens < n predict token n, as transformers' ForCausalLMLoss shifts them
        shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    head = self.get_output_embeddings()
    scale, softcap = _logit_transform(self, family)
    x = hidden.reshape(-1, hidden.shape[-1])
    if scale is not None:
        x = x * scale
    # under DeepSpeed ZeRO-3, reading head.weight here (inside the forward of a module it manages) gathers the
    # partitioned weight and registers it with this module, so its backward gathers it again
    loss = fused_linear_cross_entropy(x, head.weight, shift_labels.reshape(-1).to(hidden.device), bias=head.bias,
                                      ignore_index=-100, reduction=reduction, softcap=softcap)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    # an MoE base model (its output has router_logits) gives the MoE output class, as transformers' forward does;
    # the load-balancing loss is added where the family's forward adds it (a modeling function and a coefficient)
    moe = hasattr(outputs, "router_logits")
    aux_loss = None
    modeling = sys.modules[type(self).__module__]  # imported with the class (import_module stops torch.compile)
    if router and getattr(outputs, "router_logits", None) is not None \
            and hasattr(modeling, "load_balancing_loss_func") and hasattr(self, "router_aux_loss_coef"):
        aux_loss = modeling.load_balancing_loss_func(outputs.router_logits, self.num_experts,
                                                     self.num_experts_per_tok, named.get("attention_mask"))
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    out_cls = modeling_outputs.MoeCausalLMOutputWithPast if moe else modeling_outputs.CausalLMOutputWithPast
    # the base model's fields by the output class's own names (the cache field was renamed in transformers 5);
    # __dataclass_fields__ rather than dataclasses.fields, which torch.compile does not trace (the output classes
    # declare no ClassVar or InitVar, so both name the same fields)
    fields = {name: getattr(outputs, name, None) for name in out_cls.__dataclass_fields__}
    fields.update(loss=loss, logits=None)
    if moe:
        fields["aux_loss"] = aux_loss
    out = out_cls(**fields)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if return_dict:
        return out
    # transformers' tuple (its non-None fields in order), with None kept where it would hold the logits
    return tuple(v for k, v in fields.items() if v is not None or k == "logits")


class FusedLossForward:
    """The ``forward`` ``apply_to`` installs on a causal-LM instance: ``_causal_lm_forward`` bound to it.

    A plain object rather than a bound method so that a patched model can be pickled and loaded (a bound method
    pickles as a lookup of its function's name on the instance, which does not exist). It has the original
    bound forward's signature, name and docstring: trainers read the signature to decide which batch columns to
    pass (transformers' ``Trainer`` drops every column the forward does not name) and whether the loss takes
    ``num_items_in_batch``.
    """

    def __init__(self, module: nn.Module, family: ModelFamily | None = None):
        self.module = module
        self.family = family or family_of(module)

    def __call__(self, *args, **kwargs):
        return _causal_lm_forward(self.module, self.family, *args, **kwargs)

    def rebound(self, module: nn.Module) -> "FusedLossForward":
        """The same forward bound to ``module`` (a replica of the patched model)."""
        return FusedLossForward(module, self.family)

    @property
    def __signature__(self) -> inspect.Signature:
        signature = _signature(type(self.module).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # bound: no ``self``

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return type(self.module).forward.__doc__

    @property
    def __name__(self) -> str:
        return "forward"


# ------------------------------------------------------------------------------------------------ residual adds

_HELPER = "__liger_gen_add_then_norm__"  # the global name the rewritten layer code calls
_layers_lock = threading.Lock()
_layers_restored = False  # restore_layers() ran (and no apply_to since): unpickling a model rewrites nothing
_ORIGINAL_LAYER_CODE: dict[Any, Any] = {}  # a layer class's innermost forward function → its original code
_LAYER_NORMS: dict[Any, tuple[str, ...] | None] = {}  # that function → the norms its rewrite fuses (None: none)
_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, f).compiler_flag
                                                for f in __future__.all_feature_names))
_LAYER_PLANS: dict[Any, Any] = {}  # that function → its rewrite, or why it is refused (see _layer_plan)


def _norm_hooked(norm: nn.Module) -> bool:
    """Whether a hook would see ``norm``'s call: its own forward or backward hooks (of any kind: full, pre,
    the older non-full ones) or global ones (DeepSpeed ZeRO-3's, activation probes, gradient monitors). A hook
    expects the norm's usual single input and output, and a backward hook the gradient of the norm's own input,
    which only the unfused add-then-norm gives."""
    return bool(norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks or norm._backward_pre_hooks
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def _add_then_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x), as a decoder layer computes them: one fused pass where ``norm`` is a
    liger-gen RMSNorm that ``apply_to`` marked (``fuse_residual``) and no hook watches it (``_norm_hooked``);
    otherwise the add, then the norm's own call, exactly transformers' statements. Hooks are looked up on every
    call, so hooks registered after ``apply_to`` are seen too."""
    if getattr(norm, "fuse_residual", False) and isinstance(norm, RMSNorm) and not _norm_hooked(norm):
        return norm(x, residual=residual)
    s = residual + x
    return norm(s), s


def _match_add_then_norm(statements: list) -> tuple[str, str, Any, str] | None:
    """(hidden name, residual name, added expression, norm attribute) when three statements read
    ``h = r + <x>; r = h; h = self.<norm>(h)`` (the pre-norm decoder between its attention and MLP blocks)."""
    import ast

    if len(statements) < 3 or not all(isinstance(s, ast.Assign) and len(s.targets) == 1
                                      and isinstance(s.targets[0], ast.Name) for s in statements[:3]):
        return None
    add, keep, norm = statements[:3]
    h, r = add.targets[0].id, keep.targets[0].id
    if not (isinstance(add.value, ast.BinOp) and isinstance(add.value.op, ast.Add)
            and isinstance(add.value.left, ast.Name) and add.value.left.id == r and h != r):
        return None
    if not (isinstance(keep.value, ast.Name) and keep.value.id == h and norm.targets[0].id == h):
        return None
    call = norm.value
    if not (isinstance(call, ast.Call) and not call.keywords and len(call.args) == 1
            and isinstance(call.args[0], ast.Name) and call.args[0].id == h
            and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self" and "norm" in call.func.attr):
        return None  # (a post-norm layer's ``h = self.mlp(h)`` after the add is not a pre-norm)
    return h, r, add.value.right, call.func.attr


def _fuse_layer_code(cls: type) -> tuple[str, ...] | None:
    """Rewrite the code of ``cls``'s forward so that each ``h = r + x; r = h; h = self.<norm>(h)`` at the top
    level of its body becomes ``h, r = _add_then_norm(self.<norm>, x, r)``; return the names of those norms, or
    None where its source has no such statements or cannot be rewritten (no source, a closure, a source file that
    no longer holds the code that runs: ``layer_code_refusal`` says why).

    The code object of the innermost function is replaced (``function.__code__``), so everything around it stays
    as it is: transformers' own wrappers (gradient checkpointing, deprecated keyword names), a user's wrapper on
    the class, hooks and wrappers on layer instances (accelerate's), pickling, ``nn.DataParallel``'s replicas.
    Like the RoPE routing this is process-wide, and it changes nothing for a layer whose norm ``apply_to`` did not
    mark: ``_add_then_norm`` then runs the add and the norm as the original statements did.
    ``restore_layers()`` puts the original code back. Done once per function."""
    with _layers_lock:  # one rewrite at a time: a second reader would parse the rewritten source
        inner, plan = _layer_plan(cls)
        if inner is None or inner in _LAYER_NORMS:
            return _LAYER_NORMS.get(inner)
        result = None
        if isinstance(plan, tuple):
            new, norms = plan
            inner.__globals__[_HELPER] = _add_then_norm
            _ORIGINAL_LAYER_CODE[inner] = inner.__code__
            inner.__code__ = new
            global _layers_restored
            _layers_restored = False
            result = norms
        _LAYER_NORMS[inner] = result
        return result


def layer_code_refusal(cls: type) -> str | None:
    """Why the residual adds of ``cls``'s forward are not fused although its layout would allow it: its source
    file has changed since the class was imported (an upgraded or edited transformers in a running process), so
    the parsed definition no longer compiles to the code that runs and rewriting it would install the edited
    body. None otherwise (fused, not that layout, or no source to read)."""
    with _layers_lock:
        inner, plan = _layer_plan(cls)
    return plan if isinstance(plan, str) else None


def _compile_definition(definition, owner: str | None, filename: str, future_flags: int):
    """The code object of the function ``definition`` (an ``ast.FunctionDef`` with its line numbers and columns)
    compiled as a method of a class named ``owner`` (private names are mangled as in that class), or at module
    level when ``owner`` is None, under the ``__future__`` features ``future_flags`` (its module's, not ours)."""
    import ast

    fields = {"type_params": []} if "type_params" in ast.ClassDef._fields else {}  # Python 3.12 and later
    first = min([definition.lineno] + [d.lineno for d in definition.decorator_list])
    body = [ast.ClassDef(name=owner, bases=[], keywords=[], body=[definition], decorator_list=[], **fields,
                         lineno=first, col_offset=0, end_lineno=definition.end_lineno,
                         end_col_offset=definition.end_col_offset)] if owner else [definition]
    module = compile(ast.fix_missing_locations(ast.Module(body, type_ignores=[])), filename, "exec",
                     flags=future_flags, dont_inherit=True)
    code_type = type(module)
    scope = next(c for c in module.co_consts if isinstance(c, code_type)) if owner else module
    return next(c for c in scope.co_consts if isinstance(c, code_type) and c.co_name == definition.name)


def _layer_plan(cls: type):
    """(innermost forward, plan) for ``cls``: plan is (new code, norm names) when the forward can be rewritten,
    a string saying why not when its source file no longer matches the running code, or None (nothing to fuse,
    or not readable). Caller holds ``_layers_lock``; plans are kept per function until ``restore_layers``."""
    import ast
    import linecache

    try:
        inner = inspect.unwrap(cls.forward)
    except Exception:  # noqa: BLE001 - a class whose forward cannot be read (TorchScript's) is not ours
        return None, None
    if inner in _LAYER_PLANS:
        return inner, _LAYER_PLANS[inner]
    code = _ORIGINAL_LAYER_CODE.get(inner, getattr(inner, "__code__", None))
    plan = None
    try:
        if code is None or code.co_freevars:
            raise TypeError("not a plain function")  # a closure (e.g. super() without arguments)
        qualname = getattr(inner, "__qualname__", "").split(".")
        if "<locals>" in qualname:
            raise TypeError("a function defined inside another")
        owner = qualname[-2] if len(qualname) > 1 else None
        lines, first = inspect.getsourcelines(inner)
        # parsed where it stands (the class's indentation, the file's line numbers), so that the unmodified
        # definition compiles to the very code object that runs when the file is the one the class came from
        tree = ast.parse("if 1:\n" + "".join(lines))
        ast.increment_lineno(tree, first - 2)
        definition = tree.body[0].body[0]
        if not isinstance(definition, ast.FunctionDef) or definition.name != inner.__name__:
            raise TypeError("source is not the function's definition")
        futures = code.co_flags & _FUTURE_FLAGS
        if _compile_definition(definition, owner, code.co_filename, futures) != code:
            plan = (f"residual add not fused: {code.co_filename} has changed since "
                    f"{inner.__module__} was imported (restart the process to fuse it)")
            logger.warning("liger_gen.apply_to: %s.%s: %s", inner.__module__, inner.__qualname__, plan)
            raise LookupError(plan)
        body, norms, i = [], [], 0
        while i < len(definition.body):
            match = _match_add_then_norm(definition.body[i:i + 3])
            if match is None:
                body.append(definition.body[i])
                i += 1
                continue
            h, r, x, norm = match
            stmt = ast.parse(f"{h}, {r} = {_HELPER}(self.{norm}, __x__, {r})").body[0]
            stmt.value.args[1] = x
            body.append(stmt)
            norms.append(norm)
            i += 3
        if norms:
            definition.body, definition.decorator_list = body, []  # the decorators stay on the class
            definition = ast.parse(ast.unparse(ast.fix_missing_locations(definition))).body[0]  # fresh lines
            filename = f"<liger-gen: {inner.__module__}.{inner.__qualname__} with the residual add fused into the norm>"
            source = ast.unparse(definition)
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
            new = _compile_definition(definition, owner, filename, futures)
            if new.co_freevars:
                raise TypeError("the rewrite would need a closure")
            if hasattr(code, "co_qualname"):
                new = new.replace(co_qualname=code.co_qualname)
            plan = (new, tuple(norms))
    except LookupError:
        pass
    except (OSError, TypeError, SyntaxError, ValueError, AttributeError, IndexError, StopIteration, SystemError,
            RecursionError) as e:
        logger.debug("liger_gen.apply_to: %s.forward not rewritten: %s", cls.__qualname__, e)
    _LAYER_PLANS[inner] = plan
    return inner, plan


def _fused_norm_names(cls: type) -> tuple[str, ...]:
    """The norms whose add the code of ``cls``'s forward fuses in this process; () where it is not rewritten."""
    if not cls.__name__.endswith("DecoderLayer"):
        return ()
    try:
        inner = inspect.unwrap(cls.forward)
    except Exception:  # noqa: BLE001 - a class whose forward cannot be read (TorchScript's) is not ours
        return ()
    return (_LAYER_NORMS.get(inner) or ()) if inner in _ORIGINAL_LAYER_CODE else ()


def restore_layers() -> None:
    """Put back the original code of every decoder layer forward ``apply_to`` rewrote (the marked norms then run
    after transformers' own add again)."""
    global _layers_restored
    with _layers_lock:
        for function, code in _ORIGINAL_LAYER_CODE.items():
            function.__code__ = code  # the helper stays in the module: a forward running now may still call it
        _ORIGINAL_LAYER_CODE.clear()
        _LAYER_NORMS.clear()
        _LAYER_PLANS.clear()
        _layers_restored = True


def _fusable_norms(module: nn.Module, modeling, norm_kind: str | None, swapped: set[int]) -> list[str]:
    """The names of the norms of ``module`` whose residual add can be fused: ``module`` is a decoder layer of
    ``modeling`` whose forward can be rewritten, and each such norm is (or is about to be) a liger-gen RMSNorm."""
    cls = type(module)
    if cls.__module__ != modeling.__name__ or not cls.__name__.endswith("DecoderLayer") or norm_kind == "layer":
        return []
    names = _fuse_layer_code(cls)
    if not names:
        return []
    norms = [getattr(module, name, None) for name in names]
    return list(names) if all(isinstance(n, RMSNorm) or id(n) in swapped for n in norms) else []


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


def _install_forward(module: nn.Module, forward) -> None:
    """``module.forward = forward``, with replication for ``nn.DataParallel`` that rebinds it (``_Replicate``)."""
    module.forward = forward
    module._replicate_for_data_parallel = _Replicate(module)


# ------------------------------------------------------------------------------------------------ RoPE


def _is_function_module(obj) -> bool:
    """Whether ``obj`` is a module-level function that transformers turned into an ``nn.Module`` instance for hub
    kernels (``kernels.use_kernel_forward_from_hub`` on a function, transformers 5.25 and later with the
    ``kernels`` package): calls go through its ``forward``, and attention modules keep private copies of it that
    are rebuilt, when unpickled, as ``type(<the module-level object>)()``."""
    return isinstance(obj, nn.Module)


def _routed_function_module(original: nn.Module, patched) -> nn.Module:
    """A module to put in place of the function module ``original``: an instance of a subclass of its class whose
    ``forward`` calls ``patched``, with the original forward's signature. The subclass keeps the class's name and
    module, so the module-level object pickles by name as before. What ``type(obj)()`` builds (kernels' copies,
    and the attention modules' private copies when a model is unpickled) is transformers' own module, so nothing
    outside the module-level object stays routed after ``restore_rope``."""
    base = type(original)

    def forward(self, *args, **kwargs):
        return patched(*args, **kwargs)

    def new(cls, *args, **kwargs):
        return base(*args, **kwargs)

    forward.__signature__ = inspect.signature(base.forward)
    routed = type(base.__name__, (base,), {"forward": forward, "__new__": new, "liger_gen": True,
                                           "liger_gen_function": staticmethod(patched),
                                           "__module__": base.__module__, "__qualname__": base.__qualname__})
    module = nn.Module.__new__(routed)
    module.__init__()
    return module


def _rope_signature(original) -> inspect.Signature:
    """The call signature of transformers' rotary function, also when it is a function module."""
    if _is_function_module(original):
        signature = inspect.signature(type(original).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # no ``self``
    return inspect.signature(original)


def _wraps_rope(original, name: str, signature: inspect.Signature):
    """functools.wraps for transformers' rotary function; a function module lends its name, module and
    signature (``_rope_signature``; copying its ``__dict__`` would copy the module's parameters and hooks)."""
    if not _is_function_module(original):
        return functools.wraps(original)

    def wrap(function):
        function.__module__ = type(original).__module__
        function.__name__ = function.__qualname__ = name
        function.__signature__ = signature
        return function

    return wrap


def _binder(signature: inspect.Signature, name: str):
    """``Signature.bind(...).arguments`` with the defaults filled in, in plain Python: torch.compile traces it
    (``Signature.bind`` reads a mappingproxy, which breaks the graph once the trace has mutated a dict, as
    transformers' hub-kernel wrappers of attention modules do). TypeError as a call of the function would raise."""
    params = list(signature.parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def bind(args: tuple, kwargs: dict) -> dict:
        if len(args) > len(positional) and not var_positional:
            raise TypeError(f"{name}() takes {len(positional)} positional arguments but {len(args)} were given")
        arguments = dict(defaults)
        arguments.update(zip(positional, args))
        given = positional[:len(args)]
        for key, value in kwargs.items():
            if key in given:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
            if key not in keywords and not var_keyword:
                raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
            arguments[key] = value
        return arguments

    return bind


def _transformers_rope(original, family: ModelFamily, interleaved: bool = False, name: str | None = None):
    """liger-gen RoPE with the signature of the transformers function it replaces: ``unsqueeze_dim`` is
    honoured by name or position; a ``position_ids`` argument is used only with (seq, dim) tables, as the older
    releases that pass such tables use it (transformers ignores it with per-position tables). Per the family:
    results cast back to q's and k's dtypes (``rope_keeps_dtype``); half-width or interleaved tables turned
    into cat(freqs, freqs) (``rope_tables``); interleaved pairs of the rotary dims laid out as two halves for
    the kernel and back again (``rope_pairs``); or, for ``interleaved`` (DeepSeek's second function), laid out
    as two halves, the layout that function returns."""
    from liger_gen.functional import rope

    signature = _rope_signature(original)
    name = name or getattr(original, "__name__", family.rope_function)
    bind = _binder(signature, name)
    keeps_dtype, tables, pairs = family.rope_keeps_dtype, family.rope_tables, family.rope_pairs and not interleaved

    def halves(x: torch.Tensor, width: int) -> torch.Tensor:
        """The first ``width`` dims of x with pairs (x0, x1), (x2, x3), ... laid out as two halves."""
        rot = x[..., :width]
        out = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        return out if width == x.shape[-1] else torch.cat((out, x[..., width:]), dim=-1)

    def pairs_of(y: torch.Tensor, width: int) -> torch.Tensor:
        """The inverse of ``halves``."""
        rot = torch.stack((y[..., :width // 2], y[..., width // 2:width]), dim=-1).flatten(-2)
        return rot if width == y.shape[-1] else torch.cat((rot, y[..., width:]), dim=-1)

    if tables == "complex":  # Llama 4: complex multiplication of interleaved pairs, in fp32, cast back
        @_wraps_rope(original, name, signature)
        def apply_rotary_emb(xq, xk, freqs_cis):
            cos, sin = freqs_cis.real, freqs_cis.imag
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            width = cos.shape[-1]
            q_out, k_out = rope(halves(xq, width), halves(xk, width), cos, sin, unsqueeze_dim=2)
            return pairs_of(q_out, width).to(xq.dtype), pairs_of(k_out, width).to(xk.dtype)

        apply_rotary_emb.liger_gen = True
        return apply_rotary_emb

    @_wraps_rope(original, name, signature)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        arguments = bind((q, k, cos, sin, *args), kwargs)
        dtypes = q.dtype, k.dtype
        half = tables == "half"
        if tables == "interleaved":
            cos, sin = torch.cat((cos[..., 0::2],) * 2, dim=-1), torch.cat((sin[..., 0::2],) * 2, dim=-1)
        width = cos.shape[-1] * (2 if half else 1)
        if interleaved or pairs:
            q, k = halves(q, width), halves(k, width)
        # (seq, dim) tables with position_ids (older releases gather per position inside this function)
        position_ids = arguments.get("position_ids") if cos.dim() == 2 else None
        q_out, k_out = rope(q, k, cos, sin, position_ids, unsqueeze_dim=arguments.get("unsqueeze_dim", 1),
                            half_tables=half)
        if pairs:
            q_out, k_out = pairs_of(q_out, width), pairs_of(k_out, width)
        return (q_out.to(dtypes[0]), k_out.to(dtypes[1])) if keeps_dtype else (q_out, k_out)

    apply_rotary_pos_emb.liger_gen = True
    return apply_rotary_pos_emb


def _rope_functions(family: ModelFamily) -> tuple[tuple[str, bool], ...]:
    """(function name, interleaved) of every rotary function of the family that liger-gen replaces."""
    names = ((family.rope_function, False),) if family.rope else ()
    return names + (((family.interleaved_rope, True),) if family.interleaved_rope else ())


def _patch_rope(model: nn.Module, modeling, family: ModelFamily) -> bool:
    """Route the family's rotary functions to liger-gen; whether all of them now are."""
    done = True
    for function, interleaved in _rope_functions(family):
        key = (modeling.__name__, function)
        current = getattr(modeling, function, None)
        if not callable(current):
            raise RuntimeError(f"liger_gen.apply_to: {modeling.__name__} has no {function}; transformers "
                               f"releases tested: {', '.join(TESTED_TRANSFORMERS)}")
        original = _original_rope.setdefault(key, current)
        patched = _patched_rope.get(key)
        if patched is None:
            patched = _transformers_rope(original, family, interleaved, function)
            if _is_function_module(original):
                patched = _routed_function_module(original, patched)
            _patched_rope[key] = patched
        setattr(modeling, function, patched)
        done = done and getattr(modeling, function) is patched
        # transformers 5.0-5.14 keep the function on every attention module too (use_kernelized_func: a
        # ``rotary_fn`` attribute, later a ``_hidden_kernels`` dict); a function pickles by its module's name,
        # which now names the wrapper, so those references must be the wrapper for torch.save to work.
        for module in model.modules():
            if module.__dict__.get("rotary_fn") is original:
                module.rotary_fn = patched
            hidden = module.__dict__.get("_hidden_kernels")
            if isinstance(hidden, dict):
                for key_, value in list(hidden.items()):
                    if value is original:
                        hidden[key_] = patched
    return done


def _rope_is_patched(family: ModelFamily) -> bool:
    """Whether every rotary function of the family is routed to liger-gen in this process now."""
    functions = _rope_functions(family)
    if not functions:
        return False
    try:
        modeling = importlib.import_module(family.modeling_module)
    except ImportError:
        return False
    return all(getattr(modeling, f, None) is _patched_rope.get((modeling.__name__, f)) for f, _ in functions)


def restore_rope() -> None:
    """Undo the process-wide RoPE patch of every family ``apply_to`` patched."""
    for (name, function_name), function in _original_rope.items():
        setattr(importlib.import_module(name), function_name, function)
    _original_rope.clear()


# ------------------------------------------------------------------------------------------------ apply_to


@dataclass
class PatchReport:
    """What ``apply_to`` replaced in one model: counts per kind and the modules it left, with why."""

    family: str
    norms: int = 0
    mlps: int = 0
    experts: int = 0
    fused_adds: int = 0
    fused_layer_classes: list[str] | None = None
    rope: bool = False
    loss: bool = False
    left: list[str] | None = None
    note: str = ""

    def __setstate__(self, state: dict) -> None:
        # a model loaded in another process (torch.load) carries its modules but not the process-wide RoPE
        # routing: the report says what holds here; ``apply_to`` on the loaded model routes RoPE again
        self.__dict__.update(state)
        # the rewritten layer code is process-wide and not part of the pickle: the loaded model's marked norms
        # fuse again once their layer classes are rewritten here (the same rewrite apply_to makes)
        for name in () if _layers_restored else state.get("fused_layer_classes") or ():
            module_name, _, qualname = name.partition(":")
            try:
                cls = getattr(importlib.import_module(module_name), qualname, None)
            except ImportError:
                cls = None
            if isinstance(cls, type):
                _fuse_layer_code(cls)
        family = MODEL_FAMILIES.get(self.family)
        if self.rope and family is not None and not _rope_is_patched(family):
            self.rope = False
            self.note = "; ".join(filter(None, [self.note, "RoPE is not routed in this process: call "
                                                "liger_gen.apply_to(model) on the loaded model"]))

    def summary(self) -> str:
        done = [f"{self.norms} norms", f"{self.mlps} MLPs"] + ([f"{self.experts} experts"] if self.experts
                                                                 else [])
        done += [f"{self.fused_adds} residual adds fused into norms"] if self.fused_adds else []
        done += ["RoPE" if self.rope else "RoPE not patched", "fused LM-head loss" if self.loss else "loss as is"]
        left = f"; left as they are: {'; '.join(self.left)}" if self.left else ""
        return f"liger_gen.apply_to({self.family}): {', '.join(done)}{left}"


def _group(left: list[tuple[str, str]]) -> list[str]:
    """'<class> ×n (<why>)' lines from (class name, why) pairs, in first-seen order."""
    counts: dict[tuple[str, str], int] = {}
    for item in left:
        counts[item] = counts.get(item, 0) + 1
    return [f"{cls} ×{n} ({why})" for (cls, why), n in counts.items()]


def _check_not_sharded(model: nn.Module) -> None:
    """ValueError when ``model``'s parameters are already DTensors (FSDP2's ``fully_shard`` or tensor parallelism
    ran first), or DeepSpeed ZeRO-3 already hooked its modules (``deepspeed.initialize`` ran first): the
    replacement modules would hold sharded weights the kernels cannot take."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without DTensor
        DTensor = ()
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"liger_gen.apply_to: the model is already sharded (parameter {name!r} is a DTensor); "
                             f"call liger_gen.apply_to(model) before fully_shard / parallelize_module, then shard "
                             f"the patched model")
    if hasattr(model, "ds_id"):  # deepspeed.initialize registered its ZeRO-3 hooks on the modules
        raise ValueError("liger_gen.apply_to: DeepSpeed ZeRO-3 already manages this model (deepspeed.initialize "
                         "registered its hooks on its modules; replacement modules would have none and see "
                         "empty weights); call liger_gen.apply_to(model) before deepspeed.initialize (with "
                         "transformers' Trainer: before the Trainer is built).")


def apply_to(model: nn.Module, *, rms_norm: bool = True, swiglu: bool = True, rope: bool = True,
             fused_linear_cross_entropy: bool = True, fused_add_rms_norm: bool = True,
             strict: bool = False) -> nn.Module:
    """Replace the supported parts of a transformers model in place and return the model.

    Supported ``config.model_type``: the keys of ``MODEL_FAMILIES`` (llama, llama4_text, mistral, ministral,
    mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next, qwen3_5_text, qwen3_5_moe_text, gemma, gemma2,
    gemma3_text, phi3, phimoe, granite, granitemoe, olmo2, olmo3, glm4, smollm3, deepseek_v3, gpt_oss, cohere2,
    exaone4, falcon_h1, seed_oss); the module docstring says what each replacement does. The state_dict, the Parameter objects (so an optimizer built before
    still updates them) and the devices are unchanged; meta-device and half-precision models are patched alike.
    Logs one line (logger "liger_gen", INFO) with what was patched and what was left; the same is kept as
    ``model.liger_gen_report`` (a ``PatchReport``). Calling it again on a patched model changes nothing already
    replaced (the log line says so).

    Args:
        model: a transformers model of a supported family (a ``*ForCausalLM`` or its base ``*Model``).
        rms_norm: swap the norm modules (RMSNorm, or LayerNorm for the families that use it).
        swiglu: swap the gated MLP modules for ``liger_gen.nn.GLUMLP`` and route MoE experts' gates.
        rope: route the family's ``apply_rotary_pos_emb`` to ``liger_gen.functional.rope`` (process-wide).
        fused_linear_cross_entropy: compute the training loss of a ``*ForCausalLM`` without logits.
        fused_add_rms_norm: in decoder layers whose forward adds the attention output to the residual stream and
            then applies an RMSNorm (``h = residual + h; residual = h; h = self.norm(h)``), do the add inside
            the norm's kernel (``liger_gen.functional.fused_add_rms_norm``: one pass, same values). Needs
            ``rms_norm``; layers of other layouts (post-norm, parallel blocks, LayerNorm) are left as they are.
        strict: raise instead of leaving a module of a requested kind unpatched; the model is then unchanged.

    Raises:
        ValueError: the model's ``config.model_type`` is not a supported family; with ``strict``, a requested
            replacement could not be made (the message lists the modules and why).
        RuntimeError: the family's modeling module lacks a function or class the table names (a transformers
            release whose modeling code changed); the message names it and the releases tested.

    Distributed training: call it before sharding (``fully_shard``, tensor parallelism) or wrapping (DDP); the
    replaced modules are then sharded like any other. A model whose parameters are already DTensors raises
    ValueError saying so.
    """
    family = family_of(model)
    _check_not_sharded(model)
    try:
        modeling = importlib.import_module(family.modeling_module)
    except ImportError as e:
        raise RuntimeError(f"liger_gen.apply_to: {family.modeling_module} cannot be imported ({e}); transformers "
                           f"releases tested: {', '.join(TESTED_TRANSFORMERS)}") from e
    report = PatchReport(family.model_type, note=family.note)
    already = isinstance(getattr(model, "liger_gen_report", None), PatchReport)
    # first the plan (what replaces what, what stays and why), then, unless strict refuses it, the changes:
    # a refused call leaves the model and the process as they were
    left: list[tuple[str, str]] = []
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    gates: list[tuple[nn.Module, ExpertsGate | BatchedExpertsForward | FusedExpertsForward]] = []
    norm_swaps = 0
    swapped_norms: set[int] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            cls = type(child).__name__
            if rms_norm and family.norm is not None and cls in family.norm_class_names \
                    and not isinstance(child, (RMSNorm, LayerNorm)):
                new = _replace_norm(child, family.norm)
                if new is None:
                    left.append((cls, "weight is not one vector"))
                else:
                    swaps.append((parent, name, new))
                    norm_swaps += 1
                    swapped_norms.add(id(child))
            elif type(child).__module__ != modeling.__name__:
                continue
            elif rms_norm and cls.endswith("NormGated"):
                left.append((cls, "a gated norm (no liger-gen op)"))
            elif swiglu and cls.endswith("Experts"):
                if _is_patched_experts(child):
                    continue
                gate, why = _experts_gate(child, family) if isinstance(getattr(child, "gate_up_proj", None), nn.Parameter) \
                    else (None, "experts: not a packed gate/up layout")
                if gate is None:
                    left.append((cls, why))
                else:
                    gates.append((child, gate))
            elif swiglu and cls.endswith("MLP") and "down_proj" in dict(child.named_children()):
                new, why = _replace_mlp(child)
                if new is None:
                    left.append((cls, why))
                else:
                    swaps.append((parent, name, new))
            elif swiglu and cls.endswith("MLP") and not any(n.endswith("experts") or n == "router"
                                                             for n in dict(child.named_children())):
                left.append((cls, "MLP layout not recognised"))  # e.g. per-expert w1/w2/w3 of older releases
    if rms_norm and family.norm is not None and not norm_swaps and not any(
            type(m).__name__ in family.norm_class_names or isinstance(m, (RMSNorm, LayerNorm))
            for m in model.modules()):
        # the table names classes this release does not have: say so rather than patch half a model
        left.append(("/".join(family.norm_class_names), "no such module in the model (transformers releases "
                     f"tested: {', '.join(TESTED_TRANSFORMERS)})"))
    if rope and not _rope_functions(family):
        left.append(("apply_rotary_pos_emb", family.note or "another RoPE layout"))
    if fused_add_rms_norm and rms_norm and family.norm != "layer":
        refused = {cls: layer_code_refusal(cls) for cls in {type(m) for m in model.modules()}
                   if cls.__module__ == modeling.__name__ and cls.__name__.endswith("DecoderLayer")}
        left += [(type(m).__name__, refused[type(m)]) for m in model.modules() if refused.get(type(m))]
    if strict and left:
        raise ValueError(f"liger_gen.apply_to(strict=True): {family.model_type}: not patched: "
                         f"{'; '.join(_group(left))}; nothing was changed")
    fused_layers = [(m, names) for m in model.modules() if fused_add_rms_norm and rms_norm
                    for names in [_fusable_norms(m, modeling, family.norm, swapped_norms)] if names]
    for parent, name, new in swaps:
        setattr(parent, name, new)
    for module, gate in gates:
        if isinstance(gate, (BatchedExpertsForward, FusedExpertsForward)):
            _install_forward(module, gate)
        else:
            module._apply_gate = gate
    for layer, names in fused_layers:
        for name in names:
            getattr(layer, name).fuse_residual = True
    if rope and _rope_functions(family):
        _patch_rope(model, modeling, family)
    if fused_linear_cross_entropy and type(model).__name__ in family.causal_lm_classes:
        _install_forward(model, FusedLossForward(model, family))  # a base *Model has no LM head: nothing to fuse
    # the report counts what the model holds now, so a second call reports the same model
    report.norms = sum(isinstance(m, (RMSNorm, LayerNorm)) for m in model.modules())
    report.mlps = sum(isinstance(m, GLUMLP) for m in model.modules())
    report.experts = sum(_is_patched_experts(m) for m in model.modules())
    report.fused_adds = _count_fused_adds(model)
    report.fused_layer_classes = sorted({f"{type(m).__module__}:{type(m).__qualname__}" for m in model.modules()
                                         if _fused_norm_names(type(m))})
    report.rope = _rope_is_patched(family)
    report.loss = isinstance(model.__dict__.get("forward"), FusedLossForward)
    report.left = _group(left)
    model.liger_gen_report = report
    logger.info(report.summary() + ("; it was already patched" if already else ""))
    return model


def _count_fused_adds(model: nn.Module) -> int:
    """Marked norms of decoder layers whose forward is rewritten in this process: the adds that run fused."""
    return sum(bool(getattr(getattr(layer, name, None), "fuse_residual", False))
               for layer in model.modules() for name in _fused_norm_names(type(layer)))


def _glu_op(activation: str) -> str:
    """The op (table name) of a gated activation: swiglu for SiLU, geglu for either GELU, clamped_swiglu."""
    return {"silu": "swiglu", "clamped_swiglu": "clamped_swiglu"}.get(activation, "geglu")


def patched_ops(model: nn.Module, *, rope: bool | None = None) -> list[str]:
    """The liger-gen ops a model patched by ``apply_to`` runs in training, in ``liger_gen.ops.all_specs`` order:
    ``rms_norm`` / ``layer_norm`` for its norm modules, ``fused_add_rms_norm`` where decoder layers fuse their
    residual add into the norm, ``swiglu`` / ``geglu`` / ``clamped_swiglu`` for its
    gated MLPs and experts' gates, ``moe_permute`` where the experts run ``liger_gen.functional.moe_experts``,
    ``rope`` when the family's rotary function is routed to liger-gen in this process, and
    ``fused_linear_cross_entropy`` when its loss is fused. ``[]`` for a model ``apply_to`` has not patched.
    ``rope``: whether to count RoPE as routed (None: whether this process routes the family's now)."""
    from liger_gen.ops import all_specs

    report = getattr(model, "liger_gen_report", None)
    if not isinstance(report, PatchReport):
        return []
    ops = set()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            ops.add("rms_norm")
        elif isinstance(m, LayerNorm):
            ops.add("layer_norm")
        elif isinstance(m, GLUMLP):
            ops.add(_glu_op(m.activation))
        for hook in (m.__dict__.get("_apply_gate"), m.__dict__.get("forward")):
            if isinstance(hook, (ExpertsGate, BatchedExpertsForward, FusedExpertsForward)):
                ops.add(_glu_op(hook.activation))
            if isinstance(hook, FusedExpertsForward):
                ops.add("moe_permute")
    if _count_fused_adds(model):
        ops.add("fused_add_rms_norm")
    family = MODEL_FAMILIES.get(report.family)
    if rope if rope is not None else (family is not None and _rope_is_patched(family)):
        ops.add("rope")
    if report.loss:
        ops.add("fused_linear_cross_entropy")
    return [spec.name for spec in all_specs() if spec.name in ops]
