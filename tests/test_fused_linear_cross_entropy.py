"""Fused linear cross-entropy (chunk loop + per-chunk kernel, Triton interpreter on the CPU) against float64."""

import dataclasses
import gc
import math

import optuna
import pytest
import torch
import torch.nn.functional as F

from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.tuning.search import Tuner
from liger_gen.models import PRESETS
from liger_gen.ops.lm_head import chunks
from liger_gen.ops.lm_head import fused_linear_cross_entropy as flce_mod
from liger_gen.ops.lm_head.fused_linear_cross_entropy import (FusedLinearCrossEntropyProblem, fused_linear_cross_entropy,
                                                              fused_linear_cross_entropy_float64,
                                                              fused_linear_cross_entropy_float64_chunked,
                                                              fused_linear_cross_entropy_torch, tuning_problems)
from liger_gen.ops.lm_head.fused_linear_cross_entropy_plan import (FusedLinearCrossEntropyConfig,
                                                                   FusedLinearCrossEntropySpace)
from liger_gen.runtime.ops import clear_caches

from conftest import CPU_PATHS, seeded

optuna.logging.set_verbosity(optuna.logging.WARNING)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OP = fused_linear_cross_entropy


@pytest.fixture
def small_chunks(monkeypatch):
    """Force the smallest chunk (16 rows) so small problems take several chunks and a ragged last one."""
    monkeypatch.setattr(FusedLinearCrossEntropySpace, "MAX_EXTRA_BYTES", 1)
    clear_caches()
    yield FusedLinearCrossEntropySpace.CHUNK_CHOICES[0]
    monkeypatch.undo()
    clear_caches()


def _case(rows, hidden, vocab, dtype, device, gen, *, bias=False, ignore_every=5, leading=None):
    shape = (rows,) if leading is None else leading
    x = torch.randn(*shape, hidden, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * (2 / math.sqrt(hidden))).to(device, dtype).requires_grad_()
    b = (0.5 * torch.randn(vocab, generator=gen)).to(device, dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, shape, generator=gen)
    if ignore_every:
        target.view(-1)[::ignore_every] = -100
    return x, w, b, target.to(device)


def _check_against_float64(x, w, b, target, *, grad=None, loss_tol=None, **opts):
    """Forward (loss and z_loss) and every gradient against the unfused float64 reference."""
    loss, z = OP(x, w, target, bias=b, return_z_loss=True, **opts)
    if grad is None:
        grad = torch.randn(loss.shape, dtype=torch.float64).to(loss.device) if loss.dim() else torch.tensor(
            1.7, dtype=torch.float64, device=loss.device)
    assert loss.dtype == torch.float32 and z.dtype == torch.float32
    assert loss.shape == z.shape == (target.shape if opts.get("reduction") == "none" else ())
    loss.backward(grad.float())
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    loss64, z64 = fused_linear_cross_entropy_float64(x64, w64, target, bias=b64, return_z_loss=True, **opts)
    loss64.backward(grad)
    tol = REL_TOL[x.dtype]
    loss_tol = loss_tol or flce_mod.loss_tolerance(x.dtype)
    assert rel_l2(loss, loss64) < loss_tol, "loss"
    assert rel_l2(z, z64) < loss_tol, "z_loss"
    assert rel_l2(x.grad, x64.grad) < tol, "dx"
    assert rel_l2(w.grad, w64.grad) < tol, "dW"
    if b is not None:
        assert rel_l2(b.grad, b64.grad) < tol, "db"
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype


OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "smoothing": {"label_smoothing": 0.1},
    "class_weight": {"weight": True},
    "weight_smoothing": {"weight": True, "label_smoothing": 0.25},
    "z_loss": {"lse_square_scale": 1e-2},
    "softcap": {"softcap": 3.0},
    "everything": {"bias": True, "weight": True, "label_smoothing": 0.1, "lse_square_scale": 1e-3, "softcap": 5.0,
                   "ignore_index": 3},
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_matches_float64(option, reduction, dtype, device, small_chunks):
    """37 rows in chunks of 16 (ragged last chunk); reduction "none" with a random per-row upstream gradient."""
    gen = seeded(option, reduction, str(dtype))
    opts = dict(OPTIONS[option])
    vocab = 50
    x, w, b, target = _case(37, 24, vocab, dtype, device, gen, bias=opts.pop("bias", False))
    if opts.pop("weight", False):
        opts["weight"] = (0.25 + torch.rand(vocab, generator=gen)).to(device)
    if "ignore_index" in opts:
        target[target == -100] = opts["ignore_index"]
    _check_against_float64(x, w, b, target, reduction=reduction, **opts)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_matches_float64_on_the_plain_cpu_path(option, reduction, dtype, monkeypatch, small_chunks):
    """The same cases without the interpreter: the chunk loop's CPU GEMMs and cross_entropy's closed-form CPU
    gradient (no autograd inside the op)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    test_every_option_matches_float64(option, reduction, dtype, torch.device("cpu"), small_chunks)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored_matches_pytorch(reduction, device):
    """Regression 2: 4 rows, vocab 7, every target = ignore_index: PyTorch's loss (NaN for mean, 0 for sum), no
    exception, finite zero gradients."""
    gen = torch.Generator().manual_seed(2)
    x, w, b, _ = _case(4, 8, 7, torch.float32, device, gen, bias=True)
    target = torch.full((4,), -100, device=device)
    loss = OP(x, w, target, bias=b, reduction=reduction)
    expected = F.cross_entropy(x.detach() @ w.detach().t() + b.detach(), target, reduction=reduction)
    torch.testing.assert_close(loss, expected, equal_nan=True)
    assert math.isnan(loss.item()) == (reduction == "mean")
    loss.backward()
    for t in (x, w, b):
        assert torch.isfinite(t.grad).all() and not t.grad.any()


def test_bf16_llm_like_shape_gradients(device):
    """Regression 6: bf16, 64 rows, hidden 1024, vocab 8200: dx and dW within 2e-2 of float64."""
    gen = torch.Generator().manual_seed(6)
    # hidden 1024 keeps an LLM's GEMM depth; vocab 8200 still spans 5 of the kernel's 2048-wide tiles with a
    # masked tail (the interpreter's time grows with rows x tiles; 256 x 32000 took minutes, same errors)
    x, w, _, target = _case(64, 1024, 8200, torch.bfloat16, device, gen, ignore_every=7)
    loss = OP(x, w, target)
    loss.backward()
    loss64, _, dx64, dw64, _ = fused_linear_cross_entropy_float64_chunked(x, w, target, chunk_rows=256)
    assert rel_l2(loss, loss64) < flce_mod.loss_tolerance(torch.bfloat16)
    assert rel_l2(x.grad, dx64) < 2e-2
    assert rel_l2(w.grad, dw64) < 2e-2


@pytest.mark.parametrize("make_view", [
    lambda t: t.t(),                 # transposed: hidden has stride != 1
    lambda t: t[:, 5:29],            # sliced columns: unit stride, row stride 40
    lambda t: t[::2, :24],           # every other row
])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_non_contiguous_x(make_view, reduction, device, small_chunks):
    """Regression 7: transposed or sliced views of x give the float64 results."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(40, 40, generator=gen).to(device)
    x = make_view(base).detach().requires_grad_()
    assert not x.is_contiguous()
    rows, hidden = x.shape
    w = (torch.randn(33, hidden, generator=gen) / math.sqrt(hidden)).to(device).requires_grad_()
    target = torch.randint(0, 33, (rows,), generator=gen).to(device)
    _check_against_float64(x, w, None, target, reduction=reduction)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_and_ragged_chunks(rows, dtype, device, small_chunks):
    """Regression 8: one row, and rows that are not a multiple of the chunk size (16 here)."""
    gen = torch.Generator().manual_seed(rows)
    x, w, b, target = _case(rows, 20, 29, dtype, device, gen, bias=True, ignore_every=0)
    _check_against_float64(x, w, b, target, reduction="mean")


def test_leading_dims_and_reduction_none_shape(device, small_chunks):
    gen = torch.Generator().manual_seed(9)
    x, w, _, target = _case(None, 16, 21, torch.float32, device, gen, leading=(3, 7))
    _check_against_float64(x, w, None, target, reduction="none")
    _check_against_float64(x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(), None, target,
                           reduction="mean", label_smoothing=0.2)


