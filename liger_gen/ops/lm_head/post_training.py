"""Preference and RL losses from hidden states and the LM head: DPO, ORPO, CPO, SimPO, KTO and GRPO, with TRL's
semantics, on the chunked per-token log-probabilities of ``selective_log_softmax`` (its tuned kernels and chunk
plan), never materialising the full logits.

Two layers:

* **Formulas** (``dpo_loss``, ``orpo_loss``, ``cpo_loss``, ``kto_loss``, ``grpo_loss``): plain PyTorch on
  sequence or per-token log-probabilities, differentiable, equal to the formulas of TRL's trainers (each
  docstring names the paper and the TRL code it follows).
* **Fused losses** (``fused_linear_dpo``, ``fused_linear_orpo``, ``fused_linear_cpo``, ``fused_linear_simpo``,
  ``fused_linear_kto``, ``fused_linear_grpo``): the same losses from the policy's last hidden states ``x`` of
  shape (sequences, tokens, hidden) and the LM head.

How the fused losses run. Eagerly with gradients wanted, each chunk of whole sequences (both sequences of a
chosen/rejected pair together) goes through: one GEMM for its logits, one statistics launch for its per-token
log-probabilities, the loss formula on those (a few small PyTorch ops, differentiated by autograd), one launch
that turns the logits into their gradient in place, and the dx and dW GEMMs — three GEMMs per token, with the
gradients computed in the forward and scaled by the upstream gradient in the backward. The logits of a chunk
take at most ``SEQUENCE_CHUNK_BYTES`` (1 GiB). Where one group does not fit (long sequences), under
torch.compile or tracing, without gradients, or in float16 or float64, the loss is the formula on
``selective_log_softmax``'s log-probabilities (four GEMMs per token with gradients: the backward recomputes
the logits; extra memory within its 256 MiB plan). Both ways give the same loss and gradients up to rounding.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from liger_gen.ops.lm_head.cross_entropy_rows import scale_in_place
from liger_gen.ops.lm_head.selective_log_softmax import Chunks, LogProbOptions, check_inputs, selective_log_softmax
from liger_gen.runtime import plans
from liger_gen.runtime.ops import check_float_arg, check_targets, describe, host_checkable, no_double_backward

#: logits bytes one chunk of whole sequences may hold on the fused path (the rest of the batch is not held)
SEQUENCE_CHUNK_BYTES = 1 << 30

# float16 takes the formula: its logit gradients, formed in the forward before any loss scaling, would fall
# into float16's subnormal range at large vocabularies (the formula applies the upstream gradient first, as
# PyTorch's own backward does)
_FUSED_DTYPES = (torch.float32, torch.bfloat16)
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


class PreferenceOutput(NamedTuple):
    """A paired loss and what trainers log: the policy's sequence log-probabilities (sums, or per-token means
    where the loss uses means) and the implicit rewards, each (pairs,) float32, detached."""

    loss: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


class KTOOutput(NamedTuple):
    """KTO's loss, the policy's summed sequence log-probabilities and the rewards β·(logp − ref), (sequences,)."""

    loss: torch.Tensor
    logps: torch.Tensor
    rewards: torch.Tensor


class GRPOOutput(NamedTuple):
    """GRPO's loss and the policy's per-token log-probabilities (sequences, tokens), detached."""

    loss: torch.Tensor
    per_token_logps: torch.Tensor


# ------------------------------------------------------------------------------------------------ formulas


def _check_choice(op: str, name: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {list(choices)}, got {value!r}")
    return value


def _finite(op: str, name: str, value, low: float = -math.inf, high: float = math.inf, *,
            low_open: bool = False) -> float:
    value = check_float_arg(op, name, value)
    ok = (low < value if low_open else low <= value) and value <= high and -math.inf < value < math.inf
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}" if low > -math.inf else "finite"
        raise ValueError(f"{op}: {name} must be {bound}{f' and <= {high}' if high < math.inf else ''}, got {value}")
    return value


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair DPO loss (Rafailov et al. 2023, "Direct Preference Optimization"), as TRL's ``DPOTrainer``.

    With Δ = (π_c − ref_c) − (π_r − ref_r) of summed sequence log-probabilities (pairs,):

    * ``sigmoid``: −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ) (ε = ``label_smoothing``, conservative DPO; TRL's
      ``sigmoid`` is ε = 0);
    * ``hinge``: relu(1 − βΔ) (SLiC, Zhao et al. 2023);
    * ``ipo``: (Δ̄ − 1/(2β))², Δ̄ the difference of the log-ratios each divided by its completion's token count
      (``chosen_lengths``, ``rejected_lengths``, clamped to ≥ 1), as TRL normalises IPO (Azar et al. 2023);
    * ``robust``: (−(1 − ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε), 0 ≤ ε < 1/2 (rDPO, Chowdhury et al. 2024).

    Returns the (pairs,) losses in the promoted floating dtype; the loss is their mean. ValueError for an unknown
    ``loss_type``, β ≤ 0, ε outside [0, 1] (robust: [0, 1/2)), or IPO without the lengths.
    """
    op = "dpo_loss"
    _check_choice(op, "loss_type", loss_type, DPO_LOSS_TYPES)
    beta = _finite(op, "beta", beta, 0.0, low_open=True)
    eps = _finite(op, "label_smoothing", label_smoothing, 0.0, 1.0)
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"{op}: loss_type='ipo' needs chosen_lengths and rejected_lengths (completion tokens)")
        delta = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
        return (delta - 1.0 / (2.0 * beta)) ** 2
    delta = chosen_ratio - rejected_ratio
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * delta)
    if loss_type == "robust":
        if not eps < 0.5:
            raise ValueError(f"{op}: loss_type='robust' needs 0 <= label_smoothing < 0.5, got {eps}")
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
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
    beta = _finite("orpo_loss", "beta", beta, 0.0, low_open=True)
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
    _check_choice(op, "loss_type", loss_type, CPO_LOSS_TYPES)
    beta = _finite(op, "beta", beta, 0.0, low_open=True)
    eps = _finite(op, "label_smoothing", label_smoothing, 0.0, 1.0)
    gamma = _finite(op, "simpo_gamma", simpo_gamma)
    alpha = _finite(op, "alpha", alpha)
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
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-sequence KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
    Eq. 7), as TRL's ``KTOTrainer`` (``loss_type="kto"``): with the log-ratio ρ = logp − ref of summed
    sequence log-probabilities and the batch KL estimate z₀ = ``kl`` (detached, clamped at 0 by the caller as
    TRL does), desirable sequences lose ``w_d·(1 − σ(β(ρ − z₀)))`` and undesirable ones
    ``w_u·(1 − σ(β(z₀ − ρ)))``. TRL's loss is the mean over all sequences. ``desirable``: (sequences,) bool."""
    op = "kto_loss"
    beta = _finite(op, "beta", beta, 0.0, low_open=True)
    w_d = _finite(op, "desirable_weight", desirable_weight, 0.0)
    w_u = _finite(op, "undesirable_weight", undesirable_weight, 0.0)
    ratio = logps - ref_logps
    good = w_d * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = w_u * (1 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable, good, bad)


