"""FP8 training: the quantize op against the recipe (bit for bit), ``fp8_linear`` against float64 within bounds
derived from its roundings, the custom ops (opcheck, torch.compile), ``Float8Linear``, and
``apply_to(model, fp8=...)`` on tiny Llama and MoE models.

Tolerances of ``fp8_linear``. The float64 references quantize the operands exactly as the op does (the quantize
op is bit-exact, tested first), so the op differs from them only by (1) the fp32 accumulation of the GEMM, at most
``n·2^-24·Σ|a_k·b_k|`` over the n products of each output, (2) the rounding of the GEMM's output to bf16, at most
``2^-8·|value|`` (bf16 keeps 8 significant bits, round to nearest), and with a bias (3) the bias cast to bf16
(``2^-8·|b|`` when it is fp32) and (4) the bf16 add of the bias (one more ``2^-8``). ``_gemm_bound`` adds these
per element; a wrong scale axis, a missing dequant or a wrong GEMM operand moves outputs by e4m3's 2^-4 or more.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
import threading
import weakref

import pytest
import torch
from torch import nn

import liger_gen
from liger_gen.codegen.build import load_variant
from liger_gen.integrations import transformers as integration
from liger_gen.integrations.transformers import fp8 as fp8_swaps
from liger_gen.nn import Float8Linear
from liger_gen.ops.fp8 import linear as fp8_linear_module, quantize as fp8_quantize_module
from liger_gen.ops.fp8.linear import fp8_linear, fp8_linear_float64, fp8_linear_grads_float64
from liger_gen.ops.fp8.quantize import FORMAT_NAMES, QuantizeProblem, fp8_quantize, fp8_quantize_op
from liger_gen.runtime import fp8 as recipe
from liger_gen.training import byte_tokens, make_batches

from conftest import seeded
from helpers import lm_loss_and_grads
from mini_models import mini_model

# the linear layers' tests run their FP8 GEMMs on the CPU: torch builds before 2.13 take only per-tensor scales there
needs_cpu_fp8_gemm = pytest.mark.skipif(recipe.fp8_unsupported_reason(torch.device("cpu")) is not None,
                                        reason="this torch build has no CPU torch._scaled_mm with per-row scales")

# the interpreter computes inf·0 (a scale of 0 for an infinite slice) with NumPy, which warns; the NaN is intended
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U_BF16 = 2.0 ** -8  # bf16's unit roundoff: 8 significant bits, round to nearest
U_FP32 = 2.0 ** -24


@pytest.fixture(autouse=True)
def _restore_patches():
    yield
    integration.restore_rope()
    integration.restore_layers()


# ------------------------------------------------------------------------------------------------ quantize


def _slices(fp8_dtype, length: int, dtype: torch.dtype, gen) -> torch.Tensor:
    """(S, length) rows, each a slice the op scales as a unit: random magnitudes spread over 2^-24..1 of the row's
    amax (FP8 subnormals, values that round to 0, ties of bf16 inputs), and rows whose amax sits at the edges of
    the scale formula: 0, NaN, ±inf, exactly the format's max, just above it, exactly at the mantissa threshold
    1.75·2^k and one bf16 step above it, below the 2^-90 floor, an fp32 subnormal, near fp32's max, all negative."""
    fmt_max = recipe.FP8_FORMATS[fp8_dtype][0]
    spread = torch.exp2(-24 * torch.rand(14, length, generator=gen))
    signs = torch.where(torch.rand(14, length, generator=gen) < 0.5, -1.0, 1.0)
    amaxes = torch.tensor([0.0, 1.0, 3.0, 1.0, fmt_max, fmt_max * (1 + 2**-7), 1.75 * 2**5, 1.75 * 2**5 * (1 + 2**-7),
                           2.0**-110, 2.0**-130, 3.0e38, 2.5, 1e-3, 7.0e4])
    rows = spread * signs
    rows = rows / rows.abs().amax(1, keepdim=True) * amaxes[:, None]
    rows[:, 0] = amaxes * torch.where(torch.rand(14, generator=gen) < 0.5, -1.0, 1.0)  # amax reached exactly
    rows[1, 5] = float("nan")
    rows[2, 7] = float("inf")
    rows[3, 2] = float("-inf")
    rows[3, 9] = float("nan")
    rows[11] = -rows[11].abs()
    x = rows.to(dtype)
    assert torch.isfinite(x[4:]).all() and x[9].abs().max() > 0  # the edge rows survived the cast
    return x


