"""KL divergence with ``torch.nn.functional.kl_div`` semantics: references, search space, tuning problem,
custom ops and the public op.

    log_target=False:  l = xlogy(t, t) − t·x        log_target=True:  l = exp(t)·(t − x)
    reduction: "none" → l, "sum" → Σl, "mean" → Σl / numel, "batchmean" → Σl / input.size(0)

x = input (log-probabilities), t = target. Kernels: ``templates/kl_div.py.jinja``. The launch-settings
dataclass and the search space (``DivergenceConfig``, ``DivergenceSpace``) are the family's, in ``rows``, shared
with ``liger_gen.ops.divergence.jsd``: both ops stream (rows, vocab) tiles of two inputs and reduce them to a
scalar.
"""

from __future__ import annotations

import math

import torch

from liger_gen.codegen.problems import REL_TOL, Inputs, Problem, VocabProblem, chunk_rows, log_probs, randn
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.divergence.rows import DivergenceSpace, tuning_row_cap, tuning_rows
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import check_kernel_dtypes, check_same_device, describe, kernel_module, uses_triton

REDUCTIONS = ("none", "sum", "mean", "batchmean")
_REDUCTION_ENUM = {"none": 0, "mean": 1, "sum": 2, "batchmean": 2}  # ATen's enum; batchmean divides after

# ------------------------------------------------------------------------------------------------ references


def kl_div_torch(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                 log_target: bool = False) -> torch.Tensor:
    """``torch.nn.functional.kl_div`` without its 'mean' deprecation warning (same ATen op, same division)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    out = torch.kl_div(input, target, _REDUCTION_ENUM[reduction], log_target=log_target)
    if reduction == "batchmean" and input.dim() != 0:
        out = out / input.size(0)
    return out


def kl_div_float64(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                   log_target: bool = False) -> torch.Tensor:
    """KL divergence in float64 (the truth for tests and the tuner): ATen's formula on float64 copies."""
    return kl_div_torch(input.double(), target.double(), reduction, log_target)


def kl_div_divisor(shape: torch.Size | tuple, reduction: str) -> int:
    """What the summed loss is divided by: numel for "mean", size(0) for "batchmean" (1 for a 0-d input),
    else 1. An int (a SymInt while torch.compile traces dynamic shapes, so it does not specialise)."""
    if reduction == "mean":
        return math.prod(shape)
    if reduction == "batchmean" and len(shape) > 0:
        return shape[0]
    return 1


# ------------------------------------------------------------------------------------------------ space


class KLDivSpace(DivergenceSpace):
    """KL divergence: the forward streams input and target; the backward target, input (for d/dtarget)
    and an elementwise grad_output (reduction "none")."""

    op = "kl_div"
    template = "kl_div"
    BWD_STREAMS = 3


# ------------------------------------------------------------------------------------------------ tuning


