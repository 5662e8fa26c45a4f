"""``apply_to``: the plan of what replaces what in one model, the changes, and the report of what was left
and why; ``patched_ops``."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
from torch import nn

from liger_gen.integrations.transformers import fp8 as fp8_swaps, layers, rope as routing, vision_attention as varlen
from liger_gen.integrations.transformers.families import (TESTED_TRANSFORMERS, ModelFamily, family_named,
                                                          family_of)
from liger_gen.integrations.transformers.loss import FusedLossForward
from liger_gen.integrations.transformers.modules import (BatchedExpertsForward, ExpertsGate, FusedExpertsForward,
                                                         experts_gate, install_forward, is_patched_experts,
                                                         replace_mlp, replace_norm)
from liger_gen.nn import Float8Linear, GLUMLP, LayerNorm, RMSNorm, SquaredReLUMLP
from liger_gen.runtime.fp8 import Float8Recipe

logger = logging.getLogger("liger_gen")

# ------------------------------------------------------------------------------------------------ apply_to


@dataclass
class PatchReport:
    """What ``apply_to`` replaced in one model: counts per kind (``fp8``: the ``Float8Linear`` layers) and the
    modules it left, with why."""

    family: str
    norms: int = 0
    mlps: int = 0
    experts: int = 0
    fused_adds: int = 0
    fused_layer_classes: list[str] | None = None
    rope: bool = False
    loss: bool = False
    fp8: int = 0
    fp8_float32: int = 0  # of those, the layers with float32 weights: FP8 GEMMs only under a bf16 autocast
    fp8_norms: int = 0  # norms whose kernel writes the FP8 operands of the projections that read their output
    fp8_mlps: int = 0  # gated MLPs whose GLU kernels write their FP8 projections' operands (glu_fp8)
    vision_attention: int = 0  # vision attention modules routed to the variable-length path (vision_attention.py)
    left: list[str] | None = None
    note: str = ""
    text_family: str | None = None  # a vision-language wrapper's (Llava, ...): the family of its language model

    def __setstate__(self, state: dict) -> None:
        # a model loaded in another process (torch.load) carries its modules but not the process-wide RoPE
        # routing: the report says what holds here; ``apply_to`` on the loaded model routes RoPE again
        self.__dict__.update(state)
        # the rewritten layer code is process-wide and not part of the pickle: the loaded model's marked norms
        # fuse again once their layer classes are rewritten here (the same rewrite apply_to makes)
        for name in () if layers.restored() else state.get("fused_layer_classes") or ():
            module_name, _, qualname = name.partition(":")
            try:
                cls = getattr(importlib.import_module(module_name), qualname, None)
            except ImportError:
                cls = None
            if isinstance(cls, type):
                layers.fuse_layer_code(cls)
        family = _report_family(self)
        if self.rope and family is not None and not routing.rope_is_patched(family):
            self.rope = False
            self.note = "; ".join(filter(None, [self.note, "RoPE is not routed in this process: call "
                                                "liger_gen.apply_to(model) on the loaded model"]))

    def summary(self) -> str:
        done = [f"{self.norms} norms", f"{self.mlps} MLPs"] + ([f"{self.experts} experts"] if self.experts
                                                                 else [])
        done += [f"{self.fused_adds} residual adds fused into norms"] if self.fused_adds else []
        n32 = self.fp8_float32  # a report pickled before the field has the class default, 0
        done += [f"{self.fp8} linear layers in FP8" + (f" ({n32} of float32 weights: FP8 under a bf16 torch.autocast, "
                                                       f"F.linear without one)" if n32 else "")] if self.fp8 else []
        done += [f"{self.fp8_norms} norms writing their FP8 operands"] if self.fp8_norms else []
        done += [f"{self.fp8_mlps} MLPs writing their FP8 operands"] if self.fp8_mlps else []
        nv = getattr(self, "vision_attention", 0)  # (a report pickled before the field has none)
        done += [f"{nv} vision attention layer{'s' * (nv != 1)} routed to the variable-length path (while the "
                 f"tower's attention is sdpa; one call a layer on a GPU in bf16/fp16)"] if nv else []
        done += ["RoPE" if self.rope else "RoPE not patched", "fused LM-head loss" if self.loss else "loss as is"]
        left = f"; left as they are: {'; '.join(self.left)}" if self.left else ""
        text = f", text model {self.text_family}" if self.text_family else ""
        return f"liger_gen.apply_to({self.family}{text}): {', '.join(done)}{left}"


def _report_family(report: PatchReport) -> ModelFamily | None:
    """The family a report was made for (a vision-language wrapper's composed with its text family), or None."""
    try:
        return family_named(report.family, getattr(report, "text_family", None))
    except ValueError:
        return None


def _submodule(model: nn.Module, path: str | None) -> nn.Module | None:
    """``model.<path>``, or ``model.model.<path>`` (a ``*ForConditionalGeneration`` holds its base model there);
    ``path`` may be dotted ("visual.merger")."""
    if path is None:
        return None
    for found in (model, getattr(model, "model", None)):
        for name in path.split("."):
            found = getattr(found, name, None) if isinstance(found, nn.Module) else None
        if isinstance(found, nn.Module):
            return found
    return None


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
             vision_attention: bool = True, fp8: bool | Float8Recipe = False, strict: bool = False) -> nn.Module:
    """Replace the supported parts of a transformers model in place and return the model.

    Supported ``config.model_type``: the keys of ``MODEL_FAMILIES`` (cohere2, deepseek_v2, deepseek_v3, deepseek_v4,
    ernie4_5, ernie4_5_moe, exaone4, falcon_h1, gemma, gemma2, gemma3_text, gemma4_text, glm4, glm4_moe, gpt_oss,
    granite, granitemoe, hunyuan_v1_dense, hunyuan_v1_moe, lfm2, lfm2_moe, llama, llama4_text, minimax, ministral,
    mistral, mixtral, nemotron, olmo2, olmo3, olmoe, phi3, phimoe, qwen2, qwen2_moe, qwen3, qwen3_5_moe_text,
    qwen3_5_text, qwen3_moe, qwen3_next, seed_oss, smollm3; vision-language, their ``*ForConditionalGeneration``
    and base models: gemma3, gemma4, glm4v, glm4v_moe, llama4, mllama, qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_5_moe,
    qwen3_vl, qwen3_vl_moe, whose vision towers' norms and gated MLPs are patched too and whose loss is fused
    alike; and the wrappers internvl, llava, paligemma, smolvlm, whose
    language model is patched as the family of its ``config.text_config.model_type`` and their vision towers and
    loss as the others'; a projector that a family leaves as it is is listed in the report); the module docstring
    says what each replacement does. The state_dict, the Parameter objects (so an optimizer built before still
    updates them) and the devices are unchanged; meta-device and half-precision models are patched alike.
    Logs one line (logger "liger_gen", INFO) with what was patched and what was left; the same is kept as
    ``model.liger_gen_report`` (a ``PatchReport``). Calling it again on a patched model changes nothing already
    replaced (the log line says so).

    Args:
        model: a transformers model of a supported family (a ``*ForCausalLM``, a vision-language
            ``*ForConditionalGeneration``, or its base ``*Model``).
        rms_norm: swap the norm modules (RMSNorm, or LayerNorm for the families that use it).
        swiglu: swap the gated MLP modules for ``liger_gen.nn.GLUMLP`` (Nemotron's squared-ReLU MLPs, not gated,
            for ``liger_gen.nn.SquaredReLUMLP``) and route MoE experts' gates.
        rope: route the family's ``apply_rotary_pos_emb`` to ``liger_gen.functional.rope`` (process-wide).
        fused_linear_cross_entropy: compute the training loss of a ``*ForCausalLM`` (or a vision-language
            ``*ForConditionalGeneration``) without logits.
        fused_add_rms_norm: in decoder layers whose forward adds the attention output to the residual stream and
            then applies an RMSNorm (``h = residual + h; residual = h; h = self.norm(h)``), do the add inside
            the norm's kernel (``liger_gen.functional.fused_add_rms_norm``: one pass, same values). Needs
            ``rms_norm``; layers of other layouts (post-norm, parallel blocks, LayerNorm) are left as they are.
        vision_attention: in the vision towers that attend within each image (or window) of one long sequence
            (the Qwen vision-language families, GLM-4V), run a block's ``sdpa`` attention in one
            variable-length FlashAttention call (``torch.nn.attention.varlen.varlen_attn``, torch 2.10 and later)
            instead of one call per image or window: the same attention, without the per-piece launches. Each
            vision attention module of an ``sdpa`` tower reads a view of its config that names the function
            ``liger_gen.integrations.transformers.vision_attention`` registers (the model's config is unchanged;
            an ``eager`` or ``flash_attention_*`` tower is kept, and a tower switched away from ``sdpa`` later runs
            what it is switched to); on a CPU, a GPU before compute capability 8.0, in float32, or with dropout,
            that function runs SDPA once per piece as transformers does.
        fp8: FP8 training, opt-in: True (the default ``liger_gen.Float8Recipe()``) or a ``Float8Recipe``. Every
            ``nn.Linear`` inside the decoder layers (attention q/k/v/o, MLP gate/up/down or packed gate_up,
            shared experts) becomes a ``liger_gen.nn.Float8Linear`` in place: its forward, input-gradient and
            weight-gradient GEMMs run ``torch._scaled_mm`` on e4m3 operands with dynamic power-of-two scales (per
            token for activations and gradients, per output or input channel for the weight, per channel over
            the tokens for the weight gradient; gradients in the recipe's ``grad_dtype``), writing bf16. The
            recipe's ``modules`` (fnmatch patterns on qualified names) restrict which layers are converted.
            Everything else stays in its dtype: embeddings, norms, attention, the LM head and its loss. Listed in
            the report with the reason, and left as they are: layers whose in_features or out_features is not a
            multiple of 16, weights neither bf16 nor fp32, parameters on a device without FP8 GEMMs (a GPU before
            compute capability 8.9, a CPU torch build without ``torch._scaled_mm``), MoE experts' fused 3-D
            parameters, and MoE routers (never converted; ``strict`` does not count them). A meta-device model is
            converted without the device check: each ``Float8Linear`` computes ``F.linear`` per call on a device
            without FP8 GEMMs, and for inputs that are not bf16 outside a bf16 ``torch.autocast``.
        strict: raise instead of leaving a module of a requested kind unpatched; the model is then unchanged. The
            parts a family leaves as they are by design (a vision-language projector) are listed, not refused.

    Raises:
        ValueError: the model's ``config.model_type`` is not a supported family (or a wrapper's
            ``config.text_config.model_type`` is not a supported text family); with ``strict``, a requested
            replacement could not be made (the message lists the modules and why).
        RuntimeError: the family's modeling module lacks a function or class the table names (a transformers
            release whose modeling code changed); the message names it and the releases tested.

    Distributed training: call it before sharding (``fully_shard``, tensor parallelism) or wrapping (DDP); the
    replaced modules are then sharded like any other. A model whose parameters are already DTensors raises
    ValueError saying so.
    """
    family = family_of(model)
    recipe = fp8_swaps.fp8_recipe(fp8)
    _check_not_sharded(model)
    try:
        modeling = importlib.import_module(family.modeling_module)
    except ImportError as e:
        raise RuntimeError(f"liger_gen.apply_to: {family.modeling_module} cannot be imported ({e}); transformers "
                           f"releases tested: {', '.join(TESTED_TRANSFORMERS)}") from e
    report = PatchReport(family.model_type, text_family=family.text_family, note=family.note)
    already = isinstance(getattr(model, "liger_gen_report", None), PatchReport)
    # first the plan (what replaces what, what stays and why), then, unless strict refuses it, the changes:
    # a refused call leaves the model and the process as they were
    left: list[tuple[str, str]] = []
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    gates: list[tuple[nn.Module, ExpertsGate | BatchedExpertsForward | FusedExpertsForward]] = []
    norm_swaps = 0
    swapped_norms: set[int] = set()
    # a vision-language family's vision tower may live in its own modeling module (CLIP, SigLIP): its MLPs are
    # swapped, or listed, like the text stack's
    own_modules = {modeling.__name__}
    vision = _submodule(model, family.vision_tower)
    if vision is not None:
        own_modules.add(type(vision).__module__)
    # the parts the family leaves as they are by design (a projector): not entered, listed in the report
    kept: list[tuple[str, str]] = []
    kept_ids: set[int] = set()
    for part_name, why in family.kept:
        part = _submodule(model, part_name)
        if part is not None:  # named by its class, or by its path where that is torch's (a bare nn.Linear)
            kept.append((part_name if type(part).__module__.startswith("torch.") else type(part).__name__, why))
            kept_ids.update(id(m) for m in part.modules())
    for parent in list(model.modules()):
        if id(parent) in kept_ids:
            continue
        for name, child in list(parent.named_children()):
            cls = type(child).__name__
            if id(child) in kept_ids:
                continue
            if rms_norm and family.norm is not None and cls in family.norm_class_names \
                    and not isinstance(child, (RMSNorm, LayerNorm)):
                new = replace_norm(child, family.norm_kind(cls))
                if new is None:
                    left.append((cls, "weight is not one vector"))
                else:
                    swaps.append((parent, name, new))
                    norm_swaps += 1
                    swapped_norms.add(id(child))
            elif type(child).__module__ not in own_modules:
                continue
            elif rms_norm and cls.endswith("NormGated"):
                left.append((cls, "a gated norm (no liger-gen op)"))
            elif swiglu and cls.endswith("Experts"):
                if is_patched_experts(child):
                    continue
                gate, why = experts_gate(child, family) if isinstance(getattr(child, "gate_up_proj", None), nn.Parameter) \
                    else (None, "experts: not a packed gate/up layout")
                if gate is None:
                    left.append((cls, why))
                else:
                    gates.append((child, gate))
            elif swiglu and cls.endswith(("MLP", "Mlp")) and "down_proj" in dict(child.named_children()):
                new, why = replace_mlp(child)
                if new is None:
                    left.append((cls, why))
                else:
                    swaps.append((parent, name, new))
            elif swiglu and cls.endswith(("MLP", "Mlp")) and not any(n.endswith("experts") or n == "router"
                                                             for n in dict(child.named_children())):
                children = {n.rpartition("_")[2] for n in dict(child.named_children())}
                left.append((cls, "not gated (fc1, activation, fc2): no liger-gen op" if {"fc1", "fc2"} <= children
                             else "MLP layout not recognised"))  # e.g. per-expert w1/w2/w3 of older releases
    if rms_norm and family.norm is not None and not norm_swaps and not any(
            type(m).__name__ in family.norm_class_names or isinstance(m, (RMSNorm, LayerNorm))
            for m in model.modules()):
        # the table names classes this release does not have: say so rather than patch half a model
        left.append(("/".join(family.norm_class_names), "no such module in the model (transformers releases "
                     f"tested: {', '.join(TESTED_TRANSFORMERS)})"))
    if rope and not routing.rope_functions(family):
        left.append(("apply_rotary_pos_emb", family.note or "another RoPE layout"))
    if fused_add_rms_norm and rms_norm and family.norm != "layer":
        refused = {cls: layers.layer_code_refusal(cls) for cls in {type(m) for m in model.modules()}
                   if cls.__module__ == modeling.__name__ and cls.__name__.endswith("DecoderLayer")}
        left += [(type(m).__name__, refused[type(m)]) for m in model.modules() if refused.get(type(m))]
    fuse_loss = fused_linear_cross_entropy and type(model).__name__ in family.causal_lm_classes
    if fuse_loss and family.language_model is not None \
            and _submodule(getattr(model, "model", None), family.language_model) is None:
        # releases before 4.52 hold a *ForCausalLM (the LM head inside) where 5.x hold the base model
        fuse_loss = False
        left.append((type(model).__name__, f"loss: the fused loss needs the base model at .model and its language "
                     f"model at .model.{family.language_model} (transformers 4.52 and later)"))
    # a *ForConditionalGeneration holding a *ForCausalLM (Llama 4's): the causal LM inside gives the hidden states
    needs_inside = bool(fuse_loss and family.causal_lm_inside and not hasattr(model, "model"))
    inside = getattr(model, family.causal_lm_inside, None) if needs_inside else None
    if needs_inside and type(inside).__name__ not in family.causal_lm_classes:
        fuse_loss, inside = False, None
        left.append((type(model).__name__, f"loss: the fused loss needs a causal LM at .{family.causal_lm_inside} "
                     f"(one of {', '.join(family.causal_lm_classes)})"))
    # the vision tower's attention over cu_seqlens pieces: one variable-length call per block
    vision_attention_modules = []
    tower = _submodule(model, family.vision_attention) if vision_attention else None
    if tower is not None and getattr(tower, "config", None) is not None:
        # routed by an earlier call: its modules follow the tower's implementation, whatever it says now
        why = None if varlen.count(tower) else varlen.refusal(modeling, tower.config)
        if why is None:
            vision_attention_modules = varlen.attention_modules(tower)
            if not vision_attention_modules:
                left.append((type(tower).__name__, "vision attention: no attention module reads the tower's config"))
        elif getattr(tower.config, "_attn_implementation", None) != "sdpa":  # the user's choice: listed, not refused
            kept.append((type(tower).__name__, why))
        else:
            left.append((type(tower).__name__, why))
    fp8_plan = fp8_swaps.plan_fp8(model, recipe) if recipe is not None else None
    left += fp8_plan.left if fp8_plan else []
    if strict and left:
        raise ValueError(f"liger_gen.apply_to(strict=True): {family.model_type}: not patched: "
                         f"{'; '.join(_group(left))}; nothing was changed")
    fused_layers = [(m, names) for m in model.modules() if fused_add_rms_norm and rms_norm
                    for names in [layers.fusable_norms(m, modeling, family.norm, swapped_norms)] if names]
    for parent, name, new in swaps:
        setattr(parent, name, new)
    for module, gate in gates:
        if isinstance(gate, (BatchedExpertsForward, FusedExpertsForward)):
            install_forward(module, gate)
        else:
            module._apply_gate = gate
    for layer, names in fused_layers:
        for name in names:
            getattr(layer, name).fuse_residual = True
    if fp8_plan is not None:
        fp8_swaps.convert(fp8_plan)
        fp8_swaps.mark_fp8_norms(model)
    if rope and routing.rope_functions(family):
        routing.patch_rope(model, modeling, family)
    varlen.route(vision_attention_modules)
    if fuse_loss:
        install_forward(model, FusedLossForward(model, family))  # a base *Model has no LM head: nothing to fuse
        if inside is not None:
            install_forward(inside, FusedLossForward(inside, family))  # Llama 4's: hidden states for the loss above
    # the report counts what the model holds now, so a second call reports the same model
    report.norms = sum(isinstance(m, (RMSNorm, LayerNorm)) for m in model.modules())
    report.mlps = sum(isinstance(m, (GLUMLP, SquaredReLUMLP)) for m in model.modules())
    report.experts = sum(is_patched_experts(m) for m in model.modules())
    report.fused_adds = count_fused_adds(model)
    report.fused_layer_classes = sorted({f"{type(m).__module__}:{type(m).__qualname__}" for m in model.modules()
                                         if layers.fused_norm_names(type(m))})
    report.rope = routing.rope_is_patched(family)
    report.loss = isinstance(model.__dict__.get("forward"), FusedLossForward)
    report.fp8 = fp8_swaps.count_fp8(model)
    report.fp8_norms = sum(bool(m.__dict__.get("fp8_consumers")) for m in model.modules())
    report.fp8_mlps = sum(isinstance(m, GLUMLP) and isinstance(m.down_proj, Float8Linear) for m in model.modules())
    report.vision_attention = varlen.count(model)
    report.fp8_float32 = sum(m.weight.dtype == torch.float32 for m in fp8_plan.convert) if fp8_plan else 0
    report.left = _group(left + kept + (fp8_plan.kept if fp8_plan else []))
    model.liger_gen_report = report
    logger.info(report.summary() + ("; it was already patched" if already else ""))
    return model


