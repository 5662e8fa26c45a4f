"""Preference and RL losses from hidden states (DPO, ORPO, CPO, SimPO, KTO, GRPO): the formulas against TRL's
own code, the fused losses against float64 on both CPU paths and both ways of running (gradients in the
forward over chunks of whole sequences, or the formula on selective_log_softmax), DPO against TRL's
``DPOTrainer.compute_loss`` on a real batch, bad inputs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.ops.lm_head import post_training as P

from conftest import CPU_PATHS, seeded

F = liger_gen.functional
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # float16: the formula path


def _batch(n, t, h, v, dtype, key, prompt=2):
    gen = seeded(*key, n, t, h, v, str(dtype))
    x = torch.randn(n, t, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 2.0 / h ** 0.5).to(dtype)
    target = torch.randint(0, v, (n, t), generator=gen)
    target[:, :prompt] = -100  # the prompt
    target[1, -1] = -100  # padding in one sequence
    ref_x = torch.randn(n, t, h, generator=gen).to(dtype)
    ref_w = (torch.randn(v, h, generator=gen) * 2.0 / h ** 0.5).to(dtype)
    return x, w, target, ref_x, ref_w, gen


def _logps64(x, w, target, temperature=1.0):
    z = (x.double() @ w.double().t()) / temperature
    lp = z.log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return torch.where(target != -100, lp, 0.0)


def _mean(lp, target):
    m = (target != -100).double()
    return (lp * m).sum(-1) / m.sum(-1).clamp(min=1)


# ------------------------------------------------------------------------------ the formulas are TRL's


def _trl_namespace(**kw):
    return SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), **kw)


def test_orpo_term_is_trls_odds_ratio_loss():
    ORPOTrainer = pytest.importorskip("trl.experimental.orpo.orpo_trainer").ORPOTrainer

    gen = seeded("orpo")
    c, r = -torch.rand(6, generator=gen, dtype=torch.float64) * 3, -torch.rand(6, generator=gen, dtype=torch.float64)
    c[0] = -1e-9  # near log p = 0, where log(1 − e^c) needs the expm1 branch
    want, *_ = ORPOTrainer.odds_ratio_loss(_trl_namespace(beta=0.3), c, r)
    assert torch.allclose(P.orpo_loss(c, r, 0.3).double(), want.double(), rtol=1e-6)


@pytest.mark.parametrize("loss_type", P.CPO_LOSS_TYPES)
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_cpo_and_simpo_are_trls_cpo_loss(loss_type, alpha):
    CPOTrainer = pytest.importorskip("trl.experimental.cpo.cpo_trainer").CPOTrainer

    gen = seeded("cpo", loss_type, alpha)
    c, r = -torch.rand(5, generator=gen, dtype=torch.float64) * 4, -torch.rand(5, generator=gen, dtype=torch.float64) * 4
    self = _trl_namespace(alpha=alpha, loss_type=loss_type, simpo_gamma=0.7, beta=0.4, label_smoothing=0.1)
    want, *_ = CPOTrainer.cpo_loss(self, c, r)
    got = P.cpo_loss(c, r, 0.4, loss_type, 0.1, 0.7, alpha)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ fused losses against float64

def _case(name, n, t, ref_x, ref_w, gen):
    """(function, kwargs, float64 loss of per-token log-probabilities) for one loss configuration."""
    pairs = n // 2
    desirable = torch.rand(n, generator=gen) > 0.4
    adv = torch.randn(n, generator=gen)
    old = -torch.rand(n, t, generator=gen) * 4
    refp = -torch.rand(n, t, generator=gen) * 4

    def ref_sums(target):
        return _logps64(ref_x, ref_w, target).sum(-1)

    if name.startswith("dpo"):
        loss_type = name.split("-")[1]
        eps = 0.2 if loss_type in ("sigmoid", "robust") else 0.0

        def want(lp, target):
            s, rs, lengths = lp.sum(-1), ref_sums(target), (target != -100).sum(-1).double()
            return P.dpo_loss(s[:pairs], s[pairs:], rs[:pairs], rs[pairs:], 0.3, loss_type, eps, lengths[:pairs],
                              lengths[pairs:]).mean()
        return F.fused_linear_dpo, dict(ref_x=ref_x, ref_lm_head_weight=ref_w, beta=0.3, loss_type=loss_type,
                                        label_smoothing=eps), want
    if name == "orpo":
        def want(lp, target):
            m = _mean(lp, target)
            nll = -lp[:pairs].sum() / (target[:pairs] != -100).sum()
            return nll - P.orpo_loss(m[:pairs], m[pairs:], 0.2).double().mean()
        return F.fused_linear_orpo, dict(beta=0.2), want
    if name.startswith("cpo") or name == "simpo":
        loss_type = "simpo" if name == "simpo" else name.split("-")[1]
        alpha = 0.0 if name == "simpo" else 1.0

        def want(lp, target):
            seq = _mean(lp, target) if loss_type in ("ipo", "simpo") else lp.sum(-1)
            nll = -lp[:pairs].sum() / (target[:pairs] != -100).sum()
            return P.cpo_loss(seq[:pairs], seq[pairs:], 2.0, loss_type, 0.0, 0.5).mean() + alpha * nll
        fn = F.fused_linear_simpo if name == "simpo" else F.fused_linear_cpo
        kw = dict(beta=2.0) if name == "simpo" else dict(beta=2.0, loss_type=loss_type)
        return fn, kw, want
    if name == "kto":
        def want(lp, target):
            return P.kto_loss(lp.sum(-1), ref_sums(target), desirable, 0.05, 0.3, 1.0, 1.3).mean()
        return F.fused_linear_kto, dict(desirable=desirable, ref_x=ref_x, ref_lm_head_weight=ref_w, kl=0.05, beta=0.3,
                                        undesirable_weight=1.3), want
    loss_type, level = name.split("-")[1:]
    beta = 0.04 if loss_type in ("grpo", "dr_grpo") else 0.0
    kw = dict(advantages=adv, old_per_token_logps=old if loss_type != "dapo" else None,
              ref_per_token_logps=refp if beta else None, beta=beta, epsilon_high=0.28, loss_type=loss_type,
              importance_sampling_level=level, max_completion_length=t + 2 if loss_type == "dr_grpo" else None)

    def want(lp, target):
        mask = (target != -100).double()
        return P.grpo_loss(lp, None if kw["old_per_token_logps"] is None else old.double(),
                           refp.double() if beta else None, adv.double(), mask, beta, 0.2, 0.28, loss_type, level,
                           None, kw["max_completion_length"])
    return F.fused_linear_grpo, kw, want


CASES = ["dpo-sigmoid", "dpo-hinge", "dpo-ipo", "dpo-robust", "orpo", "cpo-sigmoid", "cpo-ipo", "simpo", "kto",
         "grpo-grpo-token", "grpo-bnpo-sequence", "grpo-dr_grpo-token", "grpo-dapo-token", "grpo-cispo-token"]


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_fused_losses_and_gradients_match_float64(interpret, dtype, name, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    n, t, h, v = 4, 6, 16, 40
    x, w, target, ref_x, ref_w, gen = _batch(n, t, h, v, dtype, ("fused", name))
    fn, kw, want = _case(name, n, t, ref_x, ref_w, gen)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref_loss = want(_logps64(x64, w64, target), target)
    ref_grads = torch.autograd.grad(ref_loss, (x64, w64))
    for sequence_bytes in (P.SEQUENCE_CHUNK_BYTES, 1, 0):  # every group in one chunk, one group per chunk, formula
        if sequence_bytes == 1:
            per_row = v * x.element_size() * t * (2 if name.startswith(("dpo", "orpo", "cpo", "simpo")) else 1)
            sequence_bytes = per_row  # exactly one group per chunk
        monkeypatch.setattr(P, "SEQUENCE_CHUNK_BYTES", sequence_bytes)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xs, ws, target, **kw)
        assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
        grads = torch.autograd.grad(out.loss * 1.5, (xs, ws))  # a non-unit upstream gradient
        loss_tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert abs(float(out.loss) - float(ref_loss)) <= loss_tol * max(1.0, abs(float(ref_loss))), sequence_bytes
        for got, ref in zip(grads, ref_grads):
            assert rel_l2(got.double(), 1.5 * ref) < REL_TOL[dtype], (sequence_bytes, rel_l2(got.double(), 1.5 * ref))
        assert grads[0].dtype == dtype and grads[1].dtype == dtype


def test_the_fused_path_runs_three_gemms_per_token_and_the_formula_path_four(monkeypatch):
    """Eager training calls compute each chunk's logits once (gradients in the forward); the fallback
    recomputes them in the backward."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from liger_gen.ops.lm_head import selective_log_softmax as S

    calls = []
    original = S.Chunks.logits
    monkeypatch.setattr(S.Chunks, "logits", lambda self, xc, out: calls.append(xc.shape[0]) or original(self, xc, out))
    x, w, target, *_ = _batch(4, 6, 16, 40, torch.float32, ("count",))
    x.requires_grad_()
    F.fused_linear_orpo(x, w, target).loss.backward()
    assert sum(calls) == 24  # every row's logits once
    calls.clear()
    monkeypatch.setattr(P, "SEQUENCE_CHUNK_BYTES", 0)
    F.fused_linear_orpo(x, w, target).loss.backward()
    assert sum(calls) == 48  # forward and recomputed in the backward


