"""End-to-end training-step benchmark: plain transformers vs Liger-Kernel vs liger-gen vs torch.compile.

What it measures
----------------
For each model (``STEP_MODELS``, i.e. ``liger_gen.models.ARCHITECTURES``: the published Llama-3.2-1B and
Qwen2.5-0.5B architectures and ``llama3-8b-4l``, Llama-3.1-8B's layer with 4 of its 32 layers, built from
transformers configs written out by hand, plus ``tiny`` / ``tiny-qwen2`` for CPU runs) and each provider, in the
order given, in one process:

- ``transformers``  plain transformers (``attn_implementation="sdpa"``);
- ``liger-kernel``  ``liger_kernel.transformers.apply_liger_kernel_to_<family>(model=model)`` with its defaults
                    (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy); CUDA only;
- ``liger-gen``     ``liger_gen.apply_to(model)`` (RMSNorm, the attention residual add fused into the next RMSNorm,
                    RoPE, SwiGLU MLP, LM-head loss without logits);
- ``torch-compile`` ``torch.compile(model)`` (default mode); the first step's wall time, which holds the
                    compilation, is reported apart (``first_step_s``, ``compile_s``);
- ``liger-gen-unfused-add``  ``liger_gen.apply_to(model, fused_add_rms_norm=False)``: the decoder layers keep
                    transformers' residual add before the post-attention norm (what that fusion is worth).

Every provider trains a freshly built model from the same initial weights (built once with ``seed``, copied to
the host, loaded into each provider's model) for ``warmup_steps + steps + profile_steps`` AdamW steps (bf16
parameters, ``fused=True``, constant ``lr``, ``use_cache=False``, ``model.train()``) on the same batches:
random windows of tiny Shakespeare read as bytes (token ids 0..255, no tokenizer), ``labels = input_ids``
(the model shifts them). Module-level patches a provider makes in transformers' modeling module (Liger-Kernel
replaces ``apply_rotary_pos_emb``, the RMSNorm and MLP classes; liger-gen replaces ``apply_rotary_pos_emb``)
are undone after it (``liger_gen``'s ``restore_rope()`` plus a snapshot of the module's globals), so the next
provider runs what it claims to run. Between providers: model and optimizer deleted, ``gc.collect()``,
``torch.cuda.empty_cache()``, ``torch.cuda.reset_peak_memory_stats()``.

Per provider:

- ``tokens_per_s`` / ``ms_per_step``: the ``steps`` timed steps, wall clock between two
  ``torch.cuda.synchronize()`` calls (warm-up steps excluded); ``step_ms``: each timed step from CUDA events.
- ``peak_allocated_gib`` / ``peak_reserved_gib``: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
  from model build to the end of the timed steps (weights, gradients, AdamW state and activations), GiB = 2**30.
- ``losses``: the loss of every step (warm-up, timed and profiled), in nats per token.
- ``profile`` (CUDA only): ``torch.profiler`` over ``profile_steps`` steps; every GPU activity (kernels, memcpy,
  memset) is put in one of ``KERNEL_CLASSES`` by :func:`classify_kernel` and summed (``kernel_ms``, per step;
  a sum of durations, so two kernels overlapping on two streams count twice). ``busy_ms`` is the union of the
  activity intervals per step (overlaps counted once); ``idle_ms = ms_per_step - busy_ms``: the unprofiled step
  time minus the profiled GPU busy time, i.e. the time per step the GPU waits for the host (launch overhead,
  Python, syncs). It can come out slightly negative from run-to-run noise; it is reported as measured.
- ``loss_check`` (every provider but the reference, ``transformers``): per step ``|loss - loss_ref| /
  |loss_ref|``; ``pass`` when the first step's and the mean over steps are <= ``rel_tol`` (see
  :func:`loss_rel_tolerance` and :func:`compare_losses`) and every loss is finite; the max is reported.
- ``speedup_vs_transformers`` / ``speedup_vs_liger_kernel``: tokens/s ratio (None when that provider did not run).

Output schema (``run_step_benchmark``'s return value, also written as JSON to ``out_dir/step.json``)::

    {
      "schema": "liger-gen/bench-step/1",
      "metadata": {"date": ISO-8601 UTC, "command": str, "device": "cuda:0" | "cpu", "gpu": str | None,
                   "cpu": str, "python", "torch", "triton", "transformers", "liger_kernel" (None if absent),
                   "liger_gen": str, "triton_interpret": str},
      "settings": {"models": [str], "providers": [str], "batch_size": int, "seq_len": int,
                   "warmup_steps": int, "steps": int, "profile_steps": int, "lr": float, "seed": int,
                   "dtype": str, "attn_implementation": str, "text": str, "loss_rel_tol": float,
                   "loss_reference": "transformers", "idle_definition": str},
      "models": {
        MODEL: {
          "config": {transformers config fields that set the shapes}, "n_params": int,
          "providers": {
            PROVIDER: {
              "status": "ok" | "skipped" | "error", "reason": str | None, "traceback": str (errors only),
              "setup_s": float (build, load, patch/compile wrapper), "first_step_s": float,
              "compile_s": float | None (torch-compile: first_step_s minus the median timed step),
              "tokens_per_s": float, "ms_per_step": float, "step_ms": [float],
              "peak_allocated_gib": float | None, "peak_reserved_gib": float | None,
              "losses": [float | None (non-finite)],
              "patch": {"rope": str, "norm_classes": [str], "mlp_classes": [str], "forward": str},
              "profile": None | {"steps": int, "kernel_ms": {CLASS: float}, "kernel_calls": {CLASS: float},
                                 "busy_ms": float, "idle_ms": float, "profiled_ms_per_step": float,
                                 "top_kernels": [{"name", "class", "ms", "calls"}]},
              "loss_check": None | {"reference": str, "max_rel_diff": float | None,
                                    "mean_rel_diff": float | None,
                                    "max_abs_diff": float | None, "first_step_rel_diff": float | None,
                                    "rel_tol": float, "pass": bool, "reason": str (only when no
                                    difference could be computed: lengths differ, non-finite loss)},
              "speedup_vs_transformers": float | None, "speedup_vs_liger_kernel": float | None
            }}}}
    }

How to run
----------
On the GPU (the defaults, 3 warm-up + 10 timed + 2 profiled steps of 8 x 2048 tokens, are sized for both models
and three providers in a few minutes on an H200)::

    python -m liger_gen.bench.step --out $OUT/step
    python -m liger_gen.bench.step --models llama3.2-1b --providers transformers,liger-kernel,liger-gen,torch-compile

On a CPU (tiny model; liger-gen's kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before
Python starts)::

    TRITON_INTERPRET=1 python -m liger_gen.bench.step --models tiny --providers transformers,liger-gen \\
        --batch-size 2 --seq-len 64 --warmup-steps 1 --steps 2 --profile-steps 0

Library use: ``run_step_benchmark(models=[...], providers=[...], ...)`` returns the dict above.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from liger_gen.files import ResultsNotWritten, read_capped_bytes, write_atomic, write_results, writable_folder
from liger_gen.models import ARCHITECTURES, Architecture

SCHEMA = "liger-gen/bench-step/1"
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"
#: The most bytes of training text read (--text). The default text is 1.1 MB and the steps read windows of it at
#: random offsets, so more text adds variety, not work; every byte becomes an int64 token, so 64 MiB of text is
#: 512 MiB of host memory.
MAX_TEXT_BYTES = 64 * 2**20

PROVIDERS: tuple[str, ...] = ("transformers", "liger-kernel", "liger-gen", "torch-compile", "liger-gen-unfused-add")
#: the providers that run ``liger_gen.apply_to``, with its keyword arguments
LIGER_GEN_PROVIDERS: dict[str, dict[str, bool]] = {"liger-gen": {},
                                                   "liger-gen-unfused-add": {"fused_add_rms_norm": False}}
DEFAULT_PROVIDERS: tuple[str, ...] = ("transformers", "liger-kernel", "liger-gen")
DEFAULT_MODELS: tuple[str, ...] = ("llama3.2-1b", "qwen2.5-0.5b")
REFERENCE_PROVIDER = "transformers"

IDLE_DEFINITION = ("idle_ms = ms_per_step (unprofiled timed steps) - busy_ms (union of GPU activity intervals "
                   "per profiled step)")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --------------------------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------------------------


#: The models this benchmark builds: ``liger_gen.models.ARCHITECTURES``, the one registry of models.
STEP_MODELS: dict[str, Architecture] = ARCHITECTURES

_FAMILY_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
_MODELING_MODULES = {"llama": "transformers.models.llama.modeling_llama",
                     "qwen2": "transformers.models.qwen2.modeling_qwen2"}


def _transformers():
    from liger_gen.optional import require

    return require("transformers", "the training-step benchmark")


def _transformers_major() -> int:
    transformers = _transformers()

    return int(transformers.__version__.split(".")[0])


def build_config(name: str, attn_implementation: str = "sdpa"):
    """The transformers config of ``STEP_MODELS[name]`` with ``use_cache=False`` and the attention backend.

    Raises ValueError for an unknown name (listing the known ones).
    """
    spec = _step_model(name)
    transformers = _transformers()

    config_cls = getattr(transformers, _FAMILY_CLASSES[spec.family][0])
    kwargs = dict(spec.fields)
    if _transformers_major() >= 5:
        kwargs["rope_parameters"] = dict(spec.rope)
    else:  # transformers 4.x: rope_theta at top level, scaling (if any) in rope_scaling
        rope = dict(spec.rope)
        kwargs["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = rope
    return config_cls(**kwargs, use_cache=False, attn_implementation=attn_implementation)


def _step_model(name: str) -> Architecture:
    if name not in STEP_MODELS:
        raise ValueError(f"models: unknown model {name!r}; known: {', '.join(STEP_MODELS)}")
    return STEP_MODELS[name]


def build_model(name: str, device: torch.device | str, dtype: torch.dtype, seed: int,
                attn_implementation: str = "sdpa"):
    """A randomly initialised ``*ForCausalLM`` of ``name`` on ``device`` with ``dtype`` parameters, train mode.

    The weights are drawn in float32 on ``device`` right after ``torch.manual_seed(seed)`` and then cast, so
    the same (seed, device) gives the same weights.
    """
    spec = _step_model(name)
    transformers = _transformers()

    config = build_config(name, attn_implementation)
    model_cls = getattr(transformers, _FAMILY_CLASSES[spec.family][1])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    model = model.to(dtype=dtype)
    model.train()
    return model


def config_summary(config) -> dict[str, Any]:
    """The shape-setting fields of a transformers config (what the JSON records per model)."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings",
            "tie_word_embeddings", "hidden_act", "rope_parameters", "rope_theta", "rope_scaling",
            "attention_bias", "_attn_implementation", "use_cache")
    out = {}
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            out[key.lstrip("_")] = dict(value) if isinstance(value, dict) else value
    if "rope_parameters" in out:  # transformers 5 keeps rope_scaling as an alias of the same dict
        out.pop("rope_scaling", None)
    if "head_dim" not in out:
        out["head_dim"] = config.hidden_size // config.num_attention_heads
    return out


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


