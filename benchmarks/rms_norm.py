"""Side-by-side benchmark of RMSNorm forward+backward (HF ``LlamaRMSNorm`` semantics).

Semantics ("llama" casting), for ``x`` of shape (rows, cols) and ``weight`` of shape (cols,)::

    h    = x.to(float32)
    rstd = rsqrt(mean(h * h, dim=-1) + eps)
    y    = weight * (h * rstd).to(x.dtype)

Providers
    liger-gen            ``liger_gen.functional.rms_norm`` with the tuned table for this GPU
    liger-gen-heuristic  the same op inside ``liger_gen.runtime.tables.heuristic_only()``
    torch-eager          the HF formula above in plain torch
    torch-compile        ``torch.compile`` (default mode) of that function
    liger-kernel         ``LigerRMSNormFunction`` (what ``LigerRMSNorm(casting_mode="llama")``
                         calls), only when ``liger_kernel`` is importable

For every shape and provider (x and weight require grad, a fixed random dy, gradients
taken with ``torch.autograd.grad`` so that nothing accumulates into ``.grad``):

1. correctness: relative L2 error of y, dx and dw against a float64 reference on the GPU;
2. kernel time per fwd+bwd: summed CUDA kernel time from ``torch.profiler``, the L2 cache
   flushed (256 MiB int32 write) before every iteration and the flush kernel excluded;
3. wall time per fwd+bwd: many back-to-back calls, one synchronize, host clock / n;
4. GB/s from the minimal byte count (see ``minimal_bytes``) over the kernel time, and the
   percentage of the device-to-device copy bandwidth measured in the same run.

Results go to a ``rich`` table (printed last) and to ``<out>/rms_norm_<gpu>.json``;
``--render file.json`` turns such a JSON into a markdown table (works without a GPU)::

    python benchmarks/rms_norm.py                                  # needs CUDA
    python benchmarks/rms_norm.py --shapes 16384x4096 --providers liger-gen,torch-eager
    python benchmarks/rms_norm.py --render benchmarks/results/rms_norm_nvidia_h200.json \\
        > benchmarks/results/rms_norm_nvidia_h200.md

Without CUDA (and without ``--render``) the script exits with a message and status 1.
Compilation/autotuning happen in the warm-up and are never timed. The default settings keep
the whole run well below 90 s on an H200 (the float64 reference and torch.compile's first
compile dominate).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

PROVIDERS = ("liger-gen", "liger-gen-heuristic", "torch-eager", "torch-compile", "liger-kernel")
DEFAULT_SHAPES = "16384x4096,16384x2048"
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
}
FLUSH_BYTES = 256 * 1024**2  # > 5x the 50 MiB L2 of an H100/H200
COPY_BYTES = 2 * 1024**3  # copy-bandwidth probe size (source tensor; as much is written)
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------
# Pure helpers (no torch needed): used by the GPU run, by --render and by the self-check.
# --------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"16384x4096,16384x2048"`` -> ``[(16384, 4096), (16384, 2048)]`` (rows x cols)."""
    shapes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*[x*]\s*(\d+)", part)
        if not m:
            raise ValueError(f"bad shape {part!r}: expected ROWSxCOLS, e.g. 16384x4096")
        rows, cols = int(m.group(1)), int(m.group(2))
        if rows <= 0 or cols <= 0:
            raise ValueError(f"bad shape {part!r}: sizes must be positive")
        shapes.append((rows, cols))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def minimal_bytes(rows: int, cols: int, itemsize: int, weight_itemsize: int | None = None,
                  rstd_itemsize: int = 4) -> int:
    """Minimal DRAM traffic of one RMSNorm forward+backward, each tensor counted once per pass.

    forward : read x (R*C*s), read w (C*sw), write y (R*C*s), write rstd (R*4, fp32)
    backward: read dy (R*C*s), read x (R*C*s), read w (C*sw), read rstd (R*4),
              write dx (R*C*s), write dw (C*sw)
    total   = 5*R*C*s + 3*C*sw + 2*R*4

    (s = activation element size, sw = weight/dw element size.) Re-reads inside a pass, the
    fp32 partial-dw scratch and any extra kernels a provider needs are deliberately not
    counted: this is the floor every implementation has to move, so GB/s is comparable.
    """
    sw = itemsize if weight_itemsize is None else weight_itemsize
    act = rows * cols * itemsize
    fwd = act + cols * sw + act + rows * rstd_itemsize
    bwd = act + act + cols * sw + rows * rstd_itemsize + act + cols * sw
    return fwd + bwd


