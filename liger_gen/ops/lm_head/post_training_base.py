"""The machinery the post-training losses share (``post_training_preference``: DPO, ORPO, CPO, SimPO, KTO;
``post_training_rl``: GRPO): their outputs, the checks of their inputs and options, and the chunk loop over whole
sequences that computes a loss and its gradients from hidden states and the LM head on ``selective_log_softmax``'s
per-token log-probabilities (its tuned kernels and chunk plan), never materialising the full logits.

``sequence_loss`` runs a loss given as ``chunk_loss(logp, ranges)``, the loss's share of one chunk of whole
sequences (a chosen/rejected pair in one chunk), or ``chunk_loss(logp, ranges, stats)`` for a loss that also reads
per-token statistics of the same distributions (``STATS``: the entropy, with its gradient; log Σ_v p_v²), which the
statistics launch writes in the same pass over each row. Eagerly with gradients wanted, each chunk goes through one
GEMM for its logits, one statistics launch for its per-token log-probabilities (and statistics), ``chunk_loss`` on
those (differentiated by autograd), one launch that turns the logits into their gradient in place (of the
log-probabilities and, where the loss uses it, of the entropy), and the dx and dW GEMMs — three GEMMs per token, the
gradients computed in the forward and scaled by the upstream gradient in the backward. The logits of a chunk take at
most ``SEQUENCE_CHUNK_BYTES``. Where one group does not fit, a loss needs the whole batch at once (``whole_batch``),
under torch.compile or tracing, without gradients, or in float16 or float64, the loss is ``chunk_loss`` of every
sequence on ``selective_log_softmax``'s log-probabilities (its backward recomputes the logits). Both ways give the
same loss and gradients up to rounding.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

from liger_gen.ops.lm_head.cross_entropy_rows import scale_in_place
from liger_gen.ops.lm_head.selective_log_softmax import (Chunks, LogProbOptions, check_inputs,
                                                         selective_log_softmax, token_log_probs_2d)
from liger_gen.runtime import plans
from liger_gen.runtime.ops import check_float_arg, check_targets, describe, no_double_backward

#: logits bytes one chunk of whole sequences may hold on the fused path (the rest of the batch is not held)
SEQUENCE_CHUNK_BYTES = 1 << 30

# float16 takes the formula: its logit gradients, formed in the forward before any loss scaling, would fall
# into float16's subnormal range at large vocabularies (the formula applies the upstream gradient first, as
# PyTorch's own backward does)
FUSED_DTYPES = (torch.float32, torch.bfloat16)


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
    """GRPO's loss, the policy's per-token log-probabilities (sequences, tokens) and, where the loss used them
    (``top_entropy_quantile`` < 1 or ``entropy_coef`` ≠ 0; else None), the per-token entropies (sequences,
    tokens) float32 (float64 for float64 inputs; 0 where the target is ignored; what TRL logs and its adaptive
    entropy control reads), both detached."""

    loss: torch.Tensor
    per_token_logps: torch.Tensor
    entropy: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------ checks


def check_choice(op: str, name: str, value, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else ValueError naming ``name`` and the choices."""
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {list(choices)}, got {value!r}")
    return value


def check_finite(op: str, name: str, value, low: float = -math.inf, high: float = math.inf, *,
                 low_open: bool = False) -> float:
    """``value`` as a float if finite and within [low, high] (``low_open``: (low, high]), else ValueError."""
    value = check_float_arg(op, name, value)
    ok = (low < value if low_open else low <= value) and value <= high and -math.inf < value < math.inf
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}" if low > -math.inf else "finite"
        raise ValueError(f"{op}: {name} must be {bound}{f' and <= {high}' if high < math.inf else ''}, got {value}")
    return value


def check_flag(op: str, name: str, value) -> bool:
    """``value`` if it is a bool, else TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_tensor(op: str, name: str, value, shapes, device) -> None:
    """ValueError unless ``value`` is a floating tensor of one of ``shapes`` on ``device`` (TypeError if it is
    not floating)."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) not in shapes:
        got = describe(name, value) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{op}: {name} must be {' or '.join(str(s) for s in shapes)}; got {got}")
    if not value.is_floating_point():
        raise TypeError(f"{op}: {name} must be floating; got {describe(name, value)}")
    if value.device != device:
        raise ValueError(f"{op}: {name} must be on x's device {device}; got {describe(name, value)}")


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


#: chunk_loss(logp (n, tokens) for the chunk's sequences in range order, ranges) -> 0-d loss contribution; a loss
#: that asks ``sequence_loss`` for per-token statistics is called ``chunk_loss(logp, ranges, stats)`` instead
ChunkLoss = Callable[..., torch.Tensor]

