"""End-to-end training-step benchmark: plain transformers vs Liger-Kernel vs liger-gen vs torch.compile.

What it measures
----------------
For each model (``STEP_MODELS``, i.e. ``liger_gen.models.ARCHITECTURES``: the published Llama-3.2-1B and
Qwen2.5-0.5B architectures, the whole Llama-3.1-8B (``llama3-8b``; 8.03 B parameters, for one GPU at a small
batch) and ``llama3-8b-4l``, its layer with 4 of its 32 layers; ``qwen2.5-vl-7b-4l``, Qwen2.5-VL-7B's text and
vision widths with 4 decoder layers and 4 vision blocks, trained on an image and text per sample;
``glm4.5-air-4l``, GLM-4.5-Air's dense layer and 3 of its 128-expert layers; all built from transformers configs
written out by hand, plus ``tiny``, ``tiny-qwen2``, ``tiny-qwen2.5-vl`` and ``tiny-glm4.5-air`` for CPU runs) and
each provider, in the order given, in one process:

- ``transformers``  plain transformers (``attn_implementation="sdpa"``);
- ``liger-kernel``  ``liger_kernel.transformers.apply_liger_kernel_to_<family>(model=model)`` with its defaults
                    (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy); CUDA only. For ``glm4_moe``, which
                    Liger-Kernel ships no patch for, its modules composed as its GLM-4.5V patch composes them
                    (``liger_gen.training.LIGER_KERNEL_COMPOSED``); skipped, with the reason, for other model
                    types without ``apply_liger_kernel_to_<model_type>``. Its autotuned
                    kernels are warmed before the warm-up steps (``autotune_warmup``, below);
- ``liger-gen``     ``liger_gen.apply_to(model)`` (RMSNorm, the attention residual add fused into the next RMSNorm,
                    RoPE, SwiGLU MLP, LM-head loss without logits);
- ``torch-compile`` ``torch.compile(model)`` (default mode); the first step's wall time, which holds the
                    compilation, is reported apart (``first_step_s``, ``compile_s``);
- ``liger-gen-unfused-add``  ``liger_gen.apply_to(model, fused_add_rms_norm=False)``: the decoder layers keep
                    transformers' residual add before the post-attention norm (what that fusion is worth).
- ``liger-gen-fp8`` ``liger_gen.apply_to(model, fp8=True)``: as ``liger-gen``, with the decoder projections'
                    GEMMs in FP8 (``liger_gen.nn.Float8Linear``); GPUs of compute capability 8.9 or newer.
- ``torchao-fp8``   torchao's float8 training with its "rowwise" recipe (``convert_to_float8_training`` of every
                    linear layer but the LM head) and ``torch.compile(model)``, which fuses torchao's scaling and
                    casts; CUDA only. The first step's wall time holds the compilation, as for ``torch-compile``.
                    The FP8 providers' loss check uses ``FP8_LOSS_REL_TOL`` (1%), not the dtype's epsilon.

Every provider trains a freshly built model from the same initial weights (built once with ``seed``, copied to
the host, loaded into each provider's model) for ``warmup_steps + steps + profile_steps`` AdamW steps (bf16
parameters, ``fused=True``, constant ``lr``, ``use_cache=False``, ``model.train()``) on the same batches:
random windows of tiny Shakespeare read as bytes (token ids 0..255, no tokenizer), ``labels = input_ids``
(the model shifts them); a vision-language model's windows carry one image per sample, as Qwen2.5-VL's
processor lays it out (``liger_gen.bench.step_data``: patches, ``image_grid_thw``, the image's placeholder tokens
in ``input_ids``, labels -100 at them). Module-level patches a provider makes in transformers' modeling module (Liger-Kernel
replaces ``apply_rotary_pos_emb``, the RMSNorm and MLP classes; liger-gen replaces ``apply_rotary_pos_emb``)
are undone after it (``liger_gen``'s ``restore_rope()`` plus a snapshot of the module's globals), so the next
provider runs what it claims to run. Between providers: model and optimizer deleted, ``gc.collect()``,
``torch.cuda.empty_cache()``, ``torch.cuda.reset_peak_memory_stats()``.

Per provider:

- ``autotune_warmup`` (``liger-kernel``): one forward and backward before the warm-up steps, gradients dropped
  (``liger_gen.bench.autotune``): the pass in which Liger-Kernel's ``@triton.autotune`` kernels (its fused MoE's
  grouped GEMMs: minutes at a large MoE) benchmark their configs at this model's shapes; its wall time ``s`` and
  the autotune entries it added (``kernels_tuned``), counted in no other field. None for the other providers.
- ``tokens_per_s`` / ``ms_per_step``: the ``steps`` timed steps, wall clock between two
  ``torch.cuda.synchronize()`` calls (warm-up steps excluded); ``step_ms``: each timed step from CUDA events.
- ``peak_allocated_gib`` / ``peak_reserved_gib``: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
  from model build to the end of the timed steps (weights, gradients, AdamW state and activations), GiB = 2**30.
- ``losses``: the loss of every step (warm-up, timed and profiled), in nats per token.
- ``profile`` (CUDA only): ``torch.profiler`` over ``profile_steps`` steps; every GPU activity (kernels, memcpy,
  memset) is put in one of ``KERNEL_CLASSES`` by ``liger_gen.bench.profile.classify_kernel`` and summed
  (``kernel_ms``, per step;
  a sum of durations, so two kernels overlapping on two streams count twice). ``busy_ms`` is the union of the
  activity intervals per step (overlaps counted once); ``idle_ms = ms_per_step - busy_ms``: the unprofiled step
  time minus the profiled GPU busy time, i.e. the time per step the GPU waits for the host (launch overhead,
  Python, syncs). It can come out slightly negative from run-to-run noise; it is reported as measured.
- ``loss_check`` (every provider but the reference, ``transformers``): per step ``|loss - loss_ref| /
  |loss_ref|``; ``pass`` when the first step's and the mean over steps are <= ``rel_tol`` (see
  ``liger_gen.training``'s :func:`loss_rel_tolerance` and :func:`compare_losses`) and every loss is finite; the
  max is reported.
- ``speedup_vs_transformers`` / ``speedup_vs_liger_kernel``: tokens/s ratio (None when that provider did not run).

Output schema (``run_step_benchmark``'s return value, also written as JSON to ``out_dir/step.json``)::

    {
      "schema": "liger-gen/bench-step/1",
      "functional_run": bool (a CPU run), "functional_run_reason": str | None (why its times are not performance),
      "metadata": {"date": ISO-8601 UTC, "command": str, "device": "cuda:0" | "cpu", "gpu": str | None,
                   "cpu": str, "python", "torch", "triton", "transformers", "liger_kernel", "torchao" (None if absent),
                   "liger_gen": str, "triton_interpret": str},
      "settings": {"models": [str], "providers": [str], "batch_size": int, "seq_len": int,
                   "warmup_steps": int, "steps": int, "profile_steps": int, "lr": float, "optimizer": str,
                   "seed": int,
                   "dtype": str, "attn_implementation": str, "text": str, "loss_rel_tol": float,
                   "loss_reference": "transformers", "idle_definition": str},
      "models": {
        MODEL: {
          "config": {transformers config fields that set the shapes; "vision": {...} of a vision-language model},
          "n_params": int,
          "inputs": None | {"image_size", "grid_thw", "image_tokens_per_sample", "text_tokens_per_sample",
                            "pixel_values_shape", "layout"} (a vision-language model's),
          "providers": {
            PROVIDER: {
              "status": "ok" | "skipped" | "error", "reason": str | None, "traceback": str (errors only),
              "setup_s": float (build, load, patch/compile wrapper), "first_step_s": float,
              "autotune_warmup": None | {"s": float | None, "kernels_tuned": int | None,
                                         "reason": str | None (why it did not run)} (liger-kernel's, also when
                                         skipped),
              "compile_s": float | None (torch-compile: first_step_s minus the median timed step),
              "tokens_per_s": float, "ms_per_step": float, "step_ms": [float],
              "peak_allocated_gib": float | None, "peak_reserved_gib": float | None,
              "losses": [float | None (non-finite)],
              "patch": {"rope": str, "norm_classes": [str], "mlp_classes": [str], "expert_classes": [str],
                        "decoder_layers": [str], "forward": str},
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

    liger-gen bench-step --out $OUT/step
    liger-gen bench-step --model llama3.2-1b --providers transformers,liger-kernel,liger-gen,torch-compile
    liger-gen bench-step --model qwen2.5-vl-7b-4l,glm4.5-air-4l --batch-size 4

On a CPU (tiny model; liger-gen's kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before
Python starts)::

    TRITON_INTERPRET=1 liger-gen bench-step --device cpu --model tiny --providers transformers,liger-gen \\
        --batch-size 2 --seq-len 64 --warmup-steps 1 --steps 2 --profile-steps 0

Library use: ``run_step_benchmark(models=[...], providers=[...], ...)`` returns the dict above.
The models and optimizer come from ``liger_gen.training``, the batches from ``liger_gen.bench.step_data``,
Liger-Kernel's autotune warm-up from ``liger_gen.bench.autotune``, the profile's kernel classes from
``liger_gen.bench.profile``; the first step in a fresh process (``--first-step``) is ``liger_gen.bench.first_step``.
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
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from liger_gen.bench.autotune import not_run, warm_autotune
from liger_gen.bench.labels import label
from liger_gen.bench.profile import device_events, summarize_profile
from liger_gen.bench.step_data import batches_to, describe_batch, min_seq_len, step_batches, tokens_per_step
from liger_gen.bench.step_report import fmt as _fmt, print_step_report
from liger_gen.console import NO_PROGRESS, ProgressBar
from liger_gen.files import ResultsNotWritten, write_atomic, write_results
from liger_gen.models import ARCHITECTURES, Architecture
from liger_gen.optional import installed_version
from liger_gen.training import (DEFAULT_TEXT, DTYPES, apply_liger_kernel, build_model, byte_tokens, compare_losses,
                                liger_kernel_unsupported, loss_rel_tolerance, make_optimizer, sync, train_step)

SCHEMA = "liger-gen/bench-step/1"

PROVIDERS: tuple[str, ...] = ("transformers", "liger-kernel", "liger-gen", "torch-compile", "liger-gen-unfused-add",
                               "liger-gen-fp8", "torchao-fp8")
#: the providers that run ``liger_gen.apply_to``, with its keyword arguments
LIGER_GEN_PROVIDERS: dict[str, dict[str, bool]] = {"liger-gen": {},
                                                   "liger-gen-unfused-add": {"fused_add_rms_norm": False},
                                                   "liger-gen-fp8": {"fp8": True}}
#: the providers that train ``torch.compile(model)``: the first step holds the compilation (``compile_s``)
COMPILED_PROVIDERS = ("torch-compile", "torchao-fp8")
#: Loss-curve tolerance of the FP8 providers against bf16 transformers: FP8 operands carry 3 mantissa bits, so a
#: step's loss moves by more than bf16's epsilon; 1% is the bound FP8 training is held to over a whole run.
FP8_PROVIDERS = ("liger-gen-fp8", "torchao-fp8")
FP8_LOSS_REL_TOL = 0.01
DEFAULT_PROVIDERS: tuple[str, ...] = ("transformers", "liger-kernel", "liger-gen")
DEFAULT_MODELS: tuple[str, ...] = ("llama3.2-1b", "qwen2.5-0.5b")
REFERENCE_PROVIDER = "transformers"

IDLE_DEFINITION = ("idle_ms = ms_per_step (unprofiled timed steps) - busy_ms (union of GPU activity intervals "
                   "per profiled step)")


# --------------------------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------------------------


#: The models this benchmark builds: ``liger_gen.models.ARCHITECTURES``, the one registry of models.
STEP_MODELS: dict[str, Architecture] = ARCHITECTURES

MODELING_MODULES = {"llama": "transformers.models.llama.modeling_llama",
                    "qwen2": "transformers.models.qwen2.modeling_qwen2",
                    "glm4_moe": "transformers.models.glm4_moe.modeling_glm4_moe",
                    "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl"}


_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "hidden_act", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias",
                "_attn_implementation", "use_cache",
                # a mixture of experts'
                "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor", "partial_rotary_factor")
_VISION_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                "spatial_merge_size", "window_size", "fullatt_block_indexes", "out_hidden_size", "hidden_act")


def config_summary(config) -> dict[str, Any]:
    """The shape-setting fields of a transformers config (what the JSON records per model): a vision-language
    model's text config's, its ``model_type`` and embedding tie, and its vision config's under ``vision``."""
    text = getattr(config, "text_config", None) or config

    def fields(cfg, keys) -> dict[str, Any]:
        out = {}
        for key in keys:
            value = getattr(cfg, key, None)
            if value is not None:
                out[key.lstrip("_")] = dict(value) if isinstance(value, dict) else value
        return out

    out = fields(text, _CONFIG_KEYS)
    if text is not config:
        out.update(fields(config, ("model_type", "tie_word_embeddings")))
        out["vision"] = fields(config.vision_config, _VISION_KEYS)
    if "rope_parameters" in out:  # transformers 5 keeps rope_scaling as an alias of the same dict
        out.pop("rope_scaling", None)
    if "head_dim" not in out:
        out["head_dim"] = text.hidden_size // text.num_attention_heads
    return out


