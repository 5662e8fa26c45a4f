"""FP8 training in ``apply_to(model, fp8=...)``: which linear layers of the decoder layers become
``liger_gen.nn.Float8Linear``, and which stay in their dtype, and why.

The plan is made before anything changes (so ``strict`` can refuse it), then ``convert`` applies it in place
(``Float8Linear.from_linear``: the Parameters, hooks and optimizer state stay). What is converted: every
``torch.nn.Linear`` inside a module whose class name ends in ``DecoderLayer`` (attention q/k/v/o, MLP
gate/up/down or packed gate_up, shared experts, linear-attention and Mamba projections), or, when the recipe names
``modules``, those of them whose qualified name matches one of its patterns. What stays, listed in the report:

- layers the FP8 GEMM cannot take: in_features or out_features not a multiple of 16, a weight that is neither
  bf16 nor fp32, parameters on a device without FP8 GEMMs (a GPU before compute capability 8.9, a CPU torch
  build without ``torch._scaled_mm``), a subclass of ``nn.Linear`` with its own forward;
- MoE experts whose weights are fused 3-D Parameters (transformers' ``*Experts`` modules), not ``nn.Linear``;
- MoE routers (a module named ``gate`` or ``router``, or a linear layer inside one, whose weight has one row per
  expert): never converted, by design (a handful of columns, and the top-k choice they feed is sensitive to rounding); ``strict`` does not
  count them as failures.

Embeddings and the LM head are outside the decoder layers and never converted. Parameters on the meta device are
converted without the device check: ``Float8Linear`` decides per call (a device without FP8 GEMMs computes
``F.linear``).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from liger_gen.nn import Float8Linear
from liger_gen.ops.fp8.linear import WEIGHT_DTYPES
from liger_gen.runtime.fp8 import Float8Recipe, fp8_unsupported_reason, gemm_dims_reason

ROUTER_NAMES = ("gate", "router")
#: config attributes that hold a MoE model's number of routed experts, across families
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def fp8_recipe(fp8) -> Float8Recipe | None:
    """The recipe ``apply_to``'s ``fp8`` argument asks for: None (False), the defaults (True) or the one given.

    Raises TypeError for anything else."""
    if isinstance(fp8, Float8Recipe):
        return fp8
    if fp8 is True:
        return Float8Recipe()
    if fp8 is False or fp8 is None:
        return None
    raise TypeError(f"liger_gen.apply_to: fp8 must be a bool or a liger_gen.Float8Recipe, got {type(fp8).__name__}")


@dataclass
class Fp8Plan:
    """What ``apply_to`` does for FP8 in one model: the linear layers to convert, those it must leave (``left``,
    refused by ``strict``) and the routers it keeps by design (``kept``); items are (name pattern, why)."""

    recipe: Float8Recipe
    convert: list[nn.Linear] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)


def _pattern(name: str) -> str:
    """The qualified name with layer indices as ``*`` ("model.layers.*.mlp.down_proj"): one report line for the
    same module of every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _expert_counts(model: nn.Module) -> set[int]:
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)] if config is not None else []
    return {n for c in configs if c is not None for key in EXPERT_COUNT_KEYS
            for n in [getattr(c, key, None)] if isinstance(n, int) and n > 0}


def _is_router(name: str, module: nn.Module, parent: nn.Module | None, counts: set[int],
               grandparent: nn.Module | None = None) -> bool:
    """A MoE router: named gate/router, or a linear layer inside a module so named (Hunyuan's ``gate.wg``,
    Gemma 4's ``router.proj``), with a 2-D weight of one row per expert (the config's expert count, or the number
    of the router's sibling ``experts``)."""
    weight = getattr(module, "weight", None)
    if getattr(weight, "dim", lambda: 0)() != 2:
        return False
    parts = name.split(".")
    if parts[-1] not in ROUTER_NAMES:
        if len(parts) < 2 or parts[-2] not in ROUTER_NAMES or not isinstance(module, nn.Linear):
            return False
        parent = grandparent  # the router module's parent holds the experts
    siblings = set(counts)
    experts = getattr(parent, "experts", None) if parent is not None else None
    if isinstance(experts, nn.ModuleList):
        siblings.add(len(experts))
    elif isinstance(experts, nn.Module):
        siblings |= {p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3}
    return weight.shape[0] in siblings


def _linear_reason(module: nn.Linear) -> str | None:
    """Why this linear layer cannot take the FP8 GEMMs, or None."""
    if type(module) is not nn.Linear and not isinstance(module, Float8Linear):
        return f"a subclass of nn.Linear ({type(module).__name__}) with its own forward"
    weight = module.weight
    reason = gemm_dims_reason(module.in_features, module.out_features)
    if reason:
        return reason
    if weight.dtype not in WEIGHT_DTYPES:
        return "FP8 GEMMs take bf16 or fp32 weights"
    if weight.device.type != "meta":  # meta: decided per call (see the module docstring)
        return fp8_unsupported_reason(weight.device)
    return None


