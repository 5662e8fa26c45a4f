"""The loss options TRL users set: DPO's loss types, their combinations, RPO's NLL term, LD-DPO's weighting,
WPO's weights (``use_weighting``) and f-DPO's divergences; ORPO without its NLL term; KTO's APO-zero; GRPO's SAPO,
LUSPO and VESPO, the vLLM importance-sampling correction, the off-policy mask, the bias-corrected KL, the
top-entropy token selection and the entropy bonus; the distillation losses' biases, mixed precision and autocast.
Each against TRL's own code on float64 log-probabilities of the same hidden states where TRL has it, else
against float64, with fresh random inputs; each option is also shown to change the result."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.ops.lm_head import fused_linear_jsd as J
from liger_gen.ops.lm_head import post_training as P

from conftest import CPU_PATHS, lm_head_tol, seeded

F = liger_gen.functional
trl = pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _logps64(x, w, target):
    lp = (x.double() @ w.double().t()).log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return torch.where(target != -100, lp, 0.0)


def _stats64(x, w, target):
    """float64 (entropy, log Σ_v p_v²) of each token's distribution, 0 where the target is ignored (as TRL's
    fused LM head returns them); differentiable."""
    logp = (x.double() @ w.double().t()).log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    sq = torch.logsumexp(2 * logp, dim=-1)
    valid = target != -100
    return torch.where(valid, entropy, 0.0), torch.where(valid, sq, 0.0)


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    def gather(self, value, **_):
        return value

    gather_for_metrics = reduce = gather

    def pad_across_processes(self, value, **_):
        return value


@pytest.fixture(scope="module")
def pairs():
    """A paired batch as TRL's DPO collator gives it: ids (2·pairs, L), completion mask (prompt 0, padding 0),
    the shifted targets, hidden states (2·pairs, L − 1, H), a head, and the reference's summed log-probs."""
    n, length, h, v = 6, 10, 16, 40
    gen = seeded("pairs", n, length)
    ids = torch.randint(0, v, (n, length), generator=gen)
    completion = torch.ones(n, length, dtype=torch.long)
    completion[:, :3] = 0
    for i, pad in enumerate((2, 0, 4, 0, 1, 3)):  # completions of different lengths: LD-DPO's tails
        if pad:
            completion[i, -pad:] = 0
    target = ids.masked_fill(completion == 0, -100)[:, 1:]
    x = torch.randn(n, length - 1, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * 0.5
    ref_x = torch.randn(n, length - 1, h, generator=gen)
    ref_w = torch.randn(v, h, generator=gen) * 0.5
    return SimpleNamespace(ids=ids, completion=completion, target=target, x=x, w=w, ref_x=ref_x, ref_w=ref_w)


def _trl_dpo(b, loss_types, weights=None, beta=0.3, eps=0.0, ld_alpha=None, tau=0.05, use_weighting=False,
             f_divergence_type="reverse_kl", f_alpha=0.5, dtype=torch.float64):
    """TRL's ``DPOTrainer._compute_loss`` on ``dtype`` (float64 unless TRL needs another: its α-divergence caps
    have no float64 entry) log-probabilities of ``b``: (loss, d loss / d W, the reference's sums)."""
    w64 = b.w.double().requires_grad_()
    logps = _logps64(b.x, w64, b.target).to(dtype)
    sq = _stats64(b.x, b.w, b.target)[1].to(dtype)
    ref_tokens = _logps64(b.ref_x, b.ref_w, b.target)
    mask = b.completion[:, 1:]
    ref = ref_tokens.sum(-1) if ld_alpha is None else (ref_tokens * P.ld_weights(mask.double(), ld_alpha)).sum(-1)
    model = lambda **kw: SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps),  # noqa: E731
                                         mean_logits=torch.zeros_like(logps), log_sum_sq_probs=sq,
                                         is_top1=torch.zeros_like(logps, dtype=torch.bool))
    trainer = SimpleNamespace(model=SimpleNamespace(training=False), accelerator=_Accelerator(), beta=beta,
                              loss_types=list(loss_types), loss_weights=weights or [1.0] * len(loss_types),
                              ld_alpha=ld_alpha, f_divergence_type=f_divergence_type,
                              f_alpha_divergence_coef=f_alpha, label_smoothing=eps, use_weighting=use_weighting,
                              precompute_ref_logps=True,
                              aux_loss_enabled=False, args=SimpleNamespace(discopop_tau=tau),
                              _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    pairs = b.ids.shape[0] // 2
    inputs = {"input_ids": b.ids, "attention_mask": torch.ones_like(b.ids), "completion_mask": b.completion,
              "ref_chosen_logps": ref[:pairs].to(dtype), "ref_rejected_logps": ref[pairs:].to(dtype)}
    loss = trl.DPOTrainer._compute_loss(trainer, model, inputs, False)
    return loss.detach(), torch.autograd.grad(loss, w64)[0], ref


def _ours_dpo(b, ref, monkeypatch, sequence_bytes, dtype=torch.float32, **kw):
    monkeypatch.setattr(P, "SEQUENCE_CHUNK_BYTES", sequence_bytes)
    w = b.w.to(dtype).requires_grad_()
    out = F.fused_linear_dpo(b.x.to(dtype), w, b.target, ref_log_probs=ref.float(), **kw)
    return out, torch.autograd.grad(out.loss, w)[0]


# one pair per chunk (aot and aot_unpaired then take the formula path), or the formula
SEQUENCE_BYTES = [40 * 4 * 9 * 2, 0]


@pytest.mark.parametrize("loss_type", P.DPO_LOSS_TYPES)
def test_every_dpo_loss_type_is_trls(pairs, loss_type, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    eps = {"robust": 0.1, "exo_pair": 1e-3, "aot": 0.1, "aot_unpaired": 0.1}.get(loss_type, 0.0)
    want, want_grad, ref = _trl_dpo(pairs, [loss_type], eps=eps, tau=0.2)
    for sequence_bytes in SEQUENCE_BYTES:
        out, grad = _ours_dpo(pairs, ref, monkeypatch, sequence_bytes, loss_type=loss_type, beta=0.3,
                              label_smoothing=eps, discopop_tau=0.2)
        assert math.isclose(float(out.loss), float(want), rel_tol=1e-5, abs_tol=1e-7), (sequence_bytes, float(want))
        assert rel_l2(grad.double(), want_grad) < 1e-5, sequence_bytes


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_combined_loss_types_ld_alpha_and_rpo_alpha_are_trls(pairs, interpret, dtype, monkeypatch):
    """MPO's combination with weights and LD-DPO's α together, and ``rpo_alpha`` as TRL 1.16's extra "sft" term:
    TRL's loss and gradient, to fp32 rounding (bf16: its tolerances); each option changes the loss."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    types, weights = ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]
    want, want_grad, ref = _trl_dpo(pairs, types, weights, ld_alpha=0.4)
    loss_tol = 1e-5 if dtype == torch.float32 else lm_head_tol(dtype)
    out, grad = _ours_dpo(pairs, ref, monkeypatch, P.SEQUENCE_CHUNK_BYTES, dtype, loss_type=types,
                          loss_weights=weights, ld_alpha=0.4, beta=0.3)
    assert abs(float(out.loss) - float(want)) <= loss_tol * max(1.0, abs(float(want)))
    assert rel_l2(grad.double(), want_grad) < REL_TOL[dtype]
    plain, _, _ = _trl_dpo(pairs, types, weights)
    assert abs(float(plain) - float(want)) > 1e-3  # ld_alpha matters here
    rpo_want, rpo_grad, ref = _trl_dpo(pairs, ["sigmoid", "sft"], [1.0, 0.7])
    out, grad = _ours_dpo(pairs, ref, monkeypatch, P.SEQUENCE_CHUNK_BYTES, dtype, rpo_alpha=0.7, beta=0.3)
    assert abs(float(out.loss) - float(rpo_want)) <= loss_tol * max(1.0, abs(float(rpo_want)))
    assert rel_l2(grad.double(), rpo_grad) < REL_TOL[dtype]
    assert abs(float(_trl_dpo(pairs, ["sigmoid"])[0]) - float(rpo_want)) > 1e-2


def test_ld_alpha_weights_the_reference_from_its_hidden_states_too(pairs, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    weights = P.ld_weights((pairs.target != -100).double(), 0.25)
    ref = (_logps64(pairs.ref_x, pairs.ref_w, pairs.target) * weights).sum(-1)
    given = F.fused_linear_dpo(pairs.x, pairs.w, pairs.target, ref_log_probs=ref.float(), ld_alpha=0.25)
    own = F.fused_linear_dpo(pairs.x, pairs.w, pairs.target, pairs.ref_x, pairs.ref_w, ld_alpha=0.25)
    assert math.isclose(float(own.loss), float(given.loss), rel_tol=1e-6)
    assert torch.allclose(own.chosen_logps.double(), (_logps64(pairs.x, pairs.w, pairs.target) * weights).sum(-1)[:3],
                          rtol=1e-5)


# ------------------------------------------------------------------------------ DPO: WPO weights, f-divergences

# 1 << 30: every pair in one chunk
ALL_SEQUENCE_BYTES = SEQUENCE_BYTES + [1 << 30]

WPO_CASES = {  # name: (loss types, weights, rpo_alpha, other options)
    "sigmoid": (["sigmoid"], None, None, {}),
    "ipo": (["ipo"], None, None, {}),
    "mpo-ld": (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.3], None, dict(ld_alpha=0.4)),
    "rpo": (["sigmoid"], None, 0.7, {}),
}


def _weighted_nll64(b, weight):
    """``weight``·NLL(chosen completions)·mean over pairs of w_c·w_r (WPO's weights, float64): the weighted "sft"
    term, which TRL 1.16 cannot compute (it multiplies an expanded tensor in place and raises): (value, d/dW)."""
    w64 = b.w.double().requires_grad_()
    lp = _logps64(b.x, w64, b.target)
    m = (b.target != -100).double()
    pairs = lp.shape[0] // 2
    nll = -(lp[:pairs] * m[:pairs]).sum() / m[:pairs].sum()
    ww = P.wpo_weights(lp, _stats64(b.x, b.w, b.target)[1], m)
    value = weight * nll * (ww[:pairs] * ww[pairs:]).mean()
    return value.detach(), torch.autograd.grad(value, w64)[0]


@pytest.mark.parametrize("name", list(WPO_CASES))
def test_use_weighting_is_trls(pairs, name, monkeypatch):
    """WPO's weights (``use_weighting``, with log Σp² from the statistics launch): TRL's loss and gradient on
    every way of running (one pair per chunk, the formula, one chunk of all pairs; the weighted NLL of "sft" and
    ``rpo_alpha`` takes the whole batch at once, against float64 since TRL raises there); the weights change the
    loss."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    types, weights, rpo_alpha, extra = WPO_CASES[name]
    sft = (weights[types.index("sft")] if "sft" in types else 0.0) + (rpo_alpha or 0.0)
    trl_types = [t for t in types if t != "sft"]
    trl_weights = None if weights is None else [w for t, w in zip(types, weights) if t != "sft"]
    want, want_grad, ref = _trl_dpo(pairs, trl_types, trl_weights, use_weighting=True, **extra)
    if sft:
        nll, nll_grad = _weighted_nll64(pairs, sft)
        want, want_grad = want + nll, want_grad + nll_grad
    for sequence_bytes in ALL_SEQUENCE_BYTES:
        out, grad = _ours_dpo(pairs, ref, monkeypatch, sequence_bytes, loss_type=types, loss_weights=weights,
                              rpo_alpha=rpo_alpha, use_weighting=True, beta=0.3, **extra)
        assert math.isclose(float(out.loss), float(want), rel_tol=1e-5, abs_tol=1e-8), (sequence_bytes, float(want))
        assert rel_l2(grad.double(), want_grad) < 1e-5, sequence_bytes
    unweighted = _trl_dpo(pairs, trl_types, trl_weights, **extra)[0]
    assert abs(float(unweighted) - float(want)) > 0.1 * abs(float(want))


F_DIVERGENCE_CASES = [  # (f_divergence_type, loss_type, label_smoothing, α)
    ("forward_kl", "sigmoid", 0.0, 0.5), ("forward_kl", "exo_pair", 1e-3, 0.5), ("js_divergence", "ipo", 0.0, 0.5),
    ("js_divergence", "robust", 0.1, 0.5), ("alpha_divergence", "hinge", 0.0, 1.6),
    ("alpha_divergence", "discopop", 0.0, 0.8), ("alpha_divergence", "sigmoid_norm", 0.0, 0.5)]


@pytest.mark.parametrize("divergence, loss_type, eps, alpha", F_DIVERGENCE_CASES,
                         ids=[f"{d}-{t}" for d, t, _, _ in F_DIVERGENCE_CASES])
def test_f_divergence_types_are_trls(pairs, divergence, loss_type, eps, alpha, monkeypatch):
    """f-DPO's scores (``f_divergence_type``, ``f_alpha_divergence_coef``) with the loss types built on their
    difference: TRL's loss and gradient on both ways of running (TRL's α-divergence runs in float32: its
    exponent caps have no float64 entry, so fp32 rounding is in the truth there); each differs from plain DPO."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dtype = torch.float32 if divergence == "alpha_divergence" else torch.float64
    want, want_grad, ref = _trl_dpo(pairs, [loss_type], eps=eps, f_divergence_type=divergence, f_alpha=alpha,
                                    tau=0.2, dtype=dtype)
    for sequence_bytes in SEQUENCE_BYTES:
        out, grad = _ours_dpo(pairs, ref, monkeypatch, sequence_bytes, loss_type=loss_type, beta=0.3,
                              label_smoothing=eps, discopop_tau=0.2, f_divergence_type=divergence,
                              f_alpha_divergence_coef=alpha)
        assert math.isclose(float(out.loss), float(want), rel_tol=1e-5, abs_tol=1e-7), (sequence_bytes, float(want))
        assert rel_l2(grad.double(), want_grad) < REL_TOL[torch.float32], sequence_bytes
    plain = _trl_dpo(pairs, [loss_type], eps=eps, tau=0.2)[0]
    assert abs(float(plain) - float(want)) > 1e-3


def test_alpha_divergence_limit_and_cap():
    """α → 1 is the reverse KL (TRL's switch at |α − 1| < 1e-6); the exponent is capped (80, float16 11), so
    large log-ratios give finite scores."""
    rho = torch.tensor([-30.0, -2.0, 0.0, 3.0, 200.0], dtype=torch.float64)
    assert torch.equal(P.f_divergence_scores(rho, "alpha_divergence", 1.0 + 1e-7), rho)
    near = P.f_divergence_scores(rho[1:4], "alpha_divergence", 1.0 + 1e-4)
    assert torch.allclose(near, rho[1:4], rtol=1e-3, atol=1e-3)
    big = P.f_divergence_scores(rho, "alpha_divergence", 2.0)
    assert torch.isfinite(big).all() and float(big[-1]) == math.expm1(80.0)
    assert torch.isfinite(P.f_divergence_scores(rho.half(), "alpha_divergence", 2.0)).all()


def test_orpo_without_its_nll_term_is_minus_trls_odds_ratio_mean(pairs, monkeypatch):
    ORPOTrainer = pytest.importorskip("trl.experimental.orpo.orpo_trainer").ORPOTrainer
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w64 = pairs.w.double().requires_grad_()
    lp = _logps64(pairs.x, w64, pairs.target)
    m = (pairs.target != -100).double()
    means = (lp * m).sum(-1) / m.sum(-1)
    terms, *_ = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=0.3, accelerator=_Accelerator()), means[:3],
                                            means[3:])
    want = -terms.mean()
    (want_grad,) = torch.autograd.grad(want, w64)
    for sequence_bytes in (P.SEQUENCE_CHUNK_BYTES, 0):
        monkeypatch.setattr(P, "SEQUENCE_CHUNK_BYTES", sequence_bytes)
        w = pairs.w.clone().requires_grad_()
        out = F.fused_linear_orpo(pairs.x, w, pairs.target, beta=0.3, compute_nll_loss=False)
        (grad,) = torch.autograd.grad(out.loss, w)
        assert math.isclose(float(out.loss), float(want), rel_tol=1e-5)
        assert rel_l2(grad.double(), want_grad) < 1e-5
    with_nll = F.fused_linear_orpo(pairs.x, pairs.w, pairs.target, beta=0.3)
    assert abs(float(with_nll.loss) - float(want)) > 0.1


def test_kto_apo_zero_unpaired_is_trls(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    n, length, h, v = 6, 9, 16, 40
    gen = seeded("kto-apo")
    ids = torch.randint(0, v, (n, length), generator=gen)
    completion = torch.ones(n, length, dtype=torch.long)
    completion[:, :3] = 0
    target = ids.masked_fill(completion == 0, -100)[:, 1:]
    x = torch.randn(n, length - 1, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * 0.5
    desirable = torch.tensor([True, False, True, False, False, True])
    ref = -torch.rand(n, generator=gen, dtype=torch.float64) * 20
    w64 = w.double().requires_grad_()
    logps = _logps64(x, w64, target)
    model = lambda **kw: SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps),  # noqa: E731
                                         mean_logits=torch.zeros_like(logps))
    trainer = SimpleNamespace(model=SimpleNamespace(training=False), accelerator=_Accelerator(), beta=0.2,
                              loss_type="apo_zero_unpaired", desirable_weight=1.2, undesirable_weight=0.9,
                              precompute_ref_logps=True, calculate_KL=False, aux_loss_enabled=False,
                              _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
                              _compute_kl_logps=lambda model, batch: None)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion,
             "label": desirable, "ref_logps": ref}
    want = trl.KTOTrainer._compute_loss(trainer, model, batch, False)
    want = want[0] if isinstance(want, tuple) else want
    (want_grad,) = torch.autograd.grad(want, w64)
    ws = w.clone().requires_grad_()
    ours = F.fused_linear_kto(x, ws, target, desirable, ref_log_probs=ref.float(), kl=5.0, beta=0.2,
                              desirable_weight=1.2, undesirable_weight=0.9, loss_type="apo_zero_unpaired")
    (grad,) = torch.autograd.grad(ours.loss, ws)
    assert math.isclose(float(ours.loss), float(want), rel_tol=1e-5)
    assert rel_l2(grad.double(), want_grad) < 1e-5
    kto = F.fused_linear_kto(x, w, target, desirable, ref_log_probs=ref.float(), kl=5.0, beta=0.2)
    assert abs(float(kto.loss) - float(want)) > 1e-3


# ------------------------------------------------------------------------------ GRPO


def _trl_is_ratio(old, sampling, mask, mode, lo, hi):
    """TRL 1.16's ``GRPOTrainer._generate_and_score_completions`` importance-sampling ratio, transcribed."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    diff = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    bad = (ratio < (-math.inf if lo is None else lo)) | (ratio > (math.inf if hi is None else hi))
    return ratio.masked_fill(bad, 0.0)


GRPO_CASES = {  # name: (loss_type, level, beta, options, IS mode or None, off-policy threshold)
    "sapo": ("sapo", "token", 0.0, dict(sapo_temperature_pos=1.3, sapo_temperature_neg=0.8), None, None),
    "luspo": ("luspo", "sequence", 0.0, {}, None, None),
    "vespo-is": ("vespo", "token", 0.0, dict(vespo_k_pos=1.5, vespo_lambda_neg=2.5), "token_truncate", None),
    "dapo-sequence_mask": ("dapo", "token", 0.0, {}, "sequence_mask", None),
    "grpo-token_mask-kl": ("grpo", "token", 0.05, dict(use_bias_correction_kl=True), "token_mask", None),
    "bnpo-sequence_truncate-offpolicy": ("bnpo", "token", 0.0, {}, "sequence_truncate", 0.3),
    "cispo-kl-sequence": ("cispo", "sequence", 0.05, dict(use_bias_correction_kl=True), None, None),
}


@pytest.mark.parametrize("name", list(GRPO_CASES))
def test_grpo_options_are_grpo_trainers_compute_loss(name, monkeypatch):
    """TRL's own ``GRPOTrainer._compute_loss`` with vLLM's importance-sampling ratio (as TRL computes it from the
    sampling engine's log-probabilities), the off-policy mask and the bias-corrected KL, on float64 per-token
    log-probabilities: our fused loss and gradient on both ways of running."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    loss_type, level, beta, opts, mode, threshold = GRPO_CASES[name]
    n, t, h, v = 4, 6, 16, 40
    gen = seeded("grpo-options", name)
    x = torch.randn(n, t, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * 0.5
    target = torch.randint(0, v, (n, t), generator=gen)
    target[1, -2:] = -100
    mask = (target != -100).long()
    adv = torch.randn(n, generator=gen)
    true = _logps64(x, w, target)
    old = true + torch.randn(n, t, generator=gen, dtype=torch.float64) * 0.3
    sampling = old + torch.randn(n, t, generator=gen, dtype=torch.float64) * 0.4
    sampling[2, 1] = float("nan")  # a token the engine did not score
    refp = true + torch.randn(n, t, generator=gen, dtype=torch.float64) * 0.2
    w64 = w.double().requires_grad_()
    args = SimpleNamespace(delta=None, use_bias_correction_kl=opts.get("use_bias_correction_kl", False),
                           steps_per_generation=1, sapo_temperature_pos=opts.get("sapo_temperature_pos", 1.0),
                           sapo_temperature_neg=opts.get("sapo_temperature_neg", 1.05),
                           vespo_k_pos=opts.get("vespo_k_pos", 2.0), vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                           vespo_lambda_neg=opts.get("vespo_lambda_neg", 2.0))
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), beta=beta, epsilon_low=0.2,
        epsilon_high=0.28, loss_type=loss_type, importance_sampling_level=level, top_entropy_quantile=1.0,
        off_policy_mask_threshold=threshold, use_vllm=mode is not None, vllm_importance_sampling_correction=True,
        current_gradient_accumulation_steps=1, max_completion_length=t, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)), args=args,
        get_off_policy_mask=trl.GRPOTrainer.get_off_policy_mask, get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (_logps64(x, w64, target),
                                                              torch.zeros(n, t, dtype=torch.float64), None))
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": target.clamp(min=0), "completion_mask": mask, "advantages": adv.double(),
              "ref_per_token_logps": refp, "num_items_in_batch": mask.sum().double(), "old_per_token_logps": old}
    if mode is not None or threshold is not None:
        inputs["sampling_per_token_logps"] = sampling
    if mode is not None:
        inputs["importance_sampling_ratio"] = _trl_is_ratio(old, sampling, mask, mode, 0.5, 1.5)
        ours_ratio = P.vllm_importance_sampling_ratio(old, sampling, mask, mode, 0.5, 1.5)
        assert torch.equal(ours_ratio, inputs["importance_sampling_ratio"])
    want = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    (want_grad,) = torch.autograd.grad(want, w64)
    kw = dict(beta=beta, epsilon_high=0.28, loss_type=loss_type, importance_sampling_level=level,
              max_completion_length=t, off_policy_mask_threshold=threshold, **opts)
    if mode is not None:
        kw.update(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5,
                  vllm_importance_sampling_clip_max=1.5)
    sampled = None if mode is None and threshold is None else sampling.float()
    results = []
    for sequence_bytes in (P.SEQUENCE_CHUNK_BYTES, 0):
        monkeypatch.setattr(P, "SEQUENCE_CHUNK_BYTES", sequence_bytes)
        ws = w.clone().requires_grad_()
        out = F.fused_linear_grpo(x, ws, target, adv, mask, old.float(), refp.float() if beta else None,
                                  sampling_per_token_logps=sampled, **kw)
        (grad,) = torch.autograd.grad(out.loss, ws)
        assert math.isclose(float(out.loss), float(want), rel_tol=1e-5, abs_tol=1e-7), sequence_bytes
        assert rel_l2(grad.double(), want_grad) < 1e-5, sequence_bytes
        results.append(float(out.loss))
    # the options matter: without them (plain dapo, no correction) the loss differs
    plain = F.fused_linear_grpo(x, w, target, adv, mask, old.float(), refp.float() if beta else None, beta=beta,
                                epsilon_high=0.28, importance_sampling_level=level)
    assert abs(float(plain.loss) - results[0]) > 1e-4


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_grpo_options_in_bf16(interpret, monkeypatch):
    """The new GRPO options in bf16 on both CPU paths (the kernels in the interpreter), against float64."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    n, t, h, v = 4, 6, 16, 40
    gen = seeded("grpo-bf16")
    x = torch.randn(n, t, h, generator=gen).bfloat16()
    w = (torch.randn(v, h, generator=gen) * 0.5).bfloat16()
    target = torch.randint(0, v, (n, t), generator=gen)
    adv = torch.randn(n, generator=gen)
    old = -torch.rand(n, t, generator=gen) * 4
    sampling = old + torch.randn(n, t, generator=gen) * 0.3
    refp = -torch.rand(n, t, generator=gen) * 4
    kw = dict(beta=0.04, loss_type="sapo", use_bias_correction_kl=True, vllm_importance_sampling_mode="token_mask",
              vllm_importance_sampling_clip_min=0.6, vllm_importance_sampling_clip_max=1.6)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    mask = torch.ones(n, t)
    want = P.grpo_loss(_logps64(x64, w64, target), old.double(), refp.double(), adv.double(), mask,
                       sampling_per_token_logps=sampling.double(), **kw)
    want_grads = torch.autograd.grad(want, (x64, w64))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = F.fused_linear_grpo(xs, ws, target, adv, None, old, refp, sampling_per_token_logps=sampling, **kw)
    grads = torch.autograd.grad(out.loss, (xs, ws))
    assert abs(float(out.loss) - float(want)) <= lm_head_tol(torch.bfloat16) * max(1.0, abs(float(want)))
    for got, ref in zip(grads, want_grads):
        assert rel_l2(got.double(), ref) < REL_TOL[torch.bfloat16]


ENTROPY_CASES = {  # name: (loss_type, beta, top_entropy_quantile, entropy_coef)
    "dapo-top40": ("dapo", 0.0, 0.4, 0.0),
    "grpo-top25-bonus-kl": ("grpo", 0.04, 0.25, 0.05),
    "bnpo-bonus": ("bnpo", 0.0, 1.0, 0.1),
    "sapo-top60-bonus": ("sapo", 0.0, 0.6, 0.02),
}


# the kernels in the interpreter where the entropy gradient reaches them: per chunk (the bonus alone) and in one
# chunk of the batch (the selection with the bonus)
ENTROPY_RUNS = [pytest.param(name, "0", id=f"{name}-plain") for name in ENTROPY_CASES] + [
    pytest.param(name, *p.values, marks=p.marks, id=f"{name}-interpreter")
    for name in ("grpo-top25-bonus-kl", "bnpo-bonus") for p in CPU_PATHS[:1]]


@pytest.mark.parametrize("name, interpret", ENTROPY_RUNS)
def test_grpo_entropy_options_are_grpo_trainers_compute_loss(name, interpret, monkeypatch):
    """TRL's ``top_entropy_quantile`` (its ``get_high_entropy_mask`` on one process) and ``entropy_coef`` bonus:
    TRL's own ``GRPOTrainer._compute_loss`` on float64 log-probabilities and entropies gives our fused loss and
    gradient, the entropies (and their gradient, for the bonus) coming from our statistics and gradient
    kernels; every way of running: one chunk of the batch, one sequence per chunk (the quantile then takes the
    formula), the formula. The returned entropies are the float64 ones to fp32 rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    loss_type, beta, quantile, coef = ENTROPY_CASES[name]
    n, t, h, v = 4, 6, 16, 40
    gen = seeded("grpo-entropy", name)
    x = torch.randn(n, t, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * 0.5
    target = torch.randint(0, v, (n, t), generator=gen)
    target[1, -2:] = -100  # 22 tokens: the quantiles fall between two tokens' entropies
    mask = (target != -100).long()
    adv = torch.randn(n, generator=gen)
    true = _logps64(x, w, target)
    old = true + torch.randn(n, t, generator=gen, dtype=torch.float64) * 0.3
    refp = true + torch.randn(n, t, generator=gen, dtype=torch.float64) * 0.2
    w64 = w.double().requires_grad_()
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), beta=beta, epsilon_low=0.2,
        epsilon_high=0.28, loss_type=loss_type, importance_sampling_level="token", top_entropy_quantile=quantile,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=True,
        current_gradient_accumulation_steps=1, max_completion_length=t, aux_loss_enabled=False,
        _entropy_bonus_enabled=coef != 0.0, entropy_coef=coef, use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
        _get_per_token_logps_and_entropies=lambda *a, **k: (_logps64(x, w64, target), _stats64(x, w64, target)[0],
                                                              None))
    trainer.get_high_entropy_mask = lambda *a: trl.GRPOTrainer.get_high_entropy_mask(trainer, *a)
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": target.clamp(min=0), "completion_mask": mask, "advantages": adv.double(),
              "ref_per_token_logps": refp, "num_items_in_batch": mask.sum().double(), "old_per_token_logps": old}
    want = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    (want_grad,) = torch.autograd.grad(want, w64)
    kw = dict(beta=beta, epsilon_high=0.28, loss_type=loss_type, max_completion_length=t,
              top_entropy_quantile=quantile, entropy_coef=coef)
    for sequence_bytes in (1 << 30, v * 4 * t, 0):
        monkeypatch.setattr(P, "SEQUENCE_CHUNK_BYTES", sequence_bytes)
        ws = w.clone().requires_grad_()
        out = F.fused_linear_grpo(x, ws, target, adv, mask, old.float(), refp.float() if beta else None, **kw)
        (grad,) = torch.autograd.grad(out.loss, ws)
        assert math.isclose(float(out.loss), float(want), rel_tol=1e-5, abs_tol=1e-7), sequence_bytes
        assert rel_l2(grad.double(), want_grad) < 1e-5, sequence_bytes
        assert torch.allclose(out.entropy.double(), _stats64(x, w, target)[0], rtol=1e-5, atol=1e-6)
    plain = F.fused_linear_grpo(x, w, target, adv, mask, old.float(), refp.float() if beta else None,
                                **{**kw, "top_entropy_quantile": 1.0, "entropy_coef": 0.0})
    assert abs(float(plain.loss) - float(want)) > 1e-3 and plain.entropy is None


def test_high_entropy_mask_is_trls():
    """``high_entropy_mask`` (NaN-masked quantile, no host sync) against TRL's ``get_high_entropy_mask`` on one
    process: quantiles 0 (the highest entropy only), 1 (every token), between, ties, and no token at all."""
    gen = seeded("entropy-mask")
    entropies = torch.rand(5, 7, generator=gen) * 3  # fp32, as TRL's fused LM head gives them
    entropies[2, :3] = 1.5  # ties
    mask = (torch.rand(5, 7, generator=gen) < 0.7).long()
    trainer = SimpleNamespace(accelerator=_Accelerator())
    for q in (0.0, 0.2, 0.5, 0.73, 1.0):
        want = trl.GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, 1 - q)
        assert torch.equal(P.high_entropy_mask(entropies, mask, q), want), q
    assert int(P.high_entropy_mask(entropies, mask, 0.0).sum()) == 1
    assert torch.equal(P.high_entropy_mask(entropies, mask, 1.0), mask.bool())
    nothing = torch.zeros_like(mask)
    assert not P.high_entropy_mask(entropies, nothing, 0.5).any()
    assert torch.equal(P.high_entropy_mask(entropies, nothing, 0.5),
                       trl.GRPOTrainer.get_high_entropy_mask(trainer, entropies, nothing, 0.5))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_entropy_options_and_wpo_weights_in_bf16(interpret, pairs, monkeypatch):
    """GRPO's top-entropy selection with the entropy bonus, and DPO's WPO weights with an f-divergence, in bf16
    on both CPU paths, against float64 of the same (rounded) inputs; bf16's rounded logits move each entropy by
    far less than the gap between the two tokens the quantile falls between (checked), so the same tokens are
    kept."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    n, t, h, v = 4, 6, 16, 40
    gen = seeded("entropy-bf16")
    x = torch.randn(n, t, h, generator=gen).bfloat16()
    w = (torch.randn(v, h, generator=gen) * 0.5).bfloat16()
    target = torch.randint(0, v, (n, t), generator=gen)
    adv = torch.randn(n, generator=gen)
    old = -torch.rand(n, t, generator=gen) * 4
    mask = torch.ones(n, t)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    entropy64 = _stats64(x64, w64, target)[0]
    kept = torch.sort(entropy64.detach().flatten())[0]
    position = (kept.numel() - 1) * (1 - 0.5)  # 11.5: between the 12th and 13th entropies
    assert float(kept[math.ceil(position)] - kept[math.floor(position)]) > 0.05
    kw = dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.05)
    want = P.grpo_loss(_logps64(x64, w64, target), old.double(), None, adv.double(), mask, entropies=entropy64, **kw)
    want_grads = torch.autograd.grad(want, (x64, w64))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = F.fused_linear_grpo(xs, ws, target, adv, None, old, **kw)
    grads = torch.autograd.grad(out.loss, (xs, ws))
    tol = lm_head_tol(torch.bfloat16)
    assert abs(float(out.loss) - float(want)) <= tol * max(1.0, abs(float(want)))
    for got, ref in zip(grads, want_grads):
        assert rel_l2(got.double(), ref) < REL_TOL[torch.bfloat16]
    # DPO: WPO weights (log Σp² of the bf16 logits) with the JS divergence, TRL's own loss as the truth
    types = ["sigmoid", "ipo"]  # (TRL's weighting multiplies in place: hinge's relu output cannot take it)
    want, want_grad, ref = _trl_dpo(pairs, types, use_weighting=True, f_divergence_type="js_divergence")
    out, grad = _ours_dpo(pairs, ref, monkeypatch, 1 << 30, torch.bfloat16, loss_type=types, use_weighting=True,
                          f_divergence_type="js_divergence", beta=0.3)
    assert abs(float(out.loss) - float(want)) <= tol * max(1e-2, abs(float(want)))
    assert rel_l2(grad.double(), want_grad) < REL_TOL[torch.bfloat16]


# ------------------------------------------------------------------------------ distillation


def _distill_inputs(rows, hs, ht, v, key):
    gen = seeded("distill", *key)
    return (torch.randn(rows, hs, generator=gen), torch.randn(v, hs, generator=gen) * 2 / hs ** 0.5,
            torch.randn(rows, ht, generator=gen), torch.randn(v, ht, generator=gen) * 2.5 / ht ** 0.5,
            torch.randn(v, generator=gen) * 2, torch.randn(v, generator=gen) * 2,
            torch.where(torch.rand(rows, generator=gen) < 0.2, -100, 1))


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("student, teacher", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16-student", "bf16-teacher", "bf16"])
def test_distillation_biases_and_mixed_dtypes_match_float64(interpret, student, teacher, monkeypatch):
    """Student and teacher biases (the student's with its gradient) and a teacher of another dtype, against the
    float64 truth of the same (rounded) inputs; the loss without the biases differs."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    xs, ws, xt, wt, bs, bt, target = _distill_inputs(13, 24, 40, 70, ("mixed", str(student), str(teacher)))
    xs, ws, bs = xs.to(student), ws.to(student).requires_grad_(), bs.to(student).requires_grad_()
    xs.requires_grad_()
    xt, wt, bt = xt.to(teacher), wt.to(teacher), bt.to(teacher)
    loss = F.fused_linear_jsd(xs, ws, xt, wt, target, beta=0.3, temperature=0.8, student_bias=bs, teacher_bias=bt)
    gx, gw, gb = torch.autograd.grad(loss * 0.5, (xs, ws, bs))
    want, dx, dw, db = J.fused_linear_jsd_float64(xs, ws, xt, wt, target, 0.3, 0.8, student_bias=bs,
                                                  teacher_bias=bt)
    low = torch.bfloat16 in (student, teacher)
    tol = REL_TOL[torch.bfloat16 if low else torch.float32]
    loss_tol = lm_head_tol(torch.bfloat16 if low else torch.float32)
    assert abs(float(loss) - float(want)) <= loss_tol * float(want)
    assert rel_l2(gx, 0.5 * dx) < tol and rel_l2(gw, 0.5 * dw) < tol and rel_l2(gb, 0.5 * db) < tol
    assert gx.dtype == gw.dtype == gb.dtype == student
    no_bias = J.fused_linear_jsd_float64(xs, ws, xt, wt, target, 0.3, 0.8)[0]
    assert abs(float(no_bias) - float(want)) > 3 * loss_tol * float(want)
    kl = F.fused_linear_kl_div(xs, ws, xt, wt, target, temperature=0.8, student_bias=bs, teacher_bias=bt)
    assert float(kl) == float(F.fused_linear_jsd(xs, ws, xt, wt, target, 0.0, 0.8, student_bias=bs,
                                                 teacher_bias=bt))


def test_distillation_biases_are_trls_generalized_jsd_loss():
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    xs, ws, xt, wt, bs, bt, target = _distill_inputs(2 * 7, 16, 24, 50, ("trl",))
    zs = (xs.double() @ ws.double().t() + bs.double()).view(2, 7, -1)
    zt = (xt.double() @ wt.double().t() + bt.double()).view(2, 7, -1)
    want = gkd.GKDTrainer.generalized_jsd_loss(zs, zt, target.view(2, 7), beta=0.5, temperature=1.2)
    got = F.fused_linear_jsd(xs.view(2, 7, -1), ws, xt.view(2, 7, -1), wt, target.view(2, 7), temperature=1.2,
                             reduction="batchmean", student_bias=bs, teacher_bias=bt)
    assert math.isclose(float(got), float(want), rel_tol=1e-5)


def test_distillation_under_autocast_is_the_autocast_dtypes_loss(monkeypatch):
    """Under CPU autocast (bf16) the loss is the bf16 one; fp32 leaves get fp32 gradients, the bf16 ones."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    xs, ws, xt, wt, bs, bt, target = _distill_inputs(10, 16, 16, 40, ("autocast",))
    leaves = [t.clone().requires_grad_() for t in (xs, ws, bs)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.fused_linear_jsd(leaves[0], leaves[1], xt, wt, target, student_bias=leaves[2], teacher_bias=bt)
    grads = torch.autograd.grad(loss, leaves)
    low = [t.bfloat16().requires_grad_() for t in (xs, ws, bs)]
    want = F.fused_linear_jsd(low[0], low[1], xt.bfloat16(), wt.bfloat16(), target, student_bias=low[2],
                              teacher_bias=bt.bfloat16())
    want_grads = torch.autograd.grad(want, low)
    assert float(loss) == float(want)
    for got, ref in zip(grads, want_grads):
        assert got.dtype == torch.float32 and torch.equal(got, ref.float())
    assert float(F.fused_linear_jsd(xs, ws, xt, wt, target, student_bias=bs, teacher_bias=bt)) != float(loss)


# ------------------------------------------------------------------------------ bad options


def test_bad_options_name_the_argument(pairs):
    x, w, target = pairs.x, pairs.w, pairs.target
    ref = torch.zeros(6)
    cases = [
        (ValueError, "loss_type must be one of", dict(loss_type="ppo")),
        (ValueError, "loss_type must be one of .* or a non-empty list", dict(loss_type=[])),
        (ValueError, r"loss_weights must have one weight per loss type \(2\)", dict(loss_type=["sigmoid", "sft"],
                                                                                   loss_weights=[1.0])),
        (ValueError, "loss_weights must be finite", dict(loss_weights=[math.nan])),
        (ValueError, r"ld_alpha must be >= 0.0 and <= 1.0", dict(ld_alpha=1.5)),
        (ValueError, "rpo_alpha must be finite", dict(rpo_alpha=math.inf)),
        (ValueError, "exo_pair' needs 0 < label_smoothing < 1", dict(loss_type="exo_pair")),
        (ValueError, "discopop_tau must be > 0", dict(loss_type="discopop", discopop_tau=0.0)),
        (TypeError, "use_weighting must be a bool", dict(use_weighting=1)),
        (ValueError, "use_weighting does not go with loss_type 'aot'", dict(loss_type=["sigmoid", "aot"],
                                                                            use_weighting=True)),
        (ValueError, "f_divergence_type must be one of", dict(f_divergence_type="kl")),
        (ValueError, "f_divergence_type='forward_kl' needs a loss type built on",
         dict(loss_type="bco_pair", f_divergence_type="forward_kl")),
        (ValueError, "f_alpha_divergence_coef must be finite",
         dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=math.inf)),
    ]
    for error, match, kw in cases:
        with pytest.raises(error, match=match):
            F.fused_linear_dpo(x, w, target, ref_log_probs=ref, **kw)
    with pytest.raises(TypeError, match="compute_nll_loss must be a bool"):
        F.fused_linear_orpo(x, w, target, compute_nll_loss=0)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        F.fused_linear_kto(x, w, target, torch.ones(6, dtype=torch.bool), ref_log_probs=ref, loss_type="apo")
    adv = torch.zeros(6)
    grpo = [
        (ValueError, "sapo_temperature_neg must be > 0", dict(loss_type="sapo", sapo_temperature_neg=0.0)),
        (ValueError, "vllm_importance_sampling_mode must be one of", dict(vllm_importance_sampling_mode="token")),
        (ValueError, r"clip_min \(4.0\) must be <=", dict(vllm_importance_sampling_clip_min=4.0)),
        (ValueError, "vespo' with the importance-sampling correction needs",
         dict(loss_type="vespo", sampling_per_token_logps=torch.zeros(6, 9))),
        (ValueError, r"sampling_per_token_logps must be \(6, 9\)", dict(sampling_per_token_logps=torch.zeros(6))),
        (TypeError, "use_bias_correction_kl must be a bool", dict(use_bias_correction_kl=1)),
        (TypeError, "unknown options", dict(vllm_importance_sampling_cap=2.0)),
        (TypeError, "did you mean 'top_entropy_quantile'", dict(top_entropy_quantle=0.2)),
        (ValueError, "off_policy_mask_threshold must be finite", dict(off_policy_mask_threshold=math.nan)),
        (ValueError, r"top_entropy_quantile must be >= 0.0 and <= 1.0", dict(top_entropy_quantile=1.5)),
        (ValueError, "entropy_coef must be finite", dict(entropy_coef=math.nan)),
    ]
    for error, match, kw in grpo:
        with pytest.raises(error, match=match):
            F.fused_linear_grpo(x, w, target, adv, **kw)
    lp, mask = torch.zeros(6, 9), torch.ones(6, 9)
    for kw in (dict(top_entropy_quantile=0.5), dict(entropy_coef=0.1)):
        with pytest.raises(ValueError, match="needs entropies"):
            P.grpo_loss(lp, lp, None, adv, mask, **kw)
    with pytest.raises(ValueError, match="top_entropy_quantile must be >= 0.0"):
        P.high_entropy_mask(lp, mask, -0.1)
    xs, ws, xt, wt, bs, bt, t = _distill_inputs(8, 16, 16, 40, ("bad",))
    with pytest.raises(ValueError, match=r"student_bias must be \(40,\)"):
        F.fused_linear_jsd(xs, ws, xt, wt, student_bias=bs[:3])
    with pytest.raises(TypeError, match="teacher_bias must have its head's dtype"):
        F.fused_linear_jsd(xs, ws, xt, wt, teacher_bias=bt.double())
    with pytest.raises(TypeError, match="teacher_x must have student_x's dtype"):
        F.fused_linear_jsd(xs, ws, xt.double(), wt.double())


def test_grpo_entropy_options_on_empty_batches_and_bad_entropies():
    """No sequence or no token: the quantile mask is empty and the loss 0 (torch.nanquantile refuses empty input);
    entropies of another shape, or not a tensor, are refused by name."""
    from liger_gen.ops.lm_head.post_training import grpo_loss, high_entropy_mask

    for shape in ((0, 5), (4, 0)):
        z = torch.zeros(shape)
        assert high_entropy_mask(z, z, 0.5).shape == shape
        loss = grpo_loss(z, z, None, torch.zeros(shape[0]), z, entropies=z, top_entropy_quantile=0.5,
                         entropy_coef=0.1)
        assert loss.item() == 0.0
    lp, mask = torch.randn(3, 4), torch.ones(3, 4)
    for bad in (torch.rand(3, 5), torch.rand(3, 1), [[0.0] * 4] * 3):
        with pytest.raises(ValueError, match=r"entropies must be a tensor of the mask's shape \(3, 4\)"):
            grpo_loss(lp, lp, None, torch.zeros(3), mask, entropies=bad, top_entropy_quantile=0.5)
