"""Summarise the packaged tuned tables of one GPU: per model preset, the entries at its shapes (tuned against
heuristic, the tuners' re-timed medians), per op the nearest-dims evidence the runtime weighs, and per op how far
tuning beat the heuristic the code gives now (entries tuned or refreshed against an older heuristic are
counted apart: their recorded gain is against a rule that no longer runs).

    python benchmarks/tables_summary.py [--gpu h200] [--models qwen2.5-7b,llama3-70b,...]

No GPU needed: it reads the tables' recorded timings (forward + backward kernel ms, CUDA-graph replays, L2
flushed), written by ``liger-gen tune``.
"""

from __future__ import annotations

import argparse
import json
import statistics

from liger_gen.models import PRESETS
from liger_gen.ops import all_specs, get_spec
from liger_gen.runtime import tables
from liger_gen.tuning.report import entry_times


def preset_dims(model) -> dict[str, dict]:
    """op → the dims of its table entries at ``model``."""
    return {spec.name: spec.problem.shape(model) for spec in all_specs()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--models", default=",".join(PRESETS))
    args = parser.parse_args()
    loaded = {}
    for spec in all_specs():
        path = tables.table_path(tables.packaged_root(), args.gpu, spec.name)
        loaded[spec.name] = json.loads(path.read_text()) if path.is_file() else {"entries": []}

    print("| preset | ops with entries | entries | median gain | max gain (op, rows) |")
    print("|---|---:|---:|---:|---|")
    for name in args.models.split(","):
        dims = preset_dims(PRESETS[name])
        gains, ops = [], set()
        for op, want in dims.items():
            for e in loaded[op]["entries"]:
                if e["dims"] == want:
                    heur, tuned = entry_times(e)
                    if heur and tuned:
                        gains.append((heur / tuned - 1, op, e["rows"]))
                        ops.add(op)
        if not gains:
            print(f"| {name} | 0 | 0 | - | - |")
            continue
        best = max(gains)
        print(f"| {name} | {len(ops)} of {len(dims)} | {len(gains)} | "
              f"{100 * statistics.median(g for g, _, _ in gains):+.1f}% | "
              f"{100 * best[0]:+.1f}% ({best[1]}, {best[2]}) |")

    print()
    print("| op | entries | nearest timed | nearest / heuristic (geo. mean) | neighbours stand in |")
    print("|---|---:|---:|---:|---|")
    for op, table in loaded.items():
        space = get_spec(op).space
        count, ratio = tables.nearest_evidence(table, space)
        print(f"| {op} | {len(table['entries'])} | {count} | {'-' if ratio is None else f'{ratio:.4f}'} | "
              f"{'yes' if tables.nearest_allowed(table, space) else 'no'} |")

    print()
    print("| op | entries against the current heuristic | median gain | max gain (dims, rows) | gains >= 1.3x | "
          "entries against an older heuristic |")
    print("|---|---:|---:|---|---:|---:|")
    for op, table in loaded.items():
        space = get_spec(op).space
        current, older = [], 0
        for e in table["entries"]:
            heur, tuned = entry_times(e)
            if not (heur and tuned):
                continue
            if tables._current_heuristic(e, space, None):
                dims = ",".join(str(v) for v in e["dims"].values())
                current.append((heur / tuned, dims, e["rows"]))
            else:
                older += 1
        if not current:
            print(f"| {op} | 0 | - | - | - | {older} |")
            continue
        best = max(current)
        print(f"| {op} | {len(current)} | {100 * (statistics.median(g for g, _, _ in current) - 1):+.1f}% | "
              f"{best[0]:.2f}x ({best[1]}, {best[2]}) | {sum(g >= 1.3 for g, _, _ in current)} | {older} |")


if __name__ == "__main__":
    main()