def test_rewards_and_logps_are_trls_definitions():
    x, w, target, ref_x, ref_w, _ = _batch(4, 6, 16, 40, torch.float32, ("rewards",))
    out = F.fused_linear_dpo(x, w, target, ref_x, ref_w, beta=0.25)
    lp, rlp = _logps64(x, w, target).sum(-1), _logps64(ref_x, ref_w, target).sum(-1)
    assert torch.allclose(out.chosen_logps.double(), lp[:2], rtol=1e-5)
    assert torch.allclose(out.rejected_rewards.double(), 0.25 * (lp[2:] - rlp[2:]), rtol=1e-4, atol=1e-6)
    given = F.fused_linear_dpo(x, w, target, ref_log_probs=rlp.float(), beta=0.25)
    assert torch.allclose(given.loss, out.loss, rtol=1e-6)
    orpo = F.fused_linear_orpo(x, w, target, beta=0.5)
    assert torch.allclose(orpo.chosen_logps.double(), _mean(_logps64(x, w, target), target)[:2], rtol=1e-5)


def test_no_gradient_and_all_masked_sequences():
    x, w, target, ref_x, ref_w, _ = _batch(4, 6, 16, 40, torch.float32, ("masked",))
    target[0] = -100  # a chosen completion with no token
    target[2] = -100  # its rejected one too: Δ = 0
    x.requires_grad_()
    with torch.no_grad():
        quiet = F.fused_linear_dpo(x, w, target, ref_x, ref_w)
    loud = F.fused_linear_dpo(x, w, target, ref_x, ref_w)
    assert torch.allclose(quiet.loss, loud.loss) and not quiet.loss.requires_grad
    lp = _logps64(x, w, target).sum(-1)
    rlp = _logps64(ref_x, ref_w, target).sum(-1)
    other = -torch.nn.functional.logsigmoid(0.1 * ((lp[1] - rlp[1]) - (lp[3] - rlp[3])))
    assert math.isclose(float(loud.loss), (math.log(2) + float(other)) / 2, rel_tol=1e-5)
    ipo = F.fused_linear_dpo(x, w, target, ref_x, ref_w, loss_type="ipo")
    assert torch.isfinite(ipo.loss)
    target[0] = -100  # a chosen completion with no token
    for out in (F.fused_linear_orpo(x, w, target), F.fused_linear_simpo(x, w, target)):
        assert torch.isnan(out.loss)  # TRL's per-token mean of an empty completion is 0/0 too
    assert torch.isfinite(F.fused_linear_cpo(x, w, target, cpo_alpha=0.0).loss)  # sums: an empty one is 0


