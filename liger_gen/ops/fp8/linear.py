"""The FP8 linear layer: ``y = x · Wᵀ + b`` with its three GEMMs in FP8 through ``torch._scaled_mm``.

The recipe and which axis each scale runs over are ``liger_gen.runtime.fp8``'s (its module docstring has the
table). Forward: x per token and W per out-feature (rows). Backward: dy per token and W per in-feature for the
input gradient; dy and x per feature over the tokens (``axis="cols"``, transposed and zero-padded to a multiple of
16 tokens, which the GEMM needs) for the weight gradient. The GEMMs are cuBLASLt's (CPU: PyTorch's reference
kernel); the quantization runs the tuned ``fp8_cast_transpose`` kernels where a tensor needs both of its
operands (x when its weight has a gradient, dy when x and W both have one) and ``fp8_quantize``'s where it needs
one (the weights, a frozen layer's x). The outputs, and the gradients of x and W, are bf16 GEMM outputs (W's
cast to its dtype); the bias gradient is summed in fp32.
"""

from __future__ import annotations

import math

import torch

from liger_gen.codegen.problems import Inputs, Problem, randn
from liger_gen.ops.fp8.cast_transpose import cast_transpose_2d
from liger_gen.ops.fp8.quantize import FORMAT_NAMES, FORMATS, quantize_2d
from liger_gen.runtime import fp8 as fp8r
from liger_gen.runtime.binding import Differentiable, Kernel, saved
from liger_gen.runtime.fp8_operands import GRADS, LAST_INPUT, eager_tensor
from liger_gen.runtime.ops import check_same_device, check_tensor, describe

OUT_DTYPE = torch.bfloat16  # cuBLASLt's axiswise-scaled FP8 GEMM writes bf16
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------------ references


