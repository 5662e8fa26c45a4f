"""Cross-entropy loss: references, tuning problem, custom ops and the public op. The kernel's settings and search
space are ``cross_entropy_space``'s; the loss options, the argument checks and the row-level API that fused
linear cross-entropy builds on are ``cross_entropy_rows``'s.

    z_ij   = softcap · tanh(x_ij / softcap)                      (Gemma-2 soft-capping; z = x without softcap)
    lse_i  = log Σ_j exp(z_ij)                                    (fp32, online: one pass over the row)
    ce_i   = (1 − ε) · w_{y_i} · (lse_i − z_{i,y_i}) + (ε / V) · Σ_j w_j · (lse_i − z_ij)
    zl_i   = λ · lse_i²                                           (z-loss, PaLM)
    loss   = mean: Σ ce_i / Σ w_{y_i} + Σ zl_i / n;  sum: Σ (ce_i + zl_i);  none: ce_i + zl_i
             (sums over rows whose target is not ignore_index; n counts them; w = 1 without class weights)

``ce`` is exactly ``torch.nn.functional.cross_entropy`` (class weights, ignore_index, label smoothing, the three
reductions). Kernels: ``templates/cross_entropy.py.jinja``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from liger_gen.codegen.problems import (FP32_OUT_TOL, IGNORE_FRACTION, REL_TOL, TARGET_BYTES, Inputs, Problem,
                                        VocabProblem, chunk_rows, randn, rel_l2, targets)
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.lm_head.cross_entropy_rows import (CrossEntropyOptions, ce_rows_closed_form_, check_inputs,
                                                      check_prediction_flags, cross_entropy_mean_scale,
                                                      target_probability, with_predictions)
from liger_gen.ops.lm_head.cross_entropy_space import CrossEntropySpace
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import check_kernel_dtypes, check_targets, kernel_module, use_custom_op, uses_triton

# ------------------------------------------------------------------------------------------------ references


def _ce_rows(x: torch.Tensor, t: torch.Tensor, weight: torch.Tensor | None, options: CrossEntropyOptions):
    """(ce_rows, zl_rows, lse, w_y, valid) of 2-D logits x (rows, V) in x's dtype, differentiable in x.

    Ignored rows have ce = zl = w_y = 0. Targets out of range raise (index errors), as in torch.
    """
    ignore_index, label_smoothing, lse_square_scale, softcap = options.row
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    n_cols = x.shape[-1]
    t = t.long()
    valid = t != ignore_index
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    lse = torch.logsumexp(x, dim=-1)
    logp = x - lse[:, None]
    w = weight.to(x.dtype) if weight is not None else None
    w_y = (w[t_safe] if w is not None else torch.ones_like(lse)) * valid
    ce = -logp.gather(1, t_safe[:, None]).squeeze(1) * w_y
    if label_smoothing > 0.0:
        smooth = -((logp * w).sum(-1) if w is not None else logp.sum(-1)) * valid
        ce = (1.0 - label_smoothing) * ce + (label_smoothing / n_cols) * smooth
    zl = lse_square_scale * lse.square() * valid
    return ce, zl, lse, w_y, valid



def cross_entropy_float64(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                          ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                          lse_square_scale: float = 0.0, softcap: float | None = None,
                          use_token_scaling: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (float64, no intermediate rounding) ``(loss, z_loss)`` from the formula in the module docstring.

    logits (..., V), target of the leading shape. Differentiable in logits. ``loss`` includes ``z_loss``.
    ``use_token_scaling`` multiplies each row's terms by its detached p_y (see ``cross_entropy``).
    """
    n_cols = logits.shape[-1]
    x = logits.reshape(-1, n_cols).double()
    ce, zl, lse, w_y, valid = _ce_rows(x, target.reshape(-1), weight,
                                       CrossEntropyOptions(ignore_index, reduction, label_smoothing,
                                                           lse_square_scale, softcap))
    if use_token_scaling:
        p = target_probability(x.detach(), target.reshape(-1), lse.detach(), softcap, ignore_index)
        ce, zl = ce * p, zl * p
    if reduction == "mean":
        ce, zl = ce.sum() / w_y.sum(), zl.sum() / valid.sum()
    elif reduction == "sum":
        ce, zl = ce.sum(), zl.sum()
    else:
        ce, zl = ce.view(target.shape), zl.view(target.shape)
    return ce + zl, zl


