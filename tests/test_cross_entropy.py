"""Cross-entropy kernels (Triton interpreter on the CPU) against float64 and torch, and the API around them."""

import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from liger_gen.codegen.problems import FP32_OUT_TOL, REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.ops.lm_head.cross_entropy import (CrossEntropyProblem, cross_entropy, cross_entropy_float64,
                                                 cross_entropy_torch)
from liger_gen.ops.lm_head.cross_entropy_rows import (cross_entropy_loss_and_grad, cross_entropy_mean_scale,
                                                      cross_entropy_reduce)
from liger_gen.ops.lm_head.cross_entropy_space import CrossEntropyConfig, CrossEntropySpace

from conftest import CPU_PATHS, assert_compiles_like_eager, seeded

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ("mean", "sum", "none")


def _case(rows, vocab, dtype, device, gen, *, ignore=(), scale=3.0):
    x = (scale * torch.randn(rows, vocab, generator=gen)).to(device, dtype)
    t = torch.randint(0, vocab, (rows,), generator=gen)
    for i in ignore:
        t[i] = -100
    return x, t.to(device)


# ------------------------------------------------------------------------------------------------ row-level API


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_loss_and_grad_chunked_mean_matches_float64(dtype, in_place, device):
    """Two chunks with a shared mean scale, gradient written in place or into a separate fp32 buffer."""
    gen = seeded("api", dtype, in_place)
    v = 77
    x, t = _case(13, v, dtype, device, gen, ignore=(1, 6))
    w = (0.5 + torch.rand(v, generator=gen)).to(device)
    opts = dict(weight=w, label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0)
    x64 = x.detach().double().requires_grad_()
    ref, ref_z = cross_entropy_float64(x64, t, reduction="mean", **opts)
    ref.backward()
    scale = cross_entropy_mean_scale(t, v, w)
    grad = x.clone() if in_place else torch.empty(x.shape, dtype=torch.float32, device=device)
    src = grad if in_place else x
    parts = [cross_entropy_loss_and_grad(src[s], t[s], grad[s], scale=scale, **opts)
             for s in (slice(0, 6), slice(6, 13))]
    loss_rows, zl_rows, lse = (torch.cat(p) for p in zip(*parts))
    loss, z = cross_entropy_reduce(loss_rows, zl_rows, "mean", scale)
    assert loss.dtype == z.dtype == lse.dtype == torch.float32 and loss.shape == ()
    assert rel_l2(loss, ref) < FP32_OUT_TOL and rel_l2(z, ref_z) < FP32_OUT_TOL
    soft = 5.0 * torch.tanh(x.double() / 5.0)
    assert rel_l2(lse, torch.logsumexp(soft, -1)) < FP32_OUT_TOL
    tol = REL_TOL[dtype] if in_place else FP32_OUT_TOL * 10  # fp32 output: fp32 math only
    assert rel_l2(grad, x64.grad) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_loss_and_grad_on_the_plain_cpu_path(dtype, in_place, monkeypatch):
    """The same chunked mean without the interpreter: the closed-form CPU gradient (what FLCE's plain path runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    test_loss_and_grad_chunked_mean_matches_float64(dtype, in_place, torch.device("cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_custom_ops_on_the_plain_cpu_path_match_float64(dtype, reduction, monkeypatch):
    """cross_entropy_fwd/bwd called as ops (as a compiled graph calls them) on CPU tensors without the interpreter,
    every option on: loss, z-loss, lse, q = 1 − p_y and the gradient against float64 autograd."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = seeded("plain-ops", dtype, reduction)
    v = 37
    x, t = _case(11, v, dtype, "cpu", gen, ignore=(2, 7))
    w = 0.5 + torch.rand(v, generator=gen)
    opts = (-100, reduction, 0.1, 1e-2, 5.0)
    loss, zl, lse, q, scale, empty = torch.ops.liger_gen.cross_entropy_fwd(x, t, w, *opts, False, False)
    assert empty.numel() == 0  # no gradient in the forward unless asked
    x64 = x.double().requires_grad_()
    ref, ref_z = cross_entropy_float64(x64, t, w, reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2,
                                       softcap=5.0)
    soft = 5.0 * torch.tanh(x.double() / 5.0)
    ref_lse = torch.logsumexp(soft, -1)
    p_y = torch.exp(soft.gather(1, torch.where(t >= 0, t, 0)[:, None]).squeeze(1) - ref_lse)
    for got, want in ((loss, ref), (zl, ref_z), (lse, ref_lse), (q, torch.where(t >= 0, 1 - p_y, 1.0))):
        assert rel_l2(got, want) < FP32_OUT_TOL
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64) if ref.dim() else torch.tensor(1.3,
                                                                                                 dtype=torch.float64)
    (ref * g).sum().backward()
    dlogits = torch.ops.liger_gen.cross_entropy_bwd(g.float(), x, t, w, lse, q, scale, *opts, False)
    assert dlogits.dtype == dtype and rel_l2(dlogits, x64.grad) < REL_TOL[dtype]


def test_loss_and_grad_rows_and_grad_output(device):
    """Unscaled per-row values; the gradient of Σ g_i·(s_ce·ce_i + s_z·zl_i) with a (rows,) grad_output."""
    gen = seeded("api-rows")
    x, t = _case(8, 40, torch.float32, device, gen, ignore=(3,))
    g = torch.randn(8, generator=gen).to(device)
    s = torch.tensor([0.25, 0.5], device=device)
    dx = torch.empty_like(x)
    loss_rows, zl_rows, lse = cross_entropy_loss_and_grad(x, t, dx, lse_square_scale=0.01, scale=s, grad_output=g)
    x64 = x.double().requires_grad_()
    ce_rows, z_rows = cross_entropy_float64(x64, t, reduction="none", lse_square_scale=0.01)
    ce_rows = ce_rows - z_rows
    (g.double() * (0.25 * ce_rows + 0.5 * z_rows)).sum().backward()
    assert rel_l2(loss_rows, ce_rows + z_rows) < FP32_OUT_TOL and rel_l2(zl_rows, z_rows) < FP32_OUT_TOL
    assert loss_rows[3] == 0 and zl_rows[3] == 0 and torch.isfinite(lse[3])
    assert rel_l2(dx, x64.grad) < 1e-5
    loss_only = cross_entropy_loss_and_grad(x, t, lse_square_scale=0.01)
    assert torch.equal(loss_only[0], loss_rows)


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture(params=[1, 0], ids=["grad_in_fwd", "recompute"])
def strategy(request):
    """Run the test with the runtime's config forced to GRAD_IN_FWD=1 and to GRAD_IN_FWD=0."""
    with _forced_config(GRAD_IN_FWD=request.param) as changes:
        yield changes


@contextlib.contextmanager
def _forced_config(**changes):
    """The runtime picks the heuristic here (no GPU, no table): patch it, and forget memoised kernel choices."""
    from liger_gen.runtime.ops import clear_caches

    original = CrossEntropySpace.heuristic
    CrossEntropySpace.heuristic = lambda self: dataclasses.replace(original(self), **changes)
    clear_caches()
    try:
        yield changes
    finally:
        CrossEntropySpace.heuristic = original
        clear_caches()


