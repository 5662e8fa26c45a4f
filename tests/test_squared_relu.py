"""Squared ReLU (Nemotron's MLP activation): kernels (Triton interpreter on the CPU) against float64 and PyTorch
eager bit for bit, odd and empty shapes, non-contiguous inputs, bad input, the custom ops, ``SquaredReLUMLP``
against transformers' ``NemotronMLP``, the space and the tuner's gate."""

import dataclasses

import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.ops.glu.glu import GLUSpace
from liger_gen.ops.glu.squared_relu import (SPEC, SquaredReLUMLP, SquaredReLUProblem, SquaredReLUSpace,
                                            squared_relu, squared_relu_float64, squared_relu_torch)
from liger_gen.runtime import tables

from conftest import CPU_PATHS, assert_compiles_like_eager, seeded
from helpers import (GLU_TEMPLATE_BRANCH_IDS, GLU_TEMPLATE_BRANCHES, HEURISTIC_LIMITS, assert_error_names,
                     assert_passes_the_gate, graph_leaves, saved_for_backward, valid_heuristics)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _leaf(t):
    return t.detach().requires_grad_()


def _randn(shape, dtype, device, gen, scale=2.0):
    return (scale * torch.randn(shape, generator=gen)).to(device, dtype)


def _assert_matches_float64(x, tol=None):
    """y and dx of the op on the leaf or view ``x`` against float64 autograd of relu(x)²."""
    y = squared_relu(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    dy = torch.randn(y.shape, generator=seeded("dy", tuple(y.shape))).to(y.device, y.dtype)
    leaf = next(t for t in graph_leaves(y) if t.requires_grad)
    (dx,) = torch.autograd.grad(y, leaf, dy)
    x64 = _leaf(leaf.detach().double())
    ref = squared_relu_float64(_same_view(x, leaf, x64))
    (ref_dx,) = torch.autograd.grad(ref, x64, dy.double())
    tol = tol or REL_TOL[x.dtype]
    assert rel_l2(y, ref) < tol, "y"
    assert rel_l2(dx, ref_dx) < tol, "dx"


def _same_view(x, leaf, other):
    """``other`` (a tensor of ``leaf``'s shape) viewed as ``x`` views ``leaf``."""
    if x is leaf:
        return other
    return other.as_strided(x.shape, x.stride(), x.storage_offset() - leaf.storage_offset())


# ------------------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 123), (7, 64), (2, 3, 96), (33, 3), (4, 1100), (1, 1), (5, 2049)])
def test_kernel_matches_float64(shape, dtype, device):
    """Non-power-of-two widths (3, 123, 1100, 2049 past one column block), one row, one element, a leading dim."""
    gen = seeded(shape, str(dtype))
    _assert_matches_float64(_leaf(_randn(shape, dtype, device, gen)))


def _eager(x, dy):
    """PyTorch eager ``torch.relu(x) ** 2`` and its autograd gradient for ``dy``."""
    leaf = _leaf(x)
    y = torch.relu(leaf) ** 2
    (dx,) = torch.autograd.grad(y, leaf, dy)
    return y.detach(), dx


def _same_bits(a, b) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# the interpreter converts fp32 to bf16 by truncation (fp16 and the GPU round to nearest), so bf16 is compared
# bit for bit on the GPU and on the plain CPU path only
BITWISE = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # the interpreter's numpy on inf and NaN
@pytest.mark.parametrize("dtype", BITWISE)
def test_kernel_rounds_where_pytorch_rounds(dtype, device):
    """y = round(relu(x)²) in fp32 and dx = round(dy · round(2·relu(x))), 0 where x <= 0: every element of the
    output and of the gradient is eager's, bit for bit, with ±0, ±inf, NaN and (fp16) values whose square or
    whose 2·x overflow the dtype."""
    gen = seeded("bits", str(dtype))
    x = _randn((64, 515), dtype, device, gen)
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-3, -1e-3, 300.0, 40000.0, 60000.0]
    x[0, :len(special)] = torch.tensor(special, dtype=torch.float32).to(dtype)
    dy = _randn((64, 515), dtype, device, gen, 1.0)
    dy[0, :3] = 0.0  # 0 · inf (x = inf below): NaN in both
    x[1, :3] = float("inf")
    xl = _leaf(x)
    y = squared_relu(xl)
    (dx,) = torch.autograd.grad(y, xl, dy)
    want_y, want_dx = _eager(x, dy)
    assert _same_bits(y, want_y) and _same_bits(dx, want_dx)
    assert torch.isnan(y[0, 4]) and torch.isnan(dx[0, 4])  # relu(NaN) = NaN, and so is its gradient


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_both_cpu_paths_give_transformers_relu2(interpret, monkeypatch):
    """The plain CPU path is transformers' ACT2FN["relu2"], bit for bit, in every dtype (bfloat16 too) and in
    float64; the interpreter's is within one bf16 rounding (it truncates) and exact in fp32 and fp16."""
    from transformers.activations import ACT2FN

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    relu2 = ACT2FN["relu2"]
    for dtype in DTYPES + ([torch.float64] if interpret == "0" else []):
        gen = seeded("relu2", str(dtype), interpret)
        x = _randn((3, 5, 48), dtype, "cpu", gen)
        dy = _randn((3, 5, 48), dtype, "cpu", gen, 1.0)
        a, b = _leaf(x), _leaf(x)
        y, ref = squared_relu(a), relu2(b)
        (dx,), (ref_dx,) = torch.autograd.grad(y, a, dy), torch.autograd.grad(ref, b, dy)
        if interpret == "0" or dtype != torch.bfloat16:
            assert torch.equal(y, ref) and torch.equal(dx, ref_dx), dtype
        else:
            eps = torch.finfo(dtype).eps
            assert ((y.float() - ref.float()).abs() <= eps * ref.float().abs()).all()
            assert ((dx.float() - ref_dx.float()).abs() <= eps * ref_dx.float().abs()).all()