def grpo_per_token_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
                        ref_per_token_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
                        beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                        loss_type: str = "dapo", importance_sampling_level: str = "token",
                        delta: float | None = None) -> torch.Tensor:
    """GRPO's per-token loss (Shao et al. 2024, "DeepSeekMath", Eq. 3; the clipping of PPO, Schulman et al. 2017),
    as TRL's ``GRPOTrainer``: with the importance ratio r = exp(logp − old) per token (``importance_sampling_level
    ="token"``) or exp of the masked mean of logp − old per sequence (``"sequence"``, GSPO, Zheng et al. 2025),
    and A the advantages ((sequences,) or (sequences, tokens)):

    * grpo, bnpo, dr_grpo, dapo: −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), r first capped at ``delta`` if
      given (two-sided clipping);
    * cispo: −min(r, ε_high)·A·logp with the capped ratio detached (MiniMax-M1, 2025);

    plus β·(exp(ref − logp) − (ref − logp) − 1) (the k3 KL estimate) when β ≠ 0. ``old`` None: the policy's
    own detached log-probabilities (one optimisation step per generation). (sequences, tokens). ValueError for an
    unknown ``loss_type`` or ``importance_sampling_level``, ε outside [0, 1) (low) or < 0 (high), δ ≤ 0, a
    non-finite β, or β ≠ 0 without the reference's log-probabilities."""
    _check_grpo_options("grpo_per_token_loss", beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level,
                        delta, ref_per_token_logps)
    logp = per_token_logps
    old = logp.detach() if old_per_token_logps is None else old_per_token_logps
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        m = mask.to(log_ratio.dtype)
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logp
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)
        loss = -torch.min(ratio * adv, clipped * adv)
    if beta != 0.0:
        d = ref_per_token_logps - logp
        loss = loss + beta * (torch.exp(d) - d - 1)
    return loss


