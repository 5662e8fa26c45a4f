"""Reporting of ``liger-gen bench`` results: derived metrics, schema check, terminal table, markdown, JSON, PNG.

Everything here works on the result dict alone (no GPU, no torch), so ``liger-gen bench --render file.json``
runs anywhere. The dict (schema 1, as ``liger_gen.bench.run_bench`` returns it and JSON stores it)::

    schema: 1
    benchmark: "liger-gen bench"
    meta:    gpu, gpu_slug, device ("cuda" | "cpu"), versions {torch, cuda, triton, transformers, liger-kernel,
             cut-cross-entropy, liger-gen}, python, git {commit, dirty, source}, command, date, elapsed_s,
             ceilings {copy {bytes, gbps, ...}, matmul {n, dtype, tflops, ...}}, l2_flush (CUDA), warnings [str]
    config:  model {ModelShape fields}, dtype, ops, providers, rows (None: per-op default), iters, wall_iters,
             warmup, seed
    ops:     op -> {dims, bytes, bytes_formula, flops, flops_formula, tolerance, outputs, gradients,
             reference_s, [error | reference_error], sol_ms}
    results: [{op, provider, status ("ok" | "not installed" | "not available" | "error: ..."), note,
             [lookup], warmup_s, rel_err {name: float}, max_rel_err, correct, peak_extra_bytes, kernel {method,
             iters, ms, median_ms, mean_ms, min_ms, kernels}, wall_ms, wall_iters, wall_rounds_ms,
             wall_minus_kernel_ms, host_overhead_ms, gbps, pct_copy, tflops, pct_matmul, speedup {peer: {kernel, wall}}}]

Times are milliseconds, bandwidths GB/s (1e9 bytes/s), compute TFLOP/s (1e12 flops/s), memory bytes.
"""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from liger_gen.bench.labels import functional_run_reason
from liger_gen.files import read_capped_text, write_results
from liger_gen.optional import install_hint

SCHEMA_VERSION = 1
MAX_RESULT_BYTES = 16 * 2**20  # a result file is ~100 kB (the committed H200 runs of every op: 90 to 120 kB)
SPEEDUP_PEERS = ("torch-compile", "liger-kernel")
REQUIRED = {
    "": ("schema", "benchmark", "meta", "config", "ops", "results"),
    "meta": ("gpu", "versions", "command", "date", "ceilings"),
    "config": ("model", "dtype", "ops", "providers"),
    "result": ("op", "provider", "status"),
}


class ReportError(ValueError):
    """A result dict or file that does not follow the schema; the message names what is missing or wrong."""


# ------------------------------------------------------------------------------------------------ pure metrics


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia_h200"`` (file names)."""
    return re.sub(r"[^a-z0-9]+", "_", str(name).lower()).strip("_") or "gpu"


def gb_per_s(nbytes: float, ms: float | None) -> float | None:
    """Bytes over milliseconds in GB/s (1 GB = 1e9 bytes); None for a missing or non-positive time."""
    if ms is None or not math.isfinite(ms) or ms <= 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def tflop_per_s(flops: float, ms: float | None) -> float | None:
    """Flops over milliseconds in TFLOP/s; None for a missing or non-positive time."""
    if ms is None or not math.isfinite(ms) or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def max_rel_err(errors: dict | None) -> float | None:
    """The largest relative error; NaN if any is NaN (``max`` would drop it depending on order)."""
    vals = [v for v in (errors or {}).values() if v is not None]
    if not vals:
        return None
    if any(isinstance(v, float) and math.isnan(v) for v in vals):
        return float("nan")
    return max(vals)


def speed_of_light_ms(op_info: dict, ceilings: dict) -> float | None:
    """The op's time at the run's ceilings: max(bytes / copy bandwidth, flops / matmul rate), in ms."""
    times = []
    copy = (ceilings.get("copy") or {}).get("gbps")
    if copy and op_info.get("bytes"):
        times.append(op_info["bytes"] / (copy * 1e9) * 1e3)
    mm = (ceilings.get("matmul") or {}).get("tflops")
    if mm and op_info.get("flops"):
        times.append(op_info["flops"] / (mm * 1e12) * 1e3)
    return max(times) if times else None