def _skip_duplicate(dtype, strategy):
    if dtype == torch.float16 and strategy["GRAD_IN_FWD"]:
        pytest.skip("float16 always recomputes (FP16_GRAD_IN_FWD): same run as the recompute case")


def _assert_matches_float64(x, t, upstream=None, loss_tol=FP32_OUT_TOL, **opts):
    """Loss (and z-loss) and the logits gradient of the public op against the float64 reference."""
    x = x.detach().requires_grad_()
    loss, z = cross_entropy(x, t, return_z_loss=True, **opts)
    assert loss.dtype == torch.float32 and z.dtype == torch.float32
    assert not z.requires_grad
    if upstream is None:  # seeded; a mean's factor kept in [0.5, 2] (tiny factors only test fp16's subnormals)
        gen = seeded("upstream", tuple(x.shape), x.dtype)
        upstream = (torch.randn(loss.shape, generator=gen) if loss.dim() else 0.5 + 1.5 * torch.rand((), generator=gen))
    g = upstream.to(x.device, torch.float32)
    loss.backward(g)
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
    x64 = x.detach().double().requires_grad_()
    ref, ref_z = cross_entropy_float64(x64, t, **opts)
    ref.backward(g.double())
    assert loss.shape == ref.shape
    assert rel_l2(loss, ref) < loss_tol, f"loss {rel_l2(loss, ref)}"
    assert rel_l2(z, ref_z) < loss_tol, f"z_loss {rel_l2(z, ref_z)}"
    assert rel_l2(x.grad, x64.grad) < REL_TOL[x.dtype], f"dlogits {rel_l2(x.grad, x64.grad)}"
    return loss, x.grad


def test_fp16_never_stores_the_gradient_for_a_unit_upstream(device):
    """fp16 with a GradScaler-like loss scale: tiny softmax entries must survive (single rounding after scaling)."""
    assert CrossEntropySpace(32000, torch.float16).heuristic().GRAD_IN_FWD == 0
    space = CrossEntropySpace(32000, torch.float16)
    assert any("float16" in p for p in space.violations(dataclasses.replace(space.heuristic(), GRAD_IN_FWD=1)))
    gen = seeded("fp16-scale")
    x, t = _case(16, 3000, torch.float16, device, gen)
    x = x.requires_grad_()
    (cross_entropy(x, t) * 65536.0).backward()
    x64 = x.detach().double().requires_grad_()
    (cross_entropy_float64(x64, t)[0] * 65536.0).backward()
    nonzero_ref = x64.grad.abs() > 1e-6  # representable in fp16 after the scale
    assert (x.grad[nonzero_ref] != 0).all()
    assert rel_l2(x.grad, x64.grad) < REL_TOL[torch.float16]


# ------------------------------------------------------------------------------------------------ named regressions


def test_regression_1_none_reduction_upstream_gradient_equals_pytorch(strategy, device):
    gen = seeded("reg1")
    x, t = _case(8, 15, torch.float32, device, gen)
    t[2] = t[5] = -100
    g = torch.randn(8, generator=gen).to(device)
    x1 = x.clone().requires_grad_()
    cross_entropy(x1, t, reduction="none").backward(g)
    x2 = x.clone().requires_grad_()
    F.cross_entropy(x2, t, reduction="none").backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(x1.grad[2], torch.zeros(15, device=device)) and torch.equal(x1.grad[5], x1.grad[2])


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_regression_2_every_target_ignored(reduction, label_smoothing, weighted, strategy, device):
    gen = seeded("reg2")
    x, _ = _case(4, 7, torch.float32, device, gen)
    t = torch.full((4,), -100, device=device)
    w = (0.5 + torch.rand(7, generator=gen)).to(device) if weighted else None
    x1 = x.clone().requires_grad_()
    loss = cross_entropy(x1, t, w, reduction=reduction, label_smoothing=label_smoothing)
    loss.backward()
    expected = F.cross_entropy(x.clone(), t, w, reduction=reduction, label_smoothing=label_smoothing)
    torch.testing.assert_close(loss, expected, equal_nan=True)  # mean: NaN (0/0) as torch; sum: 0
    assert torch.equal(x1.grad, torch.zeros_like(x))


def test_regression_3_confident_bf16_row_keeps_its_tiny_true_class_gradient(strategy, device):
    gen = seeded("reg3")
    v = 32000
    x = 3.0 * torch.randn(4, v, generator=gen)
    t = torch.randint(0, v, (4,), generator=gen)
    x[torch.arange(4), t] = x.max(dim=1).values + 12.0
    x = x.to(device, torch.bfloat16).requires_grad_()
    t = t.to(device)
    x64 = x.detach().double().requires_grad_()
    p_true = torch.softmax(x64.detach(), -1)[torch.arange(4), t]
    assert (p_true > 0.999).all() and (p_true < 1).all()  # ≈ 0.9999: p − 1 is ~1e-4, below bf16's resolution of 1
    cross_entropy(x, t).backward()
    cross_entropy_float64(x64, t)[0].backward()
    got, ref = x.grad[torch.arange(4), t].double(), x64.grad[torch.arange(4), t]
    assert ((got - ref).abs() / ref.abs() < 1e-2).all(), (got, ref)


@pytest.mark.parametrize("in_place", [False, True], ids=["separate", "in-place"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "softcap": 30.0, "weighted": True}],
                         ids=["plain", "smooth-softcap-weighted"])