def gb_per_s(nbytes: float, ms: float | None) -> float | None:
    """Bytes over milliseconds in GB/s (1 GB = 1e9 bytes)."""
    if ms is None or ms <= 0 or not math.isfinite(ms):
        return None
    return nbytes / (ms * 1e-3) / 1e9


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia_h200"`` (used in the JSON file name)."""
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return slug or "gpu"


def device_time_us(evt: Any) -> float:
    """Device time of one profiler event (a kernel/memcpy/memset), in microseconds.

    torch >= 2.4 names it ``self_device_time_total``/``device_time_total`` (torch 2.11 too);
    older releases only had the ``*cuda_time*`` spellings. New names are tried first so the
    deprecated properties (which warn) are only touched on old torch. For a device-side
    event every one of them is simply its duration, so ``time_range`` is the last resort.
    """
    for attr in ("self_device_time_total", "device_time_total", "self_cuda_time_total",
                 "cuda_time_total", "cuda_time"):
        try:
            value = getattr(evt, attr)
        except Exception:  # noqa: BLE001 - property may raise on odd event kinds
            continue
        if value:
            return float(value)
    tr = getattr(evt, "time_range", None)
    if tr is not None:
        return float(tr.end - tr.start)
    return 0.0


def device_events(events: Iterable[Any]) -> list[tuple[float, str, float]]:
    """CUDA-side events of a profile as ``(start_us, name, duration_us)`` in start order.

    With the kineto profiler every GPU activity (kernel, memcpy, memset) is its own
    FunctionEvent with ``device_type == DeviceType.CUDA``; the CPU-side ops that launched them
    are ``DeviceType.CPU`` and are skipped, so nothing is counted twice. GPU-side ranges of
    ``record_function`` annotations are also CUDA events but flagged ``is_user_annotation``.
    """
    out = []
    for evt in events:
        dt = getattr(evt, "device_type", None)
        if getattr(dt, "name", None) != "CUDA":
            continue
        if getattr(evt, "is_user_annotation", False):
            continue
        tr = getattr(evt, "time_range", None)
        start = float(tr.start) if tr is not None else 0.0
        out.append((start, str(evt.name), device_time_us(evt)))
    out.sort(key=lambda t: t[0])
    return out


def summarize_flush(kevents: list[tuple[float, str, float]], n_flushes: int) -> dict:
    """Learn what the L2 flush looks like from a profile of ``n_flushes`` flushes alone."""
    if not kevents:
        raise RuntimeError("the profiler recorded no CUDA events for the L2 flush; "
                           "kernel timing is impossible (is CUPTI available?)")
    names = sorted({name for _, name, _ in kevents})
    per_iter = len(kevents) / n_flushes
    total = sum(d for _, _, d in kevents)
    # exact=False (events lost or extra): summarize_kernels then never matches the expected
    # count and falls back to subtracting the mean flush time -- degraded, not fatal.
    return {"names": names, "events_per_flush": max(1, round(per_iter)),
            "exact": per_iter == int(per_iter), "mean_us": total / n_flushes}