def test_chunking_does_not_change_results(device, monkeypatch):
    gen = torch.Generator().manual_seed(10)
    x, w, b, target = _case(45, 16, 23, torch.float32, device, gen, bias=True)
    results = []
    for budget in (1, FusedLinearCrossEntropySpace.MAX_EXTRA_BYTES):
        monkeypatch.setattr(FusedLinearCrossEntropySpace, "MAX_EXTRA_BYTES", budget)
        clear_caches()
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        loss = OP(xs, ws, target, bias=bs, lse_square_scale=1e-3)
        loss.backward()
        results.append((loss, xs.grad, ws.grad, bs.grad))
    clear_caches()
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_int32_target_and_same_semantics_as_cross_entropy(device, small_chunks):
    """int32 targets work; values equal liger_gen's cross_entropy of the fp32 logits (same options)."""
    from liger_gen.ops.lm_head.cross_entropy import cross_entropy

    gen = torch.Generator().manual_seed(15)
    x, w, b, target = _case(26, 8, 19, torch.float32, device, gen, bias=True)
    opts = dict(weight=(0.5 + torch.rand(19, generator=gen)).to(device), label_smoothing=0.05,
                lse_square_scale=1e-2, softcap=3.0)
    for reduction in ("mean", "sum", "none"):
        ours = OP(x.detach(), w.detach(), target.int(), bias=b.detach(), reduction=reduction, return_z_loss=True,
                  **opts)
        theirs = cross_entropy(x.detach() @ w.detach().t() + b.detach(), target, reduction=reduction,
                               return_z_loss=True, **opts)
        for a, c in zip(ours, theirs):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_matches_unfused_pytorch_and_no_grad_forward(device, small_chunks):
    """Same as cross_entropy(x @ W.T) in fp32; under no_grad the forward computes no gradient, same loss."""
    gen = torch.Generator().manual_seed(11)
    x, w, _, target = _case(30, 12, 17, torch.float32, device, gen)
    expected = F.cross_entropy(x.detach() @ w.detach().t(), target)
    with torch.no_grad():
        torch.testing.assert_close(OP(x, w, target), expected)
    loss = OP(x, w, target)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fused_linear_cross_entropy_torch(x2, w2, target).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_no_grad_modes_compute_the_loss_only(mode, interpret, monkeypatch):
    """Under no_grad / inference_mode (an eval loop with a trainable lm_head) the op computes no dx or dW, on the
    kernel path and on the plain CPU path alike, and gives the same loss."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(21)
    x, w, _, target = _case(19, 8, 11, torch.float32, "cpu", gen)
    expected = F.cross_entropy(x.detach() @ w.detach().t(), target)
    seen = []
    run = flce_mod._Chunked.run

    def spy(self, scale, grad_output, need_dx, need_dw, need_db, need_pred=False):
        seen.append((need_dx, need_dw, need_db))
        return run(self, scale, grad_output, need_dx, need_dw, need_db, need_pred)

    monkeypatch.setattr(flce_mod._Chunked, "run", spy)
    with getattr(torch, mode)():
        loss = OP(x, w, target)
    torch.testing.assert_close(loss, expected)
    assert seen == [(False, False, False)] and not loss.requires_grad


def test_grad_for_one_input_only(device, small_chunks):
    gen = torch.Generator().manual_seed(12)
    x, w, b, target = _case(20, 8, 11, torch.float32, device, gen, bias=True)
    w.requires_grad_(False)
    for reduction in ("mean", "none"):
        x.grad = None
        loss = OP(x, w, target, bias=b.detach(), reduction=reduction)
        loss.sum().backward()
        x64 = x.detach().double().requires_grad_()
        fused_linear_cross_entropy_float64(x64, w, target, bias=b.detach(), reduction=reduction).sum().backward()
        assert rel_l2(x.grad, x64.grad) < REL_TOL[torch.float32]
        assert w.grad is None


def test_cpu_plain_path_and_float64(monkeypatch, small_chunks):
    """Without the interpreter the same chunk loop runs in plain PyTorch (cross_entropy's CPU fallback for the
    per-chunk loss and gradient); float64 is accepted there (unfused float64)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(13)
    for reduction in ("mean", "none"):
        x, w, b, target = _case(35, 16, 19, torch.bfloat16, "cpu", gen, bias=True)
        _check_against_float64(x, w, b, target, reduction=reduction, weight=torch.rand(19) + 0.5,
                               label_smoothing=0.1, lse_square_scale=1e-3, softcap=2.0)
    x, w, b, target = _case(35, 16, 19, torch.float64, "cpu", gen, bias=True)
    loss = OP(x, w, target, bias=b, softcap=4.0)
    loss.backward()
    x64, w64, b64 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = fused_linear_cross_entropy_float64(x64, w64, target, bias=b64, softcap=4.0)
    ref.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref)
    for a, r in ((x, x64), (w, w64), (b, b64)):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_inputs_match_pytorch(shape, reduction, device):
    x = torch.randn(*shape, 8, device=device, requires_grad=True)
    w = torch.randn(5, 8, device=device, requires_grad=True)
    target = torch.zeros(shape, dtype=torch.long, device=device)
    loss = OP(x, w, target, reduction=reduction)
    expected = F.cross_entropy(torch.zeros(0, 5, device=device), target.reshape(-1), reduction=reduction)
    torch.testing.assert_close(loss, expected.reshape(loss.shape), equal_nan=True)
    loss.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


def _bad(**changes):
    args = {"x": torch.ones(4, 8), "lm_head_weight": torch.ones(6, 8), "target": torch.zeros(4, dtype=torch.long)}
    return {**args, **changes}