def count_fused_adds(model: nn.Module) -> int:
    """Marked norms of decoder layers whose forward is rewritten in this process: the adds that run fused."""
    return sum(bool(getattr(getattr(layer, name, None), "fuse_residual", False))
               for layer in model.modules() for name in layers.fused_norm_names(type(layer)))


def _glu_op(activation: str) -> str:
    """The op (table name) of a gated activation: swiglu for SiLU, geglu for either GELU, clamped_swiglu."""
    return {"silu": "swiglu", "clamped_swiglu": "clamped_swiglu"}.get(activation, "geglu")


def patched_ops(model: nn.Module, *, rope: bool | None = None) -> list[str]:
    """The liger-gen ops a model patched by ``apply_to`` runs in training, in ``liger_gen.ops.all_specs`` order:
    ``rms_norm`` / ``layer_norm`` for its norm modules, ``fused_add_rms_norm`` where decoder layers fuse their
    residual add into the norm, ``swiglu`` / ``geglu`` / ``clamped_swiglu`` for its
    gated MLPs and experts' gates, ``squared_relu`` for its squared-ReLU MLPs (Nemotron's), ``moe_permute`` where
    the experts run ``liger_gen.functional.moe_experts``,
    ``rope`` when the family's rotary function is routed to liger-gen in this process,
    ``fused_linear_cross_entropy`` when its loss is fused, ``fp8_quantize`` and ``fp8_cast_transpose`` where
    linear layers run in FP8, ``rms_norm_fp8`` where norms write their FP8 operands, and ``glu_fp8`` where gated
    MLPs do. ``[]`` for a model ``apply_to`` has not patched.
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
        elif isinstance(m, SquaredReLUMLP):
            ops.add("squared_relu")
        for hook in (m.__dict__.get("_apply_gate"), m.__dict__.get("forward")):
            if isinstance(hook, (ExpertsGate, BatchedExpertsForward, FusedExpertsForward)):
                ops.add(_glu_op(hook.activation))
            if isinstance(hook, FusedExpertsForward):
                ops.add("moe_permute")
    if count_fused_adds(model):
        ops.add("fused_add_rms_norm")
    if report.fp8:
        ops.update(("fp8_quantize", "fp8_cast_transpose"))
    if report.fp8_norms:
        ops.add("rms_norm_fp8")
    if getattr(report, "fp8_mlps", 0):  # (a report pickled before the field has none)
        ops.add("glu_fp8")
    family = _report_family(report)
    if rope if rope is not None else (family is not None and routing.rope_is_patched(family)):
        ops.add("rope")
    if report.loss:
        ops.add("fused_linear_cross_entropy")
    return [spec.name for spec in all_specs() if spec.name in ops]
