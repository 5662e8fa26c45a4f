"""What the single-pass row norms share: RMSNorm's references (fused add + RMSNorm normalises its sum with
them), the launch settings and search space of their one kernel structure, the tuning problem's model shape,
and the argument checks of the public ops.

    rstd_i = 1 / sqrt(mean_j(x_ij²) + eps)          (always fp32)
    y_ij   = x_ij · rstd_i · (offset + w_j)

Kernels: ``templates/rms_norm.py.jinja``, ``fused_add_rms_norm.py.jinja``, ``layer_norm.py.jinja``; the ops are
``rms_norm``, ``fused_add_rms_norm`` and ``layer_norm`` beside this module, which imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import Inputs, Problem
from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2
from liger_gen.runtime.ops import describe

CASTING_MODES = ("llama", "gemma", "none")

# ------------------------------------------------------------------------------------------------ references


def rms_norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, casting_mode: str) -> torch.dtype:
    """Output dtype as transformers computes it: Llama promotes x with w, Gemma and "none" keep x's dtype."""
    return torch.promote_types(x_dtype, w_dtype) if casting_mode == "llama" else x_dtype


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str) -> torch.Tensor:
    """RMSNorm in plain PyTorch with the rounding steps of each casting mode (differentiable by autograd).

    llama: transformers' LlamaRMSNorm — ``w · (x_fp32 · rstd).to(x.dtype)``; gemma: GemmaRMSNorm — all fp32,
    ``(x_fp32 · rstd · (offset + w_fp32)).to(x.dtype)``; none: rstd in fp32, products in x's dtype.
    """
    x_f32 = x.float()
    rstd = torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        normed = (x_f32 * rstd).to(x.dtype)
        out_dtype = rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode)
        # bf16·bf16 in PyTorch is an fp32 product rounded once, which is what this computes
        return ((weight.float() + offset) * normed.float()).to(out_dtype)
    if casting_mode == "gemma":
        return (x_f32 * rstd * (offset + weight.float())).to(x.dtype)
    if casting_mode == "none":
        return x * rstd.to(x.dtype) * (offset + weight.float()).to(x.dtype)
    raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Exact RMSNorm in float64 (no intermediate rounding): ``x / sqrt(mean(x²) + eps) · (offset + w)``
    (without the factor when weight is None)."""
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * rstd if weight is None else x64 * rstd * (offset + weight.double())


# ------------------------------------------------------------------------------------------------ search space


@dataclass(frozen=True)
class RowNormForwardConfig(KernelConfig):
    """The forward kernel's launch settings of a single-pass row norm: BLOCK_N, the single-pass row width (a
    power of two >= n_cols), BLOCK_M_FWD rows per program, warps and pipeline stages."""

    BLOCK_N: int
    BLOCK_M_FWD: int = 1
    num_warps_fwd: int = 4
    num_stages_fwd: int = 1


@dataclass(frozen=True)
class RowNormConfig(RowNormForwardConfig):
    """Launch settings of one single-pass row-norm variant (the ``rms_norm``, ``fused_add_rms_norm`` and
    ``layer_norm`` templates), each op's config a subclass of it: the forward's (``RowNormForwardConfig``) and
    the backward's.

    BLOCK_N is the single-pass row width (a power of two >= n_cols). The forward kernel normalises a tile of
    BLOCK_M_FWD rows per program. The backward kernel walks tiles of BLOCK_M_BWD rows; with
    ``dw_strategy="blocked"`` each program takes TILES_PER_PROGRAM consecutive tiles, with ``"persistent"``
    PROGRAMS_PER_SM × num_sms programs stride over all tiles. Each backward program writes one fp32 partial
    row of dW, summed by a second pass. BWD_PREFETCH=1 issues the next tile's loads before the current tile's
    reductions (software pipelining written out, at the cost of a second tile of registers).
    """

    BLOCK_M_BWD: int = 1
    dw_strategy: str = "persistent"
    TILES_PER_PROGRAM: int = 1
    PROGRAMS_PER_SM: int = 1
    BWD_PREFETCH: int = 0
    num_warps_bwd: int = 4
    num_stages_bwd: int = 1


class RowNormSpace(Space):
    """Search space, constraints and heuristic of a single-pass row norm for one row width (dims
    ``{"n_cols": N}``) and dtype. Each norm's space subclasses it, setting op, template and config class: the
    norms share the params, the heuristic and the constraints, and differ in the streams each kernel pipelines
    and its reduction scratch. The budgets below are RMSNorm's, measured.
    """

    DIMS = ("n_cols",)
    MAX_N_COLS = 65536  # one row per single pass; past this a row no longer fits in registers
    # fp32 values one thread may hold per live tile before the compiler spills (measured ranges, not limits)
    MAX_ELEMS_PER_THREAD_FWD = 128
    MAX_ELEMS_PER_THREAD_BWD = 64
    STREAMS = {"fwd": 1, "bwd": 2}  # row-sized inputs each kernel streams through shared memory when pipelined
    REDUCTIONS_PER_ROW = 1  # cross-warp reductions in flight per row (scratch of one fp32 per warp each)

    PARAMS = (
        Param("BLOCK_M_FWD", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("num_stages_fwd", (1, 2, 3), "fwd"),
        Param("BLOCK_M_BWD", (1, 2, 4, 8, 16), "bwd"),
        Param("dw_strategy", ("blocked", "persistent"), "bwd"),
        Param("TILES_PER_PROGRAM", (1, 2, 4, 8, 16, 32, 64), "bwd", when=("dw_strategy", "blocked")),
        Param("PROGRAMS_PER_SM", (1, 2, 4, 8), "bwd", when=("dw_strategy", "persistent")),
        Param("BWD_PREFETCH", (0, 1), "bwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16, 32), "bwd"),
        Param("num_stages_bwd", (1, 2, 3, 4), "bwd"),
    )

    def check_dims(self) -> None:
        self.n_cols = self.dims["n_cols"]
        if not 1 <= self.n_cols <= self.MAX_N_COLS:
            raise ValueError(f"{self.op} supports 1 <= n_cols <= {self.MAX_N_COLS}, got n_cols={self.n_cols}")
        self.block_n = next_power_of_2(self.n_cols)

    def heuristic(self):
        """Analytic default, valid for every n_cols in range: one ~2K-element tile per program below 1024
        columns; from 1024 columns ~8K-element forward and ~4K-element backward tiles (several rows per
        program up to 4096 columns); warps grow with the row; the next rows' loads issued before the current
        rows' reductions (``BWD_PREFETCH``) where the registers allow.

        The wide-row tiles follow the H200 tables: at 896 and 2048 columns the tuned configs hold 4-8 rows per
        forward program and 2-4 per backward program and prefetch, and ran 1.15-1.7x the one-row-per-program
        rule this replaces (``benchmarks/results/h200_2026-12-02/tuning``)."""
        block_n = self.block_n
        warps = 1 if block_n <= 256 else 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16 if block_n <= 16384 else 32
        wide = block_n >= 1024
        block_m_fwd = max(1, min(16, (8192 if wide else 2048) // block_n))
        block_m_bwd = max(1, min(8, (4096 if wide else 1024) // block_n))
        problems: list[str] = []
        while True:  # the largest tiles (prefetching if it fits) that the device's registers allow
            for prefetch in (1, 0):
                config = self.config_cls(
                    BLOCK_N=block_n,
                    BLOCK_M_FWD=block_m_fwd,
                    num_warps_fwd=self.fit_warps(warps, block_m_fwd * block_n),
                    num_stages_fwd=1,
                    BLOCK_M_BWD=block_m_bwd,
                    dw_strategy="persistent",
                    TILES_PER_PROGRAM=1,
                    PROGRAMS_PER_SM=2,
                    BWD_PREFETCH=prefetch,
                    num_warps_bwd=self.fit_warps(warps, block_m_bwd * block_n),
                    num_stages_bwd=1,
                )
                problems = self.violations(config)
                if not problems:
                    return config
            if block_m_fwd == 1 and block_m_bwd == 1:
                raise AssertionError(f"heuristic is invalid for n_cols={self.n_cols}: {problems}")
            block_m_fwd, block_m_bwd = max(1, block_m_fwd // 2), max(1, block_m_bwd // 2)

    def shape_violations(self, config) -> list[str]:
        """Row width, threads, registers and shared memory of both kernels."""
        problems: list[str] = []
        n, elem = self.n_cols, self.element_size
        if config.BLOCK_N < n:
            problems.append(f"BLOCK_N={config.BLOCK_N} < n_cols={n}: the single-pass kernel needs the whole row")
        if config.BLOCK_N != self.block_n:
            problems.append(f"BLOCK_N={config.BLOCK_N} is not next_power_of_2(n_cols)={self.block_n}")
        for phase, block_m, warps, stages, max_elems in (
            ("fwd", config.BLOCK_M_FWD, config.num_warps_fwd, config.num_stages_fwd, self.MAX_ELEMS_PER_THREAD_FWD),
            # prefetching holds a second tile of x and dy in registers
            ("bwd", config.BLOCK_M_BWD, config.num_warps_bwd, config.num_stages_bwd,
             self.MAX_ELEMS_PER_THREAD_BWD // (2 if config.BWD_PREFETCH else 1)),
        ):
            tile = block_m * config.BLOCK_N
            problems += self.threads_violations(phase, warps, tile, max_elems)
            # pipelined loads keep (stages - 1) tiles of each streamed input in shared memory, plus the
            # cross-warp reduction scratch (one fp32 per warp per row and reduction)
            smem = (stages - 1) * self.STREAMS[phase] * tile * elem + self.REDUCTIONS_PER_ROW * block_m * warps * 4
            problems += self.smem_violations(phase, smem)
        return problems


# ------------------------------------------------------------------------------------------------ tuning


class DecoderNormProblem(Problem):
    """A decoder norm's shape: ``n_cols`` is the model's hidden size, eps its ``rms_norm_eps``."""

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {"n_cols": model.hidden_size}

    @classmethod
    def options(cls, model) -> dict:
        return {"eps": model.rms_norm_eps}


class RMSNormKernelProblem(DecoderNormProblem):
    """A norm of the RMSNorm kernel (RMSNorm, fused add + RMSNorm) at (rows, n_cols): ``casting_mode`` is a
    render-time variant of the template, the inputs are drawn at ``eps`` and handed to ``build``, which fills the
    buffers, the float64 truth, the tolerances and the phases' outputs."""

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, casting_mode: str = "llama",
                 eps: float = 1e-6, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits,
                         variant={"casting_mode": casting_mode})
        self.casting_mode, self.eps = casting_mode, eps
        self.build(self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {"eps": eps}))

    def build(self, inputs: Inputs) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------ checks


