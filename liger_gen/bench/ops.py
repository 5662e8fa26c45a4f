"""The ops of ``liger-gen bench``: one ``Case`` per op, everything about it as data.

A case says, for one op at one model's shapes: the dims (``dims(model, rows)``), the minimal bytes of one
training step (forward + backward) and, for matmul ops, its flops — pure functions of the dims, so they can be
checked without a GPU —, how to make seeded inputs and upstream gradients, the float64 truth of every output and
gradient, and the function each provider calls. Adding an op is one more ``Case`` in ``CASES``.

Minimal bytes ("speed of light" traffic; R rows, H hidden, I intermediate, V vocab, s the element size):

* layers (norms, RoPE, GLU) — the forward reads its inputs and writes its outputs (plus the fp32 per-row
  statistics a backward needs: rstd, mean); the backward reads the upstream gradients and the saved inputs and
  writes the gradients. Each tensor counted once per pass.
* losses (cross-entropy, FLCE, KL, JSD) — the upstream gradient is a scalar known to be applied last, so the
  floor is one read of every input and one write of every gradient (what a gradient-in-forward kernel moves).

Re-reads inside a pass, scratch buffers and any extra kernels a provider launches are not counted: this is the
floor every implementation has to move, so GB/s is comparable across providers.

A provider function takes ``(tensors, options)`` (dicts) and returns the tuple of differentiable outputs named
by ``Case.outputs``; gradients are taken for ``Inputs.grad_of`` and named ``"d" + input name``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from liger_gen import functional as lg
from liger_gen.codegen.problems import float64_grads
from liger_gen.models import PRESETS, ModelShape, resolve_model
from liger_gen.reference import (cross_entropy_float64, cross_entropy_torch, fused_add_rms_norm_float64,
                                 fused_add_rms_norm_torch, fused_linear_cross_entropy_float64_chunked,
                                 geglu_float64, geglu_torch, jsd_float64, jsd_torch, kl_div_float64, kl_div_torch,
                                 layer_norm_float64, layer_norm_torch, rms_norm_float64, rms_norm_torch, rope_float64,
                                 rope_torch, swiglu_float64, swiglu_torch)

IGNORE_INDEX = -100
IGNORE_FRACTION = 0.05  # share of targets / labels set to ignore_index in the loss ops
TARGET_BYTES = 8  # int64 targets and labels
STAT_BYTES = 4  # fp32 per-row statistics (rstd, mean)
ROPE_THETA = 500000.0  # Llama 3's rope_theta
REF_CHUNK_ELEMENTS = 1 << 25  # float64 reference chunk of the (rows, vocab) ops: 256 MB per temporary

# A model small enough for Triton's interpreter on the CPU (``--model tiny``), from the one model registry.
TINY = PRESETS["tiny"]

Tensors = dict[str, torch.Tensor]
Options = dict[str, Any]
ProviderFn = Callable[[Tensors, Options], tuple]


@dataclass
class Inputs:
    """One op's inputs on the device.

    tensors: every input tensor by name (none requires grad here; each provider gets private copies).
    grad_of: the names of the inputs to differentiate; their gradients are named ``"d" + name``.
    upstream: output name -> upstream gradient of that output, or None for a scalar loss (gradient 1).
    options: non-tensor arguments (eps, beta, ...).
    """

    tensors: Tensors
    grad_of: tuple[str, ...]
    upstream: dict[str, torch.Tensor | None]
    options: Options = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """Everything the harness needs about one op; see the module docstring for the conventions."""

    op: str
    default_rows: int
    dims: Callable[[ModelShape, int], dict[str, int]]
    bytes: Callable[[dict[str, int], int], int]
    bytes_formula: str
    make: Callable[[dict[str, int], torch.dtype, torch.device, torch.Generator, ModelShape], Inputs]
    outputs: tuple[str, ...]
    eager: ProviderFn
    eager_note: str
    liger_gen: ProviderFn
    reference: Callable[[Inputs], dict[str, torch.Tensor]]
    lookup_dims: Callable[[dict[str, int]], int | dict[str, int]]
    liger_kernel: Callable[[], ProviderFn] | None = None
    liger_kernel_note: str = ""
    flops: Callable[[dict[str, int]], int] = lambda dims: 0
    flops_formula: str = ""
    # extra peers for this op only: provider name -> (loader returning a ProviderFn, note)
    peers: dict[str, tuple[Callable[[], ProviderFn], str]] = field(default_factory=dict)

    def gradient_names(self, inputs: Inputs) -> tuple[str, ...]:
        return tuple("d" + name for name in inputs.grad_of)


# ------------------------------------------------------------------------------------------------ helpers


def randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Seeded N(shift, scale²) samples drawn on ``device`` in fp32, in row chunks (bounded temporaries)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    step = REF_CHUNK_ELEMENTS
    for lo in range(0, flat.numel(), step):
        n = min(step, flat.numel() - lo)
        chunk = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        flat[lo:lo + n] = (chunk * scale + shift).to(dtype)
    return out


def log_probs(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype, device: torch.device,
              scale: float = 2.0) -> torch.Tensor:
    """Seeded log_softmax of N(0, scale²) logits, normalised in fp32 row chunk by row chunk, in ``dtype``."""
    out = torch.empty((rows, vocab), dtype=dtype, device=device)
    step = max(1, REF_CHUNK_ELEMENTS // max(vocab, 1))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        z = torch.randn((hi - lo, vocab), generator=gen, device=device, dtype=torch.float32) * scale
        out[lo:hi] = torch.log_softmax(z, dim=-1).to(dtype)
    return out


def targets(gen: torch.Generator, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """int64 class indices in [0, vocab) with IGNORE_FRACTION of them set to IGNORE_INDEX."""
    t = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    ignore = torch.rand(rows, generator=gen, device=device) < IGNORE_FRACTION
    return t.masked_fill(ignore, IGNORE_INDEX)


def chunk_rows(vocab: int) -> int:
    """Rows per float64 reference chunk so that one (rows, vocab) float64 temporary stays ~256 MB."""
    return max(1, REF_CHUNK_ELEMENTS // max(vocab, 1))


def llama_cos_sin(seq: int, dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, seq, dim) cos and sin as Llama's rotary embedding gives them: fp32 angles, cast to ``dtype``."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def reference_by_autograd(inputs: Inputs, fn64: Callable[[Tensors, Options], tuple],
                          output_names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Float64 outputs and gradients of ``fn64`` (a float64 reference taking ``(tensors, options)``), by
    ``liger_gen.codegen.problems.float64_grads``: each output name and each ``"d" + input`` name maps to a
    float64 tensor (upstream gradients as given, 1 for scalar losses)."""
    names = list(inputs.tensors)
    outs, grads = float64_grads(lambda *ts: fn64(dict(zip(names, ts)), inputs.options),
                                [inputs.tensors[n] for n in names], [names.index(n) for n in inputs.grad_of],
                                [inputs.upstream[n] for n in output_names])
    ref = dict(zip(output_names, outs))
    ref.update({"d" + n: g for n, g in zip(inputs.grad_of, grads)})
    return ref


