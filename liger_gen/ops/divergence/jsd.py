"""Generalised Jensen-Shannon divergence for distillation: references, search space, tuning problem, custom ops
and the public op.

With P = exp(teacher_logp), Q = exp(student_logp), per row (sum over the vocab):

    M     = beta·P + (1 − beta)·Q
    JSD_b = beta·KL(P ‖ M) + (1 − beta)·KL(Q ‖ M)                0 < beta < 1
    beta = 0: KL(P ‖ Q)  (forward KL, teacher ‖ student)
    beta = 1: KL(Q ‖ P)  (reverse KL, student ‖ teacher)
    loss  = Σ_rows JSD / max(n_valid, 1)

Kernels: ``templates/jsd.py.jinja``. Launch settings and search space are the family's, as ``kl_div``'s
(``DivergenceConfig``/``DivergenceSpace`` in ``rows``): the same vocab-streaming layout; so is the per-row JSD
(``jsd_rows``).
"""

from __future__ import annotations

import math

import torch

from liger_gen.codegen.problems import (FP32_OUT_TOL, IGNORE_FRACTION, IGNORE_INDEX, REL_TOL, TARGET_BYTES, Inputs,
                                        Problem, VocabProblem, chunk_rows, log_probs, randn, targets)
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.divergence.rows import (DivergenceSpace, check_beta, jsd_mode, jsd_rows, tuning_row_cap,
                                           tuning_rows)
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import check_kernel_dtypes, check_same_device, describe, kernel_module, uses_triton

# ------------------------------------------------------------------------------------------------ references