#: the per-token statistics besides the log-probabilities a chunk loss may ask for (``sequence_loss``'s
#: ``stats``): the entropy of each token's distribution (differentiable: GRPO's entropy bonus, its top-entropy
#: token mask) and log Σ_v p_v² (data, no gradient: DPO's WPO weights); 0 where the target is ignored
STATS = ("entropy", "log_sum_sq_probs")


class _FusedSequenceLoss(torch.autograd.Function):
    """Loss and the gradients of x, W and bias in one pass over chunks of whole sequences (see the module)."""

    @staticmethod
    def forward(ctx, x2d, w, bias, run: Chunks, layout: _Layout, chunk_loss: ChunkLoss, stats: tuple[str, ...]):
        need = ctx.needs_input_grad
        dx, dw, db = run.grad_outputs(need[0], need[1], bias is not None and need[2])
        t = layout.tokens
        f32 = dict(dtype=torch.float32, device=x2d.device)
        lse = torch.empty(layout.sequences * t, **f32)
        logp_out = torch.empty((layout.sequences, t), **f32)
        # the statistics kernel writes them beside the log-probabilities, in the same pass over each row
        stat_out = {name: torch.empty((layout.sequences, t), **f32) for name in stats}
        logp = logp_out.view(-1)
        entropy = stat_out["entropy"].view(-1) if "entropy" in stats else None
        sq = stat_out["log_sum_sq_probs"].view(-1) if "log_sum_sq_probs" in stats else None
        most = max(sum(hi - lo for lo, hi in chunk) for chunk in layout.chunks) * t
        buf, gbuf = run.buffers(most)
        total = torch.zeros((), **f32)
        first = True
        for chunk in layout.chunks:
            parts, off = [], 0
            for lo, hi in chunk:
                rows = slice(lo * t, hi * t)
                z = run.logits(x2d[rows], buf[off:off + (hi - lo) * t])
                run.stats(z, run.target[rows], logp[rows], lse[rows],
                          (None if entropy is None else entropy[rows], None if sq is None else sq[rows], None, None))
                parts.append((rows, z, off))
                off += (hi - lo) * t

            def gather(flat):
                return torch.cat([flat[rows] for rows, _, _ in parts]).view(-1, t)

            leaves = [gather(logp).requires_grad_()]
            extra = {}
            if entropy is not None:
                leaves.append(gather(entropy).requires_grad_())
                extra["entropy"] = leaves[-1]
            if sq is not None:
                extra["log_sum_sq_probs"] = gather(sq)
            with torch.enable_grad():
                value = chunk_loss(leaves[0], chunk, extra) if stats else chunk_loss(leaves[0], chunk)
                grads = torch.autograd.grad(value, leaves, allow_unused=True) if value.requires_grad else \
                    (None,) * len(leaves)
            total += value.detach().float()
            g = torch.zeros_like(leaves[0]) if grads[0] is None else grads[0]
            g = g.reshape(-1).float().contiguous()
            g_ent = grads[1].reshape(-1).float().contiguous() if len(grads) > 1 and grads[1] is not None else None
            for rows, z, off in parts:
                n = z.shape[0]
                grad = z if gbuf is None else gbuf[off:off + n]
                run.logits_grad(z, grad, run.target[rows], lse[rows], lse[rows] if entropy is None else entropy[rows],
                                g[off:off + n], None if g_ent is None else g_ent[off:off + n])
                run.add_grads(grad, x2d[rows], first, None if dx is None else dx[rows], dw, db)
                first = False
        ctx.grads = (dx, dw, db)
        ctx.dtypes = (w.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(logp_out, *stat_out.values())
        return (total, logp_out, *stat_out.values())

    @staticmethod
    def backward(ctx, grad_loss, *_grad_per_token):
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
                None if db is None else scale_in_place(db, g).to(b_dtype), None, None, None, None)


def _sequences_per_chunk(run: Chunks, tokens: int, group: int) -> int:
    """Groups (pairs or single sequences) per chunk within SEQUENCE_CHUNK_BYTES; 0 if one group does not fit."""
    per_row = run.vocab * (torch.empty((), dtype=run.logits_dtype).element_size()
                           + (run.x.element_size() if run.logits_dtype != run.x.dtype else 0))
    return SEQUENCE_CHUNK_BYTES // max(1, per_row * tokens * group)


class SequenceLoss(NamedTuple):
    """``sequence_loss``'s result: the loss, the per-token log-probabilities (sequences, tokens) and the asked-for
    per-token statistics by name (each (sequences, tokens)), all but the loss detached."""

    loss: torch.Tensor
    logp: torch.Tensor
    stats: dict[str, torch.Tensor]