# ------------------------------------------------------------------------------------------------ norms


def _norm_dims(model: ModelShape, rows: int) -> dict[str, int]:
    return {"rows": rows, "hidden": model.hidden_size}


def _rms_norm_bytes(d: dict[str, int], s: int) -> int:
    # fwd: x, w in; y, rstd out.  bwd: dy, x, w, rstd in; dx, dw out.
    r, h = d["rows"], d["hidden"]
    return 5 * r * h * s + 3 * h * s + 2 * r * STAT_BYTES


def _rms_norm_make(d, dtype, device, gen, model):
    r, h = d["rows"], d["hidden"]
    return Inputs({"x": randn(gen, (r, h), dtype, device), "w": randn(gen, (h,), dtype, device, 0.1, 1.0)},
                  grad_of=("x", "w"), upstream={"y": randn(gen, (r, h), dtype, device)},
                  options={"eps": model.rms_norm_eps})


def _rms_norm_eager(t, o):
    return (rms_norm_torch(t["x"], t["w"], o["eps"], 0.0, "llama"),)


def _rms_norm_lg(t, o):
    return (lg.rms_norm(t["x"], t["w"], eps=o["eps"], offset=0.0, casting_mode="llama"),)


def _rms_norm_ref(ins):
    return reference_by_autograd(ins, lambda t, o: (rms_norm_float64(t["x"], t["w"], o["eps"]),), ("y",))


def _lk_rms_norm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # LigerRMSNorm's defaults: offset 0, casting "llama", in_place=True (dx overwrites dy)
    return lambda t, o: (LigerRMSNormFunction.apply(t["x"], t["w"], o["eps"], 0.0, "llama", True),)


