"""What the vocab-streaming divergences share: the launch settings and search space of their (rows, vocab)
tiles (``kl_div`` and ``jsd`` subclass the space, setting op, template and streams), the tuning row caps, and
the per-row generalized JSD of log-probabilities with its kernels' MODE constexpr, which ``jsd`` and the
LM-head distillation loss (``liger_gen.ops.lm_head.fused_linear_jsd``) both compute. Imports none of the ops.

    JSD_b = beta·KL(P ‖ M) + (1 − beta)·KL(Q ‖ M),   M = beta·P + (1 − beta)·Q
    beta = 0: KL(P ‖ Q);  beta = 1: KL(Q ‖ P)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2
from liger_gen.codegen.spec import capped_rows
from liger_gen.runtime.ops import check_float_arg

# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class DivergenceConfig(KernelConfig):
    """Launch settings of one variant of a vocab-streaming divergence (``kl_div`` and ``jsd`` templates).

    Each forward program owns BLOCK_M_FWD rows and walks them in chunks of BLOCK_V_FWD vocab columns,
    accumulating an fp32 tile that it reduces to one partial sum; num_stages_fwd pipelines the chunk loads.
    The backward is laid out the same way with its own settings (it reads and writes different streams).
    """

    BLOCK_V_FWD: int = 2048
    BLOCK_M_FWD: int = 1
    num_warps_fwd: int = 8
    num_stages_fwd: int = 1
    BLOCK_V_BWD: int = 2048
    BLOCK_M_BWD: int = 1
    num_warps_bwd: int = 8
    num_stages_bwd: int = 1


class DivergenceSpace(Space):
    """Search space, constraints and heuristic of a vocab-streaming divergence at one vocab size (dims
    ``{"vocab": V}``) and dtype. Subclasses set op, template and the streams each kernel keeps in flight."""

    config_cls = DivergenceConfig
    DIMS = ("vocab",)
    MIN_BLOCK_V = 16
    # fp32 values one thread may hold per live tile before the compiler spills (two inputs, the accumulator
    # and the transcendental temporaries are live together); a range to search, not a measured limit
    MAX_ELEMS_PER_THREAD = 32
    # (M, V) streams each kernel loads per chunk, for the pipelined-loads shared-memory estimate
    FWD_STREAMS = 2
    BWD_STREAMS = 2
    TARGET_TILE = 2048  # heuristic tile: 8 fp32 values per thread at 8 warps

    PARAMS = (
        Param("BLOCK_V_FWD", (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), "fwd"),
        Param("BLOCK_M_FWD", (1, 2, 4, 8, 16), "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16), "fwd"),
        Param("num_stages_fwd", (1, 2, 3, 4), "fwd"),
        Param("BLOCK_V_BWD", (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), "bwd"),
        Param("BLOCK_M_BWD", (1, 2, 4, 8, 16), "bwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16), "bwd"),
        Param("num_stages_bwd", (1, 2, 3, 4), "bwd"),
    )

    def check_dims(self) -> None:
        self.vocab = self.dims["vocab"]
        # a chunk wider than the row only adds masked lanes
        self.max_block_v = max(self.MIN_BLOCK_V, next_power_of_2(self.vocab))

    def heuristic(self) -> DivergenceConfig:
        """Analytic default, valid for every vocab: ~2K-element tiles (one row per program at LLM vocab
        sizes, several rows per program for small vocabularies), 8 warps or fewer, no pipelining (many
        resident programs per SM already keep enough loads in flight for a streaming kernel)."""
        block_v = min(self.TARGET_TILE, self.max_block_v)
        block_m = max(1, min(16, self.TARGET_TILE // block_v))
        warps = self.fit_warps(8, block_m * block_v, 4)
        config = DivergenceConfig(
            BLOCK_V_FWD=block_v, BLOCK_M_FWD=block_m, num_warps_fwd=warps, num_stages_fwd=1,
            BLOCK_V_BWD=block_v, BLOCK_M_BWD=block_m, num_warps_bwd=warps, num_stages_bwd=1,
        )
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for vocab={self.vocab}: {problems}"
        return config

    def shape_violations(self, config: DivergenceConfig) -> list[str]:
        """Chunk width against the vocab, threads, registers and shared memory of both kernels."""
        problems: list[str] = []
        for phase, block_v, block_m, warps, stages, streams in (
            ("fwd", config.BLOCK_V_FWD, config.BLOCK_M_FWD, config.num_warps_fwd, config.num_stages_fwd,
             self.FWD_STREAMS),
            ("bwd", config.BLOCK_V_BWD, config.BLOCK_M_BWD, config.num_warps_bwd, config.num_stages_bwd,
             self.BWD_STREAMS),
        ):
            if block_v > self.max_block_v:
                problems.append(f"{phase}: BLOCK_V={block_v} > {self.max_block_v} (vocab={self.vocab}): "
                                f"the chunk would be mostly masked")
            tile = block_m * block_v
            problems += self.threads_violations(phase, warps, tile, self.MAX_ELEMS_PER_THREAD)
            # pipelined loads keep (stages − 1) chunks of each stream in shared memory; 4 bytes per element
            # because a call may mix dtypes (e.g. a bf16 input with an fp32 target) under this dtype's table
            smem = (stages - 1) * streams * tile * 4
            problems += self.smem_violations(phase, smem)
        return problems


# ------------------------------------------------------------------------------------------------ tuning

# Tuning holds the inputs, a float64 gradient reference and the check's float64 temporaries on the GPU at
# once (~40 bytes per element): rows are capped so a 128256 vocab tunes at <= 8192 tokens (~42 GB) and no
# problem exceeds 2^31 elements. Larger token counts use the nearest (capped) bucket at run time, where the
# per-program work is the same and only the grid is longer.
MAX_TUNING_ROWS = 8192
MAX_TUNING_ELEMENTS = 2**31


def tuning_row_cap(vocab: int) -> int:
    """MAX_TUNING_ROWS, or the largest power of two with rows·vocab <= 2^31 when that is smaller."""
    return min(MAX_TUNING_ROWS, 1 << max(0, (MAX_TUNING_ELEMENTS // max(1, vocab)).bit_length() - 1))


def tuning_rows(vocab: int, rows: list[int]) -> list[int]:
    """``rows`` capped at ``tuning_row_cap(vocab)``, deduplicated."""
    return capped_rows(rows, tuning_row_cap(vocab))


# ------------------------------------------------------------------------------------------------ per-row JSD

# kernel MODE constexpr: the two endpoints are the limits JSD_b / beta and JSD_b / (1 − beta), not JSD_b itself
FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2


def check_beta(op: str, beta) -> float:
    """The generalised JSD's beta as a float in [0, 1]; TypeError / ValueError naming ``op`` and the value."""
    beta = check_float_arg(op, "beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"{op}: beta must be in [0, 1], got {beta}")
    return beta


def jsd_mode(beta: float) -> int:
    """The kernel's MODE constexpr for ``beta``: the endpoints are separate formulas, not limits of the mixture."""
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE


def jsd_rows(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-row generalized JSD Σ_vocab of (rows..., vocab) log-probabilities, in their dtype, differentiable by
    autograd without NaN where a probability is exactly 0 (such a term is 0, its limit)."""
    dead = (s == -math.inf) & (t == -math.inf)  # both probabilities 0: the term is 0
    s = s.masked_fill(dead, 0.0)
    t = t.masked_fill(dead, 0.0)

    def plogr(p: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
        """p·log_ratio with 0 where p = 0, also in the gradient (no 0·inf)."""
        zero = p == 0
        return torch.where(zero, 0.0, p * torch.where(zero, 0.0, log_ratio))

    if beta == 0.0:
        terms = plogr(t.exp(), t - s)
    elif beta == 1.0:
        terms = plogr(s.exp(), s - t)
    else:
        log_m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
        terms = plogr(beta * t.exp(), t - log_m) + plogr((1 - beta) * s.exp(), s - log_m)
    return terms.masked_fill(dead, 0.0).sum(-1)
