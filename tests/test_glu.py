"""SwiGLU / GeGLU kernels (Triton interpreter on the CPU) against float64 and PyTorch, and the API around them."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.codegen.spaces import DeviceLimits
from liger_gen.ops.glu.glu import (GeGLUProblem, GeGLUSpace, GLUConfig, GLUProblem, GLUSpace, SwiGLUMLP, as_rows, geglu,
                                   geglu_gate_up, glu_float64, glu_torch, swiglu, swiglu_gate_up)
from liger_gen.runtime import tables

from conftest import seeded
from helpers import (GLU_TEMPLATE_BRANCH_IDS, GLU_TEMPLATE_BRANCHES, HEURISTIC_LIMITS, assert_passes_the_gate,
                     saved_for_backward, valid_heuristics)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (template activation, approximate for geglu or None for swiglu)
ACTIVATIONS = [("silu", None), ("gelu", "none"), ("gelu_tanh", "tanh")]
ACT_IDS = ["swiglu", "geglu-none", "geglu-tanh"]


def _glu(activation, approximate, gate, up):
    return swiglu(gate, up) if approximate is None else geglu(gate, up, approximate)


def _glu_packed(activation, approximate, gate_up):
    return swiglu_gate_up(gate_up) if approximate is None else geglu_gate_up(gate_up, approximate)


def _leaf(t):
    return t.detach().requires_grad_()


def _randn(shape, dtype, device, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(device, dtype)


def _assert_nearly_eagers_bits(activation, approximate, gate, up, draw_dy):
    """Output and gradients (for ``dy = draw_dy(shape)``) equal eager ``glu_torch``'s in over 95% of the elements
    and within two units in the last place of the 16-bit dtype elsewhere (an absolute floor below 1/64)."""
    y = _glu(activation, approximate, gate, up)
    dy = draw_dy(y.shape)
    grads = torch.autograd.grad(y, (gate, up), dy)
    gate2, up2 = _leaf(gate.detach()), _leaf(up.detach())
    ref = glu_torch(gate2, up2, activation)
    ref_grads = torch.autograd.grad(ref, (gate2, up2), dy)
    eps = torch.finfo(gate.dtype).eps
    for name, got, want in (("y", y, ref), ("dgate", grads[0], ref_grads[0]), ("dup", grads[1], ref_grads[1])):
        got, want = got.float(), want.float()
        assert (got == want).float().mean() > 0.95, name
        assert ((got - want).abs() <= 2 * eps * want.abs().clamp_min(2 ** -6)).all(), name


def _assert_matches_float64(activation, approximate, gate, up, tol=None):
    """Forward and both gradients of the op on (gate, up) leaves/views against float64 autograd."""
    y = _glu(activation, approximate, gate, up)
    assert y.shape == gate.shape and y.dtype == gate.dtype
    dy = torch.randn(y.shape).to(y.device, y.dtype)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    g64, u64 = _leaf(gate.detach().double()), _leaf(up.detach().double())
    ref = glu_float64(g64, u64, activation)
    rg, ru = torch.autograd.grad(ref, (g64, u64), dy.double())
    tol = tol or REL_TOL[gate.dtype]
    assert rel_l2(y, ref) < tol, "y"
    assert rel_l2(dgate, rg) < tol, "dgate"
    assert rel_l2(dup, ru) < tol, "dup"


# ------------------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 123), (7, 64), (2, 3, 96), (33, 3), (4, 1100)])
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_kernel_matches_float64(activation, approximate, shape, dtype, device):
    gen = seeded(shape, str(dtype), activation)
    gate = _leaf(_randn(shape, dtype, device, gen, scale=2.0))
    up = _leaf(_randn(shape, dtype, device, gen))
    _assert_matches_float64(activation, approximate, gate, up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 246), (3, 5, 80), (9, 2)])
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_gate_up_matches_float64(activation, approximate, shape, dtype, device):
    gen = seeded(shape, str(dtype), activation, "packed")
    gate_up = _leaf(_randn(shape, dtype, device, gen, scale=2.0))
    y = _glu_packed(activation, approximate, gate_up)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    dy = torch.randn(y.shape).to(device, dtype)
    (d_gate_up,) = torch.autograd.grad(y, gate_up, dy)
    assert d_gate_up.shape == gate_up.shape
    ref_in = _leaf(gate_up.detach().double())
    g64, u64 = ref_in.chunk(2, dim=-1)
    ref = glu_float64(g64, u64, activation)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, dy.double())
    assert rel_l2(y, ref) < REL_TOL[dtype]
    assert rel_l2(d_gate_up, ref_grad) < REL_TOL[dtype]


def test_extreme_gate_values_give_pytorchs_limits(device):
    """Overflowing exponentials (|gate| up to 1e4) give act → 0 or gate and act' → 0 or 1, never NaN."""
    g = torch.tensor([[-1e4, -100.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 100.0, 1e4]], device=device)
    for activation, approximate in ACTIVATIONS:
        gate, up = _leaf(g.clone()), _leaf(torch.ones_like(g))
        y = _glu(activation, approximate, gate, up)
        dgate, dup = torch.autograd.grad(y, (gate, up), torch.ones_like(y))
        g64, u64 = _leaf(g.double()), _leaf(torch.ones_like(g, dtype=torch.float64))
        ref = glu_float64(g64, u64, activation)
        rg, _ = torch.autograd.grad(ref, (g64, u64), torch.ones_like(ref))
        for name, got, want in (("y", y, ref), ("dgate", dgate, rg), ("dup", dup, ref)):
            assert torch.isfinite(got).all(), (activation, name, got)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=f"{activation} {name}")