@pytest.mark.parametrize("block_v", [256, 8192])
def test_streamed_gradient_kernel_keeps_confident_rows_to_fp32_accuracy(block_v, opts, in_place, device):
    """The gradient-writing kernel over several vocab tiles (the last one partial, two rows per program) sums
    1 − p_y apart from the target in its second pass (the target's tile read first) and rewrites the target
    column last: confident rows keep their tiny loss and target gradient to fp32 relative accuracy wherever the
    target sits and whatever the logits' shift, also when the gradient overwrites the logits."""
    gen = seeded("confident-streamed", block_v, in_place, tuple(opts))
    rows, v = 8, 9000
    x = torch.randn(rows, v, generator=gen, dtype=torch.float64)
    t = torch.tensor([0, 255, 256, v - 1, 600, -100, 8192, 8191])
    margin = 16.5 + 2.0 * torch.rand(rows, generator=gen, dtype=torch.float64)
    hit = t >= 0
    x[hit.nonzero()[:, 0], t[hit]] = x.max(dim=1).values[hit] + margin[hit]
    if "softcap" not in opts:  # a shift softmax does not see: q must not carry lse's rounding (|lse|·2^-24)
        x[1::2] += 1000.0
    opts = dict(opts)
    weight = (0.5 + torch.rand(v, generator=gen)).to(device) if opts.pop("weighted", False) else None
    x = x.float().to(device)
    t = t.to(device)
    x64 = x.double().requires_grad_()
    ref_rows, _ = cross_entropy_float64(x64, t, weight, reduction="none", **opts)
    ref_rows.sum().backward()
    p_y = torch.softmax((x64.detach() if opts.get("softcap") is None
                         else opts["softcap"] * torch.tanh(x64.detach() / opts["softcap"])), -1)
    q_ref = 1 - p_y[hit.nonzero()[:, 0], t.cpu()[hit]]
    assert (q_ref < 1e-3).all() and (q_ref > 0).all(), q_ref  # 1 − p_y far below fp32's resolution of 1 − ε
    base = CrossEntropySpace(v, torch.float32, DeviceLimits.interpreter()).heuristic()
    config = dataclasses.replace(base, GRAD_IN_FWD=1, BLOCK_V_BWD=block_v, BLOCK_M_BWD=2, num_warps_bwd=4)
    src = x.clone()
    grad = src if in_place else torch.empty_like(x)
    loss_rows, _, _ = cross_entropy_loss_and_grad(src, t, grad, weight=weight, config=config, **opts)
    ok_rows = hit.nonzero()[:, 0].to(device)
    rel_loss = ((loss_rows.double() - ref_rows.detach()).abs() / ref_rows.detach().abs())[ok_rows]
    assert (rel_loss < 1e-5).all(), rel_loss
    got_y = grad[ok_rows, t[ok_rows]].double()
    ref_y = x64.grad[ok_rows, t[ok_rows]]
    assert ((got_y - ref_y).abs() / ref_y.abs() < 1e-5).all(), (got_y, ref_y)
    assert rel_l2(grad, x64.grad) < FP32_OUT_TOL * 10
    assert torch.equal(grad[5], torch.zeros_like(grad[5]))  # the ignored row


@pytest.mark.parametrize("want_grad", [False, True], ids=["loss-only", "with-grad"])
def test_a_row_whose_first_tiles_are_all_minus_inf_is_finite(want_grad, device):
    """The running max starts at −inf: a row whose first vocab tiles hold only −inf (masked-out vocabulary)
    must not fold exp(−inf − (−inf)) = NaN into its sum, with or without the gradient."""
    gen = seeded("minus-inf-tiles", want_grad)
    rows, v = 5, 1100
    x = torch.randn(rows, v, generator=gen)
    x[0, :600] = float("-inf")
    x[3, 256:] = float("-inf")
    t = torch.tensor([700, 3, 5, 10, 1099])
    x, t = x.to(device), t.to(device)
    base = CrossEntropySpace(v, torch.float32, DeviceLimits.interpreter()).heuristic()
    config = dataclasses.replace(base, GRAD_IN_FWD=1, BLOCK_V_BWD=256, BLOCK_M_BWD=2, num_warps_bwd=4,
                                 BLOCK_V_FWD=256, BLOCK_M_FWD=2, num_warps_fwd=4)
    x64 = x.double().requires_grad_()
    ref_rows, _ = cross_entropy_float64(x64, t, reduction="none")
    ref_rows.sum().backward()
    grad = torch.empty_like(x) if want_grad else None
    loss_rows, _, _ = cross_entropy_loss_and_grad(x.clone(), t, grad, config=config)
    assert torch.isfinite(loss_rows).all(), loss_rows
    assert rel_l2(loss_rows, ref_rows) < FP32_OUT_TOL
    if want_grad:
        assert torch.isfinite(grad).all() and rel_l2(grad, x64.grad) < FP32_OUT_TOL * 10


def test_regression_5_bf16_vocab_256000_loss(device):
    """16M elements; about 1 s in the interpreter on this machine."""
    gen = seeded("reg5")
    x, t = _case(64, 256000, torch.bfloat16, device, gen, ignore=(7,), scale=2.0)
    loss = cross_entropy(x, t)
    ref, _ = cross_entropy_float64(x, t)
    assert abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-3


@pytest.mark.parametrize("make_view", [
    lambda b: b.t(),                              # transposed: last dim of non-unit stride (copied)
    lambda b: b[:, 5:70],                         # sliced columns: unit stride, row stride 90
    lambda b: b[::2],                             # every other row
    lambda b: b.view(6, 15, 90)[:, :-2, 7:80],    # (B, T, V) that no 2-D view covers: run in place, 3-D layout
    lambda b: b.view(3, 2, 15, 90)[:, :, 1:, 3:], # 4-D that no 2-D view covers (reshaped to rows)
], ids=["transposed", "col-slice", "row-step", "3d-shifted", "4d"])
def test_regression_7_non_contiguous_logits(make_view, strategy, device):
    gen = seeded("reg7")
    base = (2.0 * torch.randn(90, 90, generator=gen)).to(device)
    x = make_view(base)
    assert not x.is_contiguous()
    t = torch.randint(0, x.shape[-1], x.shape[:-1], generator=gen).to(device)
    t.view(-1)[::5] = -100
    for reduction in ("mean", "none"):
        _assert_matches_float64(x, t, reduction=reduction, label_smoothing=0.1)


def test_shifted_3d_view_runs_without_a_copy():
    """logits[:, :-1] of (B, T, V) has no 2-D view: the kernels read it through a (B, T, V) layout instead."""
    from liger_gen.ops.lm_head.cross_entropy import _rows_layout

    base = torch.randn(4, 9, 33)
    shifted = base[:, :-1]
    assert _rows_layout(shifted).data_ptr() == shifted.data_ptr() and _rows_layout(shifted).dim() == 3
    assert _rows_layout(base[:, 2:]).dim() == 3
    assert _rows_layout(base).shape == (36, 33) and _rows_layout(base[:1, :-1]).shape == (8, 33)


# ------------------------------------------------------------------------------------------------ options vs float64

OPTION_SETS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"weighted": True},
    {"weighted": True, "label_smoothing": 0.25, "reduction": "mean"},
    {"weighted": True, "label_smoothing": 1.0, "reduction": "none"},
    {"lse_square_scale": 1e-2},
    {"lse_square_scale": 1e-3, "weighted": True, "reduction": "mean"},
    {"softcap": 4.0},
    {"softcap": 30.0, "label_smoothing": 0.1, "lse_square_scale": 1e-4, "weighted": True, "reduction": "sum"},
    {"ignore_index": 3},
]


def _options(opts, vocab, device, gen, dtype=torch.float32):
    opts = dict(opts)
    if opts.pop("weighted", False):
        opts["weight"] = (0.5 + torch.rand(vocab, generator=gen)).to(device, dtype)
    return opts


@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_matches_float64(opts, dtype, strategy, device):
    _skip_duplicate(dtype, strategy)
    gen = seeded("opts", opts, dtype)
    x, t = _case(11, 133, dtype, device, gen, ignore=(0, 4))  # 133: no tile divides it
    t[7] = 3
    t[t == -100] = opts.get("ignore_index", -100)
    _assert_matches_float64(x, t, **_options(opts, 133, device, gen))