def test_a_second_backward_is_refused():
    x, w, target, *_ = _batch(4, 6, 16, 40, torch.float32, ("twice",))
    w.requires_grad_()
    loss = F.fused_linear_simpo(x, w, target).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time"):
        loss.backward()


def test_under_torch_compile_the_loss_and_gradients_are_eagers():
    x, w, target, ref_x, ref_w, _ = _batch(4, 6, 16, 40, torch.float32, ("compile",))
    w.requires_grad_()

    def step(w):
        return F.fused_linear_dpo(x, w, target, ref_x, ref_w).loss

    eager = step(w)
    (g_eager,) = torch.autograd.grad(eager, w)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(w)
    (g_compiled,) = torch.autograd.grad(compiled, w)
    assert torch.allclose(compiled, eager, rtol=1e-6) and rel_l2(g_compiled, g_eager) < 1e-6


def test_per_token_statistics_under_torch_compile_are_eagers():
    """The losses that read per-token statistics (DPO's WPO weights: log Σp²; GRPO's entropy selection and
    bonus: the entropy with its gradient) trace without a graph break and give eager's loss and gradient."""
    x, w, target, _, _, gen = _batch(4, 6, 16, 40, torch.float32, ("compile-stats",))
    w.requires_grad_()
    ref, adv = -torch.rand(4, generator=gen) * 10, torch.randn(4, generator=gen)

    def step(w):
        dpo = F.fused_linear_dpo(x, w, target, ref_log_probs=ref, use_weighting=True,
                                 f_divergence_type="js_divergence").loss
        return dpo + F.fused_linear_grpo(x, w, target, adv, top_entropy_quantile=0.4, entropy_coef=0.05).loss

    eager = step(w)
    (g_eager,) = torch.autograd.grad(eager, w)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(w)
    (g_compiled,) = torch.autograd.grad(compiled, w)
    assert torch.allclose(compiled, eager, rtol=1e-6) and rel_l2(g_compiled, g_eager) < 1e-6


