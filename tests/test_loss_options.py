"""The loss options TRL users set: DPO's loss types, their combinations, RPO's NLL term and LD-DPO's weighting;
ORPO without its NLL term; KTO's APO-zero; GRPO's SAPO, LUSPO and VESPO, the vLLM importance-sampling correction,
the off-policy mask and the bias-corrected KL; the distillation losses' biases, mixed precision and autocast.
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


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    def gather(self, value, **_):
        return value

    gather_for_metrics = reduce = gather


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


def _trl_dpo(b, loss_types, weights=None, beta=0.3, eps=0.0, ld_alpha=None, tau=0.05):
    """TRL's ``DPOTrainer._compute_loss`` on float64 log-probabilities of ``b``: (loss, d loss / d W)."""
    w64 = b.w.double().requires_grad_()
    logps = _logps64(b.x, w64, b.target)
    ref_tokens = _logps64(b.ref_x, b.ref_w, b.target)
    mask = b.completion[:, 1:]
    ref = ref_tokens.sum(-1) if ld_alpha is None else (ref_tokens * P.ld_weights(mask.double(), ld_alpha)).sum(-1)
    model = lambda **kw: SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps),  # noqa: E731
                                         mean_logits=torch.zeros_like(logps),
                                         is_top1=torch.zeros_like(logps, dtype=torch.bool))
    trainer = SimpleNamespace(model=SimpleNamespace(training=False), accelerator=_Accelerator(), beta=beta,
                              loss_types=list(loss_types), loss_weights=weights or [1.0] * len(loss_types),
                              ld_alpha=ld_alpha, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
                              label_smoothing=eps, use_weighting=False, precompute_ref_logps=True,
                              aux_loss_enabled=False, args=SimpleNamespace(discopop_tau=tau),
                              _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    pairs = b.ids.shape[0] // 2
    inputs = {"input_ids": b.ids, "attention_mask": torch.ones_like(b.ids), "completion_mask": b.completion,
              "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}
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
        (ValueError, "off_policy_mask_threshold must be finite", dict(off_policy_mask_threshold=math.nan)),
    ]
    for error, match, kw in grpo:
        with pytest.raises(error, match=match):
            F.fused_linear_grpo(x, w, target, adv, **kw)
    xs, ws, xt, wt, bs, bt, t = _distill_inputs(8, 16, 16, 40, ("bad",))
    with pytest.raises(ValueError, match=r"student_bias must be \(40,\)"):
        F.fused_linear_jsd(xs, ws, xt, wt, student_bias=bs[:3])
    with pytest.raises(TypeError, match="teacher_bias must have its head's dtype"):
        F.fused_linear_jsd(xs, ws, xt, wt, teacher_bias=bt.double())
    with pytest.raises(TypeError, match="teacher_x must have student_x's dtype"):
        F.fused_linear_jsd(xs, ws, xt.double(), wt.double())
