"""``rms_norm_fp8``: RMSNorm (or the fused residual add + RMSNorm) that also writes the e4m3 operands of its output.

What must hold, bit for bit: y, the sum and the gradients are those of ``rms_norm`` / ``fused_add_rms_norm`` (the
same arithmetic and the same backward kernels; on the CPU, where the row sums add in one order whatever the
launch settings: on a GPU the order follows the warps, which each op's table picks), and the operands are those
of ``fp8_cast_transpose(y)`` (the recipe applied to the y written), for both fusion splits (``EMIT``), every casting mode, special rows (zeros,
NaN, inf, huge values) and ragged tiles. Plus: its space and heuristic, the tuner's gate, its errors, and a
patched Llama whose norms hand their operands to the FP8 projections: the projections quantize nothing of the
norms' outputs and the loss and gradients are unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import liger_gen
from liger_gen.integrations import transformers as integration
from liger_gen.codegen.build import load_variant
from liger_gen.functional import fp8_cast_transpose, fused_add_rms_norm, rms_norm, rms_norm_fp8
from liger_gen.ops.fp8 import linear as fp8_linear_module
from liger_gen.ops.norms.rms_norm_fp8 import RMSNormFp8Problem, RMSNormFp8Space
from liger_gen.training import byte_tokens, make_batches

from conftest import seeded
from helpers import lm_loss_and_grads
from mini_models import mini_model
from test_fp8 import _assert_same_fp8, _assert_same_scales, needs_cpu_fp8_gemm

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")


@pytest.fixture(autouse=True)
def _restore_patches():
    yield
    integration.restore_rope()
    integration.restore_layers()


def _inputs(gen, shape, dtype, fused: bool, special: bool):
    x = torch.randn(*shape, generator=gen).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
    r = torch.randn(*shape, generator=gen).to(dtype) if fused else None
    if special:  # rows of zeros, a NaN, an inf, and values whose squares overflow to inf in fp32
        flat = x.view(-1, shape[-1])
        flat[0] = 0.0
        flat[1, 3] = float("nan")
        flat[2, 5] = float("inf")
        flat[3] = flat[3] * 1e30 if dtype == torch.float32 else flat[3]
        if r is not None:
            r.view(-1, shape[-1])[0] = 0.0
    return x, w, r


def _assert_operands_of(y: torch.Tensor, out) -> None:
    q, d_rows, qt, d_cols = fp8_cast_transpose(y.reshape(-1, y.shape[-1]))
    _assert_same_fp8(out.q, q)
    _assert_same_scales(out.dequant_rows, d_rows)
    _assert_same_fp8(out.qt, qt)
    _assert_same_scales(out.dequant_cols, d_cols)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "fused_add"])
def test_outputs_and_gradients_are_the_plain_norms_and_the_operands_the_recipes(fused, casting_mode, dtype,
                                                                                 cpu_path):
    gen = seeded("rms_norm_fp8", fused, casting_mode, dtype, cpu_path)
    x, w, r = _inputs(gen, (3, 13, 80), dtype, fused, special=False)
    leaves = [t.requires_grad_() for t in (x, w, r) if t is not None]
    out = rms_norm_fp8(x, w, 1e-6, 0.25, casting_mode, residual=r)
    if fused:
        y0, s0 = fused_add_rms_norm(x, r, w, 1e-6, 0.25, casting_mode)
        assert torch.equal(out.sum, s0)
    else:
        y0 = rms_norm(x, w, 1e-6, 0.25, casting_mode)
        assert out.sum is None
    assert out.y.shape == x.shape and out.y.dtype == y0.dtype and torch.equal(out.y, y0)
    assert out.q.shape == (39, 80) and out.qt.shape == (80, 48) and out.dequant_cols.shape == (80, 1)
    _assert_operands_of(out.y.detach(), out)
    dy = torch.randn(x.shape, generator=gen).to(y0.dtype)
    outs, ups = [out.y], [dy]
    if fused:  # the sum's own gradient too (the residual stream continues)
        outs.append(out.sum)
        ups.append(torch.randn(x.shape, generator=gen).to(out.sum.dtype))
    grads = torch.autograd.grad(outs, leaves, ups)
    want = torch.autograd.grad([y0, s0] if fused else [y0], leaves, ups)
    for g, g0 in zip(grads, want):
        assert torch.equal(g, g0)


@pytest.mark.parametrize("emit", ["rows", "amax"])
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "fused_add"])
@pytest.mark.parametrize("cols", [True, False], ids=["both", "rows-only"])
def test_every_split_writes_the_same_bits(cols, fused, emit, device):
    """Each fusion choice, at small tiles (several norm rows and cast tiles per program, ragged edges), special
    rows included, against the recipe applied to the y it wrote; with ``cols`` off, no columns operand."""
    problem = RMSNormFp8Problem(torch.bfloat16, {"n_cols": 100}, 37, device, fused_add=fused)
    config = dataclasses.replace(problem.space.heuristic(), EMIT=emit, BLOCK_M_FWD=2, BLOCK_M_CAST=16,
                                 BLOCK_K_CAST=32, num_warps_cast=1)
    assert not problem.space.violations(config)
    module = load_variant("rms_norm_fp8", problem.template_params(config))
    x, w, r = _inputs(seeded("split", emit, fused, cols), (37, 100), torch.bfloat16, fused, special=True)
    x, w = x.to(device), w.to(device)
    y = torch.empty_like(x)
    q = torch.empty(37, 100, dtype=torch.float8_e4m3fn, device=device)
    d_rows, rstd = torch.empty(37, device=device), torch.empty(37, device=device)
    qt = torch.empty(100, 48, dtype=torch.float8_e4m3fn, device=device) if cols else None
    d_cols = torch.empty(100, device=device) if cols else None
    exact = device.type == "cpu"
    if fused:
        s = torch.empty_like(x)
        module.forward(x, r.to(device), w, y, s, rstd, q, d_rows, qt, d_cols, 1e-6, 0.0, exact)
    else:
        module.forward(x, w, y, rstd, q, d_rows, qt, d_cols, 1e-6, 0.0, exact)
    want = fp8_cast_transpose(y.cpu())
    _assert_same_fp8(q.cpu(), want[0])
    _assert_same_scales(d_rows.cpu(), want[1].view(-1))
    assert d_rows[1].isnan() and q[1].float().isnan().all()  # a NaN row: NaN scale and values, no silent zeros
    if cols:
        _assert_same_fp8(qt.cpu(), want[2])
        _assert_same_scales(d_cols.cpu(), want[3].view(-1))


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "fused_add"])
@pytest.mark.parametrize("emit", ["rows", "amax"])
def test_both_splits_pass_the_tuners_gate(emit, fused, device):
    problem = RMSNormFp8Problem(torch.bfloat16, {"n_cols": 72}, 29, device, fused_add=fused,
                                seed=int(torch.randint(0, 1 << 30, ())))
    config = dataclasses.replace(problem.space.heuristic(), EMIT=emit)
    assert problem.check(load_variant("rms_norm_fp8", problem.template_params(config)), "fwd") is None


def test_the_gate_catches_operands_of_another_format(device):
    """The gate holds the operands to e4m3's recipe exactly: a module rendered for e5m2 fails it."""
    problem = RMSNormFp8Problem(torch.bfloat16, {"n_cols": 64}, 20, device, fused_add=False)
    wrong = load_variant("rms_norm_fp8", {**problem.template_params(problem.space.heuristic()), "fp8": "e5m2"})
    for name in ("q_rows", "q_cols"):  # e5m2 buffers: Triton compiles no e5m2-to-e4m3 store for the GPU
        problem.buffers[name] = torch.empty_like(problem.buffers[name], dtype=torch.float8_e5m2)
    assert "differ" in problem.check(wrong, "fwd")