@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_kernel_rounds_where_pytorch_rounds(activation, approximate, device):
    """fp16 (which the interpreter rounds to nearest, unlike bf16): the kernel rounds act(gate) and the products
    where eager PyTorch does, so nearly every output is bit-identical to ``act(gate) * up`` in fp16 and the rest
    differ by at most two units in the last place (fp32 exp/erf differ by ulps, which can flip the rounding of
    act(gate), and that flip carries into dup). Without the rounding of act(gate) only ~75% would match. Values
    below 1/64 get an absolute floor: PyTorch's own fp32 gelu cancels there."""
    gen = torch.Generator().manual_seed(21)
    gate = _leaf(_randn((64, 512), torch.float16, device, gen, scale=2.0))
    up = _leaf(_randn((64, 512), torch.float16, device, gen))
    _assert_nearly_eagers_bits(activation, approximate, gate, up,
                               lambda shape: torch.randn(shape).to(device, torch.float16))


@pytest.mark.parametrize("make_views", [
    # gate and up as column slices of one bigger tensor: unit column stride, row stride 2·n + 7, read in place
    lambda base, n: (base[:, 1:1 + n], base[:, n + 5:2 * n + 5]),
    # transposed: last dim has stride != 1 (copied to rows)
    lambda base, n: (base[:, :n].t(), base[:, n:2 * n].t()),
    # every other row
    lambda base, n: (base[::2, :n], base[1::2, n:2 * n]),
    # (batch, seq, n) from a (seq, batch, n) layout
    lambda base, n: (base[:, :n].reshape(5, 4, n).transpose(0, 1), base[:, n:2 * n].reshape(5, 4, n).transpose(0, 1)),
    # up broadcast over rows (row stride 0)
    lambda base, n: (base[:, :n], base[0, n:2 * n].expand(20, n)),
], ids=["column-slices", "transposed", "strided-rows", "permuted-3d", "broadcast-rows"])
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_non_contiguous_inputs(make_views, activation, approximate, device):
    gen = torch.Generator().manual_seed(3)
    n = 37
    base = _leaf(_randn((20, 2 * n + 7), torch.float32, device, gen, scale=2.0))
    gate, up = make_views(base, n)
    assert not (gate.is_contiguous() and up.is_contiguous())
    _assert_matches_float64(activation, approximate, gate, up)


def test_column_slices_are_read_in_place(device):
    base = torch.randn(6, 20, device=device)
    gate, up = base[:, :10], base[:, 10:]
    assert as_rows(gate, 10).data_ptr() == gate.data_ptr() and as_rows(up, 10).data_ptr() == up.data_ptr()
    assert as_rows(base.t(), 6).is_contiguous()


@pytest.mark.parametrize("make_view", [
    lambda base: base.t(),                 # (m, 2n) with column stride != 1
    lambda base: base[::3],                # every third row
    lambda base: base[:, 2:2 + 2 * 12],    # a column window of a wider tensor
], ids=["transposed", "strided-rows", "column-window"])
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_gate_up_non_contiguous(make_view, activation, approximate, device):
    gen = torch.Generator().manual_seed(5)
    base = _leaf(_randn((24, 30), torch.float32, device, gen, scale=2.0))
    gate_up = make_view(base)
    assert not gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0
    y = _glu_packed(activation, approximate, gate_up)
    dy = torch.randn(y.shape, device=device)
    (grad,) = torch.autograd.grad(y, base, dy)
    ref_base = _leaf(base.detach().double())
    g64, u64 = make_view(ref_base).chunk(2, dim=-1)
    ref = glu_float64(g64, u64, activation)
    (ref_grad,) = torch.autograd.grad(ref, ref_base, dy.double())
    assert rel_l2(y, ref) < REL_TOL[torch.float32]
    assert rel_l2(grad, ref_grad) < REL_TOL[torch.float32]