def _fused_add_bytes(d: dict[str, int], s: int) -> int:
    # fwd: x, r, w in; y, s, rstd out.  bwd: dy, ds, s, w, rstd in; dx, dr, dw out.
    r, h = d["rows"], d["hidden"]
    return 9 * r * h * s + 3 * h * s + 2 * r * STAT_BYTES


def _fused_add_make(d, dtype, device, gen, model):
    r, h = d["rows"], d["hidden"]
    return Inputs({"x": randn(gen, (r, h), dtype, device), "residual": randn(gen, (r, h), dtype, device),
                   "w": randn(gen, (h,), dtype, device, 0.1, 1.0)},
                  grad_of=("x", "residual", "w"),
                  upstream={"y": randn(gen, (r, h), dtype, device), "s": randn(gen, (r, h), dtype, device)},
                  options={"eps": model.rms_norm_eps})


def _fused_add_eager(t, o):
    return fused_add_rms_norm_torch(t["x"], t["residual"], t["w"], o["eps"], 0.0, "llama")


def _fused_add_lg(t, o):
    return lg.fused_add_rms_norm(t["x"], t["residual"], t["w"], eps=o["eps"], offset=0.0, casting_mode="llama")


def _fused_add_ref(ins):
    return reference_by_autograd(
        ins, lambda t, o: fused_add_rms_norm_float64(t["x"], t["residual"], t["w"], o["eps"]), ("y", "s"))


def _lk_fused_add():
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    # LigerFusedAddRMSNorm's defaults: offset 0, casting "llama", in_place=False
    return lambda t, o: tuple(LigerFusedAddRMSNormFunction.apply(t["x"], t["residual"], t["w"], o["eps"], 0.0,
                                                                 "llama", False))


def _layer_norm_bytes(d: dict[str, int], s: int) -> int:
    # fwd: x, w, b in; y, mean, rstd out.  bwd: dy, x, w, mean, rstd in; dx, dw, db out.
    r, h = d["rows"], d["hidden"]
    return 5 * r * h * s + 5 * h * s + 4 * r * STAT_BYTES


def _layer_norm_make(d, dtype, device, gen, model):
    r, h = d["rows"], d["hidden"]
    return Inputs({"x": randn(gen, (r, h), dtype, device, 1.0, 0.5), "w": randn(gen, (h,), dtype, device, 0.1, 1.0),
                   "b": randn(gen, (h,), dtype, device, 0.1)},
                  grad_of=("x", "w", "b"), upstream={"y": randn(gen, (r, h), dtype, device)}, options={"eps": 1e-5})


def _layer_norm_eager(t, o):
    return (layer_norm_torch(t["x"], t["w"], t["b"], o["eps"]),)


def _layer_norm_lg(t, o):
    return (lg.layer_norm(t["x"], t["w"], t["b"], eps=o["eps"]),)


def _layer_norm_ref(ins):
    return reference_by_autograd(ins, lambda t, o: (layer_norm_float64(t["x"], t["w"], t["b"], o["eps"]),), ("y",))


def _lk_layer_norm():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda t, o: (LigerLayerNormFunction.apply(t["x"], t["w"], t["b"], o["eps"]),)


# ------------------------------------------------------------------------------------------------ rope


def _rope_dims(model: ModelShape, rows: int) -> dict[str, int]:
    seq = math.gcd(rows, 4096)  # 16384 tokens -> 4 sequences of 4096
    return {"rows": rows, "batch": rows // seq, "seq": seq, "n_q_heads": model.num_attention_heads,
            "n_kv_heads": model.num_key_value_heads, "head_dim": model.head_dim}


def _rope_bytes(d: dict[str, int], s: int) -> int:
    # each pass: q, k (or their gradients) in and out, cos and sin in
    qk = d["rows"] * (d["n_q_heads"] + d["n_kv_heads"]) * d["head_dim"] * s
    cos_sin = 2 * d["seq"] * d["head_dim"] * s
    return 2 * (2 * qk + cos_sin)


