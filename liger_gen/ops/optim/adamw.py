"""AdamW's update (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization") of one parameter and its
state, in place, as ``torch.optim.AdamW`` defines it: references, search space, tuning problem, custom op and the
public op. ``liger_gen.optim.AdamW`` runs it over every parameter of its groups.

    g = −grad if maximize else grad;   p ← p·(1 − lr·λ)
    m ← β1·m + (1 − β1)·g;             v ← β2·v + (1 − β2)·g²;          v̂ = max(v̂, v) with amsgrad, else v
    p ← p − lr/(1 − β1^t) · m / (sqrt(v̂)/sqrt(1 − β2^t) + ε)

Elementwise over the parameter's elements: the op's "rows" are its numel, and it has no feature dims. Every
value is computed in fp32 and stored once in its tensor's dtype. Kernels: ``templates/adamw.py.jinja``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import REL_TOL, Inputs, Problem, randn, rel_l2
from liger_gen.codegen.spaces import KernelConfig, Param, Space
from liger_gen.codegen.spec import OpSpec
from liger_gen.runtime.binding import Kernel
from liger_gen.runtime.ops import (check_float_arg, check_kernel_dtypes, describe, kernel_module, transforms_active,
                                   use_custom_op, uses_triton)

STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # torch.optim.AdamW's state names, amsgrad's last

# ------------------------------------------------------------------------------------------------ references


def adamw_torch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                max_exp_avg_sq: torch.Tensor | None, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: float, maximize: bool) -> None:
    """The update in plain PyTorch, in place: the formula of the module docstring in fp32 (float64 for float64
    tensors), each tensor stored once in its own dtype (the CPU path)."""
    dtype = torch.float64 if torch.float64 in (param.dtype, grad.dtype) else torch.float32
    g = grad.to(dtype).neg() if maximize else grad.to(dtype)
    m = exp_avg.to(dtype).mul_(beta1).add_(g, alpha=1.0 - beta1)
    v = exp_avg_sq.to(dtype).mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    vhat = v
    if max_exp_avg_sq is not None:
        vhat = torch.maximum(max_exp_avg_sq.to(dtype), v)
        max_exp_avg_sq.copy_(vhat)
    denom = vhat.sqrt().div_(math.sqrt(1.0 - beta2 ** step)).add_(eps)
    p = param.to(dtype).mul_(1.0 - lr * weight_decay).addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


def adamw_float64(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  max_exp_avg_sq: torch.Tensor | None = None, *, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, step: float, maximize: bool = False) -> tuple[torch.Tensor, ...]:
    """The truth: (param, exp_avg, exp_avg_sq[, max_exp_avg_sq]) after one step, new float64 tensors."""
    p, g, m, v = (t.double() for t in (param, grad, exp_avg, exp_avg_sq))
    g = -g if maximize else g
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    vhat = v if max_exp_avg_sq is None else torch.maximum(max_exp_avg_sq.double(), v)
    p = p * (1.0 - lr * weight_decay) - lr / (1.0 - beta1 ** step) * m / (
        vhat.sqrt() / math.sqrt(1.0 - beta2 ** step) + eps)
    return (p, m, v) if max_exp_avg_sq is None else (p, m, v, vhat)


# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class AdamWConfig(KernelConfig):
    """Launch settings: BLOCK elements per program and its warps."""

    BLOCK: int
    num_warps: int


class AdamWSpace(Space):
    """Search space, constraints and heuristic of the AdamW update. No feature dims: the update is elementwise, so
    a table entry is keyed by the parameter's element count (the rows bucket) and dtype alone. One phase ("fwd"):
    the op is not differentiable.

    Four tensors stream in and three out; about six fp32 values per element stay live. The heuristic gives each
    thread 8 elements (16-byte accesses in bf16) at 4 warps whatever the parameter's size (a table entry has no
    dims, so the heuristic cannot see the size; a smaller parameter masks the rest of its one block): analytic,
    not a measurement."""

    op = "adamw"
    template = "adamw"
    config_cls = AdamWConfig
    DIMS = ()
    phases = ("fwd",)
    MAX_ELEMS_PER_THREAD = 32
    _BLOCK = tuple(2 ** k for k in range(7, 15))  # 128 .. 16384
    _WARPS = (1, 2, 4, 8, 16)
    PARAMS = (Param("BLOCK", _BLOCK, "fwd"), Param("num_warps", _WARPS, "fwd"))

    def heuristic(self) -> AdamWConfig:
        return AdamWConfig(1024, 4)

    def shape_violations(self, config: AdamWConfig) -> list[str]:
        return self.threads_violations("fwd", config.num_warps, config.BLOCK, self.MAX_ELEMS_PER_THREAD)


# ------------------------------------------------------------------------------------------------ tuning


class AdamWProblem(Problem):
    """One AdamW step of a parameter of ``rows`` elements in ``dtype`` (its gradient and state in the same dtype,
    as ``torch.optim.AdamW`` makes them): seeded inputs, float64 truth, in-place launches.

    p ~ N(0, 0.02²) (a weight's initialisation), grad ~ N(0, 1), m ~ N(0, 0.3²), v = grad'² of another N(0, 1)
    draw, at lr 0.01 and step 7: each update is about lr, half of p's spread, so a wrong update shows in p's
    relative error at every dtype's tolerance."""

    SPACE = AdamWSpace
    OUTPUTS = ("param", "exp_avg", "exp_avg_sq")
    DEFAULT_ROWS = 1 << 26  # a 4096 x 16384 weight
    BYTES_FORMULA = "7·P·s (9·P·s with amsgrad)"

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {}

    @classmethod
    def options(cls, model) -> dict:
        return {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, "step": 7.0,
                "maximize": False, "amsgrad": False}

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        n = (dims["rows"],)
        tensors = {"param": randn(gen, n, dtype, device, 0.02), "grad": randn(gen, n, dtype, device),
                   "exp_avg": randn(gen, n, dtype, device, 0.3), "exp_avg_sq": randn(gen, n, dtype, device).square()}
        if options.get("amsgrad"):  # amsgrad's running maximum, above v
            tensors["max_exp_avg_sq"] = tensors["exp_avg_sq"] * 1.5
        return Inputs(tensors, grad_of=(), upstream={name: None for name in cls.OUTPUTS}, options=dict(options))

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        t, o = inputs.tensors, inputs.options
        outs = adamw_float64(*(t[k] for k in ("param", "grad", "exp_avg", "exp_avg_sq")), t.get("max_exp_avg_sq"),
                             **hyperparameters(o))
        return dict(zip(cls.OUTPUTS + ("max_exp_avg_sq",), outs))

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        return {"fwd": 7 * dims["rows"] * s}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        options = self.options(None)
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, options)
        self.originals = {k: t for k, t in inputs.tensors.items() if t is not None}
        self.buffers = {k: t.clone() for k, t in self.originals.items()}
        self.hyper = hyperparameters(options)
        self.ref = {k: v.float() for k, v in self.reference(inputs).items()}
        self.tol = {name: REL_TOL[dtype] for name in self.OUTPUTS}
        self.outputs = {"fwd": self.OUTPUTS}

    def launcher(self, module, phase: str):
        b, h = self.buffers, self.hyper
        return lambda: module.step(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], None, h["lr"], h["beta1"],
                                   h["beta2"], h["eps"], h["weight_decay"], h["step"], h["maximize"])

    def prepare(self, phase: str) -> None:
        for name, t in self.originals.items():
            self.buffers[name].copy_(t)

    def check(self, module, phase: str) -> str | None:
        """One step from the original inputs (the update is in place: nothing to poison); None if every updated
        tensor is within tolerance of float64."""
        self.prepare(phase)
        self.launcher(module, phase)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for name in self.OUTPUTS:
            err = rel_l2(self.buffers[name], self.ref[name])
            if not err <= self.tol[name]:
                return f"{name}: relative L2 error {err:.3g} > {self.tol[name]:.1g}"
        return None