def derive(data: dict) -> dict:
    """Fill in the metrics that follow from the measured ones (idempotent; returns ``data``).

    Per result with a kernel time: GB/s and % of the copy ceiling from the op's minimal bytes; TFLOP/s and %
    of the matmul ceiling for ops with flops; ``max_rel_err``; and ``speedup[peer] = {kernel, wall}``, the peer's
    time over this provider's, for the peers in ``SPEEDUP_PEERS`` measured on the same op. Per op: ``sol_ms``.
    """
    ceilings = data.get("meta", {}).get("ceilings", {})
    copy = (ceilings.get("copy") or {}).get("gbps")
    mm = (ceilings.get("matmul") or {}).get("tflops")
    ops = data.get("ops", {})
    for op, info in ops.items():
        info["sol_ms"] = speed_of_light_ms(info, ceilings)
    by_key = {(r["op"], r["provider"]): r for r in data.get("results", [])}
    for res in data.get("results", []):
        info = ops.get(res["op"], {})
        kernel_ms = (res.get("kernel") or {}).get("ms")
        if "rel_err" in res:
            res["max_rel_err"] = max_rel_err(res["rel_err"])
        if kernel_ms is None:
            continue
        res["gbps"] = gb_per_s(info.get("bytes", 0), kernel_ms) if info.get("bytes") else None
        res["pct_copy"] = 100.0 * res["gbps"] / copy if res["gbps"] is not None and copy else None
        res["tflops"] = tflop_per_s(info["flops"], kernel_ms) if info.get("flops") else None
        res["pct_matmul"] = 100.0 * res["tflops"] / mm if res["tflops"] is not None and mm else None
        speedup = {}
        for peer in SPEEDUP_PEERS:
            other = by_key.get((res["op"], peer))
            if other is None or other is res:
                continue
            peer_kernel = (other.get("kernel") or {}).get("ms")
            entry = {"kernel": peer_kernel / kernel_ms if peer_kernel and kernel_ms > 0 else None,
                     "wall": (other["wall_ms"] / res["wall_ms"]
                              if other.get("wall_ms") and res.get("wall_ms") else None)}
            if entry["kernel"] is not None or entry["wall"] is not None:
                speedup[peer] = entry
        res["speedup"] = speedup
    data.setdefault("meta", {}).setdefault("warnings", [])
    _add_warnings(data)
    return data


def _add_warnings(data: dict) -> None:
    """Warnings a reader must see: wrong results, liger-gen without a tuned entry, degraded flush removal."""
    found = data["meta"]["warnings"]
    tol = {op: info.get("tolerance") for op, info in data.get("ops", {}).items()}
    for res in data.get("results", []):
        where = f"{res['op']} {res['provider']}"
        msgs = []
        if res.get("correct") is False:
            bad = ", ".join(f"{k} {v:.2e}" for k, v in res.get("rel_err", {}).items()
                            if not (v <= (tol.get(res["op"]) or 0)))
            msgs.append(f"{where}: WRONG, relative error above {tol.get(res['op'])}: {bad}")
        src = (res.get("lookup") or {}).get("source")
        if res["provider"] == "liger-gen" and src == "heuristic" and data.get("meta", {}).get("device") == "cuda":
            msgs.append(f"{where}: no tuned table entry for this GPU (config source 'heuristic'); it equals "
                        f"liger-gen-heuristic")
        method = (res.get("kernel") or {}).get("method")
        if method == "subtract-flush-mean":
            msgs.append(f"{where}: L2 flush removed by subtracting its mean time (a provider kernel shares the "
                        f"flush's name): mean, not median")
        found.extend(m for m in msgs if m not in found)