def sequence_loss(x, w, bias, target, options: LogProbOptions, paired: bool, chunk_loss: ChunkLoss,
                  whole_batch: bool = False, stats: Sequence[str] = ()) -> SequenceLoss:
    """``chunk_loss`` summed over chunks of x (sequences, tokens, hidden): the fused chunk loop where it applies,
    else the formula on the log-probabilities of all sequences at once (one chunk holding every range).
    ``whole_batch``: the loss is not a sum over chunks (it sorts the batch, as DPO's AOT, or takes a quantile
    over it): one chunk of every sequence, or the formula. ``stats``: names from ``STATS`` that ``chunk_loss``
    is handed as its third argument, a dict of (n, tokens) tensors of the chunk's sequences (the entropy
    differentiable, log Σp² not); the fused loop's statistics launch computes them in its pass over each row."""
    unknown = set(stats) - set(STATS)
    assert not unknown, f"sequence_loss: unknown statistics {sorted(unknown)}"
    stats = tuple(name for name in STATS if name in stats)
    n, t, h = x.shape
    x2d = x.reshape(-1, h)
    if x2d.stride(0) != 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    flat_target = target.reshape(-1).contiguous()
    wants_grad = torch.is_grad_enabled() and any(
        p is not None and p.requires_grad for p in (x, w, bias))
    if wants_grad and n and t and x.dtype in FUSED_DTYPES and plans.eager(*(t for t in (x2d, w, bias, flat_target) if t is not None)):
        run = Chunks(x2d, w, bias, flat_target, options)
        per_chunk = _sequences_per_chunk(run, t, 2 if paired else 1)
        groups = n // 2 if paired else n
        if whole_batch and per_chunk < groups:
            per_chunk = 0
        if per_chunk:
            loss, logp, *values = _FusedSequenceLoss.apply(x2d, w, bias, run,
                                                           _Layout.make(n, t, paired, per_chunk), chunk_loss, stats)
            return SequenceLoss(loss, logp, dict(zip(stats, values)))
    logp, values = _formula_stats(x, w, bias, target, options, stats)
    everything = ((0, n // 2), (n // 2, n)) if paired else ((0, n),)
    value = chunk_loss(logp, everything, values) if stats else chunk_loss(logp, everything)
    return SequenceLoss(value.to(torch.promote_types(value.dtype, torch.float32)), logp.detach(),
                        {name: v.detach() for name, v in values.items()})


def _formula_stats(x, w, bias, target, options: LogProbOptions, stats: tuple[str, ...]):
    """The formula path's per-token log-probabilities (differentiable) and ``stats`` by name, from
    ``selective_log_softmax`` (the entropy differentiable; log Σp² from its 2-D op, in fp32, without gradient)."""
    o = options
    if "log_sum_sq_probs" in stats and x.dtype != torch.float64:  # one pass for all of them
        h = x.shape[-1]
        x2d = x.reshape(-1, h)
        if x2d.stride(0) != 1 and x2d.stride(1) != 1:
            x2d = x2d.contiguous()
        logp, entropy, sq, *_ = token_log_probs_2d(x2d, w, target.reshape(-1).contiguous(), bias, o,
                                                   ("log_probs", *stats))
        values = {"log_sum_sq_probs": sq.detach().view(target.shape)}
        if entropy is not None:
            values["entropy"] = entropy.view(target.shape)
        return logp.view(target.shape), {name: values[name] for name in stats}
    out = selective_log_softmax(x, w, target, bias, o.temperature, o.ignore_index, o.softcap, o.logit_scale,
                                return_entropy="entropy" in stats)
    logp, values = (out[0], {"entropy": out[1]}) if "entropy" in stats else (out, {})
    if "log_sum_sq_probs" in stats:  # float64 (the plain CPU path): the statistic in fp32, it is data
        with torch.no_grad():
            values["log_sum_sq_probs"] = token_log_probs_2d(
                x.reshape(-1, x.shape[-1]).float(), w.float(), target.reshape(-1).contiguous(),
                None if bias is None else bias.float(), o, ("log_probs", "log_sum_sq_probs"))[2].view(
                    target.shape).to(x.dtype)
    return logp, {name: values[name] for name in stats}


def ref_logps(op, ref_x, ref_w, ref_bias, target, options: LogProbOptions, ref_log_probs, sequences: int,
              token_weights: torch.Tensor | None = None):
    """The reference's summed sequence log-probabilities (sequences,) float32: given, or from the reference's
    hidden states and LM head (no gradient), each token's weighted by ``token_weights`` (sequences, tokens) if
    given."""
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
    return (lp.float() if token_weights is None else lp.float() * token_weights).sum(-1)


def check_policy(op: str, x, lm_head_weight, target, bias, ignore_index, temperature, paired: bool):
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


def check_ref_head(op: str, ref_w, lm_head_weight) -> None:
    if ref_w is not None and isinstance(ref_w, torch.Tensor) and ref_w.dim() == 2 and \
            ref_w.shape[0] != lm_head_weight.shape[0]:
        raise ValueError(f"{op}: the reference's vocabulary must be the policy's ({lm_head_weight.shape[0]}); got "
                         f"{describe('ref_lm_head_weight', ref_w)}")


def valid_mask(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (target != ignore_index).float()