def summarize_kernels(kevents: list[tuple[float, str, float]], n_iters: int, flush: dict) -> dict:
    """Per-iteration kernel time of a profile of ``n_iters`` x (flush; fwd+bwd).

    How the flush is taken out (robust, nothing about kernel names is hard-coded):
    the flush (``int32_buffer.fill_``) was first profiled alone, which gives the exact set of
    kernel names it launches and how many per flush. Here, if those names occur exactly
    ``n_iters * events_per_flush`` times, none of the provider's kernels shares a name with
    the flush, so dropping them by name is exact ("exclude-flush-by-name"); because one
    stream runs everything in issue order, each flush also marks the start of an iteration,
    which gives per-iteration sums (median/min). If a provider did launch a kernel with the
    same name (count mismatch), everything is summed and ``n_iters`` times the mean flush
    time measured alone is subtracted instead ("subtract-flush-mean", mean only).
    """
    flush_names = set(flush["names"])
    n_flush_like = sum(1 for _, name, _ in kevents if name in flush_names)
    exact = flush.get("exact", True)
    breakdown: dict[str, dict[str, float]] = {}
    per_iter: list[float] | None = None
    if exact and n_flush_like == n_iters * flush["events_per_flush"]:
        method = "exclude-flush-by-name"
        buckets: list[float] = []
        prev_was_flush = False
        for _, name, dur in kevents:
            if name in flush_names:
                if not prev_was_flush:
                    buckets.append(0.0)
                prev_was_flush = True
                continue
            prev_was_flush = False
            if not buckets:  # work before the first flush: cannot happen, keep it anyway
                buckets.append(0.0)
            buckets[-1] += dur
            b = breakdown.setdefault(name, {"us_per_iter": 0.0, "calls_per_iter": 0.0})
            b["us_per_iter"] += dur / n_iters
            b["calls_per_iter"] += 1.0 / n_iters
        total = sum(buckets)
        if len(buckets) == n_iters:
            per_iter = buckets
    else:
        method = "subtract-flush-mean"
        for _, name, dur in kevents:
            b = breakdown.setdefault(name, {"us_per_iter": 0.0, "calls_per_iter": 0.0})
            b["us_per_iter"] += dur / n_iters
            b["calls_per_iter"] += 1.0 / n_iters
        total = sum(d for _, _, d in kevents) - n_iters * flush["mean_us"]
    mean_us = total / n_iters
    res = {
        "method": method,
        "iters": n_iters,
        "mean_ms": mean_us / 1e3,
        "median_ms": statistics.median(per_iter) / 1e3 if per_iter else None,
        "min_ms": min(per_iter) / 1e3 if per_iter else None,
        "kernels": dict(sorted(breakdown.items(), key=lambda kv: -kv[1]["us_per_iter"])),
    }
    # The figure reported everywhere: median over iterations when available, else the mean.
    res["ms"] = res["median_ms"] if res["median_ms"] is not None else res["mean_ms"]
    return res


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    if value is None:
        return missing
    try:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def max_rel_err(errors: dict | None) -> float | None:
    if not errors:
        return None
    vals = [v for v in errors.values() if v is not None]
    if not vals:
        return None
    # NaN must win (max() would silently drop it depending on order).
    if any(isinstance(v, float) and math.isnan(v) for v in vals):
        return float("nan")
    return max(vals)


