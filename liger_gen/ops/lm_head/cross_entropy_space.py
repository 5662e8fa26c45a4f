"""The cross-entropy kernel's launch settings and search space (``templates/cross_entropy.py.jinja``): what
``cross_entropy`` tunes, and what fused linear cross-entropy's per-chunk launches (its CE_* settings) and the
row-level API (``cross_entropy_rows``) launch the same kernels with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2, warps_for


@dataclass(frozen=True)
class CrossEntropyConfig(KernelConfig):
    """Launch settings of one cross-entropy variant (``templates/cross_entropy.py.jinja``).

    GRAD_IN_FWD=1: when a gradient is needed the forward kernel writes dlogits for a unit upstream gradient
    while each row is still in L2, and the backward only rescales rows whose upstream gradient is not exactly 1
    (decided on the device): about one read and one write of the logits per training step when the loss is
    used as is, one more read and write when it is scaled (e.g. divided by gradient-accumulation steps).
    GRAD_IN_FWD=0: the forward reads the logits once and stores lse; the backward reads them again and writes
    dlogits (two reads and one write, whatever the upstream gradient). float16 always uses 0 (FP16_GRAD_IN_FWD).

    *_FWD: the loss-only forward kernel (no gradient needed, and the forward of GRAD_IN_FWD=0).
    *_BWD: the kernel that writes the gradient (the recompute backward, or the gradient-writing forward).
    BLOCK_V is the vocab tile (a row is streamed in BLOCK_V tiles; one tile when BLOCK_V >= V, and then the
    gradient-writing forward keeps the row in registers), BLOCK_M the rows per program.
    L2_HINTS=1 adds cache eviction hints: the forward's first pass over a row asks L2 to keep it for the second
    pass, and single-use reads and the dlogits writes are marked evict-first (so 2 GB of fresh dlogits do not
    push the rows still to be re-read out of L2).
    """

    GRAD_IN_FWD: int = 1
    BLOCK_V_FWD: int = 4096
    BLOCK_M_FWD: int = 1
    num_warps_fwd: int = 8
    num_stages_fwd: int = 1
    BLOCK_V_BWD: int = 4096
    BLOCK_M_BWD: int = 1
    num_warps_bwd: int = 8
    num_stages_bwd: int = 1
    L2_HINTS: int = 0


BLOCK_V_CHOICES = tuple(2 ** k for k in range(4, 16))  # 16 .. 32768
FP16_GRAD_IN_FWD = ("GRAD_IN_FWD=1 with float16: a gradient stored for a unit upstream gradient underflows fp16 "
                    "(entries below 6e-8 flush to zero) before a loss scale (GradScaler) could lift it")


class CrossEntropySpace(Space):
    """Search space, constraints and heuristic of cross-entropy for one vocab size (dims ``{"vocab": V}``).

    One tuning phase, named "fwd", times the whole training step (forward and backward): GRAD_IN_FWD moves the
    gradient from the backward kernel into the forward one, so the two kernels can only be compared together.
    The loss-only forward params are sampled only when GRAD_IN_FWD=0 (with 1 training never runs that kernel).
    """

    op = "cross_entropy"
    template = "cross_entropy"
    config_cls = CrossEntropyConfig
    DIMS = ("vocab",)
    phases = ("fwd",)
    # fp32 values one thread may hold per tile: the gradient kernel spills past 32 (sm_90, 32768-column tile on
    # 32 warps: 64 registers and a 96-byte stack; 16 per thread: no spill)
    MAX_ELEMS_PER_THREAD = 32
    # below this a long row is streamed in too many tiny tiles (one reduction per tile)
    MIN_STREAM_TILE = 512

    PARAMS = (
        Param("GRAD_IN_FWD", (0, 1), "fwd"),
        Param("BLOCK_V_FWD", BLOCK_V_CHOICES, "fwd", when=("GRAD_IN_FWD", 0)),
        Param("BLOCK_M_FWD", (1, 2, 4, 8, 16, 32, 64), "fwd", when=("GRAD_IN_FWD", 0)),
        Param("num_warps_fwd", (1, 2, 4, 8, 16, 32), "fwd", when=("GRAD_IN_FWD", 0)),
        Param("num_stages_fwd", (1, 2, 3, 4), "fwd", when=("GRAD_IN_FWD", 0)),
        Param("BLOCK_V_BWD", BLOCK_V_CHOICES, "fwd"),
        Param("BLOCK_M_BWD", (1, 2, 4, 8, 16, 32, 64), "fwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("num_stages_bwd", (1, 2, 3, 4), "fwd"),
        Param("L2_HINTS", (0, 1), "fwd"),
    )

    def check_dims(self) -> None:
        self.vocab = self.dims["vocab"]
        self.block_v_full = max(16, next_power_of_2(self.vocab))  # a whole row in one tile

    def params(self, phase: str) -> tuple[Param, ...]:
        """The tunables, with the vocab tiles narrowed to those this vocab allows (shape_violations rejects the
        others; sampling them would spend the tuner's trial budget on pruned points)."""
        lo, hi = min(self.block_v_full, self.MIN_STREAM_TILE), self.block_v_full
        return tuple(dataclasses.replace(p, choices=tuple(c for c in p.choices if lo <= c <= hi))
                     if p.name.startswith("BLOCK_V") else p for p in super().params(phase))

    def heuristic(self) -> CrossEntropyConfig:
        """Analytic default, valid for every vocab; ~16 fp32 values per thread.

        Loss kernel: the whole row in one tile up to 8192 columns (several rows per program for small vocabs,
        ~2K-element tiles), 8192-column tiles streamed beyond. Gradient kernel: tiles up to 2048 columns on 4
        warps (many resident programs per SM; measured on an H200 at 8192 x 128256 bf16, 2026-11-30: 1.72 ms
        for the training step against 1.94 ms with 16384-column tiles on 32 warps, scratch sweep of
        BLOCK_V_BWD x num_warps_bwd at BLOCK_M_BWD=1). The gradient is written in the forward, except for
        float16 (FP16_GRAD_IN_FWD).
        """
        fwd_v = min(self.block_v_full, 8192)
        fwd_m = max(1, min(64, 2048 // fwd_v))
        bwd_v = min(self.block_v_full, 2048)
        bwd_m = max(1, min(64, 2048 // bwd_v))
        config = CrossEntropyConfig(
            GRAD_IN_FWD=0 if self.dtype == torch.float16 else 1,
            BLOCK_V_FWD=fwd_v, BLOCK_M_FWD=fwd_m, num_stages_fwd=1,
            num_warps_fwd=self.fit_warps(warps_for(fwd_m * fwd_v, max_warps=16, per_thread=16), fwd_m * fwd_v),
            BLOCK_V_BWD=bwd_v, BLOCK_M_BWD=bwd_m, num_stages_bwd=1,
            num_warps_bwd=self.fit_warps(warps_for(bwd_m * bwd_v, max_warps=32, per_thread=16), bwd_m * bwd_v),
        )
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for vocab={self.vocab}: {problems}"
        return config

    def shape_violations(self, config: CrossEntropyConfig) -> list[str]:
        """Tile bounds, threads, registers and shared memory of the loss kernel and the gradient kernel."""
        problems: list[str] = []
        if config.GRAD_IN_FWD and self.dtype == torch.float16:
            problems.append(FP16_GRAD_IN_FWD)
        for phase, block_v, block_m, warps, stages in (
            ("fwd", config.BLOCK_V_FWD, config.BLOCK_M_FWD, config.num_warps_fwd, config.num_stages_fwd),
            ("bwd", config.BLOCK_V_BWD, config.BLOCK_M_BWD, config.num_warps_bwd, config.num_stages_bwd),
        ):
            if block_v > self.block_v_full:
                problems.append(f"{phase}: BLOCK_V={block_v} > {self.block_v_full} (the whole row of vocab "
                                f"{self.vocab} fits a smaller tile)")
            if block_v < min(self.block_v_full, self.MIN_STREAM_TILE):
                problems.append(f"{phase}: BLOCK_V={block_v} streams a row of {self.vocab} in tiles smaller than "
                                f"{min(self.block_v_full, self.MIN_STREAM_TILE)}")
            tile = block_m * block_v
            problems += self.threads_violations(phase, warps, tile, self.MAX_ELEMS_PER_THREAD)
            # pipelined loads keep (stages - 1) tiles of logits in shared memory, plus reduction scratch
            smem = (stages - 1) * tile * self.element_size + block_m * warps * 4 * 4
            problems += self.smem_violations(phase, smem)
        return problems