@pytest.mark.parametrize("n_cols", [1, 16, 100, 2048, 4096, 8192, 65536])
def test_the_heuristic_is_valid_for_any_width(n_cols):
    space = RMSNormFp8Space({"n_cols": n_cols}, torch.bfloat16)
    config = space.heuristic()
    assert not space.violations(config) and config.BLOCK_N >= n_cols


def test_the_space_refuses_what_cannot_run():
    space = RMSNormFp8Space({"n_cols": 4096}, torch.bfloat16)
    base = space.heuristic()
    assert any("per thread" in p for p in space.violations(dataclasses.replace(base, BLOCK_M_FWD=32,
                                                                                   num_warps_fwd=1)))
    assert any("cast" in p for p in space.violations(dataclasses.replace(base, BLOCK_M_CAST=128, BLOCK_K_CAST=256,
                                                                           num_warps_cast=1)))
    assert space.violations(dataclasses.replace(base, EMIT="both"))  # not one of the choices
    with pytest.raises(ValueError, match="65536"):
        RMSNormFp8Space({"n_cols": 65537}, torch.bfloat16)


@pytest.mark.parametrize("call, exc, words", [
    (lambda x, w: rms_norm_fp8(x.int(), w), TypeError, ["x of shape (4, 32)", "torch.int32"]),
    (lambda x, w: rms_norm_fp8(x, w[:16]), ValueError, ["weight", "(32,)", "shape (16,)"]),
    (lambda x, w: rms_norm_fp8(x, w, residual=x[:2]), ValueError, ["residual", "shape (2, 32)", "x of shape (4, 32)"]),
    (lambda x, w: rms_norm_fp8(x, w, casting_mode="t5"), ValueError, ["casting_mode", "'t5'"]),
    (lambda x, w: rms_norm_fp8(x, w, eps="small"), TypeError, ["eps"]),
])
def test_errors_name_the_tensor(call, exc, words):
    x, w = torch.randn(4, 32), torch.ones(32)
    with pytest.raises(exc) as info:
        call(x, w)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_zero_rows_and_rows_only():
    x, w = torch.randn(0, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    out = rms_norm_fp8(x, w)
    assert out.y.shape == (0, 32) and out.q.shape == (0, 32) and out.qt.shape == (32, 0)
    out = rms_norm_fp8(torch.randn(5, 32, dtype=torch.bfloat16), w, cols=False)
    assert out.qt is None and out.dequant_cols is None and out.q.shape == (5, 32)


@needs_cpu_fp8_gemm
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")
def test_a_patched_llamas_norms_hand_their_operands_to_the_projections(monkeypatch):
    """``apply_to(fp8=True)`` marks each layer's two norms (before q/k/v and before gate/up): the projections then
    quantize none of the norms' outputs (4 of the 2-layer model's 11 forward tensors with both operands), and the
    loss and every gradient are bit for bit those of the same model with the norms unmarked (on the CPU: see the
    module docstring)."""
    model = mini_model("llama", dtype=torch.bfloat16, num_hidden_layers=2)
    liger_gen.apply_to(model, fp8=True)
    assert model.liger_gen_report.fp8_norms == 4
    ids = make_batches(byte_tokens(), 1, 2, 24, seed=0)[0]
    quantized = []
    both = fp8_linear_module.cast_transpose_2d
    monkeypatch.setattr(fp8_linear_module, "cast_transpose_2d", lambda x, f: quantized.append(x) or both(x, f))
    fused = lm_loss_and_grads(model, ids)
    n_fused = len(quantized)
    for module in model.modules():
        if module.__dict__.get("fp8_consumers"):
            module.fp8_consumers = ()
    quantized.clear()
    plain = lm_loss_and_grads(model, ids)
    assert len(quantized) - n_fused == 4
    assert torch.equal(fused[0], plain[0])
    assert fused[1].keys() == plain[1].keys() and all(torch.equal(g, plain[1][n]) for n, g in fused[1].items())


@needs_cpu_fp8_gemm
@pytest.mark.parametrize("family", ["gemma2", "falcon_h1"])
def test_layers_not_built_like_llamas_keep_plain_norms(family):
    """Gemma 2's post-attention norm normalises the attention's output (its MLP reads the pre-feedforward norm's);
    Falcon-H1's Mamba mixer reads the input norm's output beside the attention, which reads it scaled: neither
    layer's norms are marked."""
    model = mini_model(family, dtype=torch.bfloat16, num_hidden_layers=1)
    liger_gen.apply_to(model, fp8=True)
    assert model.liger_gen_report.fp8 > 0 and model.liger_gen_report.fp8_norms == 0


@pytest.mark.parametrize("residual", [False, True])
def test_plain_path_under_compile_and_vmap(residual, monkeypatch):
    """Without the interpreter, a recorded graph and torch.func transforms take the custom op: torch.compile
    (fullgraph) gives the eager values, vmap gives each element's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = seeded("plain-compile", residual)
    x = torch.randn(2, 10, 32, generator=gen).to(torch.bfloat16)
    r = torch.randn(2, 10, 32, generator=gen).to(torch.bfloat16) if residual else None
    w = (torch.rand(32, generator=gen) + 0.5).to(torch.bfloat16)
    eager = rms_norm_fp8(x, w, residual=r)
    compiled = torch.compile(lambda a, b: tuple(v for v in rms_norm_fp8(a, w, residual=b) if v is not None),
                             fullgraph=True, backend="aot_eager")(x, r)
    for got, want in zip(compiled, (v for v in eager if v is not None)):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
    mapped = torch.vmap(lambda a, b: rms_norm_fp8(a, w, residual=b).y, in_dims=(0, 0 if residual else None))(x, r)
    assert torch.equal(mapped, eager.y)
