"""RMSNorm, or the residual add + RMSNorm, whose forward also writes the FP8 operands of its output: what a
decoder layer's FP8 projections (q, k, v after the input norm; gate and up after the post-attention norm) would
otherwise quantize from the norm's output in a separate op. Search space, tuning problem, custom op and the op.

    y     = RMSNorm(x) or RMSNorm(x + r)             (``rms_norm`` / ``fused_add_rms_norm``'s arithmetic)
    q, d  = y per row:    rne_e4m3(y · 2^a_i), 2^-a_i,  a_i = floor(log2(448 / max_j |y_ij|))
    qt, e = y per column: rne_e4m3(y · 2^b_j), 2^-b_j,  b_j = floor(log2(448 / max_i |y_ij|)), transposed

The operands are those of ``fp8_cast_transpose(y)`` (``liger_gen.runtime.fp8``'s recipe), bit for bit. How the
work is split is a tuned choice (``EMIT``): the norm kernel writes the rows operand itself (its row is in
registers) and the cast kernel only the columns, or the norm kernel writes both axes' amaxes and the cast kernel
both operands. The backward is the plain norms' (``rms_norm_bwd``, ``fused_add_rms_norm_bwd``): y and the sum
are differentiable, the FP8 operands are not. Kernels: ``templates/rms_norm_fp8.py.jinja``.

y and the sum are those of ``rms_norm`` / ``fused_add_rms_norm`` bit for bit where the kernels' row reductions add
in the same order: always in Triton's CPU interpreter and on the plain-PyTorch path; on a GPU the order follows
the number of warps, which each op's table chooses, so y may differ from the plain norm's in its last bit (each is
a correctly computed RMSNorm, and the operands always match the y this op returns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from liger_gen.codegen.problems import FP32_OUT_TOL, REL_TOL, STAT_BYTES, Inputs, Problem, rel_l2
from liger_gen.codegen.spaces import Param, Space, next_power_of_2
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.norms.fused_add_rms_norm import (FusedAddRMSNormProblem, fused_add_rms_norm_bwd,
                                                    fused_add_rms_norm_torch)
from liger_gen.ops.norms.rms_norm import RMSNormSpace, rms_norm_bwd
from liger_gen.ops.norms.row_norm import (DecoderNormProblem, RowNormForwardConfig, RowNormSpace, check_casting_mode, check_floating,
                                          check_row_input, check_row_params, check_row_width, rms_norm_float64,
                                          rms_norm_out_dtype, rms_norm_torch)
from liger_gen.runtime import fp8 as recipe
from liger_gen.runtime.binding import Differentiable, Kernel, saved
from liger_gen.runtime.ops import (check_float_arg, check_kernel_dtypes, check_same_device, describe,
                                   interpreter_enabled, kernel_module, transforms_active, use_custom_op, uses_triton)

OP = "rms_norm_fp8"
EMITS = ("rows", "amax")

# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class RMSNormFp8Config(RowNormForwardConfig):
    """Launch settings: the norm kernel's (``RowNormForwardConfig``, as ``rms_norm``'s forward, BLOCK_M_FWD rows
    per tile) and ``TILES_FWD``, the row tiles each program walks (its columns' amaxes kept in registers over
    them, one atomic per column per program); ``EMIT``, the fusion choice ("rows": the norm kernel writes the rows
    operand, the cast kernel the columns; "amax": the norm kernel writes both axes' amaxes, the cast kernel both
    operands); the cast kernel's tile and warps."""

    EMIT: str = "rows"
    TILES_FWD: int = 1
    BLOCK_M_CAST: int = 64
    BLOCK_K_CAST: int = 64
    num_warps_cast: int = 4