@pytest.mark.parametrize("loss_type,level,beta,old", [("grpo", "token", 0.04, True), ("bnpo", "sequence", 0.0, True),
                                                      ("dr_grpo", "token", 0.04, False), ("dapo", "token", 0.0, True),
                                                      ("cispo", "token", 0.0, True)])
def test_grpo_equals_grpo_trainers_compute_loss(loss_type, level, beta, old):
    """TRL's own ``GRPOTrainer._compute_loss`` (one process, no accumulation), handed float64 per-token
    log-probabilities of the same hidden states, gives our fused loss and gradient."""
    from collections import defaultdict

    trl = pytest.importorskip("trl")
    n, t, h, v = 4, 6, 16, 40
    x, w, target, _, _, gen = _batch(n, t, h, v, torch.float32, ("grpo-trl", loss_type, level), prompt=0)
    mask = (target != -100).long()
    adv = torch.randn(n, generator=gen)
    olds = -torch.rand(n, t, generator=gen) * 4 if old else None
    refp = -torch.rand(n, t, generator=gen) * 4
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    w64 = w.double().requires_grad_()

    class Accelerator:
        num_processes = 1
        sync_gradients = True

        def gather(self, value, **_):
            return value

        gather_for_metrics = reduce = gather

    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=Accelerator(), beta=beta, epsilon_low=0.2,
        epsilon_high=eps_high, loss_type=loss_type, importance_sampling_level=level, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, max_completion_length=t + 1, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (_logps64(x, w64, target),
                                                              torch.zeros(n, t, dtype=torch.float64), None))
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": target.clamp(min=0), "completion_mask": mask, "advantages": adv.double(),
              "ref_per_token_logps": refp.double(), "num_items_in_batch": mask.sum().double()}
    if old:
        inputs["old_per_token_logps"] = olds.double()
    want = trl.GRPOTrainer._compute_loss(trainer, None, inputs)
    (want_grad,) = torch.autograd.grad(want, w64)
    ws = w.clone().requires_grad_()
    ours = F.fused_linear_grpo(x, ws, target, adv, mask, olds, refp if beta else None, beta=beta,
                               epsilon_high=eps_high, loss_type=loss_type, importance_sampling_level=level,
                               max_completion_length=t + 1)
    (grad,) = torch.autograd.grad(ours.loss, ws)
    assert math.isclose(float(ours.loss), float(want), rel_tol=1e-5, abs_tol=1e-7)
    assert rel_l2(grad.double(), want_grad) < 1e-5