class KLDivProblem(VocabProblem):
    """KL divergence at (rows, vocab) in ``dtype`` on ``device``: inputs, float64 truth, checks, launchers.

    ``reduction`` and ``log_target`` are kernel constexprs, not template variants: one table entry serves
    every call option (tuning uses the default, "batchmean" with probabilities as target)."""

    SPACE = KLDivSpace
    OUTPUTS = ("loss",)
    # the step's floor: input and target read, d input written (the target is not differentiated); the tuned
    # phases are two kernels, the backward reading the input and target again
    BYTES_FORMULA = "3·R·V·s"

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        """Student log-probabilities and the teacher's probabilities (log-probabilities with ``log_target``) of
        N(0, 4) logits; options ``reduction`` ("batchmean"), ``log_target`` and ``target_grad`` (False). The
        upstream gradient is the loss's own (None); a caller may set another."""
        r, v = dims["rows"], dims["vocab"]
        log_target = bool(options.get("log_target", False))
        x = log_probs(gen, r, v, dtype, device)
        t = log_probs(gen, r, v, torch.float32, device)
        t = (t if log_target else t.exp_()).to(dtype)
        grad_of = ("input", "target") if options.get("target_grad", False) else ("input",)
        return Inputs({"input": x, "target": t}, grad_of=grad_of, upstream={"loss": None},
                      options={"reduction": options.get("reduction", "batchmean"), "log_target": log_target})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        """float64 loss and gradients by autograd of ATen's formula, row chunk by row chunk (~256 MB each)."""
        x, t = inputs.tensors["input"], inputs.tensors["target"]
        reduction, log_target = inputs.options["reduction"], inputs.options["log_target"]
        target_grad = "target" in inputs.grad_of
        reduce = reduction != "none"
        divisor = kl_div_divisor(x.shape, reduction)
        g = inputs.upstream["loss"]
        f64 = dict(dtype=torch.float64, device=x.device)
        loss = torch.zeros((), **f64) if reduce else torch.empty(x.shape, **f64)
        ref = {"dinput": torch.empty(x.shape, **f64)}
        if target_grad:
            ref["dtarget"] = torch.empty(x.shape, **f64)
        for lo in range(0, x.shape[0], chunk_rows(x.shape[-1])):
            rows = slice(lo, lo + chunk_rows(x.shape[-1]))
            x64 = x[rows].double().requires_grad_()
            t64 = t[rows].double().requires_grad_(target_grad)
            with torch.enable_grad():
                part = kl_div_torch(x64, t64, "sum" if reduce else "none", log_target)
                if reduce:
                    up = (1.0 if g is None else g.double()) / divisor
                    grads = torch.autograd.grad(part * up, (x64, t64) if target_grad else (x64,))
                else:
                    up = torch.ones_like(part) if g is None else g[rows].double()
                    grads = torch.autograd.grad(part, (x64, t64) if target_grad else (x64,), up)
            if reduce:
                loss += part.detach()
            else:
                loss[rows] = part.detach()
            for name, grad in zip(ref, grads):
                ref[name][rows] = grad
        return {"loss": loss / divisor if reduce else loss, **ref}

    @classmethod
    def phase_bytes(cls, dims, s: int, reduce: bool = True, target_grad: bool = False) -> dict[str, int]:
        mv = dims["rows"] * dims["vocab"]
        reads = mv * s * (1 + (0 if reduce else 1) + (1 if target_grad else 0))
        return {"fwd": 2 * mv * s + (0 if reduce else mv * s), "bwd": reads + mv * s * (2 if target_grad else 1)}

    @classmethod
    def step_bytes(cls, dims, s: int) -> int:
        return 3 * dims["rows"] * dims["vocab"] * s

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, reduction: str = "batchmean",
                 log_target: bool = False, target_grad: bool = False, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.reduction, self.log_target, self.target_grad = reduction, bool(log_target), bool(target_grad)
        self.reduce = reduction != "none"
        m, v = self.rows, self.dims["vocab"]
        self.divisor = kl_div_divisor((m, v), reduction)
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator,
                                  dict(reduction=reduction, log_target=log_target, target_grad=target_grad))
        g = randn(self.device_generator, () if self.reduce else (m, v), dtype, self.device, 1.0, 0.5)
        if reduction == "batchmean":  # scaled as a loss scaler would: fp16's −t·g/rows would be subnormal
            g = g * self.divisor
        inputs.upstream["loss"] = g
        self.buffers = {
            "x": inputs.tensors["input"], "t": inputs.tensors["target"], "g": g,
            "out": torch.empty(() if self.reduce else (m, v), dtype=dtype, device=self.device),
            "dx": torch.empty((m, v), dtype=dtype, device=self.device),
        }
        if self.target_grad:
            self.buffers["dt"] = torch.empty((m, v), dtype=dtype, device=self.device)
        ref = self.reference(inputs)
        self.ref = {"out": ref["loss"], "dx": ref["dinput"]}
        if self.target_grad:
            self.ref["dt"] = ref["dtarget"]
        tol = REL_TOL[dtype]
        self.tol = {"out": tol, "dx": tol, "dt": tol}
        self.outputs = {"fwd": ("out",), "bwd": ("dx", "dt") if self.target_grad else ("dx",)}

    def bytes_moved(self, phase: str) -> int:
        return self.phase_bytes(self.problem_dims, self.element_size, self.reduce, self.target_grad)[phase]

    def key(self) -> str:
        return f"{super().key()}:reduction={self.reduction},log_target={self.log_target},dt={self.target_grad}"

    def launcher(self, module, phase: str):
        b = self.buffers
        if phase == "fwd":
            return lambda: module.forward(b["x"], b["t"], b["out"], self.log_target, self.reduce, self.divisor)
        if phase == "bwd":
            dt = b["dt"] if self.target_grad else None
            return lambda: module.backward(b["g"], b["x"], b["t"], b["dx"], dt, self.log_target, self.reduce,
                                           self.divisor)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """Distillation over the model's vocabulary: one problem per token count (capped, see ``tuning_rows``),
    reduction "batchmean" with probabilities as target (the default call)."""
    return [KLDivProblem(dtype, model.vocab_size, r, device, seed=seed) for r in tuning_rows(model.vocab_size, rows)]


