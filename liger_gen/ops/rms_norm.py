"""RMSNorm (Zhang & Sennrich, 2019): references, search space, tuning problem, custom ops and the public op.

    rstd_i = 1 / sqrt(mean_j(x_ij²) + eps)          (always fp32)
    y_ij   = x_ij · rstd_i · (offset + w_j)

Kernels: ``templates/rms_norm.py.jinja``. This module is the worked example every other op module follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import (FP32_OUT_TOL, REL_TOL, STAT_BYTES, Inputs, Problem, randn,
                                        reference_by_autograd)
from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2
from liger_gen.codegen.spec import OpSpec
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, saved
from liger_gen.runtime.ops import (check_float_arg, check_kernel_dtypes, check_same_device, describe,
                                   interpreter_enabled, kernel_module, no_double_backward, uses_triton)
from liger_gen.runtime.tables import heuristic_only_enabled

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


@dataclass(frozen=True)
class RMSNormConfig(KernelConfig):
    """Launch settings of one RMSNorm variant (``templates/rms_norm.py.jinja``).

    BLOCK_N is the single-pass row width (a power of two >= n_cols). The forward kernel normalises a tile of
    BLOCK_M_FWD rows per program. The backward kernel walks tiles of BLOCK_M_BWD rows; with
    ``dw_strategy="blocked"`` each program takes TILES_PER_PROGRAM consecutive tiles, with ``"persistent"``
    PROGRAMS_PER_SM × num_sms programs stride over all tiles. Each backward program writes one fp32 partial
    row of dW, summed by a second pass. BWD_PREFETCH=1 issues the next tile's loads before the current tile's
    reductions (software pipelining written out, at the cost of a second tile of registers).

    Measured on an H200 (Triton 3.6, bf16, tuned table of 2026-11-29): every tuned entry with 16384 or more
    rows chose persistent + prefetch (backward 0.132 → 0.114 ms at 16384×4096), every 4096-row entry chose
    blocked without prefetch.
    """

    BLOCK_N: int
    BLOCK_M_FWD: int = 1
    num_warps_fwd: int = 4
    num_stages_fwd: int = 1
    BLOCK_M_BWD: int = 1
    dw_strategy: str = "persistent"
    TILES_PER_PROGRAM: int = 1
    PROGRAMS_PER_SM: int = 1
    BWD_PREFETCH: int = 0
    num_warps_bwd: int = 4
    num_stages_bwd: int = 1


class RMSNormSpace(Space):
    """Search space, constraints and heuristic of RMSNorm for one row width (dims ``{"n_cols": N}``) and dtype.

    The other single-pass row norms (LayerNorm, fused add + RMSNorm) subclass it: they share the params, the
    heuristic and the constraints, and differ in the streams each kernel pipelines and its reduction scratch.
    """

    op = "rms_norm"
    template = "rms_norm"
    config_cls = RMSNormConfig
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


class RMSNormProblem(DecoderNormProblem):
    """RMSNorm at (rows, n_cols) in ``dtype`` on ``device``: inputs, float64 truth, checks and launchers."""

    op = "rms_norm"
    SPACE = RMSNormSpace
    OUTPUTS = ("y",)
    # fwd: x, w in; y, rstd out.  bwd: dy, x, w, rstd in; dx, dw out.
    BYTES_FORMULA = "5·R·H·s + 3·H·s + 2·R·4"

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        r, h = dims["rows"], dims["n_cols"]
        return Inputs({"x": randn(gen, (r, h), dtype, device), "w": randn(gen, (h,), dtype, device, 0.1, 1.0)},
                      grad_of=("x", "w"), upstream={"y": randn(gen, (r, h), dtype, device)},
                      options={"eps": options.get("eps", 1e-6)})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        return reference_by_autograd(inputs, lambda t, o: (rms_norm_float64(t["x"], t["w"], o["eps"]),), cls.OUTPUTS)

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        mn, m, n = dims["rows"] * dims["n_cols"], dims["rows"], dims["n_cols"]
        return {"fwd": 2 * mn * s + n * s + m * STAT_BYTES, "bwd": 3 * mn * s + 2 * n * s + m * STAT_BYTES}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, casting_mode: str = "llama",
                 eps: float = 1e-6, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits,
                         variant={"casting_mode": casting_mode})
        self.casting_mode, self.eps = casting_mode, eps
        m, n = self.rows, self.dims["n_cols"]
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {"eps": eps})
        x, w = inputs.tensors["x"], inputs.tensors["w"]
        self.buffers = {
            "x": x, "w": w, "dy": inputs.upstream["y"],
            "rstd_in": torch.rsqrt(x.float().pow(2).mean(-1) + eps),
            "y": torch.empty((m, n), dtype=rms_norm_out_dtype(dtype, dtype, casting_mode), device=self.device),
            "rstd": torch.empty(m, dtype=torch.float32, device=self.device),
            "dx": torch.empty((m, n), dtype=dtype, device=self.device),
            "dw": torch.empty(n, dtype=dtype, device=self.device),
            "dw_partial": torch.empty((m, n), dtype=torch.float32, device=self.device),
        }
        self.ref = {**self.reference(inputs), "rstd": torch.rsqrt(x.double().pow(2).mean(-1) + eps)}
        tol = REL_TOL[dtype]
        self.tol = {"y": tol, "rstd": FP32_OUT_TOL, "dx": tol, "dw": tol}
        self.outputs = {"fwd": ("y", "rstd"), "bwd": ("dx", "dw")}

    def launcher(self, module, phase: str):
        b = self.buffers
        if phase == "fwd":
            return lambda: module.forward(b["x"], b["w"], b["y"], b["rstd"], self.eps, 0.0)
        if phase == "bwd":
            return lambda: module.backward(b["dy"], b["x"], b["w"], b["rstd_in"], b["dx"], b["dw"], b["dw_partial"],
                                           0.0, self.limits.num_sms)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The model's decoder norms: one problem per token count at ``hidden_size``."""
    return [RMSNormProblem(dtype, RMSNormProblem.shape(model), r, device, seed=seed, **RMSNormProblem.options(model))
            for r in rows]


