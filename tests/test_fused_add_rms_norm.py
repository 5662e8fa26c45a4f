"""Fused residual add + RMSNorm kernels (Triton interpreter on the CPU) against float64, and the API around them."""

import dataclasses

import optuna
import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.tuning.search import Tuner
from liger_gen.ops.norms.fused_add_rms_norm import (FusedAddRMSNormConfig, FusedAddRMSNormProblem, FusedAddRMSNormSpace,
                                                    fused_add_rms_norm, fused_add_rms_norm_float64,
                                                    fused_add_rms_norm_torch, tuning_problems)

from conftest import seeded
from helpers import assert_error_names

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _random_case(shape, dtype, device, gen, residual_dtype=None):
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    r = (2 * torch.randn(shape, generator=gen)).to(device, residual_dtype or dtype).requires_grad_()
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(device, dtype).requires_grad_()
    return x, r, w


def _float64_grads(x, r, w, eps, offset, dy, ds):
    """(y, s, dx, dr, dw) of the exact float64 computation for upstream gradients dy and ds (ds may be None)."""
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    y64, s64 = fused_add_rms_norm_float64(x64, r64, w64, eps, offset)
    outs, grads = [y64], [dy.double()]
    if ds is not None:
        outs.append(s64)
        grads.append(ds.double())
    torch.autograd.backward(outs, grads)
    return y64, s64, x64.grad, r64.grad, w64.grad


def _assert_matches_float64(x, r, w, eps, offset, casting_mode, use_sum=True, gen=None):
    y, s = fused_add_rms_norm(x, r, w, eps, offset, casting_mode)
    assert y.shape == s.shape == x.shape
    assert s.dtype == torch.promote_types(x.dtype, r.dtype)
    dy = torch.randn(y.shape, generator=gen).to(y.device, y.dtype)
    ds = torch.randn(s.shape, generator=gen).to(s.device, s.dtype) if use_sum else None
    torch.autograd.backward([y, s] if use_sum else [y], [dy, ds] if use_sum else [dy])
    y64, s64, dx64, dr64, dw64 = _float64_grads(x, r, w, eps, offset, dy, ds)
    tol = REL_TOL[s.dtype]
    assert rel_l2(y, y64) < tol, "y"
    assert rel_l2(s, s64) < tol, "s"
    assert x.grad.dtype == x.dtype and r.grad.dtype == r.dtype
    assert rel_l2(x.grad, dx64) < REL_TOL[x.dtype], "dx"
    assert rel_l2(r.grad, dr64) < REL_TOL[r.dtype], "dresidual"
    assert rel_l2(w.grad, dw64) < REL_TOL[w.dtype], "dw"
    assert x.grad.data_ptr() != r.grad.data_ptr()  # two buffers: never aliasing .grad tensors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 123), (7, 64), (3, 4097), (2, 3, 96), (33, 3)])
def test_kernel_matches_float64(shape, dtype, device):
    gen = seeded(shape, str(dtype))
    x, r, w = _random_case(shape, dtype, device, gen)
    _assert_matches_float64(x, r, w, 1e-6, 0.0, "llama", gen=gen)


