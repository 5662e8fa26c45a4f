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
from liger_gen.ops.divergence import jsd as J
from liger_gen.ops.divergence import kl_div as KL
from liger_gen.ops.glu import clamped_swiglu as CS
from liger_gen.ops.glu import glu as G
from liger_gen.ops.glu import squared_relu as SR
from liger_gen.ops.lm_head import cross_entropy as CE
from liger_gen.ops.norms import fused_add_rms_norm as FA
from liger_gen.ops.norms import layer_norm as LN
from liger_gen.ops.norms import rms_norm as N
from liger_gen.ops import rope as R
from liger_gen.reference import rope_torch
from liger_gen.runtime import ops, plans
from liger_gen.runtime.tables import heuristic_only

from conftest import seeded
from helpers import graph_leaves

F = liger_gen.functional
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not ops.interpreter_enabled(),
                                reason="plans serve the Triton path (CUDA, or the interpreter on the CPU)")


def _plans(planned) -> dict:
    """The plans an op's ``PlannedOp`` holds (not the keys it keeps as served by no plan)."""
    return {k: p for k, p in planned.plans.items() if p is not plans.NO_PLAN}


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
    before = len(_plans(N.rms_norm_planned))
    for call in range(3):  # the first call builds the plan (and records), the others use it
        dy = _randn(*shape, key=("dy", dtype, call), dtype=dtype, device=device)
        got = _rms_grads(lambda a, b: F.rms_norm(a, b, 1e-6), x, w, dy)
        want = _rms_grads(full, x, w, dy)
        for g, r in zip(got, want):
            assert torch.equal(g, r)
    assert len(_plans(N.rms_norm_planned)) == before + 1
    plan = next(p for p in _plans(N.rms_norm_planned).values() if p.shape == x.shape and p.x_dtype == dtype)
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
    assert len(_plans(FA.fused_add_rms_norm_planned)) == 1
    plan = next(iter(_plans(FA.fused_add_rms_norm_planned).values()))
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
    assert len(_plans(FA.fused_add_rms_norm_planned)) == 0 and torch.equal(s, x + r)
    F.fused_add_rms_norm(x, r.contiguous(), w)
    assert len(_plans(FA.fused_add_rms_norm_planned)) == 1
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
    assert len(_plans(N.rms_norm_planned)) >= 1
    ops.clear_caches()
    assert len(N.rms_norm_planned.plans) == 0 and len(R.rope_planned.plans) == 0
    F.rms_norm(x, w)
    with heuristic_only():
        F.rms_norm(x, w)
    assert sorted(key[-2] for key in _plans(N.rms_norm_planned)) == [False, True]


def test_tensor_subclasses_take_the_full_path(device):
    class Tagged(torch.Tensor):
        pass

    x = _randn(4, 32, key=("x",), device=device).as_subclass(Tagged)
    w = _randn(32, key=("w",), device=device)
    ops.clear_caches()
    y = F.rms_norm(x, w)
    assert len(N.rms_norm_planned.plans) == 0  # not even a verdict: a subclass is never keyed
    assert torch.equal(y.as_subclass(torch.Tensor), N.rms_norm_2d(x.as_subclass(torch.Tensor), w, 1e-6, 0.0,
                                                                  "llama")[0])