def _graph_nodes(fn):
    """Names of every autograd node reachable from fn."""
    seen, stack, names = set(), [fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("approximate", [None, "tanh"])
def test_gate_up_gradient_is_one_tensor_without_split_or_cat(approximate, device):
    """The packed op's backward node leads straight to gate_up: no slice/split/cat/copy node re-assembles the
    gradient, and the custom op's backward returns one (rows, 2·n) tensor."""
    gate_up = torch.randn(6, 40, device=device, requires_grad=True)
    y = _glu_packed(None, approximate, gate_up)
    names = _graph_nodes(y.grad_fn)
    assert not [n for n in names if any(w in n for w in ("Slice", "Split", "Cat", "Copy", "Chunk", "Stack"))], names
    assert "AccumulateGrad" in names
    dy = torch.randn(6, 20, device=device)
    grad = torch.ops.liger_gen.glu_gate_up_bwd(dy, gate_up.detach(), "silu" if approximate is None else "gelu_tanh")
    assert grad.shape == (6, 40) and grad.is_contiguous()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("approximate", [None, "none"])
def test_backward_saves_only_the_inputs(packed, approximate, device):
    """No activation tensor is saved for backward: only gate and up (or gate_up), which autograd keeps anyway."""
    x = torch.randn(4, 32, device=device, requires_grad=True)
    y, saved = saved_for_backward(lambda: _glu_packed(None, approximate, x) if packed
                                  else _glu(None, approximate, x[:, :16], x[:, 16:]))
    assert len(saved) == (1 if packed else 2)
    assert all(t.data_ptr() in (x.data_ptr(), x[:, 16:].data_ptr()) for t in saved)
    y.sum().backward()


# ------------------------------------------------------------------------------------------ runtime API


def test_cpu_path_is_bit_identical_to_transformers(monkeypatch):
    """Without the interpreter, CPU tensors run plain PyTorch: transformers' act_fn(gate) * up, bit for bit."""
    from transformers.activations import ACT2FN

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gate = _leaf(torch.randn(3, 5, 48).to(torch.bfloat16))
    up = _leaf(torch.randn(3, 5, 48).to(torch.bfloat16))
    for ours, act in ((lambda g, u: swiglu(g, u), "silu"), (lambda g, u: geglu(g, u, "tanh"), "gelu_pytorch_tanh"),
                      (lambda g, u: geglu(g, u, "none"), "gelu")):
        y = ours(gate, up)
        g2, u2 = _leaf(gate.detach()), _leaf(up.detach())
        ref = ACT2FN[act](g2) * u2
        assert torch.equal(y, ref)
        dy = torch.randn_like(y)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y, (gate, up), dy),
                                                     torch.autograd.grad(ref, (g2, u2), dy)))
    packed = torch.randn(4, 96, dtype=torch.bfloat16)
    g, u = packed.chunk(2, dim=-1)
    assert torch.equal(swiglu_gate_up(packed), F.silu(g) * u)
    assert torch.equal(geglu_gate_up(packed), F.gelu(g, approximate="tanh") * u)
    x64 = torch.randn(3, 10, dtype=torch.float64)
    torch.testing.assert_close(swiglu(x64, x64), glu_float64(x64, x64, "silu"))


