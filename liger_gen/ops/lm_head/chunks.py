"""The LM-head chunk machinery the chunked losses share: the checks of the head's weight (and the targets'
dtypes, ``TARGET_DTYPES``), and the GEMMs around a chunk's loss kernel — the logits of a chunk of hidden states in
x's dtype or fp32 (``lm_head_logits``, ``mm_fp32_out``) and the fp32 accumulation of dW (``accumulate_dw``) —
with the CPU paths' vocabulary slicing.
Imports none of the ops: the chunk loops themselves are ``fused_linear_cross_entropy._Chunked`` and
``selective_log_softmax.Chunks`` (which the distillation and preference losses build on).
"""

from __future__ import annotations

import torch

from liger_gen.runtime.ops import describe

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
