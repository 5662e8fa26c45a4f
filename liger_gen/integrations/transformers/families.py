"""The model families ``apply_to`` patches, as data: one ``ModelFamily`` per ``config.model_type``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# transformers releases the family table was checked against (the convergence tests run on them)
TESTED_TRANSFORMERS = ("4.51.3", "4.57.1", "5.0.0", "5.14.1", "5.17.0", "5.24.0", "5.25.0")


@dataclass(frozen=True)
class ModelFamily:
    """One family's modeling module and what liger-gen replaces in it (see the module docstring).

    model_type: ``config.model_type``. module: the modeling module. prefix: its class-name prefix ("Llama").
    norm: the formula of its norm classes ("llama", "gemma", "fp32", "layer", "layer1p": LayerNorm of 1 + w,
    Nemotron; None: not patched).
    norm_classes: the classes to swap (default ``<prefix>RMSNorm``). rope: whether its ``apply_rotary_pos_emb``
    is the rotate-half layout ``liger_gen.functional.rope`` computes; rope_keeps_dtype: whether that function
    casts its outputs back to q's and k's dtypes (OLMo 2/3) rather than promoting them with cos/sin's;
    rope_tables: "full" (cos/sin hold cat(freqs, freqs), as Llama's), "half" (one angle per pair, GPT-OSS),
    "interleaved" (each angle twice in a row, Cohere) or "complex" (one complex table ``freqs_cis`` of
    cos + i·sin per pair, passed as ``(xq, xk, freqs_cis)``: Llama 4's and DeepSeek-V2's ``apply_rotary_emb``);
    rope_heads_dim: with complex tables, the dim of q and k that holds the heads (2: (batch, seq, heads, head_dim),
    Llama 4; 1: (batch, heads, seq, head_dim), DeepSeek-V2); rope_single: the function rotates one tensor,
    ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` (Gemma 4); rope_function: the name of the replaced
    function; rope_pairs: the function rotates interleaved pairs (x0, x1), (x2, x3), ... of the rotary dims and
    returns them in that layout (GLM-4, Cohere 2, Llama 4, ERNIE 4.5);
    interleaved_rope: the name of a second function that rotates interleaved pairs of a de-interleavable layout
    (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``), routed to liger-gen too. mlp: whether its gated MLP
    modules are patched. causal_lm: the class names whose LM-head loss is fused (default ``<prefix>ForCausalLM``; a
    multimodal family's ``*ForConditionalGeneration``, whose base model takes the images and returns the text stack's
    hidden states). norm_classes may name torch's ``LayerNorm`` beside the family's RMSNorm classes: a multimodal
    family's vision tower, swapped for liger-gen's LayerNorm. logits: the transform between
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
    rope_heads_dim: int = 2
    rope_single: bool = False
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
# what a Qwen vision-language family leaves as transformers' own
_VISION_LEFT = ("the vision tower's patch embedding, attention and 2-D RoPE (apply_rotary_pos_emb_vision) and the "
                "patch merger stay transformers' own")
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
    _F("deepseek_v2", "DeepseekV2", rope_function="apply_rotary_emb", rope_tables="complex", rope_pairs=True,
       rope_keeps_dtype=True, rope_heads_dim=1),
    _F("hunyuan_v1_dense", "HunYuanDenseV1"),
    _F("hunyuan_v1_moe", "HunYuanMoEV1"),
    _F("glm4_moe", "Glm4Moe"),
    _F("olmoe", "Olmoe"),
    _F("ernie4_5", "Ernie4_5", rope_pairs=True, rope_keeps_dtype=True),
    _F("ernie4_5_moe", "Ernie4_5_Moe", rope_pairs=True, rope_keeps_dtype=True),
    _F("lfm2", "Lfm2", note="the short-convolution blocks stay transformers' own; the w1/w3/w2 MLPs and the "
       "residual adds (added before the norm's call) are not in a layout apply_to rewrites"),
    _F("lfm2_moe", "Lfm2Moe", note="the short-convolution blocks stay transformers' own; the dense layers' "
       "w1/w3/w2 MLPs and the residual adds (added before the norm's call) are not in a layout apply_to rewrites"),
    _F("minimax", "MiniMax", note="the lightning (linear) attention stays transformers' own; the residual adds "
       "are scaled (alpha·residual + beta·x) and stay unfused"),
    _F("nemotron", "Nemotron", norm="layer1p", norm_classes=("NemotronLayerNorm1P",),
       note="the squared-ReLU MLP (not gated) stays transformers' own"),
    _F("gemma4_text", "Gemma4", norm="fp32", logits="softcap", rope_single=True,
       module="transformers.models.gemma4.modeling_gemma4"),
    # multimodal (vision-language): the text stack as a text family's; the vision tower's RMSNorm / LayerNorm and
    # gated MLPs where it has them; the loss of the *ForConditionalGeneration. Qwen's multimodal RoPE (M-RoPE, its
    # sections interleaved in Qwen 3-VL) is assembled into per-token cos/sin tables by the text rotary embedding
    # module, so the apply_rotary_pos_emb it feeds is the plain rotate-half rotation
    _F("qwen2_5_vl", "Qwen2_5_VL", causal_lm=("Qwen2_5_VLForConditionalGeneration",),
       note=_VISION_LEFT + " (but for its RMSNorm); the vision blocks' RMSNorms and SwiGLU MLPs are patched"),
    _F("qwen2_vl", "Qwen2VL", norm_classes=("Qwen2VLRMSNorm", "LayerNorm"), causal_lm=("Qwen2VLForConditionalGeneration",),
       note=_VISION_LEFT + " (but for its LayerNorm); the vision blocks' LayerNorms are patched, their QuickGELU "
       "MLPs (fc1/fc2, not gated) stay"),
    _F("qwen3_vl", "Qwen3VL", norm_classes=("Qwen3VLTextRMSNorm", "LayerNorm"),
       causal_lm=("Qwen3VLForConditionalGeneration",),
       note=_VISION_LEFT + ", as do the deepstack mergers (but for their LayerNorms); the vision blocks' LayerNorms "
       "are patched, their GELU MLPs (linear_fc1/linear_fc2, not gated) stay and are listed in the report"),
    _F("gemma3", "Gemma3", norm="gemma", norm_classes=("Gemma3RMSNorm", "LayerNorm"),
       causal_lm=("Gemma3ForConditionalGeneration",),
       note="the SigLIP vision tower's patch embedding, attention and GELU MLPs (fc1/fc2, not gated) and the "
       "projector's pooling stay transformers' own; its LayerNorms and the projector's RMSNorm are patched; the "
       "multimodal model's logits are not soft-capped (transformers caps only Gemma3ForCausalLM's)"),
    _F("deepseek_v4", "DeepseekV4", norm="fp32", rope=False,
       note="the RoPE of the trailing slice of each head, the hyper-connections, the compressed attention and the "
       "clamped SwiGLU of the MLPs and experts (swiglu_limit) stay transformers' own"),
)}
# model types that are these families under another name in some transformers releases
# (a multimodal family's text model alone: its base text model, patched as the family's text stack)
ALIASES = {"llama4": "llama4_text", "qwen2_5_vl_text": "qwen2_5_vl", "qwen2_vl_text": "qwen2_vl",
           "qwen3_vl_text": "qwen3_vl"}


def family_of(model: nn.Module) -> ModelFamily:
    """The family entry of ``model``'s ``config.model_type``; ValueError naming the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    model_type = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if not isinstance(model_type, str) or model_type not in MODEL_FAMILIES:
        raise ValueError(f"liger_gen.apply_to: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_FAMILIES))}")
    return MODEL_FAMILIES[model_type]
