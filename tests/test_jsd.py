"""Generalised JSD kernels (Triton interpreter on the CPU) against float64, and the op's API around them."""

import dataclasses
import math

import optuna
import pytest
import torch
import torch.nn.functional as F

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import REL_TOL, rel_l2
from liger_gen.tuning.search import Tuner
from liger_gen.models import ModelShape
from liger_gen.ops.divergence.jsd import JSDProblem, JSDSpace, jsd, jsd_float64, jsd_torch, tuning_problems
from liger_gen.ops.divergence.rows import DivergenceConfig

from conftest import seeded
from helpers import assert_passes_the_gate, assert_trains_past_an_inference_mode_target, valid_heuristics

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BETAS = [0.0, 0.3, 0.5, 1.0]


def _log_probs(shape, gen, scale=2.0):
    return torch.randn(shape, generator=gen).mul(scale).log_softmax(-1)


def _labels(leading, vocab, gen, ignored=(), ignore_index=-100):
    label = torch.randint(0, vocab, leading, generator=gen)
    flat = label.view(-1)
    for i in ignored:
        flat[i] = ignore_index
    return label


def _assert_matches_float64(s, t, beta, ignore_index=-100, label=None, grad_scale=0.7):
    s = s.detach().requires_grad_()
    loss = jsd(s, t, beta, ignore_index, label)
    g = torch.tensor(grad_scale, dtype=s.dtype, device=s.device)
    loss.backward(g)
    s64 = s.detach().double().requires_grad_()
    ref = jsd_float64(s64, t.double(), beta, ignore_index, label)
    ref.backward(g.double())
    assert loss.shape == () and loss.dtype == s.dtype
    assert rel_l2(loss, ref) < REL_TOL[s.dtype], "loss"
    assert s.grad.dtype == s.dtype and s.grad.shape == s.shape
    assert rel_l2(s.grad, s64.grad) < REL_TOL[s.dtype], "d student"
    return loss, s.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("with_label", [False, True])
@pytest.mark.parametrize("shape", [(1, 300), (2, 3, 77)])
def test_kernel_matches_float64(shape, with_label, beta, dtype, device):
    gen = seeded(shape, with_label, beta, str(dtype))
    s = _log_probs(shape, gen).to(device, dtype)
    t = _log_probs(shape, gen).to(device, dtype)
    rows = math.prod(shape[:-1])
    label = _labels(shape[:-1], shape[-1], gen, ignored=[i for i in (1, 4) if i < rows]) if with_label else None
    _assert_matches_float64(s, t, beta, label=None if label is None else label.to(device))


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_long_rows_many_chunks(beta, device):
    gen = torch.Generator().manual_seed(2)
    s, t = _log_probs((5, 2500), gen).to(device), _log_probs((5, 2500), gen).to(device)
    _assert_matches_float64(s, t, beta, label=_labels((5,), 2500, gen, ignored=(2,)).to(device))


def test_endpoints_are_forward_and_reverse_kl(device):
    """beta = 0 is KL(teacher ‖ student), beta = 1 is KL(student ‖ teacher), each summed over the vocab and
    averaged over rows — torch's kl_div with log_target and 'batchmean' on (rows, vocab)."""
    gen = torch.Generator().manual_seed(3)
    s64, t64 = _log_probs((6, 90), gen).double(), _log_probs((6, 90), gen).double()
    forward_kl = F.kl_div(s64, t64, reduction="batchmean", log_target=True)
    reverse_kl = F.kl_div(t64, s64, reduction="batchmean", log_target=True)
    torch.testing.assert_close(jsd_float64(s64, t64, 0.0), forward_kl)
    torch.testing.assert_close(jsd_float64(s64, t64, 1.0), reverse_kl)
    assert rel_l2(jsd(s64.float().to(device), t64.float().to(device), 0.0), forward_kl) < 1e-5
    assert rel_l2(jsd(s64.float().to(device), t64.float().to(device), 1.0), reverse_kl) < 1e-5


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_mixture_is_weighted_kl_to_the_mixture(beta, device):
    """0 < beta < 1: beta·KL(P ‖ M) + (1 − beta)·KL(Q ‖ M) with M = beta·P + (1 − beta)·Q, via F.kl_div."""
    gen = torch.Generator().manual_seed(4)
    s64, t64 = _log_probs((5, 64), gen).double(), _log_probs((5, 64), gen).double()
    log_m = torch.logsumexp(torch.stack([t64 + math.log(beta), s64 + math.log(1 - beta)]), dim=0)
    expected = (beta * F.kl_div(log_m, t64, reduction="batchmean", log_target=True)
                + (1 - beta) * F.kl_div(log_m, s64, reduction="batchmean", log_target=True))
    torch.testing.assert_close(jsd_float64(s64, t64, beta), expected)
    assert rel_l2(jsd(s64.float().to(device), t64.float().to(device), beta), expected) < 1e-5
    # small beta: JSD_beta / beta tends to the forward KL
    small = jsd_float64(s64, t64, 1e-6) / 1e-6
    assert rel_l2(small, F.kl_div(s64, t64, reduction="batchmean", log_target=True)) < 1e-4