def fp8_linear_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The forward as the recipe defines it, in float64: the dequantized operands' product (x's rows and W's rows
    quantized to e4m3 by ``quantize_reference``), plus the bias. x (..., K), weight (N, K) → (..., N) float64."""
    xq, xd = fp8r.quantize_reference(x.reshape(-1, x.shape[-1]), -1)
    wq, wd = fp8r.quantize_reference(weight, -1)
    y = fp8r.dequantize(xq, xd) @ fp8r.dequantize(wq, wd).t()
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_grads_float64(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
                             grad_dtype: torch.dtype = fp8r.E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) as the recipe defines them, in float64: dx from dy's rows and W's columns, dW from dy's and x's
    columns (over the tokens), each operand quantized by ``quantize_reference``."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dyq, dyd = fp8r.quantize_reference(dy2, -1, grad_dtype)
    wq, wd = fp8r.quantize_reference(weight, 0)
    dx = fp8r.dequantize(dyq, dyd) @ fp8r.dequantize(wq, wd)
    dytq, dytd = fp8r.quantize_reference(dy2, 0, grad_dtype)
    xq, xd = fp8r.quantize_reference(x2, 0)
    dw = fp8r.dequantize(dytq, dytd).t() @ fp8r.dequantize(xq, xd)
    return dx.reshape(x.shape), dw


# ------------------------------------------------------------------------------------------------ bench shapes


class Fp8LinearProblem(Problem):
    """``fp8_linear`` at a decoder's MLP input projection (gate or up: hidden → intermediate features) for
    ``liger-gen bench``: its inputs, the recipe's float64 truth, bytes and FLOPs. Not a tuning problem (there is
    no space): the GEMMs are cuBLASLt's, and the quantize kernels are tuned as their own ops. The activations
    and the weight are bf16 whatever the bench's dtype: the FP8 GEMMs take and write bf16."""

    op = "fp8_linear"
    OUTPUTS = ("y",)
    ACTIVATION_DTYPE = torch.bfloat16
    # bf16 x, W, y, dy, dx, dW once each; each FP8 operand written once and read once by its GEMM (x and dy:
    # rows and columns, the token axis padded to 16; W: rows and columns)
    BYTES_FORMULA = "2·2·(R·K + N·K + R·N) + 2·(R·K + K·⌈R⌉₁₆ + 2·N·K + R·N + N·⌈R⌉₁₆)"
    FLOPS_FORMULA = "6·R·K·N"

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {"in_features": model.hidden_size, "out_features": model.intermediate_size}

    @classmethod
    def space_dims(cls, dims) -> dict[str, int]:
        return {}  # no table of its own

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        r, k, n = dims["rows"], dims["in_features"], dims["out_features"]
        bf16 = cls.ACTIVATION_DTYPE
        return Inputs({"x": randn(gen, (r, k), bf16, device), "weight": randn(gen, (n, k), bf16, device, k ** -0.5)},
                      grad_of=("x", "weight"), upstream={"y": randn(gen, (r, n), bf16, device)})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        """y, dx and dweight as the recipe defines them, in float64 (``fp8_linear_float64``, ``_grads_float64``)."""
        x, w, dy = inputs.tensors["x"], inputs.tensors["weight"], inputs.upstream["y"]
        dx, dw = fp8_linear_grads_float64(x, w, dy)
        return {"y": fp8_linear_float64(x, w), "dx": dx, "dweight": dw}

    @classmethod
    def step_bytes(cls, dims, s: int) -> int:
        r, k, n = dims["rows"], dims["in_features"], dims["out_features"]
        rp = fp8r.padded(r)
        return 2 * 2 * (r * k + n * k + r * n) + 2 * (r * k + k * rp + 2 * n * k + r * n + n * rp)

    @classmethod
    def step_flops(cls, dims) -> int:
        return 6 * dims["rows"] * dims["in_features"] * dims["out_features"]


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, keep_fp8: bool, grad_fp8: str,
              fast_accum: bool,
              xq: torch.Tensor | None = None, xd: torch.Tensor | None = None, xtq: torch.Tensor | None = None,
              xtd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y (M, N) bf16 of x (M, K) bf16 with unit column stride, weight (N, K), bias (N,) or None; and, when
    ``keep_fp8`` and ``xtq`` is not given, x's token-axis operand for the weight gradient ((K, Mp) FP8 and
    (K, 1) fp32), else two empty tensors. ``xq, xd`` (x's rows) and ``xtq, xtd`` (its columns), when given, are
    x's quantization made once for the projections that share x (``shared_operands``). ``fast_accum``: the GEMM
    accumulates in the tensor cores' faster, less precise mode (``Float8Recipe.fast_accum``)."""
    own_cols = keep_fp8 and xtq is None  # this call makes (and returns) x's token-axis operand
    if own_cols and (xq is None or xd is None):  # both of x's operands from one op (fp8_cast_transpose)
        xq, xd, xtq, xtd = cast_transpose_2d(x, "e4m3")
    elif xq is None or xd is None:
        xq, xd = quantize_2d(x, "rows", "e4m3")
    if own_cols and xtq is None:
        xtq, xtd = quantize_2d(x, "cols", "e4m3")
    wq, wd = quantize_2d(weight if weight.stride(-1) == 1 else weight.contiguous(), "rows", "e4m3")
    y = fp8r.scaled_mm(xq, xd, wq.t(), wd.t(), OUT_DTYPE, fast_accum)
    if bias is not None:
        y += bias.to(OUT_DTYPE)
    if not own_cols:
        xtq, xtd = x.new_empty((0,), dtype=fp8r.E4M3), x.new_empty((0,), dtype=torch.float32)
    return y, xtq, xtd


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor | None, xtq: torch.Tensor, xtd: torch.Tensor, weight: torch.Tensor,
              grad_fp8: str, need_dx: bool, need_dw: bool, need_bias: bool,
              dyq: torch.Tensor | None = None, dyd: torch.Tensor | None = None, dytq: torch.Tensor | None = None,
              dytd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (M, K) bf16, dW (N, K) in weight's dtype, db (N,) fp32) of dy (M, N), each an empty tensor when not
    needed; x is the saved input when its FP8 copy was not kept (``xtq`` empty). ``dyq, dyd, dytq, dytd``, when
    given, are dy's two operands as the kernel that produced dy wrote them (``glu_fp8``'s backward)."""
    m = dy.shape[0]
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    # dy per token for the input gradient, over the tokens for the weight gradient (none without features: xtq is
    # empty then, which is not "not kept", and dW is (N, 0)); both from one op where both are needed
    need_cols = bool(need_dw and m and weight.shape[1])
    if dyq is not None:
        pass  # both operands came with dy
    elif need_dx and need_cols:
        dyq, dyd, dytq, dytd = cast_transpose_2d(dy, grad_fp8)
    elif need_dx:
        dyq, dyd = quantize_2d(dy, "rows", grad_fp8)
    elif need_cols:
        dytq, dytd = quantize_2d(dy, "cols", grad_fp8)
    if need_dx:
        wtq, wtd = quantize_2d(weight if weight.stride(-1) == 1 else weight.contiguous(), "cols", "e4m3")
        dx = fp8r.scaled_mm(dyq, dyd, wtq.t(), wtd.t(), OUT_DTYPE)  # (K, N) W: N is a multiple of 16, no padding
    else:
        dx = dy.new_empty((0,), dtype=OUT_DTYPE)
    if need_cols:
        if xtq.numel() == 0:
            xtq, xtd = quantize_2d(x, "cols", "e4m3")
        dw = fp8r.scaled_mm(dytq, dytd, xtq.t(), xtd.t(), OUT_DTYPE).to(weight.dtype)
    else:
        dw = torch.zeros_like(weight) if need_dw else weight.new_empty((0,))
    db = dy.sum(0, dtype=torch.float32) if need_bias else dy.new_empty((0,), dtype=torch.float32)
    return dx, dw, db


def _fwd_fake(x, weight, bias, keep_fp8, grad_fp8, fast_accum, xq=None, xd=None, xtq=None, xtd=None):
    m, k = x.shape
    if keep_fp8 and xtq is None:
        return (x.new_empty((m, weight.shape[0]), dtype=OUT_DTYPE),
                x.new_empty((k, fp8r.padded(m)), dtype=fp8r.E4M3), x.new_empty((k, 1), dtype=torch.float32))
    return (x.new_empty((m, weight.shape[0]), dtype=OUT_DTYPE), x.new_empty((0,), dtype=fp8r.E4M3),
            x.new_empty((0,), dtype=torch.float32))


def _bwd_fake(dy, x, xtq, xtd, weight, grad_fp8, need_dx, need_dw, need_bias, dyq=None, dyd=None, dytq=None,
              dytd=None):
    m, k = dy.shape[0], weight.shape[1]
    return (dy.new_empty((m, k) if need_dx else (0,), dtype=OUT_DTYPE),
            torch.empty_like(weight) if need_dw else weight.new_empty((0,)),
            dy.new_empty((weight.shape[0] if need_bias else 0,), dtype=torch.float32))


fp8_linear_fwd = Kernel("fp8_linear_fwd", _fwd_impl, _fwd_fake)
fp8_linear_bwd = Kernel("fp8_linear_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    x, weight, bias, keep_fp8, grad_fp8, _fast, _xq, _xd, given_xtq, given_xtd = (*inputs, None, None, None, None)[:10]
    _, xtq, xtd = output
    if given_xtq is not None:  # the shared copy: saved once for every projection of x
        xtq, xtd = given_xtq, given_xtd
    # x itself only for a weight gradient without the FP8 copy
    saved(ctx, None if keep_fp8 or not weight.requires_grad else x, xtq, xtd, weight)
    ctx.grad_fp8, ctx.bias_dtype = grad_fp8, None if bias is None else bias.dtype


def _backward(ctx, dy, _dxtq, _dxtd):
    if dy is None:
        return (None,) * 10
    x, xtq, xtd, weight = ctx.saved_tensors
    need_bias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    # dy's operands, when the kernel that wrote dy wrote them too (e4m3: the only format those kernels emit)
    given = GRADS.take(dy) if ctx.eager and ctx.grad_fp8 == "e4m3" else None
    dx, dw, db = fp8_linear_bwd.run(ctx, dy, x, xtq, xtd, weight, ctx.grad_fp8, ctx.needs_input_grad[0],
                                    ctx.needs_input_grad[1], need_bias, *(given or ()))
    return ((dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None),
            (db.to(ctx.bias_dtype) if need_bias else None), None, None, None, None, None, None, None)


fp8_linear_2d = Differentiable(fp8_linear_fwd, _save, _backward, reference="torch.nn.functional.linear", outputs=1)
"""(y,) of x (M, K) bf16 with unit column stride: the FP8 linear, differentiable in x, weight and bias."""


# ------------------------------------------------------------------------------------------------ public op


def check_fp8_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The checks of ``fp8_linear`` (also ``Float8Linear``'s): dtypes, shapes, the GEMM's multiples, device."""
    check_tensor(op, "x", x, dtypes=(torch.bfloat16,), min_dim=1)
    check_tensor(op, "weight", weight, dtypes=WEIGHT_DTYPES, min_dim=2)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight must be (out_features, {x.shape[-1]}) for {describe('x', x)}; got "
                         f"{describe('weight', weight)}")
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=WEIGHT_DTYPES)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must be ({weight.shape[0]},); got {describe('bias', bias)}")
    reason = fp8r.gemm_dims_reason(weight.shape[1], weight.shape[0])
    if reason:
        raise ValueError(f"{op}: the FP8 GEMM cannot take {describe('weight', weight)}: {reason}")
    check_same_device(op, x=x, weight=weight, bias=bias)
    # the device's capability is a host fact: checked in eager calls (torch.compile's trace would record a probe)
    reason = None if torch.compiler.is_compiling() else fp8r.fp8_unsupported_reason(x.device)
    if reason:
        raise RuntimeError(f"{op}: {reason} ({describe('x', x)}); use torch.nn.functional.linear")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: fp8r.Float8Recipe | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` with its forward and backward GEMMs in FP8 (``torch._scaled_mm``).

    ``y = x · Wᵀ + b``, with x quantized per token, W per out-feature (forward), dy per token and W per
    in-feature (input gradient), dy and x per feature over the tokens (weight gradient): e4m3 operands (the
    gradients' format is ``recipe.grad_dtype``) with dynamic power-of-two scales; the recipe is
    ``liger_gen.runtime.fp8``'s, as torchao's "rowwise" float8 training recipe.

    Args:
        x: (..., K) bfloat16, any strides.
        weight: (N, K) bfloat16 or float32 (quantized from its own dtype); K and N multiples of 16.
        bias: (N,) or None.
        recipe: a ``Float8Recipe`` (None: the defaults).

    Returns:
        y (..., N) bfloat16; differentiable in x, weight and bias (dW in weight's dtype).

    Raises:
        TypeError: x not bfloat16, weight or bias not bfloat16/float32, recipe not a Float8Recipe.
        ValueError: weight not (N, K) for x's K, K or N not a multiple of 16, bias not (N,), tensors on
            different devices.
        RuntimeError: the device has no FP8 GEMM (a GPU before compute capability 8.9).
    """
    op = "fp8_linear"
    if recipe is None:
        recipe = DEFAULT_RECIPE
    elif not isinstance(recipe, fp8r.Float8Recipe):
        raise TypeError(f"{op}: recipe must be a liger_gen.Float8Recipe, got {type(recipe).__name__}")
    check_fp8_linear(op, x, weight, bias)
    return linear_2d_call(x, weight, bias, recipe)


def linear_2d_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   recipe: fp8r.Float8Recipe, source: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear`` after its checks: flatten the leading dims, quantize x once for the projections that share
    it (``shared_operands``; ``source``: the tensor x was cast from, which the projections share under
    autocast), run the op, restore the leading dims."""
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    # the token-axis copy serves the weight gradient only: not kept for a frozen weight or without autograd
    keep = recipe.keep_fp8_for_backward and weight.requires_grad and torch.is_grad_enabled()
    shared = shared_operands(x if source is None else source, x2, keep)
    y = fp8_linear_2d(x2, weight, bias, keep, FORMAT_NAMES[recipe.grad_dtype], recipe.fast_accum, *shared)[0]
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def shared_operands(x: torch.Tensor, x2: torch.Tensor, keep: bool) -> tuple:
    """x's operands (rows q, dequant, and the token-axis qt, dequant or two Nones), quantized once for the
    projections that read x: attention's q, k and v projections (and the MLP's gate and up) read one tensor,
    which is then quantized once, and its token-axis copy saved once for their weight gradients instead of three
    times. A kernel that produced x and wrote its operands (``rms_norm_fp8``, ``glu_fp8``) has offered them
    (``liger_gen.runtime.fp8_operands.LAST_INPUT``), and nothing is quantized. ``()`` under torch.compile and
    torch.func, and for inference tensors: every call quantizes (a compiled graph's buffers must not alias)."""
    if not eager_tensor(x):
        return ()
    operands = LAST_INPUT.get(x)
    # without the token-axis copy when the caller keeps none (a frozen weight, keep_fp8 False)
    if operands is not None and (not keep or operands[2] is not None):
        return operands if keep else (*operands[:2], None, None)
    with torch.no_grad():
        if keep:  # both operands from one op (fp8_cast_transpose)
            xq, xd, xtq, xtd = cast_transpose_2d(x2, "e4m3")
        else:
            (xq, xd), xtq, xtd = quantize_2d(x2, "rows", "e4m3"), None, None
    operands = (xq, xd, xtq, xtd)
    LAST_INPUT.offer(x, operands)
    return operands




DEFAULT_RECIPE = fp8r.Float8Recipe()
__all__ = ["fp8_linear", "fp8_linear_float64", "fp8_linear_grads_float64", "FORMATS"]
