"""FP8 quantization with one power-of-two scale per row or per column: search space, tuning problem, custom ops
and the public op.

    amax = max |x| over the slice;  s = floor(log2(fp8_max / amax));  q = rne_fp8(x · 2^s);  dequant = 2^-s

The recipe (and its plain-PyTorch truth, ``quantize_reference``) is ``liger_gen.runtime.fp8``'s. The standalone
kernels serve the linear layers with no fusable neighbour and the operands no other kernel writes (the weights,
and the gradients' token-axis copies); kernels: ``templates/fp8_quantize.py.jinja``, whose jit helpers
(``templates/fp8.jinja``) the fused norm and GLU variants import. ``axis="rows"`` keeps x's layout;
``axis="cols"`` writes q transposed and padded with zero rows to the FP8 GEMM's multiple, as the weight-gradient
GEMM takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import Inputs, Problem, randn
from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2
from liger_gen.codegen.spec import OpSpec
from liger_gen.runtime import fp8 as recipe
from liger_gen.runtime.binding import Kernel
from liger_gen.runtime.ops import (KERNEL_DTYPES, check_tensor, describe, interpreter_enabled, kernel_module,
                                   transforms_active, use_custom_op, uses_triton)

AXES = ("rows", "cols")
FORMATS = {"e4m3": recipe.E4M3, "e5m2": recipe.E5M2}
FORMAT_NAMES = {dtype: name for name, dtype in FORMATS.items()}

# ------------------------------------------------------------------------------------------------ space

PHASE_AXIS = {"fwd": "rows", "bwd": "cols"}


@dataclass(frozen=True)
class QuantizeConfig(KernelConfig):
    """Launch settings of the two quantize launchers, tuned separately: ``quantize_rows`` (the "fwd" phase: the
    forward's operands and dy per token) and ``quantize_cols`` (the "bwd" phase: the weight gradient's token-axis
    operands). Each has a BLOCK_M x BLOCK_K tile per program step and num_warps.

    Rows: a program owns BLOCK_M rows; rows of at most BLOCK_K columns are read once, wider ones twice.
    Cols: both kernels (column amax, quantize) use the same tile over a 2-D grid.
    """

    BLOCK_M_ROWS: int
    BLOCK_K_ROWS: int
    num_warps_rows: int = 4
    BLOCK_M_COLS: int = 64
    BLOCK_K_COLS: int = 64
    num_warps_cols: int = 4


class QuantizeSpace(Space):
    """Search space, constraints and heuristic of the quantize op for one width (dims ``{"n_cols": K}``) and
    input dtype; the FP8 format is a render-time variant with its own table entries."""

    op = "fp8_quantize"
    template = "fp8_quantize"
    config_cls = QuantizeConfig
    DIMS = ("n_cols",)
    TILE_TARGET = 8192  # elements per program step of the rows heuristic: 32 per thread at 8 warps
    COLS_TILE = (64, 64)  # the cols heuristic's tile: one column amax atomic per 64 rows
    MAX_ELEMS_PER_THREAD = 64  # fp32 values per thread before spills (x, its scaled copy): an estimate
    _BLOCK_M = (1, 2, 4, 8, 16, 32, 64, 128)
    _BLOCK_K = tuple(2 ** k for k in range(4, 15))  # 16 .. 16384
    _WARPS = (1, 2, 4, 8, 16)
    PARAMS = (
        Param("BLOCK_M_ROWS", _BLOCK_M, "fwd"), Param("BLOCK_K_ROWS", _BLOCK_K, "fwd"),
        Param("num_warps_rows", _WARPS, "fwd"),
        Param("BLOCK_M_COLS", _BLOCK_M, "bwd"), Param("BLOCK_K_COLS", _BLOCK_K, "bwd"),
        Param("num_warps_cols", _WARPS, "bwd"),
    )

    def check_dims(self) -> None:
        self.n_cols = self.dims["n_cols"]
        self.max_block_k = max(16, next_power_of_2(self.n_cols))

    def heuristic(self) -> QuantizeConfig:
        """Analytic default, valid for every n_cols. Rows: a whole row per tile up to 8192 columns, else
        8192-wide steps; ~8K-element tiles; warps to feed them. Cols: 64 x 64 tiles, 4 warps."""
        block_k = min(self.max_block_k, self.TILE_TARGET)
        rows = self.tile(max(1, min(128, self.TILE_TARGET // block_k)), block_k, 8)
        return self.checked(QuantizeConfig(*rows, *self.tile(*self.COLS_TILE, 4)))

    def tile(self, block_m: int, block_k: int, warps: int) -> tuple[int, int, int]:
        """(BLOCK_M, BLOCK_K, num_warps) of a heuristic tile: BLOCK_K no wider than the row's next power of two,
        at most ``warps`` warps with at least 8 values per thread."""
        block_k = min(block_k, self.max_block_k)
        return block_m, block_k, self.fit_warps(warps, block_m * block_k, 8)

    def checked(self, config):
        """``config``, asserted valid: the heuristic's."""
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for n_cols={self.n_cols}: {problems}"
        return config

    def shape_violations(self, config: QuantizeConfig) -> list[str]:
        return self.tiles_violations((("fwd", config.BLOCK_M_ROWS, config.BLOCK_K_ROWS, config.num_warps_rows),
                                      ("bwd", config.BLOCK_M_COLS, config.BLOCK_K_COLS, config.num_warps_cols)))

    def tiles_violations(self, tiles) -> list[str]:
        """The checks of (name, BLOCK_M, BLOCK_K, num_warps) tiles: no wider than the row's next power of two,
        threads and registers (``MAX_ELEMS_PER_THREAD``)."""
        return [p for name, block_m, block_k, warps in tiles
                for p in self.tile_violations(name, block_m, block_k, warps, self.n_cols, self.MAX_ELEMS_PER_THREAD)]


