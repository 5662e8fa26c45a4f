"""FP8 quantization along both axes in one op ("cast + transpose"): the two operands an FP8 linear layer makes of
each activation and each gradient. Search space, tuning problem, custom op and the public op.

    rows:  q[i, :]  = rne_fp8(x[i, :] · 2^s_i),  s_i = floor(log2(fp8_max / max_j |x_ij|)),  dequant_rows = 2^-s_i
    cols:  qᵀ[j, :] = rne_fp8(x[:, j] · 2^t_j),  t_j = floor(log2(fp8_max / max_i |x_ij|)),  dequant_cols = 2^-t_j

The recipe (and its plain-PyTorch truth, ``quantize_reference``) is ``liger_gen.runtime.fp8``'s; the result is
bit for bit ``fp8_quantize(x, "rows")`` and ``fp8_quantize(x, "cols")``. The forward's input x needs its rows
(the forward GEMM) and its columns (the weight gradient's GEMM, over the tokens); the output gradient dy needs
its rows (the input gradient's GEMM) and its columns (the weight gradient's). Done as one op, x is read twice
(an amax pass over both axes, then one cast that writes both layouts) instead of three or four times; a kernel
that produced x and computed its amaxes skips the amax pass. Kernels: ``templates/fp8_cast_transpose.py.jinja``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import Problem
from liger_gen.codegen.spaces import KernelConfig, Param
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.fp8.quantize import (FORMAT_NAMES, FORMATS, QuantizeProblem, QuantizeSpace, checked_2d,
                                        operand_widths)
from liger_gen.runtime import fp8 as recipe
from liger_gen.runtime.binding import Kernel
from liger_gen.runtime.ops import interpreter_enabled, kernel_module, transforms_active, use_custom_op, uses_triton

# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class CastTransposeConfig(KernelConfig):
    """Launch settings of the two kernels: the amax pass's BLOCK_M_AMAX x BLOCK_K_AMAX tile, the TILES_AMAX tiles
    each program walks down its column block (one atomic max per tile row, one per column per program) and its
    warps, and the cast's BLOCK_M x BLOCK_K tile and warps (read once, written in place and transposed)."""

    BLOCK_M_AMAX: int
    BLOCK_K_AMAX: int
    TILES_AMAX: int
    num_warps_amax: int
    BLOCK_M: int
    BLOCK_K: int
    num_warps: int


class CastTransposeSpace(QuantizeSpace):
    """Search space, constraints and heuristic of the cast + transpose op for one width (dims
    ``{"n_cols": K}``) and input dtype; the FP8 format is a render-time variant with its own table entries. One
    phase ("fwd"): the op is not differentiable, and its two kernels run as one call. The tiles' checks are the
    single-axis quantize's, and an amax pass that walks several tiles counts its int32 column accumulator among
    the values each thread holds."""

    op = "fp8_cast_transpose"
    template = "fp8_cast_transpose"
    config_cls = CastTransposeConfig
    DIMS = ("n_cols",)
    phases = ("fwd",)
    AMAX_TILE = (32, 256)  # the heuristic's amax tile: 32 values per thread at 8 warps
    AMAX_ROWS = 256  # the rows a program of the heuristic's amax pass walks: an eighth of one tile's column atomics
    CAST_TILE = (64, 64)  # the heuristic's cast tile, as the single-axis cols quantize's
    _BLOCK_M_AMAX = (1, 2, 4, 8, 16, 32, 64, 128)
    _BLOCK_K_AMAX = tuple(2 ** k for k in range(4, 15))  # 16 .. 16384
    _TILES_AMAX = (1, 2, 4, 8, 16, 32, 64)
    _BLOCK_M = (8, 16, 32, 64, 128)  # the transposed store writes BLOCK_M consecutive bytes per column
    _BLOCK_K = (16, 32, 64, 128, 256)
    _WARPS = (1, 2, 4, 8, 16)
    PARAMS = (
        Param("BLOCK_M_AMAX", _BLOCK_M_AMAX, "fwd"), Param("BLOCK_K_AMAX", _BLOCK_K_AMAX, "fwd"),
        Param("TILES_AMAX", _TILES_AMAX, "fwd"), Param("num_warps_amax", _WARPS, "fwd"),
        Param("BLOCK_M", _BLOCK_M, "fwd"), Param("BLOCK_K", _BLOCK_K, "fwd"), Param("num_warps", _WARPS, "fwd"),
    )

    def heuristic(self) -> CastTransposeConfig:
        """Analytic default, valid for every n_cols: 32 x 256 amax tiles at 8 warps, each program walking
        ``AMAX_ROWS`` rows; 64 x 64 cast tiles at 4 warps (narrower where the row is narrower)."""
        block_m, block_k, warps = self.tile(*self.AMAX_TILE, 8)
        return self.checked(CastTransposeConfig(block_m, block_k, self.AMAX_ROWS // block_m, warps,
                                                *self.tile(*self.CAST_TILE, 4)))

    def shape_violations(self, config: CastTransposeConfig) -> list[str]:
        problems = self.tiles_violations((("amax", config.BLOCK_M_AMAX, config.BLOCK_K_AMAX, config.num_warps_amax),
                                          ("cast", config.BLOCK_M, config.BLOCK_K, config.num_warps)))
        # walking several tiles keeps an int32 column accumulator of the tile's size beside the tile itself
        held = 2 * config.BLOCK_M_AMAX * config.BLOCK_K_AMAX / (32 * config.num_warps_amax)
        if config.TILES_AMAX > 1 and held > self.MAX_ELEMS_PER_THREAD >= held / 2:
            problems.append(f"amax: {held:.0f} values per thread with the column accumulator of TILES_AMAX="
                            f"{config.TILES_AMAX} > {self.MAX_ELEMS_PER_THREAD} (spills)")
        return problems


