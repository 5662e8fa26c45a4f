"""Preference and RL losses from hidden states and the LM head: DPO, ORPO, CPO, SimPO, KTO and GRPO, with TRL's
semantics, on the chunked per-token log-probabilities of ``selective_log_softmax`` (its tuned kernels and chunk
plan), never materialising the full logits.

Two layers:

* **Formulas** (``dpo_loss``, ``orpo_loss``, ``cpo_loss``, ``kto_loss``, ``grpo_loss``, ``wpo_weights``,
  ``high_entropy_mask``, ...): plain PyTorch on sequence or per-token log-probabilities (and, for WPO's weights
  and GRPO's entropy options, per-token statistics), differentiable, equal to the formulas of TRL's trainers
  (each docstring names the paper and the TRL code it follows).
* **Fused losses** (``fused_linear_dpo``, ``fused_linear_orpo``, ``fused_linear_cpo``, ``fused_linear_simpo``,
  ``fused_linear_kto``, ``fused_linear_grpo``): the same losses from the policy's last hidden states ``x`` of
  shape (sequences, tokens, hidden) and the LM head.

This module is the family's front: the losses live in ``post_training_preference`` (DPO, ORPO, CPO, SimPO, KTO)
and ``post_training_rl`` (GRPO), on the chunk loop of ``post_training_base``, and are re-exported here.

How the fused losses run. Eagerly with gradients wanted, each chunk of whole sequences (both sequences of a
chosen/rejected pair together) goes through: one GEMM for its logits, one statistics launch for its per-token
log-probabilities, the loss formula on those (a few small PyTorch ops, differentiated by autograd), one launch
that turns the logits into their gradient in place, and the dx and dW GEMMs — three GEMMs per token, with the
gradients computed in the forward and scaled by the upstream gradient in the backward. The logits of a chunk
take at most ``SEQUENCE_CHUNK_BYTES`` (1 GiB; setting it here sets the chunk loop's). Where one group does not
fit (long sequences), a loss sorts the batch (DPO's AOT), under torch.compile or tracing, without gradients, or
in float16 or float64, the loss is the formula on ``selective_log_softmax``'s log-probabilities (four GEMMs per
token with gradients: the backward recomputes the logits; extra memory within its 256 MiB plan). Both ways give
the same loss and gradients up to rounding.
"""

from __future__ import annotations

import sys
import types

from liger_gen.ops.lm_head import post_training_base as _base
from liger_gen.ops.lm_head.post_training_base import GRPOOutput, KTOOutput, PreferenceOutput
from liger_gen.ops.lm_head.post_training_preference import (CPO_LOSS_TYPES, DPO_LOSS_TYPES,
                                                            F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCE_TYPES,
                                                            KTO_LOSS_TYPES, cpo_loss, dpo_loss, f_divergence_scores,
                                                            fused_linear_cpo, fused_linear_dpo, fused_linear_kto,
                                                            fused_linear_orpo, fused_linear_simpo, kto_loss,
                                                            ld_weights, log1mexp, orpo_loss, wpo_weights)
from liger_gen.ops.lm_head.post_training_rl import (GRPO_LOSS_TYPES, IS_MODES, GRPOOptions, entropy_bonus,
                                                    fused_linear_grpo, grpo_loss, grpo_normalise,
                                                    grpo_per_token_loss, high_entropy_mask, vespo_weights,
                                                    vllm_importance_sampling_ratio)

__all__ = ["CPO_LOSS_TYPES", "DPO_LOSS_TYPES", "F_DIVERGENCE_LOSS_TYPES", "F_DIVERGENCE_TYPES", "GRPO_LOSS_TYPES",
           "IS_MODES", "KTO_LOSS_TYPES", "GRPOOptions", "GRPOOutput", "KTOOutput", "PreferenceOutput", "cpo_loss",
           "dpo_loss", "entropy_bonus", "f_divergence_scores", "fused_linear_cpo", "fused_linear_dpo",
           "fused_linear_grpo", "fused_linear_kto", "fused_linear_orpo", "fused_linear_simpo", "grpo_loss",
           "grpo_normalise", "grpo_per_token_loss", "high_entropy_mask", "kto_loss", "ld_weights", "log1mexp",
           "orpo_loss", "vespo_weights", "vllm_importance_sampling_ratio", "wpo_weights"]

class _Front(types.ModuleType):
    """This module's type: ``SEQUENCE_CHUNK_BYTES`` read or set here is the chunk loop's (``post_training_base``),
    as when the loop lived here."""

    @property
    def SEQUENCE_CHUNK_BYTES(self) -> int:
        return _base.SEQUENCE_CHUNK_BYTES

    @SEQUENCE_CHUNK_BYTES.setter
    def SEQUENCE_CHUNK_BYTES(self, value: int) -> None:
        _base.SEQUENCE_CHUNK_BYTES = value


sys.modules[__name__].__class__ = _Front
