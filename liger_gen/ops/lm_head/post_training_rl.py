"""GRPO from hidden states and the LM head, with TRL's ``GRPOTrainer`` semantics: the per-token loss of every TRL
loss type (clipped, CISPO, SAPO, LUSPO, VESPO), the KL term (with TRL's bias correction), the importance-sampling
correction of completions sampled by another engine (vLLM), the off-policy sequence mask, the top-entropy token
selection and the entropy bonus, TRL's normalisations, and ``fused_linear_grpo``, which runs them on
``post_training_base.sequence_loss``'s chunks of whole sequences."""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass

import torch

from liger_gen.ops.lm_head.post_training_base import (GRPOOutput, check_choice, check_finite, check_flag,
                                                      check_policy, check_tensor, sequence_loss, valid_mask)
from liger_gen.runtime.ops import describe

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class GRPOOptions:
    """GRPO's per-token options, TRL's ``GRPOConfig`` names and defaults (but ``use_bias_correction_kl``, False
    here: TRL's default is True); ``checked`` validates them."""

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    delta: float | None = None
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0

    def checked(self, op: str, ref, sampling) -> "GRPOOptions":
        """The options validated (ValueError / TypeError naming the option); ``ref``, ``sampling``: whether the
        reference's and the sampling engine's log-probabilities are given."""
        check_choice(op, "loss_type", self.loss_type, GRPO_LOSS_TYPES)
        check_choice(op, "importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        check_choice(op, "vllm_importance_sampling_mode", self.vllm_importance_sampling_mode, IS_MODES)
        check_flag(op, "use_bias_correction_kl", self.use_bias_correction_kl)
        check_flag(op, "vllm_importance_sampling_correction", self.vllm_importance_sampling_correction)
        values = {name: check_finite(op, name, getattr(self, name)) for name in (
            "beta", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef")}
        values["top_entropy_quantile"] = check_finite(op, "top_entropy_quantile", self.top_entropy_quantile, 0.0, 1.0)
        values["epsilon_low"] = low = check_finite(op, "epsilon_low", self.epsilon_low, 0.0)
        if not low < 1.0:
            raise ValueError(f"{op}: epsilon_low must be in [0, 1) (the ratio is clipped at 1 − epsilon_low), got "
                             f"{low}")
        values["epsilon_high"] = check_finite(op, "epsilon_high", self.epsilon_high, 0.0)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            values[name] = check_finite(op, name, getattr(self, name), 0.0, low_open=True)
        for name, low_open in (("delta", True), ("vllm_importance_sampling_clip_max", True),
                               ("vllm_importance_sampling_clip_min", False), ("off_policy_mask_threshold", None)):
            value = getattr(self, name)
            if value is not None:
                values[name] = check_finite(op, name, value) if low_open is None else \
                    check_finite(op, name, value, 0.0, low_open=low_open)
        lo, hi = values.get("vllm_importance_sampling_clip_min"), values.get("vllm_importance_sampling_clip_max")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"{op}: vllm_importance_sampling_clip_min ({lo}) must be <= "
                             f"vllm_importance_sampling_clip_max ({hi})")
        if values["beta"] != 0.0 and not ref:
            raise ValueError(f"{op}: beta={values['beta']} needs ref_per_token_logps (the reference's per-token "
                             f"log-probabilities)")
        if self.loss_type == "vespo" and sampling and self.vllm_importance_sampling_correction and \
                not self.vllm_importance_sampling_mode.startswith("token"):
            raise ValueError(f"{op}: loss_type='vespo' with the importance-sampling correction needs "
                             f"vllm_importance_sampling_mode 'token_truncate' or 'token_mask', got "
                             f"{self.vllm_importance_sampling_mode!r}")
        return GRPOOptions(**{**self.__dict__, **values})


def _unknown_options_error(op: str, unknown: set[str], known) -> TypeError:
    """The TypeError for keyword options ``op`` does not take: each with its closest known name, and the list."""
    hints = [f"{name!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, 1))
                           else "") for name in sorted(unknown)]
    return TypeError(f"{op}: unknown options {', '.join(hints)}; the keyword options are: {', '.join(sorted(known))}")


def vllm_importance_sampling_ratio(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                                   mask: torch.Tensor, mode: str = "sequence_mask", clip_min: float | None = None,
                                   clip_max: float | None = 3.0) -> torch.Tensor:
    """The importance-sampling correction of completions sampled by another engine (vLLM) whose log-probabilities
    ``sampling_per_token_logps`` differ from the trainer's ``old_per_token_logps`` (truncated / masked IS, Yao et
    al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"), as TRL's
    ``GRPOTrainer`` computes ``importance_sampling_ratio``: d = (old − sampling)·mask (NaN → 0: tokens the engine
    did not score get ratio 1); ``token_*`` modes r = exp(d) (sequences, tokens), ``sequence_*`` modes r =
    exp(Σ_t d) (sequences, 1); ``*_truncate`` clamps r to [clip_min, clip_max], ``*_mask`` sets r outside it to 0
    (a None bound is open). No gradient (data)."""
    check_choice("vllm_importance_sampling_ratio", "mode", mode, IS_MODES)
    with torch.no_grad():
        d = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
        if mode.startswith("sequence"):
            d = d.sum(-1, keepdim=True)
        r = torch.exp(d)
        if mode.endswith("truncate"):
            return torch.clamp(r, min=clip_min, max=clip_max)
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        return r.masked_fill((r < lo) | (r > hi), 0.0)


def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  importance_sampling_ratio: torch.Tensor | None, k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> torch.Tensor:
    """VESPO's sequence weights φ(w) = e^λ·w^k·e^(−λw) (VESPO, 2026, "Variational Sequence-Level Soft Policy
    Optimization"), as TRL's ``GRPOTrainer.get_gamma_weights``: w = exp(Σ_t clamp(logp − old, ±20)·mask (+ Σ_t
    log IS ratio, clamped to [log 1e-8, 20])) clamped to [1e-8, e^20], (k, λ) by the advantage's sign (λ ≥ 1e-4);
    (sequences, 1), no gradient; NaN and ±inf → 0."""
    with torch.no_grad():
        low = math.log(1e-8)
        seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
        if importance_sampling_ratio is not None:
            seq = seq + torch.clamp(torch.log(importance_sampling_ratio), low, 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(seq, low, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, k_pos, k_neg)
        lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """The tokens in the top ``top_entropy_quantile`` ρ of the batch by entropy (Wang et al. 2025, "Beyond the
    80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning"), as TRL's
    ``GRPOTrainer.get_high_entropy_mask`` on one process: with τ the (1 − ρ)-quantile (linear interpolation, as
    ``torch.quantile``) of the fp32 entropies of the tokens where ``mask`` is set, the mask ``entropy ≥ τ`` and
    ``mask``; all False when no token is set. ρ = 1 keeps every token, ρ = 0 only the highest-entropy ones. The
    comparison is in fp32 (TRL compares float64 entropies with the fp32 τ, which can drop the token at τ; its
    fused LM head gives fp32 entropies, where the two agree). (sequences, tokens) bool, no gradient, no host
    synchronisation (the quantile skips the masked-out tokens as NaN; ``torch.nanquantile`` takes at most 2²⁴
    tokens). ValueError for ρ outside [0, 1]."""
    q = check_finite("high_entropy_mask", "top_entropy_quantile", top_entropy_quantile, 0.0, 1.0)
    with torch.no_grad():
        keep = mask.bool()
        if keep.numel() == 0:  # no tokens at all (torch.nanquantile refuses an empty tensor)
            return keep
        values = torch.where(keep, entropies.float(), torch.nan)
        threshold = torch.nanquantile(values.reshape(-1), 1.0 - q)  # NaN without tokens: nothing passes
        return (entropies.float() >= threshold) & keep


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None = None,
                  count: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's entropy term, TRL's ``entropy_coef`` bonus (the loss is ``policy loss − entropy_coef·bonus``): the
    mean entropy over the tokens of ``mask`` (and of ``entropy_mask``, the top-entropy tokens, when given),
    whatever the loss type's normalisation; ``count`` (default: those tokens' count, clamped at 1) divides the
    sum. Differentiable in ``entropies``."""
    m = mask.to(entropies.dtype)
    if entropy_mask is not None:
        m = m * entropy_mask.to(m.dtype)
    return (entropies * m).sum() / (m.sum().clamp(min=1.0) if count is None else count)


def grpo_per_token_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
                        ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
                        beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                        loss_type: str = "dapo", importance_sampling_level: str = "token",
                        delta: float | None = None, *, sampling_per_token_logps: torch.Tensor | None = None,
                        entropies: torch.Tensor | None = None, **options) -> torch.Tensor:
    """GRPO's per-token loss (Shao et al. 2024, "DeepSeekMath", Eq. 3; the clipping of PPO, Schulman et al. 2017),
    as TRL's ``GRPOTrainer._compute_loss``: with the importance ratio r = exp(logp − old) per token
    (``importance_sampling_level="token"``) or exp of the masked mean of logp − old per sequence (``"sequence"``,
    GSPO, Zheng et al. 2025), and A the advantages ((sequences,) or (sequences, tokens)):

    * grpo, bnpo, dr_grpo, dapo, luspo: −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), r first capped at ``delta``
      if given (two-sided clipping);
    * cispo: −min(r, ε_high)·A·logp with the capped ratio detached (MiniMax-M1, 2025);
    * sapo: −σ(τ·(r − 1))·4/τ·A, τ = ``sapo_temperature_pos`` where A > 0 else ``sapo_temperature_neg`` (SAPO,
      Gao et al. 2025);
    * vespo: −φ·A·logp, φ = ``vespo_weights`` (detached; ``vespo_k_pos``, ``vespo_lambda_pos``, ``vespo_k_neg``,
      ``vespo_lambda_neg``);

    times the off-policy sequence mask when ``off_policy_mask_threshold`` δ is given (DeepSeek-V3.2, Eq. 9: a
    sequence is dropped where A < 0 and the masked mean of (sampling − logp) over its tokens exceeds δ; sampling
    = ``sampling_per_token_logps``, else old), times the importance-sampling ratio of
    ``vllm_importance_sampling_ratio`` (old against ``sampling_per_token_logps``, when given and
    ``vllm_importance_sampling_correction``; vespo folds it into φ instead), plus β·k3 with k3 = exp(ref − logp)
    − (ref − logp) − 1 (times r when ``use_bias_correction_kl``: the unbiased reverse-KL gradient of
    DeepSeek-V3.2) when β ≠ 0. ``old`` None: the policy's own detached log-probabilities. With
    ``top_entropy_quantile`` ρ < 1 the policy term (before the importance-sampling ratio; the KL term is kept)
    is also multiplied by ``high_entropy_mask(entropies, mask, ρ)``: ``entropies`` (sequences, tokens), each
    token's entropy at the same temperature, is then needed. (``entropy_coef`` acts in ``grpo_loss``.)

    ``options``: the other fields of ``GRPOOptions`` by name (TRL's ``GRPOConfig`` names). Returns (sequences,
    tokens). ValueError for an unknown ``loss_type``, ``importance_sampling_level`` or
    ``vllm_importance_sampling_mode``, ε outside [0, 1) (low) or < 0 (high), δ ≤ 0, SAPO temperatures ≤ 0, clip
    bounds < 0 or min > max, non-finite values, vespo with a sequence IS mode, β ≠ 0 without the reference's
    log-probabilities, ``top_entropy_quantile`` outside [0, 1] or < 1 without ``entropies``; TypeError for an
    unknown option or a flag that is not a bool."""
    unknown = set(options) - set(GRPOOptions.__dataclass_fields__)
    if unknown:
        raise _unknown_options_error("grpo_per_token_loss", unknown, GRPOOptions.__dataclass_fields__)
    if entropies is not None and (not isinstance(entropies, torch.Tensor) or entropies.shape != mask.shape):
        got = (f"{tuple(entropies.shape)} {entropies.dtype}" if isinstance(entropies, torch.Tensor)
               else type(entropies).__name__)
        raise ValueError(f"grpo_per_token_loss: entropies must be a tensor of the mask's shape {tuple(mask.shape)} "
                         f"(each token's entropy), got {got}")
    o = GRPOOptions(beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level, delta, **options)
    o = o.checked("grpo_per_token_loss", ref_per_token_logps is not None, sampling_per_token_logps is not None)
    entropy_mask = _entropy_mask("grpo_per_token_loss", o, entropies, mask)
    return per_token_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask,
                          sampling_per_token_logps, o, entropy_mask)


def _entropy_mask(op, o: GRPOOptions, entropies, mask):
    """``high_entropy_mask`` of ``entropies`` when ``o.top_entropy_quantile`` < 1, else None."""
    if o.top_entropy_quantile >= 1.0:
        return None
    if entropies is None:
        raise ValueError(f"{op}: top_entropy_quantile={o.top_entropy_quantile} needs entropies (each token's "
                         f"entropy, (sequences, tokens))")
    return high_entropy_mask(entropies, mask, o.top_entropy_quantile)


def per_token_loss(logp, old, ref, advantages, mask, sampling, o: GRPOOptions,
                   entropy_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``grpo_per_token_loss`` with checked options ``o`` and the top-entropy token mask (None: every token)."""
    old = logp.detach() if old is None else old
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    m = mask.to(logp.dtype)
    token_log_ratio = logp - old
    log_ratio = token_log_ratio
    if o.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    is_ratio = None
    if sampling is not None and o.vllm_importance_sampling_correction:
        is_ratio = vllm_importance_sampling_ratio(old, sampling, m, o.vllm_importance_sampling_mode,
                                                  o.vllm_importance_sampling_clip_min,
                                                  o.vllm_importance_sampling_clip_max)
    if o.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=o.epsilon_high).detach() * adv * logp
    elif o.loss_type == "sapo":
        tau = torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif o.loss_type == "vespo":
        phi = vespo_weights(adv, token_log_ratio, m, is_ratio, o.vespo_k_pos, o.vespo_lambda_pos, o.vespo_k_neg,
                            o.vespo_lambda_neg)
        loss = -phi * adv * logp
    else:
        clipped = torch.clamp(ratio, 1 - o.epsilon_low, 1 + o.epsilon_high)
        capped = ratio if o.delta is None else torch.clamp(ratio, max=o.delta)
        loss = -torch.min(capped * adv, clipped * adv)
    if o.off_policy_mask_threshold is not None:
        drift = torch.nan_to_num((old if sampling is None else sampling) - logp.detach(), nan=0.0)
        mean_drift = (drift * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        loss = loss * ((adv >= 0) | (mean_drift <= o.off_policy_mask_threshold)).to(loss.dtype)
    if entropy_mask is not None:
        loss = loss * entropy_mask.to(loss.dtype)
    if is_ratio is not None and o.loss_type != "vespo":
        loss = loss * is_ratio
    if o.beta != 0.0:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        loss = loss + o.beta * (kl * ratio if o.use_bias_correction_kl else kl)
    return loss


def _check_normalisation(op, loss_type, max_completion_length, num_items_in_batch) -> None:
    check_choice(op, "loss_type", loss_type, GRPO_LOSS_TYPES)
    if max_completion_length is not None and (isinstance(max_completion_length, bool) or not isinstance(
            max_completion_length, numbers.Integral) or max_completion_length < 1):
        raise ValueError(f"{op}: max_completion_length must be a positive int, got {max_completion_length!r}")
    if num_items_in_batch is not None and not (
            isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() == 1
            or isinstance(num_items_in_batch, numbers.Real) and not isinstance(num_items_in_batch, bool)):
        raise ValueError(f"{op}: num_items_in_batch must be a number or a one-element tensor, got "
                         f"{num_items_in_batch!r}")


def grpo_normalise(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str,
                   max_completion_length: int | None = None, num_items_in_batch=None) -> torch.Tensor:
    """TRL's reductions of a GRPO per-token loss (one process, no gradient accumulation): ``grpo``/``sapo`` the
    mean over sequences of each one's masked token mean; ``bnpo`` the masked token mean of the batch;
    ``dr_grpo`` the masked sum / (sequences · ``max_completion_length``, default the token dimension; Liu et al.
    2025); ``dapo``/``cispo``/``vespo`` the masked sum / ``num_items_in_batch`` (default the mask's sum, clamped
    at 1; Yu et al. 2025); ``luspo`` the mean over sequences of each one's masked sum (LUSPO, 2026: each
    sequence's loss scaled by its length)."""
    _check_normalisation("grpo_normalise", loss_type, max_completion_length, num_items_in_batch)
    m = mask.to(per_token_loss.dtype)
    masked = per_token_loss * m
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = mask.shape[-1] if max_completion_length is None else max_completion_length
        return masked.sum() / (mask.shape[0] * length)
    if loss_type == "luspo":
        return masked.sum(-1).mean()
    items = m.sum() if num_items_in_batch is None else num_items_in_batch
    return masked.sum() / torch.as_tensor(items, dtype=masked.dtype, device=masked.device).clamp(min=1.0)


def grpo_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask, beta: float = 0.0,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
              importance_sampling_level: str = "token", delta: float | None = None,
              max_completion_length: int | None = None, num_items_in_batch=None, *,
              entropies: torch.Tensor | None = None, **options) -> torch.Tensor:
    """GRPO's loss: ``grpo_per_token_loss`` (``options``: its keyword options, ``entropies``: each token's
    entropy, needed with ``top_entropy_quantile`` < 1 or ``entropy_coef`` ≠ 0) reduced by ``grpo_normalise``,
    minus ``entropy_coef``·``entropy_bonus`` (TRL's entropy regularisation: the mean entropy over the completion
    tokens, or over the top-entropy ones with ``top_entropy_quantile`` < 1, differentiable in ``entropies``)."""
    per_token = grpo_per_token_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask,
                                    beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level, delta,
                                    entropies=entropies, **options)
    loss = grpo_normalise(per_token, mask, loss_type, max_completion_length, num_items_in_batch)
    coef = check_finite("grpo_loss", "entropy_coef", options.get("entropy_coef", 0.0))
    if coef == 0.0:
        return loss
    if entropies is None:
        raise ValueError(f"grpo_loss: entropy_coef={coef} needs entropies (each token's entropy, (sequences, "
                         f"tokens))")
    entropy_mask = None
    if options.get("top_entropy_quantile", 1.0) < 1.0:
        entropy_mask = high_entropy_mask(entropies, mask, options["top_entropy_quantile"])
    return loss - coef * entropy_bonus(entropies, mask, entropy_mask)