@pytest.mark.parametrize("opts", [o for o in OPTION_SETS if "softcap" not in o and "lse_square_scale" not in o],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_float64_reference_equals_torch(opts):
    """The float64 reference is torch.nn.functional.cross_entropy for every option they share."""
    gen = seeded("ref", opts)
    x, t = _case(10, 29, torch.float64, "cpu", gen, ignore=(2, 3))
    t[5] = 3
    t[t == -100] = opts.get("ignore_index", -100)
    o = _options(opts, 29, "cpu", gen, torch.float64)
    ours, z = cross_entropy_float64(x, t, **o)
    torch.testing.assert_close(ours, F.cross_entropy(x, t, **o), rtol=1e-12, atol=1e-12)
    assert (z == 0).all()


def test_z_loss_and_softcap_reference_formulas():
    """z-loss = λ·lse² per non-ignored row (mean: over their count, also with weights); softcap = s·tanh(x/s) first."""
    gen = seeded("zl")
    x, t = _case(6, 11, torch.float64, "cpu", gen, ignore=(1,))
    w = 0.5 + torch.rand(11, generator=gen, dtype=torch.float64)
    lse = torch.logsumexp(x, -1)
    valid = t != -100
    loss, z = cross_entropy_float64(x, t, w, lse_square_scale=0.3)
    torch.testing.assert_close(z, 0.3 * (lse[valid] ** 2).mean())
    torch.testing.assert_close(loss, F.cross_entropy(x, t, w) + z)
    capped = cross_entropy_float64(x, t, softcap=2.5)[0]
    torch.testing.assert_close(capped, F.cross_entropy(2.5 * torch.tanh(x / 2.5), t))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 50), (1, 7), (3, 1), (2, 3, 40), (5,), (3, 20000)])
def test_shapes_and_dtypes(shape, dtype, strategy, device):
    """One row, one class, 1-D and 3-D logits, and a vocab streamed in tiles with a partial last tile."""
    _skip_duplicate(dtype, strategy)
    gen = seeded("shapes", shape, dtype)
    x = (2.0 * torch.randn(shape, generator=gen)).to(device, dtype)
    t = torch.randint(0, shape[-1], shape[:-1], generator=gen).to(device)
    for reduction in ("mean", "none"):
        _assert_matches_float64(x, t, reduction=reduction)


