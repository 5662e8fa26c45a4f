"""The first training step in a fresh process: each provider's time from process start to the end of step 1.

Per model and provider, a new Python process (``first_step_child.py``, which imports no liger-gen unless it runs
liger-gen) with empty Triton, liger-gen kernel and inductor caches builds the model, patches it and trains one
step; the time holds Python's start, the imports, the build and every compilation. A vision-language model's
step is an image + text batch (``step_data.step_batches``), so its vision tower's kernels compile too. ``liger-gen bench-step
--first-step [--repeats N]`` runs it; ``run_first_step`` returns the result, also written to
``out_dir/first_step.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from liger_gen.bench.labels import label
from liger_gen.bench.step import (DEFAULT_MODELS, DEFAULT_PROVIDERS, PROVIDERS, REFERENCE_PROVIDER, finish_run, fmt,
                                  provider_unavailable, run_metadata, split_names)
from liger_gen.bench.step_data import step_batches
from liger_gen.training import DEFAULT_TEXT, FAMILY_CLASSES, architecture, build_config, byte_tokens

FIRST_STEP_SCHEMA = "liger-gen/bench-first-step/1"
FIRST_STEP_CHILD = Path(__file__).resolve().parent / "first_step_child.py"


def first_step_spec(model_name: str, provider: str, batch_path: Path, dtype: str, device: torch.device, seed: int,
                    lr: float, attn_implementation: str = "sdpa") -> dict[str, Any]:
    """What ``first_step_child.py`` needs: the config class and fields (so the child imports no liger-gen)."""
    spec = architecture(model_name)
    config = build_config(model_name, attn_implementation)
    config_class, model_class = FAMILY_CLASSES[spec.family]
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

    models = split_names(models, "models")
    providers = split_names(providers, "providers")
    for m in models:
        architecture(m)
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
        "schema": FIRST_STEP_SCHEMA, "metadata": run_metadata(dev, command),
        "settings": {"models": models, "providers": providers, "batch_size": batch_size, "seq_len": seq_len,
                     "dtype": dtype, "seed": seed, "lr": lr, "repeats": repeats, "warmup_rounds": warmup_rounds,
                     "definition": "wall clock from process start to the end of the first step; empty Triton, "
                                   "kernel-module and inductor caches per run"},
        "models": {}}
    label(result, dev.type)  # on the CPU: a functional run, not performance
    tokens = byte_tokens(text)
    # each model's one batch (a vision-language model's: image + text; ValueError if seq_len is too short for it)
    batches = {m: step_batches(architecture(m), tokens, 1, batch_size, seq_len, seed)[0] for m in models}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="liger-gen-first-step-") as tmp:
        for model_name in models:
            batch_path = Path(tmp) / f"{model_name}-batch.pt"
            torch.save(batches[model_name], batch_path)
            runs: dict[str, list] = {p: [] for p in providers}
            for round_ in range(warmup_rounds + repeats):
                for provider in providers:
                    why = provider_unavailable(provider, dev, getattr(torch, dtype))
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
                                   "inputs": stamps.get("inputs"),
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
    return finish_run(result, out_dir, "first_step.json", print_first_step, console)


def print_first_step(result: dict[str, Any], console=None) -> None:
    """The first-step table: median, min and the difference to plain transformers, per model and provider."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    functional = result.get("functional_run_reason")
    table = Table(title="first training step in a fresh process (empty Triton cache)"
                  + (" — functional run, not performance" if functional else ""), caption=functional)
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
            table.add_row(model, provider, fmt(s["median_s"], ".2f"), fmt(s["min_s"], ".2f"),
                          fmt(s["vs_transformers_s"], "+.2f"), fmt(mid["imports_s"], ".2f"), fmt(mid["build_s"], ".2f"),
                          fmt(mid["step_s"], ".2f"))
    console.print(table)