def failures(data: dict, providers: tuple[str, ...] = ("liger-gen", "liger-gen-heuristic")) -> list[str]:
    """'op provider: why' for each result of ``providers`` that errored or is flagged wrong."""
    out = []
    for res in data.get("results", []):
        if res["provider"] not in providers:
            continue
        if res["status"] != "ok":
            out.append(f"{res['op']} {res['provider']}: {res['status']}")
        elif res.get("correct") is False:
            out.append(f"{res['op']} {res['provider']}: wrong (max relative error {res.get('max_rel_err'):.3g})")
    for op, info in data.get("ops", {}).items():
        if info.get("error"):
            out.append(f"{op}: {info['error']}")
    return out


# ------------------------------------------------------------------------------------------------ JSON


def validate(data: Any) -> dict:
    """``data`` if it follows the schema; ReportError naming the first missing or wrong field otherwise."""
    if not isinstance(data, dict):
        raise ReportError(f"a bench result must be a JSON object, got {type(data).__name__}")
    for key in REQUIRED[""]:
        if key not in data:
            raise ReportError(f"bench result: missing top-level field {key!r}")
    if data["schema"] != SCHEMA_VERSION:
        raise ReportError(f"bench result: schema {data['schema']!r} is not {SCHEMA_VERSION}")
    for section in ("meta", "config"):
        if not isinstance(data[section], dict):
            raise ReportError(f"bench result: {section!r} must be an object, got {type(data[section]).__name__}")
        for key in REQUIRED[section]:
            if key not in data[section]:
                raise ReportError(f"bench result: missing field {section}.{key}")
    if not isinstance(data["results"], list) or not isinstance(data["ops"], dict):
        raise ReportError("bench result: 'results' must be a list and 'ops' an object")
    for i, res in enumerate(data["results"]):
        if not isinstance(res, dict):
            raise ReportError(f"bench result: results[{i}] must be an object, got {type(res).__name__}")
        for key in REQUIRED["result"]:
            if key not in res:
                raise ReportError(f"bench result: results[{i}] has no {key!r}")
        if not isinstance(res["op"], str):
            raise ReportError(f"bench result: results[{i}].op must be a string, got {type(res['op']).__name__}")
        if res["op"] not in data["ops"]:
            raise ReportError(f"bench result: results[{i}] names op {res['op']!r}, which 'ops' does not describe")
    return data


def write_json(data: dict, path: str | Path) -> Path:
    """Write ``data`` (validated) as indented JSON; NaN is written as JSON's ``NaN`` (Python reads it back).
    ``liger_gen.files.ResultsNotWritten`` if ``path`` cannot be written: the JSON is then in a temporary file the
    message names (or printed, if none can be made)."""
    return write_results(path, json.dumps(validate(data), indent=2, default=str) + "\n")


def load_json(path: str | Path) -> dict:
    """Read and validate a result file: a regular file of at most MAX_RESULT_BYTES (never blocking on a FIFO);
    ReportError names the file and what is wrong with it."""
    path = Path(path)
    try:
        text = read_capped_text(path, MAX_RESULT_BYTES, "bench result")
    except OSError as exc:
        raise ReportError(f"cannot read bench result {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # not a regular file, too large, not UTF-8: the message names the file
        raise ReportError(str(exc)) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"cannot read bench result {path}: {exc}") from exc
    except RecursionError:  # arrays or objects nested past Python's stack
        raise ReportError(f"cannot read bench result {path}: nested deeper than this reader can parse") from None
    try:
        return validate(data)
    except ReportError as exc:
        raise ReportError(f"{path}: {exc}") from None


def default_stem(data: dict) -> str:
    """``bench_<model>_<gpu slug>`` (e.g. ``bench_llama3-8b_nvidia_h200``): the file name, without suffix, of a
    run's JSON and PNG."""
    model = re.sub(r"[^A-Za-z0-9.-]+", "_", str(data["config"]["model"].get("name", "model"))).strip("_") or "model"
    return f"bench_{model}_{data['meta'].get('gpu_slug') or gpu_slug(data['meta']['gpu'])}"


# ------------------------------------------------------------------------------------------------ tables

COLUMNS = ("op", "provider", "kernel ms", "wall ms", "host ms", "peak MiB", "rate", "% SOL", "vs compile",
           "vs liger", "max rel err", "config")
