"""KL divergence kernels (Triton interpreter on the CPU) against float64, and the op's API around them."""

import dataclasses
import warnings

import optuna
import pytest
import torch
import torch.nn.functional as F

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.tuning.search import Tuner
from liger_gen.tuning.tables import tune_to_table
from liger_gen.models import ModelShape
from liger_gen.ops.divergence.kl_div import (REDUCTIONS, KLDivProblem, KLDivSpace, kl_div, kl_div_float64,
                                             kl_div_torch, tuning_problems)
from liger_gen.ops.divergence.rows import DivergenceConfig, tuning_rows
from liger_gen.runtime import tables

from conftest import seeded
from helpers import (HEURISTIC_LIMITS, assert_error_names, assert_passes_the_gate,
                     assert_trains_past_an_inference_mode_target, valid_heuristics)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, log_target, device, gen, target_dtype=None):
    """Log-probabilities x and a target distribution t (log-probabilities with log_target) over the last dim."""
    x = torch.randn(shape, generator=gen).mul(2).log_softmax(-1).to(device, dtype)
    t_log = torch.randn(shape, generator=gen).mul(2).log_softmax(-1)
    t = (t_log if log_target else t_log.exp()).to(device, target_dtype or dtype)
    return x, t


def _assert_matches_float64(x, t, reduction, log_target, target_grad=True, grad=None):
    x = x.detach().requires_grad_()
    t = t.detach().requires_grad_(target_grad)
    y = kl_div(x, t, reduction, log_target)
    g = torch.randn(y.shape, dtype=torch.float32) if grad is None else grad(y)
    if reduction == "mean":  # undo the 1/numel: fp16 gradients of ~1e-7 would be subnormal, with no precision left
        g = g * max(1, x.numel())
    g = g.to(y.device, y.dtype)
    y.backward(g)
    x64 = x.detach().double().requires_grad_()
    t64 = t.detach().double().requires_grad_(target_grad)
    ref = kl_div_float64(x64, t64, reduction, log_target)
    ref.backward(g.double())
    assert y.shape == ref.shape
    assert y.dtype == torch.promote_types(x.dtype, t.dtype)
    assert rel_l2(y, ref) < REL_TOL[y.dtype], "loss"
    assert rel_l2(x.grad, x64.grad) < REL_TOL[x.dtype], "d input"
    assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
    if target_grad:
        assert rel_l2(t.grad, t64.grad) < REL_TOL[t.dtype], "d target"
    else:
        assert t.grad is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("shape", [(1, 300), (2, 3, 77)])
def test_kernel_matches_float64(shape, log_target, reduction, dtype, device):
    gen = seeded(shape, log_target, reduction, str(dtype))
    x, t = _inputs(shape, dtype, log_target, device, gen)
    _assert_matches_float64(x, t, reduction, log_target, target_grad=reduction in ("sum", "none"))


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_long_rows_many_chunks_and_target_grad_only(reduction, device):
    """A vocab of several chunks (not a multiple of any block), and d/dtarget without d/dinput."""
    gen = torch.Generator().manual_seed(1)
    x, t = _inputs((5, 2500), torch.float32, False, device, gen)
    _assert_matches_float64(x, t, reduction, False)
    t = t.detach().requires_grad_()
    y = kl_div(x.detach(), t, reduction)
    y.sum().backward()
    t64 = t.detach().double().requires_grad_()
    kl_div_float64(x.detach(), t64, reduction).sum().backward()
    assert rel_l2(t.grad, t64.grad) < REL_TOL[torch.float32]


@pytest.mark.parametrize("make_view", [
    lambda t: t.t(),                      # transposed: the vocab dim has stride != 1
    lambda t: t[:, 3:67],                 # sliced columns: unit stride, row stride 80
    lambda t: t[::2],                     # every other row
])
@pytest.mark.parametrize("log_target", [False, True])
def test_non_contiguous_inputs(make_view, log_target, device):
    gen = torch.Generator().manual_seed(3)
    x, t = _inputs((80, 80), torch.float32, log_target, device, gen)
    x, t = make_view(x), make_view(t)
    assert not x.is_contiguous() and not t.is_contiguous()
    for reduction in ("batchmean", "none"):
        _assert_matches_float64(x, t, reduction, log_target)


