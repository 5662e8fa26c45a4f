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