def _assert_same_fp8(q: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit, except that any NaN encoding matches any other (the kernels write the canonical positive
    NaN; PyTorch's conversion keeps the sign of the NaN it converts)."""
    nan = expected.float().isnan()
    assert torch.equal(q.float().isnan(), nan)
    assert torch.equal(q.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan])


def _assert_same_scales(d: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(d, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("axis", ["rows", "cols"])
def test_quantize_matches_the_recipe_bit_for_bit(axis, fp8_dtype, dtype, cpu_path):
    """Every element and scale equals ``quantize_reference``'s, special slices included; a NaN slice has NaN
    scales and values, an infinite one inf dequant scales (never a silent 0); the cols axis is transposed and
    zero-padded to 16 tokens (37 → 48)."""
    gen = seeded("quantize", axis, fp8_dtype, dtype, cpu_path)
    slices = _slices(fp8_dtype, 37, dtype, gen)
    x = slices if axis == "rows" else slices.t().contiguous()  # each slice along the reduced axis
    q_ref, d_ref = recipe.quantize_reference(slices, -1, fp8_dtype)
    q, d = fp8_quantize(x, axis, fp8_dtype)
    if axis == "cols":
        assert q.shape == (14, 48) and q.is_contiguous() and d.shape == (14, 1)
        assert (q[:, 37:].view(torch.uint8) == 0).all()  # the padding: +0, even in NaN and inf columns
        q = q[:, :37]
    assert q.dtype == fp8_dtype and d.dtype == torch.float32
    _assert_same_fp8(q, q_ref)
    _assert_same_scales(d.view(-1), d_ref.view(-1))
    assert d_ref[1].isnan() and d_ref[2].isinf() and d_ref[3].isnan()
    assert q_ref[1].float().isnan().all() and q_ref[2].float().isnan().sum() == 1  # inf → NaN, finite → 0
    if cpu_path == "1":
        # the other structural branches: rows wider than the tile (two walks), several programs per column
        # (the atomic amax); the public op runs the heuristic's one-tile variant at this width
        problem = QuantizeProblem(dtype, {"n_cols": x.shape[1]}, x.shape[0], "cpu", fp8=FORMAT_NAMES[fp8_dtype])
        small = dict(BLOCK_M_ROWS=8, BLOCK_K_ROWS=16, num_warps_rows=1, BLOCK_M_COLS=8, BLOCK_K_COLS=16,
                     num_warps_cols=1)
        module = load_variant("fp8_quantize", problem.template_params(
            dataclasses.replace(problem.space.heuristic(), **small)))
        q2 = torch.empty(q.shape if axis == "rows" else (14, 48), dtype=fp8_dtype)
        d2 = torch.empty(q2.shape[0], dtype=torch.float32)
        (module.quantize_rows if axis == "rows" else module.quantize_cols)(x, q2, d2, True)
        _assert_same_fp8(q2[:, :37], q_ref)
        _assert_same_scales(d2, d_ref.view(-1))


def test_quantize_takes_any_strides_and_zero_rows(cpu_path):
    gen = seeded("strides", cpu_path)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    for view in (x.t(), x[::2, ::2]):
        for axis, dim in (("rows", -1), ("cols", 0)):
            q, d = fp8_quantize(view, axis)
            q_ref, d_ref = recipe.quantize_reference(view, dim)
            _assert_same_fp8(q[:, : view.shape[0]] if axis == "cols" else q, q_ref.t() if axis == "cols" else q_ref)
            _assert_same_scales(d.view(-1), d_ref.view(-1))
    q, d = fp8_quantize(x[:0], "rows")
    assert q.shape == (0, 64) and d.shape == (0, 1)
    q, d = fp8_quantize(x[:0], "cols")
    assert q.shape == (64, 0) and d.shape == (64, 1)


@pytest.mark.parametrize("args, exc, words", [
    ((torch.zeros(4, 16, dtype=torch.int32),), TypeError, ["x of shape (4, 16)", "torch.int32", "float32"]),
    ((torch.zeros(2, 3, 16),), ValueError, ["2-D", "x of shape (2, 3, 16)", "torch.float32"]),
    ((torch.zeros(4, 16), "diag"), ValueError, ["axis", "'diag'", "rows"]),
    ((torch.zeros(4, 16), "rows", torch.float16), TypeError, ["fp8_dtype", "torch.float16"]),
])
def test_quantize_errors_name_the_tensor(args, exc, words):
    with pytest.raises(exc) as info:
        fp8_quantize(*args)
    assert all(w in str(info.value) for w in words), str(info.value)


# ------------------------------------------------------------------------------------------------ fp8_linear


def _dequantized(t: torch.Tensor, dim: int, fp8_dtype=E4M3) -> torch.Tensor:
    return recipe.dequantize(*recipe.quantize_reference(t, dim, fp8_dtype))


def _gemm_bound(ref: torch.Tensor, abs_products: torch.Tensor, n: int, bias=None, bias_rounded=True):
    """Per-element bound of |op − float64 reference| for a GEMM of ``n`` products rounded to bf16 (see the module
    docstring); ``ref`` is the reference without the bias, ``abs_products`` Σ|a_k·b_k| per element."""
    acc = n * U_FP32 * abs_products
    out = acc + U_BF16 * (ref.abs() + acc)
    if bias is not None:
        b = bias.double()
        cast = 0 if bias_rounded else U_BF16 * b.abs()
        out = out + cast + U_BF16 * ((ref + b).abs() + out + cast)
    return out


def _assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - ref).abs()
    assert torch.isfinite(got).all(), what
    worst = (err - bound).max() if err.numel() else torch.tensor(-1.0)
    assert worst <= 0, f"{what}: error exceeds the bound by {worst.item():.3g}"


LINEAR_CASES = {  # name: (x shape, x layout, weight dtype, bias dtype or None, keep_fp8_for_backward, grad format)
    "2d": ((37, 64), "contiguous", torch.bfloat16, None, True, E4M3),
    "bias-bf16-requantize": ((37, 64), "contiguous", torch.bfloat16, torch.bfloat16, False, E4M3),
    "fp32-weight-bias-e5m2": ((21, 64), "contiguous", torch.float32, torch.float32, True, E5M2),
    "transposed-x": ((48, 64), "transposed", torch.bfloat16, torch.bfloat16, True, E4M3),
    "3d-strided-x": ((3, 7, 64), "strided", torch.bfloat16, None, False, E5M2),
    "one-token": ((1, 64), "contiguous", torch.bfloat16, torch.bfloat16, True, E4M3),
    "zero-tokens": ((0, 64), "contiguous", torch.bfloat16, torch.bfloat16, True, E4M3),
    "3d-zero-tokens": ((2, 0, 64), "contiguous", torch.bfloat16, None, False, E5M2),
}


def _x(shape, layout, gen) -> torch.Tensor:
    if layout == "transposed":
        return torch.randn(shape[::-1], generator=gen).to(torch.bfloat16).t()
    if layout == "strided":
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(torch.bfloat16)[..., ::2]
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


@needs_cpu_fp8_gemm
@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_fp8_linear_matches_float64(case, cpu_path):
    """y, dx, dW and db against the recipe's float64 references, within the derived per-element bounds."""
    shape, layout, w_dtype, b_dtype, keep, grad_dtype = LINEAR_CASES[case]
    gen = seeded("linear", case, cpu_path)
    n, k = 48, shape[-1]
    x = _x(shape, layout, gen).requires_grad_()
    assert layout == "contiguous" or not x.is_contiguous()
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(w_dtype).requires_grad_()
    b = None if b_dtype is None else torch.randn(n, generator=gen).to(b_dtype).requires_grad_()
    rec = liger_gen.Float8Recipe(grad_dtype=grad_dtype, keep_fp8_for_backward=keep)
    y = liger_gen.functional.fp8_linear(x, w, b, rec)
    assert y.shape == (*shape[:-1], n) and y.dtype == torch.bfloat16
    x2, m = x.detach().reshape(-1, k), math.prod(shape[:-1])

    ref = fp8_linear_float64(x.detach(), w.detach(), None).reshape(m, n)
    products = _dequantized(x2, -1).abs() @ _dequantized(w.detach(), -1).abs().t()
    bound = _gemm_bound(ref, products, k, b, bias_rounded=b_dtype == torch.bfloat16)
    _assert_within(y.reshape(m, n), ref + (0 if b is None else b.detach().double()), bound, "y")

    dy = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(dy)
    dx_ref, dw_ref = fp8_linear_grads_float64(x.detach(), w.detach(), dy, grad_dtype)
    dy2 = dy.reshape(m, n)
    dx_products = _dequantized(dy2, -1, grad_dtype).abs() @ _dequantized(w.detach(), 0).abs()
    _assert_within(x.grad.reshape(m, k), dx_ref.reshape(m, k), _gemm_bound(dx_ref.reshape(m, k), dx_products, n), "dx")
    assert w.grad.dtype == w_dtype
    dw_products = _dequantized(dy2, 0, grad_dtype).abs().t() @ _dequantized(x2, 0).abs()
    _assert_within(w.grad, dw_ref, _gemm_bound(dw_ref, dw_products, recipe.padded(m)), "dW")
    if b is not None:
        db_ref = dy2.double().sum(0)
        db_bound = m * U_FP32 * dy2.double().abs().sum(0) * (1 + U_BF16) + (
            U_BF16 * db_ref.abs() if b_dtype == torch.bfloat16 else U_FP32 * db_ref.abs())
        _assert_within(b.grad, db_ref, db_bound, "db")


@needs_cpu_fp8_gemm
def test_fp8_linear_is_torchaos_rowwise_recipe_bit_for_bit(cpu_path):
    """The recipe is torchao's "rowwise" float8 training recipe: y, dx and dW of a bias-free layer equal those of
    torchao's Float8Linear bit for bit (the same scales, casts and GEMM operands; both GEMMs on the CPU)."""
    float8 = pytest.importorskip("torchao.float8")
    gen = seeded("torchao", cpu_path)
    m, k, n = 16 * int(torch.randint(2, 9, (), generator=gen)), 64, 48
    layer = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * float(torch.rand((), generator=gen) + 0.1))
    x = (torch.randn(m, k, generator=gen) * 4).to(torch.bfloat16)
    dy = (torch.randn(m, n, generator=gen) * 1e-3).to(torch.bfloat16)
    ours_x, ours_w = x.clone().requires_grad_(), layer.weight.detach().clone().requires_grad_()
    ours = fp8_linear(ours_x, ours_w)
    ours.backward(dy)
    peer = nn.Sequential(layer)
    float8.convert_to_float8_training(peer, config=float8.Float8LinearConfig.from_recipe_name("rowwise"))
    peer_x = x.clone().requires_grad_()
    theirs = peer(peer_x)
    theirs.backward(dy)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours_x.grad, peer_x.grad)
    assert torch.equal(ours_w.grad, peer[0].weight.grad)