def cross_entropy_torch(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                        ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                        lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                        use_token_scaling: bool = False):
    """The op in plain PyTorch (the CPU path; differentiable by autograd).

    bf16/fp16 logits are upcast to fp32 and the loss is fp32, as the kernels return it; float32 and float64 stay.
    The cross-entropy term is ``torch.nn.functional.cross_entropy`` itself; the z-loss adds λ·lse² per
    non-ignored row (mean: divided by their count). Out-of-range targets raise, as in torch.
    """
    if use_token_scaling:
        ce_rows = cross_entropy_torch(logits, target, weight, ignore_index, "none", label_smoothing, 0.0,
                                      softcap).reshape(-1)
        x = logits.reshape(-1, logits.shape[-1])
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        t = target.reshape(-1)
        lse = torch.logsumexp(x if softcap is None else softcap * torch.tanh(x / softcap), dim=-1)
        zl_rows = lse_square_scale * lse.square() * (t != ignore_index)
        p = target_probability(x, t, lse, softcap, ignore_index)
        scale = None
        if reduction == "mean":  # the denominators in x's dtype (float64 stays float64)
            valid = t != ignore_index
            w_y = (weight.to(x.dtype)[torch.where(valid, t.long(), 0)] * valid) if weight is not None \
                else valid.to(x.dtype)
            scale = torch.stack([1.0 / w_y.sum(), 1.0 / valid.sum().to(x.dtype)])
        loss, zl = token_scaled_reduce(ce_rows, zl_rows, p, reduction, scale)
        if reduction == "none":
            loss, zl = loss.view(target.shape), zl.view(target.shape)
        return (loss, zl.detach()) if return_z_loss else loss
    n_cols = logits.shape[-1]
    x = logits.reshape(-1, n_cols)
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    t = target.reshape(-1).long()
    w = weight.to(x.dtype) if weight is not None else None
    loss = F.cross_entropy(x, t, weight=w, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if reduction == "none":
        loss = loss.view(target.shape)
    if lse_square_scale == 0.0 and not return_z_loss:
        return loss
    valid = t != ignore_index
    zl = lse_square_scale * torch.logsumexp(x, dim=-1).square() * valid
    if reduction == "mean":
        zl = finite_mean(zl.sum(), 1.0 / valid.sum().to(zl.dtype))
    else:
        zl = zl.sum() if reduction == "sum" else zl.view(target.shape)
    if lse_square_scale != 0.0:
        loss = loss + zl
    return (loss, zl.detach()) if return_z_loss else loss


def finite_mean(total: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``total · factor`` for a mean's 1/count ``factor``, whose gradient stays finite when nothing is counted:
    factor inf (no non-ignored row) gives a NaN value, as torch's mean over nothing, with a zero gradient, as
    torch's cross-entropy gives (0·inf would make it NaN); a NaN factor (out-of-range targets) stays NaN."""
    finite = torch.isfinite(factor)
    safe = torch.where(finite, factor, torch.zeros_like(factor))
    return total * safe + torch.where(finite, torch.zeros_like(factor), torch.full_like(factor, float("nan")))


def token_scaled_reduce(ce_rows: torch.Tensor, zl_rows: torch.Tensor, p: torch.Tensor, reduction: str,
                        scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, z_loss)`` of per-row cross-entropy and z-loss terms weighted by p (token scaling): p·(ce + zl)
    and p·zl for "none", their sums, or for "mean" ``scale[0]·Σ p·ce + scale[1]·Σ p·zl`` and ``scale[1]·Σ p·zl``
    with ``scale`` from ``cross_entropy_mean_scale``. Differentiable in both row terms."""
    ce_rows, zl_rows = ce_rows * p, zl_rows * p
    if reduction == "none":
        return ce_rows + zl_rows, zl_rows
    if reduction == "sum":
        return ce_rows.sum() + zl_rows.sum(), zl_rows.sum()
    s = scale.to(ce_rows.dtype)
    total_z = finite_mean(zl_rows.sum(), s[1])
    return finite_mean(ce_rows.sum(), s[0]) + total_z, total_z


# ------------------------------------------------------------------------------------------------ launches


def _launch_forward(module, logits, target, weight, options: CrossEntropyOptions, *, loss_rows, zl_rows, lse, q,
                    scale, dlogits, loss, zl, token_scaling: bool = False):
    """The forward as training runs it: mean denominators, the row kernel (writing dlogits when given), the
    reduction. ``loss``/``zl`` are 0-dim outputs (ignored for reduction="none"). ``token_scaling`` (dlogits
    None) multiplies each row's terms by p_y = exp(z_y − lse) before the reduction (not 1 − q, which loses p_y's
    digits when it is small)."""
    mean = options.reduction == "mean"
    if mean:
        module.mean_scale(target, weight, scale, logits.shape[-1], options.ignore_index)
    module.forward(logits, target, weight, loss_rows, zl_rows, lse, q, dlogits, scale if mean else None, None,
                   *options.row)
    if token_scaling:
        p = target_probability(logits, target, lse, options.softcap, options.ignore_index)
        loss_rows.mul_(p)
        zl_rows.mul_(p)
    if options.reduction != "none":
        module.reduce(loss_rows, zl_rows, scale if mean else None, loss, zl)


def _launch_backward(module, grad_loss, logits, target, weight, lse, q, scale, options: CrossEntropyOptions,
                     dlogits):
    """The recompute backward: dlogits (rows, V) from logits, lse and q."""
    module.backward(logits, target, weight, lse, q, scale if options.reduction == "mean" else None, grad_loss,
                    dlogits, *options.row)


# ------------------------------------------------------------------------------------------------ tuning


class CrossEntropyProblem(VocabProblem):
    """Cross-entropy at (rows, vocab) in ``dtype`` on ``device``: the training step (forward, then backward with
    a unit upstream gradient) checked against float64 and timed as one phase, "fwd" (see CrossEntropySpace).

    The float64 gradient is computed in row chunks inside ``check`` rather than stored, so a problem holds only
    its logits and dlogits (a stored one would be 17 GB at 16384 x 128256).
    """

    SPACE = CrossEntropySpace
    OUTPUTS = ("loss",)
    # the logits read once, dlogits written once, the targets read
    BYTES_FORMULA = "2·R·V·s + 8·R"

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        """Logits N(0, logit_scale²) (2 by default), targets with ``ignore_fraction`` ignored, class weights in
        [0.5, 1.5) with ``weighted``; the loss options (``CrossEntropyOptions``' fields) as given. For reduction
        "none" the upstream gradient is N(0, 1) per row, else the loss's own (1)."""
        r, v = dims["rows"], dims["vocab"]
        ce = CrossEntropyOptions(**{k: options[k] for k in CrossEntropyOptions._fields if k in options})
        tensors = {"logits": randn(gen, (r, v), dtype, device, options.get("logit_scale", 2.0)),
                   "target": targets(gen, r, v, device, options.get("ignore_fraction", IGNORE_FRACTION),
                                     ce.ignore_index)}
        if options.get("weighted", False):
            tensors["weight"] = (0.5 + torch.rand(v, generator=gen, device=gen.device)).to(device)
        upstream = randn(gen, (r,), torch.float32, device) if ce.reduction == "none" else None
        return Inputs(tensors, grad_of=("logits",), upstream={"loss": upstream}, options=ce._asdict())

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        dlogits = torch.empty(inputs.tensors["logits"].shape, dtype=torch.float64,
                              device=inputs.tensors["logits"].device)

        def keep(rows: slice, grad: torch.Tensor) -> None:
            dlogits[rows] = grad

        truth = cls.float64_truth(inputs, keep)
        return {"loss": truth["loss"], "dlogits": dlogits}

    @classmethod
    def float64_truth(cls, inputs: Inputs, on_grad=None) -> dict[str, torch.Tensor]:
        """float64 loss, z-loss and lse of ``inputs`` (row chunks of ~256 MB) and, when ``on_grad(rows, dlogits)``
        is given, each chunk's float64 gradient for the upstream gradient, handed over chunk by chunk."""
        logits, target = inputs.tensors["logits"], inputs.tensors["target"]
        weight, opts = inputs.tensors.get("weight"), CrossEntropyOptions(**inputs.options)
        step = chunk_rows(logits.shape[-1])
        parts, wy_sum, n_valid = [], 0.0, 0.0
        for lo in range(0, logits.shape[0], step):
            ce, zl, lse, w_y, valid = _ce_rows(logits[lo:lo + step].double(), target[lo:lo + step], weight, opts)
            parts.append((ce, zl, lse))
            wy_sum, n_valid = wy_sum + w_y.sum(), n_valid + valid.sum().double()
        ce, zl, lse = (torch.cat(p) for p in zip(*parts))  # rows >= 1: a problem has at least one row
        s_ce, s_z = (1.0 / wy_sum, 1.0 / n_valid) if opts.reduction == "mean" else (1.0, 1.0)
        if opts.reduction == "none":
            loss, z_loss = ce + zl, zl
        else:
            loss, z_loss = ce.sum() * s_ce + zl.sum() * s_z, zl.sum() * s_z
        if on_grad is not None:
            upstream = inputs.upstream["loss"]
            for lo in range(0, logits.shape[0], step):
                rows = slice(lo, lo + step)
                x64 = logits[rows].double().requires_grad_()
                with torch.enable_grad():
                    c, z, _, _, _ = _ce_rows(x64, target[rows], weight, opts)
                    g = 1.0 if upstream is None else upstream.reshape(-1)[rows].double() if upstream.dim() else \
                        upstream.double()
                    (grad,) = torch.autograd.grad((g * (c * s_ce + z * s_z)).sum(), x64)
                on_grad(rows, grad)
        return {"loss": loss, "z_loss": z_loss, "lse": lse}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, reduction: str = "mean",
                 ignore_fraction: float = 0.05, label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                 softcap: float | None = None, weighted: bool = False, ignore_index: int = -100,
                 logit_scale: float = 2.0, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        self.vocab = v = self.dims["vocab"]
        m = self.rows
        self.reduction = reduction
        self.inputs = self.make_inputs(
            self.problem_dims, dtype, self.device, self.device_generator,
            dict(reduction=reduction, ignore_fraction=ignore_fraction, label_smoothing=label_smoothing,
                 lse_square_scale=lse_square_scale, softcap=softcap, weighted=weighted, ignore_index=ignore_index,
                 logit_scale=logit_scale))
        self.options = CrossEntropyOptions(**self.inputs.options)
        self.weight = self.inputs.tensors.get("weight")
        upstream = self.inputs.upstream["loss"]
        f32 = dict(dtype=torch.float32, device=self.device)
        self.buffers = {
            "logits": self.inputs.tensors["logits"], "target": self.inputs.tensors["target"],
            "grad_loss": torch.ones((), **f32) if upstream is None else upstream,
            "loss_rows": torch.empty(m, **f32), "zl_rows": torch.empty(m, **f32), "lse": torch.empty(m, **f32),
            "q": torch.empty(m, **f32), "scale": torch.empty(2, **f32),
            "loss": torch.empty((), **f32), "zl": torch.empty((), **f32),
            "dlogits": torch.empty((m, v), dtype=dtype, device=self.device),
        }
        truth = self.float64_truth(self.inputs)
        out_names = ("loss_rows", "zl_rows") if reduction == "none" else ("loss", "zl")
        self.ref = {out_names[0]: truth["loss"], out_names[1]: truth["z_loss"], "lse": truth["lse"]}
        self.tol = {name: FP32_OUT_TOL for name in self.ref}
        self.tol["dlogits"] = REL_TOL[dtype]
        self.outputs = {"fwd": (*out_names, "lse", "dlogits")}

    def dlogits_error(self) -> float:
        """Relative L2 error of buffers["dlogits"] against the float64 gradient, computed in row chunks."""
        sums = [0.0, 0.0]

        def compare(rows: slice, ref: torch.Tensor) -> None:
            sums[0] += (self.buffers["dlogits"][rows].double() - ref).square().sum().item()
            sums[1] += ref.square().sum().item()

        self.float64_truth(self.inputs, compare)
        return math.sqrt(sums[0]) / (math.sqrt(sums[1]) if sums[1] > 0 else 1.0)

    def check(self, module, phase: str) -> str | None:
        """Run the step once on NaN-poisoned outputs; None if every output is within tolerance, else why not."""
        self.prepare(phase)
        for name in self.outputs[phase]:
            self.buffers[name].fill_(float("nan"))
        self.launcher(module, phase)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for name in self.outputs[phase]:
            err = self.dlogits_error() if name == "dlogits" else rel_l2(self.buffers[name], self.ref[name])
            if not err <= self.tol[name]:
                return f"{name}: relative L2 error {err:.3g} > {self.tol[name]:.1g}"
        return None

    def launcher(self, module, phase: str):
        """The training step: forward (writing dlogits when GRAD_IN_FWD=1), then the backward."""
        if phase != "fwd":
            raise ValueError(f"cross_entropy tunes one phase, 'fwd' (the training step); got {phase!r}")
        b = self.buffers
        args = (b["logits"], b["target"], self.weight, self.options)
        grad_loss = b["grad_loss"]

        def step():
            grad_in_fwd = bool(module.GRAD_IN_FWD)
            _launch_forward(module, *args, loss_rows=b["loss_rows"], zl_rows=b["zl_rows"], lse=b["lse"],
                            q=None if grad_in_fwd else b["q"], scale=b["scale"],
                            dlogits=b["dlogits"] if grad_in_fwd else None, loss=b["loss"], zl=b["zl"])
            if grad_in_fwd:
                module.scale_grad_(b["dlogits"], grad_loss)
            else:
                _launch_backward(module, grad_loss, b["logits"], b["target"], self.weight, b["lse"], b["q"],
                                 b["scale"], self.options, b["dlogits"])
        return step

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        return {"fwd": 2 * dims["rows"] * dims["vocab"] * s + dims["rows"] * TARGET_BYTES}


MAX_TUNING_ROWS = 16384


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The LM head's loss: one problem per token count at the model's vocab size, token counts capped at
    ``MAX_TUNING_ROWS``.

    A problem holds its logits and dlogits (2 x rows x V elements: 8.4 GB at 16384 x 128256 bf16, 34 GB at
    65536) and the kernels work row by row, so past 16384 rows a bigger problem costs tuning time and memory
    while the runtime's nearest-bucket lookup serves larger token counts from the 16384-row entry.
    """
    return [CrossEntropyProblem(dtype, model.vocab_size, r, device, seed=seed)
            for r in sorted({min(int(r), MAX_TUNING_ROWS) for r in rows})]


SPEC = OpSpec("cross_entropy", CrossEntropySpace, CrossEntropyProblem, tuning_problems,
              custom_ops=("liger_gen::cross_entropy_fwd", "liger_gen::cross_entropy_bwd"),
              max_tuning_rows=MAX_TUNING_ROWS)
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _alloc_outputs(logits: torch.Tensor, rows: int, reduction: str):
    f32 = dict(dtype=torch.float32, device=logits.device)
    out = dict(loss_rows=torch.empty(rows, **f32), zl_rows=torch.empty(rows, **f32), lse=torch.empty(rows, **f32),
               q=torch.empty(rows, **f32), scale=torch.ones(2, **f32))
    if reduction == "none":
        out["loss"], out["zl"] = out["loss_rows"], out["zl_rows"]
    else:
        out["loss"], out["zl"] = torch.empty((), **f32), torch.empty((), **f32)
    return out


def _fwd_impl(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, options: CrossEntropyOptions,
              grad_in_fwd: bool, token_scaling: bool = False):
    """(loss, zl, lse, q, scale, dlogits or None) for logits (rows, V) or (B, T, V) with unit last stride and
    target (rows,). loss/zl are 0-dim fp32 (mean, sum) or (rows,) fp32 (none); lse and q = 1 − p_y are (rows,)
    fp32; scale (2,) fp32 holds the mean denominators' reciprocals (ones otherwise). With ``grad_in_fwd`` the
    forward also writes dlogits (rows, V) in logits' dtype for a unit upstream gradient. ``token_scaling``
    (never with ``grad_in_fwd``) weighs each row's terms by its detached p_y = 1 − q."""
    if token_scaling and grad_in_fwd:
        raise ValueError("cross_entropy_fwd: token scaling computes the gradient in the backward "
                         "(grad_in_fwd must be False)")
    ignore_index, reduction, _, _, softcap = options
    rows, n_cols = target.shape[0], logits.shape[-1]
    out = _alloc_outputs(logits, rows, reduction)
    dlogits = torch.empty((rows, n_cols), dtype=logits.dtype, device=logits.device) if grad_in_fwd else None
    if rows == 0:  # torch: the mean of nothing is NaN, the sum 0
        out["loss"].fill_(float("nan") if reduction == "mean" else 0.0)
        out["zl"].fill_(float("nan") if reduction == "mean" else 0.0)
    elif uses_triton(logits):
        # in the op, so that it also runs where torch.compile or torch.jit.trace recorded the op (no host sync on CUDA)
        check_targets("cross_entropy", target, n_cols, ignore_index)
        module, _, _ = kernel_module(CrossEntropySpace, logits, n_cols, rows)
        _launch_forward(module, logits, target, weight, options, loss_rows=out["loss_rows"], zl_rows=out["zl_rows"],
                        lse=out["lse"], q=None if grad_in_fwd else out["q"], scale=out["scale"], dlogits=dlogits,
                        loss=out["loss"], zl=out["zl"], token_scaling=token_scaling)
    else:  # CPU without the interpreter: the kernel's formulas in PyTorch (only reached when the op is called
        # directly, e.g. under torch.compile; the public function takes cross_entropy_torch on this path)
        t = target.long()
        valid = t != ignore_index
        scale = (cross_entropy_mean_scale(target, n_cols, weight, ignore_index) if reduction == "mean"
                 else torch.ones(2, dtype=torch.float32))
        z = logits.reshape(rows, n_cols).to(torch.float32, copy=True)
        ce, zl, lse = ce_rows_closed_form_(z, target, weight, options, scale, None, want_grad=grad_in_fwd)
        if grad_in_fwd:
            dlogits.copy_(z)
        del z
        p_y = target_probability(logits.reshape(rows, n_cols), t, lse, softcap, ignore_index)  # 0 where ignored
        if token_scaling:
            ce, zl = ce * p_y, zl * p_y
        out["loss_rows"].copy_(ce + zl)
        out["zl_rows"].copy_(zl)
        out["lse"].copy_(lse)
        out["q"].copy_(torch.where(valid, 1.0 - p_y, torch.ones_like(p_y)))
        out["scale"].copy_(scale)
        if reduction != "none":
            total_z = zl.sum()
            out["loss"].copy_(ce.sum() * scale[0] + total_z * scale[1])
            out["zl"].copy_(total_z * scale[1])
    return out["loss"], out["zl"], out["lse"], out["q"], out["scale"], dlogits


def _bwd_impl(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
              lse: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, options: CrossEntropyOptions,
              token_scaling: bool = False) -> torch.Tensor:
    """dlogits of logits' shape (contiguous, logits' dtype), recomputed from lse and q (with ``token_scaling``,
    each row's upstream gradient times its p_y = exp(z_y − lse))."""
    rows, n_cols = target.shape[0], logits.shape[-1]
    dlogits = torch.empty((rows, n_cols), dtype=logits.dtype, device=logits.device)
    g = grad_loss.reshape(-1) if options.reduction == "none" else grad_loss.reshape(())
    if token_scaling and rows:
        g = g.float() * target_probability(logits, target, lse, options.softcap, options.ignore_index)
    if rows == 0:
        pass
    elif uses_triton(logits):
        module, _, _ = kernel_module(CrossEntropySpace, logits, n_cols, rows)
        _launch_backward(module, g, logits, target, weight, lse, q, scale, options, dlogits)
    else:  # the closed form (only reached when the op is called directly on the CPU, e.g. under torch.compile)
        z = logits.reshape(rows, n_cols).to(torch.float32, copy=True)
        ce_rows_closed_form_(z, target, weight, options, scale, g, want_grad=True)
        dlogits.copy_(z)
    return dlogits.view(logits.shape)


def _fwd_op_impl(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                 reduction: str, label_smoothing: float, lse_square_scale: float, softcap: Optional[float],
                 grad_in_fwd: bool, token_scaling: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor]:
    """(loss, z_loss, lse, q, scale, dlogits) — see _fwd_impl; dlogits is an empty (0,) tensor unless
    ``grad_in_fwd``, and with ``grad_in_fwd`` q is not computed (its values are undefined; the backward does not
    read it)."""
    out = _fwd_impl(logits, target, weight,
                    CrossEntropyOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap),
                    grad_in_fwd, token_scaling)
    return out if grad_in_fwd else (*out[:5], logits.new_empty((0,)))


def _bwd_op_impl(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor],
                 lse: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, ignore_index: int, reduction: str,
                 label_smoothing: float, lse_square_scale: float, softcap: Optional[float],
                 token_scaling: bool) -> torch.Tensor:
    """dlogits recomputed from lse and q — see _bwd_impl."""
    return _bwd_impl(grad_loss, logits, target, weight, lse, q, scale,
                     CrossEntropyOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap),
                     token_scaling)


