"""The row-level cross-entropy that both cross-entropy ops build on: the loss options, the argument checks, the
closed form of a row's loss and gradient (the CPU paths), and one launch that computes per-row losses and writes
their gradient, possibly in place (``cross_entropy_loss_and_grad``), with the mean's denominators and the
reduction around it. ``cross_entropy`` runs it on whole logits, fused linear cross-entropy per chunk of logits.

Formulas: ``liger_gen.ops.lm_head.cross_entropy``. Kernels: ``templates/cross_entropy.py.jinja``, launched with
``CrossEntropySpace``'s settings (``cross_entropy_space``).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import torch

from liger_gen.ops.lm_head.chunks import TARGET_DTYPES
from liger_gen.ops.lm_head.cross_entropy_space import CrossEntropyConfig, CrossEntropySpace
from liger_gen.runtime.ops import (KERNEL_DTYPES, check_float_arg, check_same_device, describe, kernel_module,
                                   module_for, uses_triton)

REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyOptions(NamedTuple):
    """The loss options of ``cross_entropy`` and ``fused_linear_cross_entropy``, as one value.

    The public functions validate them once (``CrossEntropyOptions.checked``) and hand the value down to the
    launches, the reference rows and the chunk loop. ``*options`` gives the custom ops' scalar arguments in their
    schema order; ``options.row`` gives the kernels' (everything but the reduction, which only the callers of the
    row kernel apply).

    ignore_index: target value whose rows contribute neither loss nor gradient.
    reduction: "mean", "sum" or "none".
    label_smoothing: ε in [0, 1], as in torch.
    lse_square_scale: λ >= 0, the z-loss coefficient (PaLM).
    softcap: None, or s > 0 for tanh soft-capping of the logits (Gemma 2).
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None

    @property
    def row(self) -> tuple[int, float, float, float | None]:
        """(ignore_index, label_smoothing, lse_square_scale, softcap): the row kernel's scalar arguments."""
        return self.ignore_index, self.label_smoothing, self.lse_square_scale, self.softcap

    @classmethod
    def checked(cls, op: str, ignore_index, reduction, label_smoothing, lse_square_scale,
                softcap) -> "CrossEntropyOptions":
        """The options after validation, floats as Python floats.

        Raises:
            TypeError: ignore_index not an int, a float option not a real number.
            ValueError: reduction unknown, label_smoothing outside [0, 1], lse_square_scale < 0 or not finite,
                softcap <= 0 or not finite.
        """
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, numbers.Integral)):
            raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}")
        ignore_index = int(ignore_index)  # a NumPy integer too, as torch takes it
        if reduction not in REDUCTIONS:
            raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        label_smoothing = check_float_arg(op, "label_smoothing", label_smoothing)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
        lse_square_scale = check_float_arg(op, "lse_square_scale", lse_square_scale)
        if not 0.0 <= lse_square_scale < math.inf:  # comparisons, not math.isfinite: torch.compile(dynamic=True)
            raise ValueError(f"{op}: lse_square_scale must be a finite number >= 0, got {lse_square_scale}")
        if softcap is not None:
            softcap = check_float_arg(op, "softcap", softcap)
            if not 0.0 < softcap < math.inf:
                raise ValueError(f"{op}: softcap must be None or a finite number > 0, got {softcap}")
        return cls(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)


# ------------------------------------------------------------------------------------------------ checks