def test_the_plan_cache_is_bounded(device, monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    ops.clear_caches()
    w = _randn(16, key=("w",), device=device)
    for rows in range(1, 8):
        F.rms_norm(_randn(rows, 16, key=("x", rows), device=device), w)
        assert len(_plans(N.rms_norm_planned)) <= 3


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
    before = len(_plans(R.rope_planned))
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
    assert len(_plans(R.rope_planned)) == before + 1
    if device.type == "cuda":
        plan = list(_plans(R.rope_planned).values())[-1]
        assert plan.fwd.replay is not None and any(lc.replay is not None for lc in plan.bwd.values())


def test_rope_with_trainable_tables_or_one_unused_output_keeps_exact_gradients(device):
    q, k, cos, sin, _ = _rope_inputs(device, 1, False)
    cos_t, sin_t = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    ops.clear_caches()
    qo, ko = F.rope(q, k, cos_t, sin_t)
    assert len(_plans(R.rope_planned)) == 0  # cos/sin gradients need q and k saved: the full path
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
    assert len(N.rms_norm_planned.plans) == 0


# ------------------------------------------------------------------------------------------------ every planned op
# The binding (``liger_gen.runtime.binding.PlannedOp``) gives each op the same plan path: ``prepare`` (the checks,
# the kernel choice, the output layout) once per key, the plan after. Each case: (name, its PlannedOp, a call
# ``f(variant)`` whose variants are the same call shape (0, 1), another dtype (2), other strides (3), another
# option (4)).


def _t(*shape, dtype=torch.float32, key=()):
    return _randn(*shape, key=("planned", *key, shape, str(dtype)), dtype=dtype)


def _target(rows, classes, variant):
    t = torch.randint(0, classes, (rows,), generator=seeded("target", rows, variant))
    t[0] = -100
    return t


def _call(name, v):
    """The op ``name`` called with variant ``v``; returns its output (a tensor or a tuple)."""
    dt = torch.bfloat16 if v == 2 else torch.float32
    grad = dict(dtype=dt)
    if name == "rms_norm":
        x = _t(6, 32, **grad) if v != 3 else _t(32, 6, **grad).t()
        return F.rms_norm(x.requires_grad_(), _t(32, **grad), 1e-5 if v == 4 else 1e-6)
    if name == "fused_add_rms_norm":
        x = _t(2, 3, 32, **grad) if v != 3 else _t(2, 32, 3, **grad).transpose(1, 2)
        return F.fused_add_rms_norm(x.requires_grad_(), _t(2, 3, 32, **grad), _t(32, **grad),
                                    offset=1.0 if v == 4 else 0.0)
    if name == "rope":
        q, k = _t(2, 6, 4, 16, **grad), _t(2, 6, 2, 16, **grad)
        if v == 3:
            q = _t(2, 4, 6, 16, **grad).transpose(1, 2)
        cos, sin = _t(1, 6, 16, **grad), _t(1, 6, 16, **grad)
        return F.rope(q.requires_grad_(), k, cos, sin, None, 2 if v != 4 else -2)
    if name == "cross_entropy":
        logits = _t(5, 40, **grad) if v != 3 else _t(5, 48, **grad)[:, :40]
        return F.cross_entropy(logits.requires_grad_(), _target(5, 40, v), reduction="sum" if v == 4 else "mean")
    if name in ("swiglu", "geglu"):
        gate = _t(2, 3, 24, **grad) if v != 3 else _t(2, 24, 3, **grad).transpose(1, 2)
        up = _t(2, 3, 24, **grad)
        if name == "swiglu":
            return F.swiglu(gate.requires_grad_(), up) if v != 4 else F.geglu(gate.requires_grad_(), up)
        return F.geglu(gate.requires_grad_(), up, "none" if v == 4 else "tanh")
    if name in ("swiglu_gate_up", "geglu_gate_up"):
        gate_up = _t(2, 3, 48, **grad) if v != 3 else _t(2, 3, 64, **grad)[..., :48]
        if name == "swiglu_gate_up":
            return F.swiglu_gate_up(gate_up.requires_grad_()) if v != 4 else F.geglu_gate_up(gate_up.requires_grad_())
        return F.geglu_gate_up(gate_up.requires_grad_(), "none" if v == 4 else "tanh")
    if name == "layer_norm":
        x = _t(3, 5, 32, **grad) if v != 3 else _t(3, 32, 5, **grad).transpose(1, 2)
        return F.layer_norm(x.requires_grad_(), _t(32, **grad), None if v == 4 else _t(32, **grad))
    if name == "clamped_swiglu":
        gate = _t(2, 3, 24, **grad) if v != 3 else _t(2, 3, 48, **grad)[..., ::2]
        up = _t(2, 3, 24, **grad) if v != 3 else _t(2, 3, 48, **grad)[..., 1::2]
        return F.clamped_swiglu(gate.requires_grad_(), up, limit=5.0 if v == 4 else 7.0)
    if name == "clamped_swiglu_gate_up":
        gate_up = _t(2, 3, 48, **grad) if v != 3 else _t(2, 3, 64, **grad)[..., :48]
        return F.clamped_swiglu_gate_up(gate_up.requires_grad_(), alpha=1.0 if v == 4 else 1.702)
    if name == "squared_relu":  # no option: another shape stands for one (4)
        x = _t(2, 3, 24, **grad) if v != 3 else _t(2, 24, 3, **grad).transpose(1, 2)
        return F.squared_relu((x if v != 4 else _t(3, 40, **grad)).requires_grad_())
    if name == "kl_div":
        x = _t(5, 40, **grad).log_softmax(-1) if v != 3 else _t(40, 5, **grad).log_softmax(0).t()
        return F.kl_div(x.requires_grad_(), _t(5, 40, **grad).softmax(-1), "sum" if v == 4 else "batchmean")
    if name == "jsd":
        s = _t(2, 3, 40, **grad).log_softmax(-1) if v != 3 else _t(3, 2, 40, **grad).log_softmax(-1).transpose(0, 1)
        label = _target(6, 40, 0).view(2, 3)
        return F.jsd(s.requires_grad_(), _t(2, 3, 40, **grad).log_softmax(-1), 0.0 if v == 4 else 0.5, -100, label)
    raise AssertionError(name)


PLANNED = {"rms_norm": N.rms_norm_planned, "fused_add_rms_norm": FA.fused_add_rms_norm_planned,
           "rope": R.rope_planned, "cross_entropy": CE.cross_entropy_planned, "swiglu": G.glu_planned,
           "geglu": G.glu_planned, "swiglu_gate_up": G.glu_gate_up_planned, "geglu_gate_up": G.glu_gate_up_planned,
           "layer_norm": LN.layer_norm_planned, "clamped_swiglu": CS.clamped_swiglu_planned,
           "clamped_swiglu_gate_up": CS.clamped_swiglu_gate_up_planned, "kl_div": KL.kl_div_planned,
           "jsd": J.jsd_planned, "squared_relu": SR.squared_relu_planned}


def _counting(monkeypatch, planned) -> list:
    calls: list = []
    prepare = planned.prepare

    def counted(*args):
        calls.append(args)
        return prepare(*args)

    monkeypatch.setattr(planned, "prepare", counted)
    return calls


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_a_second_call_of_a_call_shape_skips_the_checks_and_equals_the_first(device, monkeypatch, name):
    """Same shape, strides, dtypes and options: one ``prepare`` (the checks), then the plan, with the same
    outputs and gradients as the first call (which ran through the plan it had just built)."""
    if device.type != "cpu":
        pytest.skip("the call factory makes CPU tensors")
    ops.clear_caches()
    calls = _counting(monkeypatch, PLANNED[name])
    results = []
    for _ in range(3):
        out = _outputs(_call(name, 0))
        leaf = [t for t in out if t.requires_grad]
        grads = torch.autograd.grad(leaf, graph_leaves(out), [torch.ones_like(t) for t in leaf], allow_unused=True)
        results.append((out, grads))
    assert len(calls) == 1
    assert len(_plans(PLANNED[name])) == 1
    for out, grads in results[1:]:
        for a, b in zip(out + grads, results[0][0] + results[0][1]):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_another_dtype_stride_or_option_prepares_again(device, monkeypatch, name):
    """Each of another dtype, other strides and another option is another key: its checks run (a prepare each),
    and calling it again does not."""
    if device.type != "cpu":
        pytest.skip("the call factory makes CPU tensors")
    ops.clear_caches()
    calls = _counting(monkeypatch, PLANNED[name])
    for v in (0, 2, 3, 4):
        _call(name, v)
    assert len(calls) == 4
    for v in (0, 2, 3, 4):
        _call(name, v)
    assert len(calls) == 4


def test_bad_calls_after_good_ones_still_raise(device):
    """A plan never lets a call through that the checks would refuse: a wrong shape, dtype or option is another
    key, whose checks raise the op's own error; values (cross-entropy's targets) are checked on every call."""
    if device.type != "cpu":
        pytest.skip("CPU tensors")
    ops.clear_caches()
    for _ in range(2):
        for name in PLANNED:
            _call(name, 0)
    x, w = _t(6, 32), _t(32)
    with pytest.raises(ValueError, match=r"weight must have shape \(32,\)"):
        F.layer_norm(x.view(2, 3, 32), w[:16])
    with pytest.raises(TypeError, match="weight and bias must have x's dtype"):
        F.layer_norm(_t(3, 5, 32), _t(32).double(), _t(32))
    with pytest.raises(ValueError, match="gate and up must have the same shape"):
        F.swiglu(_t(2, 3, 24), _t(2, 3, 12))
    with pytest.raises(TypeError, match="gate and up must have the same dtype"):
        F.swiglu(_t(2, 3, 24), _t(2, 3, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="last dim must be even"):
        F.swiglu_gate_up(_t(2, 3, 47))
    with pytest.raises(ValueError, match="approximate must be one of"):
        F.geglu(_t(2, 3, 24), _t(2, 3, 24), "erf")
    logits = _t(5, 40).requires_grad_()
    with pytest.raises(ValueError, match="target must have logits' leading shape"):
        F.cross_entropy(logits, _target(4, 40, 0))
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        F.cross_entropy(logits, _target(5, 40, 0), ignore_index=-100.0)
    with pytest.raises(TypeError, match="return_z_loss must be a bool"):
        F.cross_entropy(logits, _target(5, 40, 0), return_z_loss=1)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        F.cross_entropy(logits, _target(5, 40, 0), label_smoothing=2.0)
    bad = _target(5, 40, 0)
    bad[3] = 40
    for _ in range(2):  # a value: checked by every call, the plan's launches included
        with pytest.raises(ValueError, match=r"class indices outside \[0, 40\)"):
            F.cross_entropy(logits, bad)
    weight = _t(40).abs().requires_grad_()
    F.cross_entropy(logits, _target(5, 40, 0), weight.detach())
    with pytest.raises(ValueError, match="not differentiable in weight"):
        F.cross_entropy(logits, _target(5, 40, 0), weight)
    with pytest.raises(ValueError, match="k must match q's batch"):
        F.rope(_t(2, 6, 4, 16), _t(2, 5, 2, 16), _t(1, 6, 16), _t(1, 6, 16), None, 2)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        F.fused_add_rms_norm(_t(2, 3, 32), _t(2, 2, 32), _t(32))
    with pytest.raises(ValueError, match="gate and up must have the same shape"):
        F.clamped_swiglu(_t(2, 3, 24), _t(2, 3, 12))
    with pytest.raises(ValueError, match="limit must be a finite number > 0"):
        F.clamped_swiglu(_t(2, 3, 24), _t(2, 3, 24), limit=-1.0)
    with pytest.raises(TypeError, match="alpha must be a real number, got bool"):
        F.clamped_swiglu(_t(2, 3, 24), _t(2, 3, 24), alpha=True)
    with pytest.raises(ValueError, match="last dim must be even"):
        F.clamped_swiglu_gate_up(_t(2, 3, 47))
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        F.clamped_swiglu_gate_up(_t(2, 3, 48), alpha=float("inf"))
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16; got x of shape \\(2, 3, 24\\)"):
        F.squared_relu(_t(2, 3, 24).to(torch.int32))
    x = _t(5, 40).log_softmax(-1)
    with pytest.raises(ValueError, match="input and target must have the same shape"):
        F.kl_div(x, _t(5, 39))
    with pytest.raises(ValueError, match="reduction must be one of"):
        F.kl_div(x, _t(5, 40), "avg")
    with pytest.raises(TypeError, match="log_target must be a bool"):
        F.kl_div(x, _t(5, 40), "batchmean", 1)
    with pytest.raises(TypeError, match="target must be float32, bfloat16 or float16"):
        F.kl_div(x, _target(5, 40, 0)[:, None].expand(5, 40))
    s, t = _t(2, 3, 40).log_softmax(-1), _t(2, 3, 40).log_softmax(-1)
    with pytest.raises(ValueError, match="beta must be in"):
        F.jsd(s, t, 1.5)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        F.jsd(s, t, 0.5, True)
    with pytest.raises(ValueError, match="label must have student_logp's leading shape"):
        F.jsd(s, t, 0.5, -100, _target(5, 40, 0))
    with pytest.raises(TypeError, match="label must be an integer tensor"):
        F.jsd(s, t, 0.5, -100, _t(2, 3))
    F.jsd(s.requires_grad_(), t)
    with pytest.raises(ValueError, match="teacher_logp requires grad"):  # a flag, not a shape: keyed too
        F.jsd(s, t.requires_grad_())


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_planned_calls_without_autograd_equal_the_recorded_ones(device, name):
    """no_grad and inference_mode take the plan's forward alone (no autograd node): the same outputs."""
    if device.type != "cpu":
        pytest.skip("CPU tensors")
    ops.clear_caches()
    want = [t.detach() for t in _outputs(_call(name, 0))]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = _outputs(_call(name, 0))
        assert all(g.grad_fn is None for g in got)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    # cross-entropy keys whether a gradient is wanted (its forward may write it): a plan for each
    assert len(_plans(PLANNED[name])) == (2 if name == "cross_entropy" else 1)


def test_clear_caches_forgets_every_ops_plans(device):
    if device.type != "cpu":
        pytest.skip("CPU tensors")
    for name in PLANNED:
        _call(name, 0)
    assert all(len(p.plans) for p in PLANNED.values())
    ops.clear_caches()
    assert not any(len(p.plans) for p in PLANNED.values())