class RMSNormFp8Space(Space):
    """Search space, constraints and heuristic for one row width (dims ``{"n_cols": N}``) and dtype; the casting
    mode and whether the residual add is fused are render-time variants with their own table entries."""

    op = OP
    template = "rms_norm_fp8"
    config_cls = RMSNormFp8Config
    DIMS = ("n_cols",)
    phases = ("fwd",)
    MAX_N_COLS = RowNormSpace.MAX_N_COLS
    # fp32 values one thread holds per live tile: the norm's (x, y) and the operand's (the scaled row, its FP8)
    MAX_ELEMS_PER_THREAD_FWD = 64
    MAX_ELEMS_PER_THREAD_CAST = 64
    FUSED_ROWS = 32  # rows per program of the heuristic
    STREAMS = 2  # x and r (pipelined loads of the fused add; one stream without it, counted as two: an upper bound)
    PARAMS = (
        Param("BLOCK_M_FWD", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("num_stages_fwd", (1, 2, 3), "fwd"),
        Param("TILES_FWD", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("EMIT", EMITS, "fwd"),
        Param("BLOCK_M_CAST", (8, 16, 32, 64, 128), "fwd"),
        Param("BLOCK_K_CAST", (16, 32, 64, 128, 256), "fwd"),
        Param("num_warps_cast", (1, 2, 4, 8, 16), "fwd"),
    )

    def check_dims(self) -> None:
        self.n_cols = self.dims["n_cols"]
        if not 1 <= self.n_cols <= self.MAX_N_COLS:
            raise ValueError(f"{self.op} supports 1 <= n_cols <= {self.MAX_N_COLS}, got n_cols={self.n_cols}")
        self.block_n = next_power_of_2(self.n_cols)

    def heuristic(self) -> RMSNormFp8Config:
        """``rms_norm``'s forward tile and warps (halving the rows per tile while the registers do not allow
        them), each program walking ``FUSED_ROWS`` rows (one atomic per column per program), the rows
        operand written by the norm kernel, and 64 x 64 cast tiles at 4 warps (narrower where the row is)."""
        base = RMSNormSpace(self.dims, self.dtype, self.limits).heuristic()
        cast_k = min(64, max(16, self.block_n))
        block_m = base.BLOCK_M_FWD
        while True:
            config = RMSNormFp8Config(
                BLOCK_N=self.block_n, BLOCK_M_FWD=block_m,
                num_warps_fwd=self.fit_warps(base.num_warps_fwd, block_m * self.block_n), num_stages_fwd=1,
                TILES_FWD=max(1, self.FUSED_ROWS // block_m), EMIT="rows", BLOCK_M_CAST=64, BLOCK_K_CAST=cast_k,
                num_warps_cast=self.fit_warps(4, 64 * cast_k, 8))
            problems = self.violations(config)
            if not problems:
                return config
            if block_m == 1:
                raise AssertionError(f"heuristic is invalid for n_cols={self.n_cols}: {problems}")
            block_m //= 2

    def shape_violations(self, config: RMSNormFp8Config) -> list[str]:
        problems: list[str] = []
        if config.BLOCK_N != self.block_n:
            problems.append(f"BLOCK_N={config.BLOCK_N} is not next_power_of_2(n_cols)={self.block_n}")
        tile = config.BLOCK_M_FWD * config.BLOCK_N
        problems += self.threads_violations("fwd", config.num_warps_fwd, tile, self.MAX_ELEMS_PER_THREAD_FWD)
        # pipelined loads keep (stages - 1) tiles of each input in shared memory, plus the cross-warp scratch of
        # the row reductions (mean square, amax)
        smem = ((config.num_stages_fwd - 1) * self.STREAMS * tile * self.element_size
                + 2 * config.BLOCK_M_FWD * config.num_warps_fwd * 4)
        problems += self.smem_violations("fwd", smem)
        return problems + self.tile_violations("cast", config.BLOCK_M_CAST, config.BLOCK_K_CAST, config.num_warps_cast,
                                               self.n_cols, self.MAX_ELEMS_PER_THREAD_CAST)


# ------------------------------------------------------------------------------------------------ tuning


class RMSNormFp8Problem(DecoderNormProblem):
    """The norm with its output's FP8 operands at (rows, n_cols) in ``dtype``: the fused add + RMSNorm
    (``fused_add=True``, a decoder's post-attention norm) or RMSNorm alone (its input norm), in ``casting_mode``.

    Outputs (the differentiable ones): y and, with the add, the sum s, against float64; the check also holds the
    FP8 operands (``q_rows``, ``d_rows``, ``q_cols``, ``d_cols``) to the recipe's quantization of the y the
    kernel wrote, exactly. One phase, the forward: the norm and its cast, the unit whose split ``EMIT`` tunes.
    """

    SPACE = RMSNormFp8Space
    OUTPUTS = ("y", "s")
    # forward: x, r, w read; y, s, rstd written; y read again by the cast; q and qt written (one byte each) with
    # their scales. Backward (the fused add's): dy, ds, s, w, rstd read; dx, dr, dW written
    BYTES_FORMULA = "5·R·H·s + H·s + R·H + H·⌈R⌉₁₆ + 2·R·4 + H·4 (fwd) + 5·R·H·s + 2·H·s + R·4 (bwd)"

    # the fused add's inputs and float64 truth (the op's case runs the add; without it, the sum is unused)
    make_inputs = classmethod(FusedAddRMSNormProblem.make_inputs.__func__)
    reference = classmethod(FusedAddRMSNormProblem.reference.__func__)

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        mn, m, n = dims["rows"] * dims["n_cols"], dims["rows"], dims["n_cols"]
        return {"fwd": 5 * mn * s + n * s + mn + n * recipe.padded(m) + m * STAT_BYTES + m * 4 + n * 4}

    @classmethod
    def step_bytes(cls, dims, s: int) -> int:
        """The forward's bytes and the backward's (``fused_add_rms_norm``'s: dy, ds, s read; dx, dr written)."""
        mn, m, n = dims["rows"] * dims["n_cols"], dims["rows"], dims["n_cols"]
        return cls.phase_bytes(dims, s)["fwd"] + 5 * mn * s + 2 * n * s + m * STAT_BYTES

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, casting_mode: str = "llama",
                 fused_add: bool = True, eps: float = 1e-6, fp8: str = "e4m3", seed: int = 0, limits=None):
        if fp8 != "e4m3":  # (the table entries name the format; the norms write e4m3 operands only)
            raise ValueError(f"rms_norm_fp8 writes e4m3 operands only, got fp8={fp8!r}")
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits,
                         variant={"casting_mode": casting_mode, "fused_add": bool(fused_add), "fp8": "e4m3"})
        self.casting_mode, self.fused_add, self.eps = casting_mode, bool(fused_add), eps
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {"eps": eps})
        x, r, w = inputs.tensors["x"], inputs.tensors["residual"], inputs.tensors["w"]
        m, n = self.rows, self.dims["n_cols"]
        self.buffers = {
            "x": x, "r": r, "w": w,
            "y": torch.empty((m, n), dtype=rms_norm_out_dtype(dtype, dtype, casting_mode), device=self.device),
            "s": torch.empty((m, n), dtype=dtype, device=self.device),
            "rstd": torch.empty(m, dtype=torch.float32, device=self.device),
            "q_rows": torch.empty((m, n), dtype=recipe.E4M3, device=self.device),
            "d_rows": torch.empty(m, dtype=torch.float32, device=self.device),
            "q_cols": torch.empty((n, recipe.padded(m)), dtype=recipe.E4M3, device=self.device),
            "d_cols": torch.empty(n, dtype=torch.float32, device=self.device),
        }
        if self.fused_add:
            self.ref = self.reference(Inputs(inputs.tensors, (), inputs.upstream, inputs.options))
        else:
            self.ref = {"y": rms_norm_float64(x, w, eps)}
        self.tol = {"y": REL_TOL[dtype], "s": REL_TOL[dtype]}
        self.outputs = {"fwd": ("y", "s") if self.fused_add else ("y",)}

    def launcher(self, module, phase: str):
        b, exact = self.buffers, interpreter_enabled()
        if self.fused_add:
            return lambda: module.forward(b["x"], b["r"], b["w"], b["y"], b["s"], b["rstd"], b["q_rows"],
                                          b["d_rows"], b["q_cols"], b["d_cols"], self.eps, 0.0, exact)
        return lambda: module.forward(b["x"], b["w"], b["y"], b["rstd"], b["q_rows"], b["d_rows"], b["q_cols"],
                                      b["d_cols"], self.eps, 0.0, exact)

    def check(self, module, phase: str) -> str | None:
        """The base check of y (and s) against float64, then the FP8 operands against the recipe's quantization
        of the y written: every value and scale exactly, the columns' padding zero; rstd within fp32 of the
        row it normalised."""
        for name in ("d_rows", "d_cols"):
            self.buffers[name].fill_(float("nan"))
        error = super().check(module, phase)
        if error is not None:
            return error
        b = self.buffers
        error = recipe.operand_mismatch(b["y"], b["q_rows"], b["d_rows"], b["q_cols"], b["d_cols"])
        if error is not None:
            return f"y: {error}"
        normed = (b["s"] if self.fused_add else b["x"]).double()
        err = rel_l2(b["rstd"], torch.rsqrt(normed.pow(2).mean(-1) + self.eps))
        if not err <= FP32_OUT_TOL:
            return f"rstd: relative L2 error {err:.3g} > {FP32_OUT_TOL:.1g}"
        return None


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """A decoder's two norms before FP8 projections at ``hidden_size``: the input norm (RMSNorm) and the
    post-attention norm (the fused residual add + RMSNorm), one problem each per token count."""
    options = RMSNormFp8Problem.options(model)
    return [RMSNormFp8Problem(dtype, RMSNormFp8Problem.shape(model), r, device, fused_add=fused, seed=seed, **options)
            for r in rows for fused in (False, True)]