def test_ignored_rows_are_neither_read_nor_counted(device):
    gen = torch.Generator().manual_seed(5)
    s, t = _log_probs((7, 50), gen).to(device), _log_probs((7, 50), gen).to(device)
    label = _labels((7,), 50, gen, ignored=(0, 3, 6), ignore_index=7).to(device)
    loss, grad = _assert_matches_float64(s, t, 0.5, ignore_index=7, label=label)
    valid = label != 7
    assert torch.equal(grad[~valid], torch.zeros_like(grad[~valid]))
    # garbage (NaN) in ignored rows changes nothing; the loss is the mean over the 4 valid rows
    s2, t2 = s.clone(), t.clone()
    s2[~valid] = float("nan")
    t2[~valid] = float("nan")
    torch.testing.assert_close(jsd(s2, t2, 0.5, 7, label), loss.detach())
    torch.testing.assert_close(loss.detach(), jsd(s[valid], t[valid], 0.5))


def test_no_label_equals_all_rows_valid_and_all_ignored_gives_zero(device):
    gen = torch.Generator().manual_seed(6)
    s, t = _log_probs((4, 33), gen).to(device), _log_probs((4, 33), gen).to(device)
    all_valid = torch.zeros(4, dtype=torch.int64, device=device)
    torch.testing.assert_close(jsd(s, t, 0.3), jsd(s, t, 0.3, label=all_valid))
    s = s.requires_grad_()
    loss = jsd(s, t, 0.3, label=torch.full((4,), -100, device=device))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(s.grad, torch.zeros_like(s))


@pytest.mark.parametrize("beta", BETAS)
def test_zero_probabilities_give_finite_results(beta, device):
    """Masked vocab entries (−inf log-probabilities) in the teacher, the student or both contribute 0."""
    gen = torch.Generator().manual_seed(7)
    logits_s, logits_t = torch.randn(4, 40, generator=gen), torch.randn(4, 40, generator=gen)
    logits_t[:, :5] = float("-inf")          # the teacher masks 5 entries
    if beta == 1.0:
        logits_s[:, :8] = float("-inf")      # reverse KL is finite when the student's support is in the teacher's
    else:
        logits_s[:, 3:5] = float("-inf")     # forward KL when the teacher's is in the student's;
    if 0.0 < beta < 1.0:
        logits_s[:, 10] = float("-inf")      # the mixture is finite either way
    s, t = logits_s.log_softmax(-1).to(device), logits_t.log_softmax(-1).to(device)
    loss, grad = _assert_matches_float64(s, t, beta)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_near_identical_distributions_in_fp32(device):
    """Late in distillation student ≈ teacher and the JSD is small (~1e-5 per row here, from 1e-2 logit noise):
    each element's two terms cancel to first order, so fp32 resolves the loss to ~1e-3 relative (measured over
    8 seeds: 7e-6 .. 5e-3, as the fp32 logaddexp formula: 1.4e-3 .. 4.5e-3) and the gradient to ~3e-5."""
    gen = torch.Generator().manual_seed(8)
    t = _log_probs((4, 1000), gen, scale=4.0)
    s = (t + 1e-2 * torch.randn(4, 1000, generator=gen)).log_softmax(-1)
    s1 = s.to(device).clone().requires_grad_()
    loss = jsd(s1, t.to(device), 0.3)
    loss.backward()
    s64 = s.double().requires_grad_()
    ref = jsd_float64(s64, t, 0.3)
    ref.backward()
    assert ref < 1e-4
    assert rel_l2(loss, ref) < 1e-2
    assert rel_l2(s1.grad, s64.grad) < 2e-4


