"""The FP8 training recipe: dynamic axiswise scales, e4m3 operands, ``torch._scaled_mm`` GEMMs.

This module is the recipe's definition and its plain-PyTorch reference, below ``ops/`` so that every kernel
that emits an FP8 operand (the standalone quantize op, and the norm and GLU kernels that fuse it) quantizes the
same way, bit for bit.

**Quantization of one slice** (a row of activations, a column of a weight, ...). With ``amax = max|x|`` over the
slice and ``E, m`` its binary exponent and mantissa (``amax = m·2^E``, ``1 ≤ m < 2``):

    s = (8 − E) − [m > 1.75]            # = floor(log2(448 / amax)), exactly, with no division
    scale = 2^s                          # a power of two: x·scale is exact in fp32
    q = round_to_nearest_even_e4m3(x · scale)
    dequant_scale = 2^−s                 # what ``torch._scaled_mm`` multiplies the GEMM's rows/columns by

so ``|x·scale| ≤ 448`` (e4m3's largest finite value) and nothing saturates. Power-of-two scales are the choice
of torchao's "rowwise" float8 recipe too; computing the exponent from amax's bits (not ``log2(448 / amax)`` in
floating point, which rounds up to the next integer just below a power of two) makes the kernels and this
reference agree exactly. ``amax`` below ``2^−90`` (an all-zero slice) counts as ``2^−90`` (``s = 98`` for e4m3):
slices of tiny gradients keep their digits, the scales stay normal fp32 numbers, and fp32 subnormal inputs
(below ``2^−126``) always quantize to 0, whatever a device does with subnormals.
Non-finite input is never hidden: a slice holding NaN gets a NaN scale (every element NaN), and a slice whose
amax is ±inf gets ``scale = 0`` and ``dequant_scale = inf``, so its finite elements quantize to 0, its infinite
ones to NaN, and every GEMM output that reads the slice is NaN, not a silent 0.

**Which axis each scale runs over.** A linear layer ``y = x·Wᵀ`` with ``x`` (M tokens, K in-features) and
``W`` (N out-features, K) has three GEMMs; each operand is scaled along the GEMM's non-reduced axis, so each
scale factors out of the dot product:

    forward   y  = x  · Wᵀ   x: per token (row, over K)          W: per out-feature (row of W, over K)
    dgrad     dx = dy · W    dy: per token (row, over N)          W: per in-feature (column of W, over N)
    wgrad     dW = dyᵀ · x   dy: per out-feature (column, over M) x: per in-feature (column, over M)

The weight gradient is why an activation needs a second copy scaled along the token axis. Gradients use e4m3
as well (torchao's rowwise recipe does the same; ``Float8Recipe.grad_dtype`` can select e5m2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: The largest finite value and the exponent-from-bits threshold of each FP8 format: ``max = t·2^EMAX``.
FP8_FORMATS = {E4M3: (448.0, 8, 0x600000), E5M2: (57344.0, 15, 0x600000)}  # 448 = 1.75·2^8, 57344 = 1.75·2^15
MIN_AMAX_EXPONENT = -90  # amax below 2^-90 (all-zero slices) is taken as 2^-90
#: cuBLASLt's FP8 GEMM takes K and N (and the wgrad's token count, padded here) in multiples of 16.
GEMM_MULTIPLE = 16
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores


@dataclass(frozen=True)
class Float8Recipe:
    """How ``apply_to(model, fp8=...)`` and ``fp8_linear`` train a linear layer in FP8.

    Attributes:
        grad_dtype: the FP8 format of the gradient operands of the backward GEMMs: ``torch.float8_e4m3fn``
            (default; more mantissa, as torchao's rowwise recipe) or ``torch.float8_e5m2`` (more range).
        keep_fp8_for_backward: the forward saves the input's token-axis FP8 copy (one byte per element) for the
            weight gradient instead of the bf16 input (two bytes): less activation memory, one more quantize
            in the forward. False re-quantizes the saved bf16 input in the backward.
        modules: name patterns (``fnmatch``, matched against the qualified module name) of the linear layers
            ``apply_to`` converts; the default is every linear layer of the decoder layers except MoE routers.
        fast_accum: the forward GEMM uses the tensor cores' fast FP8 accumulation (default True, as torchao's
            rowwise recipe does); the two backward GEMMs always accumulate at full precision.
    """

    grad_dtype: torch.dtype = E4M3
    keep_fp8_for_backward: bool = True
    modules: tuple[str, ...] = ()
    fast_accum: bool = True

    def __post_init__(self):
        if self.grad_dtype not in (E4M3, E5M2):
            raise ValueError(f"Float8Recipe: grad_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
                             f"{self.grad_dtype!r}")
        if not isinstance(self.fast_accum, bool):
            raise TypeError(f"Float8Recipe: fast_accum must be a bool, got {self.fast_accum!r} "
                            f"({type(self.fast_accum).__name__})")
        if not isinstance(self.keep_fp8_for_backward, bool):
            raise TypeError(f"Float8Recipe: keep_fp8_for_backward must be a bool, got {self.keep_fp8_for_backward!r} "
                            f"({type(self.keep_fp8_for_backward).__name__})")
        if isinstance(self.modules, str) or not isinstance(self.modules, (tuple, list)) \
                or not all(isinstance(p, str) and p for p in self.modules):
            raise TypeError(f"Float8Recipe: modules must be a tuple of non-empty name patterns, got "
                            f"{self.modules!r}")
        object.__setattr__(self, "modules", tuple(self.modules))  # a list: hashable, as a frozen recipe must be


def scale_exponent(amax: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``floor(log2(fp8_max / amax))`` as int32, exactly, from amax's bits (fp32, non-negative or NaN).

    amax below ``2^MIN_AMAX_EXPONENT`` counts as that; the result for inf and NaN amax is meaningless (the
    callers mask it; see ``scales``)."""
    _, emax, threshold = FP8_FORMATS[fp8_dtype]
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    below = exponent < MIN_AMAX_EXPONENT
    exponent = torch.where(below, torch.full_like(exponent, MIN_AMAX_EXPONENT), exponent)
    mantissa = torch.where(below, torch.zeros_like(bits), bits & 0x7FFFFF)
    return (emax - exponent) - (mantissa > threshold).to(torch.int32)