# ------------------------------------------------------------------------------------------------ tuning


class CastTransposeProblem(QuantizeProblem):
    """Quantize (rows, n_cols) of ``dtype`` into ``fp8`` along both axes in one call: the single-axis quantize's
    inputs, truth (``quantize_reference``, matched exactly) and outputs (``q_rows``, ``d_rows``, ``q_cols``,
    ``d_cols``), with one phase that writes all four."""

    SPACE = CastTransposeSpace
    # minimal bytes: x read once (the amax pass reads it a second time), both layouts and their scales written
    BYTES_FORMULA = "R·H·s + R·H + R·4 + H·⌈R⌉₁₆ + H·4"

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        single = QuantizeProblem.phase_bytes(dims, s)
        return {"fwd": single["fwd"] + single["bwd"] - dims["rows"] * dims["n_cols"] * s}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, fp8: str = "e4m3", seed: int = 0,
                 limits=None):
        super().__init__(dtype, dims, rows, device, fp8=fp8, seed=seed, limits=limits)
        self.outputs = {"fwd": ("q_rows", "q_cols")}

    def launcher(self, module, phase: str):
        b, exact = self.buffers, interpreter_enabled()
        return lambda: module.cast_transpose(b["x"], b["q_rows"], b["d_rows"], b["q_cols"], b["d_cols"], exact)

    def check(self, module, phase: str) -> str | None:
        """Run the op once on poisoned scales; None if both layouts dequantize to the truth exactly."""
        self.buffers["d_rows"].fill_(float("nan"))
        self.buffers["d_cols"].fill_(float("nan"))
        self.launcher(module, phase)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.compare("rows") or self.compare("cols")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The activations and gradients a decoder's linear layers quantize along both axes, one problem per token
    count and width (``operand_widths``: hidden, intermediate and the attention widths)."""
    return [CastTransposeProblem(dtype, {"n_cols": k}, r, device, seed=seed)
            for r in rows for k in operand_widths(model)]


SPEC = OpSpec("fp8_cast_transpose", CastTransposeSpace, CastTransposeProblem, tuning_problems,
              custom_ops=("liger_gen::fp8_cast_transpose",))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _impl(x: torch.Tensor, fp8: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (M, K), dequant_rows (M, 1), qt (K, Mp) contiguous with zero columns past M, dequant_cols (K, 1)) of
    x (M, K) with unit column stride."""
    m, k = x.shape
    dtype = FORMATS[fp8]
    if not uses_triton(x) or x.numel() == 0:  # (an empty slice's amax counts as 0: an all-zero slice's scale)
        return recipe.operands_reference(x, fp8_dtype=dtype)
    qt = torch.empty((k, recipe.padded(m)), dtype=dtype, device=x.device)
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    d_rows = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    d_cols = torch.empty((k, 1), dtype=torch.float32, device=x.device)
    module, _, _ = kernel_module(CastTransposeSpace, x, k, m, fp8=fp8)
    module.cast_transpose(x, q, d_rows.view(-1), qt, d_cols.view(-1), interpreter_enabled())
    return q, d_rows, qt, d_cols


def _fake(x, fp8):
    m, k = x.shape
    dtype = FORMATS[fp8]
    return (x.new_empty((m, k), dtype=dtype), x.new_empty((m, 1), dtype=torch.float32),
            x.new_empty((k, recipe.padded(m)), dtype=dtype), x.new_empty((k, 1), dtype=torch.float32))


fp8_cast_transpose_op = Kernel("fp8_cast_transpose", _impl, _fake)


def cast_transpose_2d(x: torch.Tensor, fp8: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_cast_transpose`` without the checks, for callers that made x 2-D with unit column stride."""
    # a graph being recorded, or a torch.func transform (whose wrapped tensors the kernels cannot read), takes the
    # custom op
    return fp8_cast_transpose_op.op(x, fp8) if use_custom_op() or transforms_active() else _impl(x, fp8)


# ------------------------------------------------------------------------------------------------ public op


def fp8_cast_transpose(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to FP8 with one power-of-two scale per row and, separately, one per column: both
    results of ``fp8_quantize`` (axis "rows" and axis "cols"), bit for bit, from one read of x's values for the
    cast (the recipe of ``liger_gen.runtime.fp8``: dynamic scales, ``scale = 2^floor(log2(fp8_max / amax))``,
    round to nearest even).

    Args:
        x: (M, K) float32, bfloat16 or float16, any strides.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        (q, dequant_rows, qt, dequant_cols): q (M, K) in ``fp8_dtype`` and dequant_rows (M, 1) fp32, one scale
        per row; qt (K, Mp) contiguous, Mp = M rounded up to a multiple of 16 (zeros past M), and dequant_cols
        (K, 1) fp32, one scale per column, transposed (the layout of the weight-gradient GEMM's operands).
        ``q.float() * dequant_rows`` and ``(qt.float() * dequant_cols)[:, :M].t()`` are x up to FP8 rounding.
        A slice with a NaN has a NaN scale; one with an infinite element has dequant scale inf. Not
        differentiable.

    Raises:
        TypeError: x is not a float32 / bfloat16 / float16 tensor, or fp8_dtype is not an FP8 format.
        ValueError: x is not 2-D.
    """
    return cast_transpose_2d(*checked_2d("fp8_cast_transpose", x, fp8_dtype), FORMAT_NAMES[fp8_dtype])