def read_text_bytes(path: str | Path = DEFAULT_TEXT) -> bytes:
    """The bytes of the training text at ``path`` (any encoding: the tokens are its bytes). ValueError naming the
    path if it cannot be read, is not a regular file (a FIFO, a device such as /dev/zero), is larger than
    MAX_TEXT_BYTES or is empty."""
    try:
        data = read_capped_bytes(path, MAX_TEXT_BYTES, "training text")
    except OSError as exc:
        raise ValueError(f"cannot read training text {path}: {exc.strerror or exc}") from exc
    if not data:
        raise ValueError(f"training text {path} is empty")
    return data


def byte_tokens(path: str | Path = DEFAULT_TEXT) -> torch.Tensor:
    """The file's bytes as an int64 token stream (ids 0..255); ValueError as :func:`read_text_bytes`."""
    return torch.frombuffer(bytearray(read_text_bytes(path)), dtype=torch.uint8).to(torch.int64)


def make_batches(tokens: torch.Tensor, steps: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[steps, batch_size, seq_len]`` int64 windows of ``tokens`` at uniformly random offsets.

    Offsets come from a ``torch.Generator`` seeded with ``seed``, so every run (and every provider) sees the same
    batches in the same order. Raises ValueError if the stream is shorter than one window.
    """
    n = tokens.numel()
    if n < seq_len:
        raise ValueError(
            f"the token stream has {n} tokens (one per byte of the training text), fewer than --seq-len "
            f"{seq_len}; name a longer --text file or a shorter --seq-len"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - seq_len + 1, (steps, batch_size), generator=gen)
    return tokens[starts.unsqueeze(-1) + torch.arange(seq_len)]


# --------------------------------------------------------------------------------------------------------------
# Kernel classes
# --------------------------------------------------------------------------------------------------------------

#: Classes of GPU activity, in report order (``idle`` is computed, not classified).
KERNEL_CLASSES: tuple[str, ...] = ("gemm", "attention", "liger_gen", "triton_other", "optimizer", "elementwise",
                                   "other")
CLASS_LABELS = {"gemm": "GEMM", "attention": "attn", "liger_gen": "liger-gen", "triton_other": "triton other",
                "optimizer": "optim", "elementwise": "elem/reduce", "other": "memcpy/other", "idle": "idle"}

_KERNEL_DEF = re.compile(r"^def\s+(\w+_kernel)\s*\(", re.MULTILINE)
_INDUCTOR_GEMM = re.compile(r"^triton_tem_.*(?:mm|conv)", re.IGNORECASE)
_ATTENTION = re.compile(r"flash|fmha|sdpa|efficient_attention|attention|_attn", re.IGNORECASE)
_OPTIMIZER = re.compile(r"multi_tensor_apply|adam|FusedOptimizer", re.IGNORECASE)
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|splitkreduce", re.IGNORECASE)
_BARE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def liger_gen_kernel_names(templates_dir: Path = TEMPLATES_DIR) -> frozenset[str]:
    """Names of the Triton kernels liger-gen's templates define (``def <name>_kernel(`` in ``*.jinja``).

    Triton names a compiled kernel after its Python function, so these are the names the profiler reports.
    """
    names: set[str] = set()
    for path in sorted(Path(templates_dir).glob("*.jinja")):
        names.update(_KERNEL_DEF.findall(path.read_text(encoding="utf-8")))
    return frozenset(names)


def classify_kernel(name: str, liger_gen_names: Iterable[str] | None = None) -> str:
    """The class in ``KERNEL_CLASSES`` of a GPU activity named ``name`` (as torch.profiler reports it).

    Rules, first match wins:

    1. ``liger_gen``: a liger-gen template kernel (``liger_gen_kernel_names()``), optionally with a suffix that
       older Tritons appended (``rms_norm_fwd_kernel_0d1d2d``).
    2. Inductor kernels (``triton_*``): its matmul templates (``triton_tem_fused_mm...``) are ``gemm``, the
       rest ``triton_other`` (checked before attention: a fused pointwise kernel may carry an SDPA op name).
    3. ``attention``: flash / fmha / sdpa / efficient_attention (before GEMM: ``fmha_cutlassF...`` is attention).
    4. ``optimizer``: ``multi_tensor_apply`` kernels (fused AdamW, foreach ops) and anything named adam.
    5. ``gemm``: cuBLAS / cuBLASLt / CUTLASS kernels (gemm, gemv, cutlass, cublas, xmma, nvjet, splitKreduce).
    6. ``triton_other``: any other bare identifier (Triton kernels are named after a Python function, e.g.
       Liger-Kernel's ``_rms_norm_forward_kernel``; CUDA C++ kernels are reported with ``void ...<...>(...)``).
    7. ``elementwise``: PyTorch's native C++ kernels (names with ``::`` or ``void``): elementwise, reductions,
       copies, index/gather/scatter, embedding.
    8. ``other``: memcpy, memset and anything not recognised.
    """
    names = liger_gen_kernel_names() if liger_gen_names is None else liger_gen_names
    base = name.strip()
    if base in names or any(base.startswith(n + "_") and re.fullmatch(r"[0-9a-z]+", base[len(n) + 1:])
                            for n in names):
        return "liger_gen"
    if base.startswith("triton_"):
        return "gemm" if _INDUCTOR_GEMM.match(base) else "triton_other"
    if _ATTENTION.search(base):
        return "attention"
    if _OPTIMIZER.search(base):
        return "optimizer"
    if _GEMM.search(base):
        return "gemm"
    if _BARE_NAME.match(base):
        return "triton_other"
    if "::" in base or base.startswith("void "):
        return "elementwise"
    return "other"


def busy_union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlapping time counted once), same unit."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"intervals: end {end} < start {start}")
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


@dataclass(frozen=True)
class DeviceEvent:
    """One GPU activity from a profile: name, start and duration in microseconds."""

    name: str
    start_us: float
    duration_us: float


def summarize_profile(events: Sequence[DeviceEvent], n_steps: int, ms_per_step: float | None,
                      profiled_wall_s: float | None = None, liger_gen_names: Iterable[str] | None = None,
                      top: int = 15) -> dict[str, Any]:
    """Per-step kernel time by class, GPU busy time, idle time and the top kernels of ``n_steps`` profiled steps.

    Args:
        events: GPU activities (kernels, memcpy, memset) of the profiled steps.
        n_steps: how many steps the profile covers (>= 1).
        ms_per_step: the unprofiled step time (ms) ``idle_ms`` is computed from (None: idle is None).
        profiled_wall_s: wall time of the profiled steps (s), reported as ``profiled_ms_per_step``.

    Returns the ``profile`` dict of the module docstring (all times in ms per step; ``kernel_calls`` launches
    per step). Raises ValueError if ``n_steps < 1``.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    names = liger_gen_kernel_names() if liger_gen_names is None else frozenset(liger_gen_names)
    kernel_ms = {c: 0.0 for c in KERNEL_CLASSES}
    calls = {c: 0 for c in KERNEL_CLASSES}
    per_name: dict[str, list] = {}
    for ev in events:
        cls = classify_kernel(ev.name, names)
        kernel_ms[cls] += ev.duration_us / 1e3
        calls[cls] += 1
        entry = per_name.setdefault(ev.name, [cls, 0.0, 0])
        entry[1] += ev.duration_us / 1e3
        entry[2] += 1
    busy_ms = busy_union_us((ev.start_us, ev.start_us + ev.duration_us) for ev in events) / 1e3 / n_steps
    tops = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "steps": n_steps,
        "kernel_ms": {c: v / n_steps for c, v in kernel_ms.items()},
        "kernel_calls": {c: v / n_steps for c, v in calls.items()},
        "busy_ms": busy_ms,
        "idle_ms": None if ms_per_step is None else ms_per_step - busy_ms,
        "profiled_ms_per_step": None if profiled_wall_s is None else 1e3 * profiled_wall_s / n_steps,
        "top_kernels": [{"name": n[:200], "class": c, "ms": ms / n_steps, "calls": k / n_steps}
                        for n, (c, ms, k) in tops],
    }


def device_events(prof) -> list[DeviceEvent]:
    """The GPU activities of a finished ``torch.profiler.profile`` in start order (GPU-side user annotations
    skipped): ``liger_gen.bench.device_events``, the op harness's filter, as DeviceEvent records."""
    from liger_gen.bench import device_events as gpu_activities

    return [DeviceEvent(name, start, duration) for start, name, duration in gpu_activities(prof.events())]


# --------------------------------------------------------------------------------------------------------------
# Loss-curve check
# --------------------------------------------------------------------------------------------------------------


def loss_rel_tolerance(dtype: torch.dtype | str) -> float:
    """Per-step relative tolerance between a provider's loss curve and plain transformers'.

    bfloat16 / float16: the dtype's machine epsilon (bf16: 2**-7 = 7.8e-3; fp16: 2**-10). Every provider runs
    the same model with bf16 weights and activations; they differ only in rounding (fused kernels keep fp32 where
    transformers rounds to bf16, e.g. FLCE's fp32 logits) and summation order. bf16 numbers near a value x are
    spaced 2**-8·|x| to 2**-7·|x| apart, so a difference below eps·|x| is at most two bf16 steps (ulps) at the
    loss's magnitude: the curves agree to the precision the model is trained in. A change in what the model
    computes (a wrong gradient, a wrong norm) moves the curve by more once a few updates have been applied.
    float32: 1e-5 (see tests/test_train_example.py for that bound's derivation).
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if dtype in (torch.bfloat16, torch.float16):
        return float(torch.finfo(dtype).eps)
    if dtype == torch.float32:
        return 1e-5
    raise ValueError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")


def compare_losses(losses: Sequence[float | None], reference: Sequence[float | None], rel_tol: float,
                   reference_name: str = REFERENCE_PROVIDER) -> dict[str, Any]:
    """Compare two per-step loss curves: first-step, mean and max relative differences and a pass flag.

    ``pass`` is True when the curves have the same length, every loss of both is finite, the first step's
    relative difference (one forward from identical weights: the kernels' numerics alone) is <= ``rel_tol``, and
    so is the mean over all steps of ``|loss - ref| / |ref|``. ``diff`` holds the per-step ``loss - ref`` (nats),
    ``max_abs_diff`` / ``mean_abs_diff`` its largest and mean magnitude. The max is reported, not judged: two bf16
    training runs that differ only in rounding drift apart step by step (measured on an H200, 2026-11-30:
    Liger-Kernel vs transformers at Llama-3.2-1B, 8 steps, lr 3e-4: first step 3e-5, max 1.3e-2, mean 3.5e-3),
    so a per-step bound would fail correct kernels, while a systematic error shows in the first step or the
    mean. Non-finite losses give None differences and ``pass: False``. Raises ValueError if ``rel_tol`` is not
    positive.
    """
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol}")
    out: dict[str, Any] = {"reference": reference_name, "rel_tol": rel_tol, "max_rel_diff": None,
                           "mean_rel_diff": None, "max_abs_diff": None, "mean_abs_diff": None,
                           "first_step_rel_diff": None, "diff": [], "pass": False}
    if len(losses) != len(reference) or not losses:
        out["reason"] = f"{len(losses)} losses vs {len(reference)} reference losses"
        return out
    vals = [x if x is not None else math.nan for x in losses]
    refs = [x if x is not None else math.nan for x in reference]
    if not all(math.isfinite(x) for x in vals + refs):
        out["reason"] = "non-finite loss"
        return out
    out["diff"] = [a - b for a, b in zip(vals, refs)]
    rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(vals, refs)]
    out["max_rel_diff"] = max(rel)
    out["max_abs_diff"] = max(abs(d) for d in out["diff"])
    out["mean_abs_diff"] = sum(abs(d) for d in out["diff"]) / len(rel)
    out["mean_rel_diff"] = sum(rel) / len(rel)
    out["first_step_rel_diff"] = rel[0]
    out["pass"] = rel[0] <= rel_tol and out["mean_rel_diff"] <= rel_tol
    return out


# --------------------------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------------------------


def _dist_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def provider_unavailable(provider: str, device: torch.device) -> str | None:
    """Why ``provider`` cannot run on ``device`` (None when it can)."""
    if provider == "liger-kernel":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (pip install liger-kernel)"
        if device.type != "cuda":
            return "Liger-Kernel's Triton kernels need a CUDA device"
    return None


@contextlib.contextmanager
def restore_module_globals(module_names: Iterable[str]):
    """Snapshot the globals of the named modules and put them back on exit (added names are removed).

    Liger-Kernel's ``apply_liger_kernel_to_*`` rebinds module-level names of transformers' modeling modules
    (``apply_rotary_pos_emb``, ``LlamaRMSNorm``, ``LlamaMLP``) for the whole process; this keeps one provider's
    patches from leaking into the next.
    """
    modules = [importlib.import_module(n) for n in module_names]
    saved = [dict(vars(m)) for m in modules]
    try:
        yield
    finally:
        for module, snapshot in zip(modules, saved):
            current = vars(module)
            for key in [k for k in current if k not in snapshot]:
                delattr(module, key)
            for key, value in snapshot.items():
                if current.get(key, _MISSING) is not value:
                    setattr(module, key, value)


_MISSING = object()


def _apply_liger_kernel(model, family: str):
    from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen2

    apply = {"llama": apply_liger_kernel_to_llama, "qwen2": apply_liger_kernel_to_qwen2}[family]
    apply(model=model)  # defaults: rope, rms_norm, swiglu, fused_linear_cross_entropy
    return model


def _undo_liger_gen() -> None:
    import liger_gen

    restore = getattr(liger_gen, "restore_rope", None)
    if restore is None:
        from liger_gen.integrations.transformers import restore_rope as restore
    restore()
    from liger_gen.integrations.transformers import restore_layers

    restore_layers()  # the decoder layers' rewritten code (the residual add fused into the norm)


def patch_report(model, family: str) -> dict[str, Any]:
    """What the model will run: its family's ``apply_rotary_pos_emb``, the decoder-layer, norm and MLP classes
    (with the module their ``forward`` comes from), and the causal-LM ``forward``."""
    modeling = importlib.import_module(_MODELING_MODULES[family])
    rope = modeling.apply_rotary_pos_emb
    if isinstance(rope, torch.nn.Module):  # transformers' function as a hub-kernel module (liger-gen's, or not)
        rope = getattr(rope, "liger_gen_function", None) or f"{modeling.__name__}.apply_rotary_pos_emb"

    def origin(obj) -> str:
        if isinstance(obj, str):
            return obj
        fn = getattr(obj, "__func__", obj)
        if not hasattr(fn, "__globals__"):  # a callable object, e.g. liger-gen's FusedLossForward
            return f"{type(fn).__module__}.{type(fn).__qualname__}"
        name = f"{fn.__module__}.{fn.__qualname__}"
        # functools.wraps copies __module__/__qualname__ from the wrapped function; the globals still name the
        # module that defined the code (liger-gen's RoPE wrapper keeps transformers' name, for one).
        defined_in = fn.__globals__.get("__name__", "?")
        if defined_in.split(".")[0] != name.split(".")[0]:
            name += f" (wrapped by {defined_in})"
        return name

    norms, mlps, layers = set(), set(), set()
    for m in model.modules():
        cls = type(m).__name__
        if cls.endswith("DecoderLayer"):
            code = inspect.unwrap(type(m).forward).__code__
            layers.add(f"{cls} ({origin(m.forward)}; code from {code.co_filename.rsplit('/', 1)[-1]})")
        if cls.endswith("RMSNorm"):
            norms.add(f"{cls} ({origin(m.forward)})")
        elif cls.endswith("MLP"):
            mlps.add(f"{cls} ({origin(m.forward)})")
    return {"rope": origin(rope), "norm_classes": sorted(norms), "mlp_classes": sorted(mlps),
            "decoder_layers": sorted(layers), "forward": origin(model.forward)}


# --------------------------------------------------------------------------------------------------------------
# Running one provider
# --------------------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class _Run:
    """Settings shared by every provider of one model."""

    model_name: str
    family: str
    initial_state: dict[str, torch.Tensor]
    batches: torch.Tensor  # [n_steps, B, T] on the device
    device: torch.device
    dtype: torch.dtype
    seed: int
    lr: float
    warmup_steps: int
    steps: int
    profile_steps: int
    attn_implementation: str
    extra: dict[str, Any] = field(default_factory=dict)


def train_step(model, optimizer, input_ids: torch.Tensor, scheduler=None) -> torch.Tensor:
    """One causal-LM training step on ``input_ids`` (B, T): forward with ``labels=input_ids`` (transformers shifts
    them), backward, optimizer (and ``scheduler``) step, gradients cleared. Returns the loss, detached, on the
    device (no host sync)."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def make_optimizer(model, lr: float, device: torch.device):
    """AdamW over ``model``'s parameters: the fused implementation where the build has it (CUDA always)."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    except RuntimeError:
        if device.type == "cuda":
            raise
        return torch.optim.AdamW(model.parameters(), lr=lr)  # a CPU build without fused AdamW for this dtype


def run_provider(provider: str, run: _Run) -> dict[str, Any]:
    """Build, patch and train one provider's model; return its result dict (see the module docstring).

    Raises whatever the provider raises; :func:`run_step_benchmark` records it as ``status: "error"``.
    """
    device = run.device
    cuda = device.type == "cuda"
    _free(device)
    res: dict[str, Any] = {"status": "ok", "reason": None, "compile_s": None}
    modeling = _MODELING_MODULES[run.family]
    if provider not in LIGER_GEN_PROVIDERS and "liger_gen.integrations.transformers" in sys.modules:
        _undo_liger_gen()  # RoPE routed by an earlier apply_to in this process would run in this provider too
    with restore_module_globals([modeling]):
        t0 = time.perf_counter()
        model = build_model(run.model_name, device, run.dtype, run.seed, run.attn_implementation)
        model.load_state_dict(run.initial_state)
        model.train()
        try:
            if provider == "liger-kernel":
                _apply_liger_kernel(model, run.family)
            elif provider in LIGER_GEN_PROVIDERS:
                import liger_gen

                liger_gen.apply_to(model, **LIGER_GEN_PROVIDERS[provider])
            res["patch"] = patch_report(model, run.family)
            step_model = torch.compile(model) if provider == "torch-compile" else model
            optimizer = make_optimizer(model, run.lr, device)
            sync(device)
            res["setup_s"] = time.perf_counter() - t0

            losses: list[torch.Tensor] = []
            batches = run.batches
            k = 0
            first = []
            for _ in range(run.warmup_steps):
                sync(device)
                t = time.perf_counter()
                losses.append(train_step(step_model, optimizer, batches[k]))
                sync(device)
                first.append(time.perf_counter() - t)
                k += 1
            res["first_step_s"] = first[0] if first else None

            step_ms: list[float] = []
            if cuda:
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(run.steps + 1)]
            sync(device)
            t_start = time.perf_counter()
            host_marks = [t_start]
            if cuda:
                marks[0].record()
            for i in range(run.steps):
                losses.append(train_step(step_model, optimizer, batches[k]))
                k += 1
                if cuda:
                    marks[i + 1].record()
                else:
                    host_marks.append(time.perf_counter())
            sync(device)
            timed_s = time.perf_counter() - t_start
            if cuda:
                step_ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(run.steps)]
            else:
                step_ms = [1e3 * (b - a) for a, b in zip(host_marks, host_marks[1:])]
            tokens = run.steps * batches.shape[1] * batches.shape[2]
            res["tokens_per_s"] = tokens / timed_s if run.steps else None
            res["ms_per_step"] = 1e3 * timed_s / run.steps if run.steps else None
            res["step_ms"] = step_ms
            res["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
            res["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None
            if provider == "torch-compile" and res["first_step_s"] is not None and step_ms:
                median_s = sorted(step_ms)[len(step_ms) // 2] / 1e3
                res["compile_s"] = res["first_step_s"] - median_s

            res["profile"] = None
            if run.profile_steps:
                if cuda:
                    events, wall = _profile_steps(step_model, optimizer, batches, k, run.profile_steps, losses,
                                                  device)
                    res["profile"] = summarize_profile(events, run.profile_steps, res["ms_per_step"], wall)
                else:  # no GPU activity to classify: run the steps for the loss curve only
                    for i in range(run.profile_steps):
                        losses.append(train_step(step_model, optimizer, batches[k + i]))
                k += run.profile_steps
            res["losses"] = [float(x) for x in torch.stack(losses).float().cpu()]
        finally:
            if provider in LIGER_GEN_PROVIDERS:
                _undo_liger_gen()
            if provider == "torch-compile":
                torch._dynamo.reset()
    del model, step_model, optimizer, losses
    _free(device)
    return res


def _profile_steps(model, optimizer, batches, first: int, n: int, losses: list, device):
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Pp]rofiler.*")
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for i in range(n):
                losses.append(train_step(model, optimizer, batches[first + i]))
            sync(device)
            wall = time.perf_counter() - t
        return device_events(prof), wall


# --------------------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------------------


def _csv(value: str | Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else [str(v).strip() for v in value]
    if not any(items):
        raise ValueError(f"{what}: expected at least one name")
    if not all(items):  # 'a,,b' or 'a,': a typo more often than a wish to drop the item
        raise ValueError(f"{what}: empty item in {value!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{what}: repeated name in {items}")
    return items


def _validate(models, providers, batch_size, seq_len, warmup_steps, steps, profile_steps, lr, dtype, device):
    unknown = [m for m in models if m not in STEP_MODELS]
    if unknown:
        raise ValueError(f"models: unknown {unknown}; known: {', '.join(STEP_MODELS)}")
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; known: {', '.join(PROVIDERS)}")
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 2), ("warmup_steps", warmup_steps, 0),
                             ("steps", steps, 1), ("profile_steps", profile_steps, 0)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: this PyTorch build sees no CUDA GPU (use device='cpu')")
    for m in models:
        max_pos = STEP_MODELS[m].fields["max_position_embeddings"]
        if seq_len > max_pos:
            raise ValueError(f"seq_len {seq_len} exceeds {m}'s max_position_embeddings {max_pos}")


def run_step_benchmark(
    models: str | Sequence[str] = DEFAULT_MODELS,
    providers: str | Sequence[str] = DEFAULT_PROVIDERS,
    *,
    batch_size: int = 8,
    seq_len: int = 2048,
    warmup_steps: int = 3,
    steps: int = 10,
    profile_steps: int = 2,
    lr: float = 3e-4,
    seed: int = 0,
    dtype: str = "bfloat16",
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    text: str | Path = DEFAULT_TEXT,
    loss_rel_tol: float | None = None,
    out_dir: str | Path | None = None,
    console=None,
    command: str | None = None,
) -> dict[str, Any]:
    """Run the training-step benchmark and return the results dict (schema in the module docstring).

    Args:
        models: names from ``STEP_MODELS`` (list or comma-separated string).
        providers: names from ``PROVIDERS``, run in this order for every model.
        batch_size, seq_len: sequences per step and tokens per sequence.
        warmup_steps: untimed steps first (they hold Triton/cuBLAS/compile warm-up).
        steps: timed steps. profile_steps: steps under torch.profiler after them (0: no profile).
        lr: AdamW learning rate (constant). seed: initial weights and batch offsets.
        dtype: parameter dtype, ``bfloat16`` (default), ``float16`` or ``float32``.
        device: torch device (default: cuda if available, else cpu).
        text: the training text, read as bytes.
        loss_rel_tol: loss-curve tolerance (default :func:`loss_rel_tolerance` of ``dtype``).
        out_dir: if given, the dict is written to ``out_dir/step.json`` (ResultsNotWritten, after the report is
            printed, if it cannot be: the JSON is then in a temporary file the message names).
        console: a ``rich.console.Console`` for the report (None: a new one; False: print nothing).
        command: recorded in the metadata (default: ``sys.argv`` joined).

    Raises ValueError naming the argument for bad input. A provider that raises is recorded with
    ``status: "error"`` and its message; the others still run.
    """
    models = _csv(models, "models")
    providers = _csv(providers, "providers")
    try:
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                               else "cpu")
    except RuntimeError as exc:  # torch's parse error for a malformed device string
        raise ValueError(f"device: {exc}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device: bench-step trains on cuda or cpu, got {device.type!r}")
    _validate(models, providers, batch_size, seq_len, warmup_steps, steps, profile_steps, lr, dtype, device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch_dtype = _DTYPES[dtype]
    rel_tol = loss_rel_tolerance(torch_dtype) if loss_rel_tol is None else float(loss_rel_tol)
    if not rel_tol > 0:
        raise ValueError(f"loss_rel_tol must be > 0, got {loss_rel_tol!r}")
    n_total = warmup_steps + steps + profile_steps
    tokens = byte_tokens(text)
    batches_cpu = make_batches(tokens, n_total, batch_size, seq_len, seed)

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "metadata": _metadata(device, command),
        "settings": {"models": models, "providers": providers, "batch_size": batch_size, "seq_len": seq_len,
                     "warmup_steps": warmup_steps, "steps": steps, "profile_steps": profile_steps, "lr": lr,
                     "seed": seed, "dtype": dtype, "attn_implementation": attn_implementation, "text": str(text),
                     "loss_rel_tol": rel_tol, "loss_reference": REFERENCE_PROVIDER,
                     "idle_definition": IDLE_DEFINITION},
        "models": {},
    }
    batches = batches_cpu.to(device)
    for model_name in models:
        spec = STEP_MODELS[model_name]
        _free(device)
        model = build_model(model_name, device, torch_dtype, seed, attn_implementation)
        entry: dict[str, Any] = {"config": config_summary(model.config),
                                 "n_params": sum(p.numel() for p in model.parameters()), "providers": {}}
        initial_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        del model
        run = _Run(model_name, spec.family, initial_state, batches, device, torch_dtype, seed, lr, warmup_steps,
                   steps, profile_steps, attn_implementation)
        for provider in providers:
            why = provider_unavailable(provider, device)
            if why is not None:
                entry["providers"][provider] = {"status": "skipped", "reason": why}
                continue
            try:
                entry["providers"][provider] = run_provider(provider, run)
            except Exception as exc:  # noqa: BLE001 - one provider failing must not lose the others' results
                entry["providers"][provider] = {
                    "status": "error", "reason": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=-10)}
            _free(device)  # outside the handler: the exception's frames hold the failed run's tensors until then
        del run, initial_state
        add_comparisons(entry["providers"], rel_tol)
        result["models"][model_name] = entry
    return _finish(result, out_dir, "step.json", print_report, console)


def _finish(result: dict[str, Any], out_dir, file_name: str, printer: Callable, console) -> dict[str, Any]:
    """Write ``result`` to ``out_dir/file_name`` (if given), print it with ``printer`` (unless console is False).
    If the file cannot be written, the JSON goes to a temporary file (``liger_gen.files.write_results``) and
    ResultsNotWritten is raised after the report is printed: a long run never loses what it measured."""
    unwritten = None
    if out_dir is not None:
        try:
            write_results(Path(out_dir) / file_name, _json_text(result))
        except ResultsNotWritten as exc:
            unwritten = exc
    if console is not False:
        printer(result, console)
    if unwritten is not None:
        raise unwritten
    return result


def add_comparisons(providers: dict[str, dict[str, Any]], rel_tol: float) -> None:
    """Fill ``loss_check`` and the speed-ups of every ``ok`` provider in place (against ``transformers`` and
    ``liger-kernel`` when those ran)."""
    ref = providers.get(REFERENCE_PROVIDER)
    ref_ok = ref is not None and ref.get("status") == "ok"
    lk = providers.get("liger-kernel")
    lk_ok = lk is not None and lk.get("status") == "ok"
    for name, res in providers.items():
        if res.get("status") != "ok":
            continue
        res["loss_check"] = (compare_losses(res["losses"], ref["losses"], rel_tol)
                             if ref_ok and name != REFERENCE_PROVIDER else None)
        tps = res.get("tokens_per_s")
        res["speedup_vs_transformers"] = tps / ref["tokens_per_s"] if ref_ok and tps and ref["tokens_per_s"] else None
        res["speedup_vs_liger_kernel"] = tps / lk["tokens_per_s"] if lk_ok and tps and lk["tokens_per_s"] else None


def _metadata(device: torch.device, command: str | None) -> dict[str, Any]:
    import liger_gen

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "transformers": _dist_version("transformers"),
        "liger_kernel": _dist_version("liger-kernel") or _dist_version("liger_kernel"),
        "liger_gen": getattr(liger_gen, "__version__", None),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }


def _json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _json_text(result: dict[str, Any]) -> str:
    return json.dumps(_json_safe(result), indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    """Write ``result`` as strict JSON (non-finite floats become null), creating the folder; returns the path."""
    return write_atomic(path, _json_text(result))


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


def _f(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_report(result: dict[str, Any], console=None) -> None:
    """Print the summary table (speed, memory, loss check) and the kernel-class breakdown with ``rich``.

    Providers that were skipped or failed are listed under the summary with the reason.
    """
    from rich.console import Console
    from rich.table import Table

    # Piped output (logs) gets a width that fits the tables; a terminal keeps its own.
    console = console or Console(width=None if sys.stdout.isatty() else 180)
    meta, s = result["metadata"], result["settings"]
    console.print(f"[bold]Training step[/bold] on {meta['gpu'] or meta['device']}: batch {s['batch_size']} x "
                  f"{s['seq_len']} tokens, {s['dtype']}, AdamW lr {s['lr']:g}; {s['warmup_steps']} warm-up + "
                  f"{s['steps']} timed + {s['profile_steps']} profiled steps; torch {meta['torch']}, triton "
                  f"{meta['triton']}, transformers {meta['transformers']}, liger-kernel {meta['liger_kernel']}")
    summary = Table(title="Speed, memory and loss curve",
                    caption=f"x: tokens/s ratio. loss: |loss - transformers| / transformers at step 1, mean and max "
                            f"over steps; loss check: pass if step 1 and mean <= {s['loss_rel_tol']:.2e} (ref: the "
                            f"run the others are compared with). 1st s: first step wall "
                            f"time (compile time apart)")
    for col in ("model", "provider", "tok/s", "ms/step", "x HF", "x Liger", "peak GiB", "rsvd GiB",
                "loss Δrel 1/mean/max", "loss check", "1st s"):
        summary.add_column(col, justify="left" if col in ("model", "provider", "loss check") else "right")
    breakdown = Table(title="GPU time per step by kernel class (ms, torch.profiler)",
                      caption="busy: union of GPU activity per step; idle: ms/step (unprofiled) - busy")
    breakdown.add_column("model")
    breakdown.add_column("provider")
    for c in (*KERNEL_CLASSES, "idle"):
        breakdown.add_column(CLASS_LABELS[c], justify="right")
    breakdown.add_column("busy", justify="right")
    notes, any_profile = [], False
    for model_name, entry in result["models"].items():
        for name, r in entry["providers"].items():
            if r["status"] != "ok":
                summary.add_row(model_name, name, *["-"] * 7, r["status"], "-")
                notes.append(f"{model_name} / {name}: {r['status']}: {r['reason']}")
                continue
            check = r.get("loss_check")
            verdict = ("ref" if check is None else "[green]pass[/green]" if check["pass"] else "[red]FAIL[/red]")
            first = _f(r.get("first_step_s"), ".2f")
            if r.get("compile_s") is not None:
                first += f" ({r['compile_s']:.1f} compile)"
            summary.add_row(model_name, name, _f(r["tokens_per_s"], ",.0f"), _f(r["ms_per_step"], ".1f"),
                            _f(r.get("speedup_vs_transformers"), ".2f"), _f(r.get("speedup_vs_liger_kernel"), ".2f"),
                            _f(r.get("peak_allocated_gib"), ".2f"), _f(r.get("peak_reserved_gib"), ".2f"),
                            "-" if check is None else " / ".join(
                                _f(check.get(k), ".1e", "nan")
                                for k in ("first_step_rel_diff", "mean_rel_diff", "max_rel_diff")), verdict, first)
            p = r.get("profile")
            if p:
                any_profile = True
                breakdown.add_row(model_name, name, *[f"{p['kernel_ms'][c]:.1f}" for c in KERNEL_CLASSES],
                                  _f(p["idle_ms"], ".1f"), f"{p['busy_ms']:.1f}")
    console.print(summary)
    for note in notes:
        console.print(f"  {note}", highlight=False)
    if any_profile:
        console.print(breakdown)


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def step_command_options(function: Callable) -> Callable:
    """click options for a ``bench-step`` command whose parameters are :func:`run_step_benchmark`'s keywords::

        @main.command("bench-step")
        @step_command_options
        def bench_step(**options):
            run_step_benchmark(**options)
    """
    import click

    def csv(ctx, param, value):
        try:
            return _csv(value, param.name)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    def text(ctx, param, value):  # read here too, so a bad file stops the command before anything else runs
        try:
            read_text_bytes(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        return value

    def out(ctx, param, value):  # checked before the run, so the run cannot end by failing to write its results
        if value is None:
            return None
        try:
            return str(writable_folder(value))
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    options = [
        click.option("--models", default=",".join(DEFAULT_MODELS), show_default=True, callback=csv,
                     help=f"Comma-separated models: {', '.join(STEP_MODELS)}."),
        click.option("--providers", default=",".join(DEFAULT_PROVIDERS), show_default=True, callback=csv,
                     help=f"Comma-separated providers, run in this order: {', '.join(PROVIDERS)}."),
        click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1), help="Sequences per step."),
        click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(2),
                     help="Tokens per sequence."),
        click.option("--warmup-steps", default=3, show_default=True, type=click.IntRange(0),
                     help="Untimed steps first."),
        click.option("--steps", default=10, show_default=True, type=click.IntRange(1), help="Timed steps."),
        click.option("--profile-steps", default=2, show_default=True, type=click.IntRange(0),
                     help="Steps under torch.profiler after the timed ones (0: no kernel breakdown)."),
        click.option("--lr", default=3e-4, show_default=True, type=float, help="AdamW learning rate."),
        click.option("--seed", default=0, show_default=True, type=int, help="Seed of the weights and batches."),
        click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(sorted(_DTYPES)),
                     help="Parameter dtype."),
        click.option("--device", default=None, help="torch device (default: cuda; without a GPU, name cpu "
                                                    "explicitly)."),
        click.option("--attn-implementation", default="sdpa", show_default=True,
                     help="transformers attention implementation."),
        click.option("--text", default=str(DEFAULT_TEXT), type=click.Path(dir_okay=False, exists=True),
                     callback=text,
                     help=f"Training text, a regular file of at most {MAX_TEXT_BYTES // 2**20} MiB read as bytes "
                          f"(default: tiny Shakespeare)."),
        click.option("--loss-rel-tol", default=None, type=float,
                     help="Loss-curve tolerance, relative per step (default: the dtype's eps; bf16 2**-7)."),
        click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), callback=out,
                     help="Write OUT/step.json."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _main() -> None:
    import click

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @step_command_options
    def cli(**options):
        """Training-step benchmark: transformers vs Liger-Kernel vs liger-gen vs torch.compile."""
        command = " ".join(["python -m liger_gen.bench.step", *sys.argv[1:]])
        try:
            result = run_step_benchmark(**options, command=command)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        except ResultsNotWritten as exc:
            raise click.ClickException(str(exc)) from None
        failed = [(m, p) for m, e in result["models"].items() for p, r in e["providers"].items()
                  if r["status"] == "error" or (r.get("loss_check") and not r["loss_check"]["pass"])]
        sys.exit(1 if failed else 0)

    cli()



# --------------------------------------------------------------------------------------------------------------
# First step in a fresh process
# --------------------------------------------------------------------------------------------------------------

FIRST_STEP_SCHEMA = "liger-gen/bench-first-step/1"
FIRST_STEP_CHILD = Path(__file__).resolve().parent / "first_step_child.py"


def first_step_spec(model_name: str, provider: str, batch_path: Path, dtype: str, device: torch.device, seed: int,
                    lr: float, attn_implementation: str = "sdpa") -> dict[str, Any]:
    """What ``first_step_child.py`` needs: the config class and fields (so the child imports no liger-gen)."""
    spec = _step_model(model_name)
    config = build_config(model_name, attn_implementation)
    config_class, model_class = _FAMILY_CLASSES[spec.family]
    fields = config.to_dict()
    for key in ("transformers_version", "architectures", "model_type", "dtype", "torch_dtype"):
        fields.pop(key, None)
    fields["attn_implementation"] = attn_implementation
    return {"provider": provider, "family": spec.family, "config_class": config_class, "model_class": model_class,
            "config": fields, "dtype": dtype, "device": str(device), "seed": seed, "lr": lr, "batch": str(batch_path)}


def run_first_step(models: str | Sequence[str] = DEFAULT_MODELS, providers: str | Sequence[str] = DEFAULT_PROVIDERS,
                   *, batch_size: int = 8, seq_len: int = 2048, dtype: str = "bfloat16", seed: int = 0,
                   lr: float = 3e-4, repeats: int = 2, warmup_rounds: int = 1, device: str | None = None,
                   attn_implementation: str = "sdpa",
                   text: str | Path = DEFAULT_TEXT, out_dir: str | Path | None = None, console=None,
                   command: str | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Time to the end of the first training step in a fresh process with empty Triton and kernel caches.

    For each model, ``warmup_rounds`` untimed rounds (they bring the libraries' files into the OS page cache, so
    no provider pays the disk for the others) and then ``repeats`` rounds over ``providers`` (in turn, so drift
    hits every provider alike): each run is a new Python process (``first_step_child.py``) with its own empty ``TRITON_CACHE_DIR``,
    ``LIGER_GEN_CACHE_DIR`` and ``TORCHINDUCTOR_CACHE_DIR``; the liger-gen tables and compiled kernel caches are
    read from where the runtime reads them. ``first_step_s`` is from just before the process is started to the
    end of its first step (forward, backward, fused AdamW step, synchronised), so it holds Python's start, the
    imports, building the model (random weights on the device), patching and every compilation. Per run the JSON
    also has ``imports_s``, ``build_s`` (model, patch, optimizer) and ``step_s``. ``vs_transformers_s`` is the
    provider's median minus plain transformers' median.
    """
    import subprocess

    models = _csv(models, "models")
    providers = _csv(providers, "providers")
    for m in models:
        _step_model(m)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; known: {', '.join(PROVIDERS)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    try:
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                           else "cpu")
    except RuntimeError as exc:
        raise ValueError(f"device: {exc}") from None
    if dev.type not in ("cuda", "cpu") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device: {device!r} is not available here (cuda needs a visible GPU; or name cpu)")
    result: dict[str, Any] = {
        "schema": FIRST_STEP_SCHEMA, "metadata": _metadata(dev, command),
        "settings": {"models": models, "providers": providers, "batch_size": batch_size, "seq_len": seq_len,
                     "dtype": dtype, "seed": seed, "lr": lr, "repeats": repeats, "warmup_rounds": warmup_rounds,
                     "definition": "wall clock from process start to the end of the first step; empty Triton, "
                                   "kernel-module and inductor caches per run"},
        "models": {}}
    batch = make_batches(byte_tokens(text), 1, batch_size, seq_len, seed)[0]
    import tempfile

    with tempfile.TemporaryDirectory(prefix="liger-gen-first-step-") as tmp:
        batch_path = Path(tmp) / "batch.pt"
        torch.save(batch, batch_path)
        for model_name in models:
            runs: dict[str, list] = {p: [] for p in providers}
            for round_ in range(warmup_rounds + repeats):
                for provider in providers:
                    why = provider_unavailable(provider, dev)
                    if why is not None:
                        runs[provider].append({"status": "skipped", "reason": why})
                        continue
                    spec_path = Path(tmp) / f"{model_name}-{provider}-{round_}.json"
                    spec_path.write_text(json.dumps(first_step_spec(model_name, provider, batch_path, dtype, dev,
                                                                    seed, lr, attn_implementation)))
                    caches = {k: tempfile.mkdtemp(dir=tmp, prefix=k.lower() + "-")
                              for k in ("TRITON_CACHE_DIR", "LIGER_GEN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
                    env = {**os.environ, **caches}
                    t0 = time.time()
                    try:
                        proc = subprocess.run([sys.executable, str(FIRST_STEP_CHILD), str(spec_path)], env=env,
                                              capture_output=True, text=True, timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        proc = None
                    if proc is None:
                        run = {"status": "error", "reason": f"no first step within {timeout_s} s (killed)"}
                    else:
                        run = {"status": "error", "reason": (proc.stderr or proc.stdout)[-2000:]}
                    if proc is not None and proc.returncode == 0:
                        try:
                            stamps = json.loads(proc.stdout.strip().splitlines()[-1])
                            if not isinstance(stamps, dict) or not math.isfinite(stamps["loss"]):
                                raise ValueError(f"not a result with a finite loss: {stamps!r:.200}")
                            run = {"status": "ok", "first_step_s": stamps["end"] - t0,
                                   "startup_s": stamps["start"] - t0, "imports_s": stamps["imports"] - stamps["start"],
                                   "build_s": stamps["ready"] - stamps["imports"],
                                   "step_s": stamps["end"] - stamps["ready"], "loss": stamps["loss"],
                                   "imported_liger_gen": stamps.get("imported_liger_gen"),
                                   "imported_liger_kernel": stamps.get("imported_liger_kernel"),
                                   "warnings": [line for line in proc.stderr.splitlines() if "Warning" in line][:5]}
                        except (ValueError, KeyError, IndexError, TypeError) as exc:
                            run = {"status": "error", "reason": f"unusable child output ({exc}): {proc.stdout[-500:]}"}
                    if round_ >= warmup_rounds:
                        runs[provider].append(run)
            summary = {}
            for provider, rs in runs.items():
                ok = sorted(r["first_step_s"] for r in rs if r.get("status") == "ok")
                summary[provider] = {"runs": rs, "median_s": statistics.median(ok) if ok else None,
                                     "min_s": ok[0] if ok else None}
            ref = summary.get(REFERENCE_PROVIDER, {}).get("median_s")
            for s in summary.values():
                s["vs_transformers_s"] = None if ref is None or s["median_s"] is None else s["median_s"] - ref
            result["models"][model_name] = summary
    return _finish(result, out_dir, "first_step.json", print_first_step, console)


def print_first_step(result: dict[str, Any], console=None) -> None:
    """The first-step table: median, min and the difference to plain transformers, per model and provider."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="first training step in a fresh process (empty Triton cache)")
    for col in ("model", "provider", "median s", "min s", "vs transformers s", "imports s", "build s", "step s"):
        table.add_column(col, justify="left" if col in ("model", "provider") else "right")
    for model, providers in result["models"].items():
        for provider, s in providers.items():
            ok = [r for r in s["runs"] if r.get("status") == "ok"]
            if not ok:
                table.add_row(model, provider, "-", "-", "-", "-", "-",
                              (s["runs"][0].get("reason") or "")[:60] if s["runs"] else "-")
                continue
            mid = sorted(ok, key=lambda r: r["first_step_s"])[len(ok) // 2]
            table.add_row(model, provider, _f(s["median_s"], ".2f"), _f(s["min_s"], ".2f"),
                          _f(s["vs_transformers_s"], "+.2f"), _f(mid["imports_s"], ".2f"), _f(mid["build_s"], ".2f"),
                          _f(mid["step_s"], ".2f"))
    console.print(table)


if __name__ == "__main__":
    _main()