def check_casting_mode(op: str, casting_mode) -> None:
    """ValueError unless ``casting_mode`` is one of ``CASTING_MODES``."""
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"{op}: casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")


def check_row_input(op: str, x: torch.Tensor) -> int:
    """The row width (hidden) of x, (..., hidden); ValueError for a 0-dim x."""
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim (..., hidden); got {describe('x', x)}")
    return x.shape[-1]


def check_row_params(op: str, x: torch.Tensor, **params: torch.Tensor | None) -> None:
    """ValueError unless each param (weight, bias; None skipped) is (hidden,), hidden being x's last dim."""
    hidden = x.shape[-1]
    for name, t in params.items():
        if t is not None and (t.dim() != 1 or t.shape[0] != hidden):
            raise ValueError(f"{op}: {name} must have shape ({hidden},) to match x's last dim; "
                             f"got {describe(name, t)} and {describe('x', x)}")


def check_floating(op: str, **tensors: torch.Tensor | None) -> None:
    """TypeError for a tensor (None skipped) of a non-floating dtype."""
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")


def check_row_width(op: str, space: type[RowNormSpace], x: torch.Tensor) -> None:
    """ValueError when x's rows are wider than the single-pass kernel of ``space`` takes (``MAX_N_COLS``)."""
    hidden = x.shape[-1]
    if hidden > space.MAX_N_COLS:
        raise ValueError(f"{op}: hidden size {hidden} exceeds the single-pass kernel's limit "
                         f"{space.MAX_N_COLS}; got {describe('x', x)}")
