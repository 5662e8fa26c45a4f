"""Clamped SwiGLU (gpt-oss's expert activation): kernels (Triton interpreter on the CPU) against float64 and
transformers' expression, the interleaved layout, bad input, torch.compile and the custom ops."""


import pytest
import torch

from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.ops.glu.clamped_swiglu import (GPT_OSS_ALPHA, GPT_OSS_LIMIT, ClampedSwiGLUProblem, ClampedSwiGLUSpace,
                                              clamped_swiglu, clamped_swiglu_float64, clamped_swiglu_gate_up,
                                              clamped_swiglu_torch)

from conftest import CPU_PATHS, assert_compiles_like_eager, seeded
from helpers import assert_passes_the_gate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gate_up(shape, dtype, gen, limit=GPT_OSS_LIMIT):
    """(…, 2·n) interleaved values ~ N(0, 4²) (both clamps active on a share of them), with entries exactly at
    ±limit (the clamps' closed boundaries; ``limit`` is exact in every dtype) in the first row."""
    gu = 4.0 * torch.randn(shape, generator=gen)
    flat = gu.view(-1, shape[-1])
    bounds = torch.tensor([limit, limit, -limit, -limit])  # gate = limit, up = limit, gate = -limit, up = -limit
    k = min(4, shape[-1])
    flat[0, :k] = bounds[:k]
    return gu.to(dtype)


def _float64(gate_up, dy, alpha, limit):
    gu = gate_up.detach().double().requires_grad_()
    y = clamped_swiglu_float64(gu[..., ::2], gu[..., 1::2], alpha, limit)
    (dgu,) = torch.autograd.grad(y, gu, dy.double())
    return y, dgu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (7, 128), (2, 3, 202), (33, 6), (5, 2 * 1100)])
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_gate_up_matches_float64(shape, dtype, interpret, monkeypatch):
    """The interleaved op: y and the interleaved gradient against float64 autograd of the formula, with values
    beyond and exactly at both clamps (their gradients follow torch.clamp: zero outside, passed at the bound)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("gate-up", shape, dtype, interpret)
    alpha = 1.3 + torch.rand((), generator=gen).item()
    limit = (5.5, 6.25, 7.0)[int(torch.randint(0, 3, (), generator=gen))]
    gate_up = _gate_up(shape, dtype, gen, limit).requires_grad_()
    y = clamped_swiglu_gate_up(gate_up, alpha, limit)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    (dgu,) = torch.autograd.grad(y, gate_up, dy)
    ref, ref_d = _float64(gate_up, dy, alpha, limit)
    tol = REL_TOL[dtype] if dtype != torch.float32 or interpret == "1" else 1e-6
    assert rel_l2(y, ref) < tol and rel_l2(dgu, ref_d) < tol
    # the clamps: no gradient to a gate above the limit or to an up outside [-limit, limit]
    above = gate_up.detach()[..., ::2].float() > limit
    outside = gate_up.detach()[..., 1::2].float().abs() > limit
    assert above.any() or shape[-1] < 8
    assert (dgu[..., ::2][above] == 0).all() and (dgu[..., 1::2][outside] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_separate_gate_and_up_and_strided_views(dtype, interpret, monkeypatch):
    """clamped_swiglu on separate tensors, on the interleaved views of one projection (read in place), and on
    views of different column strides (copied), all equal to the interleaved op and to float64."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("separate", dtype, interpret)
    gate_up = _gate_up((3, 5, 2 * 48), dtype, gen).requires_grad_()
    dy = torch.randn(3, 5, 48, generator=gen).to(dtype)
    ref, ref_d = _float64(gate_up, dy, GPT_OSS_ALPHA, GPT_OSS_LIMIT)
    tol = REL_TOL[dtype]
    y = clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2])
    (d,) = torch.autograd.grad(y, gate_up, dy)
    assert rel_l2(y, ref) < tol and rel_l2(d, ref_d) < tol
    gate = gate_up.detach()[..., ::2].contiguous().requires_grad_()
    up = gate_up.detach()[..., 1::2]
    up = up.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # another stride pattern
    y2 = clamped_swiglu(gate, up)
    dg, du = torch.autograd.grad(y2, (gate, up), dy)
    assert rel_l2(y2, ref) < tol
    assert rel_l2(dg, ref_d[..., ::2]) < tol and rel_l2(du, ref_d[..., 1::2]) < tol


