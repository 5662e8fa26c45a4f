"""Fused linear cross-entropy (FLCE): the LM-head matmul and the cross-entropy loss, chunked over rows so the
(tokens × vocab) logits are never materialised. References, the chunk loop, tuning problem, custom ops, public
op; the launch plan (settings, search space, CPU chunk sizing) is ``fused_linear_cross_entropy_plan``'s.

    logits = x @ W^T + b                       (fp32 accumulation; see LOGITS_FP32 for the stored dtype)
    logits = softcap · tanh(logits / softcap)  (optional, Gemma 2)
    loss   = cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing)
             + lse_square_scale · lse²       (z-loss, PaLM; mean over non-ignored rows for reduction="mean")

Per chunk of CHUNK_ROWS rows: one GEMM writes the chunk's logits (fp32 accumulation; stored in fp32 or, as
transformers' bf16 ``lm_head`` output, in x's dtype), one launch of cross-entropy's row-level kernel
(``liger_gen.ops.lm_head.cross_entropy_rows.cross_entropy_loss_and_grad``; same semantics as ``cross_entropy``)
computes the rows' losses and writes d(loss)/d(logits) (over the logits when they are in x's dtype), then dX_chunk =
dlogits @ W and dW += dlogits^T @ x_chunk (an fp32 accumulator, or cuBLAS's beta=1 addition in x's dtype) and
db += Σ_rows dlogits. The plan (CHUNK_ROWS, LOGITS_FP32, DW_FP32) is tuned per GPU under a memory budget
(``FusedLinearCrossEntropySpace.MAX_EXTRA_BYTES``); the cross-entropy kernel's launch settings come from the
cross_entropy table. For reduction "mean"/"sum" the gradients are computed in the forward (as Liger-Kernel's
FLCE and Cut Cross-Entropy do) and only scaled by the upstream gradient in the backward (nothing is read or
written when it is exactly 1); for reduction "none" the upstream gradient differs per row, so the backward
recomputes each chunk's logits.
"""

from __future__ import annotations

import torch

from liger_gen.codegen.problems import FP32_OUT_TOL, REL_TOL, TARGET_BYTES, Inputs
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.lm_head.chunks import (LOW_PRECISION, MAX_TUNING_ROWS, TARGET_DTYPES, ChunkEngine, LMHeadProblem,
                                          check_lm_head, lm_head_tuning_problems)
from liger_gen.ops.lm_head.cross_entropy import cross_entropy_float64, cross_entropy_torch
from liger_gen.ops.lm_head.cross_entropy_rows import (CrossEntropyOptions, check_prediction_flags,
                                                      cross_entropy_mean_scale, cross_entropy_reduce,
                                                      loss_and_grad_unchecked, scale_in_place, target_probability,
                                                      with_predictions)
from liger_gen.ops.lm_head.fused_linear_cross_entropy_plan import (FusedLinearCrossEntropyConfig,
                                                                   FusedLinearCrossEntropySpace, chunk_ce_config,
                                                                   cpu_chunk_rows)
from liger_gen.runtime.binding import Differentiable, Kernel, refuse_dtensors, saved
from liger_gen.runtime.ops import (KERNEL_DTYPES, check_same_device, check_targets, describe,
                                   transforms_active, use_custom_op, uses_triton)

# ------------------------------------------------------------------------------------------------ references