SPEC = OpSpec("kl_div", KLDivSpace, KLDivProblem, tuning_problems,
              custom_ops=("liger_gen::kl_div_fwd", "liger_gen::kl_div_bwd"),
              rows_cap=lambda model: tuning_row_cap(model.vocab_size))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(x: torch.Tensor, t: torch.Tensor, reduction: str, divisor: int, log_target: bool) -> torch.Tensor:
    """Pointwise losses (rows, vocab) for "none", else the 0-d reduced loss, in the promoted dtype of x and t."""
    rows, vocab = x.shape
    out_dtype = torch.promote_types(x.dtype, t.dtype)
    reduce = reduction != "none"
    if x.numel() == 0:  # like ATen: "sum" of nothing is 0, "mean" 0/0 = NaN, "batchmean" 0/size(0)
        if not reduce:
            return torch.empty((rows, vocab), dtype=out_dtype, device=x.device)
        return torch.zeros((), dtype=torch.float32, device=x.device).div_(divisor).to(out_dtype)
    if uses_triton(x):
        out = torch.empty(() if reduce else (rows, vocab), dtype=out_dtype, device=x.device)
        module, _, _ = kernel_module(KLDivSpace, x, vocab, rows)
        module.forward(x, t, out, log_target, reduce, divisor)
        return out
    # CPU without the interpreter: the kernel's math in PyTorch (only reached when the op is called directly)
    loss = kl_div_torch(x.float(), t.float(), "sum" if reduce else "none", log_target)
    return (loss / divisor if reduce else loss).to(out_dtype)