@needs_cpu_fp8_gemm
def test_fp8_linear_propagates_nan_and_inf(cpu_path):
    """A NaN or inf in a token of x makes that token's outputs NaN and, through the token-axis scales of the
    weight gradient, the dW columns of its features; an inf in a row of W makes that output column NaN; a NaN in
    a token of dy makes that token's dx NaN. Everything else stays finite, and nothing non-finite becomes a 0."""
    gen = seeded("nan", cpu_path)
    x = torch.randn(20, 32, generator=gen).to(torch.bfloat16)
    x[3, 5], x[7, 0], x[9, 31] = float("nan"), float("inf"), float("-inf")
    x.requires_grad_()
    w = (torch.randn(16, 32, generator=gen) / 6).to(torch.bfloat16).requires_grad_()
    y = fp8_linear(x, w)
    bad = torch.zeros(20, dtype=torch.bool)
    bad[[3, 7, 9]] = True
    assert y[bad].isnan().all() and torch.isfinite(y[~bad]).all()
    y.backward(torch.randn(y.shape, generator=gen).to(torch.bfloat16))
    bad_cols = torch.zeros(32, dtype=torch.bool)
    bad_cols[[5, 0, 31]] = True  # the weight gradient reads x per feature over the tokens
    assert w.grad[:, bad_cols].isnan().all() and torch.isfinite(w.grad[:, ~bad_cols]).all()
    assert torch.isfinite(x.grad).all()

    w2 = w.detach().clone()
    w2[2, 4] = float("inf")
    y2 = fp8_linear(x.detach()[~bad], w2)
    assert y2[:, 2].isnan().all() and torch.isfinite(y2[:, [0, 1, *range(3, 16)]]).all()
    dy = torch.randn(17, 16, generator=gen).to(torch.bfloat16)
    dy[4, 1] = float("nan")
    xg = x.detach()[~bad].clone().requires_grad_()
    fp8_linear(xg, w.detach()).backward(dy)
    assert xg.grad[4].isnan().all() and torch.isfinite(xg.grad[[*range(4), *range(5, 17)]]).all()


