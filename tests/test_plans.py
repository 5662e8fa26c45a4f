"""Per-shape plans of the eager ops (``liger_gen.runtime.plans``): the first call of a shape validates and
builds the plan, later calls go through it and must give exactly what the op's full path gives; anything the
plan key does not cover takes the full path, checks included.

On the CPU the kernels run in Triton's interpreter, whose launches are not lean, so plans there skip the checks
and the lookup but never replay (the replay itself is tested with fake kernels in test_compiled_kernels.py); on
a GPU the same tests also check that replays were used.
"""

from __future__ import annotations

import pytest
import torch

import liger_gen
from liger_gen.ops.norms import fused_add_rms_norm as FA
from liger_gen.ops.norms import rms_norm as N
from liger_gen.ops import rope as R
from liger_gen.reference import rope_torch
from liger_gen.runtime import ops, plans
from liger_gen.runtime.tables import heuristic_only

from conftest import seeded

F = liger_gen.functional
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not ops.interpreter_enabled(),
                                reason="plans serve the Triton path (CUDA, or the interpreter on the CPU)")


def _randn(*shape, key, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=seeded(*key, shape)).to(device=device, dtype=dtype)


def _rms_grads(fn, x, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    return (y, *torch.autograd.grad(y, (x, w), dy))


@pytest.mark.parametrize("shape", [(5, 72), (2, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_through_its_plan_equals_the_full_path(device, shape, dtype):
    x = _randn(*shape, key=("x", dtype), dtype=dtype, device=device)
    w = _randn(shape[-1], key=("w", dtype), dtype=dtype, device=device)
    full = lambda a, b: N.rms_norm_2d(a if a.dim() == 2 else a.contiguous(), b, 1e-6, 0.0, "llama")[0]  # noqa: E731
    before = len(N._PLANS)
    for call in range(3):  # the first call builds the plan (and records), the others use it
        dy = _randn(*shape, key=("dy", dtype, call), dtype=dtype, device=device)
        got = _rms_grads(lambda a, b: F.rms_norm(a, b, 1e-6), x, w, dy)
        want = _rms_grads(full, x, w, dy)
        for g, r in zip(got, want):
            assert torch.equal(g, r)
    assert len(N._PLANS) == before + 1
    plan = next(p for p in N._PLANS.values() if p.shape == x.shape and p.x_dtype == dtype)
    if device.type == "cuda":  # the later calls replayed the recorded launches
        assert plan.fwd.replay is not None and any(lc.replay is not None for lc in plan.bwd.values())
    with torch.no_grad():
        assert torch.equal(F.rms_norm(x, w, 1e-6), full(x, w))


@pytest.mark.parametrize("shape", [(5, 72), (2, 3, 40)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16+fp32-residual"])
@pytest.mark.parametrize("sum_used", [True, False], ids=["sum-used", "sum-unused"])
def test_fused_add_rms_norm_through_its_plan_equals_the_full_path(device, shape, dtypes, sum_used):
    """The decoder's residual add + norm: the plan's (y, s) and the gradients of x, residual and weight equal the
    full path's exactly, with and without an upstream gradient of the sum (the residual stream), for mixed dtypes
    too; the later calls replay on a GPU."""
    x_dtype, r_dtype = dtypes
    x = _randn(*shape, key=("x", dtypes), dtype=x_dtype, device=device)
    r = _randn(*shape, key=("r", dtypes), dtype=r_dtype, device=device)
    w = _randn(shape[-1], key=("w", dtypes), dtype=x_dtype, device=device)
    rows = x.numel() // shape[-1]

    def full(a, b, c):
        y, s = FA.fused_add_rms_norm_2d(a.reshape(rows, -1), b.reshape(rows, -1), c, 1e-6, 0.0, "llama")[:2]
        return y.view(shape), s.view(shape)

    def grads(fn, dy, ds):
        a, b, c = (t.detach().requires_grad_() for t in (x, r, w))
        y, s = fn(a, b, c)
        outs, grads_in = ((y, s), (dy, ds)) if sum_used else ((y,), (dy,))
        return (y, s, *torch.autograd.grad(outs, (a, b, c), grads_in))

    ops.clear_caches()
    for call in range(3):  # the first call builds the plan (and records), the others use it
        dy = _randn(*shape, key=("dy", dtypes, call), dtype=x_dtype, device=device)
        ds = _randn(*shape, key=("ds", dtypes, call), dtype=r_dtype, device=device)
        got = grads(lambda a, b, c: F.fused_add_rms_norm(a, b, c, 1e-6), dy, ds)
        want = grads(full, dy, ds)
        for g, ref in zip(got, want):
            assert g.dtype == ref.dtype and torch.equal(g, ref)
    assert len(FA._PLANS) == 1
    plan = next(iter(FA._PLANS.values()))
    if device.type == "cuda":  # the later calls replayed the recorded launches
        assert plan.fwd.replay is not None and any(lc.replay is not None for lc in plan.bwd.values())
    with torch.no_grad():
        for g, ref in zip(F.fused_add_rms_norm(x, r, w, 1e-6), full(x, r, w)):
            assert torch.equal(g, ref)


def test_fused_add_rms_norm_plan_skips_non_contiguous_inputs_and_still_checks(device):
    x = _randn(8, 64, key=("x",), device=device)
    r = _randn(64, 8, key=("r",), device=device).t()  # a transposed view: the full path (copied rows)
    w = _randn(64, key=("w",), device=device)
    ops.clear_caches()
    y, s = F.fused_add_rms_norm(x, r, w)
    assert len(FA._PLANS) == 0 and torch.equal(s, x + r)
    F.fused_add_rms_norm(x, r.contiguous(), w)
    assert len(FA._PLANS) == 1
    with pytest.raises(ValueError, match="residual must have x's shape"):
        F.fused_add_rms_norm(x, r.contiguous()[:4], w)
    with pytest.raises(ValueError, match="weight must have shape"):
        F.fused_add_rms_norm(x, r.contiguous(), w[:32])


def test_inputs_a_plan_does_not_cover_are_still_checked(device):
    x = _randn(4, 64, key=("x",), device=device)
    w = _randn(64, key=("w",), device=device)
    F.rms_norm(x, w)
    F.rms_norm(x, w)  # a plan for (4, 64) float32 exists now
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\).*shape \(32,\)"):
        F.rms_norm(x, w[:32])
    with pytest.raises(TypeError, match="eps must be a real number, got bool"):
        F.rms_norm(x, w, eps=True)
    with pytest.raises(TypeError, match="eps must be a real number, got str"):
        F.rms_norm(x, w, eps="1e-6")
    with pytest.raises(ValueError, match="casting_mode must be one of"):
        F.rms_norm(x, w, casting_mode="llama3")
    with pytest.raises(ValueError, match="casting_mode must be one of"):
        F.rms_norm(x, w, casting_mode=["llama"])  # unhashable: never reaches the plan cache
    with pytest.raises(TypeError, match="must be float32, bfloat16 or float16; got x of shape"):
        F.rms_norm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="offset=1.0 needs a weight"):
        F.rms_norm(x, None, offset=1.0)


def test_an_int_eps_shares_the_plan_of_the_equal_float(device):
    x = _randn(3, 32, key=("x",), device=device)
    w = _randn(32, key=("w",), device=device)
    want = N.rms_norm_2d(x, w, 1.0, 0.0, "llama")[0]
    assert torch.equal(F.rms_norm(x, w, eps=1.0), want)
    assert torch.equal(F.rms_norm(x, w, eps=1), want)


def test_clear_caches_forgets_plans_and_heuristic_only_gets_its_own(device):
    x = _randn(6, 48, key=("x",), device=device)
    w = _randn(48, key=("w",), device=device)
    F.rms_norm(x, w)
    assert len(N._PLANS) >= 1
    ops.clear_caches()
    assert len(N._PLANS) == 0 and len(R._PLANS) == 0
    F.rms_norm(x, w)
    with heuristic_only():
        F.rms_norm(x, w)
    assert sorted(key[-2] for key in N._PLANS) == [False, True]


def test_tensor_subclasses_take_the_full_path(device):
    class Tagged(torch.Tensor):
        pass

    x = _randn(4, 32, key=("x",), device=device).as_subclass(Tagged)
    w = _randn(32, key=("w",), device=device)
    ops.clear_caches()
    y = F.rms_norm(x, w)
    assert len(N._PLANS) == 0
    assert torch.equal(y.as_subclass(torch.Tensor), N.rms_norm_2d(x.as_subclass(torch.Tensor), w, 1e-6, 0.0,
                                                                  "llama")[0])


def test_the_plan_cache_is_bounded(device, monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    ops.clear_caches()
    w = _randn(16, key=("w",), device=device)
    for rows in range(1, 8):
        F.rms_norm(_randn(rows, 16, key=("x", rows), device=device), w)
        assert len(N._PLANS) <= 3


def _rope_inputs(device, layout, pos, dtype=torch.float32):
    b, hq, hk, s, d = 2, 4, 2, 6, 16
    shape_q = (b, hq, s, d) if layout == 1 else (b, s, hq, d)
    shape_k = (b, hk, s, d) if layout == 1 else (b, s, hk, d)
    q = _randn(*shape_q, key=("q", layout, pos), dtype=dtype, device=device)
    k = _randn(*shape_k, key=("k", layout, pos), dtype=dtype, device=device)
    if pos:
        cos = _randn(2 * s, d, key=("cos",), dtype=dtype, device=device)
        sin = _randn(2 * s, d, key=("sin",), dtype=dtype, device=device)
        pid = torch.randint(0, 2 * s, (b, s), generator=seeded("pid")).to(device)
    else:
        cos = _randn(1, s, d, key=("cos",), dtype=dtype, device=device)
        sin = _randn(1, s, d, key=("sin",), dtype=dtype, device=device)
        pid = None
    return q, k, cos, sin, pid


@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("pos", [False, True])
def test_rope_through_its_plan_equals_the_full_path(device, layout, pos):
    q, k, cos, sin, pid = _rope_inputs(device, layout, pos)
    before = len(R._PLANS)
    for call in range(3):
        gq = _randn(*q.shape, key=("gq", call), device=device)
        gk = _randn(*k.shape, key=("gk", call), device=device)
        q1, k1 = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = F.rope(q1, k1, cos, sin, pid, layout)
        got = (*out, *torch.autograd.grad(out, (q1, k1), (gq, gk)))
        t = (lambda a: a.transpose(1, 2)) if layout == 2 else (lambda a: a)
        q2, k2 = t(q).detach().requires_grad_(), t(k).detach().requires_grad_()
        out2 = R.rope_4d(q2, k2, cos, sin, pid)
        want = tuple(map(t, (*out2, *torch.autograd.grad(out2, (q2, k2), (t(gq), t(gk))))))
        for g, r in zip(got, want):
            assert torch.equal(g, r)
    assert len(R._PLANS) == before + 1
    if device.type == "cuda":
        plan = list(R._PLANS.values())[-1]
        assert plan.fwd.replay is not None and any(lc.replay is not None for lc in plan.bwd.values())


def test_rope_with_trainable_tables_or_one_unused_output_keeps_exact_gradients(device):
    q, k, cos, sin, _ = _rope_inputs(device, 1, False)
    cos_t, sin_t = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    ops.clear_caches()
    qo, ko = F.rope(q, k, cos_t, sin_t)
    assert len(R._PLANS) == 0  # cos/sin gradients need q and k saved: the full path
    dc, ds = torch.autograd.grad((qo * 2).sum() + ko.sum(), (cos_t, sin_t))
    cos_d, sin_d = cos.double().requires_grad_(), sin.double().requires_grad_()
    qr, kr = rope_torch(q.double(), k.double(), cos_d, sin_d, None, 1)
    dcr, dsr = torch.autograd.grad((qr * 2).sum() + kr.sum(), (cos_d, sin_d))
    assert torch.allclose(dc.double(), dcr, rtol=1e-4, atol=1e-4) and torch.allclose(ds.double(), dsr, rtol=1e-4,
                                                                                       atol=1e-4)
    for _ in range(2):  # planned: only q's output used, k's gradient is the rotation of zeros
        q1, k1 = q.detach().requires_grad_(), k.detach().requires_grad_()
        qo, ko = F.rope(q1, k1, cos, sin)
        dq, dk = torch.autograd.grad(qo.sum(), (q1, k1))
        assert torch.equal(dk, torch.zeros_like(k))
        q2 = q.detach().requires_grad_()
        dq2, = torch.autograd.grad(R.rope_4d(q2, k, cos, sin, None)[0].sum(), (q2,))
        assert torch.equal(dq, dq2)


def test_forward_mode_ad_never_takes_a_plan(device):
    """A plan's direct launches would drop the tangent of a dual tensor: under a dual level the op takes its
    full path (which refuses forward AD on the kernel path, as the autograd Function has no jvp)."""
    import torch.autograd.forward_ad as fwAD

    x = _randn(4, 32, key=("x",), device=device)
    w = _randn(32, key=("w",), device=device)
    F.rms_norm(x, w)
    F.rms_norm(x, w)  # a plan exists
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="jvp"):
            F.rms_norm(fwAD.make_dual(x, torch.ones_like(x)), w)


def test_a_nan_eps_does_not_fill_the_plan_cache(device):
    ops.clear_caches()
    x = _randn(3, 16, key=("x",), device=device)
    w = _randn(16, key=("w",), device=device)
    for _ in range(3):
        assert torch.isnan(F.rms_norm(x, w, eps=float("nan"))).all()
    assert len(N._PLANS) == 0