@pytest.mark.parametrize("make_view", [
    lambda x: x.t(),                      # transposed: the vocab dim has stride != 1
    lambda x: x[:, 3:67],                 # sliced columns: unit stride, row stride 80
    lambda x: x[::2],                     # every other row
])
def test_non_contiguous_inputs(make_view, device):
    gen = torch.Generator().manual_seed(9)
    s_view, t_view = make_view(torch.empty(80, 80)), make_view(torch.empty(80, 80))
    s_view.copy_(_log_probs(s_view.shape, gen))  # log-probabilities along the view's own last dim
    t_view.copy_(_log_probs(t_view.shape, gen))
    assert not s_view.is_contiguous() and not t_view.is_contiguous()
    label = torch.randint(0, 80, (2 * s_view.shape[0],), generator=gen)[::2]  # strided labels
    label[1] = -100
    for beta in (0.0, 0.5, 1.0):
        _assert_matches_float64(s_view.to(device), t_view.to(device), beta, label=label.to(device))


def test_mixed_dtypes(device):
    gen = torch.Generator().manual_seed(10)
    s = _log_probs((4, 100), gen).to(device, torch.bfloat16)
    t = _log_probs((4, 100), gen).to(device, torch.float32)
    _assert_matches_float64(s, t, 0.5, label=torch.tensor([1, -100, 2, 3], device=device))


def test_cpu_path_is_the_torch_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(11)
    s, t = _log_probs((3, 4, 30), gen), _log_probs((3, 4, 30), gen)
    label = _labels((3, 4), 30, gen, ignored=(2, 5))
    for beta in BETAS:
        s1 = s.clone().requires_grad_()
        loss = jsd(s1, t, beta, label=label)
        s2 = s.clone().requires_grad_()
        ref = jsd_torch(s2, t, beta, label=label)
        assert torch.equal(loss, ref)
        loss.backward()
        s64 = s.double().requires_grad_()
        jsd_float64(s64, t, beta, label=label).backward()
        assert rel_l2(s1.grad, s64.grad) < 1e-5
    torch.testing.assert_close(jsd(s.double(), t.double(), 0.5), jsd_float64(s, t, 0.5), rtol=1e-12, atol=0)


@pytest.mark.parametrize("shape", [(0, 16), (3, 0), (2, 0, 5)])
def test_empty_inputs_give_zero(shape, device):
    s = torch.randn(shape, device=device, requires_grad=True)
    t = torch.randn(shape, device=device)
    label = torch.zeros(shape[:-1], dtype=torch.int64, device=device)
    for lab in (None, label):
        loss = jsd(s, t, 0.5, label=lab)
        assert loss.shape == () and loss.item() == 0.0
        loss.backward()
        assert s.grad.shape == s.shape


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(s=torch.zeros(4, 8), t=torch.zeros(4, 7)), ValueError, ["student_logp", "(4, 8)", "teacher_logp", "(4, 7)"]),
    (dict(s=torch.zeros(4, 8, dtype=torch.int64), t=torch.zeros(4, 8)), TypeError, ["student_logp", "torch.int64"]),
    (dict(s=torch.zeros(4, 8, dtype=torch.float64), t=torch.zeros(4, 8, dtype=torch.float64)), TypeError,
     ["float64", "(4, 8)"]),
    (dict(s=torch.zeros(()), t=torch.zeros(())), ValueError, ["vocab dim", "student_logp of shape ()"]),
    (dict(label=torch.zeros(5, dtype=torch.int64)), ValueError, ["label", "(5,)", "(4,)"]),
    (dict(label=torch.zeros(4)), TypeError, ["label", "integer", "torch.float32"]),
    (dict(beta=-0.1), ValueError, ["beta", "[0, 1]", "-0.1"]),
    (dict(beta=1.5), ValueError, ["beta", "1.5"]),
    (dict(beta=float("nan")), ValueError, ["beta", "nan"]),
    (dict(beta="0.5"), TypeError, ["beta"]),
    (dict(ignore_index=-100.0), TypeError, ["ignore_index", "float"]),
    (dict(t=torch.zeros(4, 8, requires_grad=True)), ValueError, ["teacher_logp", "requires grad", "detach"]),
])
def test_bad_input_names_tensor_shape_dtype(kwargs, exc, words, device):
    args = {"s": torch.zeros(4, 8), "t": torch.zeros(4, 8), "beta": 0.5, "ignore_index": -100, "label": None}
    args.update(kwargs)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(exc) as info:
        jsd(args["s"], args["t"], args["beta"], args["ignore_index"], args["label"])
    for word in words:
        assert word in str(info.value)


