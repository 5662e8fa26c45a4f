"""The FP8 cast + transpose op (``fp8_cast_transpose``: both axes' quantization in one op) against the recipe, bit
for bit: its two outputs equal ``quantize_reference`` along the rows and along the columns, special slices
included (the slices of ``test_fp8.py``), on each CPU path; every kernel branch under the tuner's exactness gate;
the amaxes a producing kernel would bring; its space, heuristic, errors and custom op."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.ops.fp8.cast_transpose import CastTransposeProblem, fp8_cast_transpose, fp8_cast_transpose_op
from liger_gen.runtime import fp8 as recipe

from conftest import seeded
from test_fp8 import E4M3, E5M2, _assert_same_fp8, _assert_same_scales, _slices

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")


def _assert_matches_recipe(x: torch.Tensor, out, fp8_dtype) -> None:
    """The four outputs of the op on x (M, K) against ``quantize_reference`` along each axis."""
    q, d_rows, qt, d_cols = out
    m, k = x.shape
    q_ref, d_ref = recipe.quantize_reference(x, -1, fp8_dtype)
    qt_ref, dt_ref = recipe.quantize_reference(x, 0, fp8_dtype)
    assert q.shape == (m, k) and d_rows.shape == (m, 1) and q.dtype == fp8_dtype and d_rows.dtype == torch.float32
    assert qt.shape == (k, recipe.padded(m)) and qt.is_contiguous() and d_cols.shape == (k, 1)
    assert (qt[:, m:].view(torch.uint8) == 0).all()  # the padding: +0, even in NaN and inf columns
    _assert_same_fp8(q, q_ref)
    _assert_same_scales(d_rows.view(-1), d_ref.view(-1))
    _assert_same_fp8(qt[:, :m], qt_ref.t())
    _assert_same_scales(d_cols.view(-1), dt_ref.view(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("along", ["rows", "cols"])
def test_cast_transpose_matches_the_recipe_bit_for_bit(along, fp8_dtype, dtype, cpu_path):
    """The special slices (zeros, NaN, ±inf, the format's max and just above, the mantissa threshold, below the
    scale floor, fp32 subnormals and near fp32's max) laid along the rows or along the columns; 37 of one and 14
    of the other, so the cols output is padded (37 → 48) and the tiles are ragged."""
    if dtype == torch.float16:  # the slices' magnitudes past float16's range: the ordinary rows only
        gen = seeded("ct-half", fp8_dtype, cpu_path)
        x = (torch.randn(14, 37, generator=gen) * torch.exp2(torch.randint(-20, 12, (14, 1), generator=gen))).half()
        x[1, 5], x[2, 7], x[3, 0] = float("nan"), float("inf"), 0.0
    else:
        x = _slices(fp8_dtype, 37, dtype, seeded("ct", along, fp8_dtype, dtype, cpu_path))
    if along == "cols":
        x = x.t().contiguous()
    _assert_matches_recipe(x, fp8_cast_transpose(x, fp8_dtype), fp8_dtype)


def _module(problem: CastTransposeProblem, **changes):
    config = dataclasses.replace(problem.space.heuristic(), **changes)
    assert not problem.space.violations(config), problem.space.violations(config)
    return load_variant("fp8_cast_transpose", problem.template_params(config))


# several programs per row and per column (the atomic amaxes meet), one program per row, one-row tiles; programs
# walking several tiles, the last one past the end of x (37 rows: 16-row programs), and one program per column
BRANCHES = [dict(BLOCK_M_AMAX=8, BLOCK_K_AMAX=16, TILES_AMAX=1, num_warps_amax=1, BLOCK_M=8, BLOCK_K=16, num_warps=1),
            dict(BLOCK_M_AMAX=1, BLOCK_K_AMAX=128, TILES_AMAX=1, num_warps_amax=1, BLOCK_M=64, BLOCK_K=128,
                 num_warps=4),
            dict(BLOCK_M_AMAX=64, BLOCK_K_AMAX=32, TILES_AMAX=1, num_warps_amax=2, BLOCK_M=16, BLOCK_K=32,
                 num_warps=1),
            dict(BLOCK_M_AMAX=4, BLOCK_K_AMAX=32, TILES_AMAX=4, num_warps_amax=1, BLOCK_M=8, BLOCK_K=16, num_warps=1),
            dict(BLOCK_M_AMAX=1, BLOCK_K_AMAX=16, TILES_AMAX=64, num_warps_amax=1, BLOCK_M=8, BLOCK_K=16,
                 num_warps=1)]


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("changes", BRANCHES, ids=["atomics", "whole-rows", "tall", "walk", "walk-all-rows"])
def test_every_kernel_branch_passes_the_tuners_gate(changes, dtype, fp8, device):
    problem = CastTransposeProblem(dtype, {"n_cols": 100}, 37, device, fp8=fp8,
                                   seed=int(torch.randint(0, 1 << 30, ())))
    assert problem.check(_module(problem, **changes), "fwd") is None


def test_the_gate_catches_a_kernel_of_the_other_format(device):
    """The check compares exactly: an e5m2 kernel checked against the e4m3 truth fails."""
    problem = CastTransposeProblem(torch.bfloat16, {"n_cols": 64}, 20, device, fp8="e4m3")
    wrong = load_variant("fp8_cast_transpose", {**problem.space.heuristic().to_dict(), "fp8": "e5m2"})
    for name in ("q_rows", "q_cols"):
        problem.buffers[name] = torch.empty_like(problem.buffers[name], dtype=torch.float8_e5m2)
    assert "differ" in problem.check(wrong, "fwd")


def _amax_bits(amax: torch.Tensor) -> torch.Tensor:
    """The amax vector as the kernels keep it: non-negative fp32 bits, NaN as 0x7FC00000."""
    bits = amax.float().view(torch.int32).clone()
    bits[amax.isnan()] = 0x7FC00000
    return bits


def test_amaxes_brought_by_the_caller_skip_the_amax_pass(device, monkeypatch):
    """A kernel that produced x and computed its amaxes hands them over (as ``amax`` leaves them): the cast alone
    gives the same bits, and the amax pass does not run. The amax pass alone leaves those bits."""
    gen = seeded("ct-given")
    x = (torch.randn(29, 48, generator=gen) * torch.exp2(torch.randint(-9, 9, (1, 48), generator=gen))).bfloat16()
    x[4, 11] = float("nan")
    x[7, 3] = float("-inf")
    x = x.to(device)
    problem = CastTransposeProblem(torch.bfloat16, {"n_cols": 48}, 29, device)
    module = _module(problem, **BRANCHES[0])
    exact = device.type == "cpu"
    row_bits = _amax_bits(x.float().abs().amax(1).where(~x.isnan().any(1), float("nan")))
    col_bits = _amax_bits(x.float().abs().amax(0).where(~x.isnan().any(0), float("nan")))
    got_rows, got_cols = torch.zeros_like(row_bits), torch.zeros_like(col_bits)
    module.amax(x, got_rows, got_cols, module.BLOCK_M_AMAX, module.BLOCK_K_AMAX, 4)
    assert torch.equal(got_rows, row_bits) and torch.equal(got_cols, col_bits)
    for tiles in (2, 3, 8):  # the walking pass leaves the same bits (NaN and -inf rows and columns among them)
        got_rows, got_cols = torch.zeros_like(row_bits), torch.zeros_like(col_bits)
        module.amax_tiles(x, got_rows, got_cols, 4, 16, tiles, 1)
        assert torch.equal(got_rows, row_bits) and torch.equal(got_cols, col_bits)
    monkeypatch.setattr(module, "amax_tiles", lambda *a: pytest.fail("the amax pass ran with the amaxes given"))
    out = (torch.empty(29, 48, dtype=E4M3, device=device), torch.empty(29, device=device),
           torch.empty(48, 32, dtype=E4M3, device=device), torch.empty(48, device=device))
    module.cast_transpose(x, *out, exact, row_bits=row_bits, col_bits=col_bits)
    _assert_matches_recipe(x.cpu(), [t.cpu() for t in (out[0], out[1][:, None], out[2], out[3][:, None])], E4M3)


def test_cast_transpose_takes_any_strides_one_row_and_zero_rows(cpu_path):
    gen = seeded("ct-strides", cpu_path)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    for view in (x.t(), x[::2, ::2], x[:1]):
        _assert_matches_recipe(view, fp8_cast_transpose(view), E4M3)
    q, d_rows, qt, d_cols = fp8_cast_transpose(x[:0])
    assert q.shape == (0, 64) and d_rows.shape == (0, 1) and qt.shape == (64, 0) and d_cols.shape == (64, 1)


@pytest.mark.parametrize("args, exc, words", [
    ((torch.zeros(4, 16, dtype=torch.int32),), TypeError, ["x of shape (4, 16)", "torch.int32", "float32"]),
    ((torch.zeros(2, 3, 16),), ValueError, ["2-D", "x of shape (2, 3, 16)", "torch.float32"]),
    ((torch.zeros(4, 16), torch.float16), TypeError, ["fp8_dtype", "torch.float16"]),
])
def test_cast_transpose_errors_name_the_tensor(args, exc, words):
    with pytest.raises(exc) as info:
        fp8_cast_transpose(*args)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_outputs_carry_no_graph(cpu_path):
    """Not differentiable, on every path: an input that requires grad gives outputs without a graph."""
    x = torch.randn(5, 32, requires_grad=True)
    assert not any(t.requires_grad or t.grad_fn is not None for t in fp8_cast_transpose(x))


def test_the_custom_op_passes_opcheck():
    x = torch.randn(21, 32, generator=seeded("ct-opcheck")).to(torch.bfloat16)
    for fmt in ("e4m3", "e5m2"):
        torch.library.opcheck(fp8_cast_transpose_op.op, (x, fmt))


@pytest.mark.parametrize("rows", [16, 17, 32])
def test_the_columns_operand_is_row_major_on_every_path(rows, cpu_path):
    """qt is (K, Mp) row-major whether or not the token axis needed padding, as the custom ops' fake
    implementations say (torch.compile's inductor lays out its buffers from them, and cuBLAS needs the
    row-major operand): checked on the returned tensors and by opcheck's fake-tensor test."""
    from liger_gen.ops.fp8.quantize import fp8_quantize

    x = torch.randn(rows, 48, generator=seeded("ct-layout", rows, cpu_path)).to(torch.bfloat16)
    padded = recipe.padded(rows)
    qt, d_cols = fp8_quantize(x, "cols")
    both = fp8_cast_transpose(x)
    for q in (qt, both[2]):
        assert q.shape == (48, padded) and q.stride() == (padded, 1)
    torch.library.opcheck(torch.ops.liger_gen.fp8_quantize.default, (x, "cols", "e4m3"), test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.liger_gen.fp8_cast_transpose.default, (x, "e4m3"), test_utils=("test_faketensor",))


def test_vmap_quantizes_each_element_on_every_path(cpu_path):
    """Under torch.vmap (whose wrapped tensors the kernels cannot read) the ops take their custom ops, which run
    once per element."""
    from liger_gen.ops.fp8.quantize import fp8_quantize

    x = torch.randn(3, 20, 32, generator=seeded("ct-vmap", cpu_path)).to(torch.bfloat16)
    mapped = torch.vmap(lambda t: fp8_cast_transpose(t))(x)
    rows = torch.vmap(lambda t: fp8_quantize(t, "rows"))(x)
    for i in range(3):
        want = fp8_cast_transpose(x[i])
        for got, ref in zip(mapped, want):
            assert torch.equal(got[i].view(torch.uint8) if got.dtype == E4M3 else got[i],
                               ref.view(torch.uint8) if ref.dtype == E4M3 else ref)
        assert torch.equal(rows[0][i].view(torch.uint8), want[0].view(torch.uint8))