def test_kto_equals_kto_trainers_compute_loss():
    """TRL's own ``KTOTrainer._compute_loss`` (precomputed reference log-probabilities, the KL batch's), handed
    float64 per-token log-probabilities of the same hidden states, gives our loss and gradient."""
    from collections import defaultdict

    trl = pytest.importorskip("trl")
    n, length, h, v = 6, 9, 16, 40
    gen = seeded("kto-trl")
    ids = torch.randint(0, v, (n, length), generator=gen)
    completion = torch.ones(n, length, dtype=torch.long)
    completion[:, :3] = 0  # the prompt
    completion[2, -2:] = 0  # padding
    target = ids.masked_fill(completion == 0, -100)[:, 1:]
    x = torch.randn(n, length - 1, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * 0.5
    desirable = torch.tensor([True, False, True, True, False, False])
    ref_logps, kl_logps, ref_kl_logps = (-torch.rand(n, generator=gen, dtype=torch.float64) * 20 for _ in range(3))
    w64 = w.double().requires_grad_()

    class Accelerator:
        device = torch.device("cpu")

        def gather_for_metrics(self, value, **_):
            return value

    logps = _logps64(x, w64, target)
    model = lambda **kw: SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps),  # noqa: E731
                                         mean_logits=torch.zeros_like(logps))
    trainer = SimpleNamespace(model=SimpleNamespace(training=False), accelerator=Accelerator(), beta=0.3,
                              loss_type="kto", desirable_weight=1.0, undesirable_weight=1.4,
                              precompute_ref_logps=True, calculate_KL=True, aux_loss_enabled=False,
                              _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
                              _compute_kl_logps=lambda model, batch: kl_logps)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion,
             "label": desirable, "ref_logps": ref_logps, "ref_KL_logps": ref_kl_logps}
    want = trl.KTOTrainer._compute_loss(trainer, model, batch, False)
    want = want[0] if isinstance(want, tuple) else want
    (want_grad,) = torch.autograd.grad(want, w64)
    kl = (kl_logps - ref_kl_logps).mean().clamp(min=0)
    ws = w.clone().requires_grad_()
    ours = F.fused_linear_kto(x, ws, target, desirable, ref_log_probs=ref_logps.float(), kl=kl.float(), beta=0.3,
                              undesirable_weight=1.4)
    (grad,) = torch.autograd.grad(ours.loss, ws)
    assert math.isclose(float(ours.loss), float(want), rel_tol=1e-5, abs_tol=1e-7)
    assert rel_l2(grad.double(), want_grad) < 1e-5


# ------------------------------------------------------------------------------ DPO against DPOTrainer