def fused_linear_cross_entropy_torch(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                                     bias: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                                     ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                                     lse_square_scale: float = 0.0, softcap: float | None = None,
                                     return_z_loss: bool = False, use_token_scaling: bool = False):
    """Unfused plain-PyTorch FLCE (materialises all logits; differentiable by autograd): ``cross_entropy_torch``
    of ``x @ lm_head_weight.T + bias``.

    The logits are computed in fp32 from the inputs (float64 for float64 inputs), as transformers' loss does
    after ``logits.float()``, without rounding to the inputs' dtype. Returns loss (and z_loss) as
    ``fused_linear_cross_entropy`` does.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = x.to(compute) @ lm_head_weight.to(compute).t()
    if bias is not None:
        logits = logits + bias.to(compute)
    return cross_entropy_torch(logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                               softcap, return_z_loss, use_token_scaling)


def fused_linear_cross_entropy_float64(x, lm_head_weight, target, bias=None, weight=None, ignore_index=-100,
                                       reduction="mean", label_smoothing=0.0, lse_square_scale=0.0, softcap=None,
                                       return_z_loss=False, use_token_scaling=False):
    """Exact FLCE in float64 (unfused, differentiable): ``cross_entropy_float64`` of the float64 logits."""
    logits = x.double() @ lm_head_weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    loss, z = cross_entropy_float64(logits, target, weight, ignore_index, reduction, label_smoothing,
                                    lse_square_scale, softcap, use_token_scaling)
    return (loss, z) if return_z_loss else loss


def fused_linear_cross_entropy_float64_chunked(x, lm_head_weight, target, bias=None, weight=None, ignore_index=-100,
                                               reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                                               softcap=None, grad_output=None, chunk_rows=1024,
                                               use_token_scaling=False):
    """Float64 truth at large shapes: (loss, z_loss, dx, dW, db) without materialising all logits.

    Each chunk's float64 logits are differentiated by autograd (``cross_entropy_float64`` per row); the chunk's
    share of a mean uses the global denominators (Σ weight[target] and the non-ignored count). ``grad_output`` is
    the upstream gradient (0-dim, or per row for "none"; 1 by default). dx is (rows, hidden); db is None
    without bias. Memory: x, W, dW in float64 plus a few float64 chunks of logits.
    """
    hidden = x.shape[-1]
    x64 = x.detach().reshape(-1, hidden).double()
    w64 = lm_head_weight.detach().double()
    b64 = None if bias is None else bias.detach().double()
    cw64 = None if weight is None else weight.detach().double()
    target = target.reshape(-1)
    valid = target != ignore_index
    count = valid.sum().double()
    wsum = count if cw64 is None else torch.where(valid, cw64[torch.where(valid, target, 0)], 0.0).sum()
    g = torch.ones((), dtype=torch.float64, device=x.device) if grad_output is None else grad_output.double()
    dx = torch.empty_like(x64)
    dw = torch.zeros_like(w64)
    db = None if b64 is None else torch.zeros_like(b64)
    ce_parts, z_parts = [], []
    for start in range(0, x64.shape[0], chunk_rows):
        end = min(start + chunk_rows, x64.shape[0])
        logits = x64[start:end] @ w64.t()
        if b64 is not None:
            logits += b64
        logits.requires_grad_()
        with torch.enable_grad():
            rows, z_rows = cross_entropy_float64(logits, target[start:end], cw64, ignore_index, "none",
                                                 label_smoothing, lse_square_scale, softcap, use_token_scaling)
            ce_rows = rows - z_rows
            if reduction == "mean":
                part = (ce_rows.sum() / wsum + z_rows.sum() / count) * g
            elif reduction == "sum":
                part = rows.sum() * g
            else:
                part = (rows * g[start:end]).sum()
            (dlogits,) = torch.autograd.grad(part, logits)
        torch.mm(dlogits, w64, out=dx[start:end])
        dw.addmm_(dlogits.t(), x64[start:end])
        if db is not None:
            db += dlogits.sum(dim=0)
        ce_parts.append(ce_rows.detach())
        z_parts.append(z_rows.detach())
    ce_rows = torch.cat(ce_parts) if ce_parts else x64.new_zeros(0)
    z_rows = torch.cat(z_parts) if z_parts else x64.new_zeros(0)
    if reduction == "mean":
        loss, z = ce_rows.sum() / wsum + z_rows.sum() / count, z_rows.sum() / count
    elif reduction == "sum":
        loss, z = ce_rows.sum() + z_rows.sum(), z_rows.sum()
    else:
        loss, z = ce_rows + z_rows, z_rows
    return loss, z, dx, dw, db


# ------------------------------------------------------------------------------------------------ chunk loop


class _Chunked(ChunkEngine):
    """One call's chunk loop (``chunks.ChunkEngine``) with the cross-entropy kernel as each chunk's step."""

    SPACE = FusedLinearCrossEntropySpace

    def __init__(self, x, w, target, bias, weight, options: CrossEntropyOptions, plan=None,
                 token_scaling: bool = False):
        self.options = options
        self.token_scaling = token_scaling
        self.weight = None if weight is None else weight.detach()
        super().__init__(x, w, bias, target, plan)
        self.ce_config = chunk_ce_config(self.hidden, self.vocab,
                                         x.dtype if x.dtype in KERNEL_DTYPES else torch.float32, self.config)
        # bfloat16 and float32 gradients carry the mean's 1/Σw from the kernel on; float16 ones are left unscaled
        # (they would underflow) and are multiplied by grad_scale at the end
        self.prescale = x.dtype != torch.float16

    def cpu_chunk_rows(self, config: FusedLinearCrossEntropyConfig) -> int:
        return cpu_chunk_rows(config, self.x.dtype, self.hidden, self.vocab, interpreter=uses_triton(self.x),
                              softcap=self.options.softcap is not None)

    def run(self, scale, grad_output, need_dx: bool, need_dw: bool, need_db: bool, need_pred: bool = False):
        """Loop over chunks: per-row (loss, z-loss) in fp32 and, if any need_*, dx (x's dtype), dW (fp32 or x's
        dtype, see ``dw_dtype``) and db (fp32).

        The gradients are those of Σ_i g_i·(s_ce·ce_i + s_z·zl_i) with ``[s_ce, s_z] = scale`` (None: ones) and
        ``g = grad_output`` (None: ones, else (rows,)), as ``cross_entropy_loss_and_grad`` defines them. With
        ``need_pred``, also each row's predicted token (int64 argmax of its logits, taken before the kernel
        overwrites them), else None. With token scaling, each row's losses and upstream gradient are multiplied
        by its detached p_y, which a loss-only launch on the chunk computes first.
        """
        x, rows = self.x, self.rows
        f32 = dict(dtype=torch.float32, device=x.device)
        loss_rows, zl_rows = torch.empty(rows, **f32), torch.empty(rows, **f32)
        pred = torch.empty(rows, dtype=torch.int64, device=x.device) if need_pred else None

        def step(start, end, logits, grad):
            if pred is not None:  # softcap is monotone: the capped logits have the same argmax
                torch.argmax(logits, dim=-1, out=pred[start:end])
            target_c = self.target[start:end]
            g_c = None if grad_output is None else grad_output[start:end]
            if self.token_scaling:  # the chunk's p_y from a loss-only pass (which leaves the logits as they are)
                loss_c, zl_c, lse_c = loss_and_grad_unchecked(logits, target_c, None, self.weight, self.options,
                                                              None, None, self.ce_config)
                p = target_probability(logits, target_c, lse_c, self.options.softcap, self.options.ignore_index)
                loss_rows[start:end] = loss_c * p
                zl_rows[start:end] = zl_c * p
                if grad is None:
                    return
                g_c = p if g_c is None else g_c.float() * p
            # the arguments were validated once by the public function: the unchecked entry point, per chunk
            loss_c, zl_c, _ = loss_and_grad_unchecked(logits, target_c, grad, self.weight, self.options, scale,
                                                      g_c, self.ce_config, scratch=True)
            if not self.token_scaling:
                loss_rows[start:end] = loss_c
                zl_rows[start:end] = zl_c

        dx, dw, db = self.walk(step, need_dx, need_dw, need_db)
        return loss_rows, zl_rows, dx, dw, db, pred


def _fwd_impl(x, w, target, bias, weight, options: CrossEntropyOptions, need_dx, need_dw, need_db, plan=None,
              need_pred: bool = False, token_scaling: bool = False):
    """(loss, z_loss, pred, dx_unscaled, grad_scale, dW, db) of a 2-D x; losses and grad_scale fp32, pred the
    (rows,) int64 predicted tokens with ``need_pred`` (else empty).

    For reduction "none", loss/z_loss are per row and no gradient is computed (the backward recomputes).
    Otherwise the requested gradients are those of the reduced loss for an upstream gradient of 1, except
    that dx is left unscaled: dx = dx_unscaled · grad_scale. grad_scale is 1 except for float16 with
    reduction "mean", whose dlogits are computed without the mean's 1/Σw (they would underflow). Unrequested
    gradients are empty tensors. ``plan``: a FusedLinearCrossEntropyConfig (or dict); None: table or heuristic.
    """
    # in the op, so that it also runs where torch.compile or torch.jit.trace recorded the op (no host sync on CUDA)
    reduction = options.reduction
    check_targets("fused_linear_cross_entropy", target, w.shape[0], options.ignore_index)
    run = _Chunked(x, w, target, bias, weight, options, plan, token_scaling)
    one = torch.ones((), dtype=torch.float32, device=x.device)

    def empty():  # distinct tensors: a custom op's outputs may not alias each other
        return x.new_empty(0)

    if reduction == "none":
        loss_rows, zl_rows, _, _, _, pred = run.run(None, None, False, False, False, need_pred)
        return loss_rows, zl_rows, empty() if pred is None else pred, empty(), one, empty(), empty()
    scale = cross_entropy_mean_scale(target, run.vocab, run.weight, options.ignore_index) \
        if reduction == "mean" else None
    chunk_scale, grad_scale = scale, one
    if scale is not None and run.prescale:
        # every row ignored makes the mean's scale inf (a NaN loss, as torch's) while the gradients stay 0
        chunk_scale = torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))
    elif scale is not None:
        # the kernel gets [1, s_z / s_ce] and the fp32 results are multiplied by s_ce = 1/Σw afterwards; every
        # row ignored makes the scale inf (NaN loss, as torch) while the gradients stay 0, as torch's
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_scale = torch.where(torch.isfinite(scale[0]), scale[0], zero)
        chunk_scale = None
        if options.lse_square_scale:
            ratio = scale[1] / scale[0]
            chunk_scale = torch.stack([one, torch.where(torch.isfinite(ratio), ratio, zero)])
    loss_rows, zl_rows, dx, dw, db, pred = run.run(chunk_scale, None, need_dx, need_dw, need_db, need_pred)
    loss, z_loss = cross_entropy_reduce(loss_rows, zl_rows, reduction, scale)
    prescale = run.prescale
    del run, loss_rows, zl_rows
    if dw is not None:
        if not prescale:
            dw.mul_(grad_scale)
        dw = dw.to(w.dtype)
    if db is not None:
        if not prescale:
            db.mul_(grad_scale)
        db = db.to(bias.dtype)
    return (loss, z_loss, empty() if pred is None else pred, empty() if dx is None else dx, grad_scale,
            empty() if dw is None else dw, empty() if db is None else db)


def _bwd_none_impl(grad_rows, x, w, target, bias, weight, options: CrossEntropyOptions, need_dx, need_dw, need_db,
                   plan=None, token_scaling: bool = False):
    """(dx, dW, db) of reduction "none" for a per-row upstream gradient: recomputes each chunk's logits."""
    run = _Chunked(x, w, target, bias, weight, options, plan, token_scaling)
    _, _, dx, dw, db, _ = run.run(None, grad_rows, need_dx, need_dw, need_db)
    del run
    return (x.new_empty(0) if dx is None else dx, x.new_empty(0) if dw is None else dw.to(w.dtype),
            x.new_empty(0) if db is None else db.to(bias.dtype))