def test_expanded_target_and_expanded_grad_output(device):
    """A broadcast target row (stride 0) and the stride-0 grad_output of ``.sum()`` are read in place."""
    gen = torch.Generator().manual_seed(4)
    x, t = _inputs((6, 130), torch.float32, False, device, gen)
    t = t[:1].expand(6, 130)
    _assert_matches_float64(x, t, "sum", False)
    _assert_matches_float64(x, t, "none", False, grad=lambda y: torch.ones((), device=y.device).expand(y.shape))


def test_mixed_dtypes_promote_like_torch(device):
    gen = torch.Generator().manual_seed(5)
    x, t = _inputs((4, 100), torch.bfloat16, False, device, gen, target_dtype=torch.float32)
    assert kl_div(x, t).dtype == F.kl_div(x.cpu(), t.cpu()).dtype == torch.float32
    _assert_matches_float64(x, t, "batchmean", False)
    _assert_matches_float64(x, t, "none", False)


@pytest.mark.parametrize("shape", [(), (37,)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_and_one_dim_inputs(shape, reduction, device):
    """batchmean divides by size(0) — the vocab for a 1-D input, nothing for a 0-d one — as torch does."""
    gen = torch.Generator().manual_seed(6)
    x, t = _inputs(shape or (1,), torch.float32, False, device, gen)
    x, t = x.reshape(shape), t.reshape(shape)
    _assert_matches_float64(x, t, reduction, False)


def test_zero_target_and_infinite_input_follow_torch(device):
    """t = 0 contributes 0 (xlogy), except t·x = NaN at x = −inf; d/dtarget is NaN at t = 0 (autograd's t/t)."""
    x = torch.tensor([[-1.0, float("-inf"), -2.0, -0.5], [-3.0, -1.0, float("-inf"), -0.1]])
    t = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.5, 0.0]])
    xk, tk = x.to(device).clone().requires_grad_(), t.to(device).clone().requires_grad_()
    y = kl_div(xk, tk, "none")
    y.backward(torch.ones_like(y))
    xr, tr = x.double().requires_grad_(), t.double().requires_grad_()
    ref = F.kl_div(xr, tr, reduction="none")
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y.cpu().double(), ref.detach(), equal_nan=True)
    torch.testing.assert_close(xk.grad.cpu().double(), xr.grad, equal_nan=True)
    torch.testing.assert_close(tk.grad.cpu().double(), tr.grad, equal_nan=True)
    assert torch.isnan(tk.grad[0, 0]) and torch.isnan(y[0, 1]) and torch.isinf(y[1, 2])


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_cpu_path_is_torch_kl_div(reduction, log_target, monkeypatch):
    """Without the interpreter, CPU tensors run ATen's kl_div: bit-identical to F.kl_div, gradients too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(7)
    x, t = _inputs((3, 5, 40), torch.bfloat16, log_target, "cpu", gen)
    x1, t1 = x.clone().requires_grad_(), t.clone().requires_grad_()
    x2, t2 = x.clone().requires_grad_(), t.clone().requires_grad_()
    y = kl_div(x1, t1, reduction, log_target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = F.kl_div(x2, t2, reduction=reduction, log_target=log_target)
    assert torch.equal(y, ref)
    y.sum().backward()
    ref.sum().backward()
    assert torch.equal(x1.grad, x2.grad) and torch.equal(t1.grad, t2.grad)
    x64, t64 = x.double(), t.double()
    torch.testing.assert_close(kl_div(x64, t64, reduction, log_target), kl_div_float64(x, t, reduction, log_target))


@pytest.mark.parametrize("shape", [(0, 16), (3, 0), (2, 0, 5)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_inputs_match_pytorch(shape, reduction, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    t = torch.rand(shape, device=device, requires_grad=True)
    y = kl_div(x, t, reduction)
    ref = kl_div_torch(x.detach().cpu(), t.detach().cpu(), reduction)
    assert y.shape == ref.shape
    torch.testing.assert_close(y.detach().cpu(), ref, equal_nan=True)
    y.sum().backward()
    assert x.grad.shape == x.shape and t.grad.shape == t.shape


@pytest.mark.parametrize("args,exc,words", [
    ((torch.ones(4, 8), torch.ones(4, 7)), ValueError, ["input", "(4, 8)", "target", "(4, 7)", "same shape"]),
    ((torch.ones(4, 8, dtype=torch.int64), torch.ones(4, 8)), TypeError, ["input", "(4, 8)", "torch.int64"]),
    ((torch.ones(4, 8), torch.ones(4, 8, dtype=torch.int32)), TypeError, ["target", "torch.int32"]),
    ((torch.ones(4, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.float64)), TypeError,
     ["float64", "(4, 8)", "input"]),
    ((torch.ones(4, 8), "target"), TypeError, ["target", "str"]),
])
def test_bad_input_names_tensor_shape_dtype(args, exc, words, device):
    assert_error_names(kl_div, args, exc, words, device)


def test_bad_options(device):
    x = torch.zeros(2, 4, device=device)
    with pytest.raises(ValueError, match="reduction.*'avg'"):
        kl_div(x, x, reduction="avg")
    with pytest.raises(TypeError, match="log_target"):
        kl_div(x, x, log_target=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensors_on_different_devices():
    with pytest.raises(ValueError, match="one device") as info:
        kl_div(torch.zeros(2, 4, device="cuda"), torch.zeros(2, 4))
    assert "target of shape (2, 4)" in str(info.value)


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_torch_compile_has_no_graph_break(reduction, device):
    gen = torch.Generator().manual_seed(8)
    x, t = _inputs((6, 90), torch.float32, True, device, gen)

    def f(x, t):
        return (kl_div(x, t, reduction, True) * 3).sum()

    x1, t1 = x.clone().requires_grad_(), t.clone().requires_grad_()
    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(x1, t1)
    loss.backward()
    x2, t2 = x.clone().requires_grad_(), t.clone().requires_grad_()
    ref = f(x2, t2)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(t1.grad, t2.grad)


def test_torch_compile_dynamic_batch_is_one_graph(device):
    """The batchmean/mean divisor is a SymInt in the op's schema: a new batch size does not recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, t: kl_div(x, t, "batchmean", True), backend=counter, fullgraph=True,
                             dynamic=True)
    gen = torch.Generator().manual_seed(14)
    for batch in (3, 5, 9):
        x, t = _inputs((batch, 2, 40), torch.float32, True, device, gen)
        x = x.requires_grad_()
        loss = compiled(x, t)
        loss.backward()
        x64 = x.detach().double().requires_grad_()
        ref = kl_div_float64(x64, t, "batchmean", True)
        ref.backward()
        assert rel_l2(loss, ref) < 1e-5 and rel_l2(x.grad, x64.grad) < 1e-5
    assert counter.frame_count == 1


