"""GPU-only checks (skipped without CUDA): tuned kernels at real shapes, torch.compile, CUDA graphs."""

import pytest
import torch

import liger_gen
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.reference import rms_norm_float64
from liger_gen.runtime import tables

pytestmark = pytest.mark.gpu


def _check(rows, hidden, dtype, casting_mode, offset=0.0):
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype).requires_grad_()
    y = liger_gen.functional.rms_norm(x, w, 1e-6, offset, casting_mode)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = rms_norm_float64(x64, w64, 1e-6, offset)
    ref.backward(dy.double())
    tol = REL_TOL[dtype]
    assert rel_l2(y, ref) < tol
    assert rel_l2(x.grad, x64.grad) < tol
    assert rel_l2(w.grad, w64.grad) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
@pytest.mark.parametrize("rows,hidden", [(16384, 4096), (8192, 2048), (3, 4097), (1, 123)])
def test_tuned_and_heuristic_match_float64(rows, hidden, dtype, casting_mode):
    _check(rows, hidden, dtype, casting_mode)
    with tables.heuristic_only():
        _check(rows, hidden, dtype, casting_mode, offset=1.0 if casting_mode == "gemma" else 0.0)


def test_compile_fullgraph_and_cuda_graph():
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x, w):
        return liger_gen.functional.rms_norm(x, w).float().square().sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(x, w)
    loss.backward()
    ref = step(x.detach(), w.detach())
    assert torch.allclose(loss.detach(), ref, rtol=1e-3)

    static_x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    y_eager = liger_gen.functional.rms_norm(static_x, w.detach())
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        liger_gen.functional.rms_norm(static_x, w.detach())
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        static_y = liger_gen.functional.rms_norm(static_x, w.detach())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, y_eager)


@pytest.mark.parametrize("rows", [2048, 16384, 5])
def test_clamped_swiglu_tuned_and_heuristic_match_float64(rows):
    """gpt-oss's expert gate at its width (2880) on the interleaved projection, bf16, both clamps active."""
    from liger_gen.reference import clamped_swiglu_float64

    gate_up = (4.0 * torch.randn(rows, 2 * 2880, device="cuda")).bfloat16().requires_grad_()
    dy = torch.randn(rows, 2880, device="cuda", dtype=torch.bfloat16)
    gu64 = gate_up.detach().double().requires_grad_()
    ref = clamped_swiglu_float64(gu64[:, ::2], gu64[:, 1::2])
    ref.backward(dy.double())
    for heuristic in (False, True):
        with tables.heuristic_only() if heuristic else _nothing():
            y = liger_gen.functional.clamped_swiglu_gate_up(gate_up)
            (d,) = torch.autograd.grad(y, gate_up, dy)
        assert rel_l2(y, ref) < REL_TOL[torch.bfloat16] and rel_l2(d, gu64.grad) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_scaling_matches_float64_at_llm_shapes(reduction):
    """use_token_scaling on the tuned kernels: cross_entropy (4096 x 32000 bf16 logits) and FLCE (4096 x 2048
    -> 32000, bf16) against float64."""
    from liger_gen.ops.lm_head.fused_linear_cross_entropy import fused_linear_cross_entropy_float64_chunked
    from liger_gen.reference import cross_entropy_float64

    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = (2 * torch.randn(4096, 32000, device="cuda", generator=gen)).bfloat16().requires_grad_()
    target = torch.randint(0, 32000, (4096,), device="cuda", generator=gen)
    target[::7] = -100
    loss = liger_gen.functional.cross_entropy(logits, target, reduction=reduction, use_token_scaling=True,
                                              lse_square_scale=1e-4)
    g = torch.randn(loss.shape, device="cuda", generator=gen) if loss.dim() else torch.tensor(1.0, device="cuda")
    (dlogits,) = torch.autograd.grad(loss, logits, g)
    x64 = logits.detach().double().requires_grad_()
    ref, _ = cross_entropy_float64(x64, target, reduction=reduction, lse_square_scale=1e-4, use_token_scaling=True)
    ref.backward(g.double())
    assert rel_l2(loss, ref) < 1e-4 and rel_l2(dlogits, x64.grad) < REL_TOL[torch.bfloat16]
    del logits, x64, dlogits
    x = torch.randn(4096, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(32000, 2048, device="cuda", generator=gen) / 2048 ** 0.5).bfloat16().requires_grad_()
    loss = liger_gen.functional.fused_linear_cross_entropy(x, w, target, reduction=reduction, use_token_scaling=True)
    dx, dw = torch.autograd.grad(loss, (x, w), g)
    ref_loss, _, ref_dx, ref_dw, _ = fused_linear_cross_entropy_float64_chunked(
        x, w, target, reduction=reduction, grad_output=g, use_token_scaling=True)
    from liger_gen.ops.lm_head.fused_linear_cross_entropy import loss_tolerance

    assert rel_l2(loss, ref_loss) < loss_tolerance(torch.bfloat16)
    assert rel_l2(dx, ref_dx) < REL_TOL[torch.bfloat16] and rel_l2(dw, ref_dw) < REL_TOL[torch.bfloat16]


def _nothing():
    import contextlib

    return contextlib.nullcontext()
