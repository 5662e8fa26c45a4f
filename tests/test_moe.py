"""Mixture-of-experts experts: routing, the permutation kernels (Triton interpreter on the CPU) and
``moe_experts`` against float64 and transformers' experts modules, determinism and bad input."""


import pytest
import torch

from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.ops.glu.moe import (MoEPermuteProblem, MoEPermuteSpace, moe_experts, moe_experts_torch, moe_permute,
                                   moe_routing, moe_unpermute)

from conftest import CPU_PATHS, seeded
from helpers import assert_passes_the_gate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _routing(tokens, experts, k, gen, skip_expert=None):
    """Top-k of random scores (distinct experts per token); ``skip_expert`` is never chosen."""
    scores = torch.rand(tokens, experts, generator=gen)
    if skip_expert is not None:
        scores[:, skip_expert] = -1.0
    weights, index = scores.softmax(-1).topk(k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def _experts(experts, hidden, width, dtype, gen):
    gate_up = torch.randn(experts, 2 * width, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(experts, hidden, width, generator=gen) * width ** -0.5
    return gate_up.to(dtype), down.to(dtype)


def test_routing_is_a_stable_sort_by_expert_and_its_inverse():
    gen = seeded("routing")
    index, _ = _routing(37, 6, 3, gen, skip_expert=2)
    token, pos, offsets = moe_routing(index, 6)
    flat = index.reshape(-1)
    experts_of_rows = flat[pos.reshape(-1).argsort()]
    assert torch.equal(experts_of_rows, flat.sort(stable=True).values)  # rows grouped by expert
    assert torch.equal(token[pos], torch.arange(37)[:, None].expand(37, 3))  # pos is token's inverse
    assert torch.equal(offsets.long(), torch.bincount(flat, minlength=6).cumsum(0))
    assert offsets.dtype == torch.int32 and offsets[1] == offsets[2]  # expert 2 has no rows
    # stable: within an expert, rows follow the (token, choice) order
    order = pos.reshape(-1).argsort()
    for e in range(6):
        rows = order[(experts_of_rows == e)]
        assert torch.equal(rows, rows.sort().values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_moe_experts_matches_float64(dtype, interpret, monkeypatch):
    """Output and the gradients of x, both weight tensors and the routing weights against float64 autograd of
    transformers' eager expert loop, with an expert that no token chose."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("experts", dtype, interpret)
    tokens, hidden, width, experts, k = 13, 24, 16, 5, 2
    index, weights = _routing(tokens, experts, k, gen, skip_expert=3)
    gate_up, down = _experts(experts, hidden, width, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, gate_up, down, weights.to(dtype))]
    out = moe_experts(leaves[0], leaves[1], leaves[2], index, leaves[3])
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = moe_experts_torch(ref_leaves[0], ref_leaves[1], ref_leaves[2], index, ref_leaves[3])
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    tol = 2 * REL_TOL[dtype]  # two GEMMs and the GLU, each rounded to the dtype as transformers' loop rounds
    assert out.dtype == dtype and rel_l2(out, ref) < tol
    for name, g, r in zip(("dx", "dgate_up", "ddown", "dweights"), grads, ref_grads):
        assert g.dtype == dtype and rel_l2(g, r) < tol, name
    assert (grads[1][3] == 0).all() and (grads[2][3] == 0).all()  # the unchosen expert gets no gradient


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_equals_transformers_experts_module(activation, monkeypatch):
    """The plain CPU path equals transformers' Qwen3-MoE experts module (fp32), whatever its implementation."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[activation]
    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6,
                                         num_hidden_layers=1, hidden_act=act)
    module = modeling.Qwen3MoeExperts(config)
    gen = seeded("transformers", activation)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) * 0.2)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) * 0.2)
    x = torch.randn(11, 32, generator=gen)
    index, weights = _routing(11, 6, 2, gen)
    ours = moe_experts(x, module.gate_up_proj, module.down_proj, index, weights, activation)
    torch.testing.assert_close(ours, module(x, index, weights), rtol=1e-5, atol=1e-6)