def plan_fp8(model: nn.Module, recipe: Float8Recipe) -> Fp8Plan:
    """The FP8 plan of ``model`` under ``recipe`` (see the module docstring); changes nothing."""
    plan = Fp8Plan(recipe)
    counts = _expert_counts(model)
    layers = [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        plan.left.append(("decoder layers", "no *DecoderLayer module in the model: no linear layer is FP8"))
    seen: set[int] = set()
    for layer_name, layer in layers:
        parents = {f"{layer_name}.{n}" if n else layer_name: m for n, m in layer.named_modules()}
        for name, module in parents.items():
            if id(module) in seen or module is layer:
                continue
            seen.add(id(module))
            if recipe.modules and not any(fnmatch.fnmatchcase(name, p) for p in recipe.modules):
                continue
            parent_name = name.rsplit(".", 1)[0]
            parent = parents.get(parent_name)
            grandparent = parents.get(parent_name.rsplit(".", 1)[0])
            dtype = str(getattr(getattr(module, "weight", None), "dtype", "")).removeprefix("torch.")
            if _is_router(name, module, parent, counts, grandparent):
                plan.kept.append((_pattern(name), f"MoE router: stays {dtype}, by design"))
            elif isinstance(module, nn.Linear):
                why = _linear_reason(module)
                if why is None:
                    plan.convert.append(module)
                else:
                    plan.left.append((_pattern(name), f"stays {dtype}: {why}"))
            elif type(module).__name__.endswith("Experts") or name.endswith("experts"):
                fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 3]
                if fused:
                    dtype = str(module.get_parameter(fused[0]).dtype).removeprefix("torch.")
                    plan.left.append((_pattern(name), f"MoE experts' fused parameters {', '.join(fused)} are not "
                                                      f"nn.Linear: they stay {dtype}"))
    return plan


def convert(plan: Fp8Plan) -> None:
    """Apply ``plan``: each planned ``nn.Linear`` becomes a ``Float8Linear`` in place (a second call leaves them
    so, with the plan's recipe)."""
    for module in plan.convert:
        Float8Linear.from_linear(module, plan.recipe)


def count_fp8(model: nn.Module) -> int:
    """The model's ``Float8Linear`` layers."""
    return sum(isinstance(m, Float8Linear) for m in model.modules())


#: a pre-norm decoder layer's norms and the projections that read their output
NORM_CONSUMERS = {"input_layernorm": (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("qkv_proj",))),
                  "post_attention_layernorm": (("mlp", ("gate_proj", "up_proj")), ("mlp", ("gate_up_proj",)))}


#: the children of a plain pre-norm decoder layer (Llama's, and the many families built like it); dropouts aside
PRE_NORM_CHILDREN = frozenset(("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))


def mark_fp8_norms(model: nn.Module) -> int:
    """Give each pre-norm decoder layer's liger-gen ``RMSNorm`` whose output the ``Float8Linear`` projections
    read (the input norm before q, k and v; the post-attention norm before gate and up) those projections, so
    its kernel writes their FP8 operands (``RMSNorm.fp8_consumers``). Only layers made of attention, MLP and
    those two norms (and dropouts) are marked: where a layer holds more (Gemma 2/3 and OLMo 2's extra norms,
    which normalise the attention's output; Falcon-H1's Mamba mixer, which reads the input norm's output beside
    the attention), its norms stay plain; so do norms whose weights are not bf16 (a float32 model under a bf16
    autocast: the projections cast the norm's float32 output and quantize it themselves). Returns the number of
    norms marked."""
    from liger_gen.nn import RMSNorm

    marked = 0
    for layer in model.modules():
        if not type(layer).__name__.endswith("DecoderLayer") or any(
                name not in PRE_NORM_CHILDREN and not isinstance(child, nn.Dropout)
                for name, child in layer.named_children()):
            continue
        for norm_name, layouts in NORM_CONSUMERS.items():
            norm = getattr(layer, norm_name, None)
            # bf16 weights: the norm's output is the projections' bf16 input (an fp32 norm under autocast is not)
            if not isinstance(norm, RMSNorm) or norm.weight is None or norm.weight.dtype != torch.bfloat16:
                continue
            for block_name, names in layouts:
                block = getattr(layer, block_name, None)
                consumers = tuple(getattr(block, n, None) for n in names)
                if block is not None and all(isinstance(m, Float8Linear) for m in consumers):
                    norm.fp8_consumers = consumers
                    marked += 1
                    break
    return marked
