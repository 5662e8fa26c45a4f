"""Patch transformers models in place: one table of model families, each described as data.

``apply_to(model)`` walks the model and replaces, for the model's family (``config.model_type``):

- **Norms** → ``liger_gen.nn.RMSNorm`` (or ``liger_gen.nn.LayerNorm``) holding the same Parameters. A family's
  ``norm`` says which formula its norm classes compute: "llama" (``w · x̂`` with x̂ rounded to the input's dtype
  first), "gemma" (``(1 + w) · x̂`` in fp32, rounded once; weights stored as w − 1), "fp32" (``w · x̂`` in fp32,
  rounded once: OLMo 2, GPT-OSS, Gemma 4, DeepSeek-V4), "layer" (LayerNorm: Cohere 2 without bias, PhiMoE with
  bias) or "layer1p" (Nemotron's LayerNorm of ``1 + w``, run by ``layer_norm`` with the weight offset). Every module of
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
- **Squared-ReLU MLPs** (Nemotron's ``down_proj(relu2(up_proj(x)))``, not gated) → ``liger_gen.nn.SquaredReLUMLP``
  holding the same ``up_proj`` and ``down_proj``, the activation by ``liger_gen.functional.squared_relu``.
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
  its real and imaginary parts are the cos/sin tables; DeepSeek-V2's is the same with q and k as (batch, heads,
  seq, head_dim). Gemma 4 rotates one tensor per call (``apply_rotary_pos_emb(x, cos, sin)``).
- **FP8 training** (opt-in, ``fp8=True`` or a ``liger_gen.Float8Recipe``): the ``nn.Linear`` layers inside the
  decoder layers become ``liger_gen.nn.Float8Linear`` in place (their GEMMs in FP8 through ``torch._scaled_mm``);
  routers, fused experts, layers whose dims are not multiples of 16 and devices without FP8 GEMMs stay as they
  are and are listed in the report (``fp8.py`` says what and why).
- **Vision-language models**: the text stack as above; the vision tower's norms (LayerNorm, RMSNorm) and gated
  MLPs where it has them, its other MLPs listed in the report; the loss of the ``*ForConditionalGeneration``. Llava,
  PaliGemma, InternVL and SmolVLM wrap a language model of another family: their table entry names their own
  parts (the attribute of the language model and of the vision tower, the vision tower's norms, the projector they
  leave as it is) and ``family_of`` combines it with the family of ``config.text_config.model_type``
  (``families.compose``), whose norms, RoPE, MLPs and fused adds the language model gets.
- **Vision attention** (``vision_attention=True``): the Qwen vision-language towers and GLM-4V's attend within each
  image (or window) of one patch sequence cut by ``cu_seqlens``; where the tower's config says ``sdpa``, each
  vision attention module reads a view of it naming the attention function ``vision_attention.py`` registers,
  which runs a block's pieces in one variable-length FlashAttention call on a GPU (compute capability 8.0 or more)
  in bf16/fp16, and SDPA per piece, as transformers does, elsewhere. The model's config is unchanged.
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

# one module per job, each owning its process-wide state; the names below are the package's API (and the paths
# that models pickled by earlier releases name)
from liger_gen.integrations.transformers.families import (MODEL_FAMILIES, TESTED_TRANSFORMERS, ModelFamily,
                                                          family_of)
from liger_gen.integrations.transformers.layers import layer_code_refusal, restore_layers
from liger_gen.integrations.transformers.loss import FusedLossForward
from liger_gen.integrations.transformers.modules import (BatchedExpertsForward, ExpertsGate, FusedExpertsForward,
                                                         _Replicate, activation_name)  # noqa: F401 (pickles)
from liger_gen.integrations.transformers.patch import PatchReport, apply_to, patched_ops
from liger_gen.integrations.transformers.rope import restore_rope

__all__ = ["MODEL_FAMILIES", "TESTED_TRANSFORMERS", "BatchedExpertsForward", "ExpertsGate", "FusedExpertsForward",
           "FusedLossForward", "ModelFamily", "PatchReport", "activation_name", "apply_to", "family_of",
           "layer_code_refusal", "patched_ops", "restore_layers", "restore_rope"]