STATUS_WIDTH = 40  # a provider's status in the tables is cut to this (the JSON keeps all of it)
RIGHT = {"kernel ms", "wall ms", "host ms", "peak MiB", "rate", "% SOL", "vs compile", "vs liger", "max rel err"}


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _rate(value: float | None) -> str:
    """Three significant digits below 100 (CPU runs, tiny shapes), thousands separators above."""
    if value is None:
        return "-"
    return _fmt(value, ",.0f") if abs(value) >= 100 else _fmt(value, ".3g")


def table_rows(data: dict) -> list[dict[str, str]]:
    """One row of formatted cells per result (shared by the terminal table and the markdown).

    ``rate`` is GB/s for memory-bound ops and TFLOP/s for ops with flops; ``% SOL`` is the matching share of
    the copy or matmul ceiling. ``vs compile`` / ``vs liger`` are kernel-time speed-ups. A result above its
    tolerance gets "WRONG" after its error; a provider that did not run shows its status in place of numbers.
    A functional run (``functional_note``: the CPU) shows no rate and no % SOL: its times are the interpreter's or
    plain PyTorch's on the host, which no GPU ceiling measures.
    """
    functional = functional_note(data) is not None
    rows = []
    for res in data.get("results", []):
        timing = res.get("kernel") or {}
        speed = res.get("speedup") or {}
        flops = res.get("tflops") is not None
        err = _fmt(res.get("max_rel_err"), ".1e")
        if res.get("correct") is False:
            err += " WRONG"
        peak = res.get("peak_extra_bytes")
        lookup = res.get("lookup") or {}
        row = {
            "op": res["op"],
            "provider": res["provider"],
            "kernel ms": _fmt(timing.get("ms"), ".4f"),
            "wall ms": _fmt(res.get("wall_ms"), ".4f"),
            "host ms": _fmt(res.get("host_overhead_ms"), ".4f"),
            "peak MiB": _fmt(peak / 2**20 if peak is not None else None, ",.1f"),
            "rate": "-" if functional else (_rate(res.get("tflops")) + " TFLOP/s") if flops else
                    (_rate(res.get("gbps")) + " GB/s" if res.get("gbps") is not None else "-"),
            "% SOL": "-" if functional else _fmt(res.get("pct_matmul") if flops else res.get("pct_copy"), ".1f"),
            "vs compile": _fmt((speed.get("torch-compile") or {}).get("kernel"), ".2f", "-"),
            "vs liger": _fmt((speed.get("liger-kernel") or {}).get("kernel"), ".2f", "-"),
            "max rel err": err,
            "config": (lookup.get("source", "-") + (" (nearest dims)" if lookup.get("tuned_at") else ""))
                      if isinstance(lookup, dict) else "-",
        }
        for key in ("vs compile", "vs liger"):
            if row[key] != "-":
                row[key] += "x"
        status = res.get("status", "ok")
        if status != "ok":
            row["kernel ms"] = status if len(status) <= STATUS_WIDTH else status[:STATUS_WIDTH - 1] + "\u2026"
        rows.append(row)
    return rows


def title(data: dict) -> str:
    meta, cfg = data.get("meta", {}), data.get("config", {})
    ceil = meta.get("ceilings", {})
    return (f"{cfg.get('model', {}).get('name', '?')} ops, forward + backward (forward alone where no gradient "
            f"flows), {cfg.get('dtype', '?')}, "
            f"{meta.get('gpu', '?')} (copy {_rate((ceil.get('copy') or {}).get('gbps'))} GB/s, matmul "
            f"{_rate((ceil.get('matmul') or {}).get('tflops'))} TFLOP/s)")


def functional_note(data: dict) -> str | None:
    """Why the run's times are not performance (a CPU run: ``liger_gen.bench.labels``), or None. Results written
    before the field existed are judged by their device."""
    if data.get("functional_run_reason"):
        return str(data["functional_run_reason"])
    meta = data.get("meta", {})
    if "functional_run" not in data and meta.get("device") == "cpu":
        return functional_run_reason("cpu", bool(meta.get("triton_interpret")))
    return None