def scales(amax: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, dequant_scale), fp32 of amax's shape, of slices with maximum magnitude ``amax`` (see the module
    docstring): ``2^s`` and ``2^−s``; NaN and NaN for a NaN amax; 0 and inf for an infinite amax."""
    s = scale_exponent(amax, fp8_dtype)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float32), s)
    dequant = torch.ldexp(torch.ones_like(amax, dtype=torch.float32), -s)
    amax = amax.to(torch.float32)
    nan = torch.full_like(scale, float("nan"))
    inf = torch.isinf(amax)
    scale = torch.where(inf, torch.zeros_like(scale), torch.where(torch.isnan(amax), nan, scale))
    dequant = torch.where(inf, torch.full_like(dequant, float("inf")), torch.where(torch.isnan(amax), nan, dequant))
    return scale, dequant


def quantize_reference(x: torch.Tensor, dim: int, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's quantization of ``x`` with one scale per slice along ``dim`` (the reduced axis), in plain
    PyTorch: the truth the kernels must match bit for bit.

    Args:
        x: floating tensor, any shape (CPU or CUDA).
        dim: the axis each amax reduces over (``-1``: one scale per row).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        (q, dequant_scale): q of x's shape in ``fp8_dtype``; dequant_scale fp32 with ``dim`` kept as size 1, such
        that ``q.float() · dequant_scale`` approximates x.
    """
    if fp8_dtype not in FP8_FORMATS:
        raise ValueError(f"quantize_reference: fp8_dtype must be one of {list(FP8_FORMATS)}, got {fp8_dtype!r}")
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=dim, keepdim=True) if xf.numel() else xf.new_zeros(
        tuple(1 if i == dim % max(x.dim(), 1) else n for i, n in enumerate(x.shape)))
    if xf.numel():  # amax ignores NaN on some builds: make a NaN in the slice give a NaN amax
        amax = torch.where(torch.isnan(xf).any(dim=dim, keepdim=True), torch.full_like(amax, float("nan")), amax)
    scale, dequant = scales(amax, fp8_dtype)
    return (xf * scale).to(fp8_dtype), dequant