@pytest.mark.parametrize("args, exc, words", [
    ((torch.zeros(4, 32), torch.zeros(16, 32)), TypeError, ["x of shape (4, 32)", "torch.float32", "bfloat16"]),
    ((torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.float16)), TypeError,
     ["weight of shape (16, 32)", "torch.float16"]),
    ((torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(16, 48, dtype=torch.bfloat16)), ValueError,
     ["weight must be (out_features, 32)", "weight of shape (16, 48)"]),
    ((torch.zeros(4, 40, dtype=torch.bfloat16), torch.zeros(16, 40, dtype=torch.bfloat16)), ValueError,
     ["in_features=40 not a multiple of 16", "weight of shape (16, 40)"]),
    ((torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(24, 32, dtype=torch.bfloat16)), ValueError,
     ["out_features=24 not a multiple of 16"]),
    ((torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16),
      torch.zeros(8, dtype=torch.bfloat16)), ValueError, ["bias must be (16,)", "bias of shape (8,)"]),
    ((torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16), None, "e4m3"),
     TypeError, ["recipe must be", "Float8Recipe", "str"]),
    ((torch.zeros(4, 32, dtype=torch.bfloat16, device="meta"), torch.zeros(16, 32, dtype=torch.bfloat16,
                                                                           device="meta")),
     RuntimeError, ["not on meta", "x of shape (4, 32), dtype torch.bfloat16, device meta"]),
])
def test_fp8_linear_errors_name_the_tensor(args, exc, words):
    with pytest.raises(exc) as info:
        fp8_linear(*args)
    assert all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(ValueError, match="grad_dtype"):
        liger_gen.Float8Recipe(grad_dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------------------ custom ops


@needs_cpu_fp8_gemm
def test_custom_ops_pass_opcheck():
    """The three custom ops under ``torch.library.opcheck`` on the kernel path of this process. The backward op
    skips opcheck's schema test: it compares inputs before and after with ``allclose``, which CPU float8 tensors
    do not implement; its fake-tensor, autograd-registration and AOT-dispatch tests run."""
    gen = seeded("opcheck")
    x = torch.randn(21, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(16, generator=gen).to(torch.bfloat16)
    for axis in ("rows", "cols"):
        for fmt in ("e4m3", "e5m2"):
            torch.library.opcheck(fp8_quantize_op.op, (x, axis, fmt))
    fwd, bwd = fp8_linear_module.fp8_linear_fwd.op, fp8_linear_module.fp8_linear_bwd.op
    no_schema = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for keep, bias, fmt, fast in ((True, b, "e4m3", True), (False, None, "e5m2", False)):
        torch.library.opcheck(fwd, (x, w, bias, keep, fmt, fast))
        _, xtq, xtd = fwd(x, w, bias, keep, fmt, fast)
        dy = torch.randn(21, 16, generator=gen).to(torch.bfloat16)
        for need_dx, need_dw in ((True, True), (False, True), (True, False)):
            torch.library.opcheck(bwd, (dy, None if keep else x, xtq, xtd, w, fmt, need_dx, need_dw,
                                        bias is not None), test_utils=no_schema)


@needs_cpu_fp8_gemm
def test_fp8_linear_and_float8_linear_compile_without_graph_breaks(cpu_path):
    """Forward and backward of ``fp8_linear`` and of a ``Float8Linear`` under ``torch.compile(fullgraph=True)``:
    the custom ops, with the eager result and gradients, bit for bit."""
    gen = seeded("compile", cpu_path)
    layer = Float8Linear(32, 16, dtype=torch.bfloat16)
    w = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(48, generator=gen).to(torch.bfloat16)
    x0 = torch.randn(2, 9, 32, generator=gen).to(torch.bfloat16)

    def f(x, w, b):
        return fp8_linear(x, w, b).float().square().mean() + layer(x).float().sum()

    results = []
    for fn in (torch.compile(f, backend="aot_eager", fullgraph=True), f):
        x, wl, bl = (t.clone().requires_grad_() for t in (x0, w, b))
        layer.zero_grad(set_to_none=True)
        loss = fn(x, wl, bl)
        loss.backward()
        results.append([loss, x.grad, wl.grad, bl.grad, layer.weight.grad])
    torch._dynamo.reset()
    for got, want in zip(*results):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ Float8Linear


@needs_cpu_fp8_gemm
def test_from_linear_converts_in_place():
    """The same object, Parameters, state_dict keys, forward hooks and optimizer state; the forward is
    ``fp8_linear``'s; the recipe shows in the repr and survives pickling; layers the FP8 GEMM cannot take and
    other module types are refused."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16, dtype=torch.bfloat16)
    params = dict(linear.named_parameters())
    keys = list(linear.state_dict())
    optimizer = torch.optim.AdamW(linear.parameters(), lr=1e-2)
    seen = []
    hook = linear.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    rec = liger_gen.Float8Recipe(grad_dtype=E5M2)
    assert Float8Linear.from_linear(linear, rec) is linear
    assert type(linear) is Float8Linear and isinstance(linear, nn.Linear) and linear.recipe is rec
    assert all(p is params[n] for n, p in linear.named_parameters()) and list(linear.state_dict()) == keys
    assert "recipe=Float8Recipe(grad_dtype=torch.float8_e5m2" in repr(linear)
    x = torch.randn(5, 32).to(torch.bfloat16)
    y = linear(x)
    assert seen == [(5, 16)] and torch.equal(y, fp8_linear(x, linear.weight, linear.bias, rec))
    before = linear.weight.detach().clone()
    y.float().sum().backward()
    optimizer.step()
    assert not torch.equal(linear.weight, before)
    hook.remove()  # (a local function does not pickle)
    copy = pickle.loads(pickle.dumps(linear))
    assert type(copy) is Float8Linear and copy.recipe == rec and torch.equal(copy(x), linear(x))
    with pytest.raises(ValueError, match="in_features=40 not a multiple of 16"):
        Float8Linear.from_linear(nn.Linear(40, 16))
    with pytest.raises(TypeError, match="expected a torch.nn.Linear, got Conv1d"):
        Float8Linear.from_linear(nn.Conv1d(16, 16, 1))
    with pytest.raises(TypeError, match="Float8Recipe"):
        Float8Linear(32, 16, recipe="e4m3")


@needs_cpu_fp8_gemm
def test_float8_linear_under_autocast_and_fallbacks():
    """Under a bf16 autocast an fp32 input runs the FP8 GEMMs on its bf16 cast (bf16 output, an fp32 input
    gradient, fp32 weight gradients); an fp32 input outside autocast, an fp16 autocast and meta tensors compute
    ``F.linear``."""
    gen = seeded("autocast")
    layer = Float8Linear(32, 16)  # fp32 weights, as in mixed-precision training
    x = torch.randn(4, 6, 32, generator=gen).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fp8_linear(x.detach().to(torch.bfloat16), layer.weight, layer.bias))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert torch.isfinite(x.grad).all() and layer.weight.grad.abs().sum() > 0
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    meta = Float8Linear(32, 16, device="meta", dtype=torch.bfloat16)
    assert meta(torch.empty(3, 32, device="meta", dtype=torch.bfloat16)).shape == (3, 16)


# ------------------------------------------------------------------------------------------------ apply_to


def _decoder_linears(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}


def _fp8_names(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}


@needs_cpu_fp8_gemm
def test_apply_to_converts_every_decoder_projection():
    model = mini_model("llama", dtype=torch.bfloat16)
    projections = _decoder_linears(model)
    assert len(projections) == 14  # 2 layers × (q, k, v, o, gate, up, down)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    for _ in range(2):  # a second call changes nothing
        liger_gen.apply_to(model, fp8=True, strict=True)
        assert _fp8_names(model) == projections
        assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
        assert all(p is params[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
        report = model.liger_gen_report
        assert report.fp8 == 14 and report.left == [] and "14 linear layers in FP8" in report.summary()
    assert all(model.get_submodule(n).recipe == liger_gen.Float8Recipe() for n in projections)


@needs_cpu_fp8_gemm
def test_apply_to_reports_what_stays_and_strict_refuses_it(monkeypatch):
    """Dims not multiples of 16, fp16 weights and a device without FP8 GEMMs leave layers as they are, listed
    with the reason; ``strict`` raises and changes nothing; ``Float8Recipe.modules`` restricts the conversion;
    a meta-device model is converted (decided per call)."""
    model = mini_model("llama", dtype=torch.bfloat16, intermediate_size=88)
    with pytest.raises(ValueError, match=r"mlp\.down_proj ×2 \(stays bfloat16: in_features=88 not a multiple of 16"):
        liger_gen.apply_to(model, fp8=True, strict=True)
    assert not _fp8_names(model) and not hasattr(model, "liger_gen_report")
    liger_gen.apply_to(model, fp8=True)
    assert _fp8_names(model) == {n for n in _decoder_linears(model) if ".self_attn." in n}
    left = model.liger_gen_report.left
    assert "model.layers.*.mlp.gate_proj ×2 (stays bfloat16: out_features=88 not a multiple of 16)" in left
    assert len(left) == 3

    model = mini_model("llama", dtype=torch.float16)
    liger_gen.apply_to(model, fp8=liger_gen.Float8Recipe(modules=("*.mlp.*",)), rope=False)
    assert not _fp8_names(model)
    assert model.liger_gen_report.left == [f"model.layers.*.mlp.{p} ×2 (stays float16: FP8 GEMMs take bf16 or fp32 "
                                           f"weights)" for p in ("gate_proj", "up_proj", "down_proj")]

    model = mini_model("llama", dtype=torch.bfloat16)
    liger_gen.apply_to(model, fp8=liger_gen.Float8Recipe(modules=("model.layers.1.self_attn.*",)), rope=False)
    assert _fp8_names(model) == {f"model.layers.1.self_attn.{p}_proj" for p in "qkvo"}

    monkeypatch.setattr(fp8_swaps, "fp8_unsupported_reason", lambda device: "no FP8 tensor cores here")
    model = mini_model("llama", dtype=torch.bfloat16)
    liger_gen.apply_to(model, fp8=True, rope=False)
    assert not _fp8_names(model) and len(model.liger_gen_report.left) == 7
    assert all(item.endswith("×2 (stays bfloat16: no FP8 tensor cores here)") for item in model.liger_gen_report.left)
    model = mini_model("llama", dtype=torch.bfloat16, device="meta")
    liger_gen.apply_to(model, fp8=True, rope=False)
    assert _fp8_names(model) == _decoder_linears(model) and model.liger_gen_report.left == []
    with pytest.raises(TypeError, match="fp8 must be a bool or a liger_gen.Float8Recipe"):
        liger_gen.apply_to(model, fp8="e4m3")


@needs_cpu_fp8_gemm
def test_apply_to_leaves_moe_routers_and_fused_experts():
    """Qwen3-MoE: the attention projections become FP8; each layer's router (transformers' TopKRouter) and fused
    experts stay bf16 and are listed; strict refuses the experts, not the routers. A router that is an
    ``nn.Linear`` (older releases' layout) with dims the GEMM could take is still never converted."""
    model = mini_model("qwen3_moe", dtype=torch.bfloat16, num_experts=16)
    liger_gen.apply_to(model, fp8=True)
    assert _fp8_names(model) == {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert model.liger_gen_report.left == [
        "model.layers.*.mlp.experts ×2 (MoE experts' fused parameters gate_up_proj, down_proj are not nn.Linear: "
        "they stay bfloat16)", "model.layers.*.mlp.gate ×2 (MoE router: stays bfloat16, by design)"]
    model = mini_model("qwen3_moe", dtype=torch.bfloat16, num_experts=16)
    for layer in model.model.layers:
        layer.mlp.gate = nn.Linear(64, 16, bias=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as info:
        liger_gen.apply_to(model, fp8=True, strict=True)
    assert "mlp.experts ×2" in str(info.value) and "router" not in str(info.value)
    liger_gen.apply_to(model, fp8=True)
    assert all(type(layer.mlp.gate) is nn.Linear for layer in model.model.layers)
    assert "model.layers.*.mlp.gate ×2 (MoE router: stays bfloat16, by design)" in model.liger_gen_report.left


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")
def test_a_patched_model_runs_the_same_bits_through_the_kernels(monkeypatch):
    """With only the FP8 layers patched, a forward and backward through the Triton kernels (interpreter) and
    through plain PyTorch give the same loss and gradients bit for bit: the quantize kernels are exact and the
    GEMMs are the same."""
    model = mini_model("llama", dtype=torch.bfloat16, num_hidden_layers=1)
    liger_gen.apply_to(model, fp8=True, rms_norm=False, swiglu=False, rope=False, fused_linear_cross_entropy=False,
                       fused_add_rms_norm=False)
    ids = make_batches(byte_tokens(), 1, 2, 24, seed=0)[0]
    launches = []
    lookup = fp8_quantize_module.kernel_module
    monkeypatch.setattr(fp8_quantize_module, "kernel_module", lambda *a, **k: launches.append(1) or lookup(*a, **k))
    results = []
    for path in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", path)
        launches.clear()
        results.append(lm_loss_and_grads(model, ids))
        assert bool(launches) == (path == "1")  # the quantize kernels ran, or none did
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0]) and all(torch.equal(g, results[0][1][n]) for n, g in grads.items())


STEPS, BATCH, SEQ, LR = 8, 2, 48, 3e-3


@needs_cpu_fp8_gemm
def test_fp8_training_follows_the_bf16_run(monkeypatch):
    """A tiny bf16 Llama patched by ``apply_to`` trains on Shakespeare with and without ``fp8=True`` from the
    same weights on the same batches (plain CPU path, whose FP8 pieces the test above ties to the kernels).

    Tolerance: e4m3 keeps 4 significant bits (unit roundoff 2^-4), so every GEMM operand moves by up to ~6% and
    the runs are different trajectories from the first step; what must hold is that FP8 training makes the bf16
    run's progress. Both curves must agree within 5% of the bf16 run's loss decrease, at the first and at the
    last step. Measured: 4e-4 apart at the first step and 3e-3 (0.2% of the 1.5 decrease) at the last; a weight
    gradient zeroed or transposed in the FP8 layers ends 0.39 apart (26%)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batches = make_batches(byte_tokens(), STEPS, BATCH, SEQ, seed=3)
    curves = {}
    for fp8 in (False, True):
        model = mini_model("llama", seed=5, dtype=torch.bfloat16)
        liger_gen.apply_to(model, fp8=fp8)
        assert model.liger_gen_report.fp8 == (14 if fp8 else 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves[fp8] = losses
    bf16, fp8 = curves[False], curves[True]
    drop = bf16[0] - bf16[-1]
    assert drop > 0.1 * bf16[0], bf16
    assert abs(fp8[0] - bf16[0]) < 0.05 * drop, (fp8, bf16)
    assert abs(fp8[-1] - bf16[-1]) < 0.05 * drop, (fp8, bf16)


def _count_quantize_and_gemm(monkeypatch):
    """Record every quantization (by axis: "rows", "cols", or "both" for the cast + transpose op) and FP8 GEMM
    the FP8 linear layers make."""
    calls = []
    quantize, both, gemm = fp8_linear_module.quantize_2d, fp8_linear_module.cast_transpose_2d, recipe.scaled_mm

    def counted_quantize(x, axis, fmt):
        calls.append(("quantize", axis, tuple(x.shape)))
        return quantize(x, axis, fmt)

    def counted_both(x, fmt):
        calls.append(("quantize", "both", tuple(x.shape)))
        return both(x, fmt)

    def counted_gemm(*args):
        calls.append(("gemm",))
        return gemm(*args)

    monkeypatch.setattr(fp8_linear_module, "quantize_2d", counted_quantize)
    monkeypatch.setattr(fp8_linear_module, "cast_transpose_2d", counted_both)
    monkeypatch.setattr(recipe, "scaled_mm", counted_gemm)
    return calls


@needs_cpu_fp8_gemm
@pytest.mark.parametrize("autocast", [False, True])
def test_projections_of_one_input_quantize_it_once(autocast, monkeypatch):
    """q, k and v (or gate and up) read one tensor: it is quantized once (both axes in one op) and its
    token-axis copy is saved once, also under autocast, where each projection casts the fp32 input to bf16
    itself; the results are those of separate calls."""
    gen = seeded("shared", autocast)
    layers = [Float8Linear(32, 16 * (i + 1), bias=False, dtype=torch.bfloat16) for i in range(3)]
    x = torch.randn(2, 19, 32, generator=gen)
    x = (x if autocast else x.to(torch.bfloat16)).requires_grad_()
    fp8_linear_module.LAST_INPUT.clear()
    calls = _count_quantize_and_gemm(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ys = [layer(x) for layer in layers]
    x_calls = [c for c in calls if c[0] == "quantize" and c[2] == (38, 32)]
    assert [c[1] for c in x_calls] == ["both"]  # both axes in one op
    dys = [torch.randn(y.shape, generator=gen).to(y.dtype) for y in ys]
    torch.autograd.backward(ys, dys)
    separate = []
    for layer, dy in zip(layers, dys):
        fp8_linear_module.LAST_INPUT.clear()
        xi = x.detach().to(torch.bfloat16).requires_grad_()
        y = fp8_linear(xi, layer.weight.detach().requires_grad_())
        y.backward(dy)
        separate.append((y, xi.grad))
    for y, (y_sep, _) in zip(ys, separate):
        assert torch.equal(y, y_sep)
    # autograd sums the three input gradients in bf16, in its own order: two roundings of 2^-9 at most
    want = sum(g.double() for _, g in separate)
    assert ((x.grad.double() - want).norm() / want.norm()).item() < 2 * 2.0 ** -8


@needs_cpu_fp8_gemm
def test_a_frozen_weight_makes_no_weight_gradient_work(monkeypatch):
    """With the weight frozen, the forward keeps no token-axis copy of x and the backward runs the input
    gradient's GEMM only; the input gradient is unchanged."""
    gen = seeded("frozen")
    layer = Float8Linear(32, 48, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(40, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(40, 48, generator=gen).to(torch.bfloat16)
    fp8_linear_module.LAST_INPUT.clear()
    calls = _count_quantize_and_gemm(monkeypatch)
    layer(x).backward(dy)
    assert [c[1] for c in calls if c[0] == "quantize"] == ["rows", "rows", "rows", "cols"]  # x, W; dy, Wᵀ
    assert calls.count(("gemm",)) == 2
    dx, _ = fp8_linear_grads_float64(x.detach(), layer.weight, dy)
    assert ((x.grad.double() - dx).norm() / dx.norm()).item() < 2.0 ** -7


# ------------------------------------------------------------------------------------------------ regressions


def _forward_bound(x, w, y, what):
    """y of ``fp8_linear(x, w)`` (no bias) against the float64 recipe, within ``_gemm_bound``."""
    x2 = x.reshape(-1, x.shape[-1])
    ref = fp8_linear_float64(x2, w)
    products = _dequantized(x2, -1).abs() @ _dequantized(w, -1).abs().t()
    _assert_within(y.reshape(ref.shape), ref, _gemm_bound(ref, products, x.shape[-1]), what)


@needs_cpu_fp8_gemm
def test_float8_linear_runs_under_inference_mode(cpu_path):
    """Inference tensors have no version counter, which the shared quantization's entry reads: under
    ``torch.inference_mode`` (and for an inference tensor passed outside it) the projections of one input give
    the no_grad results, bit for bit, within the recipe's bound."""
    gen = seeded("inference", cpu_path)
    layers = [Float8Linear(32, 16 * (i + 1), bias=False, dtype=torch.bfloat16) for i in range(2)]
    x0 = torch.randn(3, 5, 32, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = [layer(x0) for layer in layers]
    with torch.inference_mode():
        x = x0.clone()
        got = [layer(x) for layer in layers]
    got_outside = [layer(x) for layer in layers]
    for layer, a, b, c in zip(layers, want, got, got_outside):
        assert torch.equal(a, b) and torch.equal(a, c)
        _forward_bound(x0, layer.weight.detach(), b, "y")


@needs_cpu_fp8_gemm
def test_shared_quantization_follows_its_input(cpu_path):
    """The entry of the shared quantization: a ``.data`` swap (same shape, new storage) or an in-place write is a
    miss (the result is a fresh call's); the FP8 copies are freed with their input (no large tensor outlives the
    step); another thread neither reads nor evicts this thread's entry."""
    gen = seeded("shared-entry", cpu_path)
    w = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    lookup = fp8_linear_module.shared_operands
    x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    fp8_linear(x, w)
    x.data = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    got = fp8_linear(x, w)
    fp8_linear_module.LAST_INPUT.clear()
    assert torch.equal(got, fp8_linear(x.clone(), w))
    _forward_bound(x, w, got, "y after a .data swap")
    x.mul_(-3)
    got = fp8_linear(x, w)
    _forward_bound(x, w, got, "y after an in-place write")

    with torch.no_grad():
        fp8_linear(x, w)
    held = [weakref.ref(t) for t in fp8_linear_module.LAST_INPUT.operands if t is not None]
    assert held
    del x
    gc.collect()
    assert all(r() is None for r in held)

    xa, xb = (torch.randn(8, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    first = lookup(xa, xa, False)
    other = []
    thread = threading.Thread(target=lambda: other.append(lookup(xb, xb, False)))
    thread.start()
    thread.join()
    assert lookup(xa, xa, False)[0] is first[0] and other[0][0] is not first[0]
    assert torch.equal(other[0][0].view(torch.uint8), recipe.quantize_reference(xb, -1)[0].view(torch.uint8))


@needs_cpu_fp8_gemm
def test_a_layer_that_keeps_no_copy_saves_none_from_the_shared_entry():
    """A frozen weight, or ``keep_fp8_for_backward=False``, after a projection that made x's token-axis copy:
    the layer's backward does not hold that copy (the frozen one saves nothing of x, the other the bf16 x)."""
    gen = seeded("keep")
    x = torch.randn(24, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    trained = Float8Linear(32, 16, bias=False, dtype=torch.bfloat16)
    frozen = Float8Linear(32, 16, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    requantize = Float8Linear(32, 16, bias=False, dtype=torch.bfloat16,
                              recipe=liger_gen.Float8Recipe(keep_fp8_for_backward=False))
    fp8_linear_module.LAST_INPUT.clear()
    ys = [layer(x) for layer in (trained, frozen, requantize)]
    saved = [y.grad_fn.saved_tensors for y in ys]
    assert saved[0][1].shape == (32, 32)  # (K, padded tokens)
    assert saved[1][0] is None and saved[1][1].numel() == 0
    assert saved[2][0] is not None and saved[2][1].numel() == 0
    dy = torch.randn(24, 16, generator=gen).to(torch.bfloat16)
    torch.autograd.backward(ys, [dy] * 3)
    _, dw = fp8_linear_grads_float64(x.detach(), requantize.weight.detach(), dy)
    products = _dequantized(dy, 0).abs().t() @ _dequantized(x.detach(), 0).abs()
    _assert_within(requantize.weight.grad, dw, _gemm_bound(dw, products, 32), "dW")


def test_float8_linear_with_weights_it_cannot_quantize_computes_f_linear():
    """A Float8Linear whose weight became fp16 (``model.half()`` after ``apply_to``) under a bf16 autocast computes
    ``F.linear`` there, as ``nn.Linear`` does, instead of raising."""
    gen = seeded("half")
    layer = Float8Linear(32, 16, dtype=torch.float16)
    x = torch.randn(5, 32, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
        want = nn.functional.linear(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@needs_cpu_fp8_gemm
def test_routers_inside_a_gate_or_router_module_stay():
    """Routers held as a linear layer inside a module named gate/router (Hunyuan-MoE's ``mlp.gate.wg``, Gemma 4's
    ``router.proj``) are MoE routers, kept as they are even when their expert count is a multiple of 16; a
    Float8Recipe's ``modules`` list becomes a (hashable) tuple and a generator is refused."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.wg = nn.Linear(32, 16, bias=False)

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 16, bias=False)

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = Gate(), nn.ModuleList(nn.Linear(32, 32) for _ in range(16))

    class ToyDecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.router, self.o_proj = Moe(), Router(), nn.Linear(32, 32)
            self.experts = nn.Module()
            self.experts.gate_up_proj = nn.Parameter(torch.zeros(16, 64, 32))

    model = nn.ModuleDict({"layer": ToyDecoderLayer()})
    plan = fp8_swaps.plan_fp8(model, liger_gen.Float8Recipe())
    layer = model["layer"]
    assert layer.mlp.gate.wg not in plan.convert and layer.router.proj not in plan.convert
    assert layer.o_proj in plan.convert and layer.mlp.experts[0] in plan.convert
    assert ("layer.mlp.gate.wg", "MoE router: stays float32, by design") in plan.kept
    assert ("layer.router.proj", "MoE router: stays float32, by design") in plan.kept
    rec = liger_gen.Float8Recipe(modules=["*.mlp.*"])
    assert rec.modules == ("*.mlp.*",) and hash(rec) == hash(liger_gen.Float8Recipe(modules=("*.mlp.*",)))
    with pytest.raises(TypeError, match="modules"):
        liger_gen.Float8Recipe(modules=(p for p in ["*.mlp.*"]))


@needs_cpu_fp8_gemm
@pytest.mark.parametrize("m, k, n", [(4, 0, 16), (4, 16, 0)], ids=["no-in-features", "no-out-features"])
def test_fp8_linear_of_empty_feature_dims(m, k, n, cpu_path):
    """``nn.Linear(0, N)`` and ``nn.Linear(K, 0)`` (K and N multiples of 16): the bias, and zero or empty
    gradients of F.linear's shapes; the empty token-axis copy of a 0-feature x is the kept copy, not a missing one."""
    gen = seeded("empty-dims", m, k, n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).requires_grad_()
    b = torch.randn(n, generator=gen).requires_grad_()
    y = fp8_linear(x, w, b)
    assert y.shape == (m, n) and torch.equal(y, b.detach().to(torch.bfloat16).expand(m, n))
    dy = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    y.backward(dy)
    assert x.grad.shape == (m, k) and w.grad.shape == (n, k) and not x.grad.any() and not w.grad.any()
    torch.testing.assert_close(b.grad, dy.double().sum(0).float(), rtol=m * U_FP32, atol=0)


@needs_cpu_fp8_gemm
def test_report_says_when_fp8_layers_need_autocast():
    """Float32 weights make FP8 GEMMs only under a bf16 autocast: the summary counts and says so; bf16 ones not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    for dtype, expected in ((torch.float32, 7), (torch.bfloat16, 0)):
        model = LlamaForCausalLM(config).to(dtype)
        liger_gen.apply_to(model, fp8=True)
        report = model.liger_gen_report
        assert (report.fp8, report.fp8_float32) == (7, expected)
        assert ("7 of float32 weights" in report.summary()) == bool(expected)
        assert pickle.loads(pickle.dumps(report)).fp8_float32 == expected


def test_recipe_fields_keep_their_positions():
    """fast_accum came last, so positional recipes written before it keep their meaning; bad values are named."""
    rec = liger_gen.Float8Recipe(E5M2, False, ("*.q_proj",))
    assert (rec.grad_dtype, rec.keep_fp8_for_backward, rec.modules, rec.fast_accum) == (E5M2, False, ("*.q_proj",), True)
    with pytest.raises(TypeError, match=r"fast_accum must be a bool, got 1 \(int\)"):
        liger_gen.Float8Recipe(fast_accum=1)