def _rope_make(d, dtype, device, gen, model):
    b, s, hq, hk, hd = d["batch"], d["seq"], d["n_q_heads"], d["n_kv_heads"], d["head_dim"]

    def heads(n):  # transformers' layout: a (b, s, h, d) projection viewed as (b, h, s, d)
        return randn(gen, (b, s, n, hd), dtype, device).transpose(1, 2)

    cos, sin = llama_cos_sin(s, hd, dtype, device)
    return Inputs({"q": heads(hq), "k": heads(hk), "cos": cos, "sin": sin}, grad_of=("q", "k"),
                  upstream={"q_out": heads(hq), "k_out": heads(hk)})


def _rope_eager(t, o):
    return rope_torch(t["q"], t["k"], t["cos"], t["sin"])


def _rope_lg(t, o):
    return lg.rope(t["q"], t["k"], t["cos"], t["sin"])


def _rope_ref(ins):
    return reference_by_autograd(ins, lambda t, o: rope_float64(t["q"], t["k"], t["cos"], t["sin"]),
                                 ("q_out", "k_out"))


def _lk_rope():
    from liger_kernel.ops.rope import LigerRopeFunction

    return lambda t, o: tuple(LigerRopeFunction.apply(t["q"], t["k"], t["cos"], t["sin"]))


# ------------------------------------------------------------------------------------------------ GLU


def _glu_dims(model: ModelShape, rows: int) -> dict[str, int]:
    return {"rows": rows, "intermediate": model.intermediate_size}


def _glu_bytes(d: dict[str, int], s: int) -> int:
    # fwd: gate, up in; y out.  bwd: dy, gate, up in; dgate, dup out.
    return 8 * d["rows"] * d["intermediate"] * s


def _glu_make(d, dtype, device, gen, model):
    shape = (d["rows"], d["intermediate"])
    return Inputs({"gate": randn(gen, shape, dtype, device, 2.0), "up": randn(gen, shape, dtype, device)},
                  grad_of=("gate", "up"), upstream={"y": randn(gen, shape, dtype, device)})


def _swiglu_eager(t, o):
    return (swiglu_torch(t["gate"], t["up"]),)


def _swiglu_lg(t, o):
    return (lg.swiglu(t["gate"], t["up"]),)


def _swiglu_ref(ins):
    return reference_by_autograd(ins, lambda t, o: (swiglu_float64(t["gate"], t["up"]),), ("y",))


def _lk_swiglu():
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return lambda t, o: (LigerSiLUMulFunction.apply(t["gate"], t["up"]),)


def _geglu_eager(t, o):
    return (geglu_torch(t["gate"], t["up"], "tanh"),)


def _geglu_lg(t, o):
    return (lg.geglu(t["gate"], t["up"], approximate="tanh"),)


def _geglu_ref(ins):
    return reference_by_autograd(ins, lambda t, o: (geglu_float64(t["gate"], t["up"], "tanh"),), ("y",))


def _lk_geglu():
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return lambda t, o: (LigerGELUMulFunction.apply(t["gate"], t["up"]),)


# ------------------------------------------------------------------------------------------------ losses


def _vocab_dims(model: ModelShape, rows: int) -> dict[str, int]:
    return {"rows": rows, "vocab": model.vocab_size}


def _ce_bytes(d: dict[str, int], s: int) -> int:
    # logits read once, dlogits written once, targets read
    return 2 * d["rows"] * d["vocab"] * s + d["rows"] * TARGET_BYTES


def _ce_make(d, dtype, device, gen, model):
    r, v = d["rows"], d["vocab"]
    return Inputs({"logits": randn(gen, (r, v), dtype, device, 2.0), "target": targets(gen, r, v, device)},
                  grad_of=("logits",), upstream={"loss": None})


def _ce_eager(t, o):
    return (cross_entropy_torch(t["logits"], t["target"]),)


def _ce_lg(t, o):
    return (lg.cross_entropy(t["logits"], t["target"]),)


def _ce_ref(ins):
    logits, target = ins.tensors["logits"], ins.tensors["target"]
    rows, vocab = logits.shape
    n_valid = (target != IGNORE_INDEX).sum().double()
    dlogits = torch.empty((rows, vocab), dtype=torch.float64, device=logits.device)
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    step = chunk_rows(vocab)
    for lo in range(0, rows, step):
        x64 = logits[lo:lo + step].double().requires_grad_()
        with torch.enable_grad():
            part, _ = cross_entropy_float64(x64, target[lo:lo + step], reduction="sum")
            (dlogits[lo:lo + step],) = torch.autograd.grad(part / n_valid, x64)
        total += part.detach()
    return {"loss": total / n_valid, "dlogits": dlogits}


