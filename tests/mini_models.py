"""Mini models of every family ``liger_gen.apply_to`` supports: hidden 64, 2 layers, a byte vocabulary; MoE
families with 4 experts (2 per token). Shared by the convergence tests and the GPU run of every family."""

from __future__ import annotations

import importlib

import torch

VOCAB = 264  # the 256 byte tokens and a few ids to spare

# hidden 64, 4 query heads of 16, 2 KV heads, 2 layers, intermediate 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# model_type -> (config class, family-specific settings); the settings switch on what tells the family apart
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama4_text": ("Llama4TextConfig", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96,
                                             interleave_moe_layer_step=2, attention_chunk_size=64)),
    "mistral": ("MistralConfig", {}),
    "ministral": ("MinistralConfig", {}),
    "mixtral": ("MixtralConfig", dict(_MOE)),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=64, decoder_sparse_step=1)),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         decoder_sparse_step=1)),
    "qwen3_next": ("Qwen3NextConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=64, layer_types=["linear_attention",
                                                                                            "full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=16, partial_rotary_factor=0.5)),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(layer_types=["linear_attention", "full_attention"],
                                               linear_num_key_heads=2, linear_num_value_heads=4,
                                               linear_key_head_dim=16, linear_value_head_dim=16,
                                               rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                    partial_rotary_factor=0.5))),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                      shared_expert_intermediate_size=64,
                                                      layer_types=["linear_attention", "full_attention"],
                                                      linear_num_key_heads=2, linear_num_value_heads=4,
                                                      linear_key_head_dim=16, linear_value_head_dim=16,
                                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                           partial_rotary_factor=0.5))),
    "gemma": ("GemmaConfig", dict(hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(final_logit_softcapping=2.0, attn_logit_softcapping=50.0, sliding_window=16,
                                    query_pre_attn_scalar=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(final_logit_softcapping=2.0, sliding_window=16,
                                             query_pre_attn_scalar=16)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    "phimoe": ("PhimoeConfig", dict(_MOE)),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                                      attention_multiplier=0.25)),
    "granitemoe": ("GraniteMoeConfig", dict(_MOE, logits_scaling=4.0)),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", dict(sliding_window=16)),
    "glm4": ("Glm4Config", dict(partial_rotary_factor=0.5)),
    "smollm3": ("SmolLM3Config", {}),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                             moe_intermediate_size=48, first_k_dense_replace=1, n_group=1,
                                             topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4,
                                             rope_interleave=True)),
    "gpt_oss": ("GptOssConfig", dict(_MOE, sliding_window=16, layer_types=["sliding_attention",
                                                                              "full_attention"])),
    "cohere2": ("Cohere2Config", dict(logit_scale=0.5, sliding_window=16)),
    "exaone4": ("Exaone4Config", dict(sliding_window=16)),
    "falcon_h1": ("FalconH1Config", dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                                         mamba_n_groups=1, mamba_chunk_size=16, mlp_multipliers=[0.5, 2.0],
                                         lm_head_multiplier=0.5)),
    "seed_oss": ("SeedOssConfig", dict(residual_dropout=0.1)),
    "deepseek_v2": ("DeepseekV2Config", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                             moe_intermediate_size=48, first_k_dense_replace=1, n_group=1,
                                             topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(num_experts=4, moe_topk=2)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                       moe_intermediate_size=48, first_k_dense_replace=1, n_group=1, topk_group=1,
                                       use_qk_norm=True, partial_rotary_factor=0.5)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    "ernie4_5": ("Ernie4_5Config", dict(use_bias=True)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=48,
                                                moe_num_shared_experts=1, moe_layer_start_index=1)),
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)),
    "lfm2_moe": ("Lfm2MoeConfig", dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=48)),
    "minimax": ("MiniMaxConfig", dict(_MOE, layer_types=["linear_attention", "full_attention"], block_size=16)),
    "nemotron": ("NemotronConfig", dict(partial_rotary_factor=0.5)),
    "gemma4_text": ("Gemma4TextConfig", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                                             global_head_dim=16, final_logit_softcapping=2.0,
                                             hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                                             top_k_experts=2, moe_intermediate_size=48)),
    "deepseek_v4": ("DeepseekV4Config", dict(layer_types=["compressed_sparse_attention",
                                                          "heavily_compressed_attention"],
                                             compress_rates={"compressed_sparse_attention": 4,
                                                             "heavily_compressed_attention": 8},
                                             mlp_layer_types=["moe", "moe"], n_routed_experts=4,
                                             num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48,
                                             hc_mult=2, head_dim=16, num_key_value_heads=1, q_lora_rank=32,
                                             o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16,
                                             index_topk=4, sliding_window=16, partial_rotary_factor=0.5,
                                             num_nextn_predict_layers=0)),
}