def check_inputs(op: str, logits, target, weight, ignore_index, reduction, label_smoothing, lse_square_scale,
                 softcap) -> CrossEntropyOptions:
    """Validate the public arguments; returns the options (``CrossEntropyOptions.checked``)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: logits must be a tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: target must be a tensor, got {type(target).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{op}: logits must be float32, bfloat16 or float16; got {describe('logits', logits)}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"{op}: target must hold class indices as int64 or int32 (class probabilities are not "
                        f"supported); got {describe('target', target)}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{op}: logits must be (..., V) with V >= 1 classes in the last dim; "
                         f"got {describe('logits', logits)}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{op}: target must have logits' leading shape {tuple(logits.shape[:-1])} (classes are "
                         f"the last dim of logits); got {describe('target', target)} and {describe('logits', logits)}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{op}: weight must be a tensor or None, got {type(weight).__name__}")
        if not weight.is_floating_point():
            raise TypeError(f"{op}: weight must be floating point; got {describe('weight', weight)}")
        if weight.dim() != 1 or weight.shape[0] != logits.shape[-1]:
            raise ValueError(f"{op}: weight must have shape ({logits.shape[-1]},), one weight per class of logits' "
                             f"last dim; got {describe('weight', weight)} and {describe('logits', logits)}")
        if weight.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{op}: the loss is not differentiable in weight (torch raises at backward); pass "
                             f"weight.detach(); got {describe('weight', weight)} with requires_grad=True")
    check_same_device(op, logits=logits, target=target, weight=weight)
    return CrossEntropyOptions.checked(op, ignore_index, reduction, label_smoothing, lse_square_scale, softcap)


def check_prediction_flags(op: str, return_token_accuracy, return_predicted_tokens) -> bool:
    """TypeError unless both flags are bools; whether predictions are needed at all."""
    for name, flag in (("return_token_accuracy", return_token_accuracy),
                       ("return_predicted_tokens", return_predicted_tokens)):
        if not isinstance(flag, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {type(flag).__name__}")
    return return_token_accuracy or return_predicted_tokens


def with_predictions(outputs: tuple, pred: torch.Tensor, target: torch.Tensor, ignore_index: int,
                     accuracy: bool, predicted: bool, reduction: str = "mean") -> tuple:
    """``outputs`` followed by the token accuracy and/or the predicted tokens ``pred``. The accuracy follows the
    loss's reduction: "mean" and "sum", the share of non-ignored rows whose argmax is the target (0-dim float32,
    NaN when every row is ignored); "none", per row (float32 of target's shape: 1 where the argmax is the
    target, 0 where not and at ignored rows)."""
    extra = []
    if accuracy:
        valid = target != ignore_index
        hit = (pred.reshape(target.shape) == target) & valid
        extra.append(hit.float() if reduction == "none" else hit.sum().float() / valid.sum().float())
    if predicted:
        extra.append(pred)
    return (*outputs, *extra)


# ------------------------------------------------------------------------------------------------ closed form


def ce_rows_closed_form_(z: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                         options: CrossEntropyOptions, scale: torch.Tensor | None = None,
                         grad_output: torch.Tensor | None = None, want_grad: bool = False):
    """(ce_rows, zl_rows, lse) of fp32 logits ``z`` (rows, V) by the closed form, overwriting ``z``; with
    ``want_grad`` z ends up holding d/dz of ``Σ_i g_i · (s_ce · ce_i + s_z · zl_i)`` (``[s_ce, s_z] = scale``,
    ``g = grad_output``; ones when None) — what the kernels compute, for the CPU paths.

    No autograd (it runs inside custom ops, where autograd is off) and no temporary of z's size except one for
    ``softcap`` with ``want_grad`` (the tanh, for the chain rule): everything else is in place or per row. With
    p = softmax(z) and W = Σ_j w_j (V without class weights)::

        d ce_i / d z_ij = (1 − ε) · w_y · (p_ij − [j = y_i]) + (ε / V) · (W · p_ij − w_j)
        d zl_i / d z_ij = 2λ · lse_i · p_ij
        d z_ij / d x_ij = 1 − tanh²(x_ij / softcap)        (soft-capping)
    """
    ignore_index, label_smoothing, lse_square_scale, softcap = options.row
    rows, n_cols = z.shape
    target = target.long()
    valid = target != ignore_index
    t_safe = torch.where(valid, target, torch.zeros_like(target))[:, None]
    w = None if weight is None else weight.to(torch.float32)
    tanh = None
    if softcap is not None:
        z.div_(softcap).tanh_()
        if want_grad:
            tanh = z.clone()
        z.mul_(softcap)
    zmax = z.amax(dim=1)
    z.sub_(zmax[:, None])  # shifted logits: exp cannot overflow
    z_y = z.gather(1, t_safe).squeeze(1)
    if label_smoothing > 0.0:
        sum_wz = z.sum(dim=1) if w is None else torch.mv(z, w)
    z.exp_()
    sum_exp = z.sum(dim=1)
    lse_shifted = sum_exp.log()
    lse = lse_shifted + zmax
    valid_f = valid.to(torch.float32)
    w_y = valid_f if w is None else w[t_safe.squeeze(1)] * valid_f
    ce = (lse_shifted - z_y) * w_y
    w_total = float(n_cols) if w is None else w.sum()
    if label_smoothing > 0.0:
        smooth = (w_total * lse_shifted - sum_wz) * valid_f
        ce = (1.0 - label_smoothing) * ce + (label_smoothing / n_cols) * smooth
    zl = lse_square_scale * lse.square() * valid_f
    if want_grad:
        one = torch.ones((), dtype=torch.float32, device=z.device)
        s_ce, s_z = (scale[0], scale[1]) if scale is not None else (one, one)
        g = one if grad_output is None else grad_output.to(torch.float32)
        a = g * s_ce * valid_f  # (rows,)
        coef = (a * ((1.0 - label_smoothing) * w_y + (label_smoothing / n_cols) * w_total)
                + g * s_z * valid_f * (2.0 * lse_square_scale) * lse)
        z.div_(sum_exp[:, None]).mul_(coef[:, None])  # p · coefficient
        z.scatter_add_(1, t_safe, (-(1.0 - label_smoothing) * a * w_y)[:, None])
        if label_smoothing > 0.0:
            z.addr_(-(label_smoothing / n_cols) * a, torch.ones(n_cols, dtype=torch.float32, device=z.device)
                    if w is None else w)
        if tanh is not None:
            z.mul_(tanh.square_().neg_().add_(1.0))
    return ce, zl, lse



def target_probability(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, softcap: float | None,
                       ignore_index: int) -> torch.Tensor:
    """p_y = exp(z_y − lse) per row, (rows,) float32 (float64 for float64 logits), 0 for ignored rows; not
    differentiable. ``logits`` (rows, V) or a (B, T, V) layout of them, raw (before soft-capping); ``lse`` the
    rows' logsumexp of the soft-capped logits. Out-of-range targets are not checked here."""
    with torch.no_grad():
        t = target.reshape(-1).long()
        valid = t != ignore_index
        idx = torch.where(valid, t, 0).clamp_(0, logits.shape[-1] - 1)  # out-of-range targets: NaN loss anyway
        x_y = logits.gather(-1, idx.view(*logits.shape[:-1], 1)).reshape(-1)
        x_y = x_y.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        z_y = x_y if softcap is None else softcap * torch.tanh(x_y / softcap)
        return torch.where(valid, torch.exp(z_y - lse.to(z_y.dtype)), torch.zeros_like(z_y))


