"""Preference losses from hidden states and the LM head, with TRL's semantics: DPO (every TRL loss type, their
combinations, RPO's NLL term, LD-DPO's length weighting, WPO's weights, f-DPO's divergences), ORPO, CPO, SimPO
and KTO — the formulas on sequence log-probabilities (``dpo_loss``, ``orpo_loss``, ``cpo_loss``, ``kto_loss``)
and the fused losses (``fused_linear_*``) that run them on ``post_training_base.sequence_loss``'s chunks of whole
sequences."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from liger_gen.ops.lm_head.post_training_base import (KTOOutput, PreferenceOutput, check_choice, check_finite,
                                                      check_flag, check_policy, check_ref_head, ref_logps,
                                                      sequence_loss, valid_mask)
from liger_gen.runtime.ops import check_targets, describe, host_checkable

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
#: DPO's f-divergence regularisers (f-DPO, Wang et al. 2023), TRL's ``DPOConfig.f_divergence_type``
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
#: the DPO loss types built on the chosen − rejected score difference: the only ones with an f-divergence other
#: than the reverse KL (as TRL restricts them)
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def f_divergence_scores(log_ratio: torch.Tensor, f_divergence_type: str = "reverse_kl",
                        f_alpha_divergence_coef: float = 0.5) -> torch.Tensor:
    """The score f′(t) at t = π/ref of a sequence log-ratio ρ = log t (f-DPO, Wang et al. 2023, "Beyond Reverse
    KL: Generalizing Direct Preference Optimization with Diverse Divergence Constraints", Table 1 up to constants
    that cancel in the chosen − rejected difference), as TRL's ``DPOTrainer``: ``reverse_kl`` ρ; ``forward_kl``
    1 − e^(−ρ); ``js_divergence`` log 2 + log σ(ρ); ``alpha_divergence`` (e^((α−1)ρ) − 1)/(α−1) with α =
    ``f_alpha_divergence_coef`` (ρ where |α − 1| < 1e-6, the limit), the exponent computed in fp32 at least and
    capped at 80 (11 for float16) so that e^(·) stays finite in the result's dtype, as TRL caps it."""
    if f_divergence_type == "reverse_kl":
        return log_ratio
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(log_ratio)
    if abs(f_alpha_divergence_coef - 1.0) < 1e-6:
        return log_ratio
    a = f_alpha_divergence_coef - 1.0
    cap = 11.0 if log_ratio.dtype == torch.float16 else 80.0
    work = torch.promote_types(log_ratio.dtype, torch.float32)
    return torch.expm1(torch.clamp((a * log_ratio).to(work), max=cap)).to(log_ratio.dtype) / a  # no cancellation near α = 1


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None, *, discopop_tau: float = 0.05,
             nll: torch.Tensor | None = None, f_divergence_type: str = "reverse_kl",
             f_alpha_divergence_coef: float = 0.5) -> torch.Tensor:
    """Per-pair DPO loss (Rafailov et al. 2023, "Direct Preference Optimization"), as TRL's ``DPOTrainer``
    (``loss_type`` as TRL 1.16 names them).

    With the log-ratios ρ_c = π_c − ref_c, ρ_r = π_r − ref_r of summed sequence log-probabilities (pairs,),
    Δ = ρ_c − ρ_r, ε = ``label_smoothing``:

    * ``sigmoid``: −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ) (conservative DPO; TRL's ``sigmoid`` is ε = 0);
    * ``hinge``: relu(1 − βΔ) (SLiC, Zhao et al. 2023);
    * ``ipo``: (Δ̄ − 1/(2β))², Δ̄ the difference of the log-ratios each divided by its completion's token count
      (``chosen_lengths``, ``rejected_lengths``, clamped to ≥ 1), as TRL normalises IPO (Azar et al. 2023);
    * ``exo_pair``: σ(βΔ)·(log σ(βΔ) − log(1 − ε)) + σ(−βΔ)·(log σ(−βΔ) − log ε), 0 < ε < 1 (EXO, Ji et al.
      2024, Eq. 16);
    * ``nca_pair``: −log σ(βρ_c) − ½·log σ(−βρ_c) − ½·log σ(−βρ_r) (NCA, Chen et al. 2024);
    * ``robust``: (−(1 − ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε), 0 ≤ ε < 1/2 (rDPO, Chowdhury et al. 2024);
    * ``bco_pair``: −log σ(βρ_c) − log σ(−βρ_r) (BCO, Jung et al. 2024);
    * ``sppo_hard``: (ρ_c − 1/(2β))² + (ρ_r + 1/(2β))² (SPPO with hard probabilities, Wu et al. 2024);
    * ``aot``: the sigmoid loss (with ε) of δ = sort(π_c − π_r) − sort(ref_c − ref_r) over the batch;
      ``aot_unpaired``: of δ = sort(ρ_c) − sort(ρ_r) (AOT, Melnyk et al. 2024): not per pair, the batch sorted;
    * ``apo_zero``: 1 − σ(βρ_c) + σ(βρ_r); ``apo_down``: σ(βρ_c) + 1 − σ(βΔ) (APO, D'Oosterlinck et al. 2024,
      Eqs. 7 and 8);
    * ``discopop``: with l = βΔ and m = σ(l/τ), τ = ``discopop_tau`` > 0: −log σ(l)·(1 − m) + e^(−l)·m
      (DiscoPOP, Chris Lu et al. 2024, Eq. 5);
    * ``sft``: ``nll`` (0-d: the mean negative log-likelihood of the chosen completions' tokens) for every pair;
    * ``sigmoid_norm``: −log σ(βΔ̄), Δ̄ as for ``ipo``.

    ``f_divergence_type`` (TRL's ``DPOConfig`` option, f-DPO): the log-ratios ρ_c, ρ_r of the loss types built on
    their difference (``F_DIVERGENCE_LOSS_TYPES``: sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop,
    sft) are replaced by the scores ``f_divergence_scores(ρ, f_divergence_type, f_alpha_divergence_coef)``
    before Δ (and Δ̄) is formed; the default ``reverse_kl`` is plain DPO.

    Returns the (pairs,) losses in the promoted floating dtype; the loss is their mean. ValueError for an unknown
    ``loss_type`` or ``f_divergence_type``, an f-divergence other than the reverse KL with a loss type outside
    ``F_DIVERGENCE_LOSS_TYPES`` (as TRL refuses it), β ≤ 0, ε outside [0, 1] (robust: [0, 1/2); exo_pair:
    (0, 1)), τ ≤ 0, a non-finite ``f_alpha_divergence_coef``, ipo or sigmoid_norm without the lengths, sft
    without ``nll``.
    """
    op = "dpo_loss"
    check_choice(op, "loss_type", loss_type, DPO_LOSS_TYPES)
    beta = check_finite(op, "beta", beta, 0.0, low_open=True)
    eps = check_finite(op, "label_smoothing", label_smoothing, 0.0, 1.0)
    tau = check_finite(op, "discopop_tau", discopop_tau, 0.0, low_open=True)
    check_choice(op, "f_divergence_type", f_divergence_type, F_DIVERGENCE_TYPES)
    alpha = check_finite(op, "f_alpha_divergence_coef", f_alpha_divergence_coef)
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(f"{op}: f_divergence_type={f_divergence_type!r} needs a loss type built on the chosen − "
                         f"rejected score difference ({list(F_DIVERGENCE_LOSS_TYPES)}), got {loss_type!r}; use "
                         f"'reverse_kl' with it")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    chosen_score = f_divergence_scores(chosen_ratio, f_divergence_type, alpha)
    rejected_score = f_divergence_scores(rejected_ratio, f_divergence_type, alpha)
    if loss_type in ("ipo", "sigmoid_norm"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"{op}: loss_type={loss_type!r} needs chosen_lengths and rejected_lengths (completion "
                             f"tokens)")
        delta = chosen_score / chosen_lengths.clamp(min=1) - rejected_score / rejected_lengths.clamp(min=1)
        if loss_type == "ipo":
            return (delta - 1.0 / (2.0 * beta)) ** 2
        return -F.logsigmoid(beta * delta)
    delta = chosen_score - rejected_score
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * delta)
    if loss_type == "robust":
        if not eps < 0.5:
            raise ValueError(f"{op}: loss_type='robust' needs 0 <= label_smoothing < 0.5, got {eps}")
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        if not 0.0 < eps < 1.0:
            raise ValueError(f"{op}: loss_type='exo_pair' needs 0 < label_smoothing < 1 (the EXO paper suggests "
                             f"1e-3), got {eps}")
        z = beta * delta
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    c, r = beta * chosen_ratio, beta * rejected_ratio
    if loss_type == "nca_pair":
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if loss_type == "bco_pair":
        return -F.logsigmoid(c) - F.logsigmoid(-r)
    if loss_type == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(c) + torch.sigmoid(r)
    if loss_type == "apo_down":
        return torch.sigmoid(c) + 1 - torch.sigmoid(beta * delta)
    if loss_type == "discopop":
        z = beta * delta
        m = torch.sigmoid(z / tau)
        return -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m
    if loss_type == "sft":
        if nll is None:
            raise ValueError(f"{op}: loss_type='sft' needs nll (the chosen completions' mean negative "
                             f"log-likelihood)")
        return nll.expand(chosen_logps.shape)
    if loss_type == "aot":
        delta = (torch.sort(chosen_logps - rejected_logps, dim=0)[0]
                 - torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)[0])
    elif loss_type == "aot_unpaired":
        delta = torch.sort(chosen_ratio, dim=0)[0] - torch.sort(rejected_ratio, dim=0)[0]
    return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x ≤ 0 without cancellation (Mächler 2012: log1p(−exp(x)) below −log 2, else
    log(−expm1(x)))."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """Per-pair odds-ratio term of ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
    Reference Model", Eqs. 4 and 7), as TRL's ``ORPOTrainer.odds_ratio_loss``: with per-token mean
    log-probabilities (pairs,), ``log_odds = (c − r) − (log(1 − e^c) − log(1 − e^r))`` and the term is
    ``β·log σ(log_odds)``. ORPO's loss is ``NLL(chosen) − mean(term)``. ValueError for β ≤ 0."""
    beta = check_finite("orpo_loss", "beta", beta, 0.0, low_open=True)
    dtype = torch.promote_types(chosen_logps.dtype, torch.float32)  # fp32 at least, as TRL computes it
    c, r = chosen_logps.to(dtype), rejected_logps.to(dtype)
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return beta * F.logsigmoid(log_odds)


def cpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
             alpha: float = 0.0) -> torch.Tensor:
    """Per-pair CPO / SimPO loss (Xu et al. 2024, "Contrastive Preference Optimization", Eq. 3; Meng et al. 2024,
    "SimPO", Eq. 6), as TRL's ``CPOTrainer.cpo_loss``, without a reference model.

    With ``d = c − r`` (summed log-probabilities for ``sigmoid``/``hinge``, per-token means for ``ipo``/
    ``simpo``, as TRL computes them) — or, for ``alpha`` ≠ 0 (AlphaPO, Gupta et al. 2025), the difference of
    the rewards ``(1 − p^(−α))/α`` with p = exp(logps):

    * ``sigmoid``: −(1 − ε)·log σ(βd) − ε·log σ(−βd); ``simpo``: the same with d − γ/β (γ = ``simpo_gamma``);
    * ``hinge``: relu(1 − βd); ``ipo``: (d − 1/(2β))².

    CPO's loss adds ``cpo_alpha``·NLL(chosen) to the mean (see ``fused_linear_cpo``). Returns (pairs,) losses.
    """
    op = "cpo_loss"
    check_choice(op, "loss_type", loss_type, CPO_LOSS_TYPES)
    beta = check_finite(op, "beta", beta, 0.0, low_open=True)
    eps = check_finite(op, "label_smoothing", label_smoothing, 0.0, 1.0)
    gamma = check_finite(op, "simpo_gamma", simpo_gamma)
    alpha = check_finite(op, "alpha", alpha)
    if alpha != 0.0:
        d = (1 - torch.exp(chosen_logps).pow(-alpha)) / alpha - (1 - torch.exp(rejected_logps).pow(-alpha)) / alpha
    else:
        d = chosen_logps - rejected_logps
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * d)
    if loss_type == "ipo":
        return (d - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "simpo":
        d = d - gamma / beta
    return -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float = 0.0,
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             loss_type: str = "kto") -> torch.Tensor:
    """Per-sequence KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
    Eq. 7), as TRL's ``KTOTrainer``: with the log-ratio ρ = logp − ref of summed sequence log-probabilities and
    the batch KL estimate z₀ = ``kl`` (detached, clamped at 0 by the caller as TRL does), ``loss_type="kto"``:
    desirable sequences lose ``w_d·(1 − σ(β(ρ − z₀)))`` and undesirable ones ``w_u·(1 − σ(β(z₀ − ρ)))``;
    ``"apo_zero_unpaired"`` (APO-zero unpaired, D'Oosterlinck et al. 2024; no KL term): ``w_d·(1 − σ(βρ))`` and
    ``w_u·σ(βρ)``. TRL's loss is the mean over all sequences. ``desirable``: (sequences,) bool. ValueError for
    an unknown ``loss_type``, β ≤ 0 or a negative weight."""
    op = "kto_loss"
    check_choice(op, "loss_type", loss_type, KTO_LOSS_TYPES)
    beta = check_finite(op, "beta", beta, 0.0, low_open=True)
    w_d = check_finite(op, "desirable_weight", desirable_weight, 0.0)
    w_u = check_finite(op, "undesirable_weight", undesirable_weight, 0.0)
    ratio = logps - ref_logps
    if loss_type == "apo_zero_unpaired":
        return torch.where(desirable, w_d * (1 - torch.sigmoid(beta * ratio)), w_u * torch.sigmoid(beta * ratio))
    good = w_d * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = w_u * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable, good, bad)