def _jsd_mean(s: torch.Tensor, t: torch.Tensor, beta: float, ignore_index: int, label: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """Σ over valid rows of the per-row divergence / max(n_valid, 1), computed in ``dtype``."""
    rows = jsd_rows(s.to(dtype), t.to(dtype), beta)
    if label is None:
        return rows.sum() / max(rows.numel(), 1)
    valid = (label != ignore_index).reshape(rows.shape)
    return torch.where(valid, rows, 0.0).sum() / valid.sum().clamp_min(1)


def jsd_torch(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5,
              ignore_index: int = -100, label: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised JSD in plain PyTorch (fp32 math, float64 for float64 inputs; differentiable by autograd);
    the loss in the student's dtype."""
    dtype = torch.promote_types(torch.promote_types(student_logp.dtype, teacher_logp.dtype), torch.float32)
    return _jsd_mean(student_logp, teacher_logp, beta, ignore_index, label, dtype).to(student_logp.dtype)


def jsd_float64(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5,
                ignore_index: int = -100, label: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised JSD in float64 (the truth for tests and the tuner); 0-d float64, differentiable."""
    return _jsd_mean(student_logp, teacher_logp, beta, ignore_index, label, torch.float64)


# ------------------------------------------------------------------------------------------------ space


class JSDSpace(DivergenceSpace):
    """JSD: both kernels stream the student and teacher log-probabilities."""

    op = "jsd"
    template = "jsd"
    BWD_STREAMS = 2


# ------------------------------------------------------------------------------------------------ tuning


class JSDProblem(VocabProblem):
    """JSD at (rows, vocab) in ``dtype`` on ``device``: inputs, float64 truth, checks and launchers.

    ``beta`` (MODE) and the presence of labels are kernel constexprs, not template variants: one table entry
    serves every call option. Tuning uses beta = 0.5 (the mixture, the costliest mode) with labels, about
    one row in ten ignored. Rows are capped for tuning as for kl_div (``tuning_rows``)."""

    SPACE = JSDSpace
    OUTPUTS = ("loss",)
    # the step's floor: student and teacher read, d student written, labels read; the tuned phases are two
    # kernels, the backward reading both inputs again
    BYTES_FORMULA = "3·R·V·s + 8·R"

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        """Student and teacher log-probabilities of N(0, 4) logits (the teacher in ``teacher_dtype``, default
        ``dtype``), labels with ``ignore_fraction`` (0.05) ignored unless ``with_label`` is False; options
        ``beta`` (0.5) and ``ignore_index`` (-100). The upstream gradient is the loss's own (None)."""
        r, v = dims["rows"], dims["vocab"]
        ignore_index = int(options.get("ignore_index", IGNORE_INDEX))
        tensors = {"student": log_probs(gen, r, v, dtype, device),
                   "teacher": log_probs(gen, r, v, options.get("teacher_dtype") or dtype, device),
                   "label": None}
        if options.get("with_label", True):
            tensors["label"] = targets(gen, r, v, device, options.get("ignore_fraction", IGNORE_FRACTION),
                                       ignore_index)
        return Inputs(tensors, grad_of=("student",), upstream={"loss": None},
                      options={"beta": float(options.get("beta", 0.5)), "ignore_index": ignore_index})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        """float64 loss and d student by autograd of the per-row divergence, row chunk by row chunk (rows are
        independent, so each chunk's autograd gives its rows)."""
        s, t, label = inputs.tensors["student"], inputs.tensors["teacher"], inputs.tensors["label"]
        beta, ignore_index = inputs.options["beta"], inputs.options["ignore_index"]
        g = inputs.upstream["loss"]
        valid = torch.ones(s.shape[0], dtype=torch.bool, device=s.device) if label is None else label != ignore_index
        n_valid = valid.sum().double().clamp_min(1)
        scale = (1.0 if g is None else g.double()) / n_valid
        total = torch.zeros((), dtype=torch.float64, device=s.device)
        ds = torch.empty(s.shape, dtype=torch.float64, device=s.device)
        step = chunk_rows(s.shape[-1])
        for lo in range(0, s.shape[0], step):
            rows = slice(lo, lo + step)
            s64 = s[rows].double().requires_grad_()
            with torch.enable_grad():
                part = torch.where(valid[rows], jsd_rows(s64, t[rows].double(), beta), 0.0).sum()
                (ds[rows],) = torch.autograd.grad(part * scale, s64)
            total += part.detach()
        return {"loss": total / n_valid, "dstudent": ds}

    @classmethod
    def phase_bytes(cls, dims, s: int, teacher_size: int | None = None, label: bool = True) -> dict[str, int]:
        mv = dims["rows"] * dims["vocab"]
        inputs = mv * (s + (teacher_size or s)) + (dims["rows"] * TARGET_BYTES if label else 0)
        return {"fwd": inputs, "bwd": inputs + mv * s}

    @classmethod
    def step_bytes(cls, dims, s: int) -> int:
        return 3 * dims["rows"] * dims["vocab"] * s + dims["rows"] * TARGET_BYTES

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, beta: float = 0.5,
                 ignore_index: int = -100, with_label: bool = True, ignore_fraction: float = 0.1,
                 teacher_dtype: torch.dtype | None = None, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        self.beta, self.ignore_index, self.with_label = float(beta), int(ignore_index), bool(with_label)
        self.mode = jsd_mode(self.beta)
        m, v = self.rows, self.dims["vocab"]
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator,
                                  dict(beta=beta, ignore_index=ignore_index, with_label=with_label,
                                       ignore_fraction=ignore_fraction, teacher_dtype=teacher_dtype))
        label = inputs.tensors["label"]
        valid = torch.ones(m, dtype=torch.bool, device=self.device) if label is None else label != ignore_index
        n_valid = valid.sum().double()
        # grad_output scaled as a loss scaler would: fp16's Q·(s − log M)/n_valid would otherwise be subnormal
        g = randn(self.device_generator, (), dtype, self.device, 1.0, 0.5) * n_valid.clamp_min(1).to(dtype)
        inputs.upstream["loss"] = g
        self.buffers = {
            "s": inputs.tensors["student"], "t": inputs.tensors["teacher"], "g": g,
            "loss": torch.empty((), dtype=dtype, device=self.device),
            "n_valid": torch.empty((), dtype=torch.float32, device=self.device),
            "ds": torch.empty((m, v), dtype=dtype, device=self.device),
            # the backward's n_valid input: the exact count, not what a forward check left in "n_valid"
            "n_valid_in": n_valid.float(),
        }
        if label is not None:
            self.buffers["label"] = label
        ref = self.reference(inputs)
        self.ref = {"loss": ref["loss"], "n_valid": n_valid, "ds": ref["dstudent"]}
        tol = REL_TOL[dtype]
        self.tol = {"loss": tol, "n_valid": FP32_OUT_TOL, "ds": tol}
        self.outputs = {"fwd": ("loss", "n_valid"), "bwd": ("ds",)}

    def bytes_moved(self, phase: str) -> int:
        return self.phase_bytes(self.problem_dims, self.element_size, self.buffers["t"].element_size(),
                                self.with_label)[phase]

    def key(self) -> str:
        return f"{super().key()}:beta={self.beta},label={self.with_label}"

    def launcher(self, module, phase: str):
        b = self.buffers
        args = (self.mode, self.beta, self.ignore_index)
        if phase == "fwd":
            return lambda: module.forward(b["s"], b["t"], b.get("label"), b["loss"], b["n_valid"], *args)
        if phase == "bwd":
            return lambda: module.backward(b["g"], b["n_valid_in"], b["s"], b["t"], b.get("label"), b["ds"], *args)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """Distillation over the model's vocabulary: one problem per token count (capped, see
    ``liger_gen.ops.divergence.rows.tuning_rows``), beta = 0.5 with labels."""
    return [JSDProblem(dtype, model.vocab_size, r, device, seed=seed) for r in tuning_rows(model.vocab_size, rows)]


SPEC = OpSpec("jsd", JSDSpace, JSDProblem, tuning_problems, custom_ops=("liger_gen::jsd_fwd", "liger_gen::jsd_bwd"),
              rows_cap=lambda model: tuning_row_cap(model.vocab_size))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(s: torch.Tensor, t: torch.Tensor, label: torch.Tensor | None, beta: float,
              ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss 0-d in s's dtype, n_valid 0-d fp32) for 2-D (rows, vocab) s and t and (rows,) label or None."""
    rows, vocab = s.shape
    loss = torch.empty((), dtype=s.dtype, device=s.device)
    n_valid = torch.empty((), dtype=torch.float32, device=s.device)
    if rows == 0 or vocab == 0:  # nothing to sum: the loss is 0 (divided by max(n_valid, 1))
        if label is None:
            n_valid.fill_(rows)
        else:
            n_valid.copy_((label != ignore_index).sum())
        return loss.zero_(), n_valid
    if uses_triton(s):
        module, _, _ = kernel_module(JSDSpace, s, vocab, rows)
        module.forward(s, t, label, loss, n_valid, jsd_mode(beta), beta, ignore_index)
        return loss, n_valid
    # CPU without the interpreter: the reference math (only reached when the op is called directly)
    rows_loss = jsd_rows(s.float(), t.float(), beta)
    valid = torch.ones(rows, dtype=torch.bool) if label is None else label != ignore_index
    n_valid.copy_(valid.sum())
    loss.copy_(torch.where(valid, rows_loss, 0.0).sum() / n_valid.clamp_min(1))
    return loss, n_valid


def _bwd_impl(g: torch.Tensor, n_valid: torch.Tensor, s: torch.Tensor, t: torch.Tensor, label: torch.Tensor | None,
              beta: float, ignore_index: int) -> torch.Tensor:
    """d loss / d s, contiguous (rows, vocab) in s's dtype."""
    rows, vocab = s.shape
    ds = torch.empty((rows, vocab), dtype=s.dtype, device=s.device)
    if s.numel() == 0:
        return ds
    if uses_triton(s):
        module, _, _ = kernel_module(JSDSpace, s, vocab, rows)
        module.backward(g, n_valid, s, t, label, ds, jsd_mode(beta), beta, ignore_index)
        return ds
    # CPU without the interpreter: autograd of the reference math
    with torch.enable_grad():
        sf = s.detach().float().requires_grad_()
        rows_loss = jsd_rows(sf, t.float(), beta)
        if label is not None:
            rows_loss = torch.where(label != ignore_index, rows_loss, 0.0)
        (grad,) = torch.autograd.grad(rows_loss.sum(), sf)
    return ds.copy_(grad * (g.float() / n_valid.clamp_min(1)))


def _fwd_fake(s, t, label, beta, ignore_index):
    return s.new_empty(()), s.new_empty((), dtype=torch.float32)


def _bwd_fake(g, n_valid, s, t, label, beta, ignore_index):
    return s.new_empty(tuple(s.shape))


jsd_fwd = Kernel("jsd_fwd", _fwd_impl, _fwd_fake)
jsd_bwd = Kernel("jsd_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    student_logp, teacher_logp, label, beta, ignore_index = inputs
    saved(ctx, student_logp, teacher_logp, label, output[1])
    ctx.beta, ctx.ignore_index = beta, ignore_index


def _backward(ctx, grad, _dn_valid):
    s, t, label, n_valid = ctx.saved_tensors
    ds = jsd_bwd.run(ctx, grad, n_valid, s, t, label, ctx.beta, ctx.ignore_index)
    return ds, None, None, None, None


jsd_2d = Differentiable(jsd_fwd, _save, _backward, reference="liger_gen.reference.jsd_torch", outputs=1)
"""(loss, n_valid) of 2-D (rows, vocab) log-probabilities, differentiable in the student."""


# ------------------------------------------------------------------------------------------------ eager plan


def _checked(student_logp, teacher_logp, beta, ignore_index, label) -> tuple[float, bool]:
    """``jsd``'s checks: beta as a float, and whether the kernels take the call (else ``jsd_torch``)."""
    op = "jsd"
    for name, value in (("student_logp", student_logp), ("teacher_logp", teacher_logp)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    if label is not None and not isinstance(label, torch.Tensor):
        raise TypeError(f"{op}: label must be a tensor or None, got {type(label).__name__}")
    beta = check_beta(op, beta)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}")
    if student_logp.dim() < 1:
        raise ValueError(f"{op}: student_logp must have a vocab dim (..., vocab); got "
                         f"{describe('student_logp', student_logp)}")
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(f"{op}: student_logp and teacher_logp must have the same shape; got "
                         f"{describe('student_logp', student_logp)} and {describe('teacher_logp', teacher_logp)}")
    if label is not None and label.shape != student_logp.shape[:-1]:
        raise ValueError(f"{op}: label must have student_logp's leading shape {tuple(student_logp.shape[:-1])}; "
                         f"got {describe('label', label)} and {describe('student_logp', student_logp)}")
    check_same_device(op, student_logp=student_logp, teacher_logp=teacher_logp, label=label)
    for name, t in (("student_logp", student_logp), ("teacher_logp", teacher_logp)):
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
    if label is not None and (label.is_floating_point() or label.is_complex() or label.dtype == torch.bool):
        raise TypeError(f"{op}: label must be an integer tensor; got {describe('label', label)}")
    if teacher_logp.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: teacher_logp requires grad, but only student_logp is differentiated; pass "
                         f"teacher_logp.detach() (got {describe('teacher_logp', teacher_logp)})")
    if not uses_triton(student_logp):
        return beta, False
    check_kernel_dtypes(op, student_logp=student_logp, teacher_logp=teacher_logp)
    return beta, True


def _is_view(t: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``rows`` (a reshape of t) is a view of t (no copy was made)."""
    return rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


class _Plan(plans.Plan):
    """One validated call shape of ``jsd`` on the Triton path whose student, teacher (and label) reshape to
    (rows, vocab) (and (rows,)) views: the kernel module and the launches of ``_fwd_impl`` and ``_bwd_impl`` with
    the same arguments, recorded (``liger_gen.runtime.plans``). The plan takes the tensors in their own shape
    (the launches view them as rows, as the full path's reshape does)."""

    __slots__ = ("shape", "rows", "vocab", "dtype", "device", "mode", "beta", "ignore_index", "module")
    BACKWARD = jsd_bwd
    GRAD_INPUTS = (0,)

    def __init__(self, s: torch.Tensor, beta: float, ignore_index: int):
        super().__init__(s.device, (beta, ignore_index))
        self.shape, self.vocab, self.rows = s.shape, s.shape[-1], math.prod(s.shape[:-1])
        self.dtype, self.device = s.dtype, s.device
        self.mode, self.beta, self.ignore_index = jsd_mode(beta), beta, ignore_index
        self.module = kernel_module(JSDSpace, s, self.vocab, self.rows)[0]

    def inputs(self, student_logp, teacher_logp, beta, ignore_index, label):
        return student_logp, teacher_logp, label

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.rows, self.vocab)

    def forward(self, s, t, label):
        loss = torch.empty((), dtype=self.dtype, device=self.device)
        n_valid = torch.empty((), dtype=torch.float32, device=self.device)
        self.fwd((s, t, label, loss, n_valid), self._launch_fwd, s, t, label, loss, n_valid)
        return loss, n_valid

    def _launch_fwd(self, s, t, label, loss, n_valid):
        self.module.forward(self._rows(s), self._rows(t), None if label is None else label.view(self.rows), loss,
                            n_valid, self.mode, self.beta, self.ignore_index)

    def backward(self, g, n_valid, s, t, label, beta, ignore_index):
        ds = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        launches = self.launches_for((g.shape, g.stride(), g.dtype))
        launches((g, n_valid, s, t, label, ds), self._launch_bwd, g, n_valid, s, t, label, ds)
        return ds

    def _launch_bwd(self, g, n_valid, s, t, label, ds):
        self.module.backward(g, n_valid, self._rows(s), self._rows(t), None if label is None else label.view(self.rows),
                             self._rows(ds), self.mode, self.beta, self.ignore_index)

    def result(self, outputs, *args):
        return outputs[0]


def _key(student_logp, teacher_logp, beta, ignore_index, label):
    if type(ignore_index) is not int:
        return None
    # the teacher must not want a gradient while autograd records: its requires_grad is part of the call shape
    teacher_grad = torch.is_grad_enabled() and type(teacher_logp) in plans.PLAIN and teacher_logp.requires_grad
    return (plans.meta(student_logp), plans.meta(teacher_logp), plans.meta_or_none(label), plans.number(beta),
            ignore_index, teacher_grad)


def _prepare(student_logp, teacher_logp, beta, ignore_index, label) -> _Plan | None:
    beta, kernel = _checked(student_logp, teacher_logp, beta, ignore_index, label)
    if not kernel or not student_logp.numel():
        return None  # the full path (jsd_torch, or nothing to launch)
    vocab = student_logp.shape[-1]
    rows = math.prod(student_logp.shape[:-1])
    if not (_is_view(student_logp, student_logp.reshape(rows, vocab))
            and _is_view(teacher_logp, teacher_logp.reshape(rows, vocab))
            and (label is None or _is_view(label, label.reshape(rows)))):
        return None  # the full path (copies first)
    return _Plan(student_logp, beta, ignore_index)


def _full(student_logp, teacher_logp, beta, ignore_index, label):
    beta, kernel = _checked(student_logp, teacher_logp, beta, ignore_index, label)
    if not kernel:
        return jsd_torch(student_logp, teacher_logp, beta, ignore_index, label)
    vocab = student_logp.shape[-1]
    rows = math.prod(student_logp.shape[:-1])
    s2d = student_logp.reshape(rows, vocab)
    t2d = teacher_logp.reshape(rows, vocab)
    label1d = None if label is None else label.reshape(rows)
    return jsd_2d(s2d, t2d, label1d, beta, ignore_index)[0]


jsd_planned = PlannedOp(jsd_2d, key=_key, prepare=_prepare, full=_full)
"""``jsd`` (student_logp, teacher_logp, beta, ignore_index, label) through per-call-shape plans
(``binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5, ignore_index: int = -100,
        label: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence between student and teacher distributions, for distillation.

    With s = student_logp, t = teacher_logp, Q = exp(s), P = exp(t), for each row (sum over the vocab)::

        M          = beta·P + (1 − beta)·Q
        JSD_beta   = beta·KL(P ‖ M) + (1 − beta)·KL(Q ‖ M)
                   = Σ_v beta·P·(t − log M) + (1 − beta)·Q·(s − log M)          0 < beta < 1
        beta = 0   : KL(P ‖ Q) = Σ_v P·(t − s)      forward KL (teacher ‖ student), the limit of JSD_beta / beta
        beta = 1   : KL(Q ‖ P) = Σ_v Q·(s − t)      reverse KL (student ‖ teacher), the limit of
                                                    JSD_beta / (1 − beta)
        loss       = Σ_rows JSD / max(n_valid, 1)

    (JSD_beta itself goes to 0 at both ends; the endpoints are defined as these KL divergences, as in GKD,
    Agarwal et al. 2024, and TRL's generalized JSD loss.) n_valid is the number of rows whose label is not
    ``ignore_index`` (every row when ``label`` is None); ignored rows contribute nothing. If every row is
    ignored the loss is 0 and the gradient 0 (not 0/0). A term whose probability is exactly 0 contributes 0,
    so −inf log-probabilities (masked vocab entries) are fine.

    Gradient, with respect to student_logp only, times grad_output / max(n_valid, 1), 0 on ignored rows::

        0 < beta < 1 : (1 − beta)·Q·(s − log M)      beta = 0 : −P      beta = 1 : Q·(s − t + 1)

    It is recomputed in the backward from the saved inputs (no (rows, vocab) buffer is kept from the
    forward). The math is fp32; log M is formed in log space.

    Args:
        student_logp: (..., vocab) log-probabilities (e.g. ``log_softmax`` of the student's logits), float32,
            bfloat16 or float16, any strides.
        teacher_logp: same shape; float32, bfloat16 or float16 (may differ from the student's dtype). Must
            not require a gradient while autograd records (pass ``teacher_logp.detach()``).
        beta: in [0, 1].
        ignore_index: label value of rows to skip.
        label: optional (...,) integer tensor (student_logp's leading shape), e.g. the shifted labels; only
            compared with ignore_index.

    Returns:
        The 0-d loss in student_logp's dtype (accumulated in fp32, rounded once).

    CUDA tensors run the tuned Triton kernels; CPU tensors run ``jsd_torch``, or the same Triton kernels in
    Triton's interpreter when ``TRITON_INTERPRET=1``. float64 runs on the plain-PyTorch CPU path only.

    Not checked (it would need a host sync): that the inputs are log-probabilities (rows of exp summing to
    1). Finite values of any size are accepted; +inf or NaN give NaN.

    Raises:
        TypeError: an input is not a tensor, has a non-floating dtype (label: non-integer), float64 on the
            kernel path, beta is not a number or ignore_index not an int.
        ValueError: student/teacher shapes differ, an input has no vocab dim, label's shape is not the
            leading shape, tensors are on different devices, beta is outside [0, 1], or teacher_logp
            requires a gradient (only the student is differentiated).
    """
    return jsd_planned(student_logp, teacher_logp, beta, ignore_index, label)