def table_rows(data: dict) -> list[dict[str, str]]:
    """Formatted rows shared by the rich table and the markdown rendering."""
    rows = []
    for res in data.get("results", []):
        status = res.get("status", "ok")
        timing = res.get("kernel") or {}
        errs = res.get("rel_err")
        lookup = res.get("lookup") or {}
        row = {
            "shape": f"{res['rows']}x{res['cols']}",
            "provider": res["provider"],
            "kernel ms": _fmt(timing.get("ms"), ".4f"),
            "wall ms": _fmt(res.get("wall_ms"), ".4f"),
            "GB/s": _fmt(res.get("gbps"), ",.0f"),
            "% copy": _fmt(res.get("pct_copy"), ".1f"),
            "max rel err": _fmt(max_rel_err(errs), ".2e"),
            "rel err y / dx / dw": (" / ".join(_fmt((errs or {}).get(k), ".1e") for k in ("y", "dx", "dw"))
                                    if errs else "-"),
            "config": lookup.get("source", "-") if isinstance(lookup, dict) else "-",
            "status": status,
        }
        if status != "ok":  # the full message is in the JSON; the tables get a short one
            short = status if len(status) <= 48 else status[:47] + "\u2026"
            for k in ("kernel ms", "wall ms", "GB/s", "% copy"):
                if row[k] == "-":
                    row[k] = short if k == "kernel ms" else ""
        rows.append(row)
    return rows


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(data: dict) -> str:
    """Render a result JSON (as written by this script) into a markdown section."""
    meta = data.get("meta", {})
    versions = meta.get("versions", {})
    copy = meta.get("copy_bandwidth", {})
    cfg = data.get("config", {})
    lines = [f"# RMSNorm forward+backward on {meta.get('gpu', 'unknown GPU')}", ""]
    lines.append(f"- date: {meta.get('date', '?')}")
    lines.append(f"- command: `{meta.get('command', '?')}`")
    git = meta.get("git") or {}
    if git.get("commit"):
        lines.append(f"- liger-gen checkout: {git['commit'][:12]}{' (with uncommitted changes)' if git.get('dirty') else ''}")
    lines.append("- versions: " + ", ".join(f"{k} {v if v is not None else 'not installed'}"
                                            for k, v in versions.items()))
    lines.append(f"- dtype {cfg.get('dtype', '?')}, eps {cfg.get('eps', '?')}, casting "
                 f"{cfg.get('casting_mode', 'llama')} (HF LlamaRMSNorm semantics)")
    if copy:
        lines.append(f"- copy bandwidth (device-to-device copy of {copy.get('bytes', 0) / 2**30:.0f} GiB, "
                     f"read+written bytes / time, median of {copy.get('reps', '?')}): "
                     f"{_fmt(copy.get('gbps'), ',.0f')} GB/s")
    lines.append(f"- kernel ms: summed CUDA kernel time of one forward+backward from torch.profiler, "
                 f"L2 flushed ({FLUSH_BYTES // 2**20} MiB write) before each of "
                 f"{cfg.get('iters', '?')} iterations, flush excluded; median over iterations")
    lines.append(f"- wall ms: host time of {cfg.get('wall_iters', '?')} back-to-back calls / n (no flush)")
    lines.append("- GB/s: minimal bytes (5·R·C·s + 3·C·s_w + 8·R: fwd reads x, w, writes y, fp32 rstd; "
                 "bwd reads dy, x, w, rstd, writes dx, dw) / kernel time; % copy relative to the copy bandwidth")
    lines.append("- rel err: relative L2 error of y, dx, dw against a float64 reference; "
                 "config: where liger-gen took its launch config from")
    lines.append("")
    cols = ["shape", "provider", "kernel ms", "wall ms", "GB/s", "% copy", "max rel err",
            "rel err y / dx / dw", "config"]
    right = {"kernel ms", "wall ms", "GB/s", "% copy", "max rel err"}
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---:" if c in right else "---" for c in cols) + "|")
    for row in table_rows(data):
        lines.append("| " + " | ".join(_md_escape(row[c]) for c in cols) + " |")
    warnings = meta.get("warnings") or []
    if warnings:
        lines.append("")
        lines.append("Warnings:")
        lines.append("")
        lines.extend(f"- {_md_escape(w)}" for w in warnings)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# GPU part
# --------------------------------------------------------------------------------------


def _version(dist: str, module: str | None = None) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    if module:
        try:
            mod = __import__(module)
            return getattr(mod, "__version__", "unknown")
        except Exception:  # noqa: BLE001
            return None
    return None


def hf_rms_norm(x, weight, eps: float):
    """HF LlamaRMSNorm.forward, verbatim arithmetic, as a function."""
    import torch

    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


class Provider:
    def __init__(self, name: str, fn: Callable | None = None, context: Callable | None = None,
                 status: str = "ok", note: str = "", lookup: Callable | None = None):
        self.name = name
        self.fn = fn  # (x, w) -> y
        self.context = context  # () -> context manager wrapping all of this provider's work
        self.status = status
        self.note = note
        self.lookup = lookup  # (dtype, rows, cols) -> dict