# ------------------------------------------------------------------------------------------------ fused loss


def fused_linear_grpo(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                      advantages: torch.Tensor, completion_mask: torch.Tensor | None = None,
                      old_per_token_logps: torch.Tensor | None = None,
                      ref_per_token_logps: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                      beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
                      loss_type: str = "dapo", importance_sampling_level: str = "token",
                      delta: float | None = None, max_completion_length: int | None = None,
                      num_items_in_batch=None, temperature: float = 1.0, ignore_index: int = -100,
                      sampling_per_token_logps: torch.Tensor | None = None, **options) -> GRPOOutput:
    """GRPO from the policy's hidden states (Shao et al. 2024), as TRL's ``GRPOTrainer`` on one process without
    gradient accumulation: ``grpo_loss`` of the per-token log-probabilities of the completions at
    ``temperature`` (TRL divides the logits by the sampling temperature).

    Args:
        x: (sequences, tokens, hidden) hidden states of the completion positions only (shifted: x[:, t] predicts
            target[:, t]; TRL's ``logits_to_keep``); target (sequences, tokens) the completion token ids
            (``ignore_index`` where none). With prompt positions included (ignored), every normalisation but
            dr_grpo is the same; dr_grpo then needs ``max_completion_length``.
        advantages: (sequences,) or (sequences, tokens). completion_mask: (sequences, tokens), 1 for tokens in
            the loss (TRL's completion mask); default ``target != ignore_index``.
        old_per_token_logps: (sequences, tokens) the sampling policy's log-probabilities (None: the policy's
            own, detached). ref_per_token_logps: (sequences, tokens), needed when β ≠ 0.
        beta, epsilon_low, epsilon_high (default epsilon_low), loss_type (grpo, bnpo, dr_grpo, dapo, cispo, sapo,
            luspo, vespo), importance_sampling_level (token, sequence), delta, max_completion_length,
            num_items_in_batch: TRL's options of the same names (see ``grpo_per_token_loss`` and
            ``grpo_normalise`` in ``liger_gen.ops.lm_head.post_training``).
        sampling_per_token_logps: (sequences, tokens) the log-probabilities of the engine that sampled the
            completions (vLLM; TRL's ``sampling_per_token_logps``, NaN where it gave none): with it the loss is
            importance-sampling corrected as TRL's ``vllm_importance_sampling_correction`` (and the off-policy
            mask measures the drift from it).
        options: keyword options of ``GRPOOptions``, TRL's ``GRPOConfig`` names: ``use_bias_correction_kl``
            (default False here, True in TRL), ``sapo_temperature_pos``/``_neg``, ``vespo_k_pos``,
            ``vespo_lambda_pos``, ``vespo_k_neg``, ``vespo_lambda_neg``, ``vllm_importance_sampling_correction``
            (True), ``vllm_importance_sampling_mode`` ("sequence_mask"), ``vllm_importance_sampling_clip_min``
            (None), ``vllm_importance_sampling_clip_max`` (3.0), ``off_policy_mask_threshold`` (None),
            ``top_entropy_quantile`` (1.0), ``entropy_coef`` (0.0); see below.

    Entropy (TRL's ``top_entropy_quantile`` and ``entropy_coef``): each token's entropy at ``temperature`` comes
    from the statistics launch that computes its log-probability, in the same pass over the chunk's logits (no
    extra GEMM). ``top_entropy_quantile`` ρ < 1 keeps the policy term only on the tokens whose entropy is in the
    top ρ of the completion tokens (``high_entropy_mask``): the quantile is over the whole batch, so the loss then
    runs as one chunk of every sequence when the batch's logits fit ``SEQUENCE_CHUNK_BYTES``, else as the formula
    (its backward recomputes the logits: four GEMMs per token, extra memory within the 256 MiB plan). The
    quantile is over this call's tokens; TRL gathers them over all processes first. ``entropy_coef`` c subtracts
    c·(mean entropy over the completion tokens, or over the kept ones with ρ < 1) from the loss, with its
    gradient (TRL's entropy bonus, whatever the loss type; with ``use_adaptive_entropy`` the trainer picks c each
    step from the logged entropy: pass the c it applies, 0 for none).

    Returns ``GRPOOutput`` (loss 0-d float32; per-token log-probabilities, 0 where target is ignore_index; the
    per-token entropies where the entropy options use them, else None).
    Raises ValueError naming the tensor or option for bad shapes or options (see ``grpo_per_token_loss``),
    TypeError for an unknown option."""
    op = "fused_linear_grpo"
    policy = check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, False)
    unknown = set(options) - set(GRPOOptions.__dataclass_fields__)
    if unknown:
        raise _unknown_options_error(op, unknown, GRPOOptions.__dataclass_fields__)
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    o = GRPOOptions(beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level, delta, **options)
    o = o.checked(op, ref_per_token_logps is not None, sampling_per_token_logps is not None)
    _check_normalisation(op, loss_type, max_completion_length, num_items_in_batch)
    n, t = target.shape
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"{op}: advantages must be a tensor of shape ({n},) or ({n}, {t}), got "
                         f"{type(advantages).__name__}")
    for name, value, shapes in (("advantages", advantages, ((n,), (n, t))),
                                ("completion_mask", completion_mask, ((n, t),)),
                                ("old_per_token_logps", old_per_token_logps, ((n, t),)),
                                ("ref_per_token_logps", ref_per_token_logps, ((n, t),)),
                                ("sampling_per_token_logps", sampling_per_token_logps, ((n, t),))):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) not in shapes:
            got = describe(name, value) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{op}: {name} must be {' or '.join(str(s) for s in shapes)}; got {got}")
        if value.device != x.device:
            raise ValueError(f"{op}: {name} must be on x's device {x.device}; got {describe(name, value)}")
    if sampling_per_token_logps is not None:
        check_tensor(op, "sampling_per_token_logps", sampling_per_token_logps, ((n, t),), x.device)
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.device != x.device:
        num_items_in_batch = num_items_in_batch.to(x.device)
    # the sampling policies' and the reference's log-probabilities and the advantages are data: no gradient (as
    # TRL computes them under no_grad), on either path
    mask = (valid_mask(target, ignore_index) if completion_mask is None else completion_mask.detach().float())
    adv = advantages.detach().float()
    old, ref, sampling = (None if v is None else v.detach().float()
                          for v in (old_per_token_logps, ref_per_token_logps, sampling_per_token_logps))
    if loss_type in ("grpo", "sapo"):
        scale = 1.0 / (mask.sum(-1).clamp(min=1.0) * max(n, 1))  # per sequence
    elif loss_type == "bnpo":
        scale = 1.0 / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        scale = 1.0 / (max(n, 1) * (t if max_completion_length is None else max_completion_length))
    elif loss_type == "luspo":
        scale = 1.0 / max(n, 1)
    else:
        items = mask.sum() if num_items_in_batch is None else num_items_in_batch
        scale = 1.0 / torch.as_tensor(items, dtype=torch.float32, device=x.device).detach().clamp(min=1.0)

    select = o.top_entropy_quantile < 1.0
    with_entropy = select or o.entropy_coef != 0.0
    n_tokens = mask.sum().clamp(min=1.0)  # the bonus's mean over every completion token (without the selection)

    def chunk_loss(logp, ranges, stats=None):
        (lo, hi), = ranges
        sl = slice(lo, hi)
        entropy = None if stats is None else stats["entropy"]
        # with the selection, this chunk is the whole batch: the quantile is the batch's
        entropy_mask = high_entropy_mask(entropy, mask[sl], o.top_entropy_quantile) if select else None
        per_token = per_token_loss(logp, None if old is None else old[sl], None if ref is None else ref[sl], adv[sl],
                                   mask[sl], None if sampling is None else sampling[sl], o, entropy_mask)
        weighted = (per_token * mask[sl]).sum(-1)
        s = scale[sl] if isinstance(scale, torch.Tensor) and scale.dim() else scale
        value = (weighted * s).sum()
        if o.entropy_coef != 0.0:
            value = value - o.entropy_coef * entropy_bonus(entropy, mask[sl], entropy_mask,
                                                           None if select else n_tokens)
        return value

    loss, logp, stats = sequence_loss(x, lm_head_weight, bias, target, policy, False, chunk_loss, select,
                                      ("entropy",) if with_entropy else ())
    return GRPOOutput(loss, logp, stats.get("entropy"))