# ------------------------------------------------------------------------------------------------ row-level API
# For fused linear cross-entropy (and anything that produces logits chunk by chunk): one launch computes the
# per-row losses and writes the gradient, possibly in place.


@functools.lru_cache(maxsize=None)
def aux_module():
    """A kernel module for the row-vector kernels (mean denominators, reductions), whose settings are fixed."""
    from liger_gen.codegen.build import load_variant

    return load_variant("cross_entropy", CrossEntropySpace(1, torch.float32).heuristic().to_dict())


def scale_in_place(t: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """t *= factor (0-dim) in place; on the kernel path nothing is read or written when factor is exactly 1. The
    LM-head losses scale their gradients by the upstream one with it; it lives here, not in ``chunks`` (the
    family's shared module, which imports no op), because its kernel (``scale_grad_``) is cross-entropy's."""
    if not t.numel():
        return t
    if uses_triton(t) and t.is_contiguous():
        aux_module().scale_grad_(t.view(-1, t.shape[-1]), factor.float())
        return t
    return t.mul_(factor)


def cross_entropy_mean_scale(target: torch.Tensor, n_classes: int, weight: torch.Tensor | None = None,
                             ignore_index: int = -100) -> torch.Tensor:
    """``[1 / Σ_{non-ignored} w_y, 1 / #non-ignored]`` as a (2,) float32 tensor on target's device, no host sync.

    Pass it as ``scale`` to ``cross_entropy_loss_and_grad`` for reduction="mean" over ALL rows of ``target`` (also
    when the rows are processed in chunks). Entries are inf when every row is ignored (the mean is then NaN, as
    in torch); with weights, an out-of-range target makes the first entry NaN.
    """
    op = "cross_entropy_mean_scale"
    if not isinstance(target, torch.Tensor) or target.dtype not in TARGET_DTYPES or target.dim() != 1:
        raise TypeError(f"{op}: target must be a 1-D int64 or int32 tensor; got "
                        + (describe("target", target) if isinstance(target, torch.Tensor) else type(target).__name__))
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != n_classes):
        raise ValueError(f"{op}: weight must have shape ({n_classes},); got {describe('weight', weight)}")
    check_same_device(op, target=target, weight=weight)
    if not uses_triton(target):
        valid = target != ignore_index
        w_y = (weight.float()[torch.where(valid, target.long(), 0)] * valid) if weight is not None else valid.float()
        return torch.stack([1.0 / w_y.sum(), 1.0 / valid.sum().float()]).float()
    scale = torch.empty(2, dtype=torch.float32, device=target.device)
    if target.shape[0] == 0:
        return scale.fill_(float("inf"))
    aux_module().mean_scale(target, weight, scale, n_classes, ignore_index)
    return scale