@pytest.mark.parametrize("args,exc,words", [
    (_bad(lm_head_weight=torch.ones(6, 7)), ValueError, ["lm_head_weight", "(6, 7)", "(vocab, 8)", "(4, 8)"]),
    (_bad(lm_head_weight=torch.ones(6)), ValueError, ["lm_head_weight", "(6,)"]),
    (_bad(target=torch.zeros(5, dtype=torch.long)), ValueError, ["target", "(5,)", "(4,)"]),
    (_bad(target=torch.zeros(4, dtype=torch.int16)), TypeError, ["target", "int64", "torch.int16"]),
    (_bad(target=torch.zeros(4)), TypeError, ["target", "torch.float32"]),
    (_bad(x=torch.ones(4, 8, dtype=torch.int64)), TypeError, ["x", "(4, 8)", "torch.int64"]),
    (_bad(x=torch.ones(4, 8, dtype=torch.bfloat16)), TypeError, ["lm_head_weight", "bfloat16", "float32"]),
    (_bad(bias=torch.ones(5)), ValueError, ["bias", "(5,)", "(6,)"]),
    (_bad(bias=torch.ones(6, dtype=torch.float16)), TypeError, ["bias", "float16"]),
    (_bad(weight=torch.ones(7)), ValueError, ["weight", "(7,)", "(6,)"]),
    (_bad(weight=torch.ones(6, dtype=torch.long)), TypeError, ["weight", "torch.int64"]),
    (_bad(weight=torch.ones(6, requires_grad=True)), ValueError, ["weight", "requires_grad", "(6,)"]),
    (_bad(target=torch.tensor([0, 1, 6, -100])), ValueError, ["target", "[0, 6)", "6"]),
    (_bad(x="x"), TypeError, ["x", "str"]),
    (_bad(reduction="avg"), ValueError, ["reduction", "'avg'"]),
    (_bad(label_smoothing=1.5), ValueError, ["label_smoothing", "1.5"]),
    (_bad(label_smoothing="0.1"), TypeError, ["label_smoothing"]),
    (_bad(lse_square_scale=-1.0), ValueError, ["lse_square_scale"]),
    (_bad(softcap=0.0), ValueError, ["softcap"]),
    (_bad(ignore_index=1.0), TypeError, ["ignore_index"]),
    (_bad(return_z_loss=1), TypeError, ["return_z_loss"]),
    (_bad(x=torch.ones(4, 0), lm_head_weight=torch.ones(6, 0)), ValueError, ["hidden", "(4, 0)"]),
])
def test_bad_input_names_argument_shape_dtype(args, exc, words, device):
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    if device.type != "cpu" and "[0, 6)" in words:
        pytest.skip("target values are not checked on the GPU (host sync)")
    with pytest.raises(exc) as info:
        OP(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_float64_is_rejected_on_the_kernel_path(device):
    if device.type == "cpu":
        import os
        assert os.environ.get("TRITON_INTERPRET") == "1"
    x = torch.ones(3, 4, dtype=torch.float64, device=device)
    with pytest.raises(TypeError, match="float64"):
        OP(x, torch.ones(5, 4, dtype=torch.float64, device=device), torch.zeros(3, dtype=torch.long, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensors_on_other_devices_are_an_error():
    with pytest.raises(ValueError, match="one device"):
        OP(torch.ones(2, 4, device="cuda"), torch.ones(3, 4), torch.zeros(2, dtype=torch.long, device="cuda"))


def test_double_backward_and_second_backward_raise(device):
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w = torch.randn(5, 8, device=device, requires_grad=True)
    target = torch.randint(0, 5, (6,), device=device)
    loss = OP(x, w, target)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)
    loss = OP(x, w, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_inference_mode_input_with_trained_weight(device):
    with torch.inference_mode():
        x = torch.randn(9, 8, device=device)
    w = torch.randn(5, 8, device=device, requires_grad=True)
    target = torch.randint(0, 5, (9,), device=device)
    for reduction in ("mean", "none"):
        w.grad = None
        OP(x, w, target, reduction=reduction).sum().backward()
        w64 = w.detach().double().requires_grad_()
        fused_linear_cross_entropy_float64(x.clone(), w64, target, reduction=reduction).sum().backward()
        assert rel_l2(w.grad, w64.grad) < REL_TOL[torch.float32]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_has_no_graph_break(reduction, device, small_chunks):
    gen = torch.Generator().manual_seed(14)
    x, w, b, target = _case(21, 8, 13, torch.float32, device, gen, bias=True)

    def f(x, w, b):
        loss, z = OP(x, w, target, bias=b, reduction=reduction, lse_square_scale=1e-2, return_z_loss=True)
        return (loss * torch.arange(loss.numel(), device=loss.device).view(loss.shape)).sum() + loss.sum(), z

    loss, z = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, b)
    loss.backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref, z_ref = f(x2, w2, b2)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(z, z_ref)
    for a, r in ((x, x2), (w, w2), (b, b2)):
        torch.testing.assert_close(a.grad, r.grad)


def test_opcheck_custom_ops(device):
    x = torch.randn(5, 8, device=device)
    w = torch.randn(6, 8, device=device)
    b = torch.randn(6, device=device)
    cw = torch.rand(6, device=device)
    target = torch.tensor([0, 5, -100, 2, 3], device=device)
    ops = torch.ops.liger_gen
    for reduction, need_pred, token_scaling in (("mean", False, False), ("none", True, False), ("mean", True, False),
                                                ("sum", False, True), ("none", False, True)):
        torch.library.opcheck(ops.fused_linear_cross_entropy_fwd.default,
                              (x, w, target, b, cw, -100, reduction, 0.1, 1e-3, 5.0, True, True, True, need_pred,
                               token_scaling),
                              test_utils=("test_schema", "test_faketensor"))
    grad_rows = torch.randn(5, device=device)
    for token_scaling in (False, True):
        torch.library.opcheck(ops.fused_linear_cross_entropy_bwd.default,
                              (grad_rows, x, w, target, b, None, -100, 0.0, 0.0, None, True, True, True,
                               token_scaling),
                              test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.fused_linear_cross_entropy_scale_grads.default,
                          (torch.tensor(2.0, device=device), x, torch.tensor(0.5, device=device), w, b),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_heuristic_valid_over_dims(dtype):
    vocabs = [1, 2, 7, 1000, 32000, 32768, 50257, 128256, 151936, 262144, 10**6, 10**7]
    for limits in (DeviceLimits(), DeviceLimits.interpreter()):
        for hidden in (1, 64, 896, 4096, 8192):
            for vocab in vocabs:
                space = FusedLinearCrossEntropySpace({"hidden": hidden, "vocab": vocab}, dtype, limits)
                config = space.heuristic()
                assert not space.violations(config)
                # within the memory budget unless only the smallest chunk is left; the largest such chunk
                assert (space.extra_bytes(config) <= space.MAX_EXTRA_BYTES
                        or config.CHUNK_ROWS == space.CHUNK_CHOICES[0])
                bigger = [c for c in space.CHUNK_CHOICES if c > config.CHUNK_ROWS]
                if bigger:
                    assert space.violations(dataclasses.replace(config, CHUNK_ROWS=bigger[0]))
                # rounded logits for 16-bit inputs; dW summed in x's dtype for bfloat16 only
                assert config.LOGITS_FP32 == (dtype == torch.float32)
                assert config.DW_FP32 == (dtype != torch.bfloat16)
    llama = FusedLinearCrossEntropySpace({"hidden": 4096, "vocab": 128256}, torch.bfloat16)
    element = torch.empty((), dtype=torch.bfloat16).element_size()
    expect = max(c for c in llama.CHUNK_CHOICES if c * 128256 * element <= llama.MAX_EXTRA_BYTES)
    assert llama.heuristic().CHUNK_ROWS == expect


def test_constraints_reject_oversized_plans():
    space = FusedLinearCrossEntropySpace({"hidden": 4096, "vocab": 128256}, torch.bfloat16)
    good = space.heuristic()
    # an fp32 dW accumulator (2 GiB) or fp32 logits at the heuristic's chunk exceed the budget
    assert any("MiB" in p for p in space.violations(dataclasses.replace(good, DW_FP32=1)))
    assert any("MiB" in p for p in space.violations(dataclasses.replace(good, LOGITS_FP32=1)))
    assert any("MiB" in p for p in space.violations(dataclasses.replace(good, CHUNK_ROWS=8192)))
    assert any("not one of" in p for p in space.violations(dataclasses.replace(good, CHUNK_ROWS=100)))
    assert not space.violations(dataclasses.replace(good, CHUNK_ROWS=16))
    fp16 = FusedLinearCrossEntropySpace({"hidden": 64, "vocab": 100}, torch.float16)
    assert any("overflow" in p for p in fp16.violations(dataclasses.replace(fp16.heuristic(), DW_FP32=0)))
    fp32 = FusedLinearCrossEntropySpace({"hidden": 64, "vocab": 100}, torch.float32)
    assert any("must be 1" in p for p in fp32.violations(dataclasses.replace(fp32.heuristic(), LOGITS_FP32=0)))
    with pytest.raises(ValueError, match="unknown fields"):
        FusedLinearCrossEntropyConfig.from_dict({**good.to_dict(), "BLOCK_V": 2})


def test_tuning_problems_cap_rows():
    model = PRESETS["llama3-8b"]
    space = FusedLinearCrossEntropySpace({"hidden": model.hidden_size, "vocab": model.vocab_size}, torch.bfloat16)
    assert space.dims == {"hidden": 4096, "vocab": 128256}
    small = dataclasses.replace(model, hidden_size=16, vocab_size=40)
    problems = tuning_problems(small, [8, 20, 8192, 65536], torch.float32, "cpu")
    assert [p.rows for p in problems] == [8, 20, flce_mod.MAX_TUNING_ROWS]
    assert all(p.phases == ("fwd",) for p in problems)


def test_tuners_gate_and_small_tuner_run(device):
    """The tuner's float64 gate passes on each chunking, and a Tuner run with a fake timer gives a valid entry."""
    from liger_gen.codegen.build import load_variant
    problem = FusedLinearCrossEntropyProblem(torch.float32, {"hidden": 16, "vocab": 40}, 70, device, seed=3)
    for chunk in (16, 32, 128):
        config = dataclasses.replace(problem.space.heuristic(), CHUNK_ROWS=chunk)
        assert not problem.space.violations(config)
        module = load_variant(problem.template, problem.template_params(config))
        assert module.chunk_rows() == chunk and module.plan() == config.to_dict()
        assert problem.check(module, "fwd") is None
    # every bfloat16 plan (logits and dW in fp32 or bf16) passes the gate
    bf16 = FusedLinearCrossEntropyProblem(torch.bfloat16, {"hidden": 16, "vocab": 40}, 70, device, seed=5)
    for logits_fp32 in (0, 1):
        for dw_fp32 in (0, 1):
            config = dataclasses.replace(bf16.space.heuristic(), CHUNK_ROWS=16, LOGITS_FP32=logits_fp32,
                                         DW_FP32=dw_fp32)
            assert not bf16.space.violations(config)
            assert bf16.check(load_variant(bf16.template, bf16.template_params(config)), "fwd") is None

    def cost_model(launch, params):  # favours 64-row chunks
        return 1.0 + abs(math.log2(params["CHUNK_ROWS"]) - 6)

    entry = Tuner(n_trials=4, timer=cost_model, retime_rounds=1).tune(problem)
    assert set(entry["timing_ms"]) == {"fwd"}
    config = FusedLinearCrossEntropyConfig.from_dict(entry["config"])
    assert not problem.space.violations(config)
    assert entry["timing_ms"]["fwd"]["tuned"] <= entry["timing_ms"]["fwd"]["heuristic"]


def test_wrong_reference_is_caught(device):
    problem = FusedLinearCrossEntropyProblem(torch.float32, {"hidden": 8, "vocab": 12}, 10, device, seed=4)
    problem.ref["dw"] = problem.ref["dw"] * 1.5
    from liger_gen.codegen.build import load_variant

    module = load_variant(problem.template, problem.template_params(problem.space.heuristic()))
    assert "dw: relative L2 error" in problem.check(module, "fwd")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_float64_reference_matches_unfused(reduction):
    """The chunked float64 truth (used at Llama shapes) equals the unfused float64 reference."""
    gen = torch.Generator().manual_seed(16)
    x, w, b, target = _case(23, 8, 13, torch.float64, "cpu", gen, bias=True)
    opts = dict(weight=torch.rand(13, generator=gen) + 0.5, label_smoothing=0.1, lse_square_scale=1e-2, softcap=4.0)
    g = torch.randn(23, dtype=torch.float64, generator=gen) if reduction == "none" else torch.tensor(0.7,
                                                                                                  dtype=torch.float64)
    loss, z, dx, dw, db = fused_linear_cross_entropy_float64_chunked(x, w, target, b, reduction=reduction,
                                                                     grad_output=g, chunk_rows=5, **opts)
    ref, z_ref = fused_linear_cross_entropy_float64(x, w, target, b, reduction=reduction, return_z_loss=True, **opts)
    ref.backward(g)
    for a, r in ((loss, ref), (z, z_ref), (dx, x.grad), (dw, w.grad), (db, b.grad)):
        torch.testing.assert_close(a, r.detach(), rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_llama3_8b_shape_bf16_against_float64_and_peak_memory(record_property):
    """Llama-3-8B LM head: 8192 tokens × hidden 4096 × vocab 128256, bf16. Loss and gradients against a chunked
    float64 reference, and the peak memory beyond inputs, outputs (loss, dx, dW) and the fp32 dW accumulator."""
    torch.manual_seed(0)
    rows, hidden, vocab = 8192, 4096, 128256
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") * (2 / math.sqrt(hidden))).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[::9] = -100
    OP(x, w, target).backward()  # warm-up: kernels compiled, cuBLAS workspaces allocated
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = OP(x, w, target)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    outputs = x.grad.numel() * 2 + w.grad.numel() * 2  # dx, dW
    extra = peak - base - outputs
    message = (f"FLCE 8192x4096x128256 bf16: peak extra memory {extra / 2**20:.1f} MiB beyond inputs, dx and dW "
               f"(peak {peak / 2**30:.2f} GiB, base {base / 2**30:.2f} GiB)")
    print("\n" + message)
    record_property("flce_peak_extra_mib", round(extra / 2**20, 1))
    assert extra <= 256 * 2**20, message
    loss64, _, dx64, dw64, _ = fused_linear_cross_entropy_float64_chunked(x, w, target, chunk_rows=1024)
    err = {"loss": rel_l2(loss, loss64), "dx": rel_l2(x.grad, dx64), "dW": rel_l2(w.grad, dw64)}
    print(f"relative L2 errors vs float64: {err}")
    record_property("flce_rel_l2", err)
    assert err["loss"] < flce_mod.loss_tolerance(torch.bfloat16)
    assert err["dx"] < REL_TOL[torch.bfloat16] and err["dW"] < REL_TOL[torch.bfloat16]



@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_compile_on_both_cpu_paths(reduction, interpret, monkeypatch):
    """torch.compile of the op on the CPU, in the interpreter and on the plain path (where the per-chunk loss and
    gradient run inside the custom op, with autograd off): same loss and gradients as eager, every option on."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(31)
    x, w, b, target = _case(23, 8, 13, torch.bfloat16, "cpu", gen, bias=True)
    opts = dict(bias=b, reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2, softcap=4.0,
                weight=torch.rand(13, generator=gen) + 0.5)

    def f(x, w):
        loss = OP(x, w, target, **opts)
        return (loss * torch.arange(1, loss.numel() + 1).view(loss.shape)).sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
    loss.backward()
    grads = (x.grad, w.grad, b.grad)
    for t in (x, w, b):
        t.grad = None
    ref = f(x, w)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for a, r in zip(grads, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(a, r)


MEMORY_BUDGET = 2**19  # 512 KiB for the test shape below; the full fp32 logits take 1.1 MiB


@pytest.mark.parametrize("plan", ["heuristic", "fp32_logits_and_dw"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_extra_memory_stays_within_the_budget_on_cpu_paths(interpret, dtype, reduction, plan, monkeypatch,
                                                           storage_peak):
    """Forward + backward allocate at most MAX_EXTRA_BYTES beyond x's and W's gradients, on the plain CPU path
    and in the interpreter, with every option that adds buffers (soft-capping, class weights, bias) and with
    the plan of fp32 logits and an fp32 dW accumulator (float16's accumulator is exempt, as on the GPU).

    Triton's interpreter keeps each launch's arguments in a reference cycle (a recursive closure in its
    argument copying) until Python's next garbage collection: the forward's chunk buffers would outlive it
    into the backward, so the test collects between the two; what it measures is what liger-gen allocates."""
    if plan != "heuristic" and dtype == torch.float32:
        pytest.skip("float32 has one plan")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(FusedLinearCrossEntropySpace, "MAX_EXTRA_BYTES", MEMORY_BUDGET)
    monkeypatch.setattr(chunks, "SLICE_BYTES", 16 * 2**10)
    if plan != "heuristic":
        heuristic = FusedLinearCrossEntropySpace.heuristic
        monkeypatch.setattr(FusedLinearCrossEntropySpace, "heuristic",
                            lambda self: dataclasses.replace(heuristic(self), LOGITS_FP32=1, DW_FP32=1))
    clear_caches()
    # vocab, budget and slices at half of a 3000-vocab case: the same number of chunks on every path, dtype and
    # plan (2 to 11, ragged), the same shares of the budget, half the interpreter's tiles
    rows, hidden, vocab = 192, 32, 1500
    gen = torch.Generator().manual_seed(32)
    x, w, b, target = _case(rows, hidden, vocab, dtype, "cpu", gen, bias=True)
    weight = torch.rand(vocab, generator=gen) + 0.5
    with storage_peak() as meter:
        loss = OP(x, w, target, bias=b, weight=weight, reduction=reduction, softcap=5.0, label_smoothing=0.1)
        gc.collect()
        loss.sum().backward()
    grads = sum(t.grad.untyped_storage().nbytes() for t in (x, w, b))
    fp16_accumulator = vocab * hidden * 4 if dtype == torch.float16 else 0
    row_vectors = 16 * (rows + vocab) * 4  # per-row losses, lse, scales; per-class sums
    clear_caches()
    assert meter.peak - grads <= MEMORY_BUDGET + fp16_accumulator + row_vectors, (meter.peak - grads) / 2**20


@pytest.mark.parametrize("interpret", CPU_PATHS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_accuracy_and_predicted_tokens(reduction, interpret, monkeypatch, small_chunks):
    """The argmax of every row's logits (several chunks, soft-capped, with a bias) and the share of non-ignored
    rows where it is the target, against float64 logits; the loss and its gradients are the same with or
    without them; every row ignored gives NaN; the flags must be bools; and it compiles without a graph break."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(61)
    x, w, b, target = _case(37, 16, 50, torch.float32, "cpu", gen, bias=True)
    kwargs = dict(bias=b, reduction=reduction, softcap=3.0)
    loss, acc, pred = OP(x, w, target, return_token_accuracy=True, return_predicted_tokens=True, **kwargs)
    with torch.no_grad():
        ref_pred = (x.double() @ w.double().t() + b.double()).argmax(-1)
    valid = target != -100
    assert pred.dtype == torch.int64 and torch.equal(pred, ref_pred)
    assert acc.dtype == torch.float32 and not acc.requires_grad
    hits = ((ref_pred == target) & valid).float()
    if reduction == "none":  # per token, as the loss: 1 for a hit, 0 for a miss and at ignored rows
        assert acc.shape == target.shape and torch.equal(acc, hits)
    else:
        assert acc.item() == pytest.approx(hits.sum().item() / valid.sum().item())
    (dx, dw) = torch.autograd.grad(loss.sum(), (x, w))
    plain = OP(x, w, target, **kwargs)
    (dx0, dw0) = torch.autograd.grad(plain.sum(), (x, w))
    torch.testing.assert_close(loss, plain, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx0, rtol=0, atol=0)
    torch.testing.assert_close(dw, dw0, rtol=0, atol=0)
    _, none_acc = OP(x, w, torch.full_like(target, -100), return_token_accuracy=True, **kwargs)
    assert (not none_acc.any()) if reduction == "none" else math.isnan(none_acc.item())
    with pytest.raises(TypeError, match="return_token_accuracy must be a bool"):
        OP(x, w, target, return_token_accuracy=1)
    compiled = torch.compile(lambda x, w: OP(x, w, target, return_token_accuracy=True, **kwargs),
                             backend="aot_eager", fullgraph=True)
    c_loss, c_acc = compiled(x, w)
    torch.testing.assert_close(c_acc, acc)
    torch.testing.assert_close(c_loss, loss)
    torch._dynamo.reset()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", ["plain", "class_weight", "everything"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_token_scaling_matches_float64(option, reduction, dtype, interpret, monkeypatch, small_chunks):
    """use_token_scaling (each row weighed by its detached target probability) over several chunks, with every
    option: loss, z-loss, dx, dW and db against the unfused float64 reference on both CPU paths."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("token-scaling", option, reduction, str(dtype), interpret)
    opts = dict(OPTIONS[option])
    vocab = 50
    x, w, b, target = _case(37, 24, vocab, dtype, "cpu", gen, bias=opts.pop("bias", False))
    with torch.no_grad():
        w.mul_(0.5)  # p_y not negligible
    if opts.pop("weight", False):
        opts["weight"] = 0.25 + torch.rand(vocab, generator=gen)
    if "ignore_index" in opts:
        target[target == -100] = opts["ignore_index"]
    # each row's weight p_y = exp(z_y − lse) comes from the same logits as its loss: with 16-bit logits it
    # carries their rounding too, so the per-row values may differ by twice the loss's own tolerance
    tol = flce_mod.loss_tolerance(dtype) * (2 if dtype != torch.float32 else 1)
    _check_against_float64(x, w, b, target, reduction=reduction, use_token_scaling=True, loss_tol=tol, **opts)


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_token_scaling_equals_cross_entropy_and_compiles(interpret, monkeypatch, small_chunks):
    """FLCE with token scaling equals cross_entropy with token scaling on the materialised fp32 logits, in eager
    mode and under torch.compile (fullgraph), and rejects a non-bool flag."""
    from liger_gen.ops.lm_head.cross_entropy import cross_entropy

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = torch.Generator().manual_seed(73)
    x, w, _, target = _case(37, 16, 50, torch.float32, "cpu", gen)
    kwargs = dict(label_smoothing=0.1, lse_square_scale=1e-3, use_token_scaling=True)
    loss = OP(x, w, target, **kwargs)
    dx, dw = torch.autograd.grad(loss, (x, w))
    ref = cross_entropy(x @ w.t(), target, **kwargs)
    rdx, rdw = torch.autograd.grad(ref, (x, w))
    for got, want in ((loss, ref), (dx, rdx), (dw, rdw)):
        assert rel_l2(got, want) < REL_TOL[torch.float32]
    compiled = torch.compile(lambda x, w: OP(x, w, target, **kwargs), backend="aot_eager", fullgraph=True)
    c_loss = compiled(x, w)
    cdx, cdw = torch.autograd.grad(c_loss, (x, w))
    torch.testing.assert_close(c_loss, loss)
    torch.testing.assert_close(cdx, dx)
    torch.testing.assert_close(cdw, dw)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match="use_token_scaling must be a bool"):
        OP(x, w, target, use_token_scaling="yes")