def _check_grpo_options(op, beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level, delta, ref):
    """Validate GRPO's options (ValueError naming the option); (beta, epsilon_low, epsilon_high, delta)."""
    _check_choice(op, "loss_type", loss_type, GRPO_LOSS_TYPES)
    _check_choice(op, "importance_sampling_level", importance_sampling_level, ("token", "sequence"))
    beta = _finite(op, "beta", beta)
    epsilon_low = _finite(op, "epsilon_low", epsilon_low, 0.0)
    if not epsilon_low < 1.0:
        raise ValueError(f"{op}: epsilon_low must be in [0, 1) (the ratio is clipped at 1 − epsilon_low), got "
                         f"{epsilon_low}")
    epsilon_high = _finite(op, "epsilon_high", epsilon_high, 0.0)
    if delta is not None:
        delta = _finite(op, "delta", delta, 0.0, low_open=True)
    if beta != 0.0 and ref is None:
        raise ValueError(f"{op}: beta={beta} needs ref_per_token_logps (the reference's per-token log-probabilities)")
    return beta, epsilon_low, epsilon_high, delta


def _check_normalisation(op, loss_type, max_completion_length, num_items_in_batch) -> None:
    _check_choice(op, "loss_type", loss_type, GRPO_LOSS_TYPES)
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
    """TRL's reductions of a GRPO per-token loss (one process, no gradient accumulation): ``grpo`` the mean over
    sequences of each one's masked token mean; ``bnpo`` the masked token mean of the batch; ``dr_grpo`` the
    masked sum / (sequences · ``max_completion_length``, default the token dimension; Liu et al. 2025);
    ``dapo``/``cispo`` the masked sum / ``num_items_in_batch`` (default the mask's sum, clamped at 1; Yu et al.
    2025)."""
    _check_normalisation("grpo_normalise", loss_type, max_completion_length, num_items_in_batch)
    m = mask.to(per_token_loss.dtype)
    masked = per_token_loss * m
    if loss_type == "grpo":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = mask.shape[-1] if max_completion_length is None else max_completion_length
        return masked.sum() / (mask.shape[0] * length)
    items = m.sum() if num_items_in_batch is None else num_items_in_batch
    return masked.sum() / torch.as_tensor(items, dtype=masked.dtype, device=masked.device).clamp(min=1.0)


def grpo_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask, beta: float = 0.0,
              epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
              importance_sampling_level: str = "token", delta: float | None = None,
              max_completion_length: int | None = None, num_items_in_batch=None) -> torch.Tensor:
    """GRPO's loss: ``grpo_per_token_loss`` reduced by ``grpo_normalise`` (see both)."""
    per_token = grpo_per_token_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask,
                                    beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level, delta)
    return grpo_normalise(per_token, mask, loss_type, max_completion_length, num_items_in_batch)


# ------------------------------------------------------------------------------------------------ chunk engine


class _Layout(NamedTuple):
    """The chunks of a batch of ``sequences`` × ``tokens`` rows: each chunk a tuple of sequence ranges
    [lo, hi); a paired batch (chosen first half, rejected second) puts pair i's two sequences in one chunk."""

    sequences: int
    tokens: int
    chunks: tuple[tuple[tuple[int, int], ...], ...]

    @staticmethod
    def make(sequences: int, tokens: int, paired: bool, per_chunk: int) -> "_Layout":
        groups = sequences // 2 if paired else sequences
        chunks = []
        for lo in range(0, groups, per_chunk):
            hi = min(lo + per_chunk, groups)
            chunks.append(((lo, hi), (groups + lo, groups + hi)) if paired else ((lo, hi),))
        return _Layout(sequences, tokens, tuple(chunks))

    def order(self) -> torch.Tensor:
        """Sequence indices in chunk order."""
        return torch.tensor([s for chunk in self.chunks for lo, hi in chunk for s in range(lo, hi)])