def hyperparameters(options) -> dict:
    """The keyword arguments of ``adamw_step`` (and of the references) among a problem's ``options``."""
    return {k: options[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "maximize")}


def parameter_sizes(model) -> list[int]:
    """The element counts of a decoder's parameters, distinct and ascending: a norm's weight (hidden), the k/v
    projection, the q/o projection, the MLP's projection and the embedding (vocab x hidden)."""
    h, kv = model.hidden_size, model.num_key_value_heads * model.head_dim
    sizes = {h, h * kv, h * model.num_attention_heads * model.head_dim, h * model.intermediate_size,
             h * model.vocab_size}
    return sorted(sizes)


TUNING_CAP = 1 << 27  # elements; larger parameters take the largest bucket's settings (the same streaming regime)


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """One problem per parameter size of ``model`` (``parameter_sizes``, capped at ``TUNING_CAP`` elements); the
    token counts ``rows`` do not enter an optimizer step."""
    sizes = sorted({min(n, TUNING_CAP) for n in parameter_sizes(model)})
    return [AdamWProblem(dtype, {}, n, device, seed=seed) for n in sizes]


SPEC = OpSpec("adamw", AdamWSpace, AdamWProblem, tuning_problems, custom_ops=("liger_gen::adamw_step",))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _impl(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          max_exp_avg_sq: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: float, maximize: bool) -> None:
    """The update of contiguous tensors of one shape, in place."""
    if param.numel() == 0:
        return
    if not uses_triton(param):  # CPU without the interpreter (only reached when the custom op is called directly)
        adamw_torch(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, step=step, maximize=maximize)
        return
    module, _, _ = kernel_module(AdamWSpace, param, {}, param.numel())
    module.step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step,
                maximize)


