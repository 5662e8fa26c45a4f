"""Re-time the cross-entropy and FLCE H200 tables under the current cross-entropy template (tune --refresh), then
rebuild the compiled store for llama3.2-1b and qwen2.5-0.5b and verify. One process, run from the repository root
on the H200: ``OUT=<log folder> python refresh_ce.py [seconds: skip the build past this]``. The refreshed tables
go to /tmp/rt first (the packaged ones stay the priors of every later command), then into the package."""
import glob
import os
import shutil
import subprocess
import sys
import time

T0 = time.monotonic()
OUT = os.environ.get("OUT", ".")
NEW = "/tmp/rt"
PKG = "liger_gen/tuned/h200"


def lg(*args):
    from liger_gen.cli import main
    print(f"\n$ liger-gen {' '.join(args)}   [t={time.monotonic() - T0:.1f}s]", flush=True)
    try:
        main(list(args), standalone_mode=False)
        rc = 0
    except SystemExit as e:
        rc = e.code
    except Exception as e:  # noqa: BLE001
        print(f"!! {type(e).__name__}: {e}", flush=True)
        rc = 99
    print(f"[rc={rc} t={time.monotonic() - T0:.1f}s]", flush=True)
    return rc


def save_tables():
    subprocess.run(f"tar czf {OUT}/tables.tgz -C {NEW} h200", shell=True)


CE = "cross_entropy"
FL = "fused_linear_cross_entropy"
jobs = [(m, CE, "4096,16384") for m in ("llama3-8b", "qwen2.5-0.5b", "qwen2.5-7b", "mistral-7b", "gpt-oss-20b")]
jobs += [(m, FL, "4096") for m in ("llama3.2-1b", "qwen2.5-0.5b", "qwen3-30b-a3b", "gpt-oss-20b", "llama3.2-3b",
                                   "qwen2.5-7b", "mistral-7b", "llama3-8b", "llama3-70b")]
for model, op, rows in jobs:
    lg("tune", "--gpu", "h200", "--model", model, "--ops", op, "--rows", rows, "--refresh", "--no-build", "--compile-workers", "0",
       "--out", NEW)
    save_tables()
print(f"refresh done at {time.monotonic() - T0:.1f}s", flush=True)
for f in glob.glob(f"{NEW}/h200/*.json"):
    shutil.copy(f, PKG)
limit = float(sys.argv[1]) if len(sys.argv) > 1 else 200
if time.monotonic() - T0 < limit:
    lg("build", "--gpu", "h200", "--model", "llama3.2-1b", "--replace")
    lg("build", "--gpu", "h200", "--model", "qwen2.5-0.5b")
    subprocess.run(f"tar czf {OUT}/compiled.tgz {PKG}/compiled", shell=True)
    for m in ("llama3.2-1b", "qwen2.5-0.5b"):
        lg("verify", "--gpu", "h200", "--model", m, "--require-compiled")
print(f"all done at {time.monotonic() - T0:.1f}s", flush=True)
