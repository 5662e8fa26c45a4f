"""The GEMM kernels that every provider of a ``liger-gen bench-step`` run launched with the same name and call
count (the decoder layers' GEMMs, which no provider changes), and their GPU time per provider.

Reads the profile's top kernels in a step JSON (``liger-gen bench-step --profile-steps 1 --out DIR`` writes
DIR/step.json); the LM head's GEMMs differ between providers (chunked or not) and are left out by construction.

    python benchmarks/step_shared_gemms.py benchmarks/results/h200_2026-12-02/refresh/step_llama3.2-1b.json
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    for path in sys.argv[1:]:
        data = json.load(open(path))
        for model, entry in data["models"].items():
            providers = {p: v for p, v in entry["providers"].items() if v.get("profile")}
            gemms = {p: {t["name"]: t for t in v["profile"]["top_kernels"] if t["class"] == "gemm"}
                     for p, v in providers.items()}
            first = next(iter(gemms.values()))
            shared = [n for n in first
                      if all(n in g and g[n]["calls"] == first[n]["calls"] for g in gemms.values())]
            print(f"{path} {model}")
            print("| kernel | calls | " + " | ".join(f"{p} ms" for p in gemms) + " |")
            print("|---|---:|" + "---:|" * len(gemms))
            for n in shared:
                print(f"| {n} | {first[n]['calls']:.0f} | " + " | ".join(f"{g[n]['ms']:.2f}" for g in gemms.values())
                      + " |")
            print("| sum | | " + " | ".join(f"{sum(g[n]['ms'] for n in shared):.2f}" for g in gemms.values()) + " |")


if __name__ == "__main__":
    main()
