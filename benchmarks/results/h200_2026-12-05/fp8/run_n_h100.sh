# Any GPU (an H100 when no H200 starts): the Llama-3-8B-width step of the four providers and the Llama-3.2-1B step
# with the fused FP8 operands and the walking amax pass (heuristic configs where the GPU has no tables), then the
# GPU tests of the FP8 ops.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resN.tgz -C $R . ; }; left() { echo $(( 470 - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 160 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 150 python3 -m liger_gen.cli bench-step --model llama3.2-1b --providers liger-kernel,liger-gen,liger-gen-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step1b > $R/step1b.log 2>&1; echo "step1b rc=$? $(( $(date +%s)-t0 ))s"; pack
[ $(left) -gt 40 ] && { timeout $(left) python3 -m pytest -q -p no:cacheprovider tests/test_fp8_cast_transpose.py tests/test_glu_fp8.py tests/test_rms_norm_fp8.py > $R/pytest.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"; tail -n 3 $R/pytest.log > $R/pytest_tail.log; pack; }
tail -n 2 $R/pytest.log 2>/dev/null
python3 - <<PY
import glob, json
for f in sorted(glob.glob("$R/step*/step.json")):
    for m in json.load(open(f))["models"].values():
        for p, r in m["providers"].items():
            pr = r.get("profile") or {}; k = pr.get("kernel_ms", {})
            q = [(t["name"][:26], round(t["ms"], 1)) for t in pr.get("top_kernels", []) if t["class"] in ("liger_gen", "quantize")][:5]
            print(f.split("/")[-2], p[:14], r.get("status"), "tok/s %.0f peak %.2f" % (r.get("tokens_per_s") or 0, r.get("peak_allocated_gib") or 0), "gemm %.1f quant %.1f lg %.1f" % (k.get("gemm", 0), k.get("quantize", 0), k.get("liger_gen", 0)), q)
PY
grep -i "error\|Traceback\|out of memory" $R/step*.log | head -4