#: chunk_loss(logp (n, tokens) for the chunk's sequences in range order, ranges) -> 0-d loss contribution
ChunkLoss = Callable[[torch.Tensor, tuple[tuple[int, int], ...]], torch.Tensor]


class _FusedSequenceLoss(torch.autograd.Function):
    """Loss and the gradients of x, W and bias in one pass over chunks of whole sequences (see the module)."""

    @staticmethod
    def forward(ctx, x2d, w, bias, run: Chunks, layout: _Layout, chunk_loss: ChunkLoss):
        need = ctx.needs_input_grad
        dx, dw, db = run.grad_outputs(need[0], need[1], bias is not None and need[2])
        t = layout.tokens
        lse = torch.empty(layout.sequences * t, dtype=torch.float32, device=x2d.device)
        logp_out = torch.empty((layout.sequences, t), dtype=torch.float32, device=x2d.device)
        logp = logp_out.view(-1)
        most = max(sum(hi - lo for lo, hi in chunk) for chunk in layout.chunks) * t
        buf, gbuf = run.buffers(most)
        total = torch.zeros((), dtype=torch.float32, device=x2d.device)
        first = True
        for chunk in layout.chunks:
            parts, off = [], 0
            for lo, hi in chunk:
                rows = slice(lo * t, hi * t)
                z = run.logits(x2d[rows], buf[off:off + (hi - lo) * t])
                run.stats(z, run.target[rows], logp[rows], lse[rows])
                parts.append((rows, z, off))
                off += (hi - lo) * t
            leaf = torch.cat([logp[rows] for rows, _, _ in parts]).view(-1, t).requires_grad_()
            with torch.enable_grad():
                value = chunk_loss(leaf, chunk)
                g = torch.autograd.grad(value, leaf, allow_unused=True)[0] if value.requires_grad else None
            total += value.detach().float()
            if g is None:
                g = torch.zeros_like(leaf)
            g = g.reshape(-1).float().contiguous()
            for rows, z, off in parts:
                n = z.shape[0]
                grad = z if gbuf is None else gbuf[off:off + n]
                run.logits_grad(z, grad, run.target[rows], lse[rows], lse[rows], g[off:off + n], None)
                run.add_grads(grad, x2d[rows], first, None if dx is None else dx[rows], dw, db)
                first = False
        ctx.grads = (dx, dw, db)
        ctx.dtypes = (w.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(logp_out)
        return total, logp_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp):
        no_double_backward("fused post-training loss", "the formulas of liger_gen.ops.lm_head.post_training on "
                           "liger_gen.reference.selective_log_softmax_torch's log-probabilities")
        if ctx.grads is None:
            raise RuntimeError("liger_gen fused post-training loss: backward through the graph a second time is not "
                               "supported (the gradients were computed in the forward and are scaled in place)")
        dx, dw, db = ctx.grads
        ctx.grads = None
        g = grad_loss.float()
        w_dtype, b_dtype = ctx.dtypes
        return (None if dx is None else scale_in_place(dx, g),
                None if dw is None else scale_in_place(dw, g).to(w_dtype),
                None if db is None else scale_in_place(db, g).to(b_dtype), None, None, None)


def _sequences_per_chunk(run: Chunks, tokens: int, group: int) -> int:
    """Groups (pairs or single sequences) per chunk within SEQUENCE_CHUNK_BYTES; 0 if one group does not fit."""
    per_row = run.vocab * (torch.empty((), dtype=run.logits_dtype).element_size()
                           + (run.x.element_size() if run.logits_dtype != run.x.dtype else 0))
    return SEQUENCE_CHUNK_BYTES // max(1, per_row * tokens * group)


