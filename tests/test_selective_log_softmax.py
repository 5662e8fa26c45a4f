"""selective_log_softmax: per-token log-probabilities (and entropy and the logged statistics) from hidden states
and the LM head, against float64, on both CPU paths; options, chunking, bad inputs. The contract every op
keeps (compile, opcheck, zero rows, strides, double backward) is in test_contract.py."""

from __future__ import annotations

import pytest
import torch

import liger_gen
from liger_gen.ops.lm_head import selective_log_softmax as S
from liger_gen.codegen.problems import REL_TOL, rel_l2

from conftest import CPU_PATHS, lm_head_tol, seeded

F = liger_gen.functional
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(rows, hidden, vocab, dtype, key, bias=False, ignored=(1,)):
    gen = seeded(*key, rows, hidden, vocab, str(dtype))
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * 2.0 / hidden ** 0.5).to(dtype)
    b = (torch.randn(vocab, generator=gen) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, vocab, (rows,), generator=gen)
    for i in ignored:
        if i < rows:
            t[i] = -100
    return x, w, b, t


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", [{}, {"temperature": 0.7}, {"softcap": 2.5, "logit_scale": 1.5, "temperature": 1.3},
                                  {"bias": True}], ids=["plain", "temperature", "softcap_scale", "bias"])