def _lk_ce():
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap)
    return lambda t, o: (LigerCrossEntropyFunction.apply(t["logits"], t["target"], None, IGNORE_INDEX, 0.0, 0.0,
                                                         "mean", None)[0],)


def _flce_dims(model: ModelShape, rows: int) -> dict[str, int]:
    return {"rows": rows, "hidden": model.hidden_size, "vocab": model.vocab_size}


def _flce_bytes(d: dict[str, int], s: int) -> int:
    # x and W read, dx and dW written, targets read; the logits never leave the chip's chunks
    r, h, v = d["rows"], d["hidden"], d["vocab"]
    return 2 * r * h * s + 2 * v * h * s + r * TARGET_BYTES


def _flce_flops(d: dict[str, int]) -> int:
    # three GEMMs of 2·R·H·V: logits, dx = dlogits @ W, dW = dlogits^T @ x
    return 6 * d["rows"] * d["hidden"] * d["vocab"]


def _flce_make(d, dtype, device, gen, model):
    r, h, v = d["rows"], d["hidden"], d["vocab"]
    return Inputs({"x": randn(gen, (r, h), dtype, device), "w": randn(gen, (v, h), dtype, device, 2.0 / math.sqrt(h)),
                   "target": targets(gen, r, v, device)}, grad_of=("x", "w"), upstream={"loss": None})


def _flce_eager(t, o):
    # transformers' causal-LM loss: the LM head in the activations' dtype, logits upcast, then cross-entropy
    logits = t["x"] @ t["w"].t()
    return (F.cross_entropy(logits.float(), t["target"], ignore_index=IGNORE_INDEX),)


def _flce_lg(t, o):
    return (lg.fused_linear_cross_entropy(t["x"], t["w"], t["target"]),)


def _flce_ref(ins):
    t = ins.tensors
    loss, _, dx, dw, _ = fused_linear_cross_entropy_float64_chunked(t["x"], t["w"], t["target"])
    return {"loss": loss, "dx": dx, "dw": dw}


def _lk_flce():
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
    #  softcap, return_z_loss, accum_dtype): Liger's default accum_dtype=None sums dW over chunks in the weight's
    #  dtype, as liger-gen's bf16 plans do (DW_FP32=0)
    return lambda t, o: (LigerFusedLinearCrossEntropyFunction.apply(
        t["x"], t["w"], t["target"], None, None, IGNORE_INDEX, 0.0, 0.0, "mean", None, False, None)[0],)


def _cce_flce():
    from cut_cross_entropy import linear_cross_entropy

    return lambda t, o: (linear_cross_entropy(t["x"], t["w"], t["target"], ignore_index=IGNORE_INDEX,
                                              reduction="mean"),)


def _kl_bytes(d: dict[str, int], s: int) -> int:
    # input and target read, d input written (the target is not differentiated)
    return 3 * d["rows"] * d["vocab"] * s


def _kl_make(d, dtype, device, gen, model):
    r, v = d["rows"], d["vocab"]
    x = log_probs(gen, r, v, dtype, device)
    t = log_probs(gen, r, v, torch.float32, device).exp_().to(dtype)
    return Inputs({"input": x, "target": t}, grad_of=("input",), upstream={"loss": None})


def _kl_eager(t, o):
    return (kl_div_torch(t["input"], t["target"], "batchmean"),)


def _kl_lg(t, o):
    return (lg.kl_div(t["input"], t["target"], reduction="batchmean"),)


def _kl_ref(ins):
    x, target = ins.tensors["input"], ins.tensors["target"]
    rows, vocab = x.shape
    dx = torch.empty((rows, vocab), dtype=torch.float64, device=x.device)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    step = chunk_rows(vocab)
    for lo in range(0, rows, step):
        x64 = x[lo:lo + step].double().requires_grad_()
        with torch.enable_grad():
            part = kl_div_float64(x64, target[lo:lo + step], "sum")
            (dx[lo:lo + step],) = torch.autograd.grad(part / rows, x64)
        total += part.detach()
    return {"loss": total / rows, "dinput": dx}


def _lk_kl():
    from liger_kernel.ops.kl_div import LigerKLDivLossFunction

    return lambda t, o: (LigerKLDivLossFunction.apply(t["input"], t["target"], "batchmean", False, 1e-10),)