def print_table(data: dict, console=None) -> None:
    """The warnings, then the result table (rich; the CLI prints it last)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:  # piped into a log rich assumes 80 columns and squeezes the table
        console = Console() if sys.stdout.isatty() else Console(width=200)
    for w in data.get("meta", {}).get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False)
    note = functional_note(data)
    table = Table(title=title(data) + (" — functional run, not performance" if note else ""),
                  caption=escape(note) if note else None)
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in RIGHT else "left", no_wrap=True)
    for row in table_rows(data):
        table.add_row(*(escape(row[c]) for c in COLUMNS))
    console.print(table)


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(data: dict) -> str:
    """A markdown section (heading, how it was measured, one table, per-op shapes and notes, warnings)."""
    meta, cfg = data.get("meta", {}), data.get("config", {})
    versions = meta.get("versions", {})
    ceil = meta.get("ceilings", {})
    copy, mm = ceil.get("copy") or {}, ceil.get("matmul") or {}
    git = meta.get("git") or {}
    lines = [f"# {cfg.get('model', {}).get('name', '?')} ops on {meta.get('gpu', '?')}", ""]
    if functional_note(data):
        lines += [f"**{_md(functional_note(data))}.**", ""]
    lines.append(f"- date: {meta.get('date', '?')}; command: `{meta.get('command', '?')}`")
    if git.get("commit"):
        lines.append(f"- liger-gen commit: {str(git['commit'])[:12]}"
                     f"{' (with uncommitted changes)' if git.get('dirty') else ''}")
    lines.append("- versions: " + ", ".join(f"{k} {v if v is not None else 'not installed'}"
                                            for k, v in versions.items()))
    lines.append(f"- dtype {cfg.get('dtype', '?')}; model dims: "
                 + ", ".join(f"{k} {v}" for k, v in cfg.get("model", {}).items() if k != "name"))
    lines.append(f"- ceilings measured in this run: copy {_rate(copy.get('gbps'))} GB/s (device-to-device "
                 f"copy of {_fmt((copy.get('bytes') or 0) / 2**30, '.2f')} GiB, read + written bytes / median time); "
                 f"matmul {_rate(mm.get('tflops'))} TFLOP/s (torch.mm {mm.get('n', '?')}³ "
                 f"{mm.get('dtype', '')})")
    if meta.get("device") == "cpu":
        lines.append("- device: CPU (kernel ms = host-clock median of one forward + backward; no flush, no memory)")
    else:
        lines.append(f"- kernel ms: summed device kernel time of one forward + backward (torch.profiler), L2 "
                     f"flushed before each of {cfg.get('iters', '?')} iterations, flush excluded; median")
    lines.append("- wall ms: back-to-back calls / n (no flush); host ms = max(0, wall − kernel); peak MiB: "
                 "max_memory_allocated during one forward + backward minus allocated before it (outputs, saved "
                 "tensors, workspaces and gradients count; inputs and upstream gradients do not)")
    lines.append("- rate: minimal bytes / kernel time (GB/s), or flops / kernel time (TFLOP/s) for ops with a "
                 "GEMM; % SOL: share of the copy or matmul ceiling; vs compile / vs liger: kernel-time speed-up "
                 "over torch-compile / liger-kernel; max rel err: largest relative L2 error of an output or "
                 "gradient against float64 (WRONG above the dtype's tolerance); config: liger-gen's table source")
    lines.append("")
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join("---:" if c in RIGHT else "---" for c in COLUMNS) + "|")
    for row in table_rows(data):
        lines.append("| " + " | ".join(_md(row[c]) for c in COLUMNS) + " |")
    lines += ["", "| op | dims | minimal bytes | flops | float64 reference |", "|---|---|---|---|---|"]
    for op, info in data.get("ops", {}).items():
        dims = ", ".join(f"{k} {v}" for k, v in info.get("dims", {}).items())
        ref = info.get("reference_error") or info.get("error") or f"{_fmt(info.get('reference_s'), '.1f')} s"
        flops = f"{info['flops']:.3e} ({info.get('flops_formula', '')})" if info.get("flops") else "-"
        nbytes = f"{_fmt(info.get('bytes'), ',')} ({info.get('bytes_formula', '')})"
        lines.append(f"| {_md(op)} | {_md(dims)} | {_md(nbytes)} | {_md(flops)} | {_md(ref)} |")
    notes = {}
    for res in data.get("results", []):
        if res.get("note") and res["provider"] not in ("liger-gen", "liger-gen-heuristic"):
            notes.setdefault(f"{res['provider']}: {res['note']}", []).append(res["op"])
    if notes:
        lines += ["", "Providers:", ""]
        lines += [f"- {_md(note)} ({', '.join(ops)})" for note, ops in notes.items()]
    not_run = [res for res in data.get("results", []) if res.get("status", "ok") != "ok"]
    if not_run:
        lines += ["", "Not run:", ""]
        lines += [f"- {_md(res['op'])} {_md(res['provider'])}: {_md(res['status'])}" for res in not_run]
    if meta.get("warnings"):
        lines += ["", "Warnings:", ""]
        lines += [f"- {_md(w)}" for w in meta["warnings"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ plot


def plot_title(data: dict, normalise: str = "ceiling") -> str:
    """The plot's title: the run, whether it is a functional run (``functional_note``), what 1 means."""
    note = ("1 = minimal bytes at the copy ceiling (flops at the matmul ceiling for FLCE); lower is better"
            if normalise == "ceiling" else "1 = torch.compile; lower is better")
    functional = functional_note(data)
    return title(data) + "\n" + (f"{functional}\n" if functional else "") + note