def _bwd_impl(g: torch.Tensor, x: torch.Tensor | None, t: torch.Tensor, reduction: str, divisor: int,
              log_target: bool, input_grad: bool, target_grad: bool,
              input_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dt), each contiguous (rows, vocab) in its input's dtype (``input_dtype`` for dx), or an empty (0,)
    tensor when not asked. x may be None when only dx is asked (dx = −t·g does not read x)."""
    rows, vocab = t.shape
    reduce = reduction != "none"
    dx = t.new_empty((rows, vocab) if input_grad else (0,), dtype=input_dtype)
    dt = t.new_empty((rows, vocab) if target_grad else (0,))
    if t.numel() == 0 or not (input_grad or target_grad):
        return dx, dt
    if uses_triton(t):
        module, _, _ = kernel_module(KLDivSpace, dx if input_grad else x, vocab, rows)
        module.backward(g, x, t, dx if input_grad else None, dt if target_grad else None, log_target, reduce,
                        divisor)
        return dx, dt
    # CPU without the interpreter: the kernel's formulas in PyTorch
    gf = g.float() / divisor if reduce else g.float()
    tf = t.float()
    p = tf.exp() if log_target else tf
    if input_grad:
        dx.copy_(-p * gf)
    if target_grad:
        xf = x.float()
        dt.copy_((p * (tf - xf + 1) if log_target else torch.xlogy(tf != 0, tf) + tf / tf - xf) * gf)
    return dx, dt


def _fwd_fake(input, target, reduction, divisor, log_target):
    out_dtype = torch.promote_types(input.dtype, target.dtype)
    return input.new_empty(() if reduction != "none" else tuple(input.shape), dtype=out_dtype)


def _bwd_fake(g, x, t, reduction, divisor, log_target, input_grad, target_grad, input_dtype):
    dx = t.new_empty(tuple(t.shape) if input_grad else (0,), dtype=input_dtype)
    dt = t.new_empty(tuple(t.shape) if target_grad else (0,))
    return dx, dt


kl_div_fwd = Kernel("kl_div_fwd", _fwd_impl, _fwd_fake)
kl_div_bwd = Kernel("kl_div_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    input, target, reduction, divisor, log_target = inputs
    saved(ctx, input if ctx.needs_input_grad[1] else None, target)  # d/dinput = −t·g does not read the input
    ctx.reduction, ctx.divisor, ctx.log_target = reduction, divisor, log_target
    ctx.input_dtype = input.dtype


def _backward(ctx, grad):
    input, target = ctx.saved_tensors
    need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dt = kl_div_bwd.run(ctx, grad, input, target, ctx.reduction, ctx.divisor, ctx.log_target, need_x, need_t,
                        ctx.input_dtype)
    return (dx if need_x else None), (dt if need_t else None), None, None, None


_kl_div_2d = Differentiable(kl_div_fwd, _save, _backward, reference="liger_gen.reference.kl_div_torch")


def kl_div_2d(input: torch.Tensor, target: torch.Tensor, reduction: str, divisor: int,
              log_target: bool) -> torch.Tensor:
    """KL divergence of 2-D (rows, vocab) tensors, differentiable in both."""
    if torch.jit.is_tracing() and reduction in ("mean", "batchmean"):
        # torch.jit.trace records a custom op's int arguments as constants, so the divisor (a traced size here)
        # is applied outside the op, where the trace keeps it a function of the input's shape
        return _kl_div_2d(input, target, "sum", 1, log_target) / divisor
    return _kl_div_2d(input, target, reduction, divisor, log_target)


# ------------------------------------------------------------------------------------------------ eager plan


def _checked(input, target, reduction, log_target) -> bool:
    """``kl_div``'s checks; returns whether the kernels take the call (else ``torch.kl_div``)."""
    op = "kl_div"
    for name, value in (("input", input), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(log_target, bool):
        raise TypeError(f"{op}: log_target must be a bool, got {type(log_target).__name__} {log_target!r}")
    if input.shape != target.shape:
        raise ValueError(f"{op}: input and target must have the same shape (no broadcasting); got "
                         f"{describe('input', input)} and {describe('target', target)}")
    check_same_device(op, input=input, target=target)
    for name, t in (("input", input), ("target", target)):
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
    if not uses_triton(input):
        return False
    check_kernel_dtypes(op, input=input, target=target)
    return True


def _rows_vocab(shape: torch.Size) -> tuple[int, int]:
    """(rows, vocab) of the 2-D layout the kernels see (a 0-d input is one row of one)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def _is_view(t: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``rows`` (a reshape of t) is a view of t (no copy was made)."""
    return rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


class _Plan(plans.Plan):
    """One validated call shape of ``kl_div`` on the Triton path whose input and target reshape to (rows, vocab)
    views (any strides: the kernels take them): the kernel module, the output layout and the launches of
    ``_fwd_impl`` and ``_bwd_impl`` with the same arguments, recorded (``liger_gen.runtime.plans``). The plan
    takes the tensors in their own shape (the launches view them as rows, as the full path's reshape does)."""

    __slots__ = ("shape", "rows", "vocab", "out_dtype", "input_dtype", "device", "reduce", "divisor",
                 "log_target", "module")
    BACKWARD = kl_div_bwd
    GRAD_INPUTS = (0, 1)

    def __init__(self, input: torch.Tensor, target: torch.Tensor, reduction: str, log_target: bool):
        divisor = kl_div_divisor(input.shape, reduction)
        super().__init__(input.device, (reduction, divisor, log_target))
        self.shape = input.shape
        self.rows, self.vocab = _rows_vocab(input.shape)
        self.out_dtype = torch.promote_types(input.dtype, target.dtype)
        self.input_dtype, self.device = input.dtype, input.device
        self.reduce, self.divisor, self.log_target = reduction != "none", divisor, log_target
        self.module = kernel_module(KLDivSpace, input, self.vocab, self.rows)[0]

    def inputs(self, input, target, reduction, log_target):
        return input, target

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.rows, self.vocab)

    def forward(self, input, target):
        out = torch.empty(() if self.reduce else self.shape, dtype=self.out_dtype, device=self.device)
        self.fwd((input, target, out), self._launch_fwd, input, target, out)
        return out

    def _launch_fwd(self, input, target, out):
        self.module.forward(self._rows(input), self._rows(target), out if self.reduce else self._rows(out),
                            self.log_target, self.reduce, self.divisor)

    def backward(self, g, x, t, reduction, divisor, log_target, input_grad, target_grad, input_dtype):
        dx = t.new_empty(self.shape if input_grad else (0,), dtype=input_dtype)
        dt = t.new_empty(self.shape if target_grad else (0,))
        if not (input_grad or target_grad):
            return dx, dt
        launches = self.launches_for((g.shape, g.stride(), g.dtype, x is None, input_grad, target_grad))
        dx_out, dt_out = dx if input_grad else None, dt if target_grad else None
        launches((g, x, t, dx_out, dt_out), self._launch_bwd, g, x, t, dx_out, dt_out)
        return dx, dt

    def _launch_bwd(self, g, x, t, dx, dt):
        if not self.reduce:  # the gradient of the (..., vocab) loss, as the full path's view hands it on
            g = g.reshape(self.rows, self.vocab)
        self.module.backward(g, None if x is None else self._rows(x), self._rows(t),
                             None if dx is None else self._rows(dx), None if dt is None else self._rows(dt),
                             self.log_target, self.reduce, self.divisor)