def _jsd_bytes(d: dict[str, int], s: int) -> int:
    # student and teacher read, d student written, labels read
    return 3 * d["rows"] * d["vocab"] * s + d["rows"] * TARGET_BYTES


def _jsd_make(d, dtype, device, gen, model):
    r, v = d["rows"], d["vocab"]
    return Inputs({"student": log_probs(gen, r, v, dtype, device), "teacher": log_probs(gen, r, v, dtype, device),
                   "label": targets(gen, r, v, device)},
                  grad_of=("student",), upstream={"loss": None}, options={"beta": 0.5})


def _jsd_eager(t, o):
    return (jsd_torch(t["student"], t["teacher"], o["beta"], IGNORE_INDEX, t["label"]),)


def _jsd_lg(t, o):
    return (lg.jsd(t["student"], t["teacher"], beta=o["beta"], ignore_index=IGNORE_INDEX, label=t["label"]),)


def _jsd_ref(ins):
    s, teacher, label = ins.tensors["student"], ins.tensors["teacher"], ins.tensors["label"]
    beta = ins.options["beta"]
    rows, vocab = s.shape
    n_valid = (label != IGNORE_INDEX).sum().clamp_min(1).double()
    ds = torch.empty((rows, vocab), dtype=torch.float64, device=s.device)
    total = torch.zeros((), dtype=torch.float64, device=s.device)
    step = chunk_rows(vocab)
    for lo in range(0, rows, step):
        s64 = s[lo:lo + step].double().requires_grad_()
        lab = label[lo:lo + step]
        with torch.enable_grad():
            # jsd_float64 is a mean over the chunk's valid rows: scale it back to the chunk's sum
            chunk_valid = (lab != IGNORE_INDEX).sum().clamp_min(1).double()
            part = jsd_float64(s64, teacher[lo:lo + step].double(), beta, IGNORE_INDEX, lab) * chunk_valid
            (ds[lo:lo + step],) = torch.autograd.grad(part / n_valid, s64)
        total += part.detach()
    return {"loss": total / n_valid, "dstudent": ds}


def _lk_jsd():
    from liger_kernel.ops.jsd import LigerJSDFunction

    return lambda t, o: (LigerJSDFunction.apply(t["student"], t["teacher"], t["label"], o["beta"], IGNORE_INDEX),)


# ------------------------------------------------------------------------------------------------ the cases

_NORM_ROWS = _GLU_ROWS = 16384
_VOCAB_ROWS = 8192  # the cross-entropy shape: 8192 x 128256

