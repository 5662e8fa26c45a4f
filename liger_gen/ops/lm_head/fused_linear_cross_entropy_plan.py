"""The launch plan of fused linear cross-entropy: its settings (``FusedLinearCrossEntropyConfig``: rows per
chunk, the logits' and dW accumulator's dtypes, the per-chunk cross-entropy kernel's settings) and their search
space under a memory budget, the per-chunk cross-entropy kernel config a plan implies, and the smaller chunks
of the CPU paths (``cpu_chunk_rows``). The op module looks the plan up (the table's, or a given one) per call.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from liger_gen.codegen.spaces import Param
from liger_gen.ops.lm_head import chunks
from liger_gen.ops.lm_head.chunks import CHUNK_PLAN_PARAMS, ChunkPlanConfig, ChunkPlanSpace
from liger_gen.ops.lm_head.cross_entropy_space import BLOCK_V_CHOICES, CrossEntropyConfig, CrossEntropySpace


# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class FusedLinearCrossEntropyConfig(ChunkPlanConfig):
    """Launch plan of FLCE: the chunk plan (``chunks.ChunkPlanConfig``: rows per chunk, the chunk's logits dtype
    and the dW accumulator's dtype; with LOGITS_FP32=0 the cross-entropy kernel overwrites the logits with their
    gradient in place) and the per-chunk cross-entropy kernel's settings.

    CE_*: launch settings of the cross-entropy kernel that writes each chunk's losses and dlogits (cross_entropy's
        BLOCK_V_BWD, BLOCK_M_BWD, num_warps_bwd, num_stages_bwd), tuned here at the chunk's shape because a
        chunk has far fewer rows than cross_entropy's own tuning problems (rows per program set the parallelism).
    """

    CE_BLOCK_V: int = 2048
    CE_BLOCK_M: int = 1
    CE_WARPS: int = 4
    CE_STAGES: int = 1


class FusedLinearCrossEntropySpace(ChunkPlanSpace):
    """Search space, constraints and heuristic of FLCE at dims ``{"hidden": H, "vocab": V}`` and a dtype: the
    chunk plan's (``chunks.ChunkPlanSpace``: its memory budget MAX_EXTRA_BYTES) and the CE_* settings'.

    Tuned as one phase ("fwd": the fused forward that also computes every gradient, reduction "mean"); the
    reduction="none" backward reuses the plan.
    """

    op = "fused_linear_cross_entropy"
    template = "fused_linear_cross_entropy"
    also_renders = ("cross_entropy",)  # the CE_* settings launch cross-entropy's kernels
    config_cls = FusedLinearCrossEntropyConfig

    PARAMS = (
        *CHUNK_PLAN_PARAMS,
        Param("CE_BLOCK_V", BLOCK_V_CHOICES, "fwd"),
        Param("CE_BLOCK_M", (1, 2, 4, 8, 16, 32, 64), "fwd"),
        Param("CE_WARPS", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("CE_STAGES", (1, 2, 3, 4), "fwd"),
    )

    def params(self, phase: str) -> tuple[Param, ...]:
        """The tunables, with CE_BLOCK_V narrowed as cross_entropy's space narrows its tiles for this vocab."""
        allowed = {c for p in CrossEntropySpace(self.vocab, torch.float32, self.limits).params("fwd")
                   if p.name == "BLOCK_V_BWD" for c in p.choices}
        return tuple(dataclasses.replace(p, choices=tuple(c for c in p.choices if c in allowed))
                     if p.name == "CE_BLOCK_V" else p for p in super().params(phase))

    def logits_dtype(self, config: FusedLinearCrossEntropyConfig) -> torch.dtype:
        return torch.float32 if (config.LOGITS_FP32 or self.element_size == 4) else self.dtype

    def ce_config(self, config: FusedLinearCrossEntropyConfig) -> CrossEntropyConfig:
        """The cross-entropy kernel config of a plan (only its *_BWD fields are used)."""
        base = CrossEntropySpace(self.vocab, self.logits_dtype(config), self.limits).heuristic()
        return dataclasses.replace(base, GRAD_IN_FWD=0, BLOCK_V_BWD=config.CE_BLOCK_V, BLOCK_M_BWD=config.CE_BLOCK_M,
                                   num_warps_bwd=config.CE_WARPS, num_stages_bwd=config.CE_STAGES)

    def heuristic(self) -> FusedLinearCrossEntropyConfig:
        """Rounded logits, dW summed in x's dtype (bf16), and the largest chunk within MAX_EXTRA_BYTES."""
        plan = self.smallest_plan()
        ce = CrossEntropySpace(self.vocab, torch.float32 if plan["LOGITS_FP32"] else self.dtype,
                               self.limits).heuristic()
        return self.largest_chunk(FusedLinearCrossEntropyConfig(
            **plan, CE_BLOCK_V=ce.BLOCK_V_BWD, CE_BLOCK_M=ce.BLOCK_M_BWD, CE_WARPS=ce.num_warps_bwd,
            CE_STAGES=ce.num_stages_bwd))

    def shape_violations(self, config: FusedLinearCrossEntropyConfig) -> list[str]:
        """Flags fixed by the dtype; the CE_* settings valid for the chunk's logits; extra memory <=
        MAX_EXTRA_BYTES (smallest chunk exempt)."""
        problems = self.flag_violations(config)
        problems += [f"{p} (CE_* params)" for p in CrossEntropySpace(self.vocab, self.logits_dtype(config),
                                                                        self.limits).shape_violations(
            self.ce_config(config)) if p.startswith("bwd")]
        return problems + self.memory_violations(config)