def test_equals_transformers_gpt_oss_gate():
    """The plain CPU path is transformers' GptOssExperts._apply_gate, bit for bit, in float32 and bfloat16."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=16, vocab_size=64)
    experts = modeling.GptOssExperts(config)
    gen = seeded("transformers")
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = _gate_up((9, 96), dtype, gen)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "0")
            ours = clamped_swiglu_gate_up(gate_up, experts.alpha, experts.limit)
        assert torch.equal(ours, experts._apply_gate(gate_up))


def test_problem_and_space(device):
    """The tuning problem's float64 truth is the op's, its launchers pass the gate on interleaved buffers, and
    the heuristic is valid at gpt-oss's width."""
    space = ClampedSwiGLUSpace({"n_cols": 2880}, torch.bfloat16)
    assert not space.violations(space.heuristic())
    problem = ClampedSwiGLUProblem(torch.float32, 100, 12, device, seed=3)
    module = assert_passes_the_gate(problem)
    problem.buffers["gate_up"][0, 0] += 1.0  # a wrong input: the check must fail
    problem.launcher(module, "fwd")()
    assert problem.check(module, "fwd") is not None


def test_bad_input_names_argument():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="gate_up's last dim must be even"):
        clamped_swiglu_gate_up(torch.randn(4, 5))
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        clamped_swiglu_gate_up(x, alpha=0.0)
    with pytest.raises(ValueError, match="limit must be a finite number > 0 .*got inf"):
        clamped_swiglu_gate_up(x, limit=float("inf"))
    with pytest.raises(ValueError, match="within float32's range"):
        clamped_swiglu_gate_up(x, limit=1e300)
    assert clamped_swiglu(x.t(), x.t()).is_contiguous()
    with pytest.raises(TypeError, match="limit must be a real number"):
        clamped_swiglu_gate_up(x, limit="7")
    with pytest.raises(TypeError, match="alpha must be a real number"):
        clamped_swiglu(x, x, alpha=True)
    with pytest.raises(ValueError, match="same shape"):
        clamped_swiglu(x, torch.randn(4, 5))
    with pytest.raises(TypeError, match="same dtype"):
        clamped_swiglu(x, x.bfloat16())
    with pytest.raises(TypeError, match="gate_up"):
        clamped_swiglu_gate_up(torch.ones(4, 6, dtype=torch.int64))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_torch_compile_and_empty_input(interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("compile", interpret)
    gate_up = _gate_up((6, 40), torch.float32, gen)

    def f(gu):
        return clamped_swiglu_gate_up(gu, 1.5, 6.0).square().sum() + clamped_swiglu(gu[:, :20], gu[:, 20:]).sum()

    assert_compiles_like_eager(f, gate_up)
    empty = torch.zeros(0, 8, requires_grad=True)
    y = clamped_swiglu_gate_up(empty)
    y.sum().backward()
    assert y.shape == (0, 4) and empty.grad.shape == (0, 8)


def test_opcheck_custom_ops(device):
    gen = seeded("opcheck")
    gate_up = _gate_up((5, 24), torch.float32, gen).to(device)
    gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    dy = torch.randn(5, 12, generator=gen).to(device)
    ops = torch.ops.liger_gen
    for op, args in ((ops.clamped_swiglu_fwd, (gate, up, 1.702, 7.0)),
                     (ops.clamped_swiglu_bwd, (dy, gate, up, 1.702, 7.0)),
                     (ops.clamped_swiglu_gate_up_fwd, (gate_up, 1.702, 7.0)),
                     (ops.clamped_swiglu_gate_up_bwd, (dy, gate_up, 1.702, 7.0))):
        torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))


def test_reference_is_the_formula():
    """The references against the formula written out: (u + 1)·g·σ(αg) with the two clamps."""
    gen = seeded("formula")
    gate, up = 5 * torch.randn(50, generator=gen, dtype=torch.float64), 5 * torch.randn(50, generator=gen,
                                                                                        dtype=torch.float64)
    g, u = torch.minimum(gate, torch.tensor(7.0, dtype=torch.float64)), up.clamp(-7.0, 7.0)
    want = (u + 1) * g / (1 + torch.exp(-1.702 * g))
    torch.testing.assert_close(clamped_swiglu_torch(gate, up), want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_nan_and_inf_propagate_as_in_torch(interpret, monkeypatch):
    """A NaN gate or up gives NaN (the clamps must not turn it into ±limit); ±inf are clamped like any value."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    nan, inf = float("nan"), float("inf")
    gate_up = torch.tensor([[nan, 1.0, 1.0, nan, inf, 2.0, -inf, 3.0, 2.0, inf, 2.0, -inf]], requires_grad=True)
    y = clamped_swiglu_gate_up(gate_up)
    ref = clamped_swiglu_torch(gate_up.detach()[..., ::2], gate_up.detach()[..., 1::2])
    torch.testing.assert_close(y, ref, equal_nan=True)
    assert torch.isnan(y[0, :2]).all()  # (a -inf gate gives -inf · σ(-inf) = NaN in torch too)
    (d,) = torch.autograd.grad(y.sum(), gate_up)
    g = gate_up.detach().clone().requires_grad_()
    (ref_d,) = torch.autograd.grad(clamped_swiglu_torch(g[..., ::2], g[..., 1::2]).sum(), g)
    torch.testing.assert_close(d, ref_d, equal_nan=True)