def test_int32_targets_and_weight_dtypes(device):
    gen = seeded("int32")
    x, t = _case(9, 64, torch.bfloat16, device, gen, ignore=(4,))
    w32 = (0.5 + torch.rand(64, generator=gen)).to(device)
    for w in (w32, w32.bfloat16()):  # torch requires weight in logits' dtype; any float dtype is read as fp32
        a = cross_entropy(x, t.int(), w, label_smoothing=0.1)
        b = cross_entropy(x, t, w, label_smoothing=0.1)
        assert torch.equal(a, b)
        assert rel_l2(a, cross_entropy_float64(x, t, w, label_smoothing=0.1)[0]) < FP32_OUT_TOL


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.0])
def test_upstream_gradient_scaling_of_reduced_loss(scale, strategy, device):
    """A mean loss multiplied before backward (gradient accumulation): the stored gradient is rescaled."""
    gen = seeded("scale", scale)
    x, t = _case(6, 300, torch.float32, device, gen, ignore=(2,))
    _assert_matches_float64(x, t, upstream=torch.tensor(scale, device=device), lse_square_scale=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (set before kernels are defined)")
def test_out_of_range_target_raises_on_both_cpu_paths(monkeypatch):
    """As in PyTorch, a target outside [0, V) that is not ignore_index is an error: in the interpreter a
    ValueError naming the value, on the plain path torch's own error. (CUDA: a device-side assertion, tested in a
    subprocess by ``test_out_of_range_target_is_a_device_side_assertion_on_gpu``.) The row-level kernel API,
    which FLCE calls after checking once, leaves such a row NaN."""
    gen = seeded("oob")
    x, t = _case(5, 20, torch.float32, "cpu", gen)
    for bad in (20, -1):
        t2 = t.clone()
        t2[3] = bad
        for reduction in REDUCTIONS:
            with pytest.raises(ValueError, match=rf"target of shape \(5,\), dtype torch.int64, device cpu holds "
                                                 rf".*\[0, 20\).*ignore_index=-100: e.g. {bad} at position 3"):
                cross_entropy(x, t2, reduction=reduction)
        loss_rows, _, _ = cross_entropy_loss_and_grad(x, t2)
        assert torch.isnan(loss_rows[3]) and torch.isfinite(loss_rows[[0, 1, 2, 4]]).all()
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises((IndexError, RuntimeError)):
            cross_entropy(x, t2)
        monkeypatch.setenv("TRITON_INTERPRET", "1")


_DEVICE_ASSERT_SCRIPT = textwrap.dedent("""
    import sys, torch
    from liger_gen.functional import cross_entropy, fused_linear_cross_entropy
    op, bad, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    def step(x, w, t):
        if op == "ce":
            return cross_entropy(x @ w.t(), t)
        return fused_linear_cross_entropy(x, w, t)
    if mode == "compile":
        step = torch.compile(step, fullgraph=True)
    for target in ("valid", bad):
        x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(1000, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, 1000, (64,), device="cuda")
        t[::7] = -100
        if target != "valid":
            t[17] = target
        loss = step(x, w, t)
        loss.backward()
        print(target, "loss", float(loss), flush=True)
""")


@pytest.mark.gpu
@pytest.mark.parametrize("op,mode,bad", [("ce", "eager", 1000), ("flce", "eager", -2), ("ce", "compile", -2),
                                         ("flce", "compile", 1000)])
def test_out_of_range_target_is_a_device_side_assertion_on_gpu(op, mode, bad):
    """On CUDA the targets are checked on the device, without a host sync: valid targets run, then a bad one
    stops the process with "device-side assert triggered" (PyTorch's behaviour), eagerly and compiled. A
    subprocess, since a device-side assertion leaves the CUDA context unusable."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run([sys.executable, "-c", _DEVICE_ASSERT_SCRIPT, op, str(bad), mode], env=env,
                          capture_output=True, text=True, timeout=300)
    assert "valid loss" in done.stdout, done.stderr[-3000:]
    assert done.returncode != 0 and f"{bad} loss" not in done.stdout, done.stdout
    assert "device-side assert" in done.stderr and "outside [0, n_classes)" in done.stderr + done.stdout, \
        done.stderr[-3000:]


@pytest.mark.gpu
def test_target_check_is_captured_by_a_cuda_graph():
    """The check is one launch and no sync, so a CUDA graph captures the loss with it and replays it."""
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 4096, (256,), device="cuda")
    expected = cross_entropy(x, t)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cross_entropy(x, t)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = cross_entropy(x, t)
    t.copy_(torch.randint(0, 4096, (256,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(static) and not torch.equal(static, expected)
    torch.testing.assert_close(static, cross_entropy(x, t))


# ------------------------------------------------------------------------------------------------ runtime behaviour


def test_cpu_path_is_torch(monkeypatch):
    """Without the interpreter, CPU tensors run plain PyTorch: float32 is bit-identical to F.cross_entropy."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = seeded("cpu")
    x, t = _case(12, 40, torch.float32, "cpu", gen, ignore=(3,))
    w = 0.5 + torch.rand(40, generator=gen)
    for red in REDUCTIONS:
        ours = cross_entropy(x, t, w, reduction=red, label_smoothing=0.1)
        assert torch.equal(ours, F.cross_entropy(x, t, w, reduction=red, label_smoothing=0.1))
        assert torch.equal(ours, cross_entropy_torch(x, t, w, reduction=red, label_smoothing=0.1))
    loss, z = cross_entropy(x.double(), t, lse_square_scale=0.1, softcap=3.0, return_z_loss=True)
    ref, ref_z = cross_entropy_float64(x, t, lse_square_scale=0.1, softcap=3.0)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(z, ref_z)
    assert cross_entropy(x.bfloat16(), t).dtype == torch.float32



@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_inputs_match_pytorch(shape, reduction, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    t = torch.zeros(shape[:-1], dtype=torch.int64, device=device)
    loss = cross_entropy(x, t, reduction=reduction)
    expected = F.cross_entropy(x.detach().reshape(-1, 16), t.reshape(-1), reduction=reduction)
    torch.testing.assert_close(loss.reshape(-1), expected.reshape(-1), equal_nan=True)
    assert loss.shape == (t.shape if reduction == "none" else ())
    loss.sum().backward()
    assert x.grad.shape == x.shape


def test_no_grad_and_inference_mode(device):
    gen = seeded("nograd")
    x, t = _case(4, 30, torch.float32, device, gen)
    x = x.requires_grad_()
    with torch.no_grad():
        a = cross_entropy(x, t)
    with torch.inference_mode():
        b = cross_entropy(x.detach(), t)
        w = torch.rand(30, device=device) + 0.5
        ti = t.clone()
    assert torch.equal(a, b)
    cross_entropy(x, ti, w).backward()  # inference-mode target and weight with a trained input
    x64 = x.detach().double().requires_grad_()
    cross_entropy_float64(x64, t, w)[0].backward()
    assert rel_l2(x.grad, x64.grad) < REL_TOL[torch.float32]


def test_double_backward_raises(strategy, device):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    t = torch.randint(0, 32, (6,), device=device)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(cross_entropy(x, t), x, create_graph=True)


def test_retain_graph_second_backward(strategy, device):
    """Recompute gives the same gradient twice; the stored gradient of GRAD_IN_FWD=1 refuses a second use."""
    x = torch.randn(6, 32, device=device, requires_grad=True)
    t = torch.randint(0, 32, (6,), device=device)
    loss = cross_entropy(x, t)
    (g1,) = torch.autograd.grad(loss, x, torch.tensor(2.0, device=device), retain_graph=True)
    if strategy["GRAD_IN_FWD"]:
        with pytest.raises(RuntimeError, match="backward ran twice"):
            torch.autograd.grad(loss, x, torch.tensor(2.0, device=device))
    else:
        (g2,) = torch.autograd.grad(loss, x, torch.tensor(2.0, device=device))
        assert torch.equal(g1, g2)


def test_z_loss_is_returned_but_not_differentiable(device):
    x = torch.randn(5, 20, device=device, requires_grad=True)
    t = torch.randint(0, 20, (5,), device=device)
    loss, z = cross_entropy(x, t, lse_square_scale=1e-2, return_z_loss=True)
    assert z.shape == () and not z.requires_grad and loss.requires_grad
    loss0, z0 = cross_entropy(x, t, return_z_loss=True)
    assert z0.item() == 0.0
    torch.testing.assert_close(loss - z, loss0)


def test_torch_compile_has_no_graph_break(device):
    gen = seeded("compile")
    x, t = _case(8, 70, torch.float32, device, gen, ignore=(1,))
    w = (0.5 + torch.rand(70, generator=gen)).to(device)

    def f(x, t, w):
        loss, z = cross_entropy(x, t, w, label_smoothing=0.1, lse_square_scale=1e-3, softcap=8.0, return_z_loss=True)
        rows = cross_entropy(x[:, :60], t.clamp(max=59), reduction="none")
        return loss + (rows * rows).mean(), z

    x1 = x.clone().requires_grad_()
    loss, z = torch.compile(f, backend="aot_eager", fullgraph=True)(x1, t, w)
    loss.backward()
    x2 = x.clone().requires_grad_()
    ref, ref_z = f(x2, t, w)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(z, ref_z)
    torch.testing.assert_close(x1.grad, x2.grad)


def test_opcheck_custom_ops(device):
    x = torch.randn(5, 40, device=device)
    t = torch.randint(0, 40, (5,), device=device)
    w = torch.rand(40, device=device)
    for args in ((x, t, None, -100, "mean", 0.0, 0.0, None, False, False),
                 (x, t, w, -100, "none", 0.1, 1e-3, 3.0, False, False),
                 (x, t, w, -100, "mean", 0.1, 1e-3, 3.0, True, False),
                 (x, t, w, -100, "mean", 0.1, 1e-3, 3.0, False, True)):
        torch.library.opcheck(torch.ops.liger_gen.cross_entropy_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    for token_scaling in (False, True):
        loss, _, lse, q, scale, _ = torch.ops.liger_gen.cross_entropy_fwd(x, t, w, -100, "none", 0.1, 1e-3, 3.0,
                                                                          False, token_scaling)
        torch.library.opcheck(torch.ops.liger_gen.cross_entropy_bwd.default,
                              (torch.ones_like(loss), x, t, w, lse, q, scale, -100, "none", 0.1, 1e-3, 3.0,
                               token_scaling),
                              test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------------------------------------ bad input


def _bad_inputs():
    x, t = torch.randn(4, 8), torch.zeros(4, dtype=torch.int64)
    return [
        (dict(logits=x, target=torch.zeros(5, dtype=torch.int64)), ValueError, ["target", "(5,)", "(4,)"]),
        (dict(logits=x, target=torch.zeros(4, 1, dtype=torch.int64)), ValueError, ["target", "(4, 1)"]),
        (dict(logits=x, target=torch.zeros(4)), TypeError, ["target", "torch.float32", "int64"]),
        (dict(logits=x, target=torch.zeros(4, dtype=torch.int16)), TypeError, ["target", "torch.int16"]),
        (dict(logits=torch.ones(4, 8, dtype=torch.int64), target=t), TypeError, ["logits", "(4, 8)", "torch.int64"]),
        (dict(logits=torch.ones(4, 0), target=t), ValueError, ["logits", "(4, 0)"]),
        (dict(logits=x, target=t, weight=torch.ones(7)), ValueError, ["weight", "(7,)", "(8,)"]),
        (dict(logits=x, target=t, weight=torch.ones(2, 8)), ValueError, ["weight", "(2, 8)"]),
        (dict(logits=x, target=t, weight=torch.ones(8, dtype=torch.int64)), TypeError, ["weight", "torch.int64"]),
        (dict(logits=x, target=t, weight=torch.ones(8, requires_grad=True)), ValueError, ["weight", "requires_grad"]),
        (dict(logits=x, target=t, softcap=0.0), ValueError, ["softcap", "0.0"]),
        (dict(logits=x, target=t, softcap=-3.0), ValueError, ["softcap", "-3.0"]),
        (dict(logits=x, target=t, softcap="30"), TypeError, ["softcap"]),
        (dict(logits=x, target=t, label_smoothing=1.5), ValueError, ["label_smoothing", "1.5"]),
        (dict(logits=x, target=t, label_smoothing=-0.1), ValueError, ["label_smoothing", "-0.1"]),
        (dict(logits=x, target=t, lse_square_scale=-1.0), ValueError, ["lse_square_scale"]),
        (dict(logits=x, target=t, reduction="avg"), ValueError, ["reduction", "'avg'"]),
        (dict(logits=x, target=t, ignore_index=-100.0), TypeError, ["ignore_index"]),
        (dict(logits=x, target=t, return_z_loss=1), TypeError, ["return_z_loss"]),
        (dict(logits=x.double(), target=t), TypeError, ["float64", "(4, 8)"]),
        (dict(logits=[1.0], target=t), TypeError, ["logits"]),
    ]


@pytest.mark.parametrize("kwargs,exc,words", _bad_inputs())
def test_bad_input_names_argument_shape_dtype(kwargs, exc, words, device):
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) and not v.requires_grad else v
              for k, v in kwargs.items()}
    with pytest.raises(exc) as info:
        cross_entropy(**kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensors_on_other_devices_are_an_error():
    with pytest.raises(ValueError, match="one device"):
        cross_entropy(torch.ones(2, 4, device="cuda"), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="one device"):
        cross_entropy(torch.ones(2, 4, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda"),
                      torch.ones(4))


def test_loss_and_grad_bad_input(device):
    x, t = torch.randn(4, 8, device=device), torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="2-D"):
        cross_entropy_loss_and_grad(x.view(2, 2, 8), t.view(2, 2))
    with pytest.raises(ValueError, match=r"dlogits.*\(4, 7\)"):
        cross_entropy_loss_and_grad(x, t, torch.empty(4, 7, device=device))
    with pytest.raises(TypeError, match="dlogits"):
        cross_entropy_loss_and_grad(x, t, torch.empty(4, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="scale"):
        cross_entropy_loss_and_grad(x, t, scale=torch.ones(3, device=device))
    with pytest.raises(ValueError, match="grad_output"):
        cross_entropy_loss_and_grad(x, t, grad_output=torch.ones(5, device=device))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_reduce(x[:, 0], x[:, 1], "max")


# ------------------------------------------------------------------------------------------------ space and tuning


@pytest.mark.parametrize("dtype", DTYPES)
def test_heuristic_valid_for_every_vocab(dtype):
    vocabs = list(range(1, 300)) + [2 ** k + d for k in range(9, 19) for d in (-1, 0, 1)]
    vocabs += [32000, 32768, 50257, 128256, 151936, 152064, 256000, 262144]
    for limits in (DeviceLimits(), DeviceLimits.interpreter(), DeviceLimits(max_shared_memory_per_block=101376)):
        for v in vocabs:
            space = CrossEntropySpace(v, dtype, limits)
            config = space.heuristic()
            assert not space.violations(config), (v, space.violations(config))
            sampled = {p.name: p.choices for p in space.params("fwd")}  # what the tuner samples (narrowed tiles)
            assert config.BLOCK_V_FWD in sampled["BLOCK_V_FWD"] and config.BLOCK_V_BWD in sampled["BLOCK_V_BWD"]
            assert all(c <= space.block_v_full for c in sampled["BLOCK_V_BWD"])


def test_constraints_reject_bad_configs():
    space = CrossEntropySpace(128256, torch.bfloat16, DeviceLimits(max_threads_per_block=512))
    good = space.heuristic()
    assert any("threads" in p for p in space.violations(dataclasses.replace(good, num_warps_bwd=32)))
    assert any("per thread" in p for p in space.violations(dataclasses.replace(good, BLOCK_V_FWD=32768,
                                                                               num_warps_fwd=4)))
    assert any("smaller than" in p for p in space.violations(dataclasses.replace(good, BLOCK_V_BWD=64)))
    hopper_small_smem = CrossEntropySpace(128256, torch.bfloat16, DeviceLimits(max_shared_memory_per_block=101376))
    assert any("shared memory" in p for p in hopper_small_smem.violations(dataclasses.replace(
        good, BLOCK_V_BWD=32768, num_warps_bwd=16, num_stages_bwd=4)))
    small = CrossEntropySpace(100, torch.float32)
    assert any("fits a smaller tile" in p for p in small.violations(dataclasses.replace(small.heuristic(),
                                                                                        BLOCK_V_FWD=256)))
    with pytest.raises(ValueError, match="unknown fields"):
        CrossEntropyConfig.from_dict({**good.to_dict(), "BLOCK_K": 2})
    with pytest.raises(ValueError, match="non-negative int"):
        CrossEntropyConfig.from_dict({**good.to_dict(), "GRAD_IN_FWD": "yes"})


@pytest.mark.parametrize("problem_opts", [
    {},
    {"reduction": "none"},
    {"reduction": "sum", "weighted": True, "label_smoothing": 0.1},
    {"softcap": 20.0, "lse_square_scale": 1e-3, "weighted": True},
], ids=["mean", "none", "sum-weighted-smooth", "softcap-zloss"])
@pytest.mark.parametrize("changes", [
    {"GRAD_IN_FWD": 1},                                                              # one tile, rows in registers
    {"GRAD_IN_FWD": 1, "BLOCK_V_BWD": 512, "BLOCK_M_BWD": 2, "num_warps_bwd": 4},    # streamed, 2 rows
    {"GRAD_IN_FWD": 0, "BLOCK_V_FWD": 512, "BLOCK_M_FWD": 4, "num_warps_fwd": 4,
     "BLOCK_V_BWD": 1024, "BLOCK_M_BWD": 1, "num_stages_bwd": 2},                    # streamed fwd and bwd
    {"GRAD_IN_FWD": 0, "BLOCK_V_FWD": 2048, "BLOCK_M_FWD": 1, "BLOCK_V_BWD": 2048},  # one tile, recompute
], ids=["grad-in-fwd-one-tile", "grad-in-fwd-streamed", "recompute-streamed", "recompute-one-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_template_branch_passes_the_tuners_gate(changes, problem_opts, dtype, device):
    from liger_gen.codegen.build import load_variant

    problem = CrossEntropyProblem(dtype, 1100, 7, device, seed=5, **problem_opts)
    config = dataclasses.replace(problem.space.heuristic(), **changes)
    assert not problem.space.violations(config)
    module = load_variant("cross_entropy", problem.template_params(config))
    assert problem.check(module, "fwd") is None


def test_gate_catches_a_wrong_gradient(device):
    from liger_gen.codegen.build import load_variant

    problem = CrossEntropyProblem(torch.float32, 300, 9, device)
    module = load_variant("cross_entropy", problem.template_params(problem.space.heuristic()))

    class Corrupt:
        def __init__(self, m):
            self.m = m

        def scale_grad_(self, dlogits, g):
            dlogits[0, 0] += 0.05

        def __getattr__(self, name):
            return getattr(self.m, name)

    assert "dlogits" in problem.check(Corrupt(module), "fwd")


def test_tuner_produces_a_valid_entry(device):
    import optuna

    from liger_gen.tuning.search import Tuner

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def cost(launch, params):
        return 1.0 + 0.5 * params["GRAD_IN_FWD"] + abs(math.log2(params["BLOCK_V_BWD"]) - 9) * 0.1

    problem = CrossEntropyProblem(torch.float32, 700, 12, device, seed=2)
    entry = Tuner(n_trials=6, timer=cost, seed=1, retime_rounds=1).tune(problem)
    assert set(entry["timing_ms"]) == {"fwd"} and entry["dims"] == {"vocab": 700}
    assert entry["timing_ms"]["fwd"]["tuned"] <= entry["timing_ms"]["fwd"]["heuristic"]
    config = CrossEntropyConfig.from_dict(entry["config"])
    assert not problem.space.violations(config)
    assert entry["trials"]["fwd"][0]["params"] == problem.space.phase_params(problem.space.heuristic(), "fwd")


def test_tuning_problems_from_model_shape(monkeypatch):
    from liger_gen.models import PRESETS
    from liger_gen.ops.lm_head.cross_entropy import tuning_problems

    model = dataclasses.replace(PRESETS["llama3-8b"], vocab_size=300)
    problems = tuning_problems(model, [4, 16], torch.float32, "cpu")
    assert [p.rows for p in problems] == [4, 16] and problems[0].dims == {"vocab": 300}
    # the training step's floor, the bench's formula: logits read, dlogits written, targets read
    assert problems[0].bytes_moved("fwd") == 2 * 4 * 300 * 4 + 4 * 8
    import liger_gen.ops.lm_head.cross_entropy as ce

    built = []
    monkeypatch.setattr(ce, "CrossEntropyProblem", lambda dtype, vocab, rows, device, seed: built.append(rows))
    tuning_problems(model, [ce.MAX_TUNING_ROWS * 4, 16, ce.MAX_TUNING_ROWS], torch.float32, "cpu")
    assert built == [16, ce.MAX_TUNING_ROWS]  # capped, and the cap is built once


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile the kernels for real")
def test_kernels_compile_for_sm90():
    """The interpreter does not type-check like the compiler (e.g. loop-carried types): compile the heuristic
    variant's kernels to sm_90 cubin with every runtime flag on, in a process without TRITON_INTERPRET."""
    script = textwrap.dedent('''
        import inspect, torch, triton
        from triton.compiler import ASTSource
        from triton.backends.compiler import GPUTarget
        from liger_gen.codegen.build import load_variant
        from liger_gen.ops.lm_head.cross_entropy_space import CrossEntropySpace
        mod = load_variant("cross_entropy", CrossEntropySpace(128256, torch.bfloat16).heuristic().to_dict())
        F32 = ("label_smoothing", "lse_square_scale", "softcap")
        def sig(fn, consts):
            return {n: "constexpr" if n in consts else "*bf16" if n in ("x_ptr", "dx_ptr") else "*i64"
                    if n == "y_ptr" else "*fp32" if n.endswith("_ptr") else "fp32" if n in F32
                    else "i64" if "stride" in n else "i32" for n in inspect.signature(fn.fn).parameters}
        on = dict(HAS_WEIGHT=True, HAS_SMOOTH=True, HAS_SOFTCAP=True, HAS_SCALE=True, HAS_GRAD_OUT=True)
        off = {k: False for k in on}
        jobs = [(mod.ce_fwd_kernel, dict(f, WRITE_GRAD=g, STORE_Q=not g, BLOCK_M=m, BLOCK_V=v, ONE_TILE=one))
                for f in (on, off) for g in (False, True) for m, v, one in ((1, 16384, False), (2, 1024, True))]
        jobs += [(mod.ce_bwd_kernel, dict(on, BLOCK_M=1, BLOCK_V=16384)), (mod.ce_scale_grad_kernel, dict(BLOCK=4096)),
                 (mod.ce_mean_scale_kernel, dict(HAS_WEIGHT=True, BLOCK=1024)),
                 (mod.ce_reduce_kernel, dict(HAS_SCALE=True, BLOCK=1024))]
        for fn, consts in jobs:
            triton.compile(ASTSource(fn, sig(fn, consts), consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=8, num_stages=2))
        print("compiled", len(jobs))
    ''')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled 12" in done.stdout, done.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("grad_in_fwd", [1, 0])
def test_llama3_8b_shape_bf16_forward_backward_vs_float64(grad_in_fwd):
    """8192 tokens x 128256 vocab (Llama-3-8B's LM head), bf16, through the public op, against float64 in row
    chunks (the full float64 gradient alone would be 8.4 GB). Also the tuner's gate on both strategies."""
    from liger_gen.codegen.build import load_variant

    problem = CrossEntropyProblem(torch.bfloat16, 128256, 8192, "cuda", seed=3)
    with _forced_config(GRAD_IN_FWD=grad_in_fwd):
        x = problem.buffers["logits"].requires_grad_()
        t = problem.buffers["target"]
        loss = cross_entropy(x, t)
        loss.backward()
    assert rel_l2(loss, problem.ref["loss"]) < FP32_OUT_TOL
    problem.buffers["dlogits"] = x.grad
    assert problem.dlogits_error() < REL_TOL[torch.bfloat16]
    x.requires_grad_(False)
    config = dataclasses.replace(problem.space.heuristic(), GRAD_IN_FWD=grad_in_fwd)
    module = load_variant("cross_entropy", problem.template_params(config))
    assert problem.check(module, "fwd") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (set before kernels are defined)")
@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_out_of_range_target_raises_under_torch_compile_on_cpu(op):
    """The check runs inside the op, so a compiled graph raises too (it used to give a NaN loss silently)."""
    from liger_gen.functional import fused_linear_cross_entropy

    gen = seeded("oob-compile", op)
    x = torch.randn(6, 8, generator=gen)
    w = torch.randn(20, 8, generator=gen)
    t = torch.randint(0, 20, (6,), generator=gen)
    t[2] = 20

    def f(x, w, t):
        return cross_entropy(x @ w.t(), t) if op == "cross_entropy" else fused_linear_cross_entropy(x, w, t)

    with pytest.raises(ValueError, match=r"target.*\[0, 20\).*e\.g\. 20"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, t)


@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_torch_compile_with_dynamic_shapes_and_float_options(op, device):
    """dynamic=True makes the float options symbolic: the option checks must not call math.isfinite on them
    (fullgraph failed with "Unsupported torch.* op returned non-Tensor")."""
    from liger_gen.functional import fused_linear_cross_entropy

    gen = seeded("dynamic", op)
    w = torch.randn(20, 8, generator=gen).to(device)

    def f(x, t, lse_square_scale, softcap):
        opts = dict(lse_square_scale=lse_square_scale, softcap=softcap, label_smoothing=0.1)
        if op == "cross_entropy":
            return cross_entropy(x @ w.t(), t, **opts)
        return fused_linear_cross_entropy(x, w, t, **opts)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows, scale, cap in ((6, 1e-3, 3.0), (9, 2e-3, 5.0)):
        x = torch.randn(rows, 8, generator=gen).to(device)
        t = torch.randint(0, 20, (rows,), generator=gen).to(device)
        torch.testing.assert_close(compiled(x, t, scale, cap), f(x, t, scale, cap))


@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_numpy_scalars_are_taken_as_their_python_values(op):
    """NumPy scalars for the options (torch's own loss takes them): the same loss as the Python numbers."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(41)
    x, w = torch.randn(6, 8, generator=gen), torch.randn(20, 8, generator=gen)
    target = torch.tensor([1, 4, -100, 7, 19, 0])
    import liger_gen

    fn = getattr(liger_gen.functional, op)
    args = (x @ w.t(), target) if op == "cross_entropy" else (x, w, target)
    expected = fn(*args, ignore_index=-100, label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0)
    got = fn(*args, ignore_index=np.int64(-100), label_smoothing=np.float32(0.1), lse_square_scale=np.float64(1e-3),
             softcap=np.float32(5.0))
    torch.testing.assert_close(got, expected)
    with pytest.raises(TypeError, match="label_smoothing must be a real number"):
        fn(*args, label_smoothing=np.bool_(True))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_token_accuracy_and_predicted_tokens(interpret, monkeypatch):
    """The argmax class of each row of (B, T, V) logits and the share of non-ignored rows where it is the
    target, after the loss (and z-loss) in their order; the loss is unchanged by them."""
    import liger_gen

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(62)
    logits = (torch.randn(2, 9, 40, generator=gen) * 2).requires_grad_()
    target = torch.randint(0, 40, (2, 9), generator=gen)
    target[0, ::3] = -100
    loss, z, acc, pred = liger_gen.functional.cross_entropy(logits, target, softcap=4.0, return_z_loss=True,
                                                           return_token_accuracy=True, return_predicted_tokens=True)
    ref = logits.detach().double().argmax(-1)
    valid = target != -100
    assert pred.shape == target.shape and torch.equal(pred, ref)
    assert acc.item() == pytest.approx(((ref == target) & valid).sum().item() / valid.sum().item())
    torch.testing.assert_close(loss, liger_gen.functional.cross_entropy(logits, target, softcap=4.0), rtol=0, atol=0)
    loss.backward()
    assert logits.grad is not None
    with pytest.raises(TypeError, match="return_predicted_tokens must be a bool"):
        liger_gen.functional.cross_entropy(logits, target, return_predicted_tokens="yes")
    # reduction="none": the accuracy per token, as the loss (1 for a hit, 0 for a miss and at ignored tokens)
    per_row, per_acc = liger_gen.functional.cross_entropy(logits, target, reduction="none",
                                                          return_token_accuracy=True)
    assert per_row.shape == per_acc.shape == target.shape
    assert torch.equal(per_acc, ((ref == target) & valid).float())


TOKEN_SCALING_OPTIONS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"weighted": True, "lse_square_scale": 1e-2},  # a mean whose two denominators differ
    {"weighted": True, "label_smoothing": 0.2, "lse_square_scale": 1e-3, "softcap": 6.0, "reduction": "none"},
    {"softcap": 4.0, "label_smoothing": 0.1, "reduction": "sum"},
]


@pytest.mark.parametrize("opts", TOKEN_SCALING_OPTIONS,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_token_scaling_matches_float64(opts, dtype, interpret, monkeypatch):
    """use_token_scaling weighs each row (loss, smoothing and z-loss terms, and so its gradient) by its detached
    target probability: loss and dlogits against the float64 reference on both CPU paths, every option."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("token-scaling", opts, dtype, interpret)
    x, t = _case(13, 71, dtype, "cpu", gen, ignore=(1, 6), scale=1.5)  # scale 1.5: p_y is not negligible
    _assert_matches_float64(x, t, use_token_scaling=True, **_options(opts, 71, "cpu", gen))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_token_scaling_is_the_dft_loss(interpret, monkeypatch):
    """With the plain loss, token scaling is Dynamic Fine-Tuning's −sg(p_y)·log p_y averaged over non-ignored
    rows, written here from log_softmax in float64; its gradient is p_y times the plain cross-entropy's."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("dft", interpret)
    logits = (torch.randn(3, 7, 53, generator=gen) * 1.5).requires_grad_()
    target = torch.randint(0, 53, (3, 7), generator=gen)
    target[1, ::2] = -100
    loss = cross_entropy(logits, target, use_token_scaling=True)
    (grad,) = torch.autograd.grad(loss, logits)
    x64 = logits.detach().double().requires_grad_()
    valid = target != -100
    logp = torch.log_softmax(x64, -1).gather(-1, torch.where(valid, target, 0)[..., None]).squeeze(-1)
    dft = (-(logp.exp().detach() * logp) * valid).sum() / valid.sum()
    (ref_grad,) = torch.autograd.grad(dft, x64)
    assert abs(loss.item() - dft.item()) < FP32_OUT_TOL * abs(dft.item())
    assert rel_l2(grad, ref_grad) < REL_TOL[torch.float32]
    plain = torch.autograd.grad(cross_entropy(logits, target, reduction="sum"), logits)[0]
    p_y = logp.exp().detach().float() * valid
    assert rel_l2(grad, plain * (p_y / valid.sum())[..., None]) < REL_TOL[torch.float32]
    with pytest.raises(TypeError, match="use_token_scaling must be a bool"):
        cross_entropy(logits, target, use_token_scaling=1)


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_token_scaling_under_torch_compile(interpret, monkeypatch):
    """Token scaling compiles without a graph break (the custom ops carry the flag) and equals eager mode."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("token-scaling-compile", interpret)
    x, t = _case(9, 40, torch.float32, "cpu", gen, ignore=(2,), scale=1.5)
    w = 0.5 + torch.rand(40, generator=gen)

    def f(x):
        return cross_entropy(x, t, w, lse_square_scale=1e-2, softcap=5.0, use_token_scaling=True)

    assert_compiles_like_eager(f, x)


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("opts", [{"use_token_scaling": True}, {"lse_square_scale": 0.1},
                                  {"use_token_scaling": True, "lse_square_scale": 0.1, "weighted": True}],
                         ids=["token_scaling", "z_loss", "both_weighted"])
def test_every_row_ignored_gives_a_nan_mean_and_a_zero_gradient(opts, interpret, monkeypatch):
    """A batch of only ignored rows (e.g. prompt tokens): the mean is NaN, as torch's, and the gradient is zero
    on both CPU paths, as torch's cross-entropy gives it (not NaN, which would poison the weights)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("all-ignored", opts, interpret)
    x = torch.randn(5, 12, generator=gen, requires_grad=True)
    t = torch.full((5,), -100)
    loss = cross_entropy(x, t, **_options(opts, 12, "cpu", gen))
    (grad,) = torch.autograd.grad(loss, x)
    assert torch.isnan(loss) and torch.equal(grad, torch.zeros_like(grad))
