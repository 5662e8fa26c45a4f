"""``glu_fp8``: the gated linear unit that writes the e4m3 operands of its output (forward) and of its gradients
(backward), and ``GLUMLP``'s FP8 path that hands them to the projections.

What must hold, bit for bit: y and the gradients are ``swiglu`` / ``geglu``'s (the same arithmetic), and every
operand is the recipe's quantization of the tensor the kernel wrote (``fp8_cast_transpose``'s), for both fusion
choices in each direction, the packed gate_up layout, special values (zeros, NaN, inf) and ragged tiles. Plus:
the space and heuristic, the tuner's gate, the errors, the hand-over of gradient operands (a view of the same
memory matches, a write between offer and take does not), and patched Llama and Phi-3 models whose MLPs hand
their operands to the FP8 projections: the projections quantize none of them, and the loss and every gradient
are unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import liger_gen
from liger_gen.codegen.build import load_variant
from liger_gen.functional import fp8_cast_transpose, geglu, glu_fp8, swiglu
from liger_gen.integrations import transformers as integration
from liger_gen.nn import Float8Linear, GLUMLP
from liger_gen.ops.fp8 import linear as fp8_linear_module
from liger_gen.ops.glu.glu_fp8 import GLUFp8Problem, GLUFp8Space
from liger_gen.runtime.fp8 import operand_mismatch
from liger_gen.runtime import fp8_operands
from liger_gen.runtime.fp8_operands import GradOperands
from liger_gen.training import byte_tokens, make_batches

from conftest import seeded
from helpers import lm_loss_and_grads, valid_heuristics
from mini_models import mini_model
from test_fp8 import _assert_same_fp8, _assert_same_scales, needs_cpu_fp8_gemm

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@pytest.fixture(autouse=True)
def _restore_patches():
    yield
    integration.restore_rope()
    integration.restore_layers()
    fp8_operands.GRADS.clear()


def _plain(gate, up, activation):
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none")


def _special(t: torch.Tensor) -> torch.Tensor:
    """Rows of zeros, a NaN and an inf, in place of random values."""
    flat = t.view(-1, t.shape[-1])
    flat[0] = 0.0
    flat[1, 3] = float("nan")
    flat[2, 5] = float("inf")
    return t


def _assert_operands_of(y: torch.Tensor, q, d_rows, qt, d_cols) -> None:
    want = fp8_cast_transpose(y.reshape(-1, y.shape[-1]))
    _assert_same_fp8(q, want[0])
    _assert_same_scales(d_rows.view(-1), want[1].view(-1))
    if qt is not None:
        _assert_same_fp8(qt, want[2])
        _assert_same_scales(d_cols.view(-1), want[3].view(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_output_and_gradients_are_the_glus_and_the_operands_the_recipes(activation, dtype, cpu_path):
    gen = seeded("glu_fp8", activation, dtype, cpu_path)
    gate = (2 * torch.randn(3, 13, 80, generator=gen)).to(dtype).requires_grad_()
    up = torch.randn(3, 13, 80, generator=gen).to(dtype).requires_grad_()
    out = glu_fp8(gate, up, activation)
    y0 = _plain(gate, up, activation)
    assert out.y.shape == gate.shape and out.y.dtype == dtype and torch.equal(out.y, y0)
    assert out.q.shape == (39, 80) and out.qt.shape == (80, 48) and out.dequant_cols.shape == (80, 1)
    assert not (out.q.requires_grad or out.dequant_rows.requires_grad or out.qt.requires_grad)
    _assert_operands_of(out.y.detach(), *out[1:])
    dy = torch.randn(gate.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out.y, (gate, up), dy)
    for g, g0 in zip(grads, torch.autograd.grad(y0, (gate, up), dy)):
        assert torch.equal(g, g0)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _module(problem: GLUFp8Problem, **changes):
    config = dataclasses.replace(problem.space.heuristic(), **changes)
    assert not problem.space.violations(config), problem.space.violations(config)
    return load_variant("glu_fp8", problem.template_params(config))


def _operand_buffers(m, n, device, cols=True):
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=device)
    qt = torch.empty(n, -(-m // 16) * 16, dtype=torch.float8_e4m3fn, device=device) if cols else None
    return q, torch.empty(m, device=device), qt, torch.empty(n, device=device) if cols else None


@pytest.mark.parametrize("emit", ["amax", "none"])
@pytest.mark.parametrize("cols", [True, False], ids=["both", "rows-only"])
def test_the_forward_writes_the_same_bits_either_way(emit, cols, device):
    """Each fusion choice, at small tiles (several row tiles per program, several programs per row and column,
    ragged edges), special rows included: y is the GLU kernel's, the operands the recipe's of that y; a NaN row
    gets a NaN scale (no silent zeros)."""
    problem = GLUFp8Problem(torch.bfloat16, {"n_cols": 100}, 37, device)
    module = _module(problem, EMIT_FWD=emit, BLOCK_N_FWD=32, BLOCK_M_FWD=4, TILES_FWD=2, BLOCK_M_CAST_FWD=16,
                     BLOCK_K_CAST_FWD=32, num_warps_cast_fwd=1)
    gen = seeded("glu_fp8 forward", emit, cols)
    gate = _special(2 * torch.randn(37, 100, generator=gen)).to(torch.bfloat16).to(device)
    up = torch.randn(37, 100, generator=gen).to(torch.bfloat16).to(device)
    y = torch.empty_like(gate)
    operands = _operand_buffers(37, 100, device, cols)
    module.forward_fp8(gate, up, y, *operands, device.type == "cpu")
    _assert_same(y, swiglu(gate, up))
    _assert_operands_of(y.cpu(), *(None if t is None else t.cpu() for t in operands))
    assert operands[1][1].isnan() and operands[0][1].float().isnan().all()


@pytest.mark.parametrize("emit", ["amax", "none"])
@pytest.mark.parametrize("packed", [False, True], ids=["gate-up", "packed"])
def test_the_backward_writes_the_same_bits_either_way(emit, packed, device):
    """dgate and dup are the GLU backward's, written over gate and up as ``GLUMLP`` does; their operands (one
    pair per gradient, or one over the packed gradient) are the recipe's of what was written."""
    problem = GLUFp8Problem(torch.bfloat16, {"n_cols": 72}, 29, device)
    module = _module(problem, EMIT_BWD=emit, BLOCK_N_BWD=16, BLOCK_M_BWD=2, TILES_BWD=4, num_warps_bwd=1, BLOCK_M_CAST_BWD=8,
                     BLOCK_K_CAST_BWD=16, num_warps_cast_bwd=1)
    gen = seeded("glu_fp8 backward", emit, packed)
    gate_up = torch.randn(29, 144, generator=gen).to(torch.bfloat16).to(device)
    _special(gate_up[:, :72])
    dy = torch.randn(29, 72, generator=gen).to(torch.bfloat16).to(device)
    gate, up = gate_up[:, :72], gate_up[:, 72:]
    want_dgate, want_dup = torch.autograd.grad(swiglu(gate.requires_grad_(), up.requires_grad_()), (gate, up), dy)
    gate, up = gate.detach(), up.detach()
    if packed:
        operands = [_operand_buffers(29, 144, device)]
        module.backward_fp8(dy, gate, up, gate, up, gate_up, operands, device.type == "cpu")
        targets = [gate_up]
    else:
        gate, up = gate.contiguous(), up.contiguous()
        operands = [_operand_buffers(29, 72, device), _operand_buffers(29, 72, device)]
        module.backward_fp8(dy, gate, up, gate, up, None, operands, device.type == "cpu")
        targets = [gate, up]
    _assert_same(gate, want_dgate)
    _assert_same(up, want_dup)
    for target, ops in zip(targets, operands):
        _assert_operands_of(target.cpu(), *(t.cpu() for t in ops))


