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

from liger_gen.codegen.spaces import KernelConfig, Param, Space
from liger_gen.ops.lm_head import chunks
from liger_gen.ops.lm_head.cross_entropy_space import BLOCK_V_CHOICES, CrossEntropyConfig, CrossEntropySpace


# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class FusedLinearCrossEntropyConfig(KernelConfig):
    """Launch plan of FLCE: rows per chunk, the chunk's logits dtype and the dW accumulator's dtype.

    CHUNK_ROWS: the M of the logits and dx GEMMs and the K of the dW GEMM. Each chunk's dW GEMM reads and writes
        the whole dW (vocab × hidden), so small chunks make it memory bound; large chunks cost memory.
    LOGITS_FP32: 1 = the logits GEMM writes fp32 (never rounded) and the gradient goes to a second buffer in
        x's dtype; 0 = the GEMM writes logits in x's dtype (as transformers' bf16 ``lm_head`` output does;
        cuBLAS accumulates in fp32 and rounds once) and the cross-entropy kernel overwrites them with the
        gradient in place: a third of the chunk memory, so chunks three times as large fit the same budget.
    DW_FP32: 1 = dW is summed over chunks in an fp32 accumulator (vocab × hidden × 4 bytes extra); 0 = each
        chunk's dW GEMM adds into dW in x's dtype (``addmm`` with beta 1: fp32 inside the GEMM, one rounding per
        chunk). bfloat16 only (float16 sums could overflow, float32 needs no accumulator).
    Both flags are 1 for float32 inputs (their logits and dW are fp32 anyway).
    CE_*: launch settings of the cross-entropy kernel that writes each chunk's losses and dlogits (cross_entropy's
        BLOCK_V_BWD, BLOCK_M_BWD, num_warps_bwd, num_stages_bwd), tuned here at the chunk's shape because a
        chunk has far fewer rows than cross_entropy's own tuning problems (rows per program set the parallelism).
    """

    CHUNK_ROWS: int = 1024
    LOGITS_FP32: int = 0
    DW_FP32: int = 0
    CE_BLOCK_V: int = 2048
    CE_BLOCK_M: int = 1
    CE_WARPS: int = 4
    CE_STAGES: int = 1


class FusedLinearCrossEntropySpace(Space):
    """Search space, constraints and heuristic of FLCE at dims ``{"hidden": H, "vocab": V}`` and a dtype.

    Tuned as one phase ("fwd": the fused forward that also computes every gradient, reduction "mean"); the
    reduction="none" backward reuses the plan. Memory constraint: the chunk buffers plus (DW_FP32=1 with bfloat16)
    the fp32 dW accumulator may take at most MAX_EXTRA_BYTES, except that the smallest chunk is always allowed
    (huge vocabularies). float16 always sums dW in fp32 (not counted: it has no alternative).
    """

    op = "fused_linear_cross_entropy"
    template = "fused_linear_cross_entropy"
    also_renders = ("cross_entropy",)  # the CE_* settings launch cross-entropy's kernels
    config_cls = FusedLinearCrossEntropyConfig
    DIMS = ("hidden", "vocab")
    phases = ("fwd",)
    CHUNK_CHOICES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
    # peak extra memory of one call beyond its inputs and gradients (the issue's +256 MiB at Llama-3 shapes)
    MAX_EXTRA_BYTES = 256 * 2**20

    PARAMS = (
        Param("CHUNK_ROWS", CHUNK_CHOICES, "fwd"),
        Param("LOGITS_FP32", (0, 1), "fwd"),
        Param("DW_FP32", (0, 1), "fwd"),
        Param("CE_BLOCK_V", BLOCK_V_CHOICES, "fwd"),
        Param("CE_BLOCK_M", (1, 2, 4, 8, 16, 32, 64), "fwd"),
        Param("CE_WARPS", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("CE_STAGES", (1, 2, 3, 4), "fwd"),
    )

    def check_dims(self) -> None:
        self.hidden, self.vocab = self.dims["hidden"], self.dims["vocab"]

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

    def extra_bytes(self, config: FusedLinearCrossEntropyConfig) -> int:
        """Chunk buffers (+ the fp32 dW accumulator of bfloat16 with DW_FP32=1) in bytes."""
        e = self.element_size
        if e == 4:
            return config.CHUNK_ROWS * self.vocab * 4
        chunk = config.CHUNK_ROWS * self.vocab * ((4 + e) if config.LOGITS_FP32 else e)
        accumulator = self.vocab * self.hidden * 4 if config.DW_FP32 and self.dtype == torch.bfloat16 else 0
        return chunk + accumulator

    def heuristic(self) -> FusedLinearCrossEntropyConfig:
        """Rounded logits, dW summed in x's dtype (bf16), and the largest chunk within MAX_EXTRA_BYTES."""
        fp32 = self.element_size == 4
        dw_fp32 = int(fp32 or self.dtype == torch.float16)
        logits = torch.float32 if fp32 else self.dtype
        ce = CrossEntropySpace(self.vocab, logits, self.limits).heuristic()
        ce_params = dict(CE_BLOCK_V=ce.BLOCK_V_BWD, CE_BLOCK_M=ce.BLOCK_M_BWD, CE_WARPS=ce.num_warps_bwd,
                         CE_STAGES=ce.num_stages_bwd)
        best = FusedLinearCrossEntropyConfig(CHUNK_ROWS=self.CHUNK_CHOICES[0], LOGITS_FP32=int(fp32), DW_FP32=dw_fp32,
                                             **ce_params)
        for choice in self.CHUNK_CHOICES:
            config = dataclasses.replace(best, CHUNK_ROWS=choice)
            if not self.shape_violations(config):
                best = config
        problems = self.violations(best)
        assert not problems, f"heuristic is invalid for {self.dims}: {problems}"
        return best

    def shape_violations(self, config: FusedLinearCrossEntropyConfig) -> list[str]:
        """Flags fixed by the dtype; extra memory <= MAX_EXTRA_BYTES (smallest chunk exempt)."""
        problems = []
        if self.element_size == 4 and not (config.LOGITS_FP32 and config.DW_FP32):
            problems.append("fwd: float32 inputs have fp32 logits and dW: LOGITS_FP32 and DW_FP32 must be 1")
        if self.dtype == torch.float16 and not config.DW_FP32:
            problems.append("fwd: float16 dW sums over chunks could overflow: DW_FP32 must be 1")
        problems += [f"{p} (CE_* params)" for p in CrossEntropySpace(self.vocab, self.logits_dtype(config),
                                                                        self.limits).shape_violations(
            self.ce_config(config)) if p.startswith("bwd")]
        size = self.extra_bytes(config)
        if config.CHUNK_ROWS > self.CHUNK_CHOICES[0] and size > self.MAX_EXTRA_BYTES:
            problems.append(f"fwd: CHUNK_ROWS={config.CHUNK_ROWS}, LOGITS_FP32={config.LOGITS_FP32}, "
                            f"DW_FP32={config.DW_FP32} need {size / 2**20:.0f} MiB of extra memory at "
                            f"{self.dims} > {self.MAX_EXTRA_BYTES / 2**20:.0f} MiB")
        return problems


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