# ------------------------------------------------------------------------------------------------ tuning


class QuantizeProblem(Problem):
    """Quantize (rows, n_cols) of ``dtype`` into ``fp8``, per row ("fwd" phase) and per column ("bwd"): inputs,
    truth and the launchers.

    The outputs are the FP8 values and dequant scales of both axes: ``q_rows`` (M, K), ``d_rows`` (M, 1),
    ``q_cols`` (K, M; the op's padding past M left out), ``d_cols`` (K, 1). The truth is ``quantize_reference``
    (the recipe in plain PyTorch), which the kernels match exactly; the op is not differentiable.
    """

    SPACE = QuantizeSpace
    OUTPUTS = ("q_rows", "d_rows", "q_cols", "d_cols")
    # minimal bytes: x read once per axis (the cols launcher reads it twice: its amax pass, then the quantize),
    # q and the scales written; the cols output is padded to a multiple of 16 rows
    BYTES_FORMULA = "rows: R·H·s + R·H + R·4; cols: R·H·s + H·⌈R⌉₁₆ + H·4"

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {"n_cols": model.hidden_size}

    @classmethod
    def shapes(cls, model) -> list[dict[str, int]]:
        """Every operand width a decoder's FP8 linear layers quantize (``operand_widths``)."""
        return [{"n_cols": k} for k in operand_widths(model)]

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        return Inputs({"x": randn(gen, (dims["rows"], dims["n_cols"]), dtype, device)}, grad_of=(),
                      upstream=dict.fromkeys(cls.OUTPUTS), options={"fp8": options.get("fp8", "e4m3")})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        x, fmt = inputs.tensors["x"], FORMATS[inputs.options["fp8"]]
        q_rows, d_rows = recipe.quantize_reference(x, -1, fmt)
        q_cols, d_cols = recipe.quantize_reference(x, 0, fmt)
        return {"q_rows": q_rows.double(), "d_rows": d_rows.double(), "q_cols": q_cols.t().double(),
                "d_cols": d_cols.t().double()}

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        m, k = dims["rows"], dims["n_cols"]
        return {"fwd": m * k * s + m * k + m * 4, "bwd": m * k * s + k * recipe.padded(m) + k * 4}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, fp8: str = "e4m3", seed: int = 0,
                 limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits, variant={"fp8": fp8})
        self.fp8 = fp8
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {"fp8": fp8})
        x = inputs.tensors["x"]
        m, k = x.shape
        fmt = FORMATS[fp8]
        self.buffers = {"x": x,
                        "q_rows": torch.empty((m, k), dtype=fmt, device=self.device),
                        "d_rows": torch.empty(m, dtype=torch.float32, device=self.device),
                        "q_cols": torch.empty((k, recipe.padded(m)), dtype=fmt, device=self.device),
                        "d_cols": torch.empty(k, dtype=torch.float32, device=self.device)}
        ref = self.reference(inputs)
        self.ref = {axis: ref["q_" + axis] * ref["d_" + axis] for axis in AXES}  # the dequantized values
        self.tol = {axis: 0.0 for axis in AXES}
        self.outputs = {"fwd": ("q_rows",), "bwd": ("q_cols",)}

    def launcher(self, module, phase: str):
        b, exact = self.buffers, interpreter_enabled()
        axis = PHASE_AXIS[phase]
        launch = module.quantize_rows if axis == "rows" else module.quantize_cols
        return lambda: launch(b["x"], b["q_" + axis], b["d_" + axis], exact)

    def check(self, module, phase: str) -> str | None:
        """Run one launcher on poisoned scales; None if the dequantized values equal the truth exactly."""
        axis = PHASE_AXIS[phase]
        self.buffers["d_" + axis].fill_(float("nan"))
        self.launcher(module, phase)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.compare(axis)

    def compare(self, axis: str) -> str | None:
        """None if ``axis``'s output buffers dequantize to the truth exactly (and the cols padding is zero)."""
        got = recipe.dequantize(self.buffers["q_" + axis], self.buffers["d_" + axis][:, None])
        if axis == "cols":
            if bool((got[:, self.rows:] != 0).any()):
                return "q_cols: the padding past the last row is not zero"
            got = got[:, : self.rows]
        expected = self.ref[axis].to(got.device)
        same = (got == expected) | (got.isnan() & expected.isnan())
        if not bool(same.all()):
            return f"q_{axis}: {int((~same).sum())} of {same.numel()} dequantized values differ from the recipe's"
        return None