def test_custom_ops_fall_back_to_pytorch_on_plain_cpu(monkeypatch):
    """Called directly on CPU tensors without the interpreter, the custom ops compute autograd's values, bit for
    bit, also on the strided halves of a packed gate_up (64 draws: bf16 erf rounding differed on a few)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ops = torch.ops.liger_gen
    for draw in range(64):
        gen = seeded("plain glu", draw)
        _check_plain_glu_ops(ops, *(torch.randn(5, 24, dtype=torch.bfloat16, generator=gen) for _ in range(3)))


def _check_plain_glu_ops(ops, g, u, dy):
    packed = torch.cat([g, u], dim=-1)
    for activation, approximate in ACTIVATIONS:
        g2, u2 = _leaf(g.clone()), _leaf(u.clone())
        ref = glu_torch(g2, u2, activation)
        ref_grads = torch.autograd.grad(ref, (g2, u2), dy)
        outs = ops.glu_fwd(g, u, activation), ops.glu_bwd(dy, g, u, activation), \
            ops.glu_gate_up_fwd(packed, activation), ops.glu_gate_up_bwd(dy, packed, activation)
        y, (dg, du), y_packed, d_packed = outs
        assert torch.equal(y, ref) and torch.equal(y_packed, ref)
        assert torch.equal(dg, ref_grads[0]) and torch.equal(du, ref_grads[1])
        assert torch.equal(d_packed, torch.cat(ref_grads, dim=-1))


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_swiglu_mlp_matches_llama_mlp(mlp_bias, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=32, intermediate_size=72, mlp_bias=mlp_bias)
    torch.manual_seed(0)
    hf = LlamaMLP(cfg)
    ours = SwiGLUMLP(cfg)
    assert ours.state_dict().keys() == hf.state_dict().keys()
    ours.load_state_dict(hf.state_dict())
    hf, ours = hf.to(device), ours.to(device)
    x = torch.randn(2, 5, 32, device=device)
    y_hf, y_ours = hf(x), ours(x)
    torch.testing.assert_close(y_ours, y_hf, rtol=1e-5, atol=1e-5)
    y_hf.square().sum().backward()
    y_ours.square().sum().backward()
    for (name, p_hf), p_ours in zip(hf.named_parameters(), ours.parameters()):
        torch.testing.assert_close(p_ours.grad, p_hf.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_swiglu_mlp_bit_identical_on_plain_cpu_path(monkeypatch):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64)
    hf = LlamaMLP(cfg).to(torch.bfloat16)
    ours = SwiGLUMLP(cfg).to(torch.bfloat16)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(ours(x), hf(x))


def test_swiglu_mlp_rejects_other_activations():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="hidden_act"):
        SwiGLUMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act="gelu"))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_torch_compile_has_no_graph_break(activation, approximate, packed, device):
    x = torch.randn(8, 64, device=device, requires_grad=True)

    def f(x):
        y = _glu_packed(activation, approximate, x) if packed else _glu(activation, approximate, x[:, :32], x[:, 32:])
        return y.square().sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    loss.backward()
    x2 = _leaf(x.detach().clone())
    ref = f(x2)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x.grad, x2.grad)


def test_opcheck_custom_ops(device):
    g, u, dy = (torch.randn(5, 40, device=device) for _ in range(3))
    packed = torch.randn(5, 80, device=device)
    ops = torch.ops.liger_gen
    cases = []
    for activation, _ in ACTIVATIONS:
        cases += [
            (ops.glu_fwd.default, (g, u, activation)),
            (ops.glu_bwd.default, (dy, g, u, activation)),
            (ops.glu_gate_up_fwd.default, (packed, activation)),
            (ops.glu_gate_up_bwd.default, (dy, packed, activation)),
        ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("shape", [(0, 16), (3, 0, 16), (4, 0)])
@pytest.mark.parametrize("approximate", [None, "tanh"])
def test_empty_inputs_match_pytorch(shape, approximate, device):
    gate = torch.randn(shape, device=device, requires_grad=True)
    up = torch.randn(shape, device=device, requires_grad=True)
    y = _glu(None, approximate, gate, up)
    assert y.shape == gate.shape
    y.sum().backward()
    assert gate.grad.shape == gate.shape and up.grad.shape == up.shape
    packed = torch.randn(shape[:-1] + (2 * shape[-1],), device=device, requires_grad=True)
    y = _glu_packed(None, approximate, packed)
    assert y.shape == shape
    y.sum().backward()
    assert packed.grad.shape == packed.shape


def test_double_backward_raises_instead_of_dropping_a_term(device):
    x = torch.randn(6, 32, device=device, requires_grad=True)
    for y in (swiglu(x[:, :16], x[:, 16:]), geglu_gate_up(x)):
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad((swiglu(x[:, :16], x[:, 16:]) ** 2).sum(), x)  # first order still works
    assert gx.shape == x.shape


def test_inference_mode_gate_with_trained_up(device):
    with torch.inference_mode():
        gate = torch.randn(4, 16, device=device)
    up = torch.randn(4, 16, device=device, requires_grad=True)
    swiglu(gate, up).sum().backward()
    torch.testing.assert_close(up.grad, F.silu(gate.clone()))


T = torch.ones


@pytest.mark.parametrize("call,exc,words", [
    (lambda d: swiglu(T(4, 8, device=d), T(4, 7, device=d)), ValueError, ["gate", "(4, 8)", "up", "(4, 7)", "shape"]),
    (lambda d: geglu(T(4, 8, device=d), T(8, device=d)), ValueError, ["gate", "(4, 8)", "up", "(8,)"]),
    (lambda d: swiglu(T(4, 8, device=d), T(4, 8, device=d, dtype=torch.float16)), TypeError,
     ["dtype", "torch.float32", "torch.float16"]),
    (lambda d: swiglu(T(4, 8, device=d, dtype=torch.int64), T(4, 8, device=d, dtype=torch.int64)), TypeError,
     ["gate", "(4, 8)", "torch.int64"]),
    (lambda d: geglu(T(4, 8, device=d, dtype=torch.float64), T(4, 8, device=d, dtype=torch.float64)), TypeError,
     ["gate", "float64", "(4, 8)"]),
    (lambda d: swiglu(T((), device=d), T((), device=d)), ValueError, ["gate", "at least one dim"]),
    (lambda d: swiglu([1.0], T(1, device=d)), TypeError, ["gate", "tensor", "list"]),
    (lambda d: swiglu_gate_up(T(4, 7, device=d)), ValueError, ["gate_up", "(4, 7)", "even"]),
    (lambda d: geglu_gate_up(T(4, 7, device=d)), ValueError, ["gate_up", "(4, 7)", "even"]),
    (lambda d: swiglu_gate_up(T(4, 8, device=d, dtype=torch.int32)), TypeError, ["gate_up", "torch.int32"]),
    (lambda d: geglu_gate_up(T((), device=d)), ValueError, ["gate_up", "at least one dim"]),
    (lambda d: geglu(T(2, 4, device=d), T(2, 4, device=d), approximate="exact"), ValueError,
     ["approximate", "'exact'", "tanh"]),
    (lambda d: geglu_gate_up(T(2, 4, device=d), approximate=None), ValueError, ["approximate", "None"]),
])
def test_bad_input_names_argument_shape_dtype(call, exc, words, device):
    with pytest.raises(exc) as info:
        call(device)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_up_on_other_device_is_an_error():
    with pytest.raises(ValueError, match="one device"):
        swiglu(torch.ones(2, 4, device="cuda"), torch.ones(2, 4))


# ------------------------------------------------------------------------------------------ space and tuning


WIDTHS = (list(range(1, 200)) + [2 ** k + d for k in range(8, 18) for d in (-1, 0, 1)]
          + [4864, 8192, 11008, 14336, 18944, 28672])


@pytest.mark.parametrize("space_cls", [GLUSpace, GeGLUSpace])
@pytest.mark.parametrize("dtype", DTYPES)
def test_heuristic_valid_for_every_width(space_cls, dtype):
    for n, config in valid_heuristics(space_cls, WIDTHS, dtype,
                                      HEURISTIC_LIMITS + (DeviceLimits(max_shared_memory_per_block=49152),)):
        assert config.BLOCK_N_FWD <= max(16, 2 * n) and config.BLOCK_N_BWD <= max(16, 2 * n)


def test_constraints_reject_bad_configs():
    space = GLUSpace(14336, torch.float32, DeviceLimits(max_threads_per_block=256, max_shared_memory_per_block=49152))
    good = space.heuristic()
    assert any("threads" in p for p in space.violations(dataclasses.replace(good, num_warps_fwd=16)))
    assert any("per thread" in p for p in space.violations(
        dataclasses.replace(good, BLOCK_N_BWD=8192, BLOCK_M_BWD=16, num_warps_bwd=8)))
    assert any("shared memory" in p for p in space.violations(
        dataclasses.replace(good, BLOCK_N_BWD=4096, BLOCK_M_BWD=1, num_warps_bwd=8, num_stages_bwd=3)))
    assert any("not one of" in p for p in space.violations(dataclasses.replace(good, TILES_FWD=3)))
    narrow = GLUSpace(100, torch.bfloat16)
    assert any("BLOCK_N=256" in p for p in narrow.violations(dataclasses.replace(narrow.heuristic(), BLOCK_N_FWD=256)))
    with pytest.raises(ValueError, match="unknown fields"):
        GLUConfig.from_dict({**good.to_dict(), "BLOCK_K": 2})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("changes", GLU_TEMPLATE_BRANCHES, ids=GLU_TEMPLATE_BRANCH_IDS)
def test_every_template_branch_passes_the_tuners_gate(changes, activation, dtype, device):
    """The tuner's float64 gate (NaN-poisoned outputs, per-dtype tolerance) on each structural variant."""
    problem_cls = GLUProblem if activation == "silu" else GeGLUProblem
    assert_passes_the_gate(problem_cls(dtype, 100, 19, device, activation=activation, seed=5), changes)