# ------------------------------------------------------------------------------------------------ fused losses


def fused_linear_dpo(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                     ref_x: torch.Tensor | None = None, ref_lm_head_weight: torch.Tensor | None = None,
                     ref_log_probs: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                     ref_bias: torch.Tensor | None = None, beta: float = 0.1,
                     loss_type: str | Sequence[str] = "sigmoid", label_smoothing: float = 0.0,
                     loss_weights: Sequence[float] | None = None, rpo_alpha: float | None = None,
                     ld_alpha: float | None = None, discopop_tau: float = 0.05, use_weighting: bool = False,
                     f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
                     ignore_index: int = -100, temperature: float = 1.0) -> PreferenceOutput:
    """DPO from the policy's hidden states (Rafailov et al. 2023), as TRL's ``DPOTrainer``: the mean over pairs
    of ``liger_gen.ops.lm_head.post_training.dpo_loss`` on summed completion log-probabilities.

    Args:
        x: (2·pairs, tokens, hidden) float32/bfloat16/float16 last hidden states, the chosen sequences first and
            the rejected ones after, shifted so that position t predicts ``target[:, t]``.
        lm_head_weight: (vocab, hidden), x's dtype. target: (2·pairs, tokens) int64/int32, ``ignore_index`` on
            prompt and padding positions.
        ref_x, ref_lm_head_weight (and ``ref_bias``): the reference model's hidden states (2·pairs, tokens,
            ref_hidden) and LM head (vocab, ref_hidden), no gradient; or ``ref_log_probs`` (2·pairs,) its summed
            log-probabilities precomputed (TRL's ``precompute_ref_log_probs``; with ``ld_alpha``, weighted as
            below, as TRL precomputes them). Exactly one of the two.
        beta, label_smoothing, discopop_tau: see ``liger_gen.ops.lm_head.post_training.dpo_loss``.
        loss_type: one of ``DPO_LOSS_TYPES`` (sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair,
            sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm), or a list of them
            combined as TRL's ``DPOConfig(loss_type=[...], loss_weights=[...])`` does: loss = Σ wᵢ·mean(lossᵢ)
            (e.g. MPO: ``["sigmoid", "bco_pair", "sft"]``). ``sft`` is the chosen completions' mean NLL. aot
            and aot_unpaired sort the batch: they run as one chunk of every pair (or on the formula path).
        loss_weights: one finite weight per loss type (default 1 each).
        rpo_alpha: adds ``rpo_alpha``·NLL(chosen completions, token mean) (RPO, Pang et al. 2024;
            Liger-Kernel's and earlier TRL's option of this name; TRL 1.16 writes it ``loss_type=[..., "sft"]``
            with weight ``rpo_alpha``). None: no NLL term.
        ld_alpha: LD-DPO's α in [0, 1] (Liu et al. 2024, "Length Desensitization in DPO"), as TRL's ``ld_alpha``:
            each pair's completion tokens past the shorter completion's length (the "verbose" tail) count α times
            in both sequences' summed log-probabilities, the policy's and the reference's. None: plain sums.
        use_weighting: WPO's weights (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference
            Optimization", Eq. 2), as TRL's ``DPOConfig.use_weighting``: each sequence gets w = exp(mean over its
            completion tokens of log p_y − log Σ_v p_v²) (the token's probability relative to Σ_v p_v·p_v, the
            probability the policy gives a token drawn from itself; no gradient; 1 for an empty completion), and each
            loss type's per-pair loss (the "sft" term and ``rpo_alpha``'s NLL included, as TRL weights them) is
            multiplied by w_chosen·w_rejected before its mean. log Σ_v p_v² comes from the same statistics launch
            as the log-probabilities. With "sft" or ``rpo_alpha`` the NLL term is the NLL times the batch mean of
            the pair weights, not a sum over chunks: the loss then runs as one chunk of every pair (or the
            formula). Not with aot or aot_unpaired (they sort the batch: ValueError, as TRL refuses it).
        f_divergence_type, f_alpha_divergence_coef: f-DPO's divergence (TRL's options of these names;
            ``reverse_kl``, ``forward_kl``, ``js_divergence``, ``alpha_divergence`` with α =
            ``f_alpha_divergence_coef``), see ``dpo_loss`` and ``f_divergence_scores``.

    Returns ``PreferenceOutput`` (loss 0-d float32, differentiable in x, lm_head_weight and bias; logps the
    (weighted) sums; rewards β·(π − ref)). Raises ValueError / TypeError naming the tensor or option for bad
    shapes, dtypes or options (an odd number of sequences: the chosen and rejected batch sizes differ; a
    reference head of another vocabulary; an empty or unknown ``loss_type``, ``loss_weights`` of another length
    or not finite, ``rpo_alpha`` not finite, ``ld_alpha`` outside [0, 1], ``use_weighting`` not a bool or with
    aot / aot_unpaired, an unknown ``f_divergence_type`` or one other than ``reverse_kl`` with a loss type
    outside ``F_DIVERGENCE_LOSS_TYPES``). A pair whose completions are all
    ``ignore_index`` has Δ = 0 (IPO, sigmoid_norm: lengths clamped to 1); a batch with no chosen completion token
    makes the NLL (sft, rpo_alpha) 0/0 = NaN, as TRL's."""
    op = "fused_linear_dpo"
    options = check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, True)
    check_ref_head(op, ref_lm_head_weight, lm_head_weight)
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type) if isinstance(
        loss_type, (list, tuple)) else None
    if not types:
        raise ValueError(f"{op}: loss_type must be one of {list(DPO_LOSS_TYPES)} or a non-empty list of them, got "
                         f"{loss_type!r}")
    weights = (1.0,) * len(types) if loss_weights is None else tuple(loss_weights)
    if len(weights) != len(types):
        raise ValueError(f"{op}: loss_weights must have one weight per loss type ({len(types)}), got {weights!r}")
    weights = tuple(check_finite(op, "loss_weights", w) for w in weights)
    divergence = dict(f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef)
    for t in types:  # validates the options before any work
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta, t, label_smoothing,
                 torch.ones(1), torch.ones(1), discopop_tau=discopop_tau, nll=torch.zeros(()), **divergence)
    weighting = check_flag(op, "use_weighting", use_weighting)
    sorts = any(t in ("aot", "aot_unpaired") for t in types)
    if weighting and sorts:
        raise ValueError(f"{op}: use_weighting does not go with loss_type 'aot' or 'aot_unpaired' (they sort the "
                         f"batch, which would misalign the per-pair weights; TRL refuses it too), got {types}")
    rpo_alpha = None if rpo_alpha is None else check_finite(op, "rpo_alpha", rpo_alpha)
    ld_alpha = None if ld_alpha is None else check_finite(op, "ld_alpha", ld_alpha, 0.0, 1.0)
    n = x.shape[0]
    pairs = n // 2
    completion = valid_mask(target, ignore_index)
    lengths = completion.sum(-1)
    tokens = None if ld_alpha is None else ld_weights(completion, ld_alpha)
    ref = ref_logps(op, ref_x, ref_lm_head_weight, ref_bias, target, options, ref_log_probs, n, tokens)
    n_nll = lengths[:pairs].sum()  # no chosen token: NaN, as TRL's mean over an empty selection

    def chunk_loss(logp, ranges, stats=None):
        (c0, c1), (r0, r1) = ranges
        k = c1 - c0
        sums = (logp if tokens is None else logp * torch.cat([tokens[c0:c1], tokens[r0:r1]])).sum(-1)
        nll = -(logp[:k] * completion[c0:c1]).sum() / n_nll
        pair_weights = None
        if weighting:
            pair_weights = wpo_weights(logp, stats["log_sum_sq_probs"],
                                       torch.cat([completion[c0:c1], completion[r0:r1]]))
            pair_weights = pair_weights[:k] * pair_weights[k:]
            # the NLL (a batch mean) times the pairs' mean weight: with it, this chunk is the whole batch
            nll = nll * pair_weights.sum() / max(pairs, 1)
        total = 0.0
        for t, w in zip(types, weights):
            if t == "sft":  # a batch mean, not a mean over pairs
                total = total + w * nll
                continue
            losses = dpo_loss(sums[:k], sums[k:], ref[c0:c1], ref[r0:r1], beta, t, label_smoothing,
                              lengths[c0:c1], lengths[r0:r1], discopop_tau=discopop_tau, **divergence)
            if pair_weights is not None:
                losses = losses * pair_weights
            total = total + w * losses.sum() / max(pairs, 1)
        return total if rpo_alpha is None else total + rpo_alpha * nll

    # the weighted NLL (sft, rpo_alpha) is a product of two batch sums: one chunk of every pair, as AOT's sort
    whole = sorts or (weighting and ("sft" in types or rpo_alpha is not None))
    loss, logp, _ = sequence_loss(x, lm_head_weight, bias, target, options, True, chunk_loss, whole,
                                  ("log_sum_sq_probs",) if weighting else ())
    sums = (logp if tokens is None else logp * tokens).sum(-1)
    return PreferenceOutput(loss, sums[:pairs], sums[pairs:], beta * (sums[:pairs] - ref[:pairs]),
                            beta * (sums[pairs:] - ref[pairs:]))