def _sequence_loss(x, w, bias, target, options: LogProbOptions, paired: bool, chunk_loss: ChunkLoss):
    """(loss, per-token log-probabilities (sequences, tokens) detached) of ``chunk_loss`` summed over chunks of x
    (sequences, tokens, hidden): the fused chunk loop where it applies, else the formula on the log-probabilities
    of all sequences at once (one chunk holding every range)."""
    n, t, h = x.shape
    x2d = x.reshape(-1, h)
    if x2d.stride(0) != 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    flat_target = target.reshape(-1).contiguous()
    wants_grad = torch.is_grad_enabled() and any(
        p is not None and p.requires_grad for p in (x, w, bias))
    if wants_grad and n and t and x.dtype in _FUSED_DTYPES and plans.eager(*(t for t in (x2d, w, bias, flat_target) if t is not None)):
        run = Chunks(x2d, w, bias, flat_target, options)
        per_chunk = _sequences_per_chunk(run, t, 2 if paired else 1)
        if per_chunk:
            return _FusedSequenceLoss.apply(x2d, w, bias, run, _Layout.make(n, t, paired, per_chunk), chunk_loss)
    logp = selective_log_softmax(x, w, target, bias, options.temperature, options.ignore_index, options.softcap,
                                 options.logit_scale)
    everything = ((0, n // 2), (n // 2, n)) if paired else ((0, n),)
    value = chunk_loss(logp, everything)
    return value.to(torch.promote_types(value.dtype, torch.float32)), logp.detach()


def _ref_logps(op, ref_x, ref_w, ref_bias, target, options: LogProbOptions, ref_log_probs, sequences: int,
               hidden: int | None = None):
    """The reference's summed sequence log-probabilities (sequences,) float32: given, or from the reference's
    hidden states and LM head (no gradient)."""
    if (ref_x is None) == (ref_log_probs is None):
        raise ValueError(f"{op}: give exactly one of ref_x (with ref_lm_head_weight) and ref_log_probs")
    if ref_log_probs is not None:
        if ref_w is not None or ref_bias is not None:
            raise ValueError(f"{op}: ref_lm_head_weight and ref_bias go with ref_x; with ref_log_probs (the "
                             f"reference's log-probabilities given) leave them None")
        if not isinstance(ref_log_probs, torch.Tensor) or ref_log_probs.shape != (sequences,):
            got = describe("ref_log_probs", ref_log_probs) if isinstance(ref_log_probs, torch.Tensor) else \
                type(ref_log_probs).__name__
            raise ValueError(f"{op}: ref_log_probs must be ({sequences},), one summed log-probability per "
                             f"sequence; got {got}")
        if not ref_log_probs.is_floating_point():
            raise TypeError(f"{op}: ref_log_probs must be floating; got {describe('ref_log_probs', ref_log_probs)}")
        if ref_log_probs.device != target.device:
            raise ValueError(f"{op}: ref_log_probs must be on x's device {target.device}; got "
                             f"{describe('ref_log_probs', ref_log_probs)}")
        return ref_log_probs.detach().float()
    if ref_w is None:
        raise ValueError(f"{op}: ref_x needs ref_lm_head_weight")
    if not isinstance(ref_x, torch.Tensor) or ref_x.dim() != 3 or ref_x.shape[:2] != target.shape:
        got = describe("ref_x", ref_x) if isinstance(ref_x, torch.Tensor) else type(ref_x).__name__
        raise ValueError(f"{op}: ref_x must be (sequences, tokens, ref_hidden) with target's leading shape "
                         f"{tuple(target.shape)}; got {got}")
    if not isinstance(ref_w, torch.Tensor) or ref_w.dim() != 2 or ref_w.shape[1] != ref_x.shape[-1]:
        got = describe("ref_lm_head_weight", ref_w) if isinstance(ref_w, torch.Tensor) else type(ref_w).__name__
        raise ValueError(f"{op}: ref_lm_head_weight must be (vocab, {ref_x.shape[-1]}) for ref_x's hidden size; got "
                         f"{got} and {describe('ref_x', ref_x)}")
    if ref_w.dtype != ref_x.dtype:
        raise TypeError(f"{op}: ref_lm_head_weight must have ref_x's dtype; got "
                        f"{describe('ref_lm_head_weight', ref_w)} and {describe('ref_x', ref_x)}")
    with torch.no_grad():
        lp = selective_log_softmax(ref_x, ref_w, target, ref_bias, options.temperature, options.ignore_index,
                                   options.softcap, options.logit_scale)
    return lp.float().sum(-1)


def _check_policy(op: str, x, lm_head_weight, target, bias, ignore_index, temperature, paired: bool):
    """Validate the policy inputs: x (sequences, tokens, hidden), target (sequences, tokens), an even number of
    sequences when paired (chosen first, rejected second); the options."""
    options = check_inputs(op, x, lm_head_weight, target, bias, ignore_index, temperature, None, 1.0)
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be (sequences, tokens, hidden); got {describe('x', x)}")
    if paired and x.shape[0] % 2:
        raise ValueError(f"{op}: x must hold the chosen sequences then as many rejected ones (an even number of "
                         f"sequences); got {describe('x', x)}: the chosen and rejected batch sizes differ")
    check_targets(op, target.reshape(-1), lm_head_weight.shape[0], options.ignore_index)
    return options


def _check_ref_head(op: str, ref_w, lm_head_weight) -> None:
    if ref_w is not None and isinstance(ref_w, torch.Tensor) and ref_w.dim() == 2 and \
            ref_w.shape[0] != lm_head_weight.shape[0]:
        raise ValueError(f"{op}: the reference's vocabulary must be the policy's ({lm_head_weight.shape[0]}); got "
                         f"{describe('ref_lm_head_weight', ref_w)}")


def _valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (target != ignore_index).float()


# ------------------------------------------------------------------------------------------------ fused losses


def fused_linear_dpo(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                     ref_x: torch.Tensor | None = None, ref_lm_head_weight: torch.Tensor | None = None,
                     ref_log_probs: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                     ref_bias: torch.Tensor | None = None, beta: float = 0.1, loss_type: str = "sigmoid",
                     label_smoothing: float = 0.0, ignore_index: int = -100,
                     temperature: float = 1.0) -> PreferenceOutput:
    """DPO from the policy's hidden states (Rafailov et al. 2023), as TRL's ``DPOTrainer``: the mean over pairs
    of ``liger_gen.ops.lm_head.post_training.dpo_loss`` on summed completion log-probabilities.

    Args:
        x: (2·pairs, tokens, hidden) float32/bfloat16/float16 last hidden states, the chosen sequences first and
            the rejected ones after, shifted so that position t predicts ``target[:, t]``.
        lm_head_weight: (vocab, hidden), x's dtype. target: (2·pairs, tokens) int64/int32, ``ignore_index`` on
            prompt and padding positions.
        ref_x, ref_lm_head_weight (and ``ref_bias``): the reference model's hidden states (2·pairs, tokens,
            ref_hidden) and LM head (vocab, ref_hidden), no gradient; or ``ref_log_probs`` (2·pairs,) its summed
            log-probabilities precomputed (TRL's ``precompute_ref_log_probs``). Exactly one of the two.
        beta, loss_type (sigmoid, hinge, ipo, robust), label_smoothing: see
            ``liger_gen.ops.lm_head.post_training.dpo_loss``.

    Returns ``PreferenceOutput`` (loss 0-d float32, differentiable in x, lm_head_weight and bias; rewards
    β·(π − ref)). Raises ValueError / TypeError naming the tensor for bad shapes, dtypes or options (an odd
    number of sequences: the chosen and rejected batch sizes differ; a reference head of another vocabulary).
    A pair whose completions are all ``ignore_index`` has Δ = 0 (IPO: lengths clamped to 1)."""
    op = "fused_linear_dpo"
    options = _check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, True)
    _check_ref_head(op, ref_lm_head_weight, lm_head_weight)
    dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta, loss_type, label_smoothing,
             torch.ones(1), torch.ones(1))  # validates the options before any work
    n = x.shape[0]
    pairs = n // 2
    ref = _ref_logps(op, ref_x, ref_lm_head_weight, ref_bias, target, options, ref_log_probs, n)
    lengths = _valid(target, ignore_index).sum(-1)

    def chunk_loss(logp, ranges):
        (c0, c1), (r0, r1) = ranges
        sums = logp.sum(-1)
        k = c1 - c0
        losses = dpo_loss(sums[:k], sums[k:], ref[c0:c1], ref[r0:r1], beta, loss_type, label_smoothing,
                          lengths[c0:c1], lengths[r0:r1])
        return losses.sum() / max(pairs, 1)

    loss, logp = _sequence_loss(x, lm_head_weight, bias, target, options, True, chunk_loss)
    sums = logp.sum(-1)
    return PreferenceOutput(loss, sums[:pairs], sums[pairs:], beta * (sums[:pairs] - ref[:pairs]),
                            beta * (sums[pairs:] - ref[pairs:]))