def test_gate_catches_a_wrong_kernel(device):
    """The gate can fail: the SwiGLU kernel checked against GeGLU's truth is rejected."""
    swiglu_problem = GLUProblem(torch.float32, 64, 9, device, seed=1)
    geglu_problem = GeGLUProblem(torch.float32, 64, 9, device, seed=1)
    module = load_variant("glu", swiglu_problem.template_params(swiglu_problem.space.heuristic()))
    assert swiglu_problem.check(module, "fwd") is None
    assert "relative L2 error" in geglu_problem.check(module, "fwd")
    assert "relative L2 error" in geglu_problem.check(module, "bwd")


def test_problem_reference_in_chunks_bytes_and_validation(monkeypatch):
    monkeypatch.setattr(GLUProblem, "REF_CHUNK_ELEMENTS", 100)  # 3 rows per chunk of 33 columns
    problem = GeGLUProblem(torch.bfloat16, 33, 10, "cpu", activation="gelu", seed=2)
    b = problem.buffers
    g64, u64 = _leaf(b["gate"].double()), _leaf(b["up"].double())
    ref = glu_float64(g64, u64, "gelu")
    dg, du = torch.autograd.grad(ref, (g64, u64), b["dy"].double())
    for name, want in (("y", ref), ("dgate", dg), ("dup", du)):
        torch.testing.assert_close(problem.ref[name].double(), want, rtol=1e-6, atol=1e-7)
    assert problem.bytes_moved("fwd") == 3 * 10 * 33 * 2 and problem.bytes_moved("bwd") == 5 * 10 * 33 * 2
    assert problem.variant == {"activation": "gelu"}
    with pytest.raises(ValueError, match="activation"):
        GLUProblem(torch.float32, 8, 2, "cpu", activation="gelu")


