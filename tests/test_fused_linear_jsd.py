"""fused_linear_jsd / fused_linear_kl_div: distillation divergences from hidden states and two LM heads, against
float64 and TRL's ``GKDTrainer.generalized_jsd_loss``, on both CPU paths; chunking, options, bad inputs. The
contract every op keeps (compile, opcheck, zero rows, strides, double backward) is in test_contract.py."""

from __future__ import annotations

import math

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.ops.lm_head import fused_linear_jsd as J

from conftest import CPU_PATHS, lm_head_tol, seeded

F = liger_gen.functional
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rows, hidden, teacher_hidden, vocab, dtype, key, ignored=True):
    gen = seeded(*key, rows, hidden, teacher_hidden, vocab, str(dtype))
    xs = torch.randn(rows, hidden, generator=gen).to(dtype)
    ws = (torch.randn(vocab, hidden, generator=gen) * 2.0 / hidden ** 0.5).to(dtype)
    xt = torch.randn(rows, teacher_hidden, generator=gen).to(dtype)
    wt = (torch.randn(vocab, teacher_hidden, generator=gen) * 2.5 / teacher_hidden ** 0.5).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    if ignored:
        target[torch.rand(rows, generator=gen) < 0.2] = -100
    return xs, ws, xt, wt, target


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_and_student_gradients_match_float64(interpret, dtype, beta, temperature, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    xs, ws, xt, wt, target = _inputs(13, 24, 40, 70, dtype, ("match", beta, temperature))
    xs.requires_grad_(), ws.requires_grad_()
    loss = F.fused_linear_jsd(xs, ws, xt, wt, target, beta=beta, temperature=temperature)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    gx, gw = torch.autograd.grad(loss * 0.75, (xs, ws))  # a non-unit upstream gradient
    want, dx, dw = J.fused_linear_jsd_float64(xs, ws, xt, wt, target, beta, temperature)
    assert abs(float(loss) - float(want)) <= lm_head_tol(dtype) * max(float(want), 1e-3)
    assert rel_l2(gx, 0.75 * dx) < REL_TOL[dtype] and rel_l2(gw, 0.75 * dw) < REL_TOL[dtype]
    assert gx.dtype == gw.dtype == dtype
    ignored = target == -100
    assert ignored.any() and torch.count_nonzero(gx[ignored]) == 0  # ignored tokens get no gradient


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equals_trls_generalized_jsd_loss(beta):
    """TRL's GKD loss on the full float64 logits (its ``batchmean`` per token, labels masking) is ours."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    xs, ws, xt, wt, target = _inputs(2 * 9, 16, 16, 50, torch.float64, ("trl", beta))
    shape = (2, 9)
    zs = (xs @ ws.t()).view(*shape, -1)
    zt = (xt @ wt.t()).view(*shape, -1)
    want = gkd.GKDTrainer.generalized_jsd_loss(zs, zt, target.view(shape), beta=beta, temperature=1.4)
    got = F.fused_linear_jsd(xs.float().view(*shape, -1), ws.float(), xt.float().view(*shape, -1), wt.float(),
                             target.view(shape), beta=beta, temperature=1.4)
    assert math.isclose(float(got), float(want), rel_tol=1e-5)


def _trl_gkd_loss(xs, ws, xt, wt, labels, beta, temperature):
    """TRL's own ``generalized_jsd_loss(reduction="batchmean")`` on the full float64 logits of (..., H) inputs:
    (loss, d loss / d xs, d loss / d ws) by autograd."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    x64 = xs.detach().double().requires_grad_()
    w64 = ws.detach().double().requires_grad_()
    zt = xt.double() @ wt.double().t()
    loss = gkd.GKDTrainer.generalized_jsd_loss(x64 @ w64.t(), zt, labels, beta=beta, temperature=temperature,
                                               reduction="batchmean")
    return (loss.detach(), *torch.autograd.grad(loss, (x64, w64)))


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("lead", [(3, 5), (2, 2, 4), (15,)], ids=["BxS", "AxBxS", "N"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("with_target", [False, True], ids=["no_target", "target"])
def test_batchmean_is_trls_generalized_jsd_loss(interpret, lead, beta, with_target, monkeypatch):
    """reduction="batchmean" is TRL's normalisation: without labels TRL divides the sum by the logits' first dim
    (the sequences of (B, S, V) logits, not their B·S tokens), with labels by the labelled tokens. Loss and the
    student's gradients against TRL's own function on float64 logits: exact on the plain float64 path, to
    float32 rounding on both kernel paths."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    rows = math.prod(lead)
    xs, ws, xt, wt, target = _inputs(rows, 16, 24, 50, torch.float64, ("batchmean", lead, beta, with_target))
    x3, xt3, t3 = xs.view(*lead, -1), xt.view(*lead, -1), target.view(lead)
    labels = t3 if with_target else None
    want, want_dx, want_dw = _trl_gkd_loss(x3, ws, xt3, wt, labels, beta, 1.3)
    cases = [(torch.float64, 1e-12, 1e-10)] if interpret == "0" else []
    cases.append((torch.float32, 1e-5, REL_TOL[torch.float32]))
    for dtype, loss_tol, grad_tol in cases:
        x = x3.to(dtype).requires_grad_()
        w = ws.to(dtype).requires_grad_()
        got = F.fused_linear_jsd(x, w, xt3.to(dtype), wt.to(dtype), labels, beta=beta, temperature=1.3,
                                 reduction="batchmean")
        gx, gw = torch.autograd.grad(got, (x, w))
        assert math.isclose(float(got), float(want), rel_tol=loss_tol), dtype
        assert rel_l2(gx, want_dx) < grad_tol and rel_l2(gw, want_dw) < grad_tol, dtype
    token_mean = F.fused_linear_jsd(x3.float(), ws.float(), xt3.float(), wt.float(), labels, beta=beta,
                                    temperature=1.3)
    # the default stays the mean over (valid) tokens: TRL's only without a target or with (N, H) rows
    factor = 1 if with_target or len(lead) == 1 else rows / lead[0]
    assert math.isclose(float(token_mean) * factor, float(want), rel_tol=1e-5)


def test_kl_div_takes_the_reduction_and_bad_ones_are_refused():
    xs, ws, xt, wt, _ = _inputs(2 * 6, 16, 16, 40, torch.float32, ("kl batchmean",), ignored=False)
    x3, xt3 = xs.view(2, 6, -1), xt.view(2, 6, -1)
    for reverse, beta in ((False, 0.0), (True, 1.0)):
        got = F.fused_linear_kl_div(x3, ws, xt3, wt, reverse=reverse, reduction="batchmean")
        assert float(got) == float(F.fused_linear_jsd(x3, ws, xt3, wt, beta=beta, reduction="batchmean"))
        assert math.isclose(float(got), 6 * float(F.fused_linear_kl_div(x3, ws, xt3, wt, reverse=reverse)),
                            rel_tol=1e-6)
    for bad in ("mean", "sum", None, 1):
        with pytest.raises((ValueError, TypeError), match=r"reduction must be one of \('token_mean', 'batchmean'\)"):
            F.fused_linear_jsd(x3, ws, xt3, wt, reduction=bad)


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_chunks_give_the_one_chunk_result(interpret, monkeypatch):
    """Forcing 16-row chunks (three of them, the last partial) changes nothing but the summation order."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    xs, ws, xt, wt, target = _inputs(37, 16, 16, 60, torch.float32, ("chunks",))
    xs.requires_grad_(), ws.requires_grad_()
    whole = F.fused_linear_jsd(xs, ws, xt, wt, target)
    g_whole = torch.autograd.grad(whole, (xs, ws))
    monkeypatch.setattr(J.FusedLinearJSDSpace, "MAX_EXTRA_BYTES", 1)
    run = J._Distill(xs, ws, xt, wt, target, 0.5, 1.0, -100)
    assert run.chunk == 16
    parts = F.fused_linear_jsd(xs, ws, xt, wt, target)
    g_parts = torch.autograd.grad(parts, (xs, ws))
    assert math.isclose(float(parts), float(whole), rel_tol=1e-6)
    for a, b in zip(g_parts, g_whole):
        assert rel_l2(a, b) < 1e-6


def test_kl_div_is_the_jsd_endpoints_and_pytorchs_kl_div():
    xs, ws, xt, wt, _ = _inputs(2 * 5, 16, 24, 40, torch.float32, ("kl",), ignored=False)
    forward = F.fused_linear_kl_div(xs.view(2, 5, -1), ws, xt.view(2, 5, -1), wt, temperature=2.0)
    s = torch.log_softmax((xs.double() @ ws.double().t()) / 2.0, -1)
    t = torch.log_softmax((xt.double() @ wt.double().t()) / 2.0, -1)
    want = torch.nn.functional.kl_div(s, t, reduction="sum", log_target=True) / 10
    assert math.isclose(float(forward), float(want), rel_tol=1e-5)
    reverse = F.fused_linear_kl_div(xs, ws, xt, wt, reverse=True, temperature=2.0)
    want_r = torch.nn.functional.kl_div(t, s, reduction="sum", log_target=True) / 10
    assert math.isclose(float(reverse), float(want_r), rel_tol=1e-5)
    assert float(reverse) == float(F.fused_linear_jsd(xs, ws, xt, wt, beta=1.0, temperature=2.0))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_all_ignored_tokens_give_zero(interpret, monkeypatch):
    """The sum over no token divided by max(0, 1): 0, and zero gradients (TRL's 0/0 would be NaN)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    xs, ws, xt, wt, target = _inputs(6, 16, 16, 40, torch.float32, ("ignored",))
    xs.requires_grad_()
    target[:] = -100
    zero = F.fused_linear_jsd(xs, ws, xt, wt, target)
    (g,) = torch.autograd.grad(zero, xs)
    assert float(zero) == 0.0 and torch.count_nonzero(g) == 0


def test_the_teacher_gets_no_gradient_and_no_grad_gives_the_same_loss():
    xs, ws, xt, wt, target = _inputs(8, 16, 16, 40, torch.float32, ("teacher",))
    xt.requires_grad_(), wt.requires_grad_(), ws.requires_grad_()
    loss = F.fused_linear_jsd(xs, ws, xt, wt, target)
    loss.backward()
    assert xt.grad is None and wt.grad is None and ws.grad is not None
    with torch.no_grad():
        assert float(F.fused_linear_jsd(xs, ws, xt, wt, target)) == float(loss)


def test_a_second_backward_is_refused():
    xs, ws, xt, wt, target = _inputs(8, 16, 16, 40, torch.float32, ("twice",))
    ws.requires_grad_()
    loss = F.fused_linear_jsd(xs, ws, xt, wt, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bad_inputs_name_the_tensor():
    xs, ws, xt, wt, target = _inputs(8, 16, 24, 40, torch.float32, ("bad",))
    with pytest.raises(ValueError, match=r"teacher's vocabulary.*\(41, 24\)"):
        F.fused_linear_jsd(xs, ws, xt, torch.zeros(41, 24))
    with pytest.raises(ValueError, match="temperature must be"):
        F.fused_linear_jsd(xs, ws, xt, wt, temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be"):
        F.fused_linear_kl_div(xs, ws, xt, wt, temperature=-1.0)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        F.fused_linear_jsd(xs, ws, xt, wt, beta=1.5)
    with pytest.raises(ValueError, match="teacher_x must have student_x's leading shape"):
        F.fused_linear_jsd(xs, ws, xt[:7], wt)
    with pytest.raises(ValueError, match=r"teacher_lm_head_weight must be \(vocab, 24\)"):
        F.fused_linear_jsd(xs, ws, xt, wt[:, :16])
    with pytest.raises(TypeError, match="teacher_x must have student_x's dtype"):
        F.fused_linear_jsd(xs, ws, xt.double(), wt.double())
    with pytest.raises(ValueError, match="target must have student_x's leading shape"):
        F.fused_linear_jsd(xs, ws, xt, wt, target[:3])
    with pytest.raises(TypeError, match="target must be int64 or int32"):
        F.fused_linear_jsd(xs, ws, xt, wt, target.float())
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        F.fused_linear_jsd(xs, ws, xt, wt, target, ignore_index=2**64)
    with pytest.raises(TypeError, match="reverse must be a bool"):
        F.fused_linear_kl_div(xs, ws, xt, wt, reverse=1)

def test_target_is_only_a_mask():
    """Token ids are not read as classes: any value other than ignore_index keeps the token."""
    xs, ws, xt, wt, target = _inputs(8, 16, 16, 40, torch.float32, ("mask",))
    other = torch.where(target == -100, -100, 12345)
    assert float(F.fused_linear_jsd(xs, ws, xt, wt, other)) == float(F.fused_linear_jsd(xs, ws, xt, wt, target))


@pytest.mark.parametrize("op", ["fused_linear_jsd", "selective_log_softmax"])
def test_the_tuning_problems_step_passes_the_gate_and_a_wrong_input_fails_it(op, device):
    """The tuner's view of the LM-head ops: one training step of a rendered variant (with a chunk plan other
    than the heuristic's) against the problem's float64 truth; a perturbed input must fail the check."""
    from liger_gen.codegen.build import load_variant
    from liger_gen.ops import get_spec

    spec = get_spec(op)
    problem = spec.problem(torch.float32, {"hidden": 24, "vocab": 70}, 40, device, seed=1)
    config = dict(problem.space.heuristic().to_dict(), CHUNK_ROWS=16)  # three chunks, the last partial
    assert not problem.space.violations(problem.space.config_cls.from_dict(config))
    module = load_variant(op, config)
    problem.launcher(module, "fwd")()
    assert problem.check(module, "fwd") is None
    first = next(k for k in problem.buffers if k.endswith("x"))
    problem.buffers[first][0, 0] += 1.0
    problem.launcher(module, "fwd")()
    assert problem.check(module, "fwd") is not None