adamw_step_op = Kernel("adamw_step", _impl, lambda *args: None,
                       mutates_args=("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))


def adamw_step_unchecked(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, eps, weight_decay,
                         step, maximize) -> None:
    """``adamw_step`` without the argument checks, for callers that checked the tensors once
    (``liger_gen.optim.AdamW``): contiguous tensors of one shape on one device, kernel dtypes, each writable
    (``check_writable``, which both callers run first). It moves the version counters of the tensors it writes,
    as an in-place PyTorch update does (autograd then refuses a backward through a graph that saved one of
    them)."""
    args = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), float(step), bool(maximize))
    if use_custom_op() or transforms_active():  # a graph being recorded, or a torch.func transform
        adamw_step_op.op(*args)
        return
    _impl(*args)
    for t in (param, exp_avg, exp_avg_sq, max_exp_avg_sq):
        if t is not None:
            torch.autograd.graph.increment_version(t)


def check_writable(op: str, written: dict) -> None:
    """RuntimeError for a tensor of ``written`` (name → tensor or None) that the update may not write in place: one
    that requires grad while grad mode is on (the update is not differentiable), or an inference tensor outside
    inference mode. Skipped while torch.compile traces (the custom op's declared mutations are checked there, and
    Dynamo cannot trace ``is_inference``)."""
    if torch.compiler.is_compiling():
        return
    for name, t in written.items():
        if t is None:
            continue
        if t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{op}: {describe(name, t)} requires grad and would be updated in place while grad "
                               f"mode is on (the update is not differentiable); call it under torch.no_grad()")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{op}: {describe(name, t)} is an inference tensor, updated in place outside "
                               f"torch.inference_mode()")


# ------------------------------------------------------------------------------------------------ public op


def check_adamw_tensors(op: str, param, grad, state: dict) -> None:
    """Validate a parameter, its gradient and its state (name → tensor, or None for an absent
    ``max_exp_avg_sq``).

    TypeError: not tensors, not floating point, sparse. ValueError: shapes or devices that differ from the
    parameter's.
    """
    named = {"param": param, "grad": grad, **state}
    for name, t in named.items():
        if t is None and name == "max_exp_avg_sq":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"{op}: {name} must be a dense tensor; got {describe(name, t)} with layout {t.layout}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point; got {describe(name, t)}")
        if t.shape != param.shape:
            raise ValueError(f"{op}: {name} must have param's shape {tuple(param.shape)}; got {describe(name, t)}")
        if t.device != param.device:
            raise ValueError(f"{op}: {name} must be on param's device {param.device}; got {describe(name, t)}")


