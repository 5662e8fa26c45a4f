"""The printed report of the training-step benchmark (``liger_gen.bench.step``): the summary table (speed, memory,
loss check, first step, Liger-Kernel's autotune warm-up) and the GPU time per step by kernel class."""

from __future__ import annotations

import sys
from typing import Any

from liger_gen.bench.profile import CLASS_LABELS, KERNEL_CLASSES


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def autotune_cell(r: dict[str, Any]) -> str:
    """The autotune column of a provider's row: the warm-up's seconds (and the autotune entries it added), "-" for a
    provider without one."""
    warm = r.get("autotune_warmup")
    if not warm or warm.get("s") is None:
        return "-"
    tuned = warm.get("kernels_tuned")
    return f"{warm['s']:.1f}" + (f" ({tuned} tuned)" if tuned else "")


def print_step_report(result: dict[str, Any], console=None, fp8_loss_rel_tol: float = 0.01) -> None:
    """Print the summary table (speed, memory, loss check, autotune warm-up) and the kernel-class breakdown with
    ``rich``; ``fp8_loss_rel_tol``: the FP8 providers' loss-curve tolerance, named in the caption.

    Providers that were skipped or failed are listed under the summary with the reason.
    """
    from rich.console import Console
    from rich.table import Table

    # Piped output (logs) gets a width that fits the tables; a terminal keeps its own.
    console = console or Console(width=None if sys.stdout.isatty() else 180)
    meta, s = result["metadata"], result["settings"]
    console.print(f"[bold]Training step[/bold] on {meta['gpu'] or meta['device']}: batch {s['batch_size']} x "
                  f"{s['seq_len']} tokens, {s['dtype']}, AdamW lr {s['lr']:g}"
                  f"{' (liger-gen providers: liger_gen.optim.AdamW)' if s.get('optimizer') == 'liger-gen' else ''}; "
                  f"{s['warmup_steps']} warm-up + "
                  f"{s['steps']} timed + {s['profile_steps']} profiled steps; torch {meta['torch']}, triton "
                  f"{meta['triton']}, transformers {meta['transformers']}, liger-kernel "
                  f"{meta['liger_kernel'] or 'not installed'}")
    functional = result.get("functional_run_reason")
    summary = Table(title="Speed, memory and loss curve" + (" — functional run, not performance" if functional
                                                             else ""),
                    caption=(f"{functional}. " if functional else "") + f"x: tokens/s ratio. loss: |loss - transformers| / transformers at step 1, mean and max "
                            f"over steps; loss check: pass if step 1 and mean <= {s['loss_rel_tol']:.2e} "
                            f"({max(s['loss_rel_tol'], fp8_loss_rel_tol):.0e} for the FP8 providers; ref: the "
                            f"run the others are compared with). 1st s: first step wall "
                            f"time (compile time apart). autotune s: Liger-Kernel's autotune warm-up, one untimed "
                            f"forward + backward before the warm-up steps, in no other column")
    for col in ("model", "provider", "tok/s", "ms/step", "x HF", "x Liger", "peak GiB", "rsvd GiB",
                "loss Δrel 1/mean/max", "loss check", "1st s", "autotune s"):
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
                summary.add_row(model_name, name, *["-"] * 7, r["status"], "-", "-")
                notes.append(f"{model_name} / {name}: {r['status']}: {r['reason']}")
                continue
            check = r.get("loss_check")
            verdict = ("ref" if check is None else "[green]pass[/green]" if check["pass"] else "[red]FAIL[/red]")
            first = fmt(r.get("first_step_s"), ".2f")
            if r.get("compile_s") is not None:
                first += f" ({r['compile_s']:.1f} compile)"
            summary.add_row(model_name, name, fmt(r["tokens_per_s"], ",.0f"), fmt(r["ms_per_step"], ".1f"),
                            fmt(r.get("speedup_vs_transformers"), ".2f"), fmt(r.get("speedup_vs_liger_kernel"), ".2f"),
                            fmt(r.get("peak_allocated_gib"), ".2f"), fmt(r.get("peak_reserved_gib"), ".2f"),
                            "-" if check is None else " / ".join(
                                fmt(check.get(k), ".1e", "nan")
                                for k in ("first_step_rel_diff", "mean_rel_diff", "max_rel_diff")), verdict, first,
                            autotune_cell(r))
            p = r.get("profile")
            if p:
                any_profile = True
                breakdown.add_row(model_name, name, *[f"{p['kernel_ms'][c]:.1f}" for c in KERNEL_CLASSES],
                                  fmt(p["idle_ms"], ".1f"), f"{p['busy_ms']:.1f}")
    console.print(summary)
    for note in notes:
        console.print(f"  {note}", highlight=False)
    if any_profile:
        console.print(breakdown)
