"""The model families ``apply_to`` patches, as data: one ``ModelFamily`` per ``config.model_type``."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``), routed to liger-gen too. vision_rope: the name of the vision
    tower's rotary function, ``apply_rotary_pos_emb_vision(q, k, cos, sin)`` of (seq, heads, head_dim) q and k and
    (seq, head_dim) 2-D RoPE tables, computed in fp32 and cast back to q's and k's dtypes (the Qwen vision-language
    families, GLM-4V): routed to liger-gen too where the release's function takes (q, k, cos, sin).
    vision_attention: the attribute of a vision tower whose attention runs over ``cu_seqlens`` pieces (each image,
    or window) and whose ``sdpa`` attention ``apply_to`` turns into one variable-length call per block
    (``vision_attention.py``). mlp: whether its
    gated MLP modules are patched. causal_lm: the class names whose LM-head loss is fused (default
    ``<prefix>ForCausalLM``; a multimodal family's ``*ForConditionalGeneration``, whose base model takes the images
    and returns the text stack's hidden states). norm_classes may name torch's ``LayerNorm`` beside the family's
    RMSNorm classes: a multimodal family's vision tower, swapped for liger-gen's LayerNorm. logits: the transform
    between ``lm_head`` and the loss (None, "softcap" from ``config.final_logit_softcapping``, "divide" by
    ``config.logits_scaling``, "multiply" by the model's ``logit_scale``, "lm_head_multiplier" by the base
    model's ``lm_head_multiplier``). experts_gate: how the family's experts compute their gate where it is not
    transformers' shared hook: "clamped_swiglu" (GPT-OSS's own ``_apply_gate``, from the experts' ``alpha`` and
    ``limit``) or "batched" (Llama 4: ``bmm`` over experts of pre-grouped tokens, gate and up as the two halves
    of ``gate_up_proj``'s output, computed inline). note: what stays transformers' own.

    A vision-language *wrapper* (Llava, PaliGemma, InternVL, SmolVLM) holds the language model of another family:
    its entry describes only its own parts, and ``family_of`` combines it with the text family of
    ``config.text_config.model_type`` (``compose``). language_model: the attribute of the wrapper's base model that
    holds that language model (set only on wrappers). vision_tower: the attribute of the vision tower, whose
    modeling module's gated MLPs are swapped and whose other MLPs are listed in the report; the wrapper's
    ``norm`` and ``norm_classes`` are the vision tower's norms (a torch ``LayerNorm`` is a LayerNorm whatever
    ``norm`` says). kept: (attribute, why) of the parts left as they are, by design (the projector), listed in
    the report. In a composed family: text_family, the text family's model_type; norm_kinds, (class name,
    formula) of the norm classes whose formula is not ``norm`` (the vision tower's); module, the text family's
    modeling module (its RoPE, decoder layers and MLPs); logits, the wrapper's (its forward applies the
    transform, or not).

    causal_lm_inside: the attribute of a ``*ForConditionalGeneration`` that holds a ``*ForCausalLM`` where the others
    hold a base model at ``.model`` (Llama 4's ``language_model``): the fused loss runs that forward as it is (it
    merges the images into the text embeddings), without labels, the causal LM inside returning its text model's
    hidden states in the logits' place.
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
    vision_rope: str | None = None
    vision_attention: str | None = None
    mlp: bool = True
    causal_lm: tuple[str, ...] | None = None
    logits: str | None = None
    experts_gate: str | None = None
    module: str | None = None
    note: str = ""
    language_model: str | None = None
    vision_tower: str | None = None
    kept: tuple[tuple[str, str], ...] = ()
    text_family: str | None = None
    norm_kinds: tuple[tuple[str, str], ...] = ()
    causal_lm_inside: str | None = None

    @property
    def modeling_module(self) -> str:
        return self.module or f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    @property
    def norm_class_names(self) -> tuple[str, ...]:
        return self.norm_classes if self.norm_classes is not None else (f"{self.prefix}RMSNorm",)

    @property
    def causal_lm_classes(self) -> tuple[str, ...]:
        return self.causal_lm if self.causal_lm is not None else (f"{self.prefix}ForCausalLM",)

    @property
    def is_wrapper(self) -> bool:
        """Whether the family's language model is another family's (resolved from ``config.text_config``)."""
        return self.language_model is not None and self.text_family is None

    def norm_kind(self, class_name: str) -> str | None:
        """The formula of the norm class ``class_name`` (``norm`` unless ``norm_kinds`` names it)."""
        return dict(self.norm_kinds).get(class_name, self.norm)


_F = ModelFamily
# the vision tower's rotary function of the Qwen vision-language families and GLM-4V (``vision_rope``)
_VISION_ROPE = "apply_rotary_pos_emb_vision"
# what a Qwen vision-language family leaves as transformers' own
_VISION_LEFT = ("the vision tower's 2-D RoPE (apply_rotary_pos_emb_vision: fp32, cast back) is routed to liger-gen "
                "and its sdpa attention runs each block's images (or windows) in one variable-length call on a GPU "
                "in bf16/fp16; its patch embedding and the patch merger stay transformers' own")
# the vision tower of those families (``vision_attention``)
_VISUAL = "visual"
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
       note="the residual adds before its LayerNorms stay unfused; its MLPs (squared ReLU, not gated) become "
       "SquaredReLUMLP, on the squared_relu kernels"),
    _F("gemma4_text", "Gemma4", norm="fp32", logits="softcap", rope_single=True,
       module="transformers.models.gemma4.modeling_gemma4"),
    # multimodal (vision-language): the text stack as a text family's; the vision tower's RMSNorm / LayerNorm and
    # gated MLPs where it has them; the loss of the *ForConditionalGeneration. Qwen's multimodal RoPE (M-RoPE, its
    # sections interleaved in Qwen 3-VL) is assembled into per-token cos/sin tables by the text rotary embedding
    # module, so the apply_rotary_pos_emb it feeds is the plain rotate-half rotation
    _F("qwen2_5_vl", "Qwen2_5_VL", causal_lm=("Qwen2_5_VLForConditionalGeneration",), vision_rope=_VISION_ROPE,
       vision_attention=_VISUAL,
       note=_VISION_LEFT + " (but for its RMSNorm); the vision blocks' RMSNorms and SwiGLU MLPs are patched"),
    _F("qwen2_vl", "Qwen2VL", norm_classes=("Qwen2VLRMSNorm", "LayerNorm"),
       causal_lm=("Qwen2VLForConditionalGeneration",), vision_rope=_VISION_ROPE, vision_attention=_VISUAL,
       note=_VISION_LEFT + " (but for its LayerNorm); the vision blocks' LayerNorms are patched, their QuickGELU "
       "MLPs (fc1/fc2, not gated) stay"),
    _F("qwen3_vl", "Qwen3VL", norm_classes=("Qwen3VLTextRMSNorm", "LayerNorm"),
       causal_lm=("Qwen3VLForConditionalGeneration",), vision_rope=_VISION_ROPE, vision_attention=_VISUAL,
       note=_VISION_LEFT + ", as do the deepstack mergers (but for their LayerNorms); the vision blocks' LayerNorms "
       "are patched, their GELU MLPs (linear_fc1/linear_fc2, not gated) stay and are listed in the report"),
    _F("qwen3_vl_moe", "Qwen3VLMoe", norm_classes=("Qwen3VLMoeTextRMSNorm", "LayerNorm"),
       causal_lm=("Qwen3VLMoeForConditionalGeneration",), vision_rope=_VISION_ROPE, vision_attention=_VISUAL,
       note=_VISION_LEFT + ", as do the deepstack mergers (but for their LayerNorms); the vision blocks' LayerNorms "
       "are patched, their GELU MLPs (linear_fc1/linear_fc2, not gated) stay and are listed in the report; the text "
       "stack's experts and dense MLPs are patched as Qwen 3-MoE's, its router stays"),
    _F("qwen3_5", "Qwen3_5", norm="gemma", norm_classes=("Qwen3_5RMSNorm", "LayerNorm"),
       causal_lm=("Qwen3_5ForConditionalGeneration",), vision_rope=_VISION_ROPE, vision_attention=_VISUAL,
       note=_VISION_LEFT + " (but for its LayerNorm); the vision blocks' LayerNorms are patched, their GELU MLPs "
       "(linear_fc1/linear_fc2, not gated) stay and are listed in the report; the text stack as Qwen 3.5's text "
       "model: the gated linear-attention layers' gated RMSNorm is transformers' own"),
    _F("qwen3_5_moe", "Qwen3_5Moe", norm="gemma", norm_classes=("Qwen3_5MoeRMSNorm", "LayerNorm"),
       causal_lm=("Qwen3_5MoeForConditionalGeneration",), vision_rope=_VISION_ROPE, vision_attention=_VISUAL,
       note=_VISION_LEFT + " (but for its LayerNorm); the vision blocks' LayerNorms are patched, their GELU MLPs "
       "(linear_fc1/linear_fc2, not gated) stay and are listed in the report; the text stack as Qwen 3.5-MoE's text "
       "model: the gated linear-attention layers' gated RMSNorm and the router are transformers' own"),
    _F("gemma3", "Gemma3", norm="gemma", norm_classes=("Gemma3RMSNorm", "LayerNorm"),
       causal_lm=("Gemma3ForConditionalGeneration",), vision_tower="vision_tower",
       note="the SigLIP vision tower's patch embedding, attention and GELU MLPs (fc1/fc2, not gated) and the "
       "projector's pooling stay transformers' own; its LayerNorms and the projector's RMSNorm are patched; the "
       "multimodal model's logits are not soft-capped (transformers caps only Gemma3ForCausalLM's)"),
    _F("gemma4", "Gemma4", norm="fp32", logits="softcap", rope_single=True,
       causal_lm=("Gemma4ForConditionalGeneration",), vision_tower="vision_tower",
       kept=(("embed_vision", "the vision projector: a weightless RMSNorm and one linear layer, left as it is, once "
              "per image token"),
             ("embed_audio", "the audio projector: a weightless RMSNorm and one linear layer, left as it is")),
       note="the text stack as Gemma 4's text model; the vision tower's patch embedding, attention, 2-D RoPE (through "
       "the same apply_rotary_pos_emb, routed to liger-gen) and pooling stay transformers' own, its RMSNorms (q/k/v "
       "norms included) and gated MLPs (their clippable linears called whole) are patched; the audio tower's "
       "RMSNorms are patched, its convolutions, attention and feed-forward blocks stay"),
    _F("glm4v", "Glm4v", norm_classes=("Glm4vRMSNorm",), causal_lm=("Glm4vForConditionalGeneration",),
       rope_pairs=True, rope_tables="interleaved", vision_tower="visual", vision_rope=_VISION_ROPE,
       vision_attention=_VISUAL,
       kept=(("visual.merger", "the patch merger: a projection, LayerNorm and GELU before a SwiGLU, left as it is, "
              "once per image token"),),
       note="the vision tower's 2-D RoPE (apply_rotary_pos_emb_vision: fp32, cast back) is routed to liger-gen; "
       "its sdpa attention runs each block's images in one variable-length call on a GPU in bf16/fp16; its patch "
       "embedding, position embeddings and downsampling convolution stay transformers' own; its RMSNorms and SwiGLU "
       "MLPs are patched; "
       "the text stack's M-RoPE tables (sections, each angle twice in a row) rotate interleaved pairs of the "
       "partial rotary dims, routed to liger-gen like GLM-4's"),
    _F("glm4v_moe", "Glm4vMoe", norm_classes=("Glm4vMoeTextRMSNorm", "Glm4vMoeRMSNorm"),
       causal_lm=("Glm4vMoeForConditionalGeneration",), vision_tower="visual", vision_rope=_VISION_ROPE,
       vision_attention=_VISUAL,
       kept=(("visual.merger", "the patch merger: a projection, LayerNorm and GELU before a SwiGLU, left as it is, "
              "once per image token"),),
       note="the vision tower's 2-D RoPE (apply_rotary_pos_emb_vision: fp32, cast back) is routed to liger-gen; "
       "its sdpa attention runs each block's images in one variable-length call on a GPU in bf16/fp16; its patch "
       "embedding, position embeddings and downsampling convolution stay transformers' own; its RMSNorms and SwiGLU "
       "MLPs are patched; "
       "the text stack's M-RoPE tables (sections, cat(freqs, freqs)) rotate the partial rotary dims as halves, "
       "like GLM-4-MoE's; its experts, shared experts and dense MLPs are patched, "
       "its router stays"),
    _F("llama4", "Llama4", norm_classes=("Llama4TextRMSNorm", "LayerNorm"), experts_gate="batched",
       causal_lm=("Llama4ForConditionalGeneration", "Llama4ForCausalLM"), causal_lm_inside="language_model",
       rope_function="apply_rotary_emb", rope_tables="complex", rope_pairs=True, rope_keeps_dtype=True,
       vision_tower="vision_model",
       kept=(("vision_model.vision_adapter", "the pixel-shuffle adapter: a pixel shuffle and an fc1/fc2 MLP (GELU, "
              "not gated), no liger-gen op"),
             ("multi_modal_projector", "the projector: one linear layer, no liger-gen op")),
       note="the text stack as Llama 4's text model (llama4_text); the vision tower's patch embedding (unfold), "
       "attention and 2-D RoPE (vision_apply_rotary_emb) stay transformers' own, its LayerNorms are patched, its "
       "fc1/fc2 MLPs (not gated) stay and are listed in the report"),
    _F("mllama", "Mllama", norm_classes=("MllamaTextRMSNorm", "LayerNorm"),
       causal_lm=("MllamaForConditionalGeneration", "MllamaForCausalLM"), vision_tower="vision_model",
       kept=(("multi_modal_projector", "the projector: one linear layer, no liger-gen op"),),
       note="the vision tower's patch and tile embeddings, attention, gated (tanh) global layers and fc1/fc2 MLPs "
       "(not gated, listed in the report) stay transformers' own, its LayerNorms are patched; the text stack's "
       "cross-attention layers (their tanh gates, the masking of text rows without an image) stay, their q/k "
       "RMSNorms, MLPs and the add of their gated attention output into the next norm are patched"),
    # vision-language wrappers around a language model of another family (``compose``): the text stack is patched
    # as the family of config.text_config.model_type; the entries name the wrapper's own parts
    _F("llava", "Llava", norm="llama", norm_classes=("LayerNorm", "PixtralRMSNorm"),
       causal_lm=("LlavaForConditionalGeneration",), module="transformers.models.llava.modeling_llava",
       language_model="language_model", vision_tower="vision_tower",
       kept=(("multi_modal_projector", "the projector: linear layers and an activation, no liger-gen op"),),
       note="the text model is patched as its own family (config.text_config.model_type: llama, mistral, qwen2, "
       "...); the vision tower's LayerNorms (CLIP, SigLIP) or RMSNorms and SwiGLU MLPs (Pixtral) are patched; its "
       "patch embedding, attention and fc1/fc2 MLPs (not gated) stay transformers' own and are listed in the report"),
    _F("paligemma", "PaliGemma", norm="layer", norm_classes=("LayerNorm",), logits="softcap",
       causal_lm=("PaliGemmaForConditionalGeneration",), module="transformers.models.paligemma.modeling_paligemma",
       language_model="language_model", vision_tower="vision_tower",
       kept=(("multi_modal_projector", "the projector: one linear layer, no liger-gen op"),),
       note="the text model is patched as its own family (gemma, gemma2); the SigLIP vision tower's LayerNorms "
       "are patched, its patch embedding, attention and fc1/fc2 MLPs (not gated) stay transformers' own and are "
       "listed in the report; the logits are soft-capped where the text config says so, as PaliGemma's forward "
       "does"),
    _F("internvl", "InternVL", norm="llama", norm_classes=("InternVLVisionRMSNorm", "LayerNorm"),
       causal_lm=("InternVLForConditionalGeneration",), module="transformers.models.internvl.modeling_internvl",
       language_model="language_model", vision_tower="vision_tower",
       kept=(("multi_modal_projector", "the projector after the pixel shuffle (LayerNorm, linear layers, GELU): "
              "left as it is, once per image token"),),
       note="the text model is patched as its own family (qwen2, llama, ...); the InternViT vision tower's norms "
       "(LayerNorm or RMSNorm, per norm_type; the q/k RMSNorms too) are patched, its patch embedding, attention, "
       "layer scales and fc1/fc2 MLPs (not gated) stay transformers' own and are listed in the report"),
    _F("smolvlm", "SmolVLM", norm="layer", norm_classes=("LayerNorm",),
       causal_lm=("SmolVLMForConditionalGeneration",), module="transformers.models.smolvlm.modeling_smolvlm",
       language_model="text_model", vision_tower="vision_model",
       kept=(("connector", "the connector: a pixel shuffle and one linear layer, no liger-gen op"),),
       note="the text model is patched as its own family (llama); the SigLIP-style vision tower's LayerNorms are "
       "patched, its patch embedding, attention and fc1/fc2 MLPs (not gated) stay transformers' own and are "
       "listed in the report"),
    _F("deepseek_v4", "DeepseekV4", norm="fp32", rope=False,
       note="the RoPE of the trailing slice of each head, the hyper-connections, the compressed attention and the "
       "clamped SwiGLU of the MLPs and experts (swiglu_limit) stay transformers' own"),
)}
# model types that are these families under another name in some transformers releases
# (a multimodal family's text model alone: its base text model, patched as the family's text stack)
ALIASES = {"qwen2_5_vl_text": "qwen2_5_vl", "qwen2_vl_text": "qwen2_vl",
           "qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe",
           "glm4v_text": "glm4v", "glm4v_moe_text": "glm4v_moe", "mllama_text_model": "mllama"}


def _is_text_family(family: ModelFamily) -> bool:
    """Whether ``family`` can be a wrapper's language model: neither a wrapper nor a vision-language family."""
    return family.language_model is None and not any(c.endswith("ForConditionalGeneration")
                                                      for c in family.causal_lm_classes)


