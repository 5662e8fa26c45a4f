"""The contract every op keeps, checked for every op alike from its spec and its bench case.

Each op's problem class (its spec's ``problem``, read through the bench case ``liger_gen.bench.ops.CASES``) says
how to make seeded inputs at a model's shapes and how to get the float64 truth of every output and gradient
(autograd of the float64 reference); the case says how to call liger-gen. From that alone, every op
here: matches float64 within the dtype's tolerance at one row and at odd
shapes in float32, bfloat16 and float16; takes non-contiguous inputs and an extra leading dim; handles zero rows
as PyTorch does; passes ``torch.library.opcheck`` on the custom-op calls it makes, and its custom-op node runs
its backward kernels as custom ops; compiles with ``fullgraph=True`` to the eager result; refuses double
backward; and, on a GPU, replays in a CUDA graph. The op test files keep what is specific to each op.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from liger_gen.bench.ops import CASES, Inputs
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.models import ModelShape
from liger_gen.ops import all_specs, available_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPS = list(available_ops())
# odd sizes everywhere: no dim is a power of two or a multiple of a tile
ODD = ModelShape("odd", hidden_size=72, intermediate_size=100, num_attention_heads=3, num_key_value_heads=1,
                 head_dim=16, vocab_size=97, rms_norm_eps=1e-6)
# ops whose inputs carry no leading rows dim to split: RoPE takes (batch, heads, seq, head_dim) already, and
# kl_div's "batchmean" divides by the leading dim, so splitting the rows changes the loss (as in PyTorch)
FP8_QUANTIZE = {"fp8_quantize", "fp8_cast_transpose"}
NO_LEADING_ROWS = {"rope", "kl_div", "moe_permute"} | FP8_QUANTIZE
# ops without a gradient (the FP8 quantizations, which take 2-D x only; the optimizer update, in place): no
# backward to check
DIFFERENTIABLE = [op for op in OPS if op not in FP8_QUANTIZE | {"adamw"}]
# ops whose tensors are flat (an optimizer update's parameter and state): their strided layout is a step-2 view
FLAT = {"adamw"}


def _inputs(op: str, rows: int, dtype: torch.dtype, device, seed: int = 0, model: ModelShape = ODD) -> Inputs:
    case = CASES[op]
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rows)
    return case.make(case.dims(model, rows), dtype, torch.device(device), gen, model)


def _run(op: str, inputs: Inputs, fn=None, transform=None):
    """(outputs, gradients) of the liger-gen provider (or ``fn``) on private leaves; ``transform`` maps the
    tensors before the call (a layout change that keeps the values)."""
    case = CASES[op]
    tensors = {n: t.detach().clone() for n, t in inputs.tensors.items()}
    if transform is not None:
        tensors = transform(tensors)
    leaves = [tensors[n].requires_grad_() for n in inputs.grad_of]
    outs = tuple((fn or case.liger_gen)(tensors, inputs.options))
    ups = [torch.ones_like(o) if inputs.upstream[n] is None else inputs.upstream[n].reshape(o.shape).to(o.dtype)
           for n, o in zip(case.outputs, outs)]
    grads = torch.autograd.grad(outs, leaves, ups) if leaves else ()
    return outs, grads


def _assert_matches(op: str, inputs: Inputs, outs, grads, dtype) -> None:
    case = CASES[op]
    ref = case.reference(inputs)
    tol = REL_TOL[dtype]
    names = list(case.outputs) + ["d" + n for n in inputs.grad_of]
    for name, got in zip(names, list(outs) + list(grads)):
        err = rel_l2(got.detach(), ref[name])
        assert err < tol, f"{op} {name}: relative L2 error {err:.3g} >= {tol:g} ({dtype})"


def test_every_op_has_a_spec_and_a_case():
    assert [s.name for s in all_specs()] == OPS and set(OPS) <= set(CASES)


@pytest.mark.parametrize("rows", [1, 7, 41])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_matches_float64(op, dtype, rows, device):
    inputs = _inputs(op, rows, dtype, device)
    for name, t in inputs.tensors.items():
        if name in ("target", "label") and not t.is_floating_point() and rows > 1:  # class indices: some rows ignored, whatever the seed drew
            t[::5] = -100
    outs, grads = _run(op, inputs)
    _assert_matches(op, inputs, outs, grads, dtype)


def _strided(t: torch.Tensor, flat: bool = False) -> torch.Tensor:
    """The same values in a non-contiguous layout: a column slice of a wider buffer (rows stride past the row);
    with ``flat``, 1-D tensors as every other element of a buffer twice as long."""
    if flat and t.is_floating_point() and t.dim() == 1 and t.numel() >= 2:
        view = torch.empty(2 * t.numel(), dtype=t.dtype, device=t.device)[::2]
        view.copy_(t)
        return view
    if not t.is_floating_point() or t.dim() < 2 or t.shape[-1] < 2:
        return t
    wide = torch.empty((*t.shape[:-1], t.shape[-1] + 5), dtype=t.dtype, device=t.device)
    view = wide[..., 2:2 + t.shape[-1]]
    view.copy_(t)
    return view


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_inputs(op, device):
    inputs = _inputs(op, 7, torch.float32, device, seed=1)
    strided = {n: _strided(t, op in FLAT) for n, t in inputs.tensors.items()}
    assert any(not t.is_contiguous() for t in strided.values())
    outs, grads = _run(op, inputs, transform=lambda ts: {n: _strided(t, op in FLAT) for n, t in ts.items()})
    _assert_matches(op, inputs, outs, grads, torch.float32)


@pytest.mark.parametrize("op", [op for op in OPS if op not in NO_LEADING_ROWS])
def test_a_leading_batch_dim(op, device):
    """(rows, ...) inputs given as (2, rows / 2, ...): the results are those of the 2-D call, reshaped."""
    rows = 6
    inputs = _inputs(op, rows, torch.float32, device, seed=2)

    def batched(ts):
        return {n: t.reshape(2, rows // 2, *t.shape[1:]) if t.dim() >= 1 and t.shape[0] == rows else t
                for n, t in ts.items()}

    outs, grads = _run(op, inputs, transform=batched)
    flat_outs = [o.reshape(rows, *o.shape[2:]) if o.dim() >= 2 and o.shape[:2] == (2, rows // 2) else o for o in outs]
    _assert_matches(op, inputs, flat_outs, grads, torch.float32)


@pytest.mark.parametrize("op", OPS)
def test_zero_rows_behave_as_pytorch(op, device):
    inputs = _inputs(op, 0, torch.float32, device)
    outs, grads = _run(op, inputs)
    ref_outs, ref_grads = _run(op, inputs, fn=CASES[op].eager)
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, equal_nan=True)


class _CustomOpCalls(TorchDispatchMode):
    """Records every liger_gen custom-op call (the op and its arguments) below autograd."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "liger_gen":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def through_custom_ops(monkeypatch):
    """Make every op take its custom op (as torch.compile's trace does) in an eager run."""
    import sys

    from liger_gen.runtime import ops as runtime_ops

    original = runtime_ops.use_custom_op
    for name, module in list(sys.modules.items()):
        if name.startswith("liger_gen") and getattr(module, "use_custom_op", None) is original:
            monkeypatch.setattr(module, "use_custom_op", lambda: True)