def cross_entropy_reduce(loss_rows: torch.Tensor, zl_rows: torch.Tensor, reduction: str,
                         scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, z_loss)`` from ``cross_entropy_loss_and_grad``'s per-row outputs (all rows of the batch).

    mean: ``scale[0]·Σ(loss_rows − zl_rows) + scale[1]·Σ zl_rows`` and ``scale[1]·Σ zl_rows`` with ``scale`` from
    ``cross_entropy_mean_scale``; sum: plain sums; none: the rows themselves. 0-dim float32, one launch.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy_reduce: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "none":
        return loss_rows, zl_rows
    if reduction == "mean" and scale is None:
        raise ValueError("cross_entropy_reduce: reduction='mean' needs scale from cross_entropy_mean_scale")
    s = scale if reduction == "mean" else None
    if not uses_triton(loss_rows):
        total_z = zl_rows.sum()
        if s is None:
            return loss_rows.sum(), total_z
        return (loss_rows.sum() - total_z) * s[0] + total_z * s[1], total_z * s[1]
    loss = torch.empty((), dtype=torch.float32, device=loss_rows.device)
    zl = torch.empty((), dtype=torch.float32, device=loss_rows.device)
    if loss_rows.shape[0] == 0:
        fill = float("nan") if reduction == "mean" else 0.0
        return loss.fill_(fill), zl.fill_(fill)
    aux_module().reduce(loss_rows, zl_rows, s, loss, zl)
    return loss, zl