def test_opcheck_custom_ops(device):
    gen = torch.Generator().manual_seed(9)
    x, t = _inputs((5, 40), torch.float32, False, device, gen)
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.liger_gen.kl_div_fwd.default, (x, t, "batchmean", 5, False), test_utils=utils)
    torch.library.opcheck(torch.ops.liger_gen.kl_div_fwd.default, (x, t, "none", 1, True), test_utils=utils)
    g = torch.tensor(0.5, device=device)
    torch.library.opcheck(torch.ops.liger_gen.kl_div_bwd.default, (g, x, t, "sum", 1, False, True, True, x.dtype),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.liger_gen.kl_div_bwd.default,
                          (torch.randn(5, 40, device=device), x, t, "none", 1, True, True, False, x.dtype),
                          test_utils=utils)
    # d/dinput does not read the input: the backward is called without it when the target needs no gradient
    torch.library.opcheck(torch.ops.liger_gen.kl_div_bwd.default,
                          (g, None, t, "batchmean", 5, False, True, False, torch.bfloat16), test_utils=utils)


def test_inference_mode_target_with_trained_input(device):
    assert_trains_past_an_inference_mode_target(kl_div, kl_div_float64, lambda: torch.rand(4, 30, device=device),
                                                device)


# ------------------------------------------------------------------------------------------------ space/tuning