def _nll_target(op, target, nll_target, ignore_index, vocab: int):
    """The targets of the chunk loop: the completion targets, with ``nll_target`` (pairs, tokens) filling the
    chosen sequences' ignored positions (the prompt) when the NLL term covers them; and the NLL mask (pairs,
    tokens)."""
    pairs = target.shape[0] // 2
    if nll_target is None:
        return target, _valid(target[:pairs], ignore_index)
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
    return torch.cat([chosen, target[pairs:]]), _valid(nll_target, ignore_index)


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
                      ignore_index: int = -100, temperature: float = 1.0) -> PreferenceOutput:
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
    mean 0/0 and makes the loss NaN, and so does a batch with no NLL token."""
    op = "fused_linear_orpo"
    options = _check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, True)
    orpo_loss(torch.zeros(1) - 1, torch.zeros(1) - 1, beta)
    pairs = x.shape[0] // 2
    loop_target, nll_mask = _nll_target(op, target, nll_target, ignore_index, lm_head_weight.shape[0])
    completion = _valid(target, ignore_index)
    n_nll = nll_mask.sum()  # no NLL token: NaN, as PyTorch's mean cross-entropy

    def chunk_loss(logp, ranges):
        c, r, nll_sum = _pair_means(logp, ranges, completion, nll_mask)
        return nll_sum / n_nll - orpo_loss(c, r, beta).sum() / max(pairs, 1)

    loss, logp = _sequence_loss(x, lm_head_weight, bias, loop_target, options, True, chunk_loss)
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
    options = _check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, True)
    cpo_loss(torch.zeros(1) - 1, torch.zeros(1) - 1, beta, loss_type, label_smoothing, simpo_gamma, alpha)
    cpo_alpha = _finite(op, "cpo_alpha", cpo_alpha)
    pairs = x.shape[0] // 2
    average = loss_type in ("ipo", "simpo")
    loop_target, nll_mask = _nll_target(op, target, nll_target if cpo_alpha else None, ignore_index,
                                         lm_head_weight.shape[0])
    completion = _valid(target, ignore_index)
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

    loss, logp = _sequence_loss(x, lm_head_weight, bias, loop_target, options, True, chunk_loss)
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
                     desirable_weight: float = 1.0, undesirable_weight: float = 1.0, ignore_index: int = -100,
                     temperature: float = 1.0) -> KTOOutput:
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

    (and averaged over processes in distributed training). Returns ``KTOOutput``."""
    op = "fused_linear_kto"
    options = _check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, False)
    _check_ref_head(op, ref_lm_head_weight, lm_head_weight)
    n = x.shape[0]
    if not isinstance(desirable, torch.Tensor) or desirable.shape != (n,) or desirable.dtype != torch.bool:
        got = describe("desirable", desirable) if isinstance(desirable, torch.Tensor) else type(desirable).__name__
        raise ValueError(f"{op}: desirable must be ({n},) bool, one label per sequence; got {got}")
    if isinstance(kl, torch.Tensor):
        if kl.numel() != 1 or not kl.is_floating_point():
            raise ValueError(f"{op}: kl must be a float or a one-element floating tensor; got {describe('kl', kl)}")
        kl = kl.detach().float().reshape(())
    else:
        kl = _finite(op, "kl", kl)
    kto_loss(torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool), 0.0, beta, desirable_weight,
             undesirable_weight)
    ref = _ref_logps(op, ref_x, ref_lm_head_weight, ref_bias, target, options, ref_log_probs, n)
    labels = desirable.to(x.device)

    def chunk_loss(logp, ranges):
        (lo, hi), = ranges
        losses = kto_loss(logp.sum(-1), ref[lo:hi], labels[lo:hi], kl, beta, desirable_weight, undesirable_weight)
        return losses.sum() / max(n, 1)

    loss, logp = _sequence_loss(x, lm_head_weight, bias, target, options, False, chunk_loss)
    sums = logp.sum(-1)
    return KTOOutput(loss, sums, beta * (sums - ref))