def _scale_grads(grad_loss, dx_unscaled, grad_scale, dw, db, in_place: bool):
    """Gradients of mean/sum: the forward's gradients times the upstream (scalar) gradient."""
    g = grad_loss.float()
    if in_place:
        return scale_in_place(dx_unscaled, grad_scale * g), scale_in_place(dw, g), scale_in_place(db, g)
    return (dx_unscaled * (grad_scale * g)).to(dx_unscaled.dtype), (dw * g).to(dw.dtype), (db * g).to(db.dtype)


# ------------------------------------------------------------------------------------------------ tuning


def loss_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the loss against float64: FP32_OUT_TOL for float32 inputs; for 16-bit inputs the
    unit roundoff of x's dtype, because LOGITS_FP32=0 rounds the logits to it (as transformers' lm_head output
    does), which moves a row's loss by about u·|logit| (measured in the mean over 512-1024 bf16 rows: 1e-5)."""
    return torch.finfo(dtype).eps / 2 if dtype in LOW_PRECISION else FP32_OUT_TOL


class FusedLinearCrossEntropyProblem(LMHeadProblem):
    """FLCE at (rows, hidden, vocab) in ``dtype``: reduction "mean" with 1 in 20 targets ignored.

    Phase "fwd" is the whole fused forward (loss, dx and dW; the backward only scales them). The float64 truth
    is computed chunk by chunk on the device.
    """

    SPACE = FusedLinearCrossEntropySpace
    OUTPUTS = ("loss",)
    # x and W read, dx and dW written, targets read; the logits never leave the chip's chunks
    BYTES_FORMULA = "2·R·H·s + 2·V·H·s + 8·R"
    # three GEMMs of 2·R·H·V: logits, dx = dlogits @ W, dW = dlogits^T @ x
    FLOPS_FORMULA = "6·R·H·V"

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        t = inputs.tensors
        loss, _, dx, dw, _ = fused_linear_cross_entropy_float64_chunked(t["x"], t["w"], t["target"])
        return {"loss": loss, "dx": dx, "dw": dw}

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        r, h, v = dims["rows"], dims["hidden"], dims["vocab"]
        return {"fwd": 2 * r * h * s + 2 * v * h * s + r * TARGET_BYTES}

    @classmethod
    def step_flops(cls, dims) -> int:
        return 6 * dims["rows"] * dims["hidden"] * dims["vocab"]

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        self.hidden, self.vocab = self.dims["hidden"], self.dims["vocab"]
        m, h, v = self.rows, self.hidden, self.vocab
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {})
        self.buffers = {
            **inputs.tensors,
            "loss": torch.empty((), dtype=torch.float32, device=self.device),
            "dx": torch.empty((m, h), dtype=dtype, device=self.device),
            "dw": torch.empty((v, h), dtype=dtype, device=self.device),
        }
        self.ref = self.reference(inputs)
        self.tol = {"loss": loss_tolerance(dtype), "dx": REL_TOL[dtype], "dw": REL_TOL[dtype]}
        self.outputs = {"fwd": ("loss", "dx", "dw")}

    def launcher(self, module, phase: str):
        if phase != "fwd":
            raise ValueError(f"phase must be 'fwd' (FLCE is tuned as one fused phase), got {phase!r}")
        b = self.buffers
        plan = module.plan()

        def launch():
            loss, _, _, dx_u, scale, dw, _ = _fwd_impl(b["x"], b["w"], b["target"], None, None, CrossEntropyOptions(),
                                                    True, True, False, plan)
            b["loss"].copy_(loss)
            torch.mul(dx_u, scale, out=b["dx"])
            b["dw"].copy_(dw)

        return launch


