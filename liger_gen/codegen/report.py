"""Terminal front end of tuning: progress bar while tuning, summary and table listings (rich)."""

from __future__ import annotations

from pathlib import Path

import optuna
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from liger_gen.ops import get_op
from liger_gen.codegen.tuner import Tuner, tune_to_table
from liger_gen.runtime.tables import entry_sort_key

console = Console()


def run_tuning(*, ops, model, rows, dtypes, trials, out_root, storage, seed, device, gpu, device_name,
               polish: int | None = None) -> None:
    """Tune ``ops`` at the model's shapes, write one table per op, print a summary."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
    summary = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(f"tuning {model.name} on {device_name}", total=None)
        tuner = Tuner(n_trials=trials, storage=storage, seed=seed, polish_trials=polish,
                      on_trial=lambda: progress.advance(task))
        for op in ops:
            progress.update(task, description=f"tuning {op} for {model.name} on {device_name}")

            def problems(op=op):
                # problems hold their inputs and float64 truth on the GPU: build one at a time, free it after;
                # ops that cap the token count for tuning give the same problem for several rows: tune it once
                seen = set()
                for dtype in dtypes:
                    for r in rows:
                        for problem in get_op(op).tuning_problems(model, [r], dtype, device, seed):
                            if problem.key() in seen:
                                continue
                            seen.add(problem.key())
                            progress.update(task, total=(progress.tasks[0].total or 0)
                                            + (trials + tuner.polish_trials) * len(problem.phases))
                            yield problem
                            del problem
                            torch.cuda.empty_cache()

            path, entries = tune_to_table(op, problems(), Path(out_root), gpu=gpu, device_name=device_name,
                                          compute_capability=cc, tuner=tuner)
            summary.append((op, path, entries))
    for op, path, entries in summary:
        console.print(summary_table(op, entries))
        console.print(f"wrote {path}")


def _dims(entry: dict) -> str:
    """'n_cols=4096' / 'hidden=4096 vocab=128256': an entry's feature dims and variant options, short."""
    parts = [f"{k}={v}" for k, v in entry["dims"].items()]
    parts += [f"{k}={v}" for k, v in sorted(entry.get("variant", {}).items())]
    return " ".join(parts)


def summary_table(op: str, entries: list[dict]) -> Table:
    """Shape, heuristic ms, tuned ms, speed-up and GB/s (forward + backward) for each tuned entry."""
    table = Table(title=f"{op}: forward + backward kernel time (median, L2 flushed)")
    for col in ("dtype", "rows", "dims", "heuristic ms", "tuned ms", "speed-up", "tuned GB/s"):
        table.add_column(col, justify="right", overflow="fold")
    for e in sorted(entries, key=entry_sort_key):
        heur = sum(t["heuristic"] for t in e["timing_ms"].values())
        tuned = sum(t["tuned"] for t in e["timing_ms"].values())
        gbps = sum(e["bytes"].values()) / (tuned * 1e-3) / 1e9 if "bytes" in e else float("nan")
        table.add_row(e["dtype"], str(e["rows"]), _dims(e), f"{heur:.4f}", f"{tuned:.4f}",
                      f"{heur / tuned:.2f}x", f"{gbps:,.0f}")
    return table


def show_tables(gpu: str, *, show_trials: bool = False) -> bool:
    """Print every table found for ``gpu`` in the lookup order; False if none was found."""
    from liger_gen.runtime import tables

    found = False
    for source, root in tables.table_roots():
        folder = Path(root) / gpu
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            found = True
            try:
                table = tables.load_table(path)
            except tables.TableError as exc:
                console.print(f"[red]{exc}[/red]")
                continue
            reasons = tables.foreign_reasons(table, op=table["op"], gpu=gpu)
            status = "[green]in use[/green]" if not reasons else "[yellow]not used: " + "; ".join(reasons) + "[/yellow]"
            console.print(f"[bold]{path}[/bold] ({source}) — {table.get('device_name', '?')}, Triton "
                          f"{table['triton_version']}, torch {table.get('torch_version', '?')}, created "
                          f"{table.get('created', '?')}; {status}")
            if table["entries"] and "timing_ms" in table["entries"][0]:
                console.print(summary_table(table["op"], table["entries"]))
            cfg = Table(title="configs")
            cfg.add_column("dtype"), cfg.add_column("rows"), cfg.add_column("dims", overflow="fold")
            cfg.add_column("config", overflow="fold")
            for e in table["entries"]:
                cfg.add_row(e["dtype"], str(e["rows"]), _dims(e),
                            " ".join(f"{k}={v}" for k, v in sorted(e["config"].items())))
            console.print(cfg)
            if show_trials:
                for e in table["entries"]:
                    for phase, records in e.get("trials", {}).items():
                        console.print(f"{e['dtype']} {e['rows']} {_dims(e)} {phase}: " + ", ".join(
                            f"#{r['number']} {r['status']} {r['ms']:.4f}ms" if r.get("ms") else
                            f"#{r['number']} {r['status']}" for r in records))
    if not found:
        console.print(f"no tuned tables for {gpu!r} in " + ", ".join(str(r) for _, r in tables.table_roots()))
    return found