def plot(data: dict, path: str | Path, normalise: str = "ceiling") -> Path | None:
    """Bar chart of kernel time per op (one bar per provider) as a PNG; None, with a warning, without matplotlib.

    normalise: "ceiling" — kernel time over the op's speed-of-light time at the run's ceilings (1 = the
    ceiling; lower is better); "torch-compile" — over torch-compile's kernel time on the same op (ops without
    it are left out). ValueError for anything else, or when no result can be drawn.
    """
    if normalise not in ("ceiling", "torch-compile"):
        raise ValueError(f"normalise must be 'ceiling' or 'torch-compile', got {normalise!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(f"matplotlib is not installed: no PNG written; {install_hint('matplotlib')}, or pip install "
                      "matplotlib", stacklevel=2)
        return None
    ops = list(data.get("ops", {}))
    providers = [p for p in data.get("config", {}).get("providers", [])
                 if any(r["provider"] == p and (r.get("kernel") or {}).get("ms") for r in data["results"])]
    kernel = {(r["op"], r["provider"]): (r.get("kernel") or {}).get("ms") for r in data.get("results", [])}
    base = {}
    for op in ops:
        if normalise == "ceiling":
            base[op] = data["ops"][op].get("sol_ms")
        else:
            base[op] = kernel.get((op, "torch-compile"))
    ops = [op for op in ops if base.get(op)]
    if not ops or not providers:
        raise ValueError("no result with a kernel time to plot")
    fig, ax = plt.subplots(figsize=(max(8.0, 0.28 * len(ops) * len(providers) + 2.0), 5.0), dpi=120)
    width = 0.8 / len(providers)
    ratios = []
    for i, prov in enumerate(providers):
        xs, ys = [], []
        for j, op in enumerate(ops):
            ms = kernel.get((op, prov))
            if ms:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(ms / base[op])
        bars = ax.bar(xs, ys, width=width, label=prov)
        ax.bar_label(bars, fmt="%.2g", fontsize=5, rotation=90, padding=2)
        ratios += ys
    log = max(ratios) / min(ratios) > 20  # eager providers can sit 10x+ above the ceiling: keep the rest readable
    if log:
        ax.set_yscale("log")
    ax.set_ylim(top=max(ratios) * (4.0 if log else 1.2))  # room for the bar labels
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(ops, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("kernel time / speed-of-light time" if normalise == "ceiling" else
                  "kernel time / torch-compile kernel time", fontsize=8)
    ax.set_title(plot_title(data, normalise), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", ncol=min(len(providers), 3))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