tuning_problems = lm_head_tuning_problems(FusedLinearCrossEntropyProblem)

SPEC = OpSpec("fused_linear_cross_entropy", FusedLinearCrossEntropySpace, FusedLinearCrossEntropyProblem,
              tuning_problems, max_tuning_rows=MAX_TUNING_ROWS,
              custom_ops=("liger_gen::fused_linear_cross_entropy_fwd", "liger_gen::fused_linear_cross_entropy_bwd",
                          "liger_gen::fused_linear_cross_entropy_scale_grads"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding

def _fwd_fake(x, lm_head_weight, target, bias, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
              softcap, need_dx, need_dw, need_db, need_pred, token_scaling):
    rows, hidden = x.shape
    loss_shape = (rows,) if reduction == "none" else ()
    grads = reduction != "none"
    f = torch.float32
    return (x.new_empty(loss_shape, dtype=f), x.new_empty(loss_shape, dtype=f),
            x.new_empty((rows,), dtype=torch.int64) if need_pred else x.new_empty((0,)),
            x.new_empty((rows, hidden) if grads and need_dx else (0,)), x.new_empty((), dtype=f),
            lm_head_weight.new_empty(lm_head_weight.shape if grads and need_dw else (0,)),
            x.new_empty((0,)) if bias is None or not (grads and need_db) else bias.new_empty(bias.shape))


def _bwd_fake(grad_rows, x, lm_head_weight, target, bias, weight, ignore_index, label_smoothing, lse_square_scale,
              softcap, need_dx, need_dw, need_db, token_scaling):
    return (x.new_empty(x.shape if need_dx else (0,)),
            lm_head_weight.new_empty(lm_head_weight.shape if need_dw else (0,)),
            x.new_empty((0,)) if bias is None or not need_db else bias.new_empty(bias.shape))


def _scale_grads_op_impl(grad_loss: torch.Tensor, dx_unscaled: torch.Tensor, grad_scale: torch.Tensor,
                         dw: torch.Tensor, db: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of reduction mean/sum in a recorded graph: the forward's gradients times the upstream gradient,
    as new tensors."""
    return _scale_grads(grad_loss, dx_unscaled, grad_scale, dw, db, in_place=False)


def _fwd_op_impl(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                 weight: torch.Tensor | None, ignore_index: int, reduction: str, label_smoothing: float,
                 lse_square_scale: float, softcap: float | None, need_dx: bool, need_dw: bool, need_db: bool,
                 need_pred: bool, token_scaling: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor]:
    """(loss, z_loss, pred, dx_unscaled, grad_scale, dW, db) for a 2-D x with the tuned plan; see ``_fwd_impl``."""
    return _fwd_impl(x, lm_head_weight, target, bias, weight,
                     CrossEntropyOptions(ignore_index, reduction, label_smoothing, lse_square_scale, softcap),
                     need_dx, need_dw, need_db, need_pred=need_pred, token_scaling=token_scaling)


def _bwd_op_impl(grad_rows: torch.Tensor, x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                 bias: torch.Tensor | None, weight: torch.Tensor | None, ignore_index: int, label_smoothing: float,
                 lse_square_scale: float, softcap: float | None, need_dx: bool, need_dw: bool,
                 need_db: bool, token_scaling: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db) of reduction "none" for per-row upstream gradients (recomputes the logits per chunk)."""
    return _bwd_none_impl(grad_rows, x, lm_head_weight, target, bias, weight,
                          CrossEntropyOptions(ignore_index, "none", label_smoothing, lse_square_scale, softcap),
                          need_dx, need_dw, need_db, token_scaling=token_scaling)


fused_linear_cross_entropy_fwd = Kernel("fused_linear_cross_entropy_fwd", _fwd_op_impl, _fwd_fake)
fused_linear_cross_entropy_bwd = Kernel("fused_linear_cross_entropy_bwd", _bwd_op_impl, _bwd_fake)
fused_linear_cross_entropy_scale_grads = Kernel(
    "fused_linear_cross_entropy_scale_grads", _scale_grads_op_impl,
    lambda grad_loss, dx_unscaled, grad_scale, dw, db: (torch.empty_like(dx_unscaled), torch.empty_like(dw),
                                                        torch.empty_like(db)))


def _save(ctx, inputs, output):
    (x, w, target, bias, weight, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
     need_dx, need_dw, need_db, _, token_scaling) = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.reduction, ctx.has_bias, ctx.used = reduction, bias is not None, False
    if reduction == "none":  # the backward recomputes the logits chunk by chunk
        saved(ctx, x, w, target, bias, weight)
        ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, need_dx, need_dw, need_db,
                       token_scaling)
    else:  # the forward computed the gradients for an upstream gradient of 1
        _, _, _, dx_u, grad_scale, dw, db = output
        saved(ctx, dx_u, grad_scale, dw, db)


def _backward(ctx, grad_loss, *_unused):
    if ctx.reduction == "none":
        x, w, target, bias, weight = ctx.saved_tensors
        dx, dw, db = fused_linear_cross_entropy_bwd.run(ctx, grad_loss, x, w, target, bias, weight, *ctx.options)
    elif not ctx.eager:  # the custom op's node, whose backward may be traced: new tensors, no mutation
        dx, dw, db = fused_linear_cross_entropy_scale_grads.op(grad_loss, *ctx.saved_tensors)
    else:
        # the saved gradients are scaled in place (no second dW-sized buffer), so a second backward through
        # the same graph (retain_graph=True) raises instead of returning wrong values
        if ctx.used:
            raise RuntimeError("liger_gen fused_linear_cross_entropy: backward ran twice through one forward "
                               "(retain_graph=True); the gradients computed in the forward were already "
                               "consumed. Run the forward again for each backward (a model patched by "
                               "liger_gen.apply_to computes its training loss with this op: patch it with "
                               "fused_linear_cross_entropy=False to keep transformers' loss).")
        ctx.used = True
        dx, dw, db = _scale_grads(grad_loss, *ctx.saved_tensors, in_place=True)
    return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None,
            db if ctx.has_bias and ctx.needs_input_grad[3] else None) + (None,) * 11


_fused_linear_cross_entropy_2d = Differentiable(
    fused_linear_cross_entropy_fwd, _save, _backward,
    reference="liger_gen.reference.fused_linear_cross_entropy_torch", outputs=3)


def fused_linear_cross_entropy_2d(x, lm_head_weight, target, bias, weight, options: CrossEntropyOptions,
                                  need_pred: bool = False, token_scaling: bool = False):
    """(loss, z_loss, pred) of a 2-D x, differentiable in x, lm_head_weight and bias; pred the (rows,) int64
    predicted tokens with ``need_pred``, else an empty tensor."""
    if torch.jit.is_tracing():
        # a trace records these flags as constants: compute every gradient, whatever the tensors need now, so
        # that the trace is right when it replays with other tensors (autograd drops the unneeded ones)
        need_dx = need_dw = True
        need_db = bias is not None
    else:
        grad = torch.is_grad_enabled()
        need_dx = grad and x.requires_grad
        need_dw = grad and lm_head_weight.requires_grad
        need_db = grad and bias is not None and bias.requires_grad
        if not (need_dx or need_dw or need_db) and not use_custom_op() and not transforms_active():
            # no_grad, inference_mode or nothing to differentiate: the loss alone (no dx/dW GEMMs, no autograd
            # node; under torch.func.vmap the op's per-element rule runs it)
            try:
                out = _fwd_impl(x, lm_head_weight, target, bias, weight, options, False, False, False,
                                need_pred=need_pred, token_scaling=token_scaling)
            except Exception as exc:  # noqa: BLE001 - re-raised; a DTensor input is named instead
                refuse_dtensors("fused_linear_cross_entropy", (x, lm_head_weight, target, bias, weight), exc)
                raise
            return out[0], out[1], out[2]
    out = _fused_linear_cross_entropy_2d(x, lm_head_weight, target, bias, weight, *options, need_dx, need_dw,
                                         need_db, need_pred, token_scaling)
    return out[0], out[1], out[2]


# ------------------------------------------------------------------------------------------------ public op


def _check_inputs(op, x, lm_head_weight, target, bias, weight, ignore_index, reduction, label_smoothing,
                  lse_square_scale, softcap, return_z_loss):
    """Validate every argument; returns the loss options (``CrossEntropyOptions.checked``)."""
    for name, t in (("x", x), ("lm_head_weight", lm_head_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    for name, t in (("bias", bias), ("weight", weight)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor or None, got {type(t).__name__}")
    options = CrossEntropyOptions.checked(op, ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    if not isinstance(return_z_loss, bool):
        raise TypeError(f"{op}: return_z_loss must be a bool, got {type(return_z_loss).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim (..., hidden); got {describe('x', x)}")
    hidden = x.shape[-1]
    if hidden < 1:
        raise ValueError(f"{op}: x must have a hidden size >= 1 in its last dim; got {describe('x', x)}")
    check_lm_head(op, lm_head_weight, bias, hidden)
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden:
        raise ValueError(f"{op}: lm_head_weight must have shape (vocab, {hidden}) to match x's last dim; got "
                         f"{describe('lm_head_weight', lm_head_weight)} and {describe('x', x)}")
    vocab = lm_head_weight.shape[0]
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{op}: target must have x's leading shape {tuple(x.shape[:-1])} (one class index per "
                         f"row); got {describe('target', target)} and {describe('x', x)}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"{op}: target must hold class indices as int64 or int32 (class probabilities are not "
                        f"supported); got {describe('target', target)}")
    for name, t in (("bias", bias), ("weight", weight)):
        if t is not None and (t.dim() != 1 or t.shape[0] != vocab):
            raise ValueError(f"{op}: {name} must have shape ({vocab},) (one value per class of lm_head_weight); "
                             f"got {describe(name, t)} and {describe('lm_head_weight', lm_head_weight)}")
    check_same_device(op, x=x, lm_head_weight=lm_head_weight, target=target, bias=bias, weight=weight)
    for name, t in (("x", x), ("lm_head_weight", lm_head_weight), ("bias", bias), ("weight", weight)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
    if lm_head_weight.dtype != x.dtype:
        raise TypeError(f"{op}: x and lm_head_weight must have the same dtype (as in x @ lm_head_weight.T); got "
                        f"{describe('x', x)} and {describe('lm_head_weight', lm_head_weight)}")
    if bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"{op}: bias must have x's dtype {x.dtype}; got {describe('bias', bias)}")
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: the loss is not differentiable in weight (torch raises at backward); pass "
                         f"weight.detach(); got {describe('weight', weight)} with requires_grad=True")
    if uses_triton(x) and x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: the kernel path supports float32, bfloat16 and float16; got {describe('x', x)} "
                        f"(float64 runs only on the plain-PyTorch CPU path)")
    return options


def fused_linear_cross_entropy(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               lse_square_scale: float = 0.0, softcap: float | None = None,
                               return_z_loss: bool = False, return_token_accuracy: bool = False,
                               return_predicted_tokens: bool = False, use_token_scaling: bool = False):
    """Cross-entropy of a linear layer's output without materialising the logits (the LM head and its loss).

    Equal to ``torch.nn.functional.cross_entropy(x @ lm_head_weight.T + bias, target, weight, ignore_index=...,
    reduction=..., label_smoothing=...)`` computed with fp32 logits, plus two options of Liger-Kernel's
    cross-entropy: ``softcap`` (logits ← softcap·tanh(logits/softcap) before the loss, Gemma 2) and the z-loss
    ``lse_square_scale · logsumexp(logits)²`` of each non-ignored row (PaLM, Chowdhery et al. 2022), added to
    the loss and divided by the number of non-ignored rows for "mean". Rows are processed in chunks: each chunk's
    logits come from a GEMM with fp32 accumulation, stored in fp32 or (for bf16/fp16 inputs, when the tuned plan
    says so) rounded to x's dtype exactly as ``lm_head(x)`` in transformers; the per-chunk cross-entropy kernel
    turns them into losses and d(loss)/d(logits), and dx, dW and db follow by two more GEMMs (dW summed over
    chunks in fp32, or added into dW in bf16 with one rounding per chunk). Gradients are exact (no filtering of
    small terms). Peak extra memory beyond the gradients is at most ``FusedLinearCrossEntropySpace.MAX_EXTRA_BYTES``
    (256 MiB; more only when even a 16-row chunk needs more, and float16 adds an fp32 dW accumulator), whatever
    the number of tokens, on every path of the 16- and 32-bit dtypes: CUDA, the plain CPU path and the
    interpreter (the CPU paths hold more buffers per row and take fewer rows per chunk: ``cpu_chunk_rows``);
    float64 runs the unfused reference and has no bound. Under torch.compile the backward of
    "mean"/"sum" returns new gradient tensors (a custom op may not write into its saved outputs), so dx and dW
    are held twice while it runs.

    Args:
        x: (..., hidden) or (N, hidden) float32, bfloat16 or float16; any strides.
        lm_head_weight: (vocab, hidden), x's dtype, on x's device.
        target: x's leading shape, int64 or int32 class indices in [0, vocab) or ``ignore_index``.
        bias: optional (vocab,), x's dtype.
        weight: optional (vocab,) per-class rescaling weight (any float dtype; used in fp32; not differentiated).
        ignore_index: target value whose rows contribute no loss and no gradient.
        reduction: "mean" (Σ loss / Σ weight[target] over non-ignored rows; NaN if every row is ignored, as
            PyTorch), "sum", or "none" (per row, 0 for ignored rows).
        label_smoothing: in [0, 1], as PyTorch (with class weights as PyTorch weighs the smoothing term).
        lse_square_scale: z-loss coefficient (>= 0).
        softcap: None, or a float > 0 for tanh soft-capping of the logits.
        return_z_loss: also return the z-loss term (already included in the loss), for logging.
        return_token_accuracy: also return the share of non-ignored rows whose most likely class (argmax of the
            row's logits, each chunk's taken before its gradient overwrites it) is the target: 0-dim float32,
            NaN when every row is ignored; not differentiable (what trainers log as token accuracy); with
            reduction="none", per row instead (float32 of x's leading shape, 1 for a hit, 0 for a miss and for an
            ignored row).
        return_predicted_tokens: also return those argmax classes, int64 of x's leading shape (every row).
        use_token_scaling: multiply each row's loss terms (and so its gradient) by its target probability
            p_y = softmax(z)_y, detached, as ``cross_entropy`` defines it (the Dynamic Fine-Tuning loss of Wu et
            al. 2025 with the plain loss; TRL's ``loss_type="dft"``). Costs one more pass of the cross-entropy
            kernel over each chunk's logits (the GEMMs are not repeated).

    Returns:
        loss, float32 (float64 for float64 inputs on the plain path): a scalar, or of x's leading shape for
        reduction "none". With ``return_z_loss``, the tuple (loss, z_loss); z_loss has the loss's shape and is
        not differentiable (its gradient flows through the loss, which contains it). With the accuracy and/or the
        predicted tokens requested they follow, in that order: ``(loss[, z_loss][, accuracy][, predicted])``.
        The loss is differentiable in x,
        lm_head_weight and bias; for reduction mean/sum the gradients are computed in the forward and scaled by
        the upstream gradient in the backward (so one backward per forward), for "none" the backward recomputes
        the logits chunk by chunk. Double backward is not supported. Under ``torch.func.grad``, ``vjp``,
        ``jacrev`` and ``vmap`` the gradients come from the same chunk loop as new tensors (as under
        torch.compile); forward-mode transforms (``jvp``, ``jacfwd``) and second derivatives raise RuntimeError.

    CUDA tensors run the tuned chunk size and per-chunk Triton kernel for the current GPU (cuBLAS GEMMs); CPU
    tensors run the same chunk loop in plain PyTorch, or with the Triton kernel in Triton's interpreter when
    ``TRITON_INTERPRET=1``. float64 is accepted on the plain-PyTorch CPU path only, where it runs the unfused
    float64 computation (``fused_linear_cross_entropy_torch``).

    Raises:
        TypeError: a tensor argument is not a tensor; x / lm_head_weight / bias / weight are not floating, x and
            lm_head_weight (or bias) differ in dtype, float64 on the kernel path; target is not int64/int32; a
            scalar option has the wrong type.
        ValueError: hidden is 0; lm_head_weight is not (vocab, hidden) for x's hidden; target's shape is not x's
            leading shape; bias or weight is not (vocab,); weight requires grad; tensors on different devices;
            reduction unknown; label_smoothing outside [0, 1]; lse_square_scale < 0; softcap <= 0; on the CPU, a
            target outside [0, vocab) that is not ignore_index.

    On CUDA a target outside [0, vocab) that is not ignore_index is caught on the device without a host sync (as
    in ``cross_entropy``): the program stops with "device-side assert triggered" at the next synchronisation, as
    PyTorch's CUDA cross-entropy does.
    """
    op = "fused_linear_cross_entropy"
    options = _check_inputs(op, x, lm_head_weight, target, bias, weight, ignore_index, reduction, label_smoothing,
                            lse_square_scale, softcap, return_z_loss)
    need_pred = check_prediction_flags(op, return_token_accuracy, return_predicted_tokens)
    if not isinstance(use_token_scaling, bool):
        raise TypeError(f"{op}: use_token_scaling must be a bool, got {type(use_token_scaling).__name__}")
    if x.dtype == torch.float64:  # plain CPU path only (checked above): the unfused float64 reference
        out = fused_linear_cross_entropy_torch(x, lm_head_weight, target, bias, weight, *options, return_z_loss,
                                               use_token_scaling)
        if not need_pred:
            return out
        with torch.no_grad():
            logits = x @ lm_head_weight.t() if bias is None else x @ lm_head_weight.t() + bias
        return with_predictions(out if return_z_loss else (out,), logits.argmax(-1), target, options.ignore_index,
                                 return_token_accuracy, return_predicted_tokens, options.reduction)
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    if x2d.stride(0) != 1 and x2d.stride(1) != 1:  # GEMMs take row- or column-major operands without a copy
        x2d = x2d.contiguous()
    target1d = target.reshape(-1).contiguous()
    loss, z, pred = fused_linear_cross_entropy_2d(x2d, lm_head_weight, target1d, bias, weight, options, need_pred,
                                                  use_token_scaling)
    if reduction == "none":
        loss, z = loss.view(x.shape[:-1]), z.view(x.shape[:-1])
    if not need_pred:
        return (loss, z) if return_z_loss else loss
    return with_predictions((loss, z) if return_z_loss else (loss,), pred.view(x.shape[:-1]), target,
                             options.ignore_index, return_token_accuracy, return_predicted_tokens, options.reduction)

