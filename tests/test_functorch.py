"""torch.func transforms over the ops: grad, jacrev and vmap against float64 references.

``torch.func.grad`` (and ``vjp``, ``jacrev``, ``vmap``) must run the ops — one representative of every family on
the kernel path (Triton's interpreter here), the fused linear cross-entropy also on the plain CPU path — and a
model patched by ``liger_gen.apply_to`` through ``torch.func.functional_call``; what the kernels cannot do
(forward-mode AD, a second derivative) must raise a liger_gen error that names the op and what to use instead.
Inputs are fresh random tensors per case (``seeded``); results are compared with the float64 references of
``liger_gen.reference`` (differentiated by PyTorch's own transforms) at the per-dtype tolerances of the kernel
tests. Shapes are tiny: under the interpreter every launch costs milliseconds, and a jacobian by jacrev runs the
backward once per output element.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Callable

import pytest
import torch

import liger_gen
from liger_gen import functional as LF
from liger_gen import reference as R
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.ops.lm_head.post_training import dpo_loss
from conftest import seeded

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tests: the ops run in Triton's interpreter")

VOCAB, HIDDEN = 24, 16
# float32 outputs of fp32 kernels agree with float64 to a few fp32 roundoffs; the 16-bit tolerances are the
# kernel tests' (inputs are rounded to the dtype first, so the reference sees the same values)
TOL = {**REL_TOL, torch.float32: 2e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    """One op under the transforms: ``make(gen, dtype)`` gives the differentiable inputs (and the fixed ones it
    closes over), ``op`` the liger_gen call and ``ref`` the same function in plain PyTorch, run on float64;
    ``module``: the op module (its path below ``liger_gen.ops``) whose kernel lookups show that the kernels ran."""

    make: Callable
    op: Callable
    ref: Callable
    module: str


def _randn(gen, *shape):
    return torch.randn(shape, generator=gen)


def _norm_inputs(gen, dtype):
    return (_randn(gen, 3, HIDDEN).to(dtype), (1 + 0.2 * _randn(gen, HIDDEN)).to(dtype))


def _targets(gen, *shape):
    t = torch.randint(0, VOCAB, shape, generator=gen)
    t.view(-1)[0] = -100  # one ignored row
    return t


def _rope_tables(seq, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim))
    angles = torch.arange(seq).double()[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)[None]
    return emb.cos(), emb.sin()


COS, SIN = _rope_tables(4, 8)


def _rope_out(fn, q, k, dtype):
    q_out, k_out = fn(q, k, COS.to(dtype), SIN.to(dtype))
    return torch.cat([q_out.reshape(-1), k_out.reshape(-1)])


def _logp(gen, dtype, rows=3):
    return torch.log_softmax(_randn(gen, rows, VOCAB), -1).to(dtype)


def _lm_head(gen, dtype, *lead):
    return _randn(gen, *lead, HIDDEN).to(dtype), (0.3 * _randn(gen, VOCAB, HIDDEN)).to(dtype)


_T3 = torch.tensor([3, 7, -100, 11])  # fixed targets of the cross-entropy cases (one ignored row)
_T23 = torch.tensor([[5, 1, 9], [-100, 2, 20]])
_TEACHER = torch.log_softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5)), -1)
_DPO_TARGET = torch.tensor([[4, 8, -100], [1, 17, 3]])
_DPO_REF = torch.tensor([-9.0, -11.0])


def _dpo_ref(x, w, target=_DPO_TARGET):
    sums = R.selective_log_softmax_torch(x, w, target)[0].sum(-1)
    return dpo_loss(sums[:1], sums[1:], _DPO_REF[:1].to(sums), _DPO_REF[1:].to(sums), beta=0.1).mean()


CASES = {
    "rms_norm": Case(_norm_inputs, lambda x, w: LF.rms_norm(x, w, 1e-6),
                     lambda x, w: R.rms_norm_torch(x, w, 1e-6, 0.0, "llama"), "norms.rms_norm"),
    "fused_add_rms_norm": Case(
        lambda gen, dtype: (*_norm_inputs(gen, dtype), _randn(gen, 3, HIDDEN).to(dtype)),
        lambda x, w, r: torch.stack(LF.fused_add_rms_norm(x, r, w, 1e-6)),
        lambda x, w, r: torch.stack(R.fused_add_rms_norm_torch(x, r, w, 1e-6, 0.0, "llama")),
        "norms.fused_add_rms_norm"),
    "layer_norm": Case(lambda gen, dtype: (*_norm_inputs(gen, dtype), (0.1 * _randn(gen, HIDDEN)).to(dtype)),
                       lambda x, w, b: LF.layer_norm(x, w, b), lambda x, w, b: R.layer_norm_torch(x, w, b),
                       "norms.layer_norm"),
    "rope": Case(lambda gen, dtype: (_randn(gen, 1, 2, 4, 8).to(dtype), _randn(gen, 1, 1, 4, 8).to(dtype)),
                 lambda q, k: _rope_out(LF.rope, q, k, q.dtype), lambda q, k: _rope_out(R.rope_torch, q, k, q.dtype),
                 "rope"),
    "swiglu": Case(lambda gen, dtype: (_randn(gen, 3, HIDDEN).to(dtype), _randn(gen, 3, HIDDEN).to(dtype)),
                   LF.swiglu, R.swiglu_torch, "glu.glu"),
    "geglu": Case(lambda gen, dtype: (_randn(gen, 3, HIDDEN).to(dtype), _randn(gen, 3, HIDDEN).to(dtype)),
                  LF.geglu, R.geglu_torch, "glu.glu"),
    "cross_entropy": Case(lambda gen, dtype: (_randn(gen, 4, VOCAB).to(dtype),),
                          lambda z: LF.cross_entropy(z, _T3), lambda z: R.cross_entropy_torch(z, _T3),
                          "lm_head.cross_entropy"),
    "fused_linear_cross_entropy": Case(
        lambda gen, dtype: _lm_head(gen, dtype, 4),
        lambda x, w: LF.fused_linear_cross_entropy(x, w, _T3),
        lambda x, w: R.fused_linear_cross_entropy_torch(x, w, _T3), "lm_head.chunks"),
    "kl_div": Case(lambda gen, dtype: (_logp(gen, dtype), _logp(gen, dtype)),
                   lambda x, t: LF.kl_div(x, t, "batchmean", log_target=True),
                   lambda x, t: R.kl_div_torch(x, t, "batchmean", log_target=True), "divergence.kl_div"),
    "jsd": Case(lambda gen, dtype: (_logp(gen, dtype),),
                lambda s: LF.jsd(s, _TEACHER.to(s.dtype), beta=0.3),
                lambda s: R.jsd_torch(s, _TEACHER.to(s.dtype), beta=0.3), "divergence.jsd"),
    "selective_log_softmax": Case(
        lambda gen, dtype: _lm_head(gen, dtype, 2, 3),
        lambda x, w: LF.selective_log_softmax(x, w, _T23),
        lambda x, w: R.selective_log_softmax_torch(x, w, _T23)[0], "lm_head.chunks"),
    "fused_linear_dpo": Case(
        lambda gen, dtype: _lm_head(gen, dtype, 2, 3),
        lambda x, w: LF.fused_linear_dpo(x, w, _DPO_TARGET, ref_log_probs=_DPO_REF).loss,
        _dpo_ref, "lm_head.chunks"),
}


@pytest.fixture
def kernel_lookups(monkeypatch):
    """``kernel_lookups(name)``: a list that records the kernel lookups of case ``name``'s op module, i.e. that
    its Triton kernels ran (the plain CPU path looks up none)."""

    def spy(name):
        module = importlib.import_module(f"liger_gen.ops.{CASES[name].module}")
        calls, lookup = [], module.kernel_module
        monkeypatch.setattr(module, "kernel_module", lambda *a, **k: calls.append(a[0].__name__) or lookup(*a, **k))
        return calls

    return spy


def _inputs(name: str, dtype: torch.dtype, *key):
    return CASES[name].make(seeded(name, str(dtype), *key), dtype)


def _probe(out: torch.Tensor, name: str) -> torch.Tensor:
    """Fixed weights that turn an output into a scalar whose gradient reaches every element."""
    return torch.randn(out.shape, generator=seeded("probe", name), dtype=torch.float64)


def _scalar(fn: Callable, probe: torch.Tensor) -> Callable:
    return lambda *args: (fn(*args).double() * probe).sum()


def _ref64(name: str, args):
    return CASES[name].ref(*(a.double() for a in args))


def _assert_close(actual, expected, dtype, what):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert rel_l2(actual, expected) < TOL[dtype], (what, rel_l2(actual, expected))


# ------------------------------------------------------------------------------------------------ grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_matches_float64(name, dtype, kernel_lookups):
    """torch.func.grad of every argument, and the value beside it (grad_and_value), on the kernel path."""
    args = _inputs(name, dtype)
    probe = _probe(_ref64(name, args), name)
    argnums = tuple(range(len(args)))
    lookups = kernel_lookups(name)
    grads, value = torch.func.grad_and_value(_scalar(CASES[name].op, probe), argnums=argnums)(*args)
    assert lookups, "the Triton kernels did not run"
    grads64, value64 = torch.func.grad_and_value(_scalar(CASES[name].ref, probe), argnums=argnums)(
        *(a.double() for a in args))
    _assert_close(value, value64, dtype, "value")
    for i, (g, g64) in enumerate(zip(grads, grads64)):
        assert g.dtype == args[i].dtype, (i, g.dtype)
        _assert_close(g, g64, dtype, f"grad of argument {i}")


@pytest.mark.parametrize("name", ["rms_norm", "cross_entropy", "fused_linear_cross_entropy"])
def test_vjp_function_called_twice(name):
    """torch.func.vjp's function runs after the transform has returned, and may run again: the gradients the
    forward computed (cross-entropy, the fused loss) are not consumed in place."""
    dtype = torch.float32
    args = _inputs(name, dtype, "vjp")
    out, vjp_fn = torch.func.vjp(CASES[name].op, *args)
    cotangent = torch.randn(out.shape, generator=seeded("vjp", name)).to(out.dtype)
    first, second = vjp_fn(cotangent), vjp_fn(cotangent)
    _, vjp64 = torch.func.vjp(CASES[name].ref, *(a.double() for a in args))
    for g1, g2, g64 in zip(first, second, vjp64(cotangent.double())):
        _assert_close(g1, g64, dtype, "vjp")
        assert torch.equal(g1, g2)


# ------------------------------------------------------------------------------------------------ jacrev


@pytest.mark.parametrize("name", sorted(CASES))
def test_jacrev_matches_float64(name, kernel_lookups):
    """The full jacobian of the output in the first argument: jacrev runs the backward under vmap, one basis
    vector per output element."""
    dtype = torch.float32
    args = _inputs(name, dtype, "jacrev")
    rest = args[1:]
    lookups = kernel_lookups(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "performance drop" fallback warnings from PyTorch for our ops
        jac = torch.func.jacrev(lambda a: CASES[name].op(a, *rest))(args[0])
    assert lookups, "the Triton kernels did not run"
    jac64 = torch.func.jacrev(lambda a: CASES[name].ref(a, *(r.double() for r in rest)))(args[0].double())
    _assert_close(jac, jac64, dtype, "jacobian")


# ------------------------------------------------------------------------------------------------ vmap


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_matches_float64(name, kernel_lookups):
    """vmap over a batch of two inputs of each argument (the ops run once per batch element)."""
    dtype = torch.float32
    batches = [_inputs(name, dtype, "vmap", i) for i in range(2)]
    args = tuple(torch.stack(parts) for parts in zip(*batches))
    lookups = kernel_lookups(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.func.vmap(CASES[name].op)(*args)
    assert lookups, "the Triton kernels did not run"
    expected = torch.stack([_ref64(name, b) for b in batches])
    _assert_close(out, expected, dtype, "vmapped output")


@pytest.mark.parametrize("name", ["rms_norm", "fused_linear_cross_entropy", "rope"])
def test_per_sample_grads_vmap_of_grad(name):
    """vmap(grad(f)): the per-sample gradients of the usual torch.func recipe."""
    dtype = torch.float32
    batches = [_inputs(name, dtype, "per-sample", i) for i in range(2)]
    args = tuple(torch.stack(parts) for parts in zip(*batches))
    probe = _probe(_ref64(name, batches[0]), name)
    grads = torch.func.vmap(torch.func.grad(_scalar(CASES[name].op, probe)))(*args)
    for i, b in enumerate(batches):
        g64 = torch.func.grad(_scalar(CASES[name].ref, probe))(*(a.double() for a in b))
        _assert_close(grads[i], g64, dtype, f"per-sample grad {i}")


# the losses with the targets as an argument: (liger_gen, reference, the targets' shape)
TARGETED = {
    "fused_linear_cross_entropy": (lambda x, w, t: LF.fused_linear_cross_entropy(x, w, t),
                                   R.fused_linear_cross_entropy_torch, (4,)),
    "fused_linear_dpo": (lambda x, w, t: LF.fused_linear_dpo(x, w, t, ref_log_probs=_DPO_REF).loss, _dpo_ref, (2, 3)),
}


@pytest.mark.parametrize("name", sorted(TARGETED))
def test_per_sample_grads_with_per_sample_targets(name):
    """vmap(grad(loss))(x, w, target) with every argument batched, the targets too: the targets' range checks
    run inside the op, per element (a host check of batched values would be a data-dependent branch)."""
    op, ref, target_shape = TARGETED[name]
    dtype = torch.float32
    batches = [(*_inputs(name, dtype, "targets", i), _targets(seeded(name, "targets", i), *target_shape))
               for i in range(2)]
    args = tuple(torch.stack(parts) for parts in zip(*batches))
    grads = torch.func.vmap(torch.func.grad(op, argnums=(0, 1)))(*args)
    for i, (x, w, t) in enumerate(batches):
        g64 = torch.func.grad(ref, argnums=(0, 1))(x.double(), w.double(), t)
        for j in range(2):
            _assert_close(grads[j][i], g64[j], dtype, f"per-sample grad {i} of argument {j}")
    bad = args[2].clone()
    bad.view(-1)[-1] = VOCAB  # out of range in the second element only
    with pytest.raises(ValueError, match=f"holds class indices outside \\[0, {VOCAB}\\)"):
        torch.func.vmap(torch.func.grad(op, argnums=(0, 1)))(args[0], args[1], bad)


def test_grad_of_vmap():
    """grad of a loss summed over a vmapped op (the per-sample calls are differentiated one by one)."""
    dtype = torch.float32
    x, w = _inputs("rms_norm", dtype, "grad-of-vmap")
    xb = torch.stack([x, x.flip(0)])
    fn = lambda w, op: (torch.func.vmap(op, in_dims=(0, None))(xb, w).double() ** 2).sum()
    g = torch.func.grad(fn)(w, CASES["rms_norm"].op)
    g64 = torch.func.grad(fn)(w.double(), CASES["rms_norm"].ref)
    _assert_close(g, g64, dtype, "grad of the weight")


# ------------------------------------------------------------------------------------------------ plain path


def test_fused_linear_cross_entropy_plain_path(monkeypatch):
    """The plain CPU path (no interpreter) chunks the LM head in its own autograd node: grad, jacrev and vmap."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    name, dtype = "fused_linear_cross_entropy", torch.float32
    x, w = _inputs(name, dtype, "plain")
    grads = torch.func.grad(CASES[name].op, argnums=(0, 1))(x, w)
    grads64 = torch.func.grad(CASES[name].ref, argnums=(0, 1))(x.double(), w.double())
    for g, g64 in zip(grads, grads64):
        _assert_close(g, g64, dtype, "grad")
    jac = torch.func.jacrev(CASES[name].op)(x, w)
    _assert_close(jac, grads64[0], dtype, "jacrev")
    xs = torch.stack([x, x.flip(0)])
    out = torch.func.vmap(CASES[name].op, in_dims=(0, None))(xs, w)
    _assert_close(out, torch.stack([_ref64(name, (x, w)), _ref64(name, (x.flip(0), w))]), dtype, "vmap")


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_is_refused_by_name(transform):
    x, w = _inputs("rms_norm", torch.float32)
    f = lambda x: LF.rms_norm(x, w)
    with pytest.raises(RuntimeError, match=r"liger_gen rms_norm: .*forward-mode.*liger_gen\.reference\.rms_norm_torch"):
        if transform == "jvp":
            torch.func.jvp(f, (x,), (torch.ones_like(x),))
        else:
            torch.func.jacfwd(f)(x)