def build_providers(names: list[str], eps: float) -> list[Provider]:
    import torch

    out: list[Provider] = []
    lg_fn = lg_tables = None
    lg_err = None
    if any(n.startswith("liger-gen") for n in names):
        try:
            from liger_gen import functional as lg_functional
            from liger_gen.runtime import tables as lg_tables

            def lg_fn(x, w):
                return lg_functional.rms_norm(x, w, eps=eps, offset=0.0, casting_mode="llama")
        except Exception as exc:  # noqa: BLE001
            lg_err = f"error: import liger_gen failed: {type(exc).__name__}: {exc}"

    def lookup(dtype, rows, cols):
        # Called inside the provider's own context (heuristic_only() for the heuristic one),
        # never re-entering it: a flag-style context manager must not be nested.
        return lg_tables.describe_lookup(op="rms_norm", dtype=dtype, dims=cols, rows=rows)

    for name in names:
        if name == "liger-gen":
            if lg_err:
                out.append(Provider(name, status=lg_err))
            else:
                out.append(Provider(name, lg_fn, note="tuned table", lookup=lookup))
        elif name == "liger-gen-heuristic":
            if lg_err:
                out.append(Provider(name, status=lg_err))
            else:
                # The whole measurement (warm-up, check, profile, wall loop) runs inside
                # heuristic_only(), so both the forward and the backward launch see it.
                out.append(Provider(name, lg_fn, context=lg_tables.heuristic_only,
                                    note="heuristic_only()", lookup=lookup))
        elif name == "torch-eager":
            out.append(Provider(name, lambda x, w: hf_rms_norm(x, w, eps), note="HF formula"))
        elif name == "torch-compile":
            def eager(x, w):
                return hf_rms_norm(x, w, eps)

            # Default mode. dynamic=False: every shape gets its own static specialization (what
            # the first shape gets anyway), instead of a dynamic-shape recompile on shape #2.
            compiled = torch.compile(eager, dynamic=False)
            out.append(Provider(name, compiled, note="torch.compile(dynamic=False)"))
        elif name == "liger-kernel":
            try:
                try:
                    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
                except ImportError:
                    from liger_kernel.ops import LigerRMSNormFunction
            except ImportError as exc:
                out.append(Provider(name, status="not installed", note=str(exc)))
                continue

            def lk_fn(x, w, _f=LigerRMSNormFunction):
                # Same arguments LigerRMSNorm(hidden, eps, casting_mode="llama").forward passes:
                # offset 0.0, casting "llama", in_place=True (its default: dx overwrites dy, which
                # is why every provider gets its own scratch dy below).
                return _f.apply(x, w, eps, 0.0, "llama", True)

            out.append(Provider(name, lk_fn, note="LigerRMSNormFunction(casting_mode=llama, in_place=True)"))
        else:
            raise ValueError(f"unknown provider {name!r}")
    return out