def mini_config(model_type: str, **overrides):
    """The family's mini config (``FAMILY_CONFIGS``) with ``overrides``; None if transformers lacks the family."""
    import transformers

    name, settings = FAMILY_CONFIGS[model_type]
    cls = getattr(transformers, name, None)
    if cls is None:
        return None
    return cls(**{**_COMMON, **settings, **overrides})


def mini_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu", **overrides):
    """A randomly initialised ``*ForCausalLM`` of the family (eager attention), seeded; None if unavailable."""
    import transformers

    config = mini_config(model_type, **overrides)
    if config is None:
        return None
    config._attn_implementation = "eager"
    from liger_gen.integrations.transformers import MODEL_FAMILIES

    family = MODEL_FAMILIES[model_type]
    cls = getattr(importlib.import_module(family.modeling_module), family.causal_lm_classes[0], None)
    cls = cls or getattr(transformers, family.causal_lm_classes[0])
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    return model.to(dtype)


# ------------------------------------------------------------------------------------------------ vision-language

# vision-language mini models: the text stack as above (hidden 64, 2 layers), a vision tower of depth 1 and width 32
# with 4-pixel patches; special ids above the byte tokens
IMAGE, VIDEO, VISION_START, VISION_END = 260, 261, 258, 259
_TEXT = {k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"}
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])  # head_dim 16: 8 frequencies
_QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                 vision_end_token_id=VISION_END, tie_word_embeddings=False)
_QWEN_VISION = dict(depth=1, num_heads=2, patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3)

