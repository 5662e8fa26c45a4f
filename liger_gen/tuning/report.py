"""Terminal output of tuning (printing only): the end-of-run summary of gains over the heuristic, and the table
listings of ``liger-gen show`` (rich). The console is ``console``; ``driver.run_tuning`` prints its progress there."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.table import Table
from rich.text import Text

from liger_gen.console import output_console
from liger_gen.runtime.tables import entry_sort_key

console = output_console()  # a terminal's width, else no wrapping (logs: no number folded)

#: The issue's acceptance: median gain over the heuristic of at least 10%, no tuned entry slower.
TARGET_MEDIAN_GAIN = 0.10


def print_run_end(result, ops: Sequence[str], *, elapsed: float, pool: Mapping[str, Any] | None = None) -> None:
    """The end of a tuning run (``driver.run_tuning``): shapes tuned and the time taken, what the compile workers did
    (``pool``: ``Tuner.pool_stats()``, None: not printed) and, for the ops of ``result.entries`` in ``ops``' order,
    the gains over the heuristic (``gain_table``, ``gain_verdict``, ``nearest_verdicts``)."""
    console.print(f"tuned {sum(len(e) for e in result.entries.values())} shape(s) of {len(result.entries)} op(s) "
                  f"in {elapsed:.1f} s")
    if pool is not None:
        console.print(f"compile workers: {pool['compiled']} variant(s) compiled ahead ({pool['worker_s']:.1f} s of "
                      f"worker time), {pool['not_started'] + pool['not_sent'] + pool['failed']} compiled at "
                      f"their first launch instead; {pool['waited_s']:.1f} s spent waiting for workers")
    tuned = {op: result.entries[op] for op in ops if result.entries.get(op)}
    summary = gain_summary(tuned)
    if summary["rows"]:
        console.print(gain_table(summary))
        console.print(gain_verdict(summary))
        for line in nearest_verdicts(tuned):
            console.print(line)


def gain_summary(results: Mapping[str, Sequence[dict]]) -> dict[str, Any]:
    """Tuned vs heuristic for every entry of ``results`` (op → table entries), from the re-timed medians.

    Per entry the phases' times are added (forward + backward, ms); ``gain`` = heuristic / tuned − 1 (0.10: the
    tuned kernels take 1/1.1 of the heuristic's time). Returns ``{"rows": [{"op", "dtype", "rows", "dims",
    "heuristic_ms", "tuned_ms", "gain", "tuned_gbps", "cut", "method", "nearest_ms", "nearest_dims"}, ...] (ops in
    the given order, entries in table
    order), "median_gain", "min_gain", "max_gain" (None without rows), "slower": rows whose tuned time exceeds
    the heuristic's, "cut": rows whose search the time budget stopped}``. ValueError names an entry without
    positive times."""
    rows = []
    for op, entries in results.items():
        for e in sorted(entries, key=entry_sort_key):
            heur, tuned = entry_times(e)
            if not (tuned is not None and tuned > 0 and (heur is None or heur > 0)):
                raise ValueError(f"gain_summary: {op} entry {e['dtype']}/{_dims(e)}/{e['rows']} has no positive "
                                 f"timing_ms (heuristic {heur}, tuned {tuned})")
            methods = sorted(set(str(m) for m in (e.get("timing_method") or {}).values()))
            near = e.get("nearest") if isinstance(e.get("nearest"), Mapping) else {}
            rows.append({"op": op, "dtype": e["dtype"], "rows": e["rows"], "dims": _dims(e),
                         "nearest_ms": _total(e.get("timing_ms"), "nearest"),
                         "nearest_dims": _dims(near) if isinstance(near.get("dims"), Mapping) else None,
                         "heuristic_ms": heur, "tuned_ms": tuned, "gain": None if heur is None else heur / tuned - 1,
                         "tuned_gbps": _gbps(e, tuned),
                         "cut": any(s.get("cut") for s in (e.get("search") or {}).values()),
                         "method": "+".join(methods) or "?"})
    gains = [r["gain"] for r in rows if r["gain"] is not None]
    return {"rows": rows,
            "median_gain": statistics.median(gains) if gains else None,
            "min_gain": min(gains) if gains else None,
            "max_gain": max(gains) if gains else None,
            "slower": [r for r in rows if r["heuristic_ms"] is not None and r["tuned_ms"] > r["heuristic_ms"]],
            "untimed": [r for r in rows if r["heuristic_ms"] is None],
            "cut": [r for r in rows if r["cut"]]}


def entry_times(entry: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(heuristic ms, tuned ms) of a table entry, forward + backward; None where a phase has no number (a
    heuristic that could not be re-timed is recorded as null, and a hand-edited table may hold anything)."""
    timing = entry.get("timing_ms")
    return _total(timing, "heuristic"), _total(timing, "tuned")