def test_log_probs_entropy_and_gradients_match_float64(interpret, dtype, opts, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    opts = dict(opts)
    x, w, b, t = _inputs(9, 24, 70, dtype, ("match", str(opts)), bias=opts.pop("bias", False))
    leaves = [x.requires_grad_(), w.requires_grad_()] + ([b.requires_grad_()] if b is not None else [])
    logp, ent = F.selective_log_softmax(x, w, t, b, return_entropy=True, **opts)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == t.shape
    gen = seeded("upstream", str(opts))
    g1, g2 = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    grads = torch.autograd.grad((logp * g1).sum() + (ent * g2).sum(), leaves)
    options = S.LogProbOptions(-100, opts.get("temperature", 1.0), opts.get("softcap"), opts.get("logit_scale", 1.0))
    ref = S.selective_log_softmax_float64(x, w, t, b, options, g1, g2)
    tol = lm_head_tol(dtype)
    assert rel_l2(logp, ref[0]) < tol and rel_l2(ent, ref[1]) < tol
    for got, want in zip(grads, ref[2:]):
        assert rel_l2(got, want) < REL_TOL[dtype]
    assert logp[1] == 0 and ent[1] == 0  # the ignored token
    assert torch.count_nonzero(grads[0][1]) == 0


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_the_logged_statistics_match_their_definitions(interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    x, w, _, t = _inputs(11, 16, 37, torch.float32, ("stats",))
    t[4] = (x[4] @ w.t()).argmax()  # at least one token that is the argmax
    out = S.token_log_probs_2d(x, w, t, None, S.LogProbOptions(temperature=0.8), S.OUTPUT_NAMES)
    z = (x.double() @ w.double().t()) / 0.8
    logp_all = z.log_softmax(-1)
    valid = t != -100
    y = t.clamp(min=0)
    want = {
        "log_probs": logp_all.gather(-1, y[:, None])[:, 0],
        "entropy": -(logp_all.exp() * logp_all).sum(-1),
        "log_sum_sq_probs": (2 * logp_all).logsumexp(-1),
        "mean_logits": z.mean(-1),
    }
    for name, got in zip(S.OUTPUT_NAMES, out):
        if name == "is_top1":
            assert got.dtype == torch.bool and torch.equal(got, (z.argmax(-1) == y) & valid) and got[4]
        else:
            assert torch.allclose(got.double(), torch.where(valid, want[name], 0.0), rtol=1e-5, atol=1e-5), name
    logp_only = S.token_log_probs_2d(x, w, t, None, S.LogProbOptions(temperature=0.8), ("log_probs",))
    assert logp_only[1:] == (None,) * 4 and torch.equal(logp_only[0], out[0])


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_many_chunks_give_the_one_chunk_result(interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    x, w, _, t = _inputs(40, 16, 64, torch.float32, ("chunks",), ignored=(0, 17, 39))
    x.requires_grad_()
    whole = F.selective_log_softmax(x, w, t)
    (dx_whole,) = torch.autograd.grad(whole.sum(), x)
    monkeypatch.setattr(S.SelectiveLogSoftmaxSpace, "MAX_EXTRA_BYTES", 16 * 64 * 12)  # 16-row chunks on the CPU
    chunked = F.selective_log_softmax(x, w, t)
    (dx_chunked,) = torch.autograd.grad(chunked.sum(), x)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_chunked, dx_whole, rtol=1e-6, atol=1e-6)


def test_every_token_ignored_gives_zeros_and_zero_gradients():
    x, w, _, t = _inputs(5, 8, 20, torch.float32, ("ignored",))
    t.fill_(-100)
    x.requires_grad_(), w.requires_grad_()
    logp, ent = F.selective_log_softmax(x, w, t, return_entropy=True)
    assert torch.count_nonzero(logp) == 0 and torch.count_nonzero(ent) == 0
    dx, dw = torch.autograd.grad((logp + ent).sum(), (x, w))
    assert torch.count_nonzero(dx) == 0 and torch.count_nonzero(dw) == 0


def test_leading_dims_and_float64_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, _, t = _inputs(6, 8, 20, torch.float64, ("f64",))
    got = F.selective_log_softmax(x.view(2, 3, 8), w, t.view(2, 3))
    assert got.shape == (2, 3) and got.dtype == torch.float64
    want = S.selective_log_softmax_float64(x, w, t)[0]
    torch.testing.assert_close(got.reshape(-1), want)


def _bad(**changes):
    x, w, b, t = _inputs(4, 8, 20, torch.float32, ("bad",), bias=True)
    args = dict(x=x, lm_head_weight=w, target=t, bias=b)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, error, match", [
    (dict(temperature=0.0), ValueError, "temperature must be a finite number > 1e-30, got 0.0"),
    (dict(temperature=1e-40), ValueError, "temperature must be a finite number > 1e-30"),
    (dict(temperature=-1.0), ValueError, "temperature must be"),
    (dict(temperature="hot"), TypeError, "temperature must be a real number"),
    (dict(softcap=0.0), ValueError, "softcap must be None or a finite number > 0"),
    (dict(logit_scale=float("inf")), ValueError, "logit_scale must be finite"),
    (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (dict(return_entropy=1), TypeError, "return_entropy must be a Python bool, got builtins.int 1"),
], ids=lambda v: str(v)[:30])
def test_bad_options_are_refused(changes, error, match):
    args = _bad()
    kwargs = {k: v for k, v in changes.items()}
    with pytest.raises(error, match=match):
        F.selective_log_softmax(**args, **kwargs)


def test_bad_tensors_are_refused_with_their_shapes_and_dtypes():
    x, w, b, t = _inputs(4, 8, 20, torch.float32, ("bad",), bias=True)
    with pytest.raises(ValueError, match=r"lm_head_weight must be \(vocab, 8\).*shape \(20, 9\)"):
        F.selective_log_softmax(x, torch.randn(20, 9), t)
    with pytest.raises(ValueError, match=r"target must have x's leading shape \(4,\); got target of shape \(5,\)"):
        F.selective_log_softmax(x, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="target must be int64 or int32 token ids; got target of shape"):
        F.selective_log_softmax(x, w, t.float())
    with pytest.raises(TypeError, match="lm_head_weight must have x's dtype"):
        F.selective_log_softmax(x, w.double(), t)
    with pytest.raises(ValueError, match=r"bias must be \(20,\)"):
        F.selective_log_softmax(x, w, t, b[:5])
    with pytest.raises(TypeError, match="x must be a tensor, got list"):
        F.selective_log_softmax([1.0], w, t)
    bad = t.clone()
    bad[0] = 20
    with pytest.raises(ValueError, match=r"outside \[0, 20\)"):
        F.selective_log_softmax(x, w, bad)


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_compiled_forward_and_backward_equal_eager_with_entropy_and_softcap(interpret, monkeypatch):
    """The backward runs inside the custom op, below autograd (also where torch.compile traced it): its gradient
    is the closed form on both CPU paths, not autograd."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    x, w, _, t = _inputs(6, 8, 40, torch.float32, ("compile",))
    x.requires_grad_()

    def f(a):
        return F.selective_log_softmax(a, w, t, softcap=2.0, temperature=0.9, return_entropy=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    (g_got,) = torch.autograd.grad(got[0].sum() + got[1].sum(), x)
    want = f(x)
    (g_want,) = torch.autograd.grad(want[0].sum() + want[1].sum(), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
    ones = torch.ones(6)
    ref = S.selective_log_softmax_float64(x, w, t, None, S.LogProbOptions(-100, 0.9, 2.0, 1.0), ones, ones)
    assert rel_l2(g_got, ref[2]) < 1e-5
    torch._dynamo.reset()


def test_compiles_with_dynamic_shapes():
    x, w, _, t = _inputs(5, 8, 30, torch.float32, ("dynamic",))
    compiled = torch.compile(lambda a, b: F.selective_log_softmax(a, w, b, temperature=0.5), fullgraph=True,
                             dynamic=True)
    for rows in (3, 5):
        torch.testing.assert_close(compiled(x[:rows], t[:rows]), F.selective_log_softmax(x[:rows], w, t[:rows],
                                                                                          temperature=0.5))
    torch._dynamo.reset()


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_masked_vocabulary_entries_add_nothing(interpret, monkeypatch):
    """-inf logits (tokens masked out through the bias), also filling a whole first vocabulary tile: finite
    log-probabilities and entropy, equal to the float64 ones over the unmasked tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    vocab = 5000
    x, w, _, t = _inputs(4, 8, vocab, torch.float32, ("masked",), ignored=())
    t = 4200 + t % 800
    b = torch.zeros(vocab)
    b[:4200] = float("-inf")
    x.requires_grad_()
    logp, ent = F.selective_log_softmax(x, w, t, b, return_entropy=True)
    (dx,) = torch.autograd.grad((logp + ent).sum(), x)
    z = x.detach().double() @ w[4200:].double().t()
    z.requires_grad_()
    lp_all = z.log_softmax(-1)
    want_lp = lp_all.gather(-1, (t - 4200)[:, None])[:, 0]
    want_ent = -(lp_all.exp() * lp_all).sum(-1)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(dx).all()
    assert rel_l2(logp, want_lp.detach()) < 1e-5 and rel_l2(ent, want_ent.detach()) < 1e-5


def test_a_deepspeed_partition_or_an_empty_head_is_refused():
    x, w, _, t = _inputs(4, 8, 20, torch.float32, ("zero3",))
    part = torch.nn.Parameter(w[:5].clone())
    part.ds_shape = w.shape
    with pytest.raises(ValueError, match=r"lm_head_weight is a DeepSpeed ZeRO-3 partition .* of a parameter of "
                                         r"shape \(20, 8\)"):
        F.selective_log_softmax(x, part, t)
    with pytest.raises(ValueError, match="lm_head_weight is empty"):
        F.selective_log_softmax(x, w[:0], t)


def test_integer_like_options():
    import numpy as np

    x, w, _, t = _inputs(4, 8, 20, torch.float32, ("np",))
    want = F.selective_log_softmax(x, w, t, ignore_index=-100)
    torch.testing.assert_close(F.selective_log_softmax(x, w, t, ignore_index=np.int64(-100)), want)
    with pytest.raises(TypeError, match="return_entropy must be a Python bool, got numpy"):
        F.selective_log_softmax(x, w, t, return_entropy=np.True_)
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        F.selective_log_softmax(x, w, t, ignore_index=2**70)