CASES: dict[str, Case] = {c.op: c for c in (
    Case("rms_norm", _NORM_ROWS, _norm_dims, _rms_norm_bytes, "5·R·H·s + 3·H·s + 2·R·4", _rms_norm_make, ("y",),
         _rms_norm_eager, "rms_norm_torch (transformers' LlamaRMSNorm)", _rms_norm_lg, _rms_norm_ref,
         lambda d: d["hidden"], _lk_rms_norm,
         "LigerRMSNormFunction(offset=0, casting_mode='llama', in_place=True): dx is written into dy"),
    Case("fused_add_rms_norm", _NORM_ROWS, _norm_dims, _fused_add_bytes, "9·R·H·s + 3·H·s + 2·R·4",
         _fused_add_make, ("y", "s"), _fused_add_eager, "x + residual, then rms_norm_torch (transformers' decoder)",
         _fused_add_lg, _fused_add_ref, lambda d: d["hidden"], _lk_fused_add,
         "LigerFusedAddRMSNormFunction(offset=0, casting_mode='llama', in_place=False): returns one tensor as both "
         "dx and dresidual"),
    Case("layer_norm", _NORM_ROWS, _norm_dims, _layer_norm_bytes, "5·R·H·s + 5·H·s + 4·R·4", _layer_norm_make,
         ("y",), _layer_norm_eager, "F.layer_norm", _layer_norm_lg, _layer_norm_ref, lambda d: d["hidden"],
         _lk_layer_norm, "LigerLayerNormFunction(eps=1e-5)"),
    Case("rope", _NORM_ROWS, _rope_dims, _rope_bytes, "4·R·(Hq + Hkv)·D·s + 4·S·D·s", _rope_make,
         ("q_out", "k_out"), _rope_eager, "rope_torch (transformers' apply_rotary_pos_emb)", _rope_lg, _rope_ref,
         lambda d: {"n_q_heads": d["n_q_heads"], "n_kv_heads": d["n_kv_heads"], "head_dim": d["head_dim"],
                    "rotary_dim": d["head_dim"]},
         _lk_rope, "LigerRopeFunction: rotates q and k in their own storage (in place), and dq, dk likewise"),
    Case("swiglu", _GLU_ROWS, _glu_dims, _glu_bytes, "8·R·I·s", _glu_make, ("y",), _swiglu_eager,
         "silu(gate) * up (transformers' LlamaMLP)", _swiglu_lg, _swiglu_ref, lambda d: d["intermediate"],
         _lk_swiglu, "LigerSiLUMulFunction: writes dgate and dup into gate and up (in place)"),
    Case("geglu", _GLU_ROWS, _glu_dims, _glu_bytes, "8·R·I·s", _glu_make, ("y",), _geglu_eager,
         "gelu(gate, approximate='tanh') * up (transformers' GemmaMLP)", _geglu_lg, _geglu_ref,
         lambda d: d["intermediate"], _lk_geglu,
         "LigerGELUMulFunction (tanh approximation): writes dgate and dup into gate and up (in place)"),
    Case("cross_entropy", _VOCAB_ROWS, _vocab_dims, _ce_bytes, "2·R·V·s + 8·R", _ce_make, ("loss",), _ce_eager,
         "F.cross_entropy of the fp32-upcast logits, mean (transformers' loss)", _ce_lg, _ce_ref,
         lambda d: d["vocab"], _lk_ce,
         "LigerCrossEntropyFunction(reduction='mean'): the loss is returned in the logits' dtype (bf16 sum of bf16 "
         "row losses; liger-gen returns fp32); dlogits is written into the logits (in place); two host syncs "
         "(.item()) per forward"),
    Case("fused_linear_cross_entropy", _VOCAB_ROWS, _flce_dims, _flce_bytes, "2·R·H·s + 2·V·H·s + 8·R",
         _flce_make, ("loss",), _flce_eager,
         "transformers' causal-LM loss: x @ W.T in the activations' dtype, logits.float(), F.cross_entropy (mean)",
         _flce_lg, _flce_ref, lambda d: {"hidden": d["hidden"], "vocab": d["vocab"]}, _lk_flce,
         "LigerFusedLinearCrossEntropyFunction(reduction='mean', accum_dtype=None, its default): dW summed over "
         "chunks in the weight's dtype, as liger-gen's bf16 plans (DW_FP32=0); host syncs per forward",
         _flce_flops, "6·R·H·V",
         peers={"cut-cross-entropy": (_cce_flce, "cut_cross_entropy.linear_cross_entropy(reduction='mean') with its "
                                      "default filter_eps='high': logit-gradient entries below eps(dtype)/32 are "
                                      "skipped (approximate gradients)")}),
    Case("kl_div", _VOCAB_ROWS, _vocab_dims, _kl_bytes, "3·R·V·s", _kl_make, ("loss",), _kl_eager,
         "F.kl_div(reduction='batchmean')", _kl_lg, _kl_ref, lambda d: d["vocab"], _lk_kl,
         "LigerKLDivLossFunction(reduction='batchmean', eps=1e-10): t·(log max(t, eps) − x) and an fp32 loss "
         "(liger-gen returns the inputs' dtype)"),
    Case("jsd", _VOCAB_ROWS, _vocab_dims, _jsd_bytes, "3·R·V·s + 8·R", _jsd_make, ("loss",), _jsd_eager,
         "jsd_torch (fp32 math), beta 0.5, with labels", _jsd_lg, _jsd_ref, lambda d: d["vocab"], _lk_jsd,
         "LigerJSDFunction(beta=0.5, shift_labels=label): d student computed in the forward next to an fp32 "
         "(rows, vocab) loss buffer"),
)}


def bench_model(name_or_path: str) -> ModelShape:
    """Anything ``liger_gen.models.resolve_model`` takes (``"tiny"`` is the CPU-sized model)."""
    return resolve_model(name_or_path)


def get_case(op: str) -> Case:
    """The case of ``op``; KeyError names the ops that have one."""
    if op not in CASES:
        raise KeyError(f"no benchmark case for op {op!r}; cases: {', '.join(CASES)}")
    return CASES[op]