def test_tuning_problems_use_intermediate_size():
    from liger_gen.models import PRESETS
    from liger_gen.ops import get_spec

    model = dataclasses.replace(PRESETS["llama3-8b"], intermediate_size=48)
    for op, activation in (("swiglu", "silu"), ("geglu", "gelu_tanh")):
        spec = get_spec(op)
        assert spec.space.op == op and spec.space.template == "glu"
        problems = spec.tuning_problems(model, [3, 5], torch.float32, "cpu")
        assert [(p.op, p.rows, p.dims, p.variant) for p in problems] == [
            (op, r, {"n_cols": 48}, {"activation": activation}) for r in (3, 5)]


def _cost_model(launch, params):
    """Deterministic 'time' favouring 2-row tiles, 64 columns and 2 warps in both phases."""
    return sum(1.0 + abs(params[f"BLOCK_M_{p}"] - 2) + abs(params[f"BLOCK_N_{p}"] - 64) / 64
               + 0.3 * abs(params[f"num_warps_{p.lower()}"] - 2) + 0.1 * params[f"TILES_{p}"] for p in ("FWD", "BWD"))


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_small_tuner_run_writes_a_usable_table(op, tmp_path, monkeypatch):
    import optuna

    from liger_gen.tuning.search import Tuner
    from liger_gen.tuning.tables import tune_to_table
    from liger_gen.runtime.ops import clear_caches

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    problem_cls = GLUProblem if op == "swiglu" else GeGLUProblem
    problem = problem_cls(torch.float32, 96, 12, "cpu", seed=1)
    tuner = Tuner(n_trials=4, timer=_cost_model, seed=0, retime_rounds=1)
    path, (entry,) = tune_to_table(problem.SPACE, [problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                                   compute_capability="9.0", tuner=tuner)
    assert path == tmp_path / "h200" / f"{op}.json"
    config = GLUConfig.from_dict(entry["config"])
    assert not problem.space.violations(config)
    assert entry["variant"] == problem.variant and entry["dims"] == {"n_cols": 96}
    assert entry["bytes"] == {"fwd": 3 * 12 * 96 * 4, "bwd": 5 * 12 * 96 * 4}
    for phase in ("fwd", "bwd"):
        assert entry["trials"][phase][0]["params"] == problem.space.phase_params(problem.space.heuristic(), phase)
        assert entry["timing_ms"][phase]["tuned"] <= entry["timing_ms"][phase]["heuristic"]
    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    tables.clear_caches()
    try:
        found = tables.lookup(problem.SPACE, torch.float32, 96, 12, "h200", DeviceLimits.interpreter(),
                              variant=problem.variant)
        assert found["source"] == "user" and found["config"] == config
    finally:
        monkeypatch.delenv(tables.ENV_TUNED_DIR)
        clear_caches()


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_llama3_8b_shape_on_gpu(activation, approximate, packed):
    """Llama-3-8B's MLP activation at 16384 tokens x 14336 in bf16 against float64 (computed in row chunks)."""
    rows, n = 16384, 14336
    gen = torch.Generator(device="cuda").manual_seed(0)
    if packed:
        gate_up = _leaf(2 * torch.randn(rows, 2 * n, device="cuda", generator=gen).to(torch.bfloat16))
        gate, up = gate_up.detach()[:, :n], gate_up.detach()[:, n:]
        y = _glu_packed(activation, approximate, gate_up)
        dy = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
        (d_gate_up,) = torch.autograd.grad(y, gate_up, dy)
        dgate, dup = d_gate_up[:, :n], d_gate_up[:, n:]
    else:
        gate = _leaf(2 * torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16))
        up = _leaf(torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16))
        y = _glu(activation, approximate, gate, up)
        dy = torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16)
        dgate, dup = torch.autograd.grad(y, (gate, up), dy)
        gate, up = gate.detach(), up.detach()
    sums = {name: [0.0, 0.0] for name in ("y", "dgate", "dup")}
    for start in range(0, rows, 1024):
        r = slice(start, start + 1024)
        g64, u64 = _leaf(gate[r].double()), _leaf(up[r].double())
        ref = glu_float64(g64, u64, activation)
        rg, ru = torch.autograd.grad(ref, (g64, u64), dy[r].double())
        for name, got, want in (("y", y[r], ref.detach()), ("dgate", dgate[r], rg), ("dup", dup[r], ru)):
            sums[name][0] += (got.double() - want).square().sum().item()
            sums[name][1] += want.square().sum().item()
    for name, (err, norm) in sums.items():
        assert (err / norm) ** 0.5 < REL_TOL[torch.bfloat16], name