def _total(timing: Any, key: str) -> float | None:
    """Forward + backward ms of ``key`` (heuristic, tuned, nearest) in an entry's ``timing_ms``; None where a
    phase has no number."""
    if not isinstance(timing, Mapping) or not timing:
        return None
    values = [_number(t.get(key)) if isinstance(t, Mapping) else None for t in timing.values()]
    return None if any(v is None for v in values) else sum(values)


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, a bool, NaN/inf, or an int too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _gbps(entry: Mapping[str, Any], tuned_ms: float | None) -> float | None:
    moved = entry.get("bytes")
    if not tuned_ms or not isinstance(moved, Mapping):
        return None
    values = [_number(v) for v in moved.values()]
    if any(v is None for v in values):
        return None
    seconds = tuned_ms * 1e-3
    if not seconds > 0:  # a subnormal time underflows to 0
        return None
    return sum(values) / seconds / 1e9


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def gain_table(summary: dict[str, Any]) -> Table:
    """The rows of ``gain_summary`` as a rich table."""
    table = Table(title="tuned vs heuristic: re-timed medians, forward + backward kernel time")
    nearest = any(r.get("nearest_dims") for r in summary["rows"])
    for col in ("op", "dtype", "rows", "dims", "heuristic ms", "tuned ms", "gain", "tuned GB/s", "timing",
                "budget cut", *(("nearest tuned dims", "its ms") if nearest else ())):
        table.add_column(col, justify="right", overflow="fold")
    for r in summary["rows"]:
        near = (r.get("nearest_dims") or "", "" if not r.get("nearest_dims") else _ms(r.get("nearest_ms")))
        table.add_row(*_cells(r["op"], r["dtype"], r["rows"], r["dims"], _ms(r["heuristic_ms"]), _ms(r["tuned_ms"]),
                              "n/a" if r["gain"] is None else f"{100 * r['gain']:+.1f}%",
                              "" if r["tuned_gbps"] is None else f"{r['tuned_gbps']:,.0f}", r["method"],
                              "yes" if r["cut"] else "", *(near if nearest else ())))
    return table


def nearest_verdicts(results: Mapping[str, Sequence[dict]]) -> list[str]:
    """Per op whose new entries timed the config tuned at the nearest other dims: how it did against the
    heuristic (``tables.nearest_evidence`` of these entries) and whether that alone would let the runtime use
    neighbouring entries for the op's missing dims (``tables.nearest_allowed``; the runtime weighs the whole
    table)."""
    from liger_gen.runtime import tables

    lines = []
    for op, entries in results.items():
        count, ratio = tables.nearest_evidence({"entries": list(entries)})
        if count:
            allowed = tables.nearest_allowed({"entries": list(entries)})
            lines.append(f"{op}: at {count} new shapes the config tuned at the nearest other dims took "
                         f"{ratio:.3f}x the heuristic's time (geometric mean): "
                         + ("enough to stand in for dims without an entry" if allowed else
                            "not enough to stand in for dims without an entry"))
    return lines


def gain_verdict(summary: dict[str, Any]) -> str:
    """One line: median gain (and range) against the 10% target, and whether any tuned entry is slower."""
    if not summary["rows"]:
        return "no tuned entries"
    untimed = summary.get("untimed") or []
    note = (f"; {len(untimed)} entries whose heuristic could not be re-timed (no gain known)" if untimed else "")
    med = summary["median_gain"]
    if med is None:
        return f"no entry has a re-timed heuristic to compare with{note}"
    verdict = "meets" if med >= TARGET_MEDIAN_GAIN and not summary["slower"] else "misses"
    timed = len(summary["rows"]) - len(untimed)
    return (f"median gain over the heuristic {100 * med:+.1f}% over {timed} entries (range "
            f"{100 * summary['min_gain']:+.1f}% to {100 * summary['max_gain']:+.1f}%); "
            f"{len(summary['slower'])} tuned entries slower than the heuristic; {len(summary['cut'])} searches cut "
            f"by the time budget{note}; {verdict} the target (median >= {100 * TARGET_MEDIAN_GAIN:.0f}%, none slower)")


def _dims(entry: dict) -> str:
    """'n_cols=4096' / 'hidden=4096 vocab=128256': an entry's feature dims and variant options, short (plain text:
    callers escape it)."""
    parts = [f"{k}={v}" for k, v in entry["dims"].items()]
    parts += [f"{k}={v}" for k, v in sorted(entry.get("variant", {}).items())]
    return " ".join(parts)


