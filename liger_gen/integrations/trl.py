"""TRL's trainers on liger-gen's per-token log-probabilities.

TRL's post-training trainers (``DPOTrainer``, ``GRPOTrainer``, ``KTOTrainer``, ``RLOOTrainer``, ``SFTTrainer``
and others) give the model a fused LM head (``trl.trainer.utils.add_fused_lm_head``): with
``fused_lm_head=True`` the forward returns per-token log-probabilities and the statistics the trainer logs,
computed in chunks by TRL's ``ChunkedLogProbFunction``, instead of logits. ``use_liger_gen_log_probs()`` has
that fused head compute them with ``liger_gen.functional.selective_log_softmax``'s tuned kernels instead; the
trainers' own losses (DPO's sigmoid, IPO, hinge, ...; GRPO's clipped ratio, KL term and normalisations; KTO,
...) are unchanged, so their semantics are TRL's by construction.

Usage, before the trainer is built or at any time before training::

    from liger_gen.integrations.trl import use_liger_gen_log_probs
    use_liger_gen_log_probs()
    trainer = trl.DPOTrainer(model=model, ...)

Under autocast the hidden states and the LM head are cast to the autocast dtype first, as autocast casts
them for the LM head's GEMM (the casts are differentiable: fp32 master weights get fp32 gradients). A hidden
state whose dtype differs from the LM head's outside autocast (``cast_lm_head_to_fp32`` with a bf16 head) and
a DeepSpeed ZeRO-3 head (TRL's function gathers it again in its backward) go to TRL's own function.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from liger_gen.ops.lm_head.selective_log_softmax import LogProbOptions, OUTPUT_NAMES, token_log_probs_2d
from liger_gen.optional import require

_lock = threading.Lock()
_original: Any = None


class LigerGenLogProbFunction:
    """Stands in for TRL's ``ChunkedLogProbFunction``: ``apply(hidden, weight, bias, targets, temperature,
    chunk_size, final_logit_softcapping=None, logit_scale=1.0, outputs=...)`` returns (log_probs, entropy,
    log_sum_sq_probs, mean_logits, is_top1), None for the fields not in ``outputs``, from liger-gen's kernels.
    ``chunk_size`` (TRL's vocab tile) is ignored: the chunk plan is liger-gen's tuned one."""

    @staticmethod
    def apply(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
              temperature: float, chunk_size: int, final_logit_softcapping: float | None = None,
              logit_scale: float = 1.0, outputs: tuple[str, ...] = OUTPUT_NAMES):
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            # as under autocast the LM head would: its GEMMs in the autocast dtype (the casts are differentiable)
            dtype = torch.get_autocast_dtype(device_type)
            with torch.autocast(device_type, enabled=False):
                return LigerGenLogProbFunction.apply(
                    hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), targets,
                    temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)
        if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype) \
                or hasattr(weight, "ds_shape"):  # ZeRO-3: TRL's function gathers the head again in its backward
            return _original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                   final_logit_softcapping, logit_scale, outputs)
        unknown = set(outputs) - set(OUTPUT_NAMES)
        if unknown:
            raise ValueError(f"liger_gen: TRL asked for per-token outputs {sorted(unknown)} that liger-gen does not "
                             f"compute (known: {OUTPUT_NAMES})")
        options = LogProbOptions(-100, float(temperature), final_logit_softcapping, float(logit_scale))
        hidden = hidden if hidden.stride(-1) == 1 or hidden.stride(0) == 1 else hidden.contiguous()
        return token_log_probs_2d(hidden, weight, targets.contiguous(), bias, options, tuple(outputs))


def _trl_utils():
    require("trl", "liger_gen.integrations.trl")
    from trl.trainer import utils

    if not hasattr(utils, "_ChunkedLogProbFunction"):
        raise RuntimeError("liger_gen: this TRL version has no fused LM head to patch "
                           "(trl.trainer.utils._ChunkedLogProbFunction; TRL >= 1.16 has it)")
    return utils


def use_liger_gen_log_probs() -> None:
    """Make TRL's fused LM head compute log-probabilities (and entropy and the logged statistics) with
    liger-gen's kernels, for every trainer in this process. Idempotent; ``restore_trl_log_probs`` undoes it.

    Raises:
        liger_gen.optional.MissingExtraError: TRL is not installed.
        RuntimeError: the installed TRL has no fused LM head (older than 1.16).
    """
    global _original
    utils = _trl_utils()
    with _lock:
        if utils._ChunkedLogProbFunction is LigerGenLogProbFunction:
            return
        _original = utils._ChunkedLogProbFunction
        utils._ChunkedLogProbFunction = LigerGenLogProbFunction


def restore_trl_log_probs() -> None:
    """Give TRL's fused LM head its own ``ChunkedLogProbFunction`` back."""
    utils = _trl_utils()
    with _lock:
        if utils._ChunkedLogProbFunction is LigerGenLogProbFunction and _original is not None:
            utils._ChunkedLogProbFunction = _original