# the backward is the plain norms' custom ops
SPEC = OpSpec(OP, RMSNormFp8Space, RMSNormFp8Problem, tuning_problems,
              custom_ops=("liger_gen::rms_norm_fp8_fwd", "liger_gen::rms_norm_bwd", "liger_gen::fused_add_rms_norm_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


def _fwd_impl(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, offset: float,
              casting_mode: str, cols: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, s, q, d_rows, qt, d_cols, rstd) of 2-D x (and residual, of x's shape) with unit column stride: s is
    empty without a residual, qt and d_cols are empty unless ``cols``; d_rows (rows, 1), d_cols (n_cols, 1)."""
    rows, n_cols = x.shape
    fused = residual is not None
    s_dtype = torch.promote_types(x.dtype, residual.dtype) if fused else x.dtype
    y_dtype = rms_norm_out_dtype(s_dtype, weight.dtype, casting_mode)
    if not uses_triton(x) or x.numel() == 0:  # the recipe in plain PyTorch (and nothing to launch)
        out = _plain(x, weight, eps, offset, casting_mode, residual, cols)
        normed = (out.sum if fused else x).float()
        rstd = torch.rsqrt(normed.pow(2).mean(-1) + eps) if rows else normed.new_empty((0,))
        qt, d_cols = (out.qt, out.dequant_cols) if cols else (_empty(x, recipe.E4M3), _empty(x, torch.float32))
        return (out.y.to(y_dtype), out.sum if fused else _empty(x, x.dtype), out.q, out.dequant_rows, qt, d_cols,
                rstd)
    s = torch.empty((rows, n_cols), dtype=s_dtype, device=x.device) if fused else _empty(x, x.dtype)
    y = torch.empty((rows, n_cols), dtype=y_dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    q = torch.empty((rows, n_cols), dtype=recipe.E4M3, device=x.device)
    d_rows = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if cols:
        qt = torch.empty((n_cols, recipe.padded(rows)), dtype=recipe.E4M3, device=x.device)
        d_cols = torch.empty((n_cols, 1), dtype=torch.float32, device=x.device)
    else:
        qt, d_cols = _empty(x, recipe.E4M3), _empty(x, torch.float32)
    module, _, _ = kernel_module(RMSNormFp8Space, y, n_cols, rows, casting_mode=casting_mode, fused_add=fused,
                                 fp8="e4m3")
    tail = (rstd, q, d_rows.view(-1), qt if cols else None, d_cols.view(-1) if cols else None, eps, offset,
            interpreter_enabled())
    if fused:
        module.forward(x, residual, weight, y, s, *tail)
    else:
        module.forward(x, weight, y, *tail)
    return y, s, q, d_rows, qt, d_cols, rstd


def _fwd_fake(x, residual, weight, eps, offset, casting_mode, cols):
    rows, n_cols = x.shape
    fused = residual is not None
    s_dtype = torch.promote_types(x.dtype, residual.dtype) if fused else x.dtype
    y = x.new_empty((rows, n_cols), dtype=rms_norm_out_dtype(s_dtype, weight.dtype, casting_mode))
    s = x.new_empty((rows, n_cols), dtype=s_dtype) if fused else _empty(x, x.dtype)
    q, d_rows = x.new_empty((rows, n_cols), dtype=recipe.E4M3), x.new_empty((rows, 1), dtype=torch.float32)
    if cols:
        qt = x.new_empty((n_cols, recipe.padded(rows)), dtype=recipe.E4M3)
        d_cols = x.new_empty((n_cols, 1), dtype=torch.float32)
    else:
        qt, d_cols = _empty(x, recipe.E4M3), _empty(x, torch.float32)
    return y, s, q, d_rows, qt, d_cols, x.new_empty((rows,), dtype=torch.float32)


rms_norm_fp8_fwd = Kernel("rms_norm_fp8_fwd", _fwd_impl, _fwd_fake)


def _save(ctx, inputs, output):
    x, residual, weight, _eps, offset, casting_mode, _cols = inputs
    y, s, *_, rstd = output
    ctx.fused = residual is not None
    saved(ctx, s if ctx.fused else x, weight, rstd)
    ctx.offset, ctx.casting_mode = offset, casting_mode
    ctx.dtypes = (x.dtype, residual.dtype if ctx.fused else x.dtype)


def _backward(ctx, dy, ds, *_operands_and_rstd):
    """The plain norms' backward: dy through the norm, plus ds (the sum's own gradient) with the add; the FP8
    operands have none."""
    v, weight, rstd = ctx.saved_tensors
    x_dtype, residual_dtype = ctx.dtypes
    rest = (None,) * 4
    if not ctx.fused:
        if dy is None:
            return (None,) * 7
        dx, dw = rms_norm_bwd.run(ctx, dy, v, weight, rstd, ctx.offset, ctx.casting_mode)
        return (dx, None, dw if ctx.needs_input_grad[2] else None) + rest
    if dy is None:  # only the sum was used: its gradient passes to both inputs, a buffer each
        if ds is None:
            return (None,) * 7
        return (ds.to(x_dtype), ds.to(residual_dtype, copy=True), None) + rest
    dx, dr, dw = fused_add_rms_norm_bwd.run(ctx, dy, ds, v, weight, rstd, ctx.offset, ctx.casting_mode, x_dtype,
                                            residual_dtype)
    return (dx, dr, dw if ctx.needs_input_grad[2] else None) + rest


rms_norm_fp8_2d = Differentiable(rms_norm_fp8_fwd, _save, _backward, outputs=6,
                                 reference="liger_gen.reference.rms_norm_torch (with a residual: "
                                           "liger_gen.reference.fused_add_rms_norm_torch)")
"""(y, s, q, d_rows, qt, d_cols) of 2-D x (and residual) with unit column stride, differentiable in x, residual
and weight through y and s."""


# ------------------------------------------------------------------------------------------------ public op


class Fp8NormOutput(NamedTuple):
    """What ``rms_norm_fp8`` returns: the norm's output and sum, and the output's FP8 operands."""

    y: torch.Tensor
    sum: torch.Tensor | None
    q: torch.Tensor
    dequant_rows: torch.Tensor
    qt: torch.Tensor | None
    dequant_cols: torch.Tensor | None


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
                 casting_mode: str = "llama", residual: torch.Tensor | None = None,
                 cols: bool = True) -> Fp8NormOutput:
    """RMSNorm of x (or of ``x + residual``, as ``fused_add_rms_norm``) that also returns the e4m3 operands of
    its output for the FP8 linear layers that read it: ``fp8_cast_transpose(y)`` from the same kernels.

    ``y = s / sqrt(mean(s², dim=-1) + eps) · (offset + weight)`` with ``s = x`` (or ``x + residual``, rounded to
    their promoted dtype), in ``casting_mode`` as ``rms_norm`` (Zhang & Sennrich, 2019); the operands follow
    ``liger_gen.runtime.fp8``'s recipe (dynamic power-of-two scales, round to nearest even).

    Args:
        x: (..., hidden) float32, bfloat16 or float16; any leading dims, any strides.
        weight: (hidden,) floating, on x's device.
        eps, offset, casting_mode: as ``rms_norm``.
        residual: x's shape, or None (no add).
        cols: also return the columns operand (the weight gradient's); False for layers whose weights are frozen.

    Returns:
        ``Fp8NormOutput(y, sum, q, dequant_rows, qt, dequant_cols)``: y of x's shape (dtype as ``rms_norm``), sum
        (x's shape, the promoted dtype) or None without a residual; q (rows, hidden) float8_e4m3fn and
        dequant_rows (rows, 1) fp32, rows being the product of the leading dims; qt (hidden, rows rounded up to a
        multiple of 16) float8_e4m3fn with zeros past the last row and dequant_cols (hidden, 1) fp32, or both
        None when ``cols`` is False. y and sum are differentiable in x, residual and weight.

    Raises:
        TypeError: a tensor that is not floating, float64 on the kernel path, eps / offset not a number.
        ValueError: weight not (hidden,), residual not of x's shape, tensors on different devices, hidden over
            the kernel's limit (65536), an unknown casting_mode.
    """
    op = OP
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    eps, offset = check_float_arg(op, "eps", eps), check_float_arg(op, "offset", offset)
    check_casting_mode(op, casting_mode)
    check_row_input(op, x)
    check_row_params(op, x, weight=weight)
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
            raise ValueError(f"{op}: residual must be a tensor of x's shape; got "
                             f"{describe('residual', residual) if isinstance(residual, torch.Tensor) else residual!r}"
                             f" and {describe('x', x)}")
    check_same_device(op, x=x, weight=weight, residual=residual)
    check_floating(op, x=x, weight=weight, residual=residual)
    if not uses_triton(x) and not (use_custom_op() or transforms_active()):
        # the plain-PyTorch path in eager mode: the norms' references (autograd's), then the recipe; a graph
        # being recorded or a torch.func transform takes the custom op (whose plain branch computes the same)
        return _plain(x, weight, eps, offset, casting_mode, residual, bool(cols))
    if uses_triton(x):
        check_kernel_dtypes(op, x=x, weight=weight, residual=residual)
        check_row_width(op, RMSNormFp8Space, x)
    shape, hidden = x.shape, x.shape[-1]
    rows = math.prod(shape[:-1])
    x2 = x.reshape(rows, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(rows, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    # (the custom op returns rstd too: a graph records every output)
    y, s, q, d_rows, qt, d_cols = rms_norm_fp8_2d(x2, r2, weight, eps, offset, casting_mode, bool(cols))[:6]
    # the operands are not differentiable: detached, so autograd keeps no graph through them
    return Fp8NormOutput(y.view(shape), s.view(shape) if residual is not None else None, q.detach(),
                         d_rows.detach(), qt.detach() if cols else None, d_cols.detach() if cols else None)


def _plain(x, weight, eps, offset, casting_mode, residual, cols) -> Fp8NormOutput:
    """``rms_norm_fp8`` on the plain-PyTorch path, as ``rms_norm`` and ``fused_add_rms_norm`` run there."""
    if residual is None:
        y, s = rms_norm_torch(x, weight, eps, offset, casting_mode), None
    else:
        y, s = fused_add_rms_norm_torch(x, residual, weight, eps, offset, casting_mode)
    return Fp8NormOutput(y, s, *recipe.operands_reference(y.detach().reshape(-1, x.shape[-1]), cols))