def columns_reference(x: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns operand of 2-D x (M, K) laid out as the kernels write it, in plain PyTorch: (K, Mp) ``fp8_dtype``
    with Mp = ``padded(M)`` and zeros past the M tokens (the weight gradient's GEMM needs the multiple), row-major,
    and the (K, 1) dequant scales. No in-place write and no FP8 ``cat`` (which ``torch.autocast`` cannot take)."""
    q, dequant = quantize_reference(x, 0, fp8_dtype)
    m, k = x.shape
    qt = torch.nn.functional.pad(q.view(torch.uint8).t().contiguous(), (0, padded(m) - m)).view(fp8_dtype)
    return qt, dequant.reshape(k, 1)


def operands_reference(x: torch.Tensor, cols: bool = True, fp8_dtype: torch.dtype = E4M3) -> tuple:
    """Both operands of 2-D x as the kernels lay them out, in plain PyTorch: (q (M, K), dequant_rows (M, 1), qt
    (K, Mp), dequant_cols (K, 1)) (``quantize_reference`` per row, ``columns_reference``); the last two None
    unless ``cols``."""
    return (*quantize_reference(x, -1, fp8_dtype), *(columns_reference(x, fp8_dtype) if cols else (None, None)))


def operand_mismatch(x: torch.Tensor, q, d_rows, qt, d_cols, fp8_dtype: torch.dtype = E4M3) -> str | None:
    """Why operands a kernel wrote for 2-D x (M, K) differ from the recipe's quantization of x, or None: every
    dequantized value exactly (NaN where the recipe's is NaN) and the columns operand's padding past M zero. An
    axis given as None is not checked; the scales may be vectors or columns. The tuning problems' gate."""
    for axis, qq, dd in (("rows", q, d_rows), ("cols", qt, d_cols)):
        if qq is None:
            continue
        want_q, want_d = quantize_reference(x, -1 if axis == "rows" else 0, fp8_dtype)
        got = dequantize(qq, dd.reshape(-1, 1)).cpu()
        want = dequantize(want_q, want_d).cpu()
        if axis == "cols":
            if bool((got[:, x.shape[0]:] != 0).any()):
                return "the columns operand's padding past the last row is not zero"
            got, want = got[:, : x.shape[0]], want.t()
        same = (got == want) | (got.isnan() & want.isnan())
        if not bool(same.all()):
            return f"{int((~same).sum())} of {same.numel()} values of the {axis} operand differ from the recipe's"
    return None


def dequantize(q: torch.Tensor, dequant_scale: torch.Tensor) -> torch.Tensor:
    """``q`` (FP8) times its dequant scale (broadcast), in float64: the value the recipe's GEMMs multiply."""
    return q.to(torch.float64) * dequant_scale.to(torch.float64)


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm() -> bool:
    a = torch.zeros((16, 16), dtype=E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@torch.compiler.assume_constant_result  # torch.compile takes the answer as a constant, not a traced probe GEMM
def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on ``device``, or None when they can: CUDA GPUs of compute capability 8.9 or
    newer (FP8 tensor cores), and CPUs whose torch build has ``torch._scaled_mm`` with per-row scales (2.13 has;
    2.11 takes only per-tensor scales on the CPU). Cached per device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _unsupported_reason(device)


@functools.lru_cache(maxsize=None)
def _unsupported_reason(device: torch.device) -> str | None:
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device.index)
        if cc < MIN_CAPABILITY:
            return (f"{torch.cuda.get_device_name(device.index)} (compute capability {cc[0]}.{cc[1]}) has no FP8 "
                    f"tensor cores; they start at {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
        return None
    if device.type == "cpu":
        return None if _cpu_scaled_mm() else (f"this torch build ({torch.__version__}) has no CPU torch._scaled_mm "
                                              f"with per-row scales")
    return f"FP8 GEMMs run on CUDA GPUs and CPUs, not on {device.type}"


def gemm_dims_reason(in_features: int, out_features: int) -> str | None:
    """Why a linear layer of these dims cannot take the FP8 GEMM (cuBLASLt needs K and N in multiples of 16),
    or None."""
    bad = [f"{name}={n}" for name, n in (("in_features", in_features), ("out_features", out_features))
           if n % GEMM_MULTIPLE]
    return f"{' and '.join(bad)} not a multiple of {GEMM_MULTIPLE}" if bad else None


def padded(n: int) -> int:
    """``n`` rounded up to the FP8 GEMM's multiple (the wgrad's token axis is padded with zeros to this)."""
    return -(-n // GEMM_MULTIPLE) * GEMM_MULTIPLE


def scaled_mm(a: torch.Tensor, a_dequant: torch.Tensor, b: torch.Tensor, b_dequant: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``(a · a_dequant) @ (b · b_dequant)`` through ``torch._scaled_mm`` (cuBLASLt on CUDA).

    a: (M, K) FP8, row-major; a_dequant: (M, 1) fp32. b: (K, N) FP8, column-major (``bt.t()`` of a contiguous
    (N, K)); b_dequant: (1, N) fp32. Returns (M, N) in ``out_dtype`` (bf16 on CUDA for axiswise scales).
    ``fast_accum``: cuBLASLt/CUTLASS's fast FP8 accumulation (partial sums kept in the tensor cores' reduced
    precision between promotions; the CPU ignores it).
    """
    return torch._scaled_mm(a, b, scale_a=a_dequant, scale_b=b_dequant, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)