@pytest.mark.parametrize("emit", ["amax", "none"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_both_choices_pass_the_tuners_gate(activation, emit, device):
    problem = GLUFp8Problem(torch.bfloat16, {"n_cols": 48}, 37, device, activation=activation,
                            seed=int(torch.randint(0, 1 << 30, ())))
    module = _module(problem, EMIT_FWD=emit, EMIT_BWD=emit)
    assert problem.check(module, "fwd") is None and problem.check(module, "bwd") is None


def test_the_gate_catches_operands_of_another_format(device):
    """The gate holds the operands to e4m3's recipe exactly: a module rendered for e5m2 fails both phases."""
    problem = GLUFp8Problem(torch.bfloat16, {"n_cols": 64}, 20, device)
    wrong = load_variant("glu_fp8", {**problem.template_params(problem.space.heuristic()), "fp8": "e5m2"})
    # e5m2 buffers: Triton compiles no e5m2-to-e4m3 store for the GPU
    for name, (q, d_rows, qt, d_cols) in problem.operand_buffers.items():
        problem.operand_buffers[name] = (q.to(torch.float8_e5m2), d_rows, qt.to(torch.float8_e5m2), d_cols)
    assert "differ" in problem.check(wrong, "fwd") and "differ" in problem.check(wrong, "bwd")


def test_operand_mismatch_names_the_axis():
    y = torch.randn(20, 32)
    q, d_rows, qt, d_cols = fp8_cast_transpose(y)
    assert operand_mismatch(y, q, d_rows, qt, d_cols) is None
    assert "rows operand" in operand_mismatch(y, q, 2 * d_rows, qt, d_cols)
    padded = qt.clone()
    padded[:, -1] = 1.0
    assert "padding" in operand_mismatch(y, q, d_rows, padded, d_cols)


def test_the_heuristic_is_valid_for_any_width():
    dims = [{"n_cols": n} for n in (1, 16, 100, 2048, 8192, 14336, 28672)]
    for d, config in valid_heuristics(GLUFp8Space, dims, torch.bfloat16):
        assert config.EMIT_FWD == config.EMIT_BWD == "amax"
        assert config.BLOCK_M_FWD * config.TILES_FWD >= min(32, 2048 // config.BLOCK_N_FWD), d


def test_the_space_refuses_what_cannot_run():
    space = GLUFp8Space({"n_cols": 4096}, torch.bfloat16)
    base = space.heuristic()
    assert any("cast" in p for p in space.violations(dataclasses.replace(base, BLOCK_M_CAST_BWD=128,
                                                                           BLOCK_K_CAST_BWD=256,
                                                                           num_warps_cast_bwd=1)))
    assert space.violations(dataclasses.replace(base, EMIT_FWD="rows"))  # not one of the choices
    narrow = GLUFp8Space({"n_cols": 20}, torch.bfloat16)
    assert any("BLOCK_K=64" in p for p in narrow.violations(dataclasses.replace(narrow.heuristic(),
                                                                                  BLOCK_K_CAST_FWD=64)))


@pytest.mark.parametrize("call, exc, words", [
    (lambda g, u: glu_fp8(g.int(), u), TypeError, ["gate of shape (4, 32)", "torch.int32"]),
    (lambda g, u: glu_fp8(g, u[:, :16]), ValueError, ["gate of shape (4, 32)", "up of shape (4, 16)"]),
    (lambda g, u: glu_fp8(g, u.half()), TypeError, ["same dtype", "torch.float16"]),
    (lambda g, u: glu_fp8(g, u, "relu"), ValueError, ["activation", "'relu'"]),
])
def test_errors_name_the_tensor(call, exc, words):
    gate, up = torch.randn(4, 32), torch.randn(4, 32)
    with pytest.raises(exc) as info:
        call(gate, up)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_zero_rows_zero_columns_and_rows_only(cpu_path):
    out = glu_fp8(torch.randn(0, 32, dtype=torch.bfloat16), torch.randn(0, 32, dtype=torch.bfloat16))
    assert out.y.shape == (0, 32) and out.q.shape == (0, 32) and out.qt.shape == (32, 0)
    out = glu_fp8(torch.randn(2, 3, 0, dtype=torch.bfloat16), torch.randn(2, 3, 0, dtype=torch.bfloat16))
    assert out.y.shape == (2, 3, 0) and out.q.shape == (6, 0) and out.qt.shape == (0, 16)
    out = glu_fp8(torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(5, 32, dtype=torch.bfloat16), cols=False)
    assert out.qt is None and out.dequant_cols is None and out.q.shape == (5, 32)


def test_plain_path_under_compile_and_vmap(monkeypatch):
    """Without the interpreter, a recorded graph and torch.func transforms take the custom op: torch.compile
    (fullgraph) gives the eager values, vmap gives each element's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = seeded("glu_fp8 plain compile")
    gate = torch.randn(2, 10, 32, generator=gen).to(torch.bfloat16)
    up = torch.randn(2, 10, 32, generator=gen).to(torch.bfloat16)
    eager = glu_fp8(gate, up)
    compiled = torch.compile(lambda a, b: tuple(glu_fp8(a, b)), fullgraph=True, backend="aot_eager")(gate, up)
    for got, want in zip(compiled, eager):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
    assert torch.equal(torch.vmap(lambda a, b: glu_fp8(a, b).y)(gate, up), eager.y)


# ------------------------------------------------------------------------------------------------ the hand-over


def test_gradient_operands_are_taken_once_by_a_view_of_the_same_memory():
    cache = GradOperands()
    g = torch.randn(6, 16)
    cache.offer(g, ("g",))
    assert cache.take(g.view(12, 8)) is None  # another width per row: not the operands' layout
    assert cache.take(g.view(3, 2, 16)) == ("g",)  # a view with the same rows: autograd hands these on
    assert cache.take(g) is None  # taken once
    cache.offer(g, ("g",))
    g.add_(1)  # a write between offer and take
    assert cache.take(g) is None
    a, b, c = torch.randn(4, 16), torch.randn(4, 16), torch.randn(4, 16)
    for t in (a, b, c):
        cache.offer(t, (id(t),))
    assert cache.take(a) is None and cache.take(c) == (id(c),) and cache.take(b) == (id(b),)  # the oldest went
    cache.offer(g.t(), ("t",))  # not contiguous: never kept
    assert cache.entries == []
    with torch.inference_mode():
        cache.offer(torch.randn(4, 16), ("inference",))
    assert cache.entries == []


@needs_cpu_fp8_gemm
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")
@pytest.mark.parametrize("family, handed", [("llama", 3), ("phi3", 2)])
def test_a_patched_models_mlps_hand_their_operands_to_the_projections(family, handed, monkeypatch):
    """``apply_to(fp8=True)``: each MLP's GLU writes h's operands for the down projection and its gradients'
    for the gate and up projections (one packed gradient for Phi-3's gate_up), so the projections quantize
    ``handed`` tensors fewer per layer; the loss and every gradient are bit for bit those of the plain GLU path
    (on the CPU), the backward writes over gate and up as the bf16 path does, and no operand is left over."""
    model = mini_model(family, dtype=torch.bfloat16, num_hidden_layers=2)
    liger_gen.apply_to(model, fp8=True)
    report = model.liger_gen_report
    assert report.fp8_mlps == 2 and "2 MLPs writing their FP8 operands" in report.summary()
    assert "glu_fp8" in integration.patched_ops(model)
    ids = make_batches(byte_tokens(), 1, 2, 24, seed=0)[0]
    quantized, overwrites = [], []
    both = fp8_linear_module.cast_transpose_2d
    monkeypatch.setattr(fp8_linear_module, "cast_transpose_2d", lambda x, f: quantized.append(x) or both(x, f))
    from liger_gen.ops.glu import mlp as mlp_module
    product = mlp_module.glu_fp8_product
    monkeypatch.setattr(mlp_module, "glu_fp8_product",
                        lambda *a, **k: overwrites.append(k["overwrite"]) or product(*a, **k))
    fused = lm_loss_and_grads(model, ids)
    n_fused = len(quantized)
    assert overwrites == [True, True] and fp8_operands.GRADS.entries == []
    monkeypatch.setattr(GLUMLP, "_fp8_plan", lambda self, *tensors: None)
    quantized.clear()
    plain = lm_loss_and_grads(model, ids)
    assert len(quantized) - n_fused == 2 * handed
    assert torch.equal(fused[0], plain[0])
    assert fused[1].keys() == plain[1].keys() and all(torch.equal(g, plain[1][n]) for n, g in fused[1].items())


@needs_cpu_fp8_gemm
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")
def test_a_hook_that_writes_a_gradient_through_data_is_not_bypassed(monkeypatch):
    """A forward hook on the gate projections registers a gradient hook that doubles the gradient through
    ``.data`` (no version bump, so a handed-over operand could not tell): with hooks around, the MLPs hand over
    no gradient operands, and every gradient is the plain GLU path's."""
    model = mini_model("llama", dtype=torch.bfloat16, num_hidden_layers=2)
    liger_gen.apply_to(model, fp8=True)
    for layer in model.model.layers:
        layer.mlp.gate_proj.register_forward_hook(
            lambda m, args, out: out.register_hook(lambda g: g.data.mul_(2)) and None)
    ids = make_batches(byte_tokens(), 1, 2, 24, seed=1)[0]
    offered = []
    offer = fp8_operands.GRADS.offer
    monkeypatch.setattr(fp8_operands.GRADS, "offer", lambda g, ops: offered.append(g) or offer(g, ops))
    fused = lm_loss_and_grads(model, ids)
    assert offered == []
    monkeypatch.setattr(GLUMLP, "_fp8_plan", lambda self, *tensors: None)
    plain = lm_loss_and_grads(model, ids)
    assert all(torch.equal(g, plain[1][n]) for n, g in fused[1].items())


@needs_cpu_fp8_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_model_under_a_bf16_autocast_trains_through_the_fused_operands(dtype, cpu_path, monkeypatch):
    """Under ``torch.autocast(bfloat16)`` (fp32 weights, as docs/fp8.md names beside bf16 models; or bf16 ones),
    on both CPU paths: the MLPs hand over their operands (the products are bf16 under autocast), the bf16
    model's norms too; loss and gradients are those of the same model with every fusion off."""
    model = mini_model("llama", dtype=dtype, num_hidden_layers=2)
    liger_gen.apply_to(model, fp8=True)
    assert model.liger_gen_report.fp8_mlps == 2
    assert model.liger_gen_report.fp8_norms == (4 if dtype == torch.bfloat16 else 0)
    ids = make_batches(byte_tokens(), 1, 2, 24, seed=2)[0]
    offered = []
    offer = fp8_operands.GRADS.offer
    monkeypatch.setattr(fp8_operands.GRADS, "offer", lambda g, ops: offered.append(g) or offer(g, ops))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = lm_loss_and_grads(model, ids)
        assert len(offered) == 4 and torch.isfinite(fused[0])
        monkeypatch.setattr(GLUMLP, "_fp8_plan", lambda self, *tensors: None)
        for module in model.modules():
            if module.__dict__.get("fp8_consumers"):
                module.fp8_consumers = ()
        plain = lm_loss_and_grads(model, ids)
    assert torch.equal(fused[0], plain[0])
    assert all(torch.equal(g, plain[1][n]) for n, g in fused[1].items())


def test_operands_nobody_took_are_dropped_when_the_backward_ends():
    """An offer inside a backward pass lives until that pass ends, taken or not; what a pass that raised (or an
    offer outside any pass) left is dropped by the next pass's first offer."""
    class Offers(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            fp8_operands.GRADS.offer(g.contiguous(), ("untaken",))
            seen.append(len(fp8_operands.GRADS.entries))
            return g

    seen = []
    x = torch.randn(4, 16, requires_grad=True)
    Offers.apply(x).sum().backward()
    assert seen == [1] and fp8_operands.GRADS.entries == []

    class Raises(torch.autograd.Function):  # a pass that offers, then fails before its end
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("out of memory")

    fp8_operands.GRADS.offer(torch.randn(2, 16), ("outside a backward",))
    with pytest.raises(RuntimeError, match="out of memory"):
        Offers.apply(Raises.apply(x)).sum().backward()  # Offers' backward runs first
    assert [e[-1] for e in fp8_operands.GRADS.entries] == [("untaken",)]
    Offers.apply(x).sum().backward()  # the next pass's first offer drops what the failed one left
    assert seen == [1, 1, 1] and fp8_operands.GRADS.entries == []


@needs_cpu_fp8_gemm
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter must be on before kernels are defined")
def test_a_second_backward_through_an_fp8_mlp_says_what_to_do():
    mlp = _fp8_mlp()
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    y = mlp(x).float().square().sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"GLUMLP: a second backward .* `in_place_backward = False`"):
        y.backward()
    mlp.in_place_backward = False
    y = mlp(x).float().square().sum()
    y.backward(retain_graph=True)
    y.backward()


def _fp8_mlp(recipe=None, **options):
    def linear(i, o):
        return Float8Linear.from_linear(torch.nn.Linear(i, o, bias=False, dtype=torch.bfloat16),
                                        recipe or liger_gen.Float8Recipe())
    return GLUMLP("silu", linear(32, 16), gate_proj=linear(16, 32), up_proj=linear(16, 32), **options)


@needs_cpu_fp8_gemm
def test_what_the_mlp_asks_of_the_glu():
    """(cols, grads) of ``GLUMLP._fp8_plan``: h's columns operand only for a down projection that keeps it for
    its weight gradient; the gradients' operands only for e4m3 gradients of FP8 gate and up projections whose
    weights train and whose output is the gate as is; nothing for a product that is not bf16 or without an FP8
    down projection."""
    gate = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    assert _fp8_mlp()._fp8_plan(gate) == (True, True)
    with torch.no_grad():
        assert _fp8_mlp()._fp8_plan(gate) == (False, False)
    frozen = _fp8_mlp()
    frozen.down_proj.weight.requires_grad_(False)
    frozen.gate_proj.weight.requires_grad_(False)
    assert frozen._fp8_plan(gate) == (False, False)
    assert _fp8_mlp(liger_gen.Float8Recipe(grad_dtype=torch.float8_e5m2))._fp8_plan(gate) == (True, False)
    assert _fp8_mlp(liger_gen.Float8Recipe(keep_fp8_for_backward=False))._fp8_plan(gate) == (False, True)
    assert _fp8_mlp(gate_multiplier=0.5)._fp8_plan(gate) == (True, False)
    assert _fp8_mlp()._fp8_plan(gate.float()) is None
    plain = GLUMLP("silu", torch.nn.Linear(32, 16), gate_proj=torch.nn.Linear(16, 32), up_proj=torch.nn.Linear(16, 32))
    assert plain._fp8_plan(gate) is None