SPEC = OpSpec("rms_norm", RMSNormSpace, RMSNormProblem, tuning_problems,
              custom_ops=("liger_gen::rms_norm_fwd", "liger_gen::rms_norm_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, n_cols): itself when 2-D, else a view (x is contiguous there; see ``rms_norm``)."""
    return x if x.dim() == 2 else x.view(math.prod(x.shape[:-1]), x.shape[-1])


def _fwd_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
              casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y of x's shape and rstd (rows,) fp32, for x 2-D with unit column stride or N-D contiguous. Rows are
    flattened here, inside the op, so autograd records no view nodes around it."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode), device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, rstd.fill_(float("inf"))
    if uses_triton(x):
        module, _, _ = kernel_module(RMSNormSpace, x, n_cols, rows, casting_mode=casting_mode)
        module.forward(x2, weight, _rows(y), rstd, eps, offset)
    else:  # CPU without the interpreter: plain PyTorch (only reached when the op is called directly)
        y.copy_(rms_norm_torch(x, weight, eps, offset, casting_mode))
        rstd.copy_(torch.rsqrt(x2.float().pow(2).mean(-1) + eps))
    return y, rstd


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float,
              casting_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """dx of x's shape (contiguous) in x's dtype and dW (n_cols,) in weight's dtype; dy has x's shape, any
    strides."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight)
    dy2 = dy.reshape(rows, n_cols)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    dw = torch.empty_like(weight)
    dx2 = _rows(dx)
    if uses_triton(x):
        module, _, limits = kernel_module(RMSNormSpace, x, n_cols, rows, casting_mode=casting_mode)
        dw_partial = torch.empty((module.num_bwd_programs(rows, limits.num_sms), n_cols), dtype=torch.float32,
                                 device=x.device)
        module.backward(dy2, x2, weight, rstd, dx2, dw, dw_partial, offset, limits.num_sms)
    else:  # the kernel's formulas in PyTorch (only reached when the op is called directly on the CPU)
        normed = x2.float() * rstd[:, None]
        g = dy2.float() * (weight.float() + offset)
        dx2.copy_((g - normed * (g * normed).mean(-1, keepdim=True)) * rstd[:, None])
        normed_w = normed if casting_mode == "gemma" else normed.to(x.dtype).float()
        dw.copy_((dy2.float() * normed_w).sum(0))
    return dx, dw


def _fwd_fake(x, weight, eps, offset, casting_mode):
    y = x.new_empty(x.shape, dtype=rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode))
    return y, x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32)


def _bwd_fake(dy, x, weight, rstd, offset, casting_mode):
    return x.new_empty(x.shape), torch.empty_like(weight)


rms_norm_fwd = Kernel("rms_norm_fwd", _fwd_impl, _fwd_fake)
rms_norm_bwd = Kernel("rms_norm_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    x, weight, _eps, offset, casting_mode = inputs
    saved(ctx, x, weight, output[1])
    ctx.offset, ctx.casting_mode = offset, casting_mode


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd.run(ctx, dy, x, weight, rstd, ctx.offset, ctx.casting_mode)
    return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None


rms_norm_2d = Differentiable(rms_norm_fwd, _save, _backward, reference="liger_gen.reference.rms_norm_torch",
                           outputs=1)
"""(y, rstd) of x (2-D with unit column stride, or N-D contiguous; rows are the leading dims), differentiable in x
and weight."""


# ------------------------------------------------------------------------------------------------ eager plan


class _Plan:
    """One validated call shape of ``rms_norm`` on the Triton path: the kernel module, the output layout and
    the recorded launches (``liger_gen.runtime.plans``). The launch functions are the ones ``_fwd_impl`` and
    ``_bwd_impl`` use, with the same arguments."""

    __slots__ = ("shape", "rows", "n_cols", "x_dtype", "out_dtype", "device", "eps", "offset", "casting_mode",
                 "module", "num_sms", "n_programs", "fwd", "bwd")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting_mode: str):
        self.shape, self.n_cols = x.shape, x.shape[-1]
        self.rows = math.prod(x.shape[:-1])
        self.x_dtype, self.device = x.dtype, x.device
        self.out_dtype = rms_norm_out_dtype(x.dtype, weight.dtype, casting_mode)
        self.eps, self.offset, self.casting_mode = eps, offset, casting_mode
        self.module, _, limits = kernel_module(RMSNormSpace, x, self.n_cols, self.rows, casting_mode=casting_mode)
        self.num_sms = limits.num_sms
        self.n_programs = self.module.num_bwd_programs(self.rows, limits.num_sms)
        self.fwd = plans.Launches(record=x.is_cuda)
        self.bwd: dict[tuple, plans.Launches] = {}  # per upstream gradient layout

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        rstd = torch.empty((self.rows,), dtype=torch.float32, device=self.device)
        self.fwd((x, weight, y, rstd), self._launch_fwd, x, weight, y, rstd)
        return y, rstd

    def _launch_fwd(self, x, weight, y, rstd):
        self.module.forward(_rows(x), weight, _rows(y), rstd, self.eps, self.offset)

    def backward(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        launches = plans.launches_for(self.bwd, (dy.shape, dy.stride(), dy.dtype), self.device.type == "cuda")
        dx = torch.empty(self.shape, dtype=self.x_dtype, device=self.device)
        dw = torch.empty((self.n_cols,), dtype=weight.dtype, device=self.device)
        dw_partial = torch.empty((self.n_programs, self.n_cols), dtype=torch.float32, device=self.device)
        launches((dy, x, weight, rstd, dx, dw, dw_partial), self._launch_bwd, dy, x, weight, rstd, dx, dw,
                 dw_partial)
        return dx, dw

    def _launch_bwd(self, dy, x, weight, rstd, dx, dw, dw_partial):
        dy2 = dy.reshape(self.rows, self.n_cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        self.module.backward(dy2, _rows(x), weight, rstd, _rows(dx), dw, dw_partial, self.offset, self.num_sms)


class _Planned(torch.autograd.Function):
    """``rms_norm`` through a plan: y of x, differentiable in x and weight (the kernels of ``rms_norm_2d``)."""

    @staticmethod
    def forward(ctx, x, weight, plan):
        y, rstd = plan.forward(x, weight)
        ctx.set_materialize_grads(False)
        saved(ctx, x, weight, rstd)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        no_double_backward("rms_norm", "liger_gen.reference.rms_norm_torch")
        if dy is None:
            return None, None, None
        x, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.plan.backward(dy, x, weight, rstd)
        return dx, (dw if ctx.needs_input_grad[1] else None), None


_PLANS = plans.new_cache()


# ------------------------------------------------------------------------------------------------ public op


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0,
             casting_mode: str = "llama") -> torch.Tensor:
    """Root-mean-square layer norm over the last dim (Zhang & Sennrich, 2019).

    ``y = x / sqrt(mean(x², dim=-1) + eps) · (offset + weight)``, with the statistics always in fp32; without a
    weight (``torch.nn.RMSNorm(elementwise_affine=False)``) ``y = x / sqrt(mean(x²) + eps)``.

    Args:
        x: (..., hidden) float32, bfloat16 or float16; any leading dims, any strides.
        weight: (hidden,) floating, on x's device; or None (no elementwise scale: the output has x's dtype, and
            the kernels run with a weight of ones, whose gradient is not kept).
        eps: added to the mean square before the reciprocal square root.
        offset: added to weight (Gemma stores w − 1 and uses offset=1.0).
        casting_mode: "llama" — transformers' LlamaRMSNorm: x·rstd in fp32, rounded to x's dtype, times
            weight; the output has the promoted dtype of x and weight. "gemma" — GemmaRMSNorm: everything in
            fp32, output in x's dtype. "none" — rstd in fp32, the products in x's dtype.

    Returns:
        y of x's shape (dtype as above). Differentiable in x and weight.

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run plain PyTorch, or the same
    Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 is accepted on the plain-PyTorch
    path only.

    Raises:
        TypeError: x or weight is not a tensor or has a non-floating dtype, float64 on the kernel path, or eps /
            offset is not a number.
        ValueError: weight is not (hidden,), the tensors are on different devices, hidden exceeds the kernel's
            limit (65536), casting_mode is unknown, or a nonzero offset without a weight.
    """
    if type(eps) in plans.NUMBERS and type(offset) in plans.NUMBERS and type(casting_mode) is str \
            and eps == eps and plans.eager(x, weight):  # a call shape validated before skips the checks
        key = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype, weight.device,
               eps, offset, casting_mode, heuristic_only_enabled(), interpreter_enabled())
        plan = _PLANS.get(key)
        if plan is not None:
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return _Planned.apply(x, weight, plan)
            return plan.forward(x, weight)[0]
    else:
        key = None
    op = "rms_norm"
    if not isinstance(x, torch.Tensor) or not (weight is None or isinstance(weight, torch.Tensor)):
        raise TypeError(f"{op}: x must be a tensor and weight a tensor or None, got {type(x).__name__} and "
                        f"{type(weight).__name__}")
    eps, offset = check_float_arg(op, "eps", eps), check_float_arg(op, "offset", offset)
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"{op}: casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim (..., hidden); got {describe('x', x)}")
    hidden = x.shape[-1]
    if weight is None:
        if offset != 0.0:
            raise ValueError(f"{op}: offset={offset} needs a weight (it is added to the weight); got weight=None")
        weight = x.new_ones(hidden)  # no scale: a product with 1 rounds to the normalised value itself
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"{op}: weight must have shape ({hidden},) to match x's last dim; "
                         f"got {describe('weight', weight)} and {describe('x', x)}")
    check_same_device(op, x=x, weight=weight)
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
    if not uses_triton(x):
        return rms_norm_torch(x, weight, eps, offset, casting_mode)
    check_kernel_dtypes(op, x=x, weight=weight)
    if hidden > RMSNormSpace.MAX_N_COLS:
        raise ValueError(f"{op}: hidden size {hidden} exceeds the single-pass kernel's limit "
                         f"{RMSNormSpace.MAX_N_COLS}; got {describe('x', x)}")
    if not (x.dim() == 2 and x.stride(-1) == 1) and not x.is_contiguous():
        x = x.contiguous()  # the op flattens rows with a view: 2-D with unit column stride, or contiguous
        key = None
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
        key = None
    if key is not None and x.numel():  # the same call shape skips the checks above from now on
        plan = plans.remember(_PLANS, key, _Plan(x, weight, eps, offset, casting_mode))
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _Planned.apply(x, weight, plan)
        return plan.forward(x, weight)[0]
    return rms_norm_2d(x, weight, eps, offset, casting_mode)[0]