# --------------------------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------------------------


def provider_unavailable(provider: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                         family: str | None = None) -> str | None:
    """Why ``provider`` cannot run on ``device`` with parameters of ``dtype`` for a model of ``family`` (its
    ``config.model_type``; None: any), or None when it can."""
    if provider == "liger-kernel":
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (pip install liger-kernel)"
        if device.type != "cuda":
            return "Liger-Kernel's Triton kernels need a CUDA device"
        if family is not None:
            return liger_kernel_unsupported(family)
    if provider == "torchao-fp8":
        if importlib.util.find_spec("torchao") is None:
            return "torchao is not installed (pip install torchao)"
        if device.type != "cuda":
            return "torchao's float8 training needs a CUDA GPU"
    if provider in FP8_PROVIDERS:
        from liger_gen.runtime.fp8 import fp8_unsupported_reason

        if dtype != torch.bfloat16:
            return (f"FP8 training runs the GEMMs of bf16 weights; with --dtype {str(dtype).removeprefix('torch.')} "
                    f"(no autocast here) its layers would run plain F.linear")

        return fp8_unsupported_reason(device)
    return None


def convert_torchao_fp8(model):
    """torchao's float8 training, rowwise recipe, on every linear layer but the LM head (kept in bf16, as
    liger-gen's FP8 does)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=lambda module, fqn: fqn != "lm_head")
    return model


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


def undo_liger_gen() -> None:
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
    modeling = importlib.import_module(MODELING_MODULES[family])
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

    norms, mlps, experts, layers = set(), set(), set(), set()
    for m in model.modules():
        cls = type(m).__name__
        if cls.endswith("DecoderLayer"):
            code = inspect.unwrap(type(m).forward).__code__
            layers.add(f"{cls} ({origin(m.forward)}; code from {code.co_filename.rsplit('/', 1)[-1]})")
        if cls.endswith("RMSNorm"):
            norms.add(f"{cls} ({origin(m.forward)})")
        elif cls.endswith("MLP"):
            mlps.add(f"{cls} ({origin(m.forward)})")
        elif cls.endswith("Experts"):  # a mixture of experts' routed experts (the shared ones are MLPs)
            experts.add(f"{cls} ({origin(m.forward)})")
    return {"rope": origin(rope), "norm_classes": sorted(norms), "mlp_classes": sorted(mlps),
            "expert_classes": sorted(experts), "decoder_layers": sorted(layers), "forward": origin(model.forward)}


# --------------------------------------------------------------------------------------------------------------
# Running one provider
# --------------------------------------------------------------------------------------------------------------


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
    batches: torch.Tensor | list[dict[str, torch.Tensor]]  # [n_steps, B, T] (or per step, a vision-language model's
                                                          # inputs) on the device
    device: torch.device
    dtype: torch.dtype
    seed: int
    lr: float
    warmup_steps: int
    steps: int
    profile_steps: int
    attn_implementation: str
    optimizer: str = "torch"
    extra: dict[str, Any] = field(default_factory=dict)


def run_provider(provider: str, run: _Run) -> dict[str, Any]:
    """Build, patch and train one provider's model; return its result dict (see the module docstring).

    Raises whatever the provider raises; :func:`run_step_benchmark` records it as ``status: "error"``.
    """
    device = run.device
    cuda = device.type == "cuda"
    _free(device)
    res: dict[str, Any] = {"status": "ok", "reason": None, "compile_s": None, "autotune_warmup": None}
    modeling = MODELING_MODULES[run.family]
    if provider not in LIGER_GEN_PROVIDERS and "liger_gen.integrations.transformers" in sys.modules:
        undo_liger_gen()  # RoPE routed by an earlier apply_to in this process would run in this provider too
    with restore_module_globals([modeling]):
        t0 = time.perf_counter()
        model = build_model(run.model_name, device, run.dtype, run.seed, run.attn_implementation)
        model.load_state_dict(run.initial_state)
        model.train()
        try:
            if provider == "liger-kernel":
                apply_liger_kernel(model, run.family)
            elif provider == "torchao-fp8":
                convert_torchao_fp8(model)
            elif provider in LIGER_GEN_PROVIDERS:
                import liger_gen

                liger_gen.apply_to(model, **LIGER_GEN_PROVIDERS[provider])
            res["patch"] = patch_report(model, run.family)
            step_model = torch.compile(model) if provider in COMPILED_PROVIDERS else model
            optimizer = make_optimizer(model, run.lr, device, run.optimizer if provider in LIGER_GEN_PROVIDERS
                                       else "torch")
            sync(device)
            res["setup_s"] = time.perf_counter() - t0

            batches = run.batches
            if provider == "liger-kernel":  # its autotuned kernels benchmark their configs here, not in step 1
                res["autotune_warmup"] = warm_autotune(step_model, batches[0], device)

            losses: list[torch.Tensor] = []
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
            tokens = run.steps * tokens_per_step(batches)
            res["tokens_per_s"] = tokens / timed_s if run.steps else None
            res["ms_per_step"] = 1e3 * timed_s / run.steps if run.steps else None
            res["step_ms"] = step_ms
            res["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
            res["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None
            if provider in COMPILED_PROVIDERS and res["first_step_s"] is not None and step_ms:
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
                undo_liger_gen()
            if provider in COMPILED_PROVIDERS:
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


def split_names(value: str | Sequence[str], what: str) -> list[str]:
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
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: this PyTorch build sees no CUDA GPU (use device='cpu')")
    for m in models:
        max_pos = STEP_MODELS[m].fields["max_position_embeddings"]
        if seq_len > max_pos:
            raise ValueError(f"seq_len {seq_len} exceeds {m}'s max_position_embeddings {max_pos}")
        if seq_len < min_seq_len(STEP_MODELS[m]):
            vision = STEP_MODELS[m].vision
            raise ValueError(f"seq_len {seq_len} is too short for {m}: each sample holds an image of "
                             f"{vision.image_tokens} tokens between its start and end tokens, and two tokens of "
                             f"text (at least {min_seq_len(STEP_MODELS[m])})")


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
    optimizer: str = "torch",
    seed: int = 0,
    dtype: str = "bfloat16",
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    text: str | Path = DEFAULT_TEXT,
    loss_rel_tol: float | None = None,
    out_dir: str | Path | None = None,
    console=None,
    command: str | None = None,
    progress: ProgressBar = NO_PROGRESS,
) -> dict[str, Any]:
    """Run the training-step benchmark and return the results dict (schema in the module docstring).

    Args:
        models: names from ``STEP_MODELS`` (list or comma-separated string).
        providers: names from ``PROVIDERS``, run in this order for every model.
        batch_size, seq_len: sequences per step and tokens per sequence.
        warmup_steps: untimed steps first (they hold Triton/cuBLAS/compile warm-up).
        steps: timed steps. profile_steps: steps under torch.profiler after them (0: no profile).
        lr: AdamW learning rate (constant). seed: initial weights and batch offsets.
        optimizer: the AdamW of the liger-gen providers: ``"torch"`` (torch's fused AdamW, which every other
            provider runs) or ``"liger-gen"`` (``liger_gen.optim.AdamW``).
        dtype: parameter dtype, ``bfloat16`` (default), ``float16`` or ``float32``.
        device: torch device (default: cuda if available, else cpu).
        text: the training text, read as bytes.
        loss_rel_tol: loss-curve tolerance (default :func:`loss_rel_tolerance` of ``dtype``).
        out_dir: if given, the dict is written to ``out_dir/step.json`` (ResultsNotWritten, after the report is
            printed, if it cannot be: the JSON is then in a temporary file the message names).
        console: a ``rich.console.Console`` for the report (None: a new one; False: print nothing).
        command: recorded in the metadata (default: ``sys.argv`` joined).
        progress: advanced once per model and provider (``liger_gen.console.progress_bar``; default: no bar).

    Raises ValueError naming the argument for bad input. A provider that raises is recorded with
    ``status: "error"`` and its message; the others still run.
    """
    models = split_names(models, "models")
    providers = split_names(providers, "providers")
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
    torch_dtype = DTYPES[dtype]
    rel_tol = loss_rel_tolerance(torch_dtype) if loss_rel_tol is None else float(loss_rel_tol)
    if not rel_tol > 0:
        raise ValueError(f"loss_rel_tol must be > 0, got {loss_rel_tol!r}")
    n_total = warmup_steps + steps + profile_steps
    tokens = byte_tokens(text)

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "metadata": run_metadata(device, command),
        "settings": {"models": models, "providers": providers, "batch_size": batch_size, "seq_len": seq_len,
                     "warmup_steps": warmup_steps, "steps": steps, "profile_steps": profile_steps, "lr": lr,
                     "optimizer": optimizer, "seed": seed, "dtype": dtype, "attn_implementation": attn_implementation, "text": str(text),
                     "loss_rel_tol": rel_tol, "loss_reference": REFERENCE_PROVIDER,
                     "idle_definition": IDLE_DEFINITION},
        "models": {},
    }
    label(result, device.type)  # on the CPU: a functional run, not performance
    progress.start(len(models) * len(providers))
    for model_name in models:
        spec = STEP_MODELS[model_name]
        _free(device)
        model = build_model(model_name, device, torch_dtype, seed, attn_implementation)
        entry: dict[str, Any] = {"config": config_summary(model.config),
                                 "n_params": sum(p.numel() for p in model.parameters()),
                                 "inputs": describe_batch(spec, batch_size, seq_len), "providers": {}}
        initial_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        # the same batches for every provider (the image ones drop inputs this transformers' forward does not take)
        batches = batches_to(step_batches(spec, tokens, n_total, batch_size, seq_len, seed), device, model.forward)
        del model
        run = _Run(model_name, spec.family, initial_state, batches, device, torch_dtype, seed, lr, warmup_steps,
                   steps, profile_steps, attn_implementation, optimizer)
        for provider in providers:
            why = provider_unavailable(provider, device, torch_dtype, spec.family)
            if why is not None:
                entry["providers"][provider] = {"status": "skipped", "reason": why}
                if provider == "liger-kernel":
                    entry["providers"][provider]["autotune_warmup"] = not_run(why)
                progress.advance(f"{model_name} {provider}")
                continue
            try:
                entry["providers"][provider] = run_provider(provider, run)
            except Exception as exc:  # noqa: BLE001 - one provider failing must not lose the others' results
                entry["providers"][provider] = {
                    "status": "error", "reason": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=-10)}
            _free(device)  # outside the handler: the exception's frames hold the failed run's tensors until then
            progress.advance(f"{model_name} {provider}")
        del run, initial_state, batches
        add_comparisons(entry["providers"], rel_tol)
        result["models"][model_name] = entry
    return finish_run(result, out_dir, "step.json", print_report, console)


def finish_run(result: dict[str, Any], out_dir, file_name: str, printer: Callable, console) -> dict[str, Any]:
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
        tol = max(rel_tol, FP8_LOSS_REL_TOL) if name in FP8_PROVIDERS else rel_tol
        res["loss_check"] = (compare_losses(res["losses"], ref["losses"], tol)
                             if ref_ok and name != REFERENCE_PROVIDER else None)
        tps = res.get("tokens_per_s")
        res["speedup_vs_transformers"] = tps / ref["tokens_per_s"] if ref_ok and tps and ref["tokens_per_s"] else None
        res["speedup_vs_liger_kernel"] = tps / lk["tokens_per_s"] if lk_ok and tps and lk["tokens_per_s"] else None


def run_metadata(device: torch.device, command: str | None) -> dict[str, Any]:
    from liger_gen._version import __version__

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # the interpreter's variable is part of the command: without it the same line times the plain path
        "command": command if command is not None else " ".join(
            (["TRITON_INTERPRET=1"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
            + [Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": installed_version("triton"),
        "transformers": installed_version("transformers"),
        "liger_kernel": installed_version("liger-kernel") or installed_version("liger_kernel"),
        "torchao": installed_version("torchao"),
        "liger_gen": __version__,
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


fmt = _fmt  # the first-step benchmark's report formats as this one's


def print_report(result: dict[str, Any], console=None) -> None:
    """Print the summary table (speed, memory, loss check, Liger-Kernel's autotune warm-up) and the kernel-class
    breakdown with ``rich`` (``liger_gen.bench.step_report``); skipped and failed providers are listed under the
    summary with the reason."""
    print_step_report(result, console, FP8_LOSS_REL_TOL)