def test_teacher_with_grad_is_fine_when_autograd_is_off(device):
    t = torch.zeros(2, 8, device=device, requires_grad=True)
    with torch.no_grad():
        assert jsd(torch.zeros(2, 8, device=device), t).item() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensors_on_different_devices():
    with pytest.raises(ValueError, match="one device"):
        jsd(torch.zeros(2, 4, device="cuda"), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="label of shape"):
        jsd(torch.zeros(2, 4, device="cuda"), torch.zeros(2, 4, device="cuda"), label=torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("with_label", [False, True])
def test_torch_compile_has_no_graph_break(with_label, device):
    gen = torch.Generator().manual_seed(12)
    s, t = _log_probs((6, 90), gen).to(device), _log_probs((6, 90), gen).to(device)
    label = torch.tensor([1, -100, 2, 3, -100, 5], device=device) if with_label else None

    def f(s, t, label):
        return jsd(s, t, 0.4, -100, label) * 3

    s1 = s.clone().requires_grad_()
    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(s1, t, label)
    loss.backward()
    s2 = s.clone().requires_grad_()
    ref = f(s2, t, label)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(s1.grad, s2.grad)


def test_opcheck_custom_ops(device):
    gen = torch.Generator().manual_seed(13)
    s, t = _log_probs((5, 40), gen).to(device), _log_probs((5, 40), gen).to(device)
    label = torch.tensor([0, -100, 3, 4, 1], device=device)
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.liger_gen.jsd_fwd.default, (s, t, label, 0.5, -100), test_utils=utils)
    torch.library.opcheck(torch.ops.liger_gen.jsd_fwd.default, (s, t, None, 0.0, -100), test_utils=utils)
    g, n_valid = torch.tensor(1.5, device=device), torch.tensor(4.0, device=device)
    torch.library.opcheck(torch.ops.liger_gen.jsd_bwd.default, (g, n_valid, s, t, label, 0.5, -100),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.liger_gen.jsd_bwd.default, (g, n_valid, s, t, None, 1.0, -100),
                          test_utils=utils)


def test_inference_mode_teacher_with_trained_student(device):
    assert_trains_past_an_inference_mode_target(jsd, jsd_float64,
                                                lambda: torch.randn(4, 30, device=device).log_softmax(-1), device)


# ------------------------------------------------------------------------------------------------ space/tuning


@pytest.mark.parametrize("dtype", DTYPES)
def test_heuristic_valid_for_every_vocab(dtype):
    vocabs = list(range(1, 200)) + [2**k + d for k in range(9, 19) for d in (-1, 0, 1)] + [128256, 152064]
    list(valid_heuristics(JSDSpace, vocabs, dtype))