@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_fused_dpo_trains_as_dpo_trainers_loss(loss_type, corpus, tmp_path, monkeypatch):
    """Three AdamW steps on TRL's DPOTrainer batches (its collator, its reference model): one copy of a tiny
    Llama trained on TRL's ``compute_loss``, one on ``fused_linear_dpo`` of its last hidden states; the losses
    and every parameter's gradient agree at each step."""
    import copy

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    trl = pytest.importorskip("trl")
    from test_trl import _model, _preference_data

    tokenizer, _ = corpus
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                         max_length=64, dataloader_num_workers=0, disable_tqdm=True, loss_type=loss_type,
                         bf16=False, beta=0.2, seed=0)
    policy, reference = _model(len(tokenizer)), _model(len(tokenizer))
    torch.manual_seed(1)
    for p in reference.parameters():  # a reference unlike the policy: non-zero log-ratios
        p.data.add_(torch.randn_like(p) * 0.02)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=_preference_data(corpus),
                             processing_class=tokenizer)
    ours_model = copy.deepcopy(policy)
    theirs_opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-3)
    policy.train(), ours_model.train()
    losses = []
    for step, batch in zip(range(3), trainer.get_train_dataloader()):
        theirs = trainer.compute_loss(policy, batch)
        theirs.backward()

        ids, completion, mask = batch["input_ids"], batch["completion_mask"], batch["attention_mask"]
        target = ids.masked_fill(completion == 0, -100)[:, 1:]
        x = ours_model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        with torch.no_grad():
            ref_x = reference.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        ours = F.fused_linear_dpo(x, ours_model.lm_head.weight, target, ref_x, reference.lm_head.weight, beta=0.2,
                                  loss_type=loss_type)
        ours.loss.backward()
        assert math.isclose(float(ours.loss), float(theirs), rel_tol=1e-5, abs_tol=1e-7), step
        for (k, p), q in zip(policy.named_parameters(), ours_model.parameters()):
            assert rel_l2(q.grad, p.grad) < 1e-4, (step, k)
        losses.append(float(theirs))
        for opt in (theirs_opt, ours_opt):
            opt.step()
            opt.zero_grad()
    assert len(losses) == 3 and losses[-1] != losses[0]  # the parameters moved between steps


# ------------------------------------------------------------------------------ bad inputs

def test_bad_inputs_name_the_tensor():
    x, w, target, ref_x, ref_w, _ = _batch(4, 6, 16, 40, torch.float32, ("bad",))
    with pytest.raises(ValueError, match="chosen and rejected batch sizes differ"):
        F.fused_linear_dpo(x[:3], w, target[:3], ref_x[:3], ref_w)
    with pytest.raises(ValueError, match="exactly one of ref_x"):
        F.fused_linear_dpo(x, w, target)
    with pytest.raises(ValueError, match="exactly one of ref_x"):
        F.fused_linear_dpo(x, w, target, ref_x, ref_w, ref_log_probs=torch.zeros(4))
    with pytest.raises(ValueError, match=r"ref_lm_head_weight.*\(41, 16\)"):
        F.fused_linear_dpo(x, w, target, ref_x, torch.zeros(41, 16))
    with pytest.raises(ValueError, match=r"ref_log_probs must be \(4,\)"):
        F.fused_linear_dpo(x, w, target, ref_log_probs=torch.zeros(2))
    with pytest.raises(ValueError, match="x must be \\(sequences, tokens, hidden\\)"):
        F.fused_linear_orpo(x[0], w, target[0])
    with pytest.raises(ValueError, match="loss_type must be one of"):
        F.fused_linear_dpo(x, w, target, ref_x, ref_w, loss_type="sigmoidal")
    with pytest.raises(ValueError, match="beta must be > 0"):
        F.fused_linear_dpo(x, w, target, ref_x, ref_w, beta=0.0)
    with pytest.raises(ValueError, match="robust"):
        F.fused_linear_dpo(x, w, target, ref_x, ref_w, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"desirable must be \(4,\) bool"):
        F.fused_linear_kto(x, w, target, torch.ones(4), ref_x, ref_w)
    with pytest.raises(ValueError, match="needs ref_per_token_logps"):
        F.fused_linear_grpo(x, w, target, torch.zeros(4), beta=0.1)
    with pytest.raises(ValueError, match=r"advantages must be \(4,\) or \(4, 6\)"):
        F.fused_linear_grpo(x, w, target, torch.zeros(3))
    with pytest.raises(ValueError, match=r"nll_target must be \(2, 6\)"):
        F.fused_linear_orpo(x, w, target, nll_target=target)
    with pytest.raises(ValueError, match="temperature"):
        F.fused_linear_grpo(x, w, target, torch.zeros(4), temperature=0.0)
    with pytest.raises(TypeError, match="target must be int64 or int32"):
        F.fused_linear_simpo(x, w, target.float())