def measure_copy_bandwidth(torch, device, nbytes: int = COPY_BYTES, reps: int = 10) -> dict:
    """Device-to-device copy of an ``nbytes`` tensor, timed with CUDA events (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(7)
    dst.copy_(src)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))  # ms
    del src, dst
    torch.cuda.empty_cache()
    med = statistics.median(times)
    return {"bytes": nbytes, "bytes_moved": 2 * nbytes, "reps": reps, "median_ms": med,
            "times_ms": times, "gbps": gb_per_s(2 * nbytes, med)}


def profile_device_events(torch, body: Callable[[], None]) -> list[tuple[float, str, float]]:
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        # One profile per measurement is intended; torch warns that events are not accumulated.
        warnings.filterwarnings("ignore", message=".*[Pp]rofiler clears events.*")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            body()
            torch.cuda.synchronize()
        return device_events(prof.events())


def git_state(repo: Path) -> dict:
    """Commit and dirtiness of the checkout the benchmark ran from (best effort)."""
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", "-C", str(repo), *cmd], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except Exception:  # noqa: BLE001 - no git, no repo, no commit yet
        return {"commit": None, "dirty": None}


def rel_l2(torch, got, ref) -> float:
    got = got.detach().to(torch.float64)
    num = torch.linalg.vector_norm(got - ref)
    den = torch.linalg.vector_norm(ref)
    return float(num / den) if float(den) > 0 else float(num)


def bench_one(torch, prov: Provider, x0, w0, dy0, ref: dict, flush_buf, flush: dict,
              args, dtype) -> dict:
    import contextlib

    rows, cols = x0.shape
    res: dict[str, Any] = {"provider": prov.name, "rows": rows, "cols": cols, "status": prov.status,
                           "note": prov.note}
    if prov.status != "ok":
        return res
    ctx = prov.context() if prov.context else contextlib.nullcontext()
    with ctx:
        if prov.lookup is not None:
            try:
                res["lookup"] = prov.lookup(dtype, rows, cols)
            except Exception as exc:  # noqa: BLE001 - informative only
                res["lookup"] = {"source": "?", "error": f"{type(exc).__name__}: {exc}"}

        # Private copies: a provider must not be able to disturb another one's inputs, and
        # liger-kernel's in_place backward writes dx into the dy it is handed.
        x = x0.detach().clone().requires_grad_(True)
        w = w0.detach().clone().requires_grad_(True)
        dy = dy0.clone()
        fn = prov.fn

        def step(grad_out):
            y = fn(x, w)
            dx, dw = torch.autograd.grad(y, (x, w), grad_out)
            return y, dx, dw

        # 1. warm-up (compilation, autotuning, allocator) -- not timed.
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step(dy)
        torch.cuda.synchronize()
        res["warmup_s"] = time.perf_counter() - t0

        # 2. correctness against the float64 reference (fresh dy: in-place providers).
        y, dx, dw = step(dy0.clone())
        torch.cuda.synchronize()
        res["rel_err"] = {"y": rel_l2(torch, y, ref["y"]), "dx": rel_l2(torch, dx, ref["dx"]),
                          "dw": rel_l2(torch, dw, ref["dw"])}
        del y, dx, dw

        # 3. kernel time: flush L2, then one fwd+bwd; n times under the profiler.
        def body():
            for _ in range(args.iters):
                flush_buf.fill_(0x2A)
                step(dy)

        torch.cuda.synchronize()
        res["kernel"] = summarize_kernels(profile_device_events(torch, body), args.iters, flush)

        # 4. wall time: back-to-back calls, no flush and no sync inside the loop.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.wall_iters):
            step(dy)
        torch.cuda.synchronize()
        res["wall_ms"] = (time.perf_counter() - t0) * 1e3 / args.wall_iters
        res["wall_iters"] = args.wall_iters
    return res


def run(args) -> int:
    try:
        import torch
    except ImportError:
        print("rms_norm.py: torch is not installed; this benchmark needs torch with CUDA "
              "(only --render works without it).", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("rms_norm.py: no CUDA device available (torch.cuda.is_available() is False). "
              "This benchmark needs an NVIDIA GPU; only --render works without one.", file=sys.stderr)
        return 1

    dtype_name = DTYPE_ALIASES.get(args.dtype.lower())
    if dtype_name is None:
        print(f"rms_norm.py: unsupported --dtype {args.dtype!r} "
              f"(choose from {', '.join(sorted(DTYPE_ALIASES))})", file=sys.stderr)
        return 2
    dtype = getattr(torch, dtype_name)
    shapes = parse_shapes(args.shapes)
    names = [n.strip() for n in args.providers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        print(f"rms_norm.py: unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}",
              file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    props = torch.cuda.get_device_properties(device)
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    meta = {
        "gpu": gpu,
        "gpu_slug": gpu_slug(gpu),
        "capability": list(torch.cuda.get_device_capability(device)),
        "sm_count": props.multi_processor_count,
        "total_memory_gib": round(props.total_memory / 2**30, 1),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton_version,
            "transformers": _version("transformers"),
            "liger-kernel": _version("liger-kernel", "liger_kernel"),
            "liger-gen": _version("liger-gen", "liger_gen"),
        },
        "python": sys.version.split()[0],
        "git": git_state(Path(__file__).resolve().parent.parent),
        "command": shlex.join(["python", *sys.argv]),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }

    providers = build_providers(names, args.eps)

    log = print if not args.quiet else (lambda *a, **k: None)
    log(f"[rms_norm] {gpu}: measuring copy bandwidth ...", file=sys.stderr)
    copy = measure_copy_bandwidth(torch, device)
    meta["copy_bandwidth"] = copy
    log(f"[rms_norm] copy bandwidth {copy['gbps']:,.0f} GB/s", file=sys.stderr)

    # The L2 flush: writing a 256 MiB int32 buffer. Profile flushes alone once to learn its
    # kernel name(s) and duration (see summarize_kernels for how that is used).
    flush_buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    flush_buf.fill_(0x2A)
    torch.cuda.synchronize()
    profile_device_events(torch, lambda: flush_buf.fill_(0x2A))  # throwaway: CUPTI start-up
    n_probe = max(args.iters, 10)

    def flush_body():
        for _ in range(n_probe):
            flush_buf.fill_(0x2A)

    flush = summarize_flush(profile_device_events(torch, flush_body), n_probe)
    meta["l2_flush"] = {"bytes": FLUSH_BYTES, **flush}

    gen = torch.Generator(device=device)
    results = []
    warnings: list[str] = []
    failed = False
    for rows, cols in shapes:
        gen.manual_seed(args.seed)
        x0 = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen)
        w0 = (1.0 + 0.1 * torch.randn(cols, device=device, dtype=torch.float32, generator=gen)).to(dtype)
        dy0 = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen)

        # float64 reference of the exact math (no intermediate rounding), on the GPU.
        x64 = x0.to(torch.float64).requires_grad_(True)
        w64 = w0.to(torch.float64).requires_grad_(True)
        y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + args.eps) * w64
        dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy0.to(torch.float64))
        ref = {"y": y64.detach(), "dx": dx64, "dw": dw64}
        del x64, w64, y64

        nbytes = minimal_bytes(rows, cols, x0.element_size(), w0.element_size())
        for prov in providers:
            log(f"[rms_norm] {rows}x{cols} {prov.name} ...", file=sys.stderr)
            try:
                res = bench_one(torch, prov, x0, w0, dy0, ref, flush_buf, flush, args, dtype)
            except Exception as exc:  # noqa: BLE001 - record and go on with the others
                traceback.print_exc()
                failed = True
                res = {"provider": prov.name, "rows": rows, "cols": cols, "note": prov.note,
                       "status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            res["bytes"] = nbytes
            if res.get("kernel"):
                res["gbps"] = gb_per_s(nbytes, res["kernel"]["ms"])
                res["pct_copy"] = (100.0 * res["gbps"] / copy["gbps"]
                                   if res["gbps"] is not None and copy.get("gbps") else None)
            if prov.status.startswith("error"):
                failed = True
            src = (res.get("lookup") or {}).get("source")
            if prov.name == "liger-gen-heuristic" and src not in (None, "heuristic"):
                warnings.append(f"{rows}x{cols}: liger-gen-heuristic reports config source {src!r}")
            if prov.name == "liger-gen" and src == "heuristic":
                warnings.append(f"{rows}x{cols}: liger-gen found no tuned table entry for {gpu} "
                                f"(config source 'heuristic'); it equals liger-gen-heuristic")
            if res.get("kernel") and res["kernel"]["method"] != "exclude-flush-by-name":
                warnings.append(f"{rows}x{cols} {prov.name}: flush removed by "
                                f"{res['kernel']['method']} (mean, not median)")
            results.append(res)
        del ref, dx64, dw64, x0, w0, dy0
        torch.cuda.empty_cache()

    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    meta["warnings"] = warnings
    for w in warnings:
        print(f"[rms_norm] warning: {w}", file=sys.stderr)
    data = {
        "schema": SCHEMA_VERSION,
        "benchmark": "rms_norm",
        "meta": meta,
        "config": {"shapes": [list(s) for s in shapes], "dtype": dtype_name, "eps": args.eps,
                   "offset": 0.0, "casting_mode": "llama", "iters": args.iters,
                   "wall_iters": args.wall_iters, "warmup": args.warmup, "seed": args.seed,
                   "providers": names,
                   "bytes_formula": "5*R*C*s + 3*C*s_w + 2*R*4"},
        "results": results,
    }
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"rms_norm_{meta['gpu_slug']}.json"
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        log(f"[rms_norm] wrote {path} ({meta['elapsed_s']} s)", file=sys.stderr)

    print_table(data)
    return 1 if failed else 0


def print_table(data: dict) -> None:
    cols = ["shape", "provider", "kernel ms", "wall ms", "GB/s", "% copy", "max rel err"]
    rows = table_rows(data)
    meta = data.get("meta", {})
    title = (f"RMSNorm fwd+bwd, {data.get('config', {}).get('dtype', '')}, {meta.get('gpu', '')} "
             f"(copy {_fmt(meta.get('copy_bandwidth', {}).get('gbps'), ',.0f')} GB/s)")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(f"{c:>12}" for c in cols))
        for r in rows:
            print("  ".join(f"{r[c]:>12}" for c in cols))
        return
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="left" if c in ("shape", "provider") else "right", no_wrap=True)
    for r in rows:
        table.add_row(*(r[c] for c in cols))
    # Piped into a file/CI log rich would assume 80 columns and squeeze the table.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="RMSNorm forward+backward benchmark (liger-gen vs torch vs Liger-Kernel).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated ROWSxCOLS")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32")
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset")
    p.add_argument("--iters", type=int, default=20, help="profiled (flushed) iterations")
    p.add_argument("--wall-iters", type=int, default=100, help="back-to-back calls for wall time")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls per provider/shape")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                   help="directory for rms_norm_<gpu>.json ('' to skip)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--render", metavar="JSON", help="print a result JSON as markdown and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        sys.stdout.write(render_markdown(data))
        return 0
    for name in ("iters", "wall_iters", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            print(f"rms_norm.py: --{name.replace('_', '-')} is too small", file=sys.stderr)
            return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