@pytest.mark.gpu
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS, ids=ACT_IDS)
def test_kernel_rounds_like_pytorch_eager_on_gpu(activation, approximate):
    """bf16 on the GPU (round to nearest): outputs and gradients equal eager ``act(gate) * up`` in nearly every
    element and differ by at most two bf16 units in the last place (fp32 exp/erf/tanh implementations differ by
    ulps, which can flip the rounding of act(gate), carried into dup; below 1/64 an absolute floor, where
    PyTorch's own fp32 gelu formulas cancel)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    gate = _leaf(2 * torch.randn(256, 4096, device="cuda", generator=gen).to(torch.bfloat16))
    up = _leaf(torch.randn(256, 4096, device="cuda", generator=gen).to(torch.bfloat16))
    _assert_nearly_eagers_bits(activation, approximate, gate, up,
                               lambda shape: torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16))


def _gelu_tanh_mlp_grads(hidden=2048, intermediate=4096, batch=2, seq=2048, device="cuda", dtype=torch.bfloat16,
                         scaled=True):
    """Gradients (x, gate_proj, up_proj, down_proj weights) of the GELU-tanh MLP ``down(gelu_tanh(gate(x)) ·
    up(x))`` computed three ways from the same bf16 inputs: transformers' LlamaMLP with hidden_act
    "gelu_pytorch_tanh" (GELUTanh) in ``dtype``, the same MLP with liger-gen's geglu in ``dtype``, and float64.
    Weights ~ N(0, 1/fan_in) (``scaled``), or N(0, 1) as in Liger-Kernel's test (gate values of order 45)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                                      hidden_act="gelu_pytorch_tanh")
    gen = torch.Generator().manual_seed(0)
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(config).to(device, dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[1] ** 0.5 if scaled else 1.0))
    x = torch.randn(batch, seq, hidden, generator=gen).to(device, dtype)
    dy = torch.randn(batch, seq, hidden, generator=gen).to(device, dtype)

    def run(forward, params, inp):
        inp = inp.detach().requires_grad_()
        params = [p.detach().requires_grad_() for p in params]
        forward(inp, *params).backward(dy.to(inp.dtype))
        return [inp.grad] + [p.grad for p in params]

    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]

    def ours(inp, wg, wu, wd):
        return F.linear(geglu(F.linear(inp, wg), F.linear(inp, wu), "tanh"), wd)

    def exact(inp, wg, wu, wd):
        return F.linear(F.gelu(F.linear(inp, wg), approximate="tanh") * F.linear(inp, wu), wd)

    def theirs(inp, wg, wu, wd):  # LlamaMLP.forward with these weights: down_proj(act_fn(gate_proj(x)) * up_proj(x))
        return F.linear(mlp.act_fn(F.linear(inp, wg)) * F.linear(inp, wu), wd)

    reference = run(exact, [w.double() for w in weights], x.double())
    return run(theirs, weights, x), run(ours, weights, x), reference


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled-init", "unit-init"])
def test_geglu_mlp_bf16_gradients_against_float64_and_transformers(scaled):
    """Batch 2 × 2048 tokens, hidden 2048 → 4096, bf16: the MLP that Liger-Kernel's own test compares with
    transformers' GELUTanh MLP by allclose(atol=1e-2, rtol=1e-2). Measured against float64, liger-gen's
    gradients are at least as accurate as transformers' bf16 ones, and within the bf16 tolerance."""
    names = ("x", "gate_proj", "up_proj", "down_proj")
    theirs, ours, exact = _gelu_tanh_mlp_grads(scaled=scaled)
    def outside(a, b):  # share of elements an allclose(atol=1e-2, rtol=1e-2) of a against b rejects
        a, b = a.double(), b.double()
        return ((a - b).abs() > 1e-2 + 1e-2 * b.abs()).double().mean().item()

    for name, t, o, e in zip(names, theirs, ours, exact):
        err_t, err_o = rel_l2(t, e), rel_l2(o, e)
        print(f"{name}: relative L2 against float64: liger-gen {err_o:.4e}, transformers {err_t:.4e}; outside "
              f"allclose(1e-2, 1e-2): liger-gen vs transformers {outside(o, t):.2e}, transformers vs float64 "
              f"{outside(t, e):.2e}, liger-gen vs float64 {outside(o, e):.2e}")
        assert err_o < REL_TOL[torch.bfloat16], name
        assert err_o <= 1.02 * err_t, (name, err_o, err_t)