def _key(input, target, reduction, log_target):
    return plans.meta(input), plans.meta(target), plans.exact(reduction), plans.exact(log_target)


def _prepare(input, target, reduction, log_target) -> _Plan | None:
    if not _checked(input, target, reduction, log_target) or not input.numel():
        return None  # the full path (torch.kl_div, or nothing to launch)
    rows, vocab = _rows_vocab(input.shape)
    if not (_is_view(input, input.reshape(rows, vocab)) and _is_view(target, target.reshape(rows, vocab))):
        return None  # the full path (copies first)
    return _Plan(input, target, reduction, log_target)


def _full(input, target, reduction, log_target):
    if not _checked(input, target, reduction, log_target):
        return kl_div_torch(input, target, reduction, log_target)
    divisor = kl_div_divisor(input.shape, reduction)
    rows, vocab = _rows_vocab(input.shape)
    out = kl_div_2d(input.reshape(rows, vocab), target.reshape(rows, vocab), reduction, divisor, log_target)
    return out.view(input.shape) if reduction == "none" else out


kl_div_planned = PlannedOp(_kl_div_2d, key=_key, prepare=_prepare, full=_full)
"""``kl_div`` (input, target, reduction, log_target) through per-call-shape plans (``binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
           log_target: bool = False) -> torch.Tensor:
    """Kullback-Leibler divergence, ``torch.nn.functional.kl_div`` semantics, over the last (vocab) dim.

    Pointwise, with x = input (log-probabilities) and t = target, as ATen defines it::

        log_target=False:  l = xlogy(t, t) − t·x     (t = 0 contributes 0; t·x is still NaN for x = −inf)
        log_target=True:   l = exp(t)·(t − x)

    Args:
        input: (..., vocab) log-probabilities, float32, bfloat16 or float16; any leading dims, any strides.
        target: same shape as input; probabilities, or log-probabilities with ``log_target=True``; float32,
            bfloat16 or float16 (may differ from input's dtype; the loss takes the promoted dtype, as in torch).
        reduction: "none" (pointwise, input's shape), "sum", "mean" (Σl / numel — torch's definition, which
            divides by the vocab size too), or "batchmean" (Σl / input.size(0), the KL divergence per sample
            when input is (batch, vocab); what distillation usually wants). The default is torch's, "mean";
            torch's deprecation warning for "mean" is not repeated.
        log_target: whether target holds log-probabilities.

    Returns:
        The loss in the promoted dtype of input and target: input's shape for "none", else 0-d. Math is
        fp32 and a reduced loss is rounded once (torch rounds the sum, then the division, in the input
        dtype). Differentiable in input and in target (dl/dt = log t + 1 − x, or exp(t)·(t − x + 1) with
        log_target; NaN where t = 0, exactly as torch's autograd gives). Gradients are recomputed in the
        backward from the saved inputs; no (rows, vocab) buffer is held between forward and backward.

    CUDA tensors run the tuned Triton kernels; CPU tensors run ``torch.kl_div``, or the same Triton kernels
    in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 runs on the plain-PyTorch CPU path only.
    2-D inputs of any strides (transposed, sliced, expanded) are read in place; higher-dim inputs whose
    leading dims cannot be flattened into a view are copied once by ``reshape``.

    Not checked (it would need a host sync): that input holds log-probabilities and target probabilities
    (values outside give torch's values: NaN for log of a negative target, etc.).

    Raises:
        TypeError: input/target is not a tensor or not floating point, float64 on the kernel path, or
            log_target is not a bool.
        ValueError: input and target shapes differ (no broadcasting), the tensors are on different devices,
            or reduction is unknown.
    """
    return kl_div_planned(input, target, reduction, log_target)