def _fwd_fake(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
              grad_in_fwd, token_scaling):
    rows = target.shape[0]
    shape = (rows,) if reduction == "none" else ()
    f32 = dict(dtype=torch.float32)
    dlogits = logits.new_empty((rows, logits.shape[-1]) if grad_in_fwd else (0,))
    return (logits.new_empty(shape, **f32), logits.new_empty(shape, **f32), logits.new_empty((rows,), **f32),
            logits.new_empty((rows,), **f32), logits.new_empty((2,), **f32), dlogits)


def _bwd_fake(grad_loss, logits, target, weight, lse, q, scale, ignore_index, reduction, label_smoothing,
              lse_square_scale, softcap, token_scaling):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


cross_entropy_fwd = Kernel("cross_entropy_fwd", _fwd_op_impl, _fwd_fake)
cross_entropy_bwd = Kernel("cross_entropy_bwd", _bwd_op_impl, _bwd_fake)


def _grad_in_fwd(logits: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether the forward writes dlogits (the tuned GRAD_IN_FWD of this shape): only in eager mode, where the
    backward may scale the saved gradient in place (a recorded graph cannot); never for float16 (its unit-scale
    gradient would underflow)."""
    if use_custom_op() or target.shape[0] == 0 or logits.dtype == torch.float16 or not uses_triton(logits):
        return False
    module, _, _ = kernel_module(CrossEntropySpace, logits, logits.shape[-1], target.shape[0])
    return bool(module.GRAD_IN_FWD)


def _save(ctx, inputs, output):
    logits, target, weight, *options, grad_in_fwd, token_scaling = inputs
    _, zl, lse, q, scale, dlogits = output
    ctx.mark_non_differentiable(zl, lse, q, scale, dlogits)
    ctx.grad_in_fwd, ctx.token_scaling = grad_in_fwd, token_scaling
    ctx.options = CrossEntropyOptions(*options)
    ctx.logits_shape = logits.shape
    if grad_in_fwd:
        saved(ctx, dlogits)
    else:
        saved(ctx, logits, target, weight, lse, q, scale)


def _backward(ctx, grad_loss, *_unused):
    """With GRAD_IN_FWD=1 the forward wrote dlogits and saved only that; the backward scales it in place (rows
    whose upstream gradient is exactly 1 are skipped on the device) and hands it on. A second backward through
    the same graph (retain_graph=True) then raises a RuntimeError rather than returning a twice-scaled
    gradient. Otherwise dlogits is recomputed from the logits, lse and q."""
    if ctx.grad_in_fwd:
        if ctx.eager:  # the eager node scales the saved gradient in place: it can be used once
            if getattr(ctx, "consumed", False):
                raise RuntimeError("liger_gen cross_entropy: backward ran twice through one forward "
                                   "(retain_graph=True); the gradient written by the forward was already scaled "
                                   "and handed on. Run the forward again for each backward.")
            ctx.consumed = True
        (dlogits,) = ctx.saved_tensors
        g = grad_loss.reshape(-1) if ctx.options.reduction == "none" else grad_loss.reshape(())
        if not ctx.eager:  # the custom op's node (a direct call of the op; its backward may be traced): new tensor
            scaled = dlogits.float() * (g[:, None] if g.dim() else g).float()
            return (scaled.to(dlogits.dtype).view(ctx.logits_shape),) + (None,) * 9
        module = ctx.plan.module if ctx.plan is not None else \
            kernel_module(CrossEntropySpace, dlogits, dlogits.shape[-1], dlogits.shape[0])[0]
        module.scale_grad_(dlogits, g)
        torch.autograd.graph.increment_version(dlogits)
        return (dlogits.view(ctx.logits_shape),) + (None,) * 9
    logits, target, weight, lse, q, scale = ctx.saved_tensors
    dlogits = cross_entropy_bwd.run(ctx, grad_loss, logits, target, weight, lse, q, scale, *ctx.options,
                                    ctx.token_scaling)
    return (dlogits,) + (None,) * 9


cross_entropy_2d = Differentiable(cross_entropy_fwd, _save, _backward,
                                  reference="liger_gen.reference.cross_entropy_torch", outputs=2)
"""(loss, z_loss, lse, q, scale, dlogits) of logits (rows, V) or (B, T, V) with unit last stride and target
(rows,), differentiable in the logits; only loss carries a gradient."""


def _rows_layout(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) as a (rows, V) view or, for a (B, T, V) view that no 2-D view covers (e.g.
    ``logits[:, :-1]``), as is: both with unit last stride. Copies only for a last dim of non-unit stride or for
    a > 3-D layout no 2-D view covers."""
    n_cols = logits.shape[-1]
    if logits.stride(-1) != 1 and n_cols > 1:
        logits = logits.contiguous()
    if logits.dim() == 3:
        b, t = logits.shape[0], logits.shape[1]
        if b > 1 and t > 1 and logits.stride(0) != logits.stride(1) * t:
            return logits
    return logits.reshape(-1, n_cols)


# ------------------------------------------------------------------------------------------------ eager plan


class _Plan(plans.Plan):
    """One validated call shape of ``cross_entropy`` on the Triton path (logits whose rows layout is a view,
    target viewable as (rows,), weight with unit stride or absent, no prediction outputs): the options, whether
    the forward writes the gradient, the kernel module and the launches of ``_fwd_impl`` and ``_bwd_impl`` with
    the same arguments, recorded (``liger_gen.runtime.plans``). The targets' range is checked on every call (on
    CUDA by a launch the replay repeats)."""

    __slots__ = ("options", "grad_in_fwd", "token_scaling", "flat", "rows", "n_cols", "dtype", "device",
                 "target_shape", "return_z_loss", "module")
    BACKWARD = cross_entropy_bwd
    GRAD_INPUTS = (0,)

    def __init__(self, x: torch.Tensor, t: torch.Tensor, options: CrossEntropyOptions, grad_in_fwd: bool,
                 token_scaling: bool, flat: bool, target_shape: torch.Size, return_z_loss: bool):
        super().__init__(x.device, (*options, grad_in_fwd, token_scaling))
        self.options, self.grad_in_fwd, self.token_scaling = options, grad_in_fwd, token_scaling
        self.flat, self.target_shape, self.return_z_loss = flat, target_shape, return_z_loss
        self.rows, self.n_cols = t.shape[0], x.shape[-1]
        self.dtype, self.device = x.dtype, x.device
        self.module = kernel_module(CrossEntropySpace, x, self.n_cols, self.rows)[0]

    def inputs(self, logits, target, weight, *_options):
        x = logits.view(self.rows, self.n_cols) if self.flat else logits
        return x, target.view(self.rows), weight

    def needs_grad(self, inputs) -> bool:
        return inputs[0].requires_grad

    def forward(self, x, t, weight):
        grad_in_fwd, reduction = self.grad_in_fwd, self.options.reduction
        out = _alloc_outputs(x, self.rows, reduction)
        dlogits = torch.empty((self.rows, self.n_cols), dtype=self.dtype, device=self.device) if grad_in_fwd \
            else x.new_empty((0,))
        q = None if grad_in_fwd else out["q"]
        loss, zl = (None, None) if reduction == "none" else (out["loss"], out["zl"])  # one slot per buffer
        self.fwd((x, t, weight, out["loss_rows"], out["zl_rows"], out["lse"], q, out["scale"],
                  dlogits if grad_in_fwd else None, loss, zl), self._launch_fwd, x, t, weight, out["loss_rows"],
                 out["zl_rows"], out["lse"], q, out["scale"], dlogits if grad_in_fwd else None, out["loss"], out["zl"])
        return out["loss"], out["zl"], out["lse"], out["q"], out["scale"], dlogits

    def _launch_fwd(self, x, t, weight, loss_rows, zl_rows, lse, q, scale, dlogits, loss, zl):
        # in the launches, so that a replay repeats it (no host sync on CUDA; a host check on the CPU)
        check_targets("cross_entropy", t, self.n_cols, self.options.ignore_index)
        _launch_forward(self.module, x, t, weight, self.options, loss_rows=loss_rows, zl_rows=zl_rows, lse=lse, q=q,
                        scale=scale, dlogits=dlogits, loss=loss, zl=zl, token_scaling=self.token_scaling)

    def backward(self, grad_loss, logits, target, weight, lse, q, scale, ignore_index, reduction, label_smoothing,
                 lse_square_scale, softcap, token_scaling):
        options = self.options
        g = grad_loss.reshape(-1) if reduction == "none" else grad_loss.reshape(())
        if token_scaling:
            g = g.float() * target_probability(logits, target, lse, options.softcap, options.ignore_index)
        dlogits = torch.empty((self.rows, self.n_cols), dtype=self.dtype, device=self.device)
        launches = self.launches_for((g.shape, g.stride(), g.dtype))
        launches((g, logits, target, weight, lse, q, scale, dlogits), _launch_backward, self.module, g, logits,
                 target, weight, lse, q, scale, options, dlogits)
        return dlogits.view(logits.shape)

    def result(self, outputs, *args):
        loss, zl = outputs
        if self.options.reduction == "none":
            loss, zl = loss.view(self.target_shape), zl.view(self.target_shape)
        return (loss, zl) if self.return_z_loss else loss


def _key(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
         return_z_loss, return_token_accuracy, return_predicted_tokens, use_token_scaling):
    if return_token_accuracy is not False or return_predicted_tokens is not False or type(ignore_index) is not int \
            or type(reduction) is not str or type(return_z_loss) is not bool or type(use_token_scaling) is not bool:
        return None
    grad = torch.is_grad_enabled()  # the forward writes the gradient only when one is wanted; weight must not want one
    return (plans.meta(logits), plans.meta(target), plans.meta_or_none(weight), ignore_index, reduction,
            plans.number(label_smoothing), plans.number(lse_square_scale),
            None if softcap is None else plans.number(softcap), return_z_loss, use_token_scaling,
            grad and logits.requires_grad, grad and weight is not None and weight.requires_grad)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _prepare(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
             return_z_loss, return_token_accuracy, return_predicted_tokens, use_token_scaling) -> _Plan | None:
    op = "cross_entropy"
    options = check_inputs(op, logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                           softcap)
    _check_flags(op, return_z_loss, use_token_scaling)
    check_prediction_flags(op, return_token_accuracy, return_predicted_tokens)
    if not uses_triton(logits):
        return None
    check_kernel_dtypes(op, logits=logits)
    x, t = _rows_layout(logits), target.reshape(-1)
    if not t.shape[0] or not _same_storage(x, logits) or not _same_storage(t, target) or \
            (weight is not None and weight.stride(0) != 1):
        return None  # the full path (nothing to launch, or copies first)
    grad_in_fwd = (torch.is_grad_enabled() and logits.requires_grad and not use_token_scaling
                   and _grad_in_fwd(x, t))
    return _Plan(x, t, options, grad_in_fwd, use_token_scaling, x is not logits, target.shape, return_z_loss)


def _check_flags(op: str, return_z_loss, use_token_scaling) -> None:
    if not isinstance(return_z_loss, bool):
        raise TypeError(f"{op}: return_z_loss must be a bool, got {type(return_z_loss).__name__}")
    if not isinstance(use_token_scaling, bool):
        raise TypeError(f"{op}: use_token_scaling must be a bool, got {type(use_token_scaling).__name__}")


def _full(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
          return_z_loss, return_token_accuracy, return_predicted_tokens, use_token_scaling):
    op = "cross_entropy"
    options = check_inputs(op, logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                           softcap)
    _check_flags(op, return_z_loss, use_token_scaling)
    if check_prediction_flags(op, return_token_accuracy, return_predicted_tokens):
        out = cross_entropy(logits, target, weight, *options, return_z_loss=return_z_loss,
                            use_token_scaling=use_token_scaling)
        with torch.no_grad():  # softcap is monotone: the argmax of the raw logits
            pred = logits.argmax(-1)
        return with_predictions(out if return_z_loss else (out,), pred, target, options.ignore_index,
                                return_token_accuracy, return_predicted_tokens, options.reduction)
    if not uses_triton(logits):
        return cross_entropy_torch(logits, target, weight, *options, return_z_loss, use_token_scaling)
    check_kernel_dtypes(op, logits=logits)
    x = _rows_layout(logits)
    t = target.reshape(-1)
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    grad_in_fwd = (torch.is_grad_enabled() and logits.requires_grad and not use_token_scaling
                   and _grad_in_fwd(x, t))
    loss, zl, *_ = cross_entropy_2d(x, t, weight, *options, grad_in_fwd, use_token_scaling)
    if reduction == "none":
        loss, zl = loss.view(target.shape), zl.view(target.shape)
    return (loss, zl) if return_z_loss else loss


cross_entropy_planned = PlannedOp(cross_entropy_2d, key=_key, prepare=_prepare, full=_full)
"""``cross_entropy`` through per-call-shape plans (``liger_gen.runtime.binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                  lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                  return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                  use_token_scaling: bool = False):
    """Cross-entropy loss of logits against class indices, optionally with z-loss and logit soft-capping.

    Equals ``torch.nn.functional.cross_entropy(logits, target, weight, ignore_index=ignore_index,
    reduction=reduction, label_smoothing=label_smoothing)`` for every option the two share (class weights with
    label smoothing; mean with weights divides by the summed weight of the non-ignored targets; a mean over no
    non-ignored row is NaN, as in torch), plus:

    * ``lse_square_scale`` λ adds the z-loss λ·lse_i² per non-ignored row (PaLM, Chowdhery et al. 2022); it is
      unweighted, and a mean divides it by the number of non-ignored rows (also with class weights).
    * ``softcap`` s replaces the logits by s·tanh(logits / s) first (Gemma-2 final-logit soft-capping).
    * ``use_token_scaling`` multiplies each row's loss terms (cross-entropy, smoothing and z-loss) by the row's
      target probability p_y = softmax(z)_y, detached: the gradient is p_y times the row's gradient. With the
      plain loss this is the Dynamic Fine-Tuning loss −sg(p_y)·log p_y (Wu et al. 2025, "On the Generalization
      of SFT"; TRL's ``loss_type="dft"``). The reduction is unchanged (a mean still divides by the number, or the
      summed class weight, of non-ignored rows).

    Args:
        logits: (..., V) float32, bfloat16 or float16, any strides; the classes are the LAST dim (as in
            transformers' losses; torch's (N, C, d1, ...) layout for > 2-D input is not used). 2-D (N, V) and
            1-D (V,) inputs mean what they mean in torch.
        target: int64 or int32 class indices of logits' leading shape; ``ignore_index`` marks rows to skip.
        weight: optional (V,) float per-class weights (any float dtype; computed in fp32). Not differentiated.
        ignore_index: target value whose rows contribute neither loss nor gradient.
        reduction: "mean", "sum" or "none" (per-row losses of target's shape).
        label_smoothing: ε in [0, 1], as in torch.
        lse_square_scale: λ >= 0, the z-loss coefficient.
        softcap: None, or s > 0.
        return_z_loss: also return the z-loss, reduced like the loss.
        return_token_accuracy: also return the share of non-ignored rows whose argmax class is the target (0-dim
            float32, NaN when every row is ignored; not differentiable); with reduction="none", per row instead
            (float32 of target's shape, 1 for a hit, 0 for a miss and for an ignored row).
        return_predicted_tokens: also return each row's argmax class, int64 of target's shape.
        use_token_scaling: weigh each row by its detached target probability (above). The gradient is then
            always recomputed in the backward (one more read of the logits than the default).

    Returns:
        loss — float32 whatever the logits' dtype: 0-dim for "mean"/"sum", target's shape for "none". It includes
        the z-loss. torch would return the logits' dtype; a bf16 loss keeps only ~3 significant digits
        (relative rounding up to 2^-8), while the value is accumulated in fp32 anyway, and transformers' loss
        (which upcasts the logits) and Liger-Kernel both return float32. With ``return_z_loss``: ``(loss,
        z_loss)``, z_loss float32 and not differentiable (its gradient flows through ``loss``, which contains it).
        The accuracy and the predicted tokens, when requested, follow in that order.
        Differentiable in logits; the gradient has logits' dtype.

    A target outside [0, V) that is not ignore_index is an error, as in PyTorch: on CUDA it is caught on the
    device without a host sync (one extra launch that reads the targets), and the program stops with
    "device-side assert triggered" at the next synchronisation, as PyTorch's CUDA cross-entropy does; on the CPU
    (both paths) it raises at once.

    CUDA tensors run the tuned Triton kernels; CPU tensors run plain PyTorch (``cross_entropy_torch``), or the
    same kernels in Triton's interpreter with ``TRITON_INTERPRET=1``. float64 logits run only on the plain path.
    Under torch.compile the backward always recomputes from lse (a custom op may not update its saved gradient
    in place).

    Raises:
        TypeError: logits/target/weight not tensors, logits not floating (or float64 on the kernel path), target
            not int64/int32, weight not floating, ignore_index not an int, a float option not a number, a
            ``return_*`` or ``use_token_scaling`` flag not a bool.
        ValueError: target's shape is not logits' leading shape, weight is not (V,) or requires grad, V < 1,
            tensors on different devices, reduction unknown, label_smoothing outside [0, 1], lse_square_scale
            < 0, softcap <= 0; on the CPU, a target outside [0, V) that is not ignore_index (the plain path
            raises torch's own IndexError/RuntimeError).
        RuntimeError: at backward, a second backward through one forward (``retain_graph=True``) when the
            tuned config computes the gradient in the forward (bf16/fp32 on the kernel path): run the forward
            again, or use the plain path.
    """
    return cross_entropy_planned(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                                 softcap, return_z_loss, return_token_accuracy, return_predicted_tokens,
                                 use_token_scaling)