def _mlp(packed: bool, activation: str, hidden: int, inter: int, device, dtype, gen):
    from liger_gen.ops.glu.glu import GLUMLP

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    linear = lambda i, o: torch.nn.Linear(i, o).to(device, dtype)  # noqa: E731
    if packed:
        return GLUMLP(activation, linear(inter, hidden), gate_up_proj=linear(hidden, 2 * inter))
    return GLUMLP(activation, linear(inter, hidden), gate_proj=linear(hidden, inter), up_proj=linear(hidden, inter))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True], ids=["gate-up", "packed"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glumlp_backward_writes_over_its_activations_and_matches_float64(device, dtype, packed, activation,
                                                                          storage_peak, monkeypatch):
    """GLUMLP's eager backward writes dgate/dup over its own gate/up activations (two activation-sized buffers
    fewer at the backward's peak) and its gradients match float64 as closely as the buffered backward's."""
    import copy

    from liger_gen.ops.glu import glu as glu_module

    gen = seeded(dtype, packed, activation)
    mlp = _mlp(packed, activation, 32, 96, device, dtype, gen)
    x = _randn((3, 40, 32), dtype, device, gen).requires_grad_()
    dy = _randn((3, 40, 32), dtype, device, gen)
    ref = copy.deepcopy(mlp).double()
    ref.in_place_backward = False
    x64 = x.detach().double().requires_grad_()
    with monkeypatch.context() as m:
        m.setattr(glu_module, "uses_triton", lambda t: False)  # float64: the plain-PyTorch op
        ref(x64).backward(dy.double())
    results = {}
    for in_place in (False, True):
        model = copy.deepcopy(mlp)
        model.in_place_backward = in_place
        xi = x.detach().requires_grad_()
        y = model(xi)
        with storage_peak() as meter:
            y.backward(dy)
        grads = [xi.grad] + [p.grad for p in model.parameters()]
        errors = [rel_l2(g.double(), r) for g, r in zip(grads, [x64.grad] + [p.grad for p in ref.parameters()])]
        results[in_place] = (meter.peak, errors)
    (peak_buffered, err_buffered), (peak_in_place, err_in_place) = results[False], results[True]
    for e, b in zip(err_in_place, err_buffered):
        assert e <= max(1.01 * b, REL_TOL[dtype] / 100), (err_in_place, err_buffered)
    # the buffered backward holds dgate and dup while the saved gate and up are still alive; which other
    # temporaries coincide with each path's peak depends on the device's allocation order, so the bound is one
    # activation (two on the CPU paths, measured)
    activation_bytes = 3 * 40 * 96 * torch.finfo(dtype).bits // 8
    assert peak_buffered - peak_in_place >= activation_bytes, (peak_buffered, peak_in_place)


def test_glumlp_second_backward_through_the_graph_is_refused_by_name(device):
    gen = seeded("retain")
    mlp = _mlp(False, "silu", 16, 48, device, torch.float32, gen)
    loss = mlp(_randn((2, 8, 16), torch.float32, device, gen)).square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"GLUMLP: a second backward .* `in_place_backward = False`"):
        loss.backward()
    mlp.in_place_backward = False  # then retain_graph works: both backwards give the same gradient
    mlp.zero_grad()
    loss = mlp(_randn((2, 8, 16), torch.float32, device, gen)).square().sum()
    loss.backward(retain_graph=True)
    first = mlp.gate_proj.weight.grad.clone()
    loss.backward()
    assert torch.allclose(mlp.gate_proj.weight.grad, 2 * first, rtol=1e-5, atol=1e-6)


def test_glumlp_keeps_activations_a_forward_hook_holds(device):
    """A forward hook on a projection may keep its output: the backward then leaves the activations as they are."""
    gen = seeded("hook")
    mlp = _mlp(False, "silu", 16, 48, device, torch.float32, gen)
    kept = []
    mlp.up_proj.register_forward_hook(lambda module, args, out: kept.append(out))
    x = _randn((2, 8, 16), torch.float32, device, gen)
    mlp(x).sum().backward()
    assert torch.equal(kept[0], mlp.up_proj(x))


def test_glumlp_keeps_activations_a_hook_inside_a_wrapped_projection_holds(device):
    """A PEFT-style wrapper around a projection whose inner Linear has a hook that keeps its output: the
    backward leaves that tensor as it is."""

    class Wrapped(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    gen = seeded("nested-hook")
    mlp = _mlp(False, "silu", 16, 48, device, torch.float32, gen)
    mlp.gate_proj = Wrapped(mlp.gate_proj)
    kept = []
    mlp.gate_proj.base_layer.register_forward_hook(lambda module, args, out: kept.append(out))
    x = _randn((2, 8, 16), torch.float32, device, gen)
    mlp(x).sum().backward()
    assert torch.equal(kept[0], mlp.gate_proj(x))


def test_glumlp_overwrites_only_what_a_matmul_or_sum_made(device):
    """A projection ending in an op that saves its own output (tanh) keeps the buffered backward: same
    gradients as with in_place_backward off, and no in-place error; a pickled GLUMLP without the attribute
    (made before it existed) runs as the default."""
    import copy

    class Squashed(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return torch.tanh(self.base(x))

    gen = seeded("tanh")
    mlp = _mlp(False, "silu", 16, 48, device, torch.float32, gen)
    mlp.up_proj = Squashed(mlp.up_proj)
    x = _randn((2, 8, 16), torch.float32, device, gen)
    buffered = copy.deepcopy(mlp)
    buffered.in_place_backward = False
    mlp(x).square().sum().backward()
    buffered(x).square().sum().backward()
    for a, b in zip(mlp.parameters(), buffered.parameters()):
        assert torch.equal(a.grad, b.grad)
    old = copy.deepcopy(buffered)
    del old.__dict__["in_place_backward"]
    old.zero_grad()
    old(x).square().sum().backward()
    assert torch.equal(old.down_proj.weight.grad, mlp.down_proj.weight.grad)