@pytest.mark.parametrize("dtype", DTYPES)
def test_heuristic_valid_for_every_vocab(dtype):
    vocabs = list(range(1, 300)) + [2**k + d for k in range(9, 19) for d in (-1, 0, 1)]
    vocabs += [32000, 32768, 128256, 151936, 152064, 256000]
    list(valid_heuristics(KLDivSpace, vocabs, dtype,
                          HEURISTIC_LIMITS + (DeviceLimits(max_shared_memory_per_block=101376),)))


def test_constraints_reject_bad_configs():
    space = KLDivSpace(128256, torch.bfloat16, DeviceLimits(max_threads_per_block=256,
                                                            max_shared_memory_per_block=101376))
    good = space.heuristic()
    assert good.BLOCK_V_FWD == 2048 and good.BLOCK_M_FWD == 1
    assert any("threads" in p for p in space.violations(dataclasses.replace(good, num_warps_fwd=16)))
    assert any("per thread" in p for p in space.violations(dataclasses.replace(good, num_warps_bwd=1)))
    assert any("shared memory" in p for p in space.violations(
        dataclasses.replace(good, BLOCK_V_BWD=8192, num_warps_bwd=16, num_stages_bwd=3)))
    assert any("BLOCK_M_FWD=3" in p for p in space.violations(dataclasses.replace(good, BLOCK_M_FWD=3)))
    small = KLDivSpace(100, torch.float32)
    assert any("mostly masked" in p for p in small.violations(dataclasses.replace(small.heuristic(),
                                                                                   BLOCK_V_FWD=256)))
    with pytest.raises(ValueError, match="unknown fields"):
        DivergenceConfig.from_dict({**good.to_dict(), "BLOCK_K": 2})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction,log_target,target_grad", [
    ("batchmean", False, False), ("none", True, True), ("sum", True, False), ("mean", False, True),
])
@pytest.mark.parametrize("changes", [
    {},
    {"BLOCK_V_FWD": 64, "BLOCK_M_FWD": 4, "num_warps_fwd": 2, "num_stages_fwd": 2,
     "BLOCK_V_BWD": 128, "BLOCK_M_BWD": 2, "num_warps_bwd": 1, "num_stages_bwd": 3},
])
def test_every_template_branch_passes_the_tuners_gate(changes, reduction, log_target, target_grad, dtype, device):
    """The tuner's float64 gate (NaN-poisoned outputs, per-dtype tolerance) on each kernel branch."""
    problem = KLDivProblem(dtype, 333, 13, device, reduction=reduction, log_target=log_target,
                           target_grad=target_grad, seed=5)
    assert_passes_the_gate(problem, changes)


def test_float64_reference_is_the_same_in_row_chunks(monkeypatch, device):
    """Tuning problems build their float64 truth chunk by chunk (memory); chunks must not change it."""
    import liger_gen.ops.divergence.kl_div as kl_module

    whole = KLDivProblem(torch.float32, 50, 11, device, reduction="none", target_grad=True, seed=3)
    monkeypatch.setattr(kl_module, "chunk_rows", lambda vocab: 4)
    for reduction in ("none", "batchmean"):
        chunked = KLDivProblem(torch.float32, 50, 11, device, reduction=reduction, target_grad=True, seed=3)
        assert torch.equal(chunked.buffers["x"], whole.buffers["x"])
        if reduction == "none":
            for name in ("out", "dx", "dt"):
                torch.testing.assert_close(chunked.ref[name], whole.ref[name])
        else:
            torch.testing.assert_close(chunked.ref["out"], kl_div_float64(chunked.buffers["x"], chunked.buffers["t"], "batchmean"))
            torch.testing.assert_close(chunked.ref["dx"], -chunked.buffers["t"].double() * chunked.buffers["g"] / 11)


def test_gate_rejects_a_wrong_kernel(device):
    problem = KLDivProblem(torch.float32, 200, 6, device, seed=2)
    module = load_variant("kl_div", problem.template_params(problem.space.heuristic()))

    class Wrong:
        def forward(self, x, t, out, log_target, reduce, divisor):
            module.forward(x, t, out, log_target, reduce, divisor * 1.01)

    assert "relative L2 error" in problem.check(Wrong(), "fwd")