def test_permutations_are_deterministic_and_sum_in_order():
    """The interpreter kernels give bit-identical results on repeated runs (each token's k rows are added in a
    fixed order, no atomics), equal to the fp32 reference sum."""
    gen = seeded("determinism")
    index, weights = _routing(29, 8, 4, gen)
    token, pos, _ = moe_routing(index, 8)
    ys = torch.randn(29 * 4, 40, generator=gen).bfloat16().requires_grad_()
    w = weights.bfloat16().requires_grad_()
    runs = []
    for _ in range(2):
        out = moe_unpermute(ys, pos, w)
        runs.append((out, *torch.autograd.grad(out, (ys, w), torch.ones_like(out))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    want = (ys.detach().double()[pos] * w.detach().double()[..., None]).sum(1)
    assert rel_l2(runs[0][0], want) < REL_TOL[torch.bfloat16]


def test_problem_and_space(device):
    space = MoEPermuteSpace({"hidden": 2048}, torch.bfloat16)
    assert not space.violations(space.heuristic())
    problem = MoEPermuteProblem(torch.float32, 48, 10, device, seed=2)
    module = assert_passes_the_gate(problem)
    problem.buffers["pos"][0, 0] = problem.buffers["pos"][0, 1]  # a wrong permutation must fail the check
    assert problem.check(module, "fwd") is not None


def test_bad_input_names_argument():
    gen = seeded("bad")
    index, weights = _routing(4, 3, 2, gen)
    gate_up, down = _experts(3, 8, 6, torch.float32, gen)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"top_k_index holds indices outside \[0, 3\)"):
        moe_experts(x, gate_up, down, index + 1, weights)
    with pytest.raises(ValueError, match="gate_up_proj must be"):
        moe_experts(x, gate_up[:, :11], down, index, weights)
    with pytest.raises(TypeError, match="down_proj must have x's dtype"):
        moe_experts(x, gate_up, down.double(), index, weights)
    with pytest.raises(ValueError, match="activation must be one of"):
        moe_experts(x, gate_up, down, index, weights, "relu")
    with pytest.raises(ValueError, match="top_k_weights must be"):
        moe_experts(x, gate_up, down, index, weights[:, :1])
    with pytest.raises(TypeError, match="top_k_index must be an int64 or int32"):
        moe_experts(x, gate_up, down, index.float(), weights)
    token, pos, _ = moe_routing(index, 3)
    with pytest.raises(ValueError, match="token holds indices outside"):
        moe_permute(x, token + 4, pos)
    with pytest.raises(ValueError, match="pos must be"):
        moe_unpermute(torch.randn(9, 8), pos)


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_moe_experts_compiles_without_a_graph_break(interpret, monkeypatch):
    """Under torch.compile(fullgraph=True) the per-expert fallback does not read the offsets on the host; the
    compiled result and gradients equal eager mode's."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("compile", interpret)
    index, weights = _routing(9, 4, 2, gen, skip_expert=1)
    gate_up, down = _experts(4, 16, 8, torch.float32, gen)
    x = torch.randn(9, 16, generator=gen)

    def f(x, gate_up, down):
        return moe_experts(x, gate_up, down, index, weights)

    leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves)
    grads = torch.autograd.grad(got.square().sum(), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    ref = f(*ref_leaves)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    torch.testing.assert_close(got, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    torch._dynamo.reset()


def test_routing_rejects_bad_indices():
    with pytest.raises(ValueError, match=r"top_k_index holds indices outside \[0, 3\)"):
        moe_routing(torch.tensor([[0, 5]]), 3)
    with pytest.raises(ValueError, match="2-D"):
        moe_routing(torch.tensor([0, 1]), 3)
    with pytest.raises(TypeError, match="int64 or int32"):
        moe_routing(torch.tensor([[0.0, 1.0]]), 3)
    with pytest.raises(TypeError, match="token must be a 1-D int64"):
        moe_permute(torch.randn(2, 4), [0, 1], torch.tensor([[0], [1]]))


def test_tuning_rows_are_capped_so_the_float64_reference_fits_one_gpu():
    from liger_gen.models import PRESETS
    from liger_gen.ops.glu.moe import MAX_TUNING_ELEMENTS, SPEC, TUNING_TOP_K

    rows = [4096, 16384, 65536]
    assert SPEC.tuning_rows(PRESETS["llama3-70b"], rows) == [4096, 16384, 32768]  # hidden 8192
    assert SPEC.tuning_rows(PRESETS["llama3-8b"], rows) == rows  # hidden 4096: the packaged 65536 entries stay
    for shape in PRESETS.values():
        capped = SPEC.tuning_rows(shape, rows)
        assert all(r * TUNING_TOP_K * shape.hidden_size <= MAX_TUNING_ELEMENTS for r in capped)
        assert max(capped) * 2 * TUNING_TOP_K * shape.hidden_size > MAX_TUNING_ELEMENTS or max(capped) == 65536


# ------------------------------------------------------------------------------------------------ pos and token
# The kernels' backwards rely on pos being a permutation of the sorted rows and on token being its inverse: the
# unpermute backward writes dys[pos[t, j]] once per pair (a repeated row would keep one write, not the sum), and
# the permute backward sums dxs[pos[t, j]] over j as token t's gradient. Both ops refuse inputs that break this.


def _inverse_pair(tokens, k, gen):
    """A random valid (token, pos): pos any permutation of the T·k rows (not grouped by expert), token its inverse."""
    pos = torch.randperm(tokens * k, generator=gen).view(tokens, k)
    token = torch.empty(tokens * k, dtype=torch.int64)
    token[pos.reshape(-1)] = torch.arange(tokens).repeat_interleave(k)
    return token, pos


def _pair(source, tokens, k, gen):
    if source == "routing":
        index, _ = _routing(tokens, 2 * k + 1, k, gen)
        token, pos, _ = moe_routing(index, 2 * k + 1)
        return token, pos
    return _inverse_pair(tokens, k, gen)


def _two_cells(tokens, k, gen):
    """Two distinct (t, j) cells of a (tokens, k) pos, in different tokens."""
    a, b = torch.randperm(tokens, generator=gen)[:2].tolist()
    ja, jb = torch.randint(k, (2,), generator=gen).tolist()
    return (a, ja), (b, jb)


@pytest.mark.parametrize("source", ["routing", "any_inverse"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_permutations_match_float64_for_any_valid_pos(source, dtype, interpret, monkeypatch):
    """moe_routing's (token, pos) and any other permutation pos with its inverse token are accepted, and both
    ops' outputs and gradients (x; ys and the weights) match float64 autograd of the plain indexing."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("valid pos", source, dtype, interpret)
    tokens, k, hidden = 11, 3, 20
    token, pos = _pair(source, tokens, k, gen)
    for index_dtype in (torch.int64, torch.int32):
        t, p = token.to(index_dtype), pos.to(index_dtype)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
        ys = torch.randn(tokens * k, hidden, generator=gen).to(dtype).requires_grad_()
        w = torch.rand(tokens, k, generator=gen).to(dtype).requires_grad_()
        xs, out = moe_permute(x, t, p), moe_unpermute(ys, p, w)
        dxs, dout = torch.randn(xs.shape, generator=gen).to(dtype), torch.randn(out.shape, generator=gen).to(dtype)
        grads = torch.autograd.grad((xs, out), (x, ys, w), (dxs, dout))
        leaves = [v.detach().double().requires_grad_() for v in (x, ys, w)]
        ref_xs = leaves[0][token]
        ref_out = (leaves[1][pos] * leaves[2][..., None]).sum(1)
        ref_grads = torch.autograd.grad((ref_xs, ref_out), leaves, (dxs.double(), dout.double()))
        assert rel_l2(xs, ref_xs) < REL_TOL[dtype] and rel_l2(out, ref_out) < REL_TOL[dtype]
        for name, g, r in zip(("dx", "dys", "dw"), grads, ref_grads):
            assert g.dtype == dtype and rel_l2(g, r) < REL_TOL[dtype], (name, index_dtype)


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_unpermute_refuses_a_repeated_row(interpret, monkeypatch):
    """A pos that names one row of ys twice (and so another never) is refused on both paths, naming pos, its
    shape and dtype and the first repeated row; the kernel path would otherwise return a wrong dys."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("repeated row", interpret)
    tokens, k, hidden = 9, 2, 16
    for index_dtype in (torch.int64, torch.int32):
        _, pos = _pair("routing", tokens, k, gen)
        (a, ja), (b, jb) = _two_cells(tokens, k, gen)
        row, lost = int(pos[a, ja]), int(pos[b, jb])
        pos[b, jb] = row
        ys = torch.randn(tokens * k, hidden, generator=gen, requires_grad=True)
        w = torch.rand(tokens, k, generator=gen)
        shape = rf"shape \({tokens}, {k}\), dtype {index_dtype}"
        with pytest.raises(ValueError, match=rf"moe_unpermute: pos must hold each row of ys once.*{shape}.*"
                                             rf"row {row} appears 2 times.*never appear.*row {lost}\)"):
            moe_unpermute(ys, pos.to(index_dtype), w)
        with pytest.raises(ValueError, match=rf"row {row} appears 2 times"):
            moe_unpermute(ys, pos.to(index_dtype))  # unweighted as well
        with torch.no_grad():  # no backward to guard: the forward is right for any pos in range
            out = moe_unpermute(ys, pos.to(index_dtype), w)
        assert rel_l2(out, (ys.detach().double()[pos] * w.double()[..., None]).sum(1)) < REL_TOL[torch.float32]


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_permute_refuses_pos_that_is_not_the_inverse_of_token(interpret, monkeypatch):
    """Two ways pos can break the inverse that the permute backward sums over, both refused on both paths:
    a permutation that sends a pair to another token's row, and a token's own row named twice."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("not inverse", interpret)
    tokens, k, hidden = 10, 3, 16
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    for index_dtype in (torch.int64, torch.int32):
        token, pos = _pair("any_inverse", tokens, k, gen)
        (a, ja), (b, jb) = _two_cells(tokens, k, gen)
        swapped = pos.clone()
        swapped[a, ja], swapped[b, jb] = pos[b, jb], pos[a, ja]  # still a permutation, no longer token's inverse
        first = min((a, ja), (b, jb))
        row = int(swapped[first])
        with pytest.raises(ValueError, match=rf"moe_permute: pos must be the inverse of token.*shape \({tokens}, "
                                             rf"{k}\), dtype {index_dtype}.*pos\[{first[0]}, {first[1]}\] = {row} "
                                             rf"but token\[{row}\] = {int(token[row])}"):
            moe_permute(x, token.to(index_dtype), swapped.to(index_dtype))
        repeated = pos.clone()
        repeated[a, (ja + 1) % k] = pos[a, ja]  # token[repeated] is still t everywhere; one row of a is lost
        with pytest.raises(ValueError, match=rf"moe_permute: pos must hold each row of xs once.*"
                                             rf"row {int(pos[a, ja])} appears 2 times"):
            moe_permute(x, token.to(index_dtype), repeated.to(index_dtype))


@pytest.mark.parametrize("interpret", CPU_PATHS)
def test_pos_checks_compile_without_a_graph_break(interpret, monkeypatch):
    """Under torch.compile(fullgraph=True) the checks are traced device-side assertions (as on CUDA, where they
    cost no host synchronisation): valid input gives eager mode's result, a repeated row or a pos that is not
    token's inverse stops the call."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gen = seeded("compiled checks", interpret)
    tokens, k, hidden = 7, 2, 16
    token, pos = _pair("routing", tokens, k, gen)
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)  # the checks guard the backwards
    ys = torch.randn(tokens * k, hidden, generator=gen, requires_grad=True)
    w = torch.rand(tokens, k, generator=gen)

    def f(x, ys, token, pos, w):
        return moe_permute(x, token, pos), moe_unpermute(ys, pos, w)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    try:
        for got, want in zip(compiled(x, ys, token, pos, w), f(x, ys, token, pos, w)):
            torch.testing.assert_close(got, want)
        (a, ja), (b, jb) = _two_cells(tokens, k, gen)
        repeated = pos.clone()
        repeated[b, jb] = pos[a, ja]
        with pytest.raises(RuntimeError, match="pos must hold each row"):
            compiled(x, ys, token, repeated, w)
        swapped = pos.clone()
        swapped[a, ja], swapped[b, jb] = pos[b, jb], pos[a, ja]
        with pytest.raises(RuntimeError, match="pos must be the inverse of token"):
            compiled(x, ys, token, swapped, w)
    finally:
        torch._dynamo.reset()
