# Sourced by the run scripts: wheels (transformers 5.25 and what it needs, Liger-Kernel 0.8.5), results folder,
# the time left in the call, and a summary of every step.json written so far.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
pack() { tar czf $OUT/res_$1.tgz -C $R . ; }
left() { echo $(( 580 - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
python3 -c "import torch, triton, transformers, liger_kernel.transformers as _; from importlib.metadata import version; print(torch.__version__, triton.__version__, transformers.__version__, version('liger-kernel'))" >> $R/env.txt 2>&1
cat $R/env.txt
summary() {
python3 - <<PY
import glob, json
for f in sorted(glob.glob("$R/*/step.json")):
    for name, m in json.load(open(f))["models"].items():
        for p, r in m["providers"].items():
            k = (r.get("profile") or {}).get("kernel_ms", {})
            a = r.get("autotune_warmup") or {}
            print(f.split("/")[-2], name, p, r.get("status"), "tok/s %.0f peak %.2f" % (r.get("tokens_per_s") or 0, r.get("peak_allocated_gib") or 0),
                  "autotune_s", a.get("s"), "loss0 %.5f" % (r.get("losses") or [0])[0], {c: round(v, 1) for c, v in k.items() if v > 1}, (r.get("reason") or "")[:200])
PY
}