def test_custom_ops_fall_back_to_pytorch_on_plain_cpu(monkeypatch):
    """Called directly on CPU tensors without the interpreter, the custom ops compute autograd's values, bit for
    bit (their backward writes autograd's formulas out: the op runs below autograd), NaN, ±inf and ±0 included."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for dtype in DTYPES:
        gen = seeded("plain ops", str(dtype))
        x, dy = (_randn((5, 24), dtype, "cpu", gen) for _ in range(2))
        x[0, :5] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0])
        want_y, want_dx = _eager(x, dy)
        assert _same_bits(torch.ops.liger_gen.squared_relu_fwd(x), want_y)
        assert _same_bits(torch.ops.liger_gen.squared_relu_bwd(dy, x), want_dx)


@pytest.mark.parametrize("make_view", [
    lambda base, n: base[:, 3:3 + n],                                      # a column slice: row stride n + 7
    lambda base, n: base[:, :n].t(),                                       # transposed: copied to rows
    lambda base, n: base[::2, :n],                                         # every other row
    lambda base, n: base[:, :n].reshape(5, 4, n).transpose(0, 1),          # (batch, seq, n) of (seq, batch, n)
    lambda base, n: base[0, :n].expand(20, n),                             # broadcast over rows (row stride 0)
], ids=["column-slice", "transposed", "strided-rows", "permuted-3d", "broadcast-rows"])
def test_non_contiguous_inputs(make_view, device):
    gen = seeded("views")
    n = 37
    base = _leaf(_randn((20, n + 7), torch.float32, device, gen))
    x = make_view(base, n)
    assert not x.is_contiguous()
    _assert_matches_float64(x)


def test_column_slices_are_read_in_place_and_only_x_is_saved(device):
    """A column slice of a wider tensor is read where it is (no copy), and the backward keeps x alone."""
    base = torch.randn(6, 40, device=device, requires_grad=True)
    y, saved = saved_for_backward(lambda: squared_relu(base[:, 8:32]))
    assert len(saved) == 1 and saved[0].data_ptr() == base[:, 8:32].data_ptr()
    y.sum().backward()
    assert (base.grad[:, :8] == 0).all() and (base.grad[:, 32:] == 0).all()


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16), (4, 0), (0,)])
def test_empty_inputs_match_pytorch(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    y = squared_relu(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_a_1d_input_and_a_leading_dim(device):
    gen = seeded("1d")
    _assert_matches_float64(_leaf(_randn((77,), torch.float32, device, gen)))
    _assert_matches_float64(_leaf(_randn((2, 3, 4, 21), torch.bfloat16, device, gen)))


T = torch.ones


@pytest.mark.parametrize("args,exc,words", [
    ((T(4, 8, dtype=torch.int64),), TypeError, ["x", "(4, 8)", "torch.int64", "float32, bfloat16 or float16"]),
    ((T(4, 8, dtype=torch.bool),), TypeError, ["x", "(4, 8)", "torch.bool"]),
    ((T(()),), ValueError, ["x", "shape ()", "torch.float32", "at least one dim"]),
    (([1.0, 2.0],), TypeError, ["x", "tensor", "list"]),
])
def test_bad_input_names_the_tensor_shape_and_dtype(args, exc, words, device):
    assert_error_names(squared_relu, args, exc, words, device)


def test_float64_runs_on_the_plain_path_only(device, monkeypatch):
    """float64 on the kernel path (CUDA, or the CPU under the interpreter) is refused by name; the plain CPU path
    takes it."""
    x = torch.randn(4, 8, dtype=torch.float64)
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(TypeError) as info:
            squared_relu(x.to(device))
        for word in ("x of shape (4, 8)", "torch.float64", "plain-PyTorch CPU path"):
            assert word in str(info.value), str(info.value)
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        torch.testing.assert_close(squared_relu(x), squared_relu_float64(x), rtol=0, atol=0)


def test_double_backward_raises_instead_of_dropping_a_term(device):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(squared_relu(x).square().sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad(squared_relu(x).square().sum(), x)  # first order still works
    assert gx.shape == x.shape


def test_inference_mode_input(device):
    """x made under inference_mode (a frozen projection's output) with a trained layer after it: no error."""
    with torch.inference_mode():
        x = torch.randn(4, 16, device=device)
    w = torch.randn(16, device=device, requires_grad=True)
    (squared_relu(x) * w).sum().backward()
    torch.testing.assert_close(w.grad, squared_relu_torch(x.clone()).sum(0))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_torch_compile_has_no_graph_break(interpret, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    x = _randn((8, 72), torch.float32, "cpu", seeded("compile", interpret))
    assert_compiles_like_eager(lambda t: squared_relu(t[:, 4:68]).square().sum(), x)


def test_opcheck_custom_ops(device):
    gen = seeded("opcheck")
    x, dy = _randn((5, 40), torch.float32, device, gen), _randn((5, 40), torch.float32, device, gen)
    ops = torch.ops.liger_gen
    assert SPEC.custom_ops == ("liger_gen::squared_relu_fwd", "liger_gen::squared_relu_bwd")
    for op, args in ((ops.squared_relu_fwd.default, (x,)), (ops.squared_relu_bwd.default, (dy, x)),
                     (ops.squared_relu_fwd.default, (x[:, 3:30],)), (ops.squared_relu_bwd.default, (dy[:0], x[:0]))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------------------------------ the MLP module


def _nemotron_config(**changes):
    from transformers import NemotronConfig

    return NemotronConfig(hidden_size=32, intermediate_size=72, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=64, **changes)


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_squared_relu_mlp_matches_nemotron_mlp(mlp_bias, device):
    from transformers.models.nemotron.modeling_nemotron import NemotronMLP

    from liger_gen.integrations.transformers.modules import replace_mlp

    torch.manual_seed(0)
    hf = NemotronMLP(_nemotron_config(mlp_bias=mlp_bias)).to(device)
    ours, why = replace_mlp(hf)
    assert isinstance(ours, SquaredReLUMLP) and why == ""
    assert ours.up_proj is hf.up_proj and ours.down_proj is hf.down_proj  # the same Parameters
    assert ours.state_dict().keys() == hf.state_dict().keys()
    x = torch.randn(2, 5, 32, device=device)
    y_hf, y_ours = hf(x), ours(x)
    torch.testing.assert_close(y_ours, y_hf, rtol=1e-5, atol=1e-5)
    grads = [torch.autograd.grad(y.square().sum(), list(hf.parameters())) for y in (y_hf, y_ours)]
    for (name, _), g_hf, g_ours in zip(hf.named_parameters(), *grads):
        torch.testing.assert_close(g_ours, g_hf, rtol=1e-4, atol=1e-5, msg=name)


def test_squared_relu_mlp_bit_identical_on_plain_cpu_path(monkeypatch):
    from transformers.models.nemotron.modeling_nemotron import NemotronMLP

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hf = NemotronMLP(_nemotron_config()).to(torch.bfloat16)
    ours = SquaredReLUMLP(hf.up_proj, hf.down_proj)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(ours(x), hf(x))


def test_other_mlps_are_not_taken_for_squared_relu():
    """A gated MLP with relu² (no kernel computes act(gate) · up for it) and a squared-ReLU MLP without an
    up_proj stay, saying why; the module refuses projections that are not modules."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from liger_gen.integrations.transformers.modules import replace_mlp

    gated = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act="relu2"))
    assert replace_mlp(gated) == (None, "activation ReLUSquaredActivation")
    fc = torch.nn.Module()
    fc.fc1, fc.down_proj, fc.act_fn = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), gated.act_fn
    assert replace_mlp(fc) == (None, "activation ReLUSquaredActivation")
    with pytest.raises(TypeError, match="up_proj must be an nn.Module, got Tensor"):
        SquaredReLUMLP(torch.ones(2), torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------ space and tuning


WIDTHS = (list(range(1, 200)) + [2 ** k + d for k in range(8, 18) for d in (-1, 0, 1)]
          + [4096, 12288, 16384, 24576, 73728])  # Nemotron-4's and Minitron's intermediate sizes among them


@pytest.mark.parametrize("dtype", DTYPES)
def test_heuristic_valid_for_every_width(dtype):
    for n, config in valid_heuristics(SquaredReLUSpace, WIDTHS, dtype,
                                      HEURISTIC_LIMITS + (DeviceLimits(max_shared_memory_per_block=49152),)):
        assert config.BLOCK_N_FWD <= max(16, 2 * n) and config.BLOCK_N_BWD <= max(16, 2 * n)


def test_constraints_reject_bad_configs_and_count_one_stream_less():
    limits = DeviceLimits(max_threads_per_block=256, max_shared_memory_per_block=40960)
    space = SquaredReLUSpace(24576, torch.float32, limits)
    good = space.heuristic()
    assert any("threads" in p for p in space.violations(dataclasses.replace(good, num_warps_fwd=16)))
    assert any("per thread" in p for p in space.violations(
        dataclasses.replace(good, BLOCK_N_BWD=8192, BLOCK_M_BWD=16, num_warps_bwd=8)))
    assert any("not one of" in p for p in space.violations(dataclasses.replace(good, TILES_FWD=3)))
    narrow = SquaredReLUSpace(100, torch.bfloat16)
    assert any("BLOCK_N=256" in p for p in narrow.violations(dataclasses.replace(narrow.heuristic(), BLOCK_N_FWD=256)))
    # 2 stages of a 4096-element fp32 tile: x and dy (32 KiB) fit 40 KiB of shared memory; the GLU's gate, up
    # and dy (48 KiB) do not, and with 3 stages neither fits
    wide = dataclasses.replace(good, BLOCK_N_BWD=4096, BLOCK_M_BWD=1, num_warps_bwd=8, num_stages_bwd=2)
    assert not space.violations(wide)
    assert any("shared memory" in p for p in GLUSpace(24576, torch.float32, limits).violations(wide))
    assert any("shared memory" in p for p in space.violations(dataclasses.replace(wide, num_stages_bwd=3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("changes", GLU_TEMPLATE_BRANCHES, ids=GLU_TEMPLATE_BRANCH_IDS)
def test_every_template_branch_passes_the_tuners_gate(changes, dtype, device):
    """The tuner's float64 gate (NaN-poisoned outputs, per-dtype tolerance) on each structural variant."""
    assert_passes_the_gate(SquaredReLUProblem(dtype, 100, 19, device, seed=5), changes)


def test_gate_catches_a_wrong_kernel(device):
    """The gate can fail: outputs for other inputs than the truth's (a sign flipped in one row) are rejected."""
    problem = SquaredReLUProblem(torch.float32, 64, 9, device, seed=1)
    module = load_variant("squared_relu", problem.template_params(problem.space.heuristic()))
    assert problem.check(module, "fwd") is None and problem.check(module, "bwd") is None
    problem.buffers["x"][0, :8] = -problem.buffers["x"][0, :8]  # inputs the truth was not computed for
    assert "relative L2 error" in problem.check(module, "fwd")
    assert "relative L2 error" in problem.check(module, "bwd")


def test_problem_reference_in_chunks_bytes_and_spec(monkeypatch):
    monkeypatch.setattr(SquaredReLUProblem, "REF_CHUNK_ELEMENTS", 100)  # 3 rows per chunk of 33 columns
    problem = SquaredReLUProblem(torch.bfloat16, 33, 10, "cpu", seed=2)
    b = problem.buffers
    x64 = _leaf(b["x"].double())
    ref = squared_relu_float64(x64)
    (dx,) = torch.autograd.grad(ref, x64, b["dy"].double())
    torch.testing.assert_close(problem.ref["y"].double(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(problem.ref["dx"].double(), dx, rtol=1e-6, atol=1e-7)
    assert (b["x"] < 0).any() and (b["x"] > 0).any()  # both branches of the backward
    assert problem.bytes_moved("fwd") == 2 * 10 * 33 * 2 and problem.bytes_moved("bwd") == 3 * 10 * 33 * 2
    assert problem.variant == {} and problem.op == "squared_relu" and problem.template == "squared_relu"
    assert SPEC.name == "squared_relu" and SPEC.space is SquaredReLUSpace and SPEC.problem is SquaredReLUProblem


def test_tuning_problems_use_intermediate_size():
    from liger_gen.models import PRESETS
    from liger_gen.ops import get_spec

    model = dataclasses.replace(PRESETS["llama3-8b"], intermediate_size=48)
    spec = get_spec("squared_relu")
    problems = spec.tuning_problems(model, [3, 5], torch.float32, "cpu")
    assert [(p.op, p.rows, p.dims) for p in problems] == [("squared_relu", r, {"n_cols": 48}) for r in (3, 5)]


def _cost_model(launch, params):
    """Deterministic 'time' favouring 2-row tiles, 64 columns and 2 warps in both phases."""
    return sum(1.0 + abs(params[f"BLOCK_M_{p}"] - 2) + abs(params[f"BLOCK_N_{p}"] - 64) / 64
               + 0.3 * abs(params[f"num_warps_{p.lower()}"] - 2) + 0.1 * params[f"TILES_{p}"] for p in ("FWD", "BWD"))


def test_small_tuner_run_writes_a_usable_table(tmp_path, monkeypatch):
    """The op has no packaged H200 table yet: a tuner run writes one, and the runtime then uses it."""
    import optuna

    from liger_gen.runtime.ops import clear_caches
    from liger_gen.tuning.search import Tuner
    from liger_gen.tuning.tables import tune_to_table

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    problem = SquaredReLUProblem(torch.float32, 96, 12, "cpu", seed=1)
    tuner = Tuner(n_trials=4, timer=_cost_model, seed=0, retime_rounds=1)
    path, (entry,) = tune_to_table(SquaredReLUSpace, [problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                                   compute_capability="9.0", tuner=tuner)
    assert path == tmp_path / "h200" / "squared_relu.json"
    config = SquaredReLUSpace.config_cls.from_dict(entry["config"])
    assert not problem.space.violations(config)
    assert entry["dims"] == {"n_cols": 96} and entry["bytes"] == {"fwd": 2 * 12 * 96 * 4, "bwd": 3 * 12 * 96 * 4}
    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    tables.clear_caches()
    try:
        found = tables.lookup(SquaredReLUSpace, torch.float32, 96, 12, "h200", DeviceLimits.interpreter())
        assert found["source"] == "user" and found["config"] == config
    finally:
        monkeypatch.delenv(tables.ENV_TUNED_DIR)
        clear_caches()


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nemotron_4_15b_shape_on_gpu(dtype):
    """Nemotron-4-15B's MLP activation at 8192 tokens x 24576 against float64 (row chunks) and eager's bits."""
    rows, n = 8192, 24576
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _leaf((2 * torch.randn(rows, n, device="cuda", generator=gen)).to(dtype))
    dy = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
    y = squared_relu(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    want_y, want_dx = _eager(x.detach(), dy)
    assert torch.equal(y, want_y) and torch.equal(dx, want_dx)
    for lo in range(0, rows, 1024):
        x64 = _leaf(x.detach()[lo:lo + 1024].double())
        ref = squared_relu_float64(x64)
        (ref_dx,) = torch.autograd.grad(ref, x64, dy[lo:lo + 1024].double())
        assert rel_l2(y[lo:lo + 1024], ref) < REL_TOL[dtype] and rel_l2(dx[lo:lo + 1024], ref_dx) < REL_TOL[dtype]
