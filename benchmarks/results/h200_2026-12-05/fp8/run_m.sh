# H200: the tables of fp8_cast_transpose (its walking amax pass) and glu_fp8 at Llama-3-8B width, then the
# Llama-3-8B-width step of the four providers with every FP8 table, then the 32-layer Llama-3-8B step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resM.tgz -C $R . ; }; left() { echo $(( 585 - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 110 python3 -m liger_gen.cli tune --gpu h200 --ops fp8_cast_transpose,glu_fp8 --model llama3-8b --rows 4096,16384 --trials 12 --budget-s 30 > $R/tune.log 2>&1; echo "tune rc=$? $(( $(date +%s)-t0 ))s"
tar czf $R/tuned.tgz liger_gen/tuned/h200; pack
timeout 150 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
[ $(left) -gt 60 ] && { timeout $(left) python3 -m liger_gen.cli bench-step --model llama3-8b --batch-size 4 --providers liger-kernel,liger-gen-fp8,liger-gen --lr 1e-4 --steps 6 --warmup-steps 2 --profile-steps 1 --out $R/step8b32 > $R/step8b32.log 2>&1; echo "step8b32 rc=$? $(( $(date +%s)-t0 ))s"; pack; }
grep "fp8_cast_transpose\|glu_fp8" $R/tune.log | cut -c1-160 | tail -6
python3 - <<PY
import glob, json
for f in sorted(glob.glob("$R/step*/step.json")):
    for m in json.load(open(f))["models"].values():
        for p, r in m["providers"].items():
            pr = r.get("profile") or {}; k = pr.get("kernel_ms", {})
            q = [(t["name"][:26], round(t["ms"], 1)) for t in pr.get("top_kernels", []) if t["class"] in ("liger_gen", "quantize")][:5]
            print(f.split("/")[-2], p[:14], r.get("status"), "tok/s %.0f peak %.2f" % (r.get("tokens_per_s") or 0, r.get("peak_allocated_gib") or 0), "gemm %.1f quant %.1f lg %.1f" % (k.get("gemm", 0), k.get("quantize", 0), k.get("liger_gen", 0)), q)
PY
grep -i "error\|Traceback\|out of memory" $R/step8b*.log | head -4