def test_space_and_template_are_jsd_own():
    space = JSDSpace(128256, torch.bfloat16)
    assert space.op == "jsd" and space.template == "jsd" and space.config_cls is DivergenceConfig
    # two streams in the backward (student, teacher), counted at 4 bytes: one buffered 2 x 8192 chunk of each
    # fits in 227 KiB, two do not
    config = dataclasses.replace(space.heuristic(), BLOCK_V_BWD=8192, BLOCK_M_BWD=2, num_warps_bwd=16,
                                 num_stages_bwd=2)
    assert not space.violations(config)
    assert any("shared memory" in p for p in space.violations(dataclasses.replace(config, num_stages_bwd=3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta,with_label", [(0.5, True), (0.0, True), (1.0, False), (0.2, False)])
@pytest.mark.parametrize("changes", [
    {},
    {"BLOCK_V_FWD": 64, "BLOCK_M_FWD": 4, "num_warps_fwd": 2, "num_stages_fwd": 2,
     "BLOCK_V_BWD": 128, "BLOCK_M_BWD": 2, "num_warps_bwd": 1, "num_stages_bwd": 3},
])
def test_every_template_branch_passes_the_tuners_gate(changes, beta, with_label, dtype, device):
    """The tuner's float64 gate (NaN-poisoned outputs, per-dtype tolerance) on each kernel branch."""
    problem = JSDProblem(dtype, 333, 13, device, beta=beta, with_label=with_label, ignore_fraction=0.3, seed=5)
    assert_passes_the_gate(problem, changes)


def test_float64_reference_is_the_same_in_row_chunks(monkeypatch, device):
    """Tuning problems build their float64 truth chunk by chunk (memory); chunks must not change it."""
    import liger_gen.ops.divergence.jsd as jsd_module

    whole = JSDProblem(torch.float32, 50, 11, device, ignore_fraction=0.3, seed=3)
    monkeypatch.setattr(jsd_module, "chunk_rows", lambda vocab: 4)
    chunked = JSDProblem(torch.float32, 50, 11, device, ignore_fraction=0.3, seed=3)
    assert torch.equal(chunked.buffers["label"], whole.buffers["label"])
    for name in ("loss", "n_valid", "ds"):
        torch.testing.assert_close(chunked.ref[name], whole.ref[name])
    s64 = chunked.buffers["s"].double().requires_grad_()
    ref = jsd_float64(s64, chunked.buffers["t"], 0.5, -100, chunked.buffers["label"])
    (ref * chunked.buffers["g"].double()).backward()
    torch.testing.assert_close(chunked.ref["loss"], ref.detach())
    torch.testing.assert_close(chunked.ref["ds"], s64.grad)


def test_gate_rejects_a_wrong_kernel(device):
    problem = JSDProblem(torch.float32, 200, 6, device, seed=2)
    module = load_variant("jsd", problem.template_params(problem.space.heuristic()))

    class Wrong:  # a kernel that drops the (1 − beta) weight of the gradient
        def backward(self, g, n_valid, s, t, label, ds, mode, beta, ignore_index):
            module.backward(g, n_valid, s, t, label, ds, mode, beta, ignore_index)
            ds.div_(1 - beta)

    assert "relative L2 error" in problem.check(Wrong(), "bwd")


def test_tuner_produces_a_valid_entry(device):
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def cost(launch, params):  # deterministic 'time': favours 256-wide chunks and 4 rows per program
        return (1.0 + abs(params["BLOCK_V_FWD"].bit_length() - 9) + abs(params["BLOCK_M_BWD"] - 4)
                + 0.1 * params["num_stages_fwd"] + 0.1 * params["num_warps_bwd"])

    problem = JSDProblem(torch.bfloat16, 500, 8, device, seed=1)
    entry = Tuner(n_trials=4, timer=cost, seed=0, retime_rounds=1).tune(problem)
    assert not problem.space.violations(DivergenceConfig.from_dict(entry["config"]))
    assert entry["dims"] == {"vocab": 500} and entry["dtype"] == "bfloat16"
    for phase in ("fwd", "bwd"):
        assert entry["timing_ms"][phase]["tuned"] <= entry["timing_ms"][phase]["heuristic"]
        assert entry["bytes"][phase] > 0


def test_tuning_problems_use_capped_rows():
    model = ModelShape("tiny", 64, 128, 4, 2, 16, 250, 1e-6)
    problems = tuning_problems(model, [3, 17], torch.float32, "cpu")
    assert [(p.rows, p.dims["vocab"], p.beta) for p in problems] == [(3, 250, 0.5), (17, 250, 0.5)]


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.5, 0.0, 1.0])
def test_llama3_vocab_bf16_against_chunked_float64(beta):
    """8192 tokens x 128256 vocab in bf16 (2^30 elements), labels with ignored rows: loss and d/dstudent vs
    float64, chunk by chunk."""
    rows, vocab, dtype = 8192, 128256, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(rows, vocab, device="cuda", generator=gen).mul_(2).log_softmax(-1).to(dtype).requires_grad_()
    t = torch.randn(rows, vocab, device="cuda", generator=gen).mul_(2).log_softmax(-1).to(dtype)
    label = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    label[torch.rand(rows, device="cuda", generator=gen) < 0.1] = -100
    loss = jsd(s, t, beta, -100, label)
    g = torch.tensor(0.75, device="cuda", dtype=dtype)
    loss.backward(g)
    valid = label != -100
    n_valid = valid.sum().double()
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    err2 = norm2 = 0.0
    for lo in range(0, rows, 512):
        s64 = s[lo:lo + 512].detach().double().requires_grad_()
        part = jsd_float64(s64, t[lo:lo + 512], beta, -100, label[lo:lo + 512]) * valid[lo:lo + 512].sum().clamp_min(1)
        total += part.detach()
        (part * (g.double() / n_valid)).backward()
        err2 += (s.grad[lo:lo + 512].double() - s64.grad).square().sum().item()
        norm2 += s64.grad.square().sum().item()
    tol = REL_TOL[dtype]
    assert rel_l2(loss, total / n_valid) < tol
    assert (err2 / norm2) ** 0.5 < tol