def summary_table(op: str, entries: list[dict]) -> Table:
    """Shape, heuristic ms, tuned ms, speed-up and GB/s (forward + backward) for each tuned entry."""
    table = Table(title=Text(f"{safe_text(op)}: forward + backward kernel time (re-timed medians, L2 flushed)"))
    for col in ("dtype", "rows", "dims", "heuristic ms", "tuned ms", "speed-up", "tuned GB/s"):
        table.add_column(col, justify="right", overflow="fold")
    for e in sorted(entries, key=entry_sort_key):
        heur, tuned = entry_times(e)
        gbps = _gbps(e, tuned)
        table.add_row(*_cells(e["dtype"], e["rows"], _dims(e), _ms(heur), _ms(tuned),
                              f"{heur / tuned:.2f}x" if heur and tuned else "n/a",
                              "n/a" if gbps is None else f"{gbps:,.0f}"))
    return table


def median_gain(entries: Sequence[Any]) -> float | None:
    """The median of heuristic / tuned - 1 (forward + backward) over the entries timed both ways; None without
    one (lenient, for ``show``'s summary: an entry without positive times is left out, never an error)."""
    gains = []
    for e in entries:
        heur, tuned = entry_times(e) if isinstance(e, Mapping) else (None, None)
        if heur is not None and tuned is not None and heur > 0 and tuned > 0:
            gains.append(heur / tuned - 1)
    return statistics.median(gains) if gains else None


def _summary_line(path: Path, source: str, table: Mapping[str, Any], status: str, in_use: bool,
                  compiled: Mapping[str, int]) -> Text:
    """``show``'s line for one table file: op, shapes tuned, median gain over the heuristic, compiled kernels
    present, in use here or why not (plain text: ``safe_text``)."""
    entries = table.get("entries") or []
    gain = median_gain(entries)
    kernels = compiled.get(table["op"], 0)
    line = Text()
    line.append(safe_text(table["op"]), style="bold")
    line.append(safe_text(f": {len(entries)} shape(s) tuned; median gain over the heuristic "
                          + ("n/a" if gain is None else f"{100 * gain:+.1f}%")
                          + (f"; {kernels} compiled kernel(s) usable here" if kernels else
                             "; no compiled kernels usable here (compiled at first use)")
                          + f"; {source} {path.name}: "))
    line.append(safe_text(status), style="green" if in_use else "yellow")
    return line


def show_tables(gpu: str, specs: Sequence[Any], *, show_trials: bool = False,
                ops: Sequence[str] | None = None, detail: bool = False,
                compiled: Mapping[str, int] | None = None) -> bool:
    """Print every table found for ``gpu`` in the lookup order, judged against the op ``specs`` of this
    installation (a table of another op is listed as not used); False if none was found. By default one line per
    table file (``_summary_line``: op, shapes tuned, median gain, compiled kernels, in use or why not);
    ``detail``: each table's header line, its times and its configs. ``show_trials`` (implies ``detail``): also
    list each entry's trials, read from the trial log beside the table. ``ops``: only the tables of these ops
    (their file names), None for all. ``compiled``: usable compiled kernels per op, for the summary lines (the
    caller counts them as ``liger-gen verify`` does: ``liger_gen.verify.compiled_kernels_per_op``).

    Everything read from a table is printed as plain text: rich markup in it is not interpreted and terminal
    control characters are replaced (``safe_text``), so a table can neither break the listing nor drive the
    terminal."""
    from liger_gen.runtime import tables

    spaces = {spec.name: spec.space for spec in specs}
    detail = detail or show_trials
    compiled = compiled or {}
    found = False
    for source, root in tables.table_roots():
        folder = Path(root) / gpu
        try:
            paths = [p for p in tables.table_files(folder) if ops is None or p.stem in ops]
        except OSError as exc:
            console.print(Text(f"cannot list {safe_text(folder)}: {type(exc).__name__}: {safe_text(exc)}", style="red"))
            continue
        for path in paths:
            found = True
            try:
                table = tables.load_table(path, spaces.get(path.stem))
            except tables.TableError as exc:
                console.print(Text(safe_text(exc), style="red"))
                continue
            status, reasons = _status(path, table, spaces, gpu)
            if not detail:
                console.print(_summary_line(path, source, table, status, not reasons, compiled))
                continue
            line = Text()
            line.append(safe_text(path), style="bold")
            line.append(f" ({source}) — {safe_text(table.get('device_name', '?'))}, Triton "
                        f"{safe_text(table['triton_version'])}, torch {safe_text(table.get('torch_version', '?'))}, "
                        f"created {safe_text(table.get('created', '?'))}; ")
            line.append(safe_text(status), style="green" if not reasons else "yellow")
            console.print(line)
            if table["entries"] and "timing_ms" in table["entries"][0]:
                console.print(summary_table(safe_text(table["op"]), table["entries"]))
            cfg = Table(title="configs")
            cfg.add_column("dtype"), cfg.add_column("rows"), cfg.add_column("dims", overflow="fold")
            cfg.add_column("config", overflow="fold")
            for e in table["entries"]:
                cfg.add_row(*_cells(e["dtype"], e["rows"], _dims(e),
                                    " ".join(f"{k}={v}" for k, v in sorted(e["config"].items()))))
            console.print(cfg)
            if show_trials:
                for e in tables.with_trials(path, table)["entries"]:
                    trials = e.get("trials")
                    for phase, records in (trials.items() if isinstance(trials, dict) else ()):
                        console.print(Text(safe_text(f"{e['dtype']} {e['rows']} {_dims(e)} {phase}: " + ", ".join(
                            _trial_text(r) for r in (records if isinstance(records, list) else ())))))
    if found and not detail:
        console.print(Text(f"each table's times and configs: liger-gen show --gpu {safe_text(gpu)}"
                           + (f" --ops {','.join(ops)}" if ops else "") + " --detail"))
    if not found:
        if ops and gpu in tables.gpus_with_tables(spaces):  # the GPU has tables, none of the ops asked for
            message = (f"no tuned table of {', '.join(ops)} for {gpu!r} in any folder looked up: "
                       f"{'it runs its' if len(ops) == 1 else 'they run their'} heuristic there")
        else:
            message = tables.no_tables_message(gpu, spaces)
        console.print(Text(safe_text(message) + "; looked up: "
                           + ", ".join(safe_text(r) for _, r in tables.table_roots())))
    return found