# model_type -> (config class, conditional-generation class, config settings)
VLM_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(_QWEN_IDS, text_config=dict(_TEXT, rope_parameters=_MROPE),
                        vision_config=dict(_QWEN_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                           window_size=16, fullatt_block_indexes=[0]))),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(_QWEN_IDS, text_config=dict(_TEXT, rope_parameters=_MROPE),
                      vision_config=dict(_QWEN_VISION, embed_dim=32, hidden_size=64, mlp_ratio=2))),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(_QWEN_IDS, text_config=dict(_TEXT, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                      vision_config=dict(_QWEN_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                         num_position_embeddings=16, deepstack_visual_indexes=[0]))),
    # Qwen 3-VL's vision tower over a Qwen 3-MoE text stack: layer 0 dense, layer 1 of 4 experts; router logits asked
    # by the text config, so the load-balancing loss is in the loss as the family's forward adds it
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     dict(_QWEN_IDS, text_config=dict(_TEXT, rope_parameters=dict(_MROPE, mrope_interleaved=True),
                                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                      decoder_sparse_step=1, mlp_only_layers=[0],
                                                      output_router_logits=True),
                          vision_config=dict(_QWEN_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                             num_position_embeddings=16, deepstack_visual_indexes=[0]))),
    # Qwen 3.5: a linear-attention layer and a full-attention layer (M-RoPE of the half of head_dim that rotates)
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                dict(_QWEN_IDS, text_config=dict(FAMILY_CONFIGS["qwen3_5_text"][1], **_TEXT, rope_parameters=dict(
                    _MROPE, mrope_section=[1, 1, 2], mrope_interleaved=True, partial_rotary_factor=0.5)),
                     vision_config=dict(_QWEN_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                        num_position_embeddings=16))),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                    dict(_QWEN_IDS, text_config=dict(FAMILY_CONFIGS["qwen3_5_moe_text"][1], **_TEXT,
                                                     output_router_logits=True, rope_parameters=dict(
                                                         _MROPE, mrope_section=[1, 1, 2], mrope_interleaved=True,
                                                         partial_rotary_factor=0.5)),
                         vision_config=dict(_QWEN_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                            num_position_embeddings=16))),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration",
               dict(text_config=dict(_TEXT, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
                                     query_pre_attn_scalar=16),
                    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=16, patch_size=4),
                    mm_tokens_per_image=4, boi_token_index=VISION_START, eoi_token_index=VISION_END,
                    image_token_index=IMAGE, tie_word_embeddings=False)),
    # Gemma 4: the text stack of the gemma4_text mini model without its experts, images attended causally; 16x16
    # images of 4x4 patches (flattened, with their (x, y) positions) pooled 2x2 to 4 tokens; no audio tower. The
    # experts (patched as gemma4_text's, converging in test_families.py) make this run ill-conditioned in float32:
    # a router near-tie at step 14 puts the losses 1.1e-5 apart with any one op swapped (every earlier step within
    # 2e-7) and the weights up to 4e-4 apart; bidirectional image attention puts the vision q/k projections 1.9e-4
    # apart (measured; without either, every weight within 3e-5)
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration",
               dict(text_config=dict(FAMILY_CONFIGS["gemma4_text"][1], **_TEXT, enable_moe_block=False),
                    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                                       position_embedding_size=16, use_clipped_linears=True),
                    audio_config=None, boi_token_id=VISION_START, eoi_token_id=VISION_END, image_token_id=IMAGE,
                    video_token_id=VIDEO, audio_token_id=257, boa_token_id=262, eoa_token_index=263,
                    tie_word_embeddings=False)),
    "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration",  # M-RoPE of the half of head_dim that rotates
              dict(image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=VISION_START,
                   image_end_token_id=VISION_END, video_start_token_id=262, video_end_token_id=263,
                   tie_word_embeddings=False,
                   text_config=dict(_TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                mrope_section=[1, 1, 2], partial_rotary_factor=0.5)),
                   vision_config=dict(_QWEN_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                      image_size=16))),
    "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration",  # layer 0 dense, layer 1 of 4 experts
                  dict(image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=VISION_START,
                       image_end_token_id=VISION_END, video_start_token_id=262, video_end_token_id=263,
                       tie_word_embeddings=False,
                       text_config=dict(_TEXT, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                        moe_intermediate_size=48, first_k_dense_replace=1, n_group=1, topk_group=1,
                                        output_router_logits=True,
                                        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                             mrope_section=[1, 1, 2], partial_rotary_factor=0.5)),
                       vision_config=dict(_QWEN_VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                                          image_size=16))),
    # Llama 4: the text stack of the llama4_text mini model (layer 1 of experts); 16x16 images of 4x4 patches, pixel
    # shuffled (ratio 0.5) to 4 tokens an image; the language model a Llama4ForCausalLM inside the model
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration",
               dict(text_config=dict(FAMILY_CONFIGS["llama4_text"][1], **_TEXT),
                    vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=16, patch_size=4, vision_output_dim=64,
                                       projector_input_dim=64, projector_output_dim=64),
                    boi_token_index=VISION_START, eoi_token_index=VISION_END, image_token_index=IMAGE,
                    tie_word_embeddings=False)),
    "mllama": ("MllamaConfig", "MllamaForConditionalGeneration",  # layer 1 cross-attends; images of 1 or 2 tiles
               dict(text_config=dict(_TEXT, cross_attention_layers=[1], rope_parameters=dict(rope_type="default",
                                                                                           rope_theta=10000.0)),
                    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_global_layers=1,
                                       attention_heads=2, image_size=16, patch_size=4, max_num_tiles=2,
                                       intermediate_layers_indices=[0], vision_output_dim=64,
                                       supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
                    image_token_index=IMAGE, tie_word_embeddings=False)),
    # wrappers around another family's language model (text_config.model_type), each with a vision tower of its own
    # kind: 16x16 images of 4x4 patches
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration",  # CLIP; the 16 patch features (the class token dropped)
              dict(text_config=dict(_TEXT, model_type="llama"),
                   vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4,
                                      projection_dim=32),
                   vision_feature_layer=-1, image_token_id=IMAGE, tie_word_embeddings=False)),
    "paligemma": ("PaliGemmaConfig", "PaliGemmaForConditionalGeneration",  # PaliGemma 2: Gemma 2, soft-capped logits
                  dict(text_config=dict(_TEXT, model_type="gemma2", final_logit_softcapping=2.0,
                                        attn_logit_softcapping=50.0, sliding_window=16, query_pre_attn_scalar=16),
                       vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4,
                                          vision_use_head=False, projection_dim=64),
                       projection_dim=64, hidden_size=64, image_token_id=IMAGE, tie_word_embeddings=False)),
    # InternViT with RMSNorms (InternViT-6B's norm_type) and a final LayerNorm; 4 tokens an image after the pixel
    # shuffle. Without its q/k norms: with them the last of the 20 steps is ill-conditioned in float32 (measured:
    # plain transformers 1.0e-5 from a float64 run there, the patched model 1.3e-5, 2.7e-6 apart; every earlier
    # step within 2e-7), past LOSS_RTOL by chance, not by a wrong op
    "internvl": ("InternVLConfig", "InternVLForConditionalGeneration",
                 dict(text_config=dict(_TEXT, model_type="qwen2"),
                      vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=[16, 16], patch_size=[4, 4],
                                         norm_type="rms_norm", use_qk_norm=False, use_mean_pooling=False),
                      vision_feature_layer=-1, downsample_ratio=0.5, image_token_id=IMAGE, tie_word_embeddings=False)),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration",  # pixel shuffle by 2: 4 tokens an image
                dict(text_config=dict(_TEXT, model_type="llama"),
                     vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=16, patch_size=4),
                     scale_factor=2, image_token_id=IMAGE, tie_word_embeddings=False)),
}