def operand_widths(model) -> tuple[int, ...]:
    """The widths of the operands a decoder's linear layers quantize, each once: ``hidden_size`` (the attention
    and MLP inputs; the gradients of o and down), ``intermediate_size`` (the down projection's input; the
    gradients of gate and up) and the attention widths (the gradients of q, and of k and v)."""
    return tuple(dict.fromkeys((model.hidden_size, model.intermediate_size,
                                model.num_attention_heads * model.head_dim,
                                model.num_key_value_heads * model.head_dim)))


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The operands a decoder's linear layers quantize, one problem per token count and width
    (``operand_widths``)."""
    return [QuantizeProblem(dtype, {"n_cols": k}, r, device, seed=seed) for r in rows for k in operand_widths(model)]


SPEC = OpSpec("fp8_quantize", QuantizeSpace, QuantizeProblem, tuning_problems,
              custom_ops=("liger_gen::fp8_quantize",))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _impl(x: torch.Tensor, axis: str, fp8: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, dequant) of x (M, K) with unit column stride: rows → q (M, K), dequant (M, 1); cols → q (K, Mp)
    contiguous with zero columns past M, dequant (K, 1)."""
    m, k = x.shape
    dtype = FORMATS[fp8]
    shape = (m, k) if axis == "rows" else (k, recipe.padded(m))
    if not uses_triton(x) or x.numel() == 0:
        # (an empty slice's amax counts as 0: the scale of an all-zero slice)
        return recipe.quantize_reference(x, -1, dtype) if axis == "rows" else recipe.columns_reference(x, dtype)
    q = torch.empty(shape, dtype=dtype, device=x.device)
    dequant = torch.empty((shape[0], 1), dtype=torch.float32, device=x.device)
    module, _, _ = kernel_module(QuantizeSpace, x, k, m, fp8=fp8)
    launch = module.quantize_rows if axis == "rows" else module.quantize_cols
    launch(x, q, dequant.view(-1), interpreter_enabled())
    return q, dequant


def _fake(x, axis, fp8):
    m, k = x.shape
    shape = (m, k) if axis == "rows" else (k, recipe.padded(m))
    return x.new_empty(shape, dtype=FORMATS[fp8]), x.new_empty((shape[0], 1), dtype=torch.float32)


fp8_quantize_op = Kernel("fp8_quantize", _impl, _fake)


def quantize_2d(x: torch.Tensor, axis: str, fp8: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize`` without the checks, for callers that made x 2-D with unit column stride."""
    # a graph being recorded, or a torch.func transform (whose wrapped tensors the kernels cannot read), takes the
    # custom op
    return fp8_quantize_op.op(x, axis, fp8) if use_custom_op() or transforms_active() else _impl(x, axis, fp8)


# ------------------------------------------------------------------------------------------------ public op


def fp8_quantize(x: torch.Tensor, axis: str = "rows",
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to FP8 with one power-of-two scale per row or per column (the recipe of
    ``liger_gen.runtime.fp8``: dynamic scales, ``scale = 2^floor(log2(fp8_max / amax))``, round to nearest even).

    Args:
        x: (M, K) float32, bfloat16 or float16, any strides.
        axis: "rows" — one scale per row (the input of ``torch._scaled_mm``'s first operand); "cols" — one scale
            per column (over the M rows), returned transposed: the layout of the weight-gradient GEMM's operands.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        (q, dequant_scale). axis="rows": q (M, K) in ``fp8_dtype``, dequant_scale (M, 1) fp32. axis="cols":
        q (K, Mp) contiguous with Mp = M rounded up to a multiple of 16 (zeros past M), dequant_scale (K, 1).
        ``q.float() * dequant_scale`` is x up to FP8 rounding. A slice with a NaN has a NaN scale; one with an
        infinite element has dequant_scale inf (its finite elements quantize to 0, its infinite ones to NaN),
        so nothing non-finite becomes a silent zero. Not differentiable.

    Raises:
        TypeError: x is not a float32 / bfloat16 / float16 tensor, or fp8_dtype is not an FP8 format.
        ValueError: x is not 2-D, or axis is not "rows" or "cols".
    """
    op = "fp8_quantize"
    if axis not in AXES:
        check_tensor(op, "x", x, dtypes=KERNEL_DTYPES)
        raise ValueError(f"{op}: axis must be one of {AXES}, got {axis!r}")
    return quantize_2d(*checked_2d(op, x, fp8_dtype), axis, FORMAT_NAMES[fp8_dtype])


def checked_2d(op: str, x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor]:
    """The checks of a public quantize op: x a 2-D float32 / bfloat16 / float16 tensor and fp8_dtype an FP8
    format; (x detached (the ops are not differentiable, on every path), with unit column stride,)."""
    check_tensor(op, "x", x, dtypes=KERNEL_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (M, K); got {describe('x', x)}")
    if fp8_dtype not in FORMAT_NAMES:
        raise TypeError(f"{op}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    x = x.detach()
    return (x if x.stride(-1) == 1 else x.contiguous(),)