# ------------------------------------------------------------------------------------------------ per call


@functools.lru_cache(maxsize=256)
def chunk_ce_config(hidden: int, vocab: int, dtype: torch.dtype, plan: FusedLinearCrossEntropyConfig):
    """The per-chunk cross-entropy kernel config of a plan, built once per (shape, dtype, plan), not per call."""
    return FusedLinearCrossEntropySpace({"hidden": hidden, "vocab": vocab}, dtype).ce_config(plan)


def cpu_chunk_rows(plan: FusedLinearCrossEntropyConfig, dtype: torch.dtype, hidden: int, vocab: int, *,
                   interpreter: bool, softcap: bool) -> int:
    """Rows per chunk on the CPU paths: the plan's, fewer where the CPU's buffers per row would exceed the budget.

    A chunk on the GPU holds the plan's buffers (``FusedLinearCrossEntropySpace.extra_bytes``). The CPU paths
    hold more per row: the plain path computes the cross-entropy in fp32 on a working copy of 16-bit logits (4
    bytes per logit more) and keeps the tanh of soft-capped logits for the gradient (4 more); both CPU paths
    have the sliced GEMMs' fp32 temporaries (``chunks.SLICE_BYTES`` per operand, two operands). The chunk is cut
    so that all of it, with the plan's fp32 dW accumulator, stays within ``MAX_EXTRA_BYTES``.
    """
    space = FusedLinearCrossEntropySpace
    element = torch.finfo(dtype).bits // 8
    low = element < 4
    logits_bytes = 4 if (plan.LOGITS_FP32 or not low) else element
    per_logit = logits_bytes + (element if logits_bytes != element else 0)  # + a separate gradient buffer
    if not interpreter:
        per_logit += (4 if logits_bytes != 4 else 0) + (4 if softcap else 0)
    fp32_acc = bool(plan.DW_FP32) and low
    # fp32 copies of the chunk's x for the fp32-output GEMMs of 16-bit inputs
    per_row = per_logit * vocab + (4 * hidden if low and (logits_bytes == 4 or fp32_acc) else 0)
    accumulator = vocab * hidden * 4 if (fp32_acc and dtype == torch.bfloat16) else 0
    free = space.MAX_EXTRA_BYTES - accumulator - (2 * chunks.SLICE_BYTES if low else 0)
    fit = free // per_row if free > 0 else 0
    return max(min(plan.CHUNK_ROWS, space.CHUNK_CHOICES[0]), min(plan.CHUNK_ROWS, fit))