@pytest.mark.parametrize("op", OPS)
def test_custom_ops_pass_opcheck_and_run_their_backward_as_custom_ops(op, device, through_custom_ops):
    """The forward and backward of the custom-op path, recorded: every call is one of the spec's declared custom
    ops, a backward kernel runs as a custom op (not as a launch inside the autograd node, which torch.compile
    could not trace), and each recorded call passes opcheck's schema and fake-tensor checks."""
    spec = next(s for s in all_specs() if s.name == op)
    inputs = _inputs(op, 7, torch.float32, device, seed=3)
    with _CustomOpCalls() as rec:
        _run(op, inputs)
    names = [f"{func.namespace}::{func._opname}" for func, _, _ in rec.calls]
    assert set(names) <= set(spec.custom_ops) and names, names
    if op in DIFFERENTIABLE:
        assert len(set(names)) >= 2, f"{op}: the backward ran no custom op ({names})"
    for func, args, kwargs in rec.calls:
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(func, args, kwargs, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("op", OPS)
def test_compiles_without_graph_break_to_the_eager_result(op, device):
    case = CASES[op]
    inputs = _inputs(op, 7, torch.float32, device, seed=4)
    compiled = torch.compile(case.liger_gen, backend="aot_eager", fullgraph=True)
    outs, grads = _run(op, inputs, fn=compiled)
    ref_outs, ref_grads = _run(op, inputs)
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()


@pytest.mark.parametrize("binding", ["eager", "custom_op"])
@pytest.mark.parametrize("op", DIFFERENTIABLE)
def test_double_backward_is_refused(op, binding, device, request):
    """In both bindings: the custom op's node (what torch.jit.trace replays) must not return a first-order
    gradient that silently carries no graph."""
    if binding == "custom_op":
        request.getfixturevalue("through_custom_ops")
    case = CASES[op]
    inputs = _inputs(op, 5, torch.float32, device, seed=5)
    tensors = {n: t.detach().clone() for n, t in inputs.tensors.items()}
    leaves = [tensors[n].requires_grad_() for n in inputs.grad_of]
    loss = sum(o.float().square().sum() for o in case.liger_gen(tensors, inputs.options))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, leaves, create_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("op", DIFFERENTIABLE)
def test_forward_and_backward_replay_in_a_cuda_graph(op):
    """Captured once, replayed on new input values: the replay's results are the eager results for them."""
    case = CASES[op]
    first, second = (_inputs(op, 64, torch.bfloat16, "cuda", seed=s) for s in (6, 7))
    static = {n: t.detach().clone() for n, t in first.tensors.items()}
    leaves = {n: static[n].requires_grad_() for n in first.grad_of}

    def step():
        outs = tuple(case.liger_gen(static, first.options))
        loss = sum(o.float().sum() for o in outs)
        return outs, torch.autograd.grad(loss, list(leaves.values()))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # warm up: compile and pick every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_outs, g_grads = step()
    for n, t in second.tensors.items():
        static[n].detach().copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    ref_outs, ref_grads = _run(op, Inputs(second.tensors, second.grad_of,
                                          {n: None for n in case.outputs}, second.options))
    for got, want in zip(g_outs + g_grads, ref_outs + ref_grads):
        assert math.isclose(rel_l2(got, want.double()), 0.0, abs_tol=1e-6)