def _status(path: Path, table: Mapping[str, Any], spaces: Mapping[str, Any], gpu: str) -> tuple[str, list[str]]:
    """"in use" (with a Triton mismatch noted) or "not used: why", and the reasons it is not used."""
    from liger_gen.runtime import tables

    spec = spaces.get(table["op"])
    reasons = (tables.foreign_reasons(table, space=spec, gpu=gpu) if spec is not None
               else [f"op {table['op']!r} is not one of this installation's ops"])
    if path.name != f"{table['op']}.json":
        reasons.append(f"the runtime reads only {table['op']}.json")
    mismatch = tables.triton_mismatch(table) if not reasons else None
    status = "not used: " + "; ".join(reasons) if reasons else (
        f"in use ({mismatch}; ${tables.STRICT_TABLES_ENV}=1 would refuse it)" if mismatch else "in use")
    return status, reasons


def table_summaries(gpu: str, specs: Sequence[Any], *, ops: Sequence[str] | None = None,
                    compiled: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """``show``'s summary lines as records (``liger-gen show --json``), one per table file found for ``gpu`` in
    the lookup order: ``op``, ``path``, ``source``, ``shapes_tuned``, ``median_gain`` (heuristic / tuned - 1,
    None when no entry was timed both ways), ``compiled_kernels``, ``in_use``, ``status``, ``error`` (a file that
    cannot be read or a folder that cannot be listed: the other fields are None)."""
    from liger_gen.runtime import tables

    spaces = {spec.name: spec.space for spec in specs}
    compiled = compiled or {}
    out: list[dict[str, Any]] = []
    blank = dict.fromkeys(("op", "shapes_tuned", "median_gain", "compiled_kernels", "in_use", "status"))
    for source, root in tables.table_roots():
        folder = Path(root) / gpu
        try:
            paths = [p for p in tables.table_files(folder) if ops is None or p.stem in ops]
        except OSError as exc:
            out.append({**blank, "path": str(folder), "source": source, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for path in paths:
            try:
                table = tables.load_table(path, spaces.get(path.stem))
            except tables.TableError as exc:
                out.append({**blank, "op": path.stem, "path": str(path), "source": source, "error": str(exc)})
                continue
            status, reasons = _status(path, table, spaces, gpu)
            entries = table.get("entries") or []
            out.append({"op": table["op"], "path": str(path), "source": source, "shapes_tuned": len(entries),
                        "median_gain": median_gain(entries), "compiled_kernels": compiled.get(table["op"], 0),
                        "in_use": not reasons, "status": status, "error": None})
    return out


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def safe_text(value: Any) -> str:
    """``str(value)`` with terminal control characters (ESC, BEL, CR, ...) shown as ``\\xNN`` and characters that
    cannot be encoded (a lone surrogate from a JSON ``\\ud800``) as backslash escapes: table contents are
    printed, never executed by the terminal, and never make printing fail."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _cells(*values: Any) -> list[Text]:
    """Table cells as plain ``Text`` (rich does not parse markup in Text), with control characters replaced."""
    return [Text(safe_text(v)) for v in values]


def _trial_text(record: Any) -> str:
    if not isinstance(record, dict):
        return safe_text(record)
    ms = _number(record.get("ms"))
    timed = f" {ms:.4f}ms" if ms else ""
    return safe_text(f"#{record.get('number', '?')} {record.get('status', '?')}{timed}")