_COMPOSED: dict[tuple[str, str], ModelFamily] = {}


def compose(wrapper: ModelFamily, text: ModelFamily) -> ModelFamily:
    """The family of a vision-language wrapper (Llava, PaliGemma, ...) whose language model is of ``text``'s family:
    the text family's norms, RoPE, MLPs, fused adds and modeling module; the wrapper's vision-tower norms (with
    their own formula), its ``*ForConditionalGeneration`` loss and logit transform, its vision tower and kept parts;
    both notes. One object per pair."""
    key = (wrapper.model_type, text.model_type)
    if key not in _COMPOSED:
        vision = tuple(c for c in wrapper.norm_class_names if c not in text.norm_class_names)
        _COMPOSED[key] = replace(
            text, model_type=wrapper.model_type, prefix=wrapper.prefix,
            norm_classes=text.norm_class_names + vision,
            norm_kinds=text.norm_kinds + tuple((c, wrapper.norm) for c in vision),
            causal_lm=wrapper.causal_lm_classes, logits=wrapper.logits, module=text.modeling_module,
            language_model=wrapper.language_model, vision_tower=wrapper.vision_tower, kept=wrapper.kept,
            text_family=text.model_type,
            note="; ".join(filter(None, (wrapper.note, f"text model ({text.model_type}): {text.note}" if text.note
                                         else ""))))
    return _COMPOSED[key]