def cross_entropy_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, dlogits: torch.Tensor | None = None, *,
                                weight: torch.Tensor | None = None, ignore_index: int = -100,
                                label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                                softcap: float | None = None, scale: torch.Tensor | None = None,
                                grad_output: torch.Tensor | None = None, config: CrossEntropyConfig | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row losses of 2-D logits and, when ``dlogits`` is given, their gradient — one kernel launch, no sync.

    Args:
        logits: (rows, V) float32/bfloat16/float16 with unit column stride (any row stride).
        target: (rows,) int64/int32 (any stride); ``ignore_index`` rows give 0 loss and 0 gradient; targets outside
            [0, V) give NaN loss and NaN gradient in their row (not checked on the host).
        dlogits: None (loss only) or (rows, V) float32/bfloat16/float16 with unit column stride; may be ``logits``
            itself (computed in place: each row is fully read before it is overwritten). Receives, rounded once from
            fp32, d/dlogits of ``Σ_i g_i · (s_ce · ce_i + s_z · zl_i)`` with ``[s_ce, s_z] = scale`` (ones when
            None) and ``g = grad_output`` (ones when None; 0-dim or (rows,), any float dtype).
        weight, ignore_index, label_smoothing, lse_square_scale, softcap: as in ``cross_entropy``.
        scale: None or a (2,) float32 tensor; for a mean over a batch processed in chunks pass
            ``cross_entropy_mean_scale(all_targets, V, weight, ignore_index)`` to every chunk.
        config: the kernel's launch settings (its *_BWD fields when dlogits is given, else *_FWD); None: the
            cross_entropy table's entry for this shape.

    Returns:
        ``(loss_rows, zl_rows, lse)``, each (rows,) float32: ``loss_rows = ce_i + zl_i`` and ``zl_rows = λ·lse_i²``
        NOT multiplied by scale or grad_output (0 for ignored rows, NaN for out-of-range targets), and the row's
        logsumexp (of the soft-capped logits; for every row, ignored or not). Reduce with ``cross_entropy_reduce``.

    Raises:
        TypeError/ValueError for the same bad inputs as ``cross_entropy``, and for logits not 2-D, a non-unit column
        stride, or dlogits/scale/grad_output of the wrong shape, dtype or device.
    """
    op = "cross_entropy_loss_and_grad"
    options = check_inputs(op, logits, target, weight, ignore_index, "none", label_smoothing, lse_square_scale,
                           softcap)
    if logits.dim() != 2 or (logits.stride(1) != 1 and logits.shape[1] > 1):
        raise ValueError(f"{op}: logits must be 2-D (rows, V) with unit column stride; got "
                         f"{describe('logits', logits)} and strides {tuple(logits.stride())}")
    rows, n_cols = logits.shape
    if dlogits is not None:
        if not isinstance(dlogits, torch.Tensor) or dlogits.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{op}: dlogits must be a float32, bfloat16 or float16 tensor; got "
                            + (describe("dlogits", dlogits) if isinstance(dlogits, torch.Tensor)
                               else type(dlogits).__name__))
        if tuple(dlogits.shape) != (rows, n_cols) or (dlogits.stride(1) != 1 and n_cols > 1):
            raise ValueError(f"{op}: dlogits must be ({rows}, {n_cols}) with unit column stride; got "
                             f"{describe('dlogits', dlogits)} and strides {tuple(dlogits.stride())}")
    if scale is not None and (not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (2,)
                              or scale.dtype != torch.float32 or scale.stride(0) != 1):
        raise ValueError(f"{op}: scale must be None or a contiguous (2,) float32 tensor; got "
                         + (describe("scale", scale) if isinstance(scale, torch.Tensor) else type(scale).__name__))
    if grad_output is not None and (not isinstance(grad_output, torch.Tensor) or not grad_output.is_floating_point()
                                    or tuple(grad_output.shape) not in ((), (rows,))):
        raise ValueError(f"{op}: grad_output must be None, 0-dim or ({rows},) floating; got "
                         + (describe("grad_output", grad_output) if isinstance(grad_output, torch.Tensor)
                            else type(grad_output).__name__))
    check_same_device(op, logits=logits, dlogits=dlogits, scale=scale, grad_output=grad_output)
    if uses_triton(logits) and logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{op}: the Triton kernel supports float32, bfloat16 and float16; got "
                        f"{describe('logits', logits)}")
    return loss_and_grad_unchecked(logits, target, dlogits, weight, options, scale, grad_output, config)


def loss_and_grad_unchecked(logits, target, dlogits, weight, options: CrossEntropyOptions, scale, grad_output, config,
                            scratch: bool = False):
    """``cross_entropy_loss_and_grad`` without its argument checks (for callers that validated them once, such
    as FLCE's chunk loop, which calls it once per chunk); ``options.reduction`` is not read. ``scratch``: the
    caller no longer needs ``logits``, so the plain CPU path may overwrite fp32 logits instead of working on a
    copy."""
    rows, n_cols = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    loss_rows, zl_rows, lse = torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty(rows, **f32)
    if rows == 0:
        return loss_rows, zl_rows, lse
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    if uses_triton(logits):
        if config is None:
            module, _, _ = kernel_module(CrossEntropySpace, logits, n_cols, rows)
        else:
            module = module_for("cross_entropy", config, ())
        module.forward(logits, target, weight, loss_rows, zl_rows, lse, None, dlogits, scale, grad_output,
                       *options.row)
        return loss_rows, zl_rows, lse
    # CPU without the interpreter: the closed form on an fp32 working copy (the logits themselves when they are
    # fp32 and ``scratch`` says the caller no longer needs them, as FLCE's chunk buffer)
    in_place = logits.dtype == torch.float32 and (scratch or dlogits is logits)
    z = logits if in_place else logits.to(torch.float32, copy=True)
    ce, zl, row_lse = ce_rows_closed_form_(z, target, weight, options, scale, grad_output,
                                           want_grad=dlogits is not None)
    torch.add(ce, zl, out=loss_rows)
    zl_rows.copy_(zl)
    lse.copy_(row_lse)
    if dlogits is not None and dlogits is not z:
        dlogits.copy_(z)
    return loss_rows, zl_rows, lse