def test_second_derivative_is_refused_by_name():
    x, w = _inputs("swiglu", torch.float32)
    f = lambda x: LF.swiglu(x, w).sum()
    with pytest.raises(RuntimeError, match=r"liger_gen glu: .*second derivative.*liger_gen\.reference\.glu_torch"):
        torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x)


def test_vmap_over_an_empty_batch_is_refused_by_name():
    x, w = _inputs("rms_norm", torch.float32)
    with pytest.raises(ValueError, match=r"liger_gen rms_norm: torch\.func\.vmap over an empty batch.*\(0, 3, 16\)"):
        torch.func.vmap(lambda x: LF.rms_norm(x, w))(torch.empty(0, 3, HIDDEN))


def test_eager_paths_unchanged_after_a_transform():
    """A transform leaves nothing behind: the planned eager path and the in-place GLU backward still run."""
    x, w = _inputs("rms_norm", torch.float32)
    torch.func.grad(lambda x: LF.rms_norm(x, w).sum())(x)
    xe = x.clone().requires_grad_()
    y = LF.rms_norm(xe, w)
    assert type(y.grad_fn).__name__ == "_PlannedBackward"  # the eager call shape's plan
    y.sum().backward()
    g = torch.func.grad(lambda x: LF.rms_norm(x, w).sum())(x)
    _assert_close(xe.grad, g, torch.float32, "eager grad")