def check_hyperparameters(op: str, lr, beta1, beta2, eps, weight_decay, step=1.0) -> dict:
    """The hyperparameters as floats; ValueError for values outside ``torch.optim.AdamW``'s ranges (lr, eps,
    weight_decay ≥ 0, betas in [0, 1)) or a step count below 1, TypeError for non-numbers."""
    values = {name: check_float_arg(op, name, value) for name, value in
              (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay),
               ("step", step))}
    for name in ("lr", "eps", "weight_decay"):
        if not values[name] >= 0.0:
            raise ValueError(f"{op}: {name} must be >= 0, got {values[name]}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= values[name] < 1.0:
            raise ValueError(f"{op}: {name} must be in [0, 1), got {values[name]}")
    if not values["step"] >= 1.0:
        raise ValueError(f"{op}: step must be >= 1 (the count after this update), got {values['step']}")
    return values


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               max_exp_avg_sq: torch.Tensor | None = None, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-2, step: float, maximize: bool = False) -> None:
    """One AdamW step of one parameter, in place (Loshchilov & Hutter 2019, "Decoupled Weight Decay
    Regularization"; ``torch.optim.AdamW``'s update, the formula in this module's docstring).

    Args:
        param: the parameter, any shape, float32, bfloat16 or float16; updated in place.
        grad: its gradient, param's shape (any floating dtype on the CPU path; a kernel dtype on the GPU).
        exp_avg, exp_avg_sq: the first and second moment estimates m and v, param's shape; updated in place.
        max_exp_avg_sq: amsgrad's running maximum of v, param's shape, updated in place; None without amsgrad.
        lr: learning rate (≥ 0). beta1, beta2: the moments' decay rates, in [0, 1). eps: added to the denominator
            (≥ 0). weight_decay: decoupled decay λ (≥ 0): p is multiplied by 1 − lr·λ.
        step: the step count t after this update (1 on the first), for the bias corrections 1 − β^t.
        maximize: ascend the gradient instead.

    Every value is computed in fp32 and stored once in its tensor's dtype; the result is within rounding of the
    float64 update and of ``torch.optim.AdamW``'s. CUDA tensors run the tuned Triton kernel; CPU tensors plain
    PyTorch, or the kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. Tensors with other strides than
    contiguous are updated through contiguous copies. Not differentiable.

    Raises:
        TypeError: a non-tensor, a non-floating, sparse or complex tensor, float64 on the kernel path, or a
            hyperparameter that is not a number.
        ValueError: a tensor whose shape or device differs from param's; a hyperparameter out of range.
        RuntimeError: a tensor to update that requires grad while grad mode is on, or an inference tensor outside
            inference mode.
    """
    h = check_hyperparameters("adamw_step", lr, beta1, beta2, eps, weight_decay, step)
    state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq}
    check_adamw_tensors("adamw_step", param, grad, state)
    check_writable("adamw_step", {"param": param, **state})  # on both paths, which then behave alike
    if not uses_triton(param):
        adamw_torch(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, **h, maximize=bool(maximize))
        return
    check_kernel_dtypes("adamw_step", param=param, grad=grad, **state)
    written = [t for t in (param, exp_avg, exp_avg_sq, max_exp_avg_sq) if t is not None]
    if all(t.is_contiguous() for t in written) and grad.is_contiguous():
        adamw_step_unchecked(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, maximize=maximize, **h)
        return
    copies = [t.contiguous() for t in written]
    adamw_step_unchecked(copies[0], grad.contiguous(), copies[1], copies[2], copies[3] if len(copies) > 3 else None,
                         maximize=maximize, **h)
    for t, c in zip(written, copies):
        if c is not t:
            t.copy_(c)