@pytest.mark.parametrize("casting_mode,offset", [("llama", 0.5), ("gemma", 1.0), ("gemma", 0.0), ("none", 0.0),
                                                 ("none", 1.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_casting_modes_and_offset(casting_mode, offset, dtype, device):
    gen = torch.Generator().manual_seed(7)
    x, r, w = _random_case((9, 200), dtype, device, gen)
    _assert_matches_float64(x, r, w, 1e-5, offset, casting_mode, gen=gen)


@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
def test_unused_sum_gets_no_gradient_and_is_handled(casting_mode, device):
    """Autograd passes None for an unused output (eager): the kernel's no-ds branch."""
    gen = torch.Generator().manual_seed(8)
    x, r, w = _random_case((11, 72), torch.bfloat16, device, gen)
    _assert_matches_float64(x, r, w, 1e-6, 0.0, casting_mode, use_sum=False, gen=gen)


def test_unused_norm_output_passes_the_sum_gradient_through(device):
    x, r, w = _random_case((5, 40), torch.float32, device, torch.Generator().manual_seed(9))
    _, s = fused_add_rms_norm(x, r, w)
    ds = torch.randn_like(s)
    s.backward(ds)
    assert torch.equal(x.grad, ds) and torch.equal(r.grad, ds) and x.grad.data_ptr() != r.grad.data_ptr()
    assert w.grad is None  # as in PyTorch: weight is not on the path to the loss


def test_gradients_accumulate_over_two_backwards_of_views(device):
    """x and residual reached through views of leaves: a shared gradient buffer would alias x.grad and
    r.grad and double-count the second accumulation (PyTorch's own `a + b` does, as of 2.13)."""
    gen = torch.Generator().manual_seed(10)
    x, r, w = _random_case((6, 32), torch.float32, device, gen)
    dy, ds = torch.randn(6, 32, generator=gen).to(device), torch.randn(6, 32, generator=gen).to(device)
    for _ in range(2):
        y, s = fused_add_rms_norm(x.view(6, 32), r.view(6, 32), w)
        torch.autograd.backward([y, s], [dy, ds])
    _, _, dx64, dr64, dw64 = _float64_grads(x, r, w, 1e-6, 0.0, dy, ds)
    assert rel_l2(x.grad, 2 * dx64) < 1e-5 and rel_l2(r.grad, 2 * dr64) < 1e-5 and rel_l2(w.grad, 2 * dw64) < 1e-5


@pytest.mark.parametrize("make_view", [
    lambda t: t.t(),                      # transposed: last dim has stride != 1
    lambda t: t[:, 3:67],                 # sliced columns: unit stride, row stride 80
    lambda t: t[::2],                     # every other row
])
def test_non_contiguous_inputs(make_view, device):
    gen = torch.Generator().manual_seed(3)
    x = make_view(torch.randn(80, 80, generator=gen).to(device)).detach().requires_grad_()
    # residual through a different view kind than x, so the two row strides differ
    r_base = torch.randn(2 * x.shape[0], x.shape[1] + 5, generator=gen).to(device)
    r = r_base[::2, 5:].detach().requires_grad_()
    assert not x.is_contiguous() and not r.is_contiguous() and r.shape == x.shape
    w = (1 + 0.2 * torch.randn(x.shape[-1], generator=gen)).to(device).requires_grad_()
    _assert_matches_float64(x, r, w, 1e-6, 0.0, "llama", gen=gen)


@pytest.mark.parametrize("x_dtype,r_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                                             (torch.bfloat16, torch.float16)])
def test_mixed_dtypes_follow_pytorch_promotion(x_dtype, r_dtype, device):
    """Like ``x + residual``: s has the promoted dtype, each input's gradient comes back in its own dtype."""
    gen = torch.Generator().manual_seed(12)
    x, r, w = _random_case((7, 48), x_dtype, device, gen, residual_dtype=r_dtype)
    _assert_matches_float64(x, r, w, 1e-6, 0.0, "llama", gen=gen)
    y, s = fused_add_rms_norm(x.detach(), r.detach(), w.detach())
    ref_y, ref_s = fused_add_rms_norm_torch(x.detach(), r.detach(), w.detach(), 1e-6, 0.0, "llama")
    assert (y.dtype, s.dtype) == (ref_y.dtype, ref_s.dtype)
    assert torch.equal(s, ref_s)  # fp32 sums of exactly representable inputs: no rounding to disagree on


@pytest.mark.parametrize("casting_mode", ["llama", "gemma", "none"])
def test_kernel_rounds_like_plain_pytorch(casting_mode, device):
    """On the GPU: s is bit-identical to PyTorch's add, y within two bf16 ulp of the plain-PyTorch formula."""
    if device.type == "cpu":
        pytest.skip("Triton's interpreter converts fp32 to bf16 by truncation, not round-to-nearest")
    gen = torch.Generator().manual_seed(11)
    x, r, w = (t.detach() for t in _random_case((16, 256), torch.bfloat16, device, gen))
    y, s = fused_add_rms_norm(x, r, w, 1e-6, 0.0, casting_mode)
    ref_y, ref_s = fused_add_rms_norm_torch(x, r, w, 1e-6, 0.0, casting_mode)
    assert torch.equal(s, ref_s)
    two_ulp = 2.0 ** -6 * ref_y.float().abs().clamp_min(1e-3)
    assert ((y.float() - ref_y.float()).abs() <= two_ulp).all()


def test_cpu_path_equals_transformers_decoder_pattern(monkeypatch):
    """Without the interpreter, CPU tensors run plain PyTorch: bit-identical to ``residual + hidden`` followed
    by transformers' LlamaRMSNorm, and the same gradients."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hf = LlamaRMSNorm(48, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(hf.weight, 1.0, 0.1)
    hidden = torch.randn(3, 5, 48, dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(3, 5, 48, dtype=torch.bfloat16, requires_grad=True)
    s_ref = residual + hidden
    y_ref = hf(s_ref)
    y, s = fused_add_rms_norm(hidden, residual, hf.weight, 1e-5)
    assert torch.equal(s, s_ref) and torch.equal(y, y_ref)


def test_torch_compile_has_no_graph_break(device):
    gen = torch.Generator().manual_seed(13)
    x, r, w = _random_case((8, 64), torch.float32, device, gen)

    def f(x, r, w):
        y, s = fused_add_rms_norm(x, r, w)
        return y.square().sum() + (s * s.detach()).sum()

    def f_no_sum(x, r, w):
        return fused_add_rms_norm(x, r, w)[0].square().sum()

    for fn in (f, f_no_sum):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]
        loss = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
        loss.backward()
        ref_leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]
        ref = fn(*ref_leaves)
        ref.backward()
        torch.testing.assert_close(loss, ref)
        for a, b in zip(leaves, ref_leaves):
            torch.testing.assert_close(a.grad, b.grad)


def test_opcheck_custom_ops(device):
    x, r, w = torch.randn(5, 40, device=device), torch.randn(5, 40, device=device), torch.randn(40, device=device)
    torch.library.opcheck(torch.ops.liger_gen.fused_add_rms_norm_fwd.default, (x, r, w, 1e-6, 0.0, "llama"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.liger_gen.fused_add_rms_norm_fwd.default,
                          (x.bfloat16(), r, w, 1e-6, 1.0, "gemma"), test_utils=("test_schema", "test_faketensor"))
    s = x + r
    rstd = torch.rsqrt(s.pow(2).mean(-1) + 1e-6)
    for ds in (torch.randn(5, 40, device=device), None):
        torch.library.opcheck(torch.ops.liger_gen.fused_add_rms_norm_bwd.default,
                              (torch.randn(5, 40, device=device), ds, s, w, rstd, 0.0, "llama", torch.float32,
                               torch.bfloat16),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16), (4, 0)])
def test_empty_inputs_match_pytorch(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    r = torch.randn(shape, device=device, requires_grad=True)
    w = torch.ones(shape[-1], device=device, requires_grad=True)
    y, s = fused_add_rms_norm(x, r, w)
    assert y.shape == s.shape == x.shape
    (y.sum() + s.sum()).backward()
    assert x.grad.shape == r.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("x,r,w,exc,words", [
    (torch.ones(4, 8), torch.ones(4, 9), torch.ones(8), ValueError, ["residual", "(4, 9)", "(4, 8)"]),
    (torch.ones(4, 8), torch.ones(8), torch.ones(8), ValueError, ["residual", "(8,)", "broadcast"]),
    (torch.ones(4, 8), torch.ones(4, 8), torch.ones(7), ValueError, ["weight", "(7,)", "(8,)"]),
    (torch.ones(4, 8), torch.ones(4, 8), torch.ones(2, 8), ValueError, ["weight", "(2, 8)"]),
    (torch.ones(4, 8, dtype=torch.int64), torch.ones(4, 8), torch.ones(8), TypeError, ["x", "(4, 8)", "torch.int64"]),
    (torch.ones(4, 8), torch.ones(4, 8, dtype=torch.int32), torch.ones(8), TypeError, ["residual", "torch.int32"]),
    (torch.ones(4, 8), torch.ones(4, 8), torch.ones(8, dtype=torch.int64), TypeError, ["weight", "torch.int64"]),
    (torch.ones(4, 8), torch.ones(4, 8, dtype=torch.float64), torch.ones(8), TypeError,
     ["residual", "float64", "(4, 8)"]),
    (torch.ones(()), torch.ones(()), torch.ones(1), ValueError, ["at least one dim"]),
    (torch.ones(4, 8), [1.0] * 8, torch.ones(8), TypeError, ["residual", "list"]),
])
def test_bad_input_names_tensor_shape_dtype(x, r, w, exc, words, device):
    assert_error_names(fused_add_rms_norm, (x, r, w), exc, words, device)


def test_bad_options_and_too_wide_rows(device):
    x = torch.ones(2, 4, device=device)
    with pytest.raises(ValueError, match="casting_mode"):
        fused_add_rms_norm(x, x, torch.ones(4, device=device), casting_mode="fp8")
    with pytest.raises(TypeError, match="eps"):
        fused_add_rms_norm(x, x, torch.ones(4, device=device), eps="1e-6")
    with pytest.raises(TypeError, match="offset"):
        fused_add_rms_norm(x, x, torch.ones(4, device=device), offset=True)
    wide = torch.ones(1, 32769, device=device)
    with pytest.raises(ValueError, match="32768"):
        fused_add_rms_norm(wide, wide, torch.ones(32769, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inputs_on_other_devices_are_an_error():
    x = torch.ones(2, 4, device="cuda")
    with pytest.raises(ValueError, match="residual of shape"):
        fused_add_rms_norm(x, torch.ones(2, 4), torch.ones(4, device="cuda"))
    with pytest.raises(ValueError, match="one device"):
        fused_add_rms_norm(x, x, torch.ones(4))


def test_float64_runs_on_plain_cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, r, w = (torch.randn(shape, dtype=torch.float64) for shape in ((3, 10), (3, 10), (10,)))
    y, s = fused_add_rms_norm(x, r, w)
    y64, s64 = fused_add_rms_norm_float64(x, r, w, 1e-6)
    assert y.dtype == s.dtype == torch.float64 and torch.equal(s, s64)
    # rstd in fp32, as transformers' LlamaRMSNorm computes it for any input dtype
    torch.testing.assert_close(y, y64, rtol=1e-6, atol=1e-7)


def test_inference_mode_inputs_with_trained_weight(device):
    with torch.inference_mode():
        x, r = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
        y_inf, s_inf = fused_add_rms_norm(x, r, torch.ones(16, device=device))
    assert y_inf.is_inference() and torch.equal(s_inf, x + r)
    w = torch.randn(16, device=device, requires_grad=True)
    y, s = fused_add_rms_norm(x, r, w)
    (y.sum() + s.sum()).backward()
    w64 = w.detach().double().requires_grad_()
    fused_add_rms_norm_float64(x.clone(), r.clone(), w64, 1e-6)[0].sum().backward()
    assert rel_l2(w.grad, w64.grad) < REL_TOL[torch.float32]


# ------------------------------------------------------------------------------------------ space and tuner


def test_constraints_count_the_extra_streams():
    """The fused add's own constraints (those every row norm shares: ``test_row_norms``)."""
    space = FusedAddRMSNormSpace(4096, torch.bfloat16, DeviceLimits(max_threads_per_block=512))
    good = space.heuristic()
    assert any("per thread" in p for p in space.violations(
        dataclasses.replace(good, BLOCK_M_BWD=1, num_warps_bwd=4, BWD_PREFETCH=1)))
    assert not space.violations(dataclasses.replace(good, BLOCK_M_BWD=1, num_warps_bwd=4, BWD_PREFETCH=0))
    # shared memory: (stages − 1) pipelined tiles of each of the 3 backward streams, 2 forward streams
    small = FusedAddRMSNormSpace(8192, torch.float32, DeviceLimits(max_shared_memory_per_block=81920))
    cfg = dataclasses.replace(small.heuristic(), num_stages_bwd=2, num_stages_fwd=2, BLOCK_M_FWD=1)
    problems = small.violations(cfg)
    assert any(p.startswith("bwd") and "shared memory" in p for p in problems)  # 3·32 KiB > 80 KiB
    assert not any(p.startswith("fwd") for p in problems)  # 2·32 KiB fits


def test_the_gate_catches_a_wrong_variant(device):
    """The gate can fail: a kernel that forgets ds in the backward, or writes a wrong s, is rejected."""
    problem = FusedAddRMSNormProblem(torch.float32, 64, 9, device, seed=2)
    module = load_variant("fused_add_rms_norm", problem.template_params(problem.space.heuristic()))

    class DropsDs:
        def backward(self, dy, ds, *rest):
            module.backward(dy, None, *rest)

        def forward(self, x, r, w, y, s, rstd, eps, offset):
            module.forward(x, r, w, y, s, rstd, eps, offset)
            s.mul_(1.001)

        def __getattr__(self, name):
            return getattr(module, name)

    assert "dx: relative L2 error" in problem.check(DropsDs(), "bwd")
    assert "s: relative L2 error" in problem.check(DropsDs(), "fwd")


def test_small_tuner_run_gives_a_valid_entry(device):
    def cost_model(launch, params):
        return 1.0 + abs(params["BLOCK_M_FWD"] - 2) + 0.1 * params["num_warps_bwd"] + 0.2 * params["BWD_PREFETCH"]

    from liger_gen.models import PRESETS

    model = dataclasses.replace(PRESETS["llama3-8b"], hidden_size=96)
    (problem,) = tuning_problems(model, [20], torch.float32, device, seed=1)
    assert problem.dims == {"n_cols": 96} and problem.eps == model.rms_norm_eps
    entry = Tuner(n_trials=4, timer=cost_model, retime_rounds=1, seed=0).tune(problem)
    config = FusedAddRMSNormConfig.from_dict(entry["config"])
    assert not problem.space.violations(config)
    for phase in ("fwd", "bwd"):
        assert entry["trials"][phase][0]["params"] == problem.space.phase_params(problem.space.heuristic(), phase)
        assert entry["timing_ms"][phase]["tuned"] <= entry["timing_ms"][phase]["heuristic"]
    assert entry["variant"] == {"casting_mode": "llama"} and entry["bytes"]["bwd"] > entry["bytes"]["fwd"]


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_llama3_8b_shape_bf16_matches_float64():
    """16384 tokens × hidden 4096, bf16, the tuned (or heuristic) kernels against float64 (chunked reference)."""
    rows, hidden, dtype = 16384, 4096, torch.bfloat16
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
    r = (4 * torch.randn(rows, hidden, device="cuda")).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype).requires_grad_()
    y, s = fused_add_rms_norm(x, r, w, 1e-5)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward([y, s], [dy, ds])
    err = {k: [0.0, 0.0] for k in ("y", "s", "dx", "dr")}
    dw64 = torch.zeros(hidden, dtype=torch.float64, device="cuda")
    for lo in range(0, rows, 2048):  # float64 autograd of 16384 × 4096 needs ~5 GB per tensor: chunk it
        sl = slice(lo, lo + 2048)
        x64, r64 = x[sl].detach().double().requires_grad_(), r[sl].detach().double().requires_grad_()
        w64 = w.detach().double().requires_grad_()
        y64, s64 = fused_add_rms_norm_float64(x64, r64, w64, 1e-5)
        torch.autograd.backward([y64, s64], [dy[sl].double(), ds[sl].double()])
        dw64 += w64.grad
        for k, a, e in (("y", y[sl], y64), ("s", s[sl], s64), ("dx", x.grad[sl], x64.grad),
                        ("dr", r.grad[sl], r64.grad)):
            err[k][0] += (a.double() - e.detach()).pow(2).sum().item()
            err[k][1] += e.detach().pow(2).sum().item()
    tol = REL_TOL[dtype]
    for k, (num, den) in err.items():
        assert (num / den) ** 0.5 < tol, k
    assert rel_l2(w.grad, dw64) < tol
    assert torch.equal(s, (x + r).detach())  # the sum rounds exactly as PyTorch's add


@pytest.mark.gpu
def test_inductor_fullgraph_and_cuda_graph():
    """Inductor (not only aot_eager) compiles the custom ops without a graph break; a CUDA graph replays them."""
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x, r, w):
        y, s = fused_add_rms_norm(x, r, w)
        return y.float().square().sum() + s.float().sum()

    loss = torch.compile(step, fullgraph=True)(x, r, w)
    loss.backward()
    grads = [t.grad.clone() for t in (x, r, w)]
    for t in (x, r, w):
        t.grad = None
    ref = step(x, r, w)
    ref.backward()
    assert torch.allclose(loss.detach(), ref.detach(), rtol=1e-3)
    for g, t in zip(grads, (x, r, w)):
        assert rel_l2(g, t.grad) < REL_TOL[torch.bfloat16]

    static_x, static_r = x.detach().clone(), r.detach().clone()
    y_eager, s_eager = fused_add_rms_norm(static_x, static_r, w.detach())
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_add_rms_norm(static_x, static_r, w.detach())
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static_y, static_s = fused_add_rms_norm(static_x, static_r, w.detach())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, y_eager) and torch.equal(static_s, s_eager)
