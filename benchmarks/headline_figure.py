"""The front page's figure: end-to-end training throughput and peak memory of plain transformers, Liger-Kernel
and liger-gen, drawn from a committed ``liger-gen bench-step`` JSON (no GPU, no new measurement).

Left panel: tokens/s of each provider over plain transformers' tokens/s on the same model (1.0 = transformers).
Right panel: peak ``torch.cuda.max_memory_allocated`` of one training step, GiB. The title names the GPU, the
date and the command recorded in the JSON's metadata.

    python benchmarks/headline_figure.py                       # the current run (BENCHMARKS.md), docs/assets/headline.png
    python benchmarks/headline_figure.py STEP_JSON --out PNG
"""

from __future__ import annotations

import argparse
import json
import shlex
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The current end-to-end run that BENCHMARKS.md quotes ("Training steps"): the final code of 2026-12-04, run G.
DEFAULT_STEP_JSON = ROOT / "benchmarks" / "results" / "h200_2026-12-04" / "one_session" / "run_g" / "step" / "step.json"
DEFAULT_OUT = ROOT / "docs" / "assets" / "headline.png"

PROVIDERS = {"transformers": "transformers", "liger-kernel": "Liger-Kernel", "liger-gen": "liger-gen"}
MODEL_NAMES = {"llama3.2-1b": "Llama-3.2-1B", "qwen2.5-0.5b": "Qwen2.5-0.5B",
               "llama3-8b-4l": "Llama-3-8B width\n(4 layers)", "llama3-8b": "Llama-3-8B"}
COLORS = {"transformers": "#9e9e9e", "liger-kernel": "#4c72b0", "liger-gen": "#dd8452"}


def command_of(metadata: dict) -> str:
    """The recorded command as a user types it: ``liger-gen bench-step ...`` without the machine's --out folder."""
    words = shlex.split(metadata["command"])
    if words and words[0].endswith("cli.py"):
        words[0] = "liger-gen"
    if "--out" in words:
        i = words.index("--out")
        del words[i:i + 2]
    return " ".join(words)


def load(path: Path = DEFAULT_STEP_JSON) -> dict:
    """What the figure plots, straight from a bench-step JSON.

    Returns {"gpu", "date" (YYYY-MM-DD), "command", "step" (dtype and tokens per step), "models": [model key, ...], "rows": [{"model", "provider",
    "tokens_per_s", "vs_transformers", "peak_gib"}, ...]} for the providers in PROVIDERS that ran with status
    "ok". Raises KeyError when a model lacks plain transformers (the panels' reference)."""
    data = json.loads(Path(path).read_text())
    meta = data["metadata"]
    rows, models = [], []
    order = [m for m in data.get("settings", {}).get("models", []) if m in data["models"]]
    for model in order + [m for m in data["models"] if m not in order]:
        entry = data["models"][model]
        runs = {p: r for p, r in entry["providers"].items() if p in PROVIDERS and r.get("status") == "ok"}
        base = runs["transformers"]["tokens_per_s"]
        models.append(model)
        for provider in PROVIDERS:
            if provider in runs:
                r = runs[provider]
                rows.append({"model": model, "provider": provider, "tokens_per_s": r["tokens_per_s"],
                             "vs_transformers": r["tokens_per_s"] / base, "peak_gib": r["peak_allocated_gib"]})
    settings = data["settings"]
    step = f"{settings['dtype'].replace('bfloat16', 'bf16')}, {settings['batch_size']} × {settings['seq_len']} tokens"
    return {"gpu": meta["gpu"], "date": meta["date"][:10], "command": command_of(meta), "step": step,
            "models": models, "rows": rows}


def draw(figure_data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = figure_data["models"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=100)
    width = 0.8 / len(PROVIDERS)
    panels = [("vs_transformers", "tokens/s relative to transformers", "{:.2f}×"),
              ("peak_gib", "peak memory, GiB (lower is better)", "{:.1f}")]
    for ax, (key, label, fmt) in zip(axes, panels):
        for j, provider in enumerate(PROVIDERS):
            xs, ys = [], []
            for i, model in enumerate(models):
                row = next((r for r in figure_data["rows"] if r["model"] == model and r["provider"] == provider), None)
                if row is not None:
                    xs.append(i + (j - (len(PROVIDERS) - 1) / 2) * width)
                    ys.append(row[key])
            bars = ax.bar(xs, ys, width, label=PROVIDERS[provider], color=COLORS[provider])
            ax.bar_label(bars, [fmt.format(y) for y in ys], fontsize=7, padding=1)
        ax.set_xticks(range(len(models)), [MODEL_NAMES.get(m, m) for m in models], fontsize=8)
        ax.set_ylabel(label, fontsize=9)
        ax.spines[["top", "right"]].set_visible(False)
        ax.margins(y=0.12)
    axes[0].axhline(1.0, color="black", linewidth=0.6)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(PROVIDERS), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.94))
    command = "\n".join(textwrap.wrap(figure_data["command"], 130, break_on_hyphens=False))
    fig.suptitle(f"Training step, {figure_data['step']} — {figure_data['gpu']}, {figure_data['date']}", fontsize=11)
    fig.text(0.5, 0.005, command, ha="center", va="bottom", fontsize=6.5, family="monospace")
    fig.tight_layout(rect=(0, 0.07, 1, 0.89))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step_json", nargs="?", type=Path, default=DEFAULT_STEP_JSON)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    figure_data = load(args.step_json)
    draw(figure_data, args.out)
    for r in figure_data["rows"]:
        print(f"{r['model']:14s} {r['provider']:13s} {r['tokens_per_s']:10,.0f} tok/s "
              f"{r['vs_transformers']:.3f}× transformers {r['peak_gib']:6.2f} GiB")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