def family_named(model_type: str, text_model_type: str | None = None) -> ModelFamily:
    """The family of ``model_type`` (aliases resolved); a wrapper's composed with the text family of
    ``text_model_type`` (its ``config.text_config.model_type``). ValueError naming what is supported."""
    model_type = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if not isinstance(model_type, str) or model_type not in MODEL_FAMILIES:
        raise ValueError(f"liger_gen.apply_to: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_FAMILIES))}")
    family = MODEL_FAMILIES[model_type]
    if not family.is_wrapper:
        return family
    text_type = ALIASES.get(text_model_type, text_model_type) if isinstance(text_model_type, str) \
        else text_model_type
    text = MODEL_FAMILIES.get(text_type) if isinstance(text_type, str) else None
    if text is None or not _is_text_family(text):
        texts = sorted(name for name, f in MODEL_FAMILIES.items() if _is_text_family(f))
        raise ValueError(f"liger_gen.apply_to: {model_type}'s language model has config.text_config.model_type "
                         f"{text_model_type!r}, which is not a supported text family; supported: {', '.join(texts)}")
    return compose(family, text)


def family_of(model: nn.Module) -> ModelFamily:
    """The family entry of ``model``'s ``config.model_type`` (a vision-language wrapper's composed with the text
    family of its ``config.text_config.model_type``); ValueError naming the supported ones."""
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None)
    return family_named(getattr(config, "model_type", None), getattr(text_config, "model_type", None))
