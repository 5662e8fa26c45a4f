"""SM clock and board power while the GPU was busy, from ``nvidia-smi`` samples taken during a run.

The samples are CSV lines of ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,
utilization.gpu --format=csv,noheader,nounits -lms 100``; only samples at >= 90% utilisation count.

    python benchmarks/clock_summary.py benchmarks/results/h200_2026-12-02/power/clocks_*.csv
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def summary(path: Path) -> str:
    busy = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 5:
            continue
        try:
            clock, power, temp, util = (float(f) for f in fields[1:5])
        except ValueError:
            continue
        if util >= 90:
            busy.append((clock, power, temp))
    if not busy:
        return f"| {path.stem} | 0 | - | - | - | - |"
    clocks = [b[0] for b in busy]
    return (f"| {path.stem} | {len(busy)} | {statistics.median(clocks):.0f} | {min(clocks):.0f} | "
            f"{statistics.median(b[1] for b in busy):.1f} | {max(b[2] for b in busy):.0f} |")


def main() -> None:
    print("| samples | busy samples | SM MHz median | SM MHz min | power W median | max temp C |")
    print("|---|---:|---:|---:|---:|---:|")
    for arg in sys.argv[1:]:
        print(summary(Path(arg)))


if __name__ == "__main__":
    main()