def fused_linear_grpo(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                      advantages: torch.Tensor, completion_mask: torch.Tensor | None = None,
                      old_per_token_logps: torch.Tensor | None = None,
                      ref_per_token_logps: torch.Tensor | None = None, *, bias: torch.Tensor | None = None,
                      beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
                      loss_type: str = "dapo", importance_sampling_level: str = "token",
                      delta: float | None = None, max_completion_length: int | None = None,
                      num_items_in_batch=None, temperature: float = 1.0, ignore_index: int = -100) -> GRPOOutput:
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
        beta, epsilon_low, epsilon_high (default epsilon_low), loss_type (grpo, bnpo, dr_grpo, dapo, cispo),
            importance_sampling_level (token, sequence), delta, max_completion_length, num_items_in_batch: TRL's
            options of the same names (see ``grpo_per_token_loss`` and ``grpo_normalise`` in
            ``liger_gen.ops.lm_head.post_training``).

    Returns ``GRPOOutput`` (loss 0-d float32; per-token log-probabilities, 0 where target is ignore_index)."""
    op = "fused_linear_grpo"
    options = _check_policy(op, x, lm_head_weight, target, bias, ignore_index, temperature, False)
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    beta, epsilon_low, epsilon_high, delta = _check_grpo_options(op, beta, epsilon_low, epsilon_high, loss_type,
                                                                 importance_sampling_level, delta,
                                                                 ref_per_token_logps)
    _check_normalisation(op, loss_type, max_completion_length, num_items_in_batch)
    n, t = target.shape
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"{op}: advantages must be a tensor of shape ({n},) or ({n}, {t}), got "
                         f"{type(advantages).__name__}")
    for name, value, shapes in (("advantages", advantages, ((n,), (n, t))),
                                ("completion_mask", completion_mask, ((n, t),)),
                                ("old_per_token_logps", old_per_token_logps, ((n, t),)),
                                ("ref_per_token_logps", ref_per_token_logps, ((n, t),))):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) not in shapes:
            got = describe(name, value) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{op}: {name} must be {' or '.join(str(s) for s in shapes)}; got {got}")
        if value.device != x.device:
            raise ValueError(f"{op}: {name} must be on x's device {x.device}; got {describe(name, value)}")
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.device != x.device:
        num_items_in_batch = num_items_in_batch.to(x.device)
    # the sampling policy's and the reference's log-probabilities and the advantages are data: no gradient (as TRL
    # computes them under no_grad), on either path
    mask = (_valid(target, ignore_index) if completion_mask is None else completion_mask.detach().float())
    adv = advantages.detach().float()
    old = None if old_per_token_logps is None else old_per_token_logps.detach().float()
    ref = None if ref_per_token_logps is None else ref_per_token_logps.detach().float()
    if loss_type == "grpo":
        scale = 1.0 / (mask.sum(-1).clamp(min=1.0) * max(n, 1))  # per sequence
    elif loss_type == "bnpo":
        scale = 1.0 / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        scale = 1.0 / (max(n, 1) * (t if max_completion_length is None else max_completion_length))
    else:
        items = mask.sum() if num_items_in_batch is None else num_items_in_batch
        scale = 1.0 / torch.as_tensor(items, dtype=torch.float32, device=x.device).detach().clamp(min=1.0)

    def chunk_loss(logp, ranges):
        (lo, hi), = ranges
        sl = slice(lo, hi)
        per_token = grpo_per_token_loss(logp, None if old is None else old[sl], None if ref is None else ref[sl],
                                        adv[sl], mask[sl], beta, epsilon_low, epsilon_high, loss_type,
                                        importance_sampling_level, delta)
        weighted = (per_token * mask[sl]).sum(-1)
        s = scale[sl] if isinstance(scale, torch.Tensor) and scale.dim() else scale
        return (weighted * s).sum()

    loss, logp = _sequence_loss(x, lm_head_weight, bias, target, options, False, chunk_loss)
    return GRPOOutput(loss, logp)