# ------------------------------------------------------------------------------------------------ models


def test_patched_model_through_functional_call(kernel_lookups):
    """A mini Llama patched by apply_to: torch.func.grad of its loss through functional_call (GLUMLP, the norms
    and the fused add, RoPE, the fused loss) equals the unpatched model's gradients."""
    pytest.importorskip("transformers")
    from liger_gen.integrations.transformers import restore_rope
    from mini_models import mini_model

    plain = mini_model("llama", num_hidden_layers=1)
    patched = mini_model("llama", num_hidden_layers=1)
    gen = seeded("functional_call")
    ids = torch.randint(3, 200, (1, 6), generator=gen)
    plain(input_ids=ids, labels=ids).loss.backward()
    expected = {n: p.grad for n, p in plain.named_parameters()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            liger_gen.apply_to(patched)
        params = {n: p.detach() for n, p in patched.named_parameters()}
        lookups = {name: kernel_lookups(name) for name in ("rms_norm", "fused_add_rms_norm", "rope", "swiglu",
                                                            "fused_linear_cross_entropy")}

        def loss(params):
            return torch.func.functional_call(patched, params, (), {"input_ids": ids, "labels": ids}).loss

        grads = torch.func.grad(loss)(params)
        assert all(lookups.values()), {name: len(calls) for name, calls in lookups.items()}
        # and eager training of the same model still works after the transform (the plans, GLUMLP in place)
        patched(input_ids=ids, labels=ids).loss.backward()
    finally:
        restore_rope()
    report = patched.liger_gen_report
    assert report.norms and report.mlps and report.loss, report.summary()
    for n, g in grads.items():
        assert rel_l2(g, expected[n]) < 1e-4, (n, rel_l2(g, expected[n]))
        assert rel_l2(dict(patched.named_parameters())[n].grad, expected[n]) < 1e-4, n