def mini_vlm(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu",
             vision_attention: str = "eager", **vision):
    """A randomly initialised ``*ForConditionalGeneration`` of the family (eager attention; the vision tower's
    ``vision_attention``, its config updated with ``vision``), seeded; None if this transformers release lacks it."""
    import transformers

    config_name, model_name, settings = VLM_CONFIGS[model_type]
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        return None
    if vision:
        settings = dict(settings, vision_config=dict(settings["vision_config"], **vision))
    config = config_cls(**settings)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = vision_attention
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype)


def vlm_batch(model_type: str, ids: torch.Tensor, generator: torch.Generator) -> dict:
    """Model inputs for a (batch, seq) tensor of text tokens as the family's processor lays them out: per sample
    one image of random pixels, its placeholder tokens (as many as the vision tower yields) at a position that varies
    by sample (between the family's start and end tokens where it has them), and the image's side inputs (Qwen's
    and GLM-4V's patches, ``image_grid_thw`` and ``mm_token_type_ids``; Gemma 3's and PaliGemma's
    ``token_type_ids``; SmolVLM's images per sample; Mllama's tiles, aspect ratios and cross-attention mask).
    ``labels``: the tokens with the image placeholders masked (-100), as the fine-tuning collators do (transformers'
    loss does not mask them); PaliGemma's with its whole prefix masked (image, BOS, prompt), as its processor masks
    it, the prefix attended bidirectionally (``token_type_ids`` 0)."""
    ids = ids.clone()
    rows = ids.shape[0]
    batch = {}

    def place(n: int, start: int | None = VISION_START, end: int | None = VISION_END) -> None:
        for row in range(rows):
            at = 2 + 3 * row
            if start is not None:
                ids[row, at] = start
            ids[row, at + 1:at + 1 + n] = IMAGE
            if end is not None:
                ids[row, at + 1 + n] = end

    if model_type.startswith(("qwen", "glm4v")):  # GLM-4V's images are laid out as Qwen's
        grids = [(1, 4, 4), (1, 4, 8)] * (rows // 2) + [(1, 4, 4)] * (rows % 2)
        for row, (t, h, w) in enumerate(grids):
            n, at = t * h * w // 4, 2 + 3 * row  # merged 2x2 patches per token
            ids[row, at], ids[row, at + 1:at + 1 + n], ids[row, at + 1 + n] = VISION_START, IMAGE, VISION_END
        patches = sum(t * h * w for t, h, w in grids)
        batch.update(pixel_values=torch.randn(patches, 3 * 2 * 4 * 4, generator=generator),
                     image_grid_thw=torch.tensor(grids), mm_token_type_ids=(ids == IMAGE).int())
    elif model_type == "paligemma":  # the image first, then BOS, the prompt (2 + row tokens) and "\n"; the suffix
        ids[:, :16] = IMAGE
        ids[:, 16] = 1
        prefix = torch.zeros_like(ids, dtype=torch.bool)
        for row in range(rows):
            ids[row, 19 + row] = ord("\n")
            prefix[row, :20 + row] = True
        batch.update(pixel_values=torch.randn(rows, 3, 16, 16, generator=generator),
                     token_type_ids=(~prefix).long())
        batch["input_ids"] = ids
        batch["labels"] = ids.masked_fill(prefix, -100)
        return batch
    elif model_type == "mllama":  # one <|image|> token; every later token cross-attends to the image's tiles
        tiles = [1, 2] * (rows // 2) + [1] * (rows % 2)
        cross = torch.zeros(rows, ids.shape[1], 1, 2, dtype=torch.long)
        for row, n in enumerate(tiles):
            ids[row, 2 + 3 * row] = IMAGE
            cross[row, 2 + 3 * row:, 0, :n] = 1
        batch.update(pixel_values=torch.randn(rows, 1, 2, 3, 16, 16, generator=generator),
                     aspect_ratio_ids=torch.tensor(tiles).view(rows, 1),  # (1, 1): id 1, (1, 2): id 2
                     aspect_ratio_mask=(torch.arange(2) < torch.tensor(tiles)[:, None]).long().view(rows, 1, 2),
                     cross_attention_mask=cross)
    elif model_type == "gemma4":  # <boi> 4 tokens <eoi>; the 16 patches of 4x4 pixels flattened, row by row
        place(4)
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), dim=-1).reshape(16, 2)
        batch.update(pixel_values=torch.rand(rows, 16, 3 * 4 * 4, generator=generator),
                     image_position_ids=grid.expand(rows, -1, -1), mm_token_type_ids=(ids == IMAGE).long())
    elif model_type == "llava":  # 16 patch tokens, no start or end token
        place(16, None, None)
        batch.update(pixel_values=torch.randn(rows, 3, 16, 16, generator=generator))
    elif model_type == "llama4":  # <|image_start|> 4 tokens <|image_end|>; one tile an image
        place(4)
        batch.update(pixel_values=torch.randn(rows, 3, 16, 16, generator=generator))
    elif model_type == "internvl":  # <img> 4 tokens </img>
        place(4)
        batch.update(pixel_values=torch.randn(rows, 3, 16, 16, generator=generator))
    elif model_type == "smolvlm":  # 4 tokens between the image-boundary tokens; (batch, images, 3, H, W) pixels
        place(4)
        batch.update(pixel_values=torch.randn(rows, 1, 3, 16, 16, generator=generator))
    else:  # Gemma 3: 16x16 images of 4x4 patches, pooled to 4 tokens
        place(4)
        batch.update(pixel_values=torch.randn(rows, 3, 16, 16, generator=generator),
                     token_type_ids=(ids == IMAGE).long())
    batch["input_ids"] = ids
    batch["labels"] = ids.masked_fill(ids == IMAGE, -100)
    return batch
