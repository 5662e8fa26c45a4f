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