def wpo_weights(per_token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor,
                completion_mask: torch.Tensor) -> torch.Tensor:
    """WPO's sequence weights (Zhou et al. 2024, Eq. 2, the length-normalised form TRL's ``use_weighting``
    computes): exp(Σ_t (log p_t − log Σ_v p_{t,v}²)·m_t / max(Σ_t m_t, 1)) of (sequences, tokens) inputs, the
    log-probabilities of the chosen tokens, log Σ_v p_v² of each token's distribution and the completion mask;
    (sequences,), no gradient (data)."""
    with torch.no_grad():
        m = completion_mask.to(per_token_logps.dtype)
        aligned = (per_token_logps - log_sum_sq_probs.to(per_token_logps.dtype)) * m
        return torch.exp(aligned.sum(-1) / m.sum(-1).clamp(min=1.0))


def ld_weights(completion: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's token weights (2·pairs, tokens) of a paired completion mask, as TRL's ``ld_alpha``: 1 on each
    completion's first min(chosen, rejected) tokens (the pair's shared length), ``ld_alpha`` on the rest, 0 off
    the completions."""
    pairs = completion.shape[0] // 2
    lengths = completion.sum(-1)
    shared = torch.minimum(lengths[:pairs], lengths[pairs:]).repeat(2)
    position = completion.cumsum(-1)
    return completion * torch.where(position <= shared[:, None], 1.0, ld_alpha)


def _nll_target(op, target, nll_target, ignore_index, vocab: int):
    """The targets of the chunk loop: the completion targets, with ``nll_target`` (pairs, tokens) filling the
    chosen sequences' ignored positions (the prompt) when the NLL term covers them; and the NLL mask (pairs,
    tokens)."""
    pairs = target.shape[0] // 2
    if nll_target is None:
        return target, valid_mask(target[:pairs], ignore_index)
    if not isinstance(nll_target, torch.Tensor) or nll_target.shape != (pairs, target.shape[1]) or \
            nll_target.dtype not in (torch.int64, torch.int32):
        got = describe("nll_target", nll_target) if isinstance(nll_target, torch.Tensor) else \
            type(nll_target).__name__
        raise ValueError(f"{op}: nll_target must be ({pairs}, {target.shape[1]}) int64/int32, the chosen "
                         f"sequences' NLL targets; got {got}")
    if nll_target.device != target.device:
        raise ValueError(f"{op}: nll_target must be on target's device {target.device}; got "
                         f"{describe('nll_target', nll_target)}")
    check_targets(op, nll_target.reshape(-1), vocab, ignore_index)
    both = (target[:pairs] != ignore_index) & (nll_target != ignore_index)
    if not target.is_cuda and host_checkable(target, nll_target) and \
            bool((both & (nll_target != target[:pairs])).any()):
        # (on CUDA not checked: a host sync; nor under torch.func.vmap of the targets, a data-dependent branch)
        raise ValueError(f"{op}: nll_target must hold target's token wherever both are not ignore_index (one "
                         f"log-probability per position); they differ in {describe('nll_target', nll_target)}")
    chosen = torch.where(target[:pairs] != ignore_index, target[:pairs], nll_target.to(target.dtype))
    return torch.cat([chosen, target[pairs:]]), valid_mask(nll_target, ignore_index)


def _pair_means(logp, ranges, completion_mask, nll_mask):
    """(chosen, rejected) per-token mean log-probabilities over the completion and the chosen NLL sum of a chunk."""
    (c0, c1), (r0, r1) = ranges
    k = c1 - c0
    m = torch.cat([completion_mask[c0:c1], completion_mask[r0:r1]])
    means = (logp * m).sum(-1) / m.sum(-1)  # 0/0 = NaN for an empty completion, as in TRL
    nll_sum = -(logp[:k] * nll_mask[c0:c1]).sum()
    return means[:k], means[k:], nll_sum


def fused_linear_orpo(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor, *,
                      bias: torch.Tensor | None = None, beta: float = 0.1, nll_target: torch.Tensor | None = None,
                      compute_nll_loss: bool = True, ignore_index: int = -100,
                      temperature: float = 1.0) -> PreferenceOutput:
    """ORPO from the policy's hidden states (Hong et al. 2024), as TRL's ``ORPOTrainer``: ``NLL(chosen) −
    mean(orpo_loss(c̄, r̄))`` (``liger_gen.ops.lm_head.post_training.orpo_loss``) with c̄, r̄ the per-token mean completion
    log-probabilities and NLL the mean negative log-likelihood over the chosen sequences' ``nll_target`` tokens.
    The default NLL covers the chosen completions only (``target``'s chosen half, as Liger-Kernel's ORPO); TRL's
    ``ORPOTrainer`` covers prompt and completion: pass ``nll_target`` = the chosen sequences' next tokens with
    ``ignore_index`` on padding for TRL's loss. No reference model.

    x, lm_head_weight, target, bias: as in ``fused_linear_dpo``. ``nll_target``: optional (pairs, tokens); where
    both it and the chosen half of ``target`` are not ``ignore_index`` they must hold the same token (ValueError on
    the CPU; not checked on CUDA, where it would need a host sync). As in TRL, a completion whose per-token mean
    log-probability rounds to 0 in fp32 (a certain policy) has log(1 − e^0) = −inf: the loss is inf. Returns
    ``PreferenceOutput`` (logps are the means; rewards β·mean). As in TRL, a completion with no token has the
    mean 0/0 and makes the loss NaN, and so does a batch with no NLL token.

    ``compute_nll_loss`` (bool, Liger-Kernel's option of this name): False drops the NLL term, leaving
    ``−mean(orpo_loss(c̄, r̄))`` (the odds-ratio term alone, e.g. to add one's own SFT loss); ``nll_target`` is
    then not used. TypeError if it is not a bool."""
    op = "fused_linear_orpo"
    options = check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, True)
    orpo_loss(torch.zeros(1) - 1, torch.zeros(1) - 1, beta)
    with_nll = check_flag(op, "compute_nll_loss", compute_nll_loss)
    pairs = x.shape[0] // 2
    loop_target, nll_mask = _nll_target(op, target, nll_target if with_nll else None, ignore_index,
                                        lm_head_weight.shape[0])
    completion = valid_mask(target, ignore_index)
    n_nll = nll_mask.sum()  # no NLL token: NaN, as PyTorch's mean cross-entropy

    def chunk_loss(logp, ranges):
        c, r, nll_sum = _pair_means(logp, ranges, completion, nll_mask)
        odds = orpo_loss(c, r, beta).sum() / max(pairs, 1)
        return nll_sum / n_nll - odds if with_nll else -odds

    loss, logp, _ = sequence_loss(x, lm_head_weight, bias, loop_target, options, True, chunk_loss)
    means = (logp * completion).sum(-1) / completion.sum(-1)
    return PreferenceOutput(loss, means[:pairs], means[pairs:], beta * means[:pairs], beta * means[pairs:])


def fused_linear_cpo(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor, *,
                     bias: torch.Tensor | None = None, beta: float = 0.1, loss_type: str = "sigmoid",
                     label_smoothing: float = 0.0, simpo_gamma: float = 0.5, cpo_alpha: float = 1.0,
                     alpha: float = 0.0, nll_target: torch.Tensor | None = None, ignore_index: int = -100,
                     temperature: float = 1.0) -> PreferenceOutput:
    """CPO from the policy's hidden states (Xu et al. 2024), as TRL's ``CPOTrainer``: ``mean(cpo_loss(c, r)) +
    cpo_alpha·NLL(chosen)`` (``liger_gen.ops.lm_head.post_training.cpo_loss``), with c, r summed completion
    log-probabilities (per-token means for ``ipo`` and ``simpo``), NLL as in ``fused_linear_orpo``
    (``nll_target``; the default covers the chosen completions only, TRL's trainer prompt and completion).
    ``loss_type="simpo"`` with ``cpo_alpha=0`` is SimPO (``fused_linear_simpo``); ``alpha`` ≠ 0 is AlphaPO.
    Returns ``PreferenceOutput`` (rewards β·logps, or β·AlphaPO rewards). As in TRL, a completion with no token
    makes the per-token means (ipo, simpo) 0/0 and the loss NaN, and so does a batch with no NLL token when
    ``cpo_alpha`` ≠ 0; summed log-probabilities of an empty completion are 0."""
    op = "fused_linear_cpo"
    options = check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, True)
    cpo_loss(torch.zeros(1) - 1, torch.zeros(1) - 1, beta, loss_type, label_smoothing, simpo_gamma, alpha)
    cpo_alpha = check_finite(op, "cpo_alpha", cpo_alpha)
    pairs = x.shape[0] // 2
    average = loss_type in ("ipo", "simpo")
    loop_target, nll_mask = _nll_target(op, target, nll_target if cpo_alpha else None, ignore_index,
                                         lm_head_weight.shape[0])
    completion = valid_mask(target, ignore_index)
    n_nll = nll_mask.sum()  # no NLL token: NaN, as PyTorch's mean cross-entropy

    def chunk_loss(logp, ranges):
        means_c, means_r, nll_sum = _pair_means(logp, ranges, completion, nll_mask)
        if average:
            c, r = means_c, means_r
        else:
            (c0, c1), (r0, r1) = ranges
            m = torch.cat([completion[c0:c1], completion[r0:r1]])
            sums = (logp * m).sum(-1)
            c, r = sums[:c1 - c0], sums[c1 - c0:]
        value = cpo_loss(c, r, beta, loss_type, label_smoothing, simpo_gamma, alpha).sum() / max(pairs, 1)
        return value + cpo_alpha * nll_sum / n_nll if cpo_alpha else value

    loss, logp, _ = sequence_loss(x, lm_head_weight, bias, loop_target, options, True, chunk_loss)
    seq = (logp * completion).sum(-1)
    if average:
        seq = seq / completion.sum(-1)
    rewards = seq if alpha == 0.0 else (1 - torch.exp(seq).pow(-alpha)) / alpha
    return PreferenceOutput(loss, seq[:pairs], seq[pairs:], beta * rewards[:pairs], beta * rewards[pairs:])


def fused_linear_simpo(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor, *,
                       bias: torch.Tensor | None = None, beta: float = 2.0, simpo_gamma: float = 0.5,
                       label_smoothing: float = 0.0, cpo_alpha: float = 0.0, nll_target: torch.Tensor | None = None,
                       ignore_index: int = -100, temperature: float = 1.0) -> PreferenceOutput:
    """SimPO from the policy's hidden states (Meng et al. 2024, "SimPO: Simple Preference Optimization with a
    Reference-Free Reward", Eq. 6): ``fused_linear_cpo`` with ``loss_type="simpo"`` — per-token mean
    log-probabilities, margin γ = ``simpo_gamma``. The defaults are the paper's, not TRL's: β 2.0 (the paper's
    range is 2–10; TRL's ``CPOConfig`` has 0.1) and no NLL term (TRL's ``CPOTrainer`` adds ``cpo_alpha``·NLL,
    1.0 unless set to 0). Arguments, result and errors: ``fused_linear_cpo``'s."""
    return fused_linear_cpo(x, lm_head_weight, target, bias=bias, beta=beta, loss_type="simpo",
                            label_smoothing=label_smoothing, simpo_gamma=simpo_gamma, cpo_alpha=cpo_alpha,
                            nll_target=nll_target, ignore_index=ignore_index, temperature=temperature)


def fused_linear_kto(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor, desirable: torch.Tensor,
                     ref_x: torch.Tensor | None = None, ref_lm_head_weight: torch.Tensor | None = None,
                     ref_log_probs: torch.Tensor | None = None, *, kl: torch.Tensor | float = 0.0,
                     bias: torch.Tensor | None = None, ref_bias: torch.Tensor | None = None, beta: float = 0.1,
                     desirable_weight: float = 1.0, undesirable_weight: float = 1.0, loss_type: str = "kto",
                     ignore_index: int = -100, temperature: float = 1.0) -> KTOOutput:
    """KTO from the policy's hidden states (Ethayarajh et al. 2024), as TRL's ``KTOTrainer``: the mean over all
    sequences of ``kto_loss`` on summed completion log-probabilities.

    x (sequences, tokens, hidden), target (sequences, tokens), ``desirable`` (sequences,) bool (TRL's
    ``label``); the reference as in ``fused_linear_dpo``; ``kl`` the detached batch KL estimate z₀ (a 0-d tensor
    or a float; a NaN tensor gives a NaN loss), as TRL computes it from its mismatched KL batch (each completion
    paired with another sequence's prompt)::

        with torch.no_grad():
            policy_kl = lg.selective_log_softmax(kl_x, policy_head, kl_target).sum(-1)
            ref_kl = lg.selective_log_softmax(ref_kl_x, ref_head, kl_target).sum(-1)
        kl = (policy_kl - ref_kl).mean().clamp(min=0)

    (and averaged over processes in distributed training). ``loss_type``: "kto" or "apo_zero_unpaired" (TRL's
    ``KTOConfig.loss_type``; the latter has no KL term, ``kl`` is not used), see ``kto_loss``. Returns
    ``KTOOutput``. (TRL's KTO sums the completion log-probabilities; it has no length-averaged variant.)"""
    op = "fused_linear_kto"
    options = check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, False)
    check_ref_head(op, ref_lm_head_weight, lm_head_weight)
    n = x.shape[0]
    if not isinstance(desirable, torch.Tensor) or desirable.shape != (n,) or desirable.dtype != torch.bool:
        got = describe("desirable", desirable) if isinstance(desirable, torch.Tensor) else type(desirable).__name__
        raise ValueError(f"{op}: desirable must be ({n},) bool, one label per sequence; got {got}")
    if isinstance(kl, torch.Tensor):
        if kl.numel() != 1 or not kl.is_floating_point():
            raise ValueError(f"{op}: kl must be a float or a one-element floating tensor; got {describe('kl', kl)}")
        kl = kl.detach().float().reshape(())
    else:
        kl = check_finite(op, "kl", kl)
    kto_loss(torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool), 0.0, beta, desirable_weight,
             undesirable_weight, loss_type)
    ref = ref_logps(op, ref_x, ref_lm_head_weight, ref_bias, target, options, ref_log_probs, n)
    labels = desirable.to(x.device)

    def chunk_loss(logp, ranges):
        (lo, hi), = ranges
        losses = kto_loss(logp.sum(-1), ref[lo:hi], labels[lo:hi], kl, beta, desirable_weight, undesirable_weight,
                          loss_type)
        return losses.sum() / max(n, 1)

    loss, logp, _ = sequence_loss(x, lm_head_weight, bias, target, options, False, chunk_loss)
    sums = logp.sum(-1)
    return KTOOutput(loss, sums, beta * (sums - ref))