def test_tuner_writes_an_entry_the_runtime_finds(device, tmp_path, monkeypatch):
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def cost(launch, params):  # deterministic 'time': favours 512-wide chunks and 2 warps
        return (1.0 + abs(params["BLOCK_V_FWD"].bit_length() - 10) + abs(params["BLOCK_V_BWD"].bit_length() - 10)
                + 0.1 * params["num_warps_fwd"] + 0.1 * params["num_warps_bwd"])

    problem = KLDivProblem(torch.float32, 600, 8, device, seed=1)
    tuner = Tuner(n_trials=4, timer=cost, seed=0, retime_rounds=1)
    path, (entry,) = tune_to_table(KLDivSpace, [problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                                   compute_capability="9.0", tuner=tuner)
    config = DivergenceConfig.from_dict(entry["config"])
    assert not problem.space.violations(config)
    assert entry["dims"] == {"vocab": 600} and entry["rows"] == 8
    for phase in ("fwd", "bwd"):
        assert entry["timing_ms"][phase]["tuned"] <= entry["timing_ms"][phase]["heuristic"]
        assert entry["trials"][phase][0]["params"] == problem.space.phase_params(problem.space.heuristic(), phase)
        assert entry["bytes"][phase] > 0
    # the runtime finds the written entry for the nearest row count
    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    tables.clear_caches()
    found = tables.lookup(KLDivSpace, torch.float32, {"vocab": 600}, 11, "h200")
    assert found["source"] == "user" and found["config"] == config
    tables.clear_caches()


def test_tuning_rows_are_capped():
    assert tuning_rows(128256, [4096, 16384, 65536]) == [4096, 8192]
    assert tuning_rows(32000, [1, 4096]) == [1, 4096]
    assert tuning_rows(2**20, [4096, 65536]) == [2048]
    assert all(r * v <= 2**31 for v in (128256, 152064, 256000, 2**22) for r in tuning_rows(v, [65536]))
    model = ModelShape("tiny", 64, 128, 4, 2, 16, 250, 1e-6)
    problems = tuning_problems(model, [3, 17], torch.float32, "cpu")
    assert [(p.rows, p.dims["vocab"]) for p in problems] == [(3, 250), (17, 250)]


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("log_target", [False, True])
def test_llama3_vocab_bf16_against_chunked_float64(log_target):
    """8192 tokens x 128256 vocab in bf16 (2^30 elements): loss and both gradients vs float64, chunk by chunk."""
    rows, vocab, dtype = 8192, 128256, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, vocab, device="cuda", generator=gen).mul_(2).log_softmax(-1).to(dtype).requires_grad_()
    t_log = torch.randn(rows, vocab, device="cuda", generator=gen).mul_(2).log_softmax(-1)
    t = (t_log if log_target else t_log.exp_()).to(dtype).requires_grad_()
    del t_log
    loss = kl_div(x, t, "batchmean", log_target)
    g = torch.tensor(0.75, device="cuda", dtype=dtype)
    loss.backward(g)
    ref = torch.zeros((), dtype=torch.float64, device="cuda")
    err2 = {"dx": 0.0, "dt": 0.0}
    norm2 = {"dx": 0.0, "dt": 0.0}
    for lo in range(0, rows, 512):
        x64 = x[lo:lo + 512].detach().double().requires_grad_()
        t64 = t[lo:lo + 512].detach().double().requires_grad_()
        part = kl_div_torch(x64, t64, "sum", log_target)
        ref += part.detach()
        (part * (g.double() / rows)).backward()
        for name, ours, truth in (("dx", x.grad[lo:lo + 512], x64.grad), ("dt", t.grad[lo:lo + 512], t64.grad)):
            err2[name] += (ours.double() - truth).square().sum().item()
            norm2[name] += truth.square().sum().item()
    tol = REL_TOL[dtype]
    assert rel_l2(loss, ref / rows) < tol
    for name in ("dx", "dt"):
        assert (err2[name] / norm2[name]) ** 0.5 < tol, name