def test_bench_losses_runs_every_loss_on_the_cpu_and_agrees_with_eager(tmp_path):
    """``liger-gen bench-losses --device cpu``: every loss, liger-gen's loss and gradients against torch eager's
    (fp32 on the CPU's plain path), the JSON written; an unknown loss is a usage error."""
    import json

    from click.testing import CliRunner

    from liger_gen.cli import main

    # 8 tokens a sequence (the first, an eighth, is the ignored prompt): the interpreter's time goes with the rows
    args = ["bench-losses", "--device", "cpu", "--hidden", "32", "--vocab", "96", "--batch", "2", "--seq", "8",
            "--providers", "torch-eager,liger-gen,liger-gen-logps", "--iters", "1", "--warmup", "1",
            "--out", str(tmp_path)]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    rows = json.loads((tmp_path / "bench_losses.json").read_text())["rows"]
    assert {r["loss"] for r in rows} == {"dpo", "orpo", "cpo", "simpo", "kto", "grpo", "jsd"}
    ours = [r for r in rows if r["provider"].startswith("liger-gen")]
    assert len(ours) == 8  # one per loss, and DPO on selective_log_softmax
    for r in ours:
        assert r["rel_loss"] < 1e-5 and r["rel_dx"] < 1e-5 and r["rel_dw"] < 1e-5, r
    bad = CliRunner().invoke(main, args[:-2] + ["--losses", "dpo,ppo", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "ppo" in bad.output
    empty = CliRunner().invoke(main, args[:-2] + ["--losses", ",", "--out", str(tmp_path)])
    assert empty.exit_code == 2 and "at least one loss" in empty.output


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_no_host_synchronisation_on_cuda(name):
    """Forward and backward of every fused loss (and the JSD) with CUDA's sync debug mode set to error."""
    n, t, h, v = 4, 64, 64, 512
    x, w, target, ref_x, ref_w, gen = _batch(n, t, h, v, torch.bfloat16, ("sync", name))
    fn, kw, _ = _case(name, n, t, ref_x, ref_w, gen)
    cuda = {k: a.cuda() if isinstance(a, torch.Tensor) else a for k, a in kw.items()}
    x, w, target = x.cuda().requires_grad_(), w.cuda().requires_grad_(), target.cuda()
    teacher_x, teacher_w = ref_x.cuda().flatten(0, 1), ref_w.cuda()

    def step():
        fn(x, w, target, **cuda).loss.backward()
        F.fused_linear_jsd(x.flatten(0, 1), w, teacher_x, teacher_w, target.flatten()).backward()

    step()  # the first call builds kernels and reads tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_formula_options_are_checked_and_data_gets_no_gradient():
    """The public formulas validate their options as the fused losses do; GRPO's old and reference
    log-probabilities and advantages are data on both ways of running (no gradient, as TRL computes them)."""
    lp = -torch.rand(3, 4, dtype=torch.float64) * 3
    adv, mask = torch.randn(3, dtype=torch.float64), torch.ones(3, 4)
    with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
        P.grpo_loss(lp, lp, None, adv, mask, importance_sampling_level="seq")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        P.grpo_loss(lp, None, None, adv, mask, loss_type="foo")
    with pytest.raises(ValueError, match=r"epsilon_low must be in \[0, 1\)"):
        P.grpo_loss(lp, lp, None, adv, mask, epsilon_low=5.0)
    with pytest.raises(ValueError, match="needs ref_per_token_logps"):
        P.grpo_loss(lp, None, None, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length must be a positive int"):
        P.grpo_normalise(lp, mask, "dr_grpo", max_completion_length=True)
    with pytest.raises(ValueError, match="num_items_in_batch must be a number"):
        P.grpo_normalise(lp, mask, "dapo", num_items_in_batch="a")
    x, w, target, *_ = _batch(4, 6, 16, 40, torch.float32, ("data",))
    for chunk_bytes in (P.SEQUENCE_CHUNK_BYTES, 0):
        P_bytes, P.SEQUENCE_CHUNK_BYTES = P.SEQUENCE_CHUNK_BYTES, chunk_bytes
        try:
            data = [torch.randn(4, requires_grad=True), -torch.rand(4, 6).requires_grad_(),
                    -torch.rand(4, 6).requires_grad_()]
            out = F.fused_linear_grpo(x.clone().requires_grad_(), w, target, data[0], None, data[1], data[2],
                                      beta=0.1)
            out.loss.backward()
            assert all(d.grad is None for d in data), chunk_bytes
        finally:
            P.SEQUENCE_CHUNK_BYTES = P_bytes


def test_float64_keeps_float64_and_double_backward_is_refused_on_the_fused_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # float64 runs on the plain path only
    x, w, target, ref_x, ref_w, _ = _batch(4, 6, 16, 40, torch.float32, ("f64",))
    out = F.fused_linear_orpo(x.double(), w.double(), target)
    assert out.loss.dtype == torch.float64
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = _logps64(x64, w64, target)
    m = _mean(want, target)
    ref = -want[:2].sum() / (target[:2] != -100).sum() - P.orpo_loss(m[:2], m[2:]).mean()
    assert torch.allclose(out.loss, ref, rtol=1e-12)
    xs = x.clone().requires_grad_()
    loss = F.fused_linear_dpo(xs, w, target, ref_x, ref_w).loss
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, xs, create_graph=True)


def test_reference_and_nll_target_errors_name_their_tensors():
    x, w, target, ref_x, ref_w, _ = _batch(4, 6, 16, 40, torch.float32, ("ref-bad",))
    with pytest.raises(ValueError, match=r"ref_lm_head_weight must be \(vocab, 16\) for ref_x's hidden size"):
        F.fused_linear_dpo(x, w, target, ref_x, ref_w[:, :8])
    with pytest.raises(TypeError, match="ref_lm_head_weight must have ref_x's dtype"):
        F.fused_linear_dpo(x, w, target, ref_x, ref_w.double())
    with pytest.raises(ValueError, match="leave them None"):
        F.fused_linear_dpo(x, w, target, ref_log_probs=torch.zeros(4), ref_bias=torch.zeros(40))
    bad = target.clone()
    bad[0, 3] = 40
    with pytest.raises(ValueError, match="fused_linear_kto: target of shape .* holds class indices outside"):
        F.fused_linear_kto(x, w, bad, torch.ones(4, dtype=torch.bool), ref_x, ref_w)
    nll = target[:2].clone()
    nll[0, 0] = 7  # a prompt position: fine, the NLL covers it
    F.fused_linear_orpo(x, w, target, nll_target=nll)
    nll[0, 4] = (target[0, 4] + 1) % 40  # a completion position with another token
    with pytest.raises(ValueError, match="nll_target must hold target's token"):
        F.fused_linear_orpo(x, w, target, nll_target=nll)
    nll = target[:2].clone()
    nll[1, 0] = 99
    with pytest.raises(ValueError, match="fused_linear_orpo: target of shape .* holds class indices outside"):
        F.fused_linear_orpo(x, w, target, nll_target=nll)
