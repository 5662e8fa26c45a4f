"""The LM-head machinery the chunked losses share — fused linear cross-entropy, selective log-softmax, fused
linear JSD and the post-training losses all run on it:

* the checks of the head's weight (``check_lm_head``) and the targets' dtypes (``TARGET_DTYPES``);
* the GEMMs around a chunk's loss kernel: the logits of a chunk of hidden states in x's dtype or fp32
  (``lm_head_logits``, ``mm_fp32_out``) and the fp32 accumulation of dW (``accumulate_dw``), with the CPU
  paths' vocabulary slicing;
* the chunk plan every op's config starts with (``ChunkPlanConfig``: rows per chunk, the logits' and dW's
  dtypes) and its search space under one extra-memory budget (``ChunkPlanSpace``);
* the chunk engine (``ChunkEngine``): one call's plan lookup, the walk over row chunks with the logits GEMM and
  bias, the reused chunk buffers, and each chunk's dx, dW (fp32 accumulation or added in x's dtype) and db;
  each op subclasses it with its own per-chunk kernels;
* the tuning problem's base of an op at a model's (hidden, vocab) (``LMHeadProblem``, ``lm_head_tuning_problems``).

Imports none of the ops. (The in-place scaling of the gradients, ``cross_entropy_rows.scale_in_place``, stays with
cross-entropy: its kernel is cross-entropy's.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from liger_gen.codegen.problems import Inputs, Problem, randn, targets
from liger_gen.codegen.spaces import KernelConfig, Param, Space
from liger_gen.runtime.ops import KERNEL_DTYPES, describe, kernel_module, uses_triton

LOW_PRECISION = (torch.bfloat16, torch.float16)
#: the dtypes of the LM-head losses' class-index targets
TARGET_DTYPES = (torch.int64, torch.int32)


# ------------------------------------------------------------------------------------------------ checks


def check_lm_head(op: str, lm_head_weight: torch.Tensor, bias: torch.Tensor | None, hidden: int) -> None:
    """ValueError for an LM head the chunked ops cannot use whole: a DeepSpeed ZeRO-3 partition (``ds_shape``
    differs from the shape) or an empty weight (a shard read outside its module's forward)."""
    for name, t in (("lm_head_weight", lm_head_weight), ("bias", bias)):
        full = getattr(t, "ds_shape", None)  # DeepSpeed ZeRO-3 marks its partitioned parameters
        if full is not None and tuple(t.shape) != tuple(full):
            raise ValueError(f"{op}: {name} is a DeepSpeed ZeRO-3 partition ({describe(name, t)}) of a parameter of "
                             f"shape {tuple(full)}; the loss needs the whole weight, which DeepSpeed gathers when "
                             f"it is read inside the forward of a module it manages: compute the loss there (the "
                             f"forward liger_gen.apply_to patches does), or register the weight with "
                             f"deepspeed.zero.register_external_parameter(module, weight) for the module whose "
                             f"forward computes it")
    if lm_head_weight.numel() == 0:
        raise ValueError(f"{op}: lm_head_weight is empty ({describe('lm_head_weight', lm_head_weight)}): an empty "
                         f"shard, as a sharded model's parameter read outside its module's forward; pass the whole "
                         f"(vocab, {hidden}) weight (a DTensor's full_tensor(); under DeepSpeed ZeRO-3, read it "
                         f"inside the forward of a module DeepSpeed manages)")


# ------------------------------------------------------------------------------------------------ GEMMs


_ADDMM_FP32_ACCUMULATE: bool | None = None  # does addmm(out_dtype=fp32) accept an fp32 accumulator? (torch version)
SLICE_BYTES = 32 * 2**20  # fp32 temporaries of the sliced GEMMs below (per operand)


def _vocab_slices(vocab: int, width: int):
    """Slices of the vocabulary whose fp32 temporaries of ``width`` columns stay within SLICE_BYTES."""
    step = max(1, SLICE_BYTES // (4 * max(1, width)))
    return [slice(v0, min(v0 + step, vocab)) for v0 in range(0, vocab, step)]


def accumulate_dw(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with a 16-bit ``a`` (vocab, n), ``b`` (n, hidden) and an fp32 ``acc``, never rounding the
    product.

    CUDA: ``addmm(out_dtype=float32)`` in place where this torch accepts an fp32 ``self``; older versions only
    accept a ``self`` of the inputs' dtype, so the fallback adds fp32 ``mm`` products per slice of the
    vocabulary (the check fails in the dispatcher, before any launch). CPU (no fp32-output GEMM of 16-bit
    operands): fp32 copies of ``b`` and of one vocabulary slice of ``a`` at a time, added in place.
    """
    global _ADDMM_FP32_ACCUMULATE
    if acc.is_cuda:
        if _ADDMM_FP32_ACCUMULATE is not False:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                _ADDMM_FP32_ACCUMULATE = True
                return
            except (RuntimeError, TypeError):
                if _ADDMM_FP32_ACCUMULATE:
                    raise
                _ADDMM_FP32_ACCUMULATE = False
        for s in _vocab_slices(acc.shape[0], acc.shape[1]):
            acc[s] += torch.mm(a[s], b, out_dtype=torch.float32)
        return
    b32 = b.float()
    for s in _vocab_slices(acc.shape[0], max(acc.shape[1], a.shape[1])):
        acc[s].addmm_(a[s].float(), b32)


def mm_fp32_out(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ w.T`` in fp32 for 16-bit ``x`` (n, hidden), ``w`` (vocab, hidden): fp32 accumulation, never
    rounded. CUDA has the GEMM; on the CPU, fp32 copies of x and of one vocabulary slice of w at a time."""
    if out.is_cuda:
        torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        return
    x32 = x.float()
    for s in _vocab_slices(w.shape[0], max(w.shape[1], x.shape[0])):
        out[:, s] = torch.mm(x32, w[s].float().t())


def lm_head_logits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out = x @ w.T (+ bias)`` with fp32 accumulation, stored in ``out``'s dtype (x's, or fp32)."""
    if out.dtype == x.dtype:
        if bias is not None:
            torch.addmm(bias, x, w.t(), out=out)
        else:
            torch.mm(x, w.t(), out=out)
    else:
        mm_fp32_out(x, w, out)
        if bias is not None:
            out.add_(bias)
    return out


# ------------------------------------------------------------------------------------------------ chunk plan


@dataclass(frozen=True)
class ChunkPlanConfig(KernelConfig):
    """The chunk plan that opens every chunked LM-head op's config (the op's kernel settings follow it).

    CHUNK_ROWS: rows per chunk: the M of the logits and dx GEMMs and the K of the dW GEMM. Each chunk's dW GEMM
        reads and writes the whole dW (vocab × hidden), so small chunks make it memory bound; large chunks cost
        memory.
    LOGITS_FP32: 1 = the logits GEMM writes fp32 (never rounded) and the gradient goes to a second buffer in
        x's dtype; 0 = the GEMM writes logits in x's dtype (as transformers' bf16 ``lm_head`` output does;
        cuBLAS accumulates in fp32 and rounds once) and the op's kernel overwrites them with the gradient in
        place: a third of the chunk memory, so chunks three times as large fit the same budget.
    DW_FP32: 1 = dW is summed over chunks in an fp32 accumulator (vocab × hidden × 4 bytes extra); 0 = each
        chunk's dW GEMM adds into dW in x's dtype (``addmm`` with beta 1: fp32 inside the GEMM, one rounding per
        chunk). bfloat16 only (float16 sums could overflow, float32 needs no accumulator).
    Both flags are 1 for float32 inputs (their logits and dW are fp32 anyway).
    """

    CHUNK_ROWS: int = 1024
    LOGITS_FP32: int = 0
    DW_FP32: int = 0


CHUNK_CHOICES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
#: the chunk plan's tunables, the first of every chunked op's PARAMS (all tuned in the one phase, "fwd")
CHUNK_PLAN_PARAMS = (
    Param("CHUNK_ROWS", CHUNK_CHOICES, "fwd"),
    Param("LOGITS_FP32", (0, 1), "fwd"),
    Param("DW_FP32", (0, 1), "fwd"),
)


class ChunkPlanSpace(Space):
    """The chunk plan's part of a chunked LM-head op's space at dims ``{"hidden": H, "vocab": V}`` and a dtype:
    the flags the dtype fixes, the memory budget, and the heuristic's chunk (the largest within the budget).

    Tuned as one phase ("fwd"). Memory: the chunk's ``LOGITS_BUFFERS`` logits buffers (plus a gradient buffer in
    x's dtype with fp32 logits) and (DW_FP32=1 with bfloat16) the fp32 dW accumulator may take at most
    MAX_EXTRA_BYTES, except that the smallest chunk is always allowed (huge vocabularies). float16 always sums dW
    in fp32 (not counted: it has no alternative).
    """

    DIMS = ("hidden", "vocab")
    phases = ("fwd",)
    CHUNK_CHOICES = CHUNK_CHOICES
    # peak extra memory of one call beyond its inputs and gradients (the issue's +256 MiB at Llama-3 shapes)
    MAX_EXTRA_BYTES = 256 * 2**20
    LOGITS_BUFFERS = 1  # (CHUNK_ROWS, vocab) logits buffers of a chunk (plus a gradient buffer with fp32 logits)

    def check_dims(self) -> None:
        self.hidden, self.vocab = self.dims["hidden"], self.dims["vocab"]

    def extra_bytes(self, config: ChunkPlanConfig) -> int:
        """Chunk buffers (+ the fp32 dW accumulator of bfloat16 with DW_FP32=1) in bytes."""
        e = self.element_size
        if e == 4:
            return config.CHUNK_ROWS * self.vocab * 4 * self.LOGITS_BUFFERS
        chunk = config.CHUNK_ROWS * self.vocab * (self.LOGITS_BUFFERS * (4 if config.LOGITS_FP32 else e)
                                                  + (e if config.LOGITS_FP32 else 0))
        accumulator = self.vocab * self.hidden * 4 if config.DW_FP32 and self.dtype == torch.bfloat16 else 0
        return chunk + accumulator

    def smallest_plan(self) -> dict[str, int]:
        """The heuristic's plan before its chunk grows: the smallest chunk, logits in x's dtype (fp32 for float32
        inputs), dW summed in x's dtype for bfloat16 and in fp32 otherwise."""
        fp32 = self.element_size == 4
        return dict(CHUNK_ROWS=self.CHUNK_CHOICES[0], LOGITS_FP32=int(fp32),
                    DW_FP32=int(fp32 or self.dtype == torch.float16))

    def largest_chunk(self, config):
        """``config`` with the largest CHUNK_ROWS that ``shape_violations`` allows (the heuristic's chunk); the
        result is asserted valid."""
        best = config
        for choice in self.CHUNK_CHOICES:
            candidate = dataclasses.replace(best, CHUNK_ROWS=choice)
            if not self.shape_violations(candidate):
                best = candidate
        problems = self.violations(best)
        assert not problems, f"heuristic is invalid for {self.dims}: {problems}"
        return best

    def flag_violations(self, config: ChunkPlanConfig) -> list[str]:
        """The flags the dtype fixes: float32 has fp32 logits and dW, float16 sums dW in fp32."""
        problems = []
        if self.element_size == 4 and not (config.LOGITS_FP32 and config.DW_FP32):
            problems.append("fwd: float32 inputs have fp32 logits and dW: LOGITS_FP32 and DW_FP32 must be 1")
        if self.dtype == torch.float16 and not config.DW_FP32:
            problems.append("fwd: float16 dW sums over chunks could overflow: DW_FP32 must be 1")
        return problems

    def memory_violations(self, config: ChunkPlanConfig) -> list[str]:
        """Extra memory <= MAX_EXTRA_BYTES (the smallest chunk exempt)."""
        size = self.extra_bytes(config)
        if config.CHUNK_ROWS > self.CHUNK_CHOICES[0] and size > self.MAX_EXTRA_BYTES:
            return [f"fwd: CHUNK_ROWS={config.CHUNK_ROWS}, LOGITS_FP32={config.LOGITS_FP32}, "
                    f"DW_FP32={config.DW_FP32} need {size / 2**20:.0f} MiB of extra memory at {self.dims} > "
                    f"{self.MAX_EXTRA_BYTES / 2**20:.0f} MiB"]
        return []


# ------------------------------------------------------------------------------------------------ chunk engine


class ChunkEngine:
    """One call's walk over the row chunks of x (rows, hidden) through the LM head W (vocab, hidden) (+ bias).

    The engine owns what every chunked LM-head op does the same way: the plan (the table's or the heuristic's
    config of ``SPACE``, or a given one: rows per chunk, fewer on the CPU paths; the logits' and dW's dtypes),
    the chunk buffers (reused by every chunk), each chunk's logits GEMM (fp32 accumulation, bias in the
    epilogue) and, from the gradient of the chunk's logits that the op's kernel writes, the chunk's dx = grad @ W,
    its share of dW (written by the first chunk's GEMM in x's dtype, or summed in fp32) and of db.
    ``walk`` drives a chunk loop; the op's subclass supplies its kernels as the ``step`` of each chunk (the
    post-training losses use the pieces directly, over chunks of whole sequences).

    Subclasses set ``SPACE`` (a ``ChunkPlanSpace``: chunk choices, memory budget, config class) and
    ``CPU_BYTES_PER_LOGIT`` (what the CPU paths' fp32 working copies take per logit), or override
    ``cpu_chunk_rows``.
    """

    SPACE: ClassVar[type[ChunkPlanSpace]]
    CPU_BYTES_PER_LOGIT: ClassVar[int] = 12

    def __init__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor | None,
                 plan=None):
        """``plan``: a config of ``SPACE`` or a dict of its fields; None: the table's, else the heuristic's (with
        the rendered kernel module as ``self.module`` on the Triton paths)."""
        self.x, self.w, self.bias, self.target = x, w, bias, target
        self.rows, self.hidden = x.shape
        self.vocab = w.shape[0]
        self.module = None
        if plan is None:
            config, self.module = self.lookup()
        else:
            config = plan if isinstance(plan, KernelConfig) else self.SPACE.config_cls.from_dict(plan)
        self.use_plan(config, fit_cpu=True)

    def lookup(self):
        """(config, kernel module or None) of this call's shape: the table's or the heuristic's; no module on
        the plain CPU path."""
        dims = {"hidden": self.hidden, "vocab": self.vocab}
        if uses_triton(self.x):
            module, config, _ = kernel_module(self.SPACE, self.x, dims, max(1, self.rows))
            return config, module
        space = self.SPACE(dims, self.x.dtype if self.x.dtype in KERNEL_DTYPES else torch.float32)
        return space.heuristic(), None

    def use_plan(self, config, fit_cpu: bool = False) -> None:
        """Take ``config``'s chunk plan: the logits' and dW's dtypes and the rows per chunk (with ``fit_cpu``, on
        the CPU paths, ``cpu_chunk_rows``; else the plan's own, as the tuner times it)."""
        x = self.x
        self.config = config
        low = x.dtype in LOW_PRECISION
        self.logits_dtype = torch.float32 if (config.LOGITS_FP32 or not low) else x.dtype
        # dW summed in fp32 unless the plan adds each chunk's product into dW in x's dtype (bfloat16 only)
        self.dw_dtype = torch.float32 if (config.DW_FP32 or x.dtype != torch.bfloat16) else x.dtype
        chunk = self.cpu_chunk_rows(config) if fit_cpu and not x.is_cuda else config.CHUNK_ROWS
        self.chunk = min(chunk, max(self.rows, 1))

    def cpu_chunk_rows(self, config) -> int:
        """Rows per chunk on the CPU paths: the plan's, fewer where ``CPU_BYTES_PER_LOGIT`` per logit would exceed
        the space's budget (never fewer than its smallest chunk)."""
        space = self.SPACE
        fit = space.MAX_EXTRA_BYTES // max(1, self.CPU_BYTES_PER_LOGIT * self.vocab)
        return max(space.CHUNK_CHOICES[0], min(config.CHUNK_ROWS, fit))

    def spans(self):
        """The chunks' row ranges [lo, hi), in order."""
        return ((lo, min(lo + self.chunk, self.rows)) for lo in range(0, self.rows, self.chunk))

    def logits(self, xc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The chunk's logits ``xc @ W.T (+ bias)`` into ``out`` (fp32 accumulation, stored in out's dtype)."""
        return lm_head_logits(xc, self.w, self.bias, out)

    def grad_outputs(self, need_dx: bool, need_dw: bool, need_db: bool):
        """(dx, dW, db) to fill, None where not needed: dW in x's dtype is written by the first chunk's GEMM,
        an fp32 dW and db are summed from zero."""
        dev, dtype = self.x.device, self.x.dtype
        dx = torch.empty((self.rows, self.hidden), dtype=dtype, device=dev) if need_dx else None
        dw = None
        if need_dw:
            dw = (torch.empty if self.dw_dtype == dtype and self.rows else torch.zeros)(
                (self.vocab, self.hidden), dtype=self.dw_dtype, device=dev)
        db = torch.zeros(self.vocab, dtype=torch.float32, device=dev) if need_db else None
        return dx, dw, db

    def buffers(self, rows: int, grad: bool = True):
        """(logits buffer, gradient buffer) of ``rows`` rows; the gradient buffer is None without ``grad`` or
        when the gradient is written over the logits (logits in x's dtype): the gradient GEMMs take it in x's
        dtype, one operand dtype."""
        dev = self.x.device
        buf = torch.empty((rows, self.vocab), dtype=self.logits_dtype, device=dev)
        separate = grad and self.logits_dtype != self.x.dtype
        return buf, (torch.empty((rows, self.vocab), dtype=self.x.dtype, device=dev) if separate else None)

    def add_grads(self, grad, xc, first: bool, dx, dw, db) -> None:
        """dx = grad @ W for the chunk's rows (``dx`` None: not needed); grad.T @ xc added into dW (written by the
        first chunk when dW is in x's dtype: the GEMM adds in fp32 and rounds once) and grad's column sums into
        db (each None: not needed)."""
        if dx is not None:
            torch.mm(grad, self.w, out=dx)
        if dw is not None:
            if dw.dtype == xc.dtype and first:
                torch.mm(grad.t(), xc, out=dw)
            elif dw.dtype == xc.dtype:
                dw.addmm_(grad.t(), xc)
            else:
                accumulate_dw(dw, grad.t(), xc)
        if db is not None:
            db += grad.sum(dim=0, dtype=torch.float32)

    def walk(self, step: Callable, need_dx: bool = False, need_dw: bool = False, need_db: bool = False,
             grad: bool | None = None):
        """The chunk loop: for each chunk [lo, hi), its logits z into the reused buffer, ``step(lo, hi, z, g)``
        (the op's kernels: the chunk's per-row results and, with gradients, d/d(logits) written into ``g``: z
        itself when the logits are in x's dtype, else the gradient buffer; g is None without gradients), then
        the chunk's dx, dW and db from g. ``grad``: whether the steps write gradients (default: any need_*).
        Returns (dx, dW, db), None where not needed."""
        want = (need_dx or need_dw or need_db) if grad is None else grad
        dx, dw, db = self.grad_outputs(need_dx, need_dw, need_db)
        if self.rows == 0:
            return dx, dw, db
        buf, gbuf = self.buffers(self.chunk, want)
        for lo, hi in self.spans():
            xc = self.x[lo:hi]
            z = self.logits(xc, buf[:hi - lo])
            g = (z if gbuf is None else gbuf[:hi - lo]) if want else None
            step(lo, hi, z, g)
            if g is not None and (need_dx or need_dw or need_db):
                self.add_grads(g, xc, lo == 0, None if dx is None else dx[lo:hi], dw, db)
        return dx, dw, db


# ------------------------------------------------------------------------------------------------ tuning


MAX_TUNING_ROWS = 4096  # each trial is a full training step (3-4 GEMMs); the best chunk barely depends on rows


class LMHeadProblem(Problem):
    """An LM-head op at (rows, hidden, vocab): the model's (hidden_size, vocab_size), 8192 tokens by default;
    inputs x ~ N(0, 1), W ~ N(0, (2/√H)²) and targets with 1 in 20 ignored, and the upstream gradient of the
    first output that ``upstream_gradient`` draws (None: the loss's own)."""

    DEFAULT_ROWS = 8192

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {"hidden": model.hidden_size, "vocab": model.vocab_size}

    @classmethod
    def upstream_gradient(cls, gen: torch.Generator, rows: int, device) -> torch.Tensor | None:
        return None

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        r, h, v = dims["rows"], dims["hidden"], dims["vocab"]
        g = cls.upstream_gradient(gen, r, device)
        return Inputs({"x": randn(gen, (r, h), dtype, device),
                       "w": randn(gen, (v, h), dtype, device, 2.0 / math.sqrt(h)),
                       "target": targets(gen, r, v, device)}, grad_of=("x", "w"), upstream={cls.OUTPUTS[0]: g})

    def flops(self, phase: str) -> int:
        return self.step_flops(self.problem_dims)


def lm_head_tuning_problems(problem: type[Problem]):
    """``tuning_problems`` of an LM-head op: ``problem`` at the model's (hidden_size, vocab_size), token counts
    capped at MAX_TUNING_ROWS."""

    def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
        dims = {"hidden": model.hidden_size, "vocab": model.vocab_size}
        capped = sorted({min(int(r), MAX_TUNING_ROWS) for r in rows})
        return [problem(dtype, dims, r, device, seed=seed) for r in capped]

    return tuning_problems
