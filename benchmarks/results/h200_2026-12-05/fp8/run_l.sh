# fp8_cast_transpose's walking amax pass, before/after on whatever GPU comes (before = `git archive f6471c6
# liger_gen` carried as .before; after = this tree), alternating: the op's kernel ms at Llama-3-8B width with the
# heuristic and with the tables, and the Llama-3-8B-width FP8 step. On an H200 then: the tables of
# fp8_cast_transpose and glu_fp8, the step of the four providers, and the 32-layer Llama-3-8B step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resL.tgz -C $R . ; }; left() { echo $(( 585 - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
H200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200); ROUNDS=$([ $H200 = 1 ] && echo 1 || echo 2)
for round in $(seq $ROUNDS); do for side in before after; do
  if [ $side = before ]; then P=$PWD/.before:/tmp/site; else P=$PWD:/tmp/site; fi
  PYTHONPATH=$P timeout 60 python3 -P -m liger_gen.cli bench --model llama3-8b --ops fp8_cast_transpose --providers liger-gen,liger-gen-heuristic --iters 10 --wall-iters 50 --out $R/ct_${side}_$round > $R/ct_${side}_$round.log 2>&1; echo "ct $side $round rc=$? $(( $(date +%s)-t0 ))s"
  PYTHONPATH=$P timeout 80 python3 -P -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-gen-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step_${side}_$round > $R/step_${side}_$round.log 2>&1; echo "step $side $round rc=$? $(( $(date +%s)-t0 ))s"
  pack
done; done
export PYTHONPATH=$PWD:/tmp/site
if [ $H200 = 1 ]; then
  timeout 100 python3 -m liger_gen.cli tune --gpu h200 --ops fp8_cast_transpose,glu_fp8 --model llama3-8b --rows 4096,16384 --trials 12 --budget-s 30 > $R/tune.log 2>&1; echo "tune rc=$? $(( $(date +%s)-t0 ))s"
  tar czf $R/tuned.tgz liger_gen/tuned/h200; pack
  timeout 150 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
  [ $(left) -gt 60 ] && { timeout $(left) python3 -m liger_gen.cli bench-step --model llama3-8b --batch-size 4 --providers liger-kernel,liger-gen-fp8,liger-gen --lr 1e-4 --steps 6 --warmup-steps 2 --profile-steps 1 --out $R/step8b32 > $R/step8b32.log 2>&1; echo "step8b32 rc=$? $(( $(date +%s)-t0 ))s"; pack; }
fi
for f in $R/ct_*.log; do echo "== $f"; grep "│ fp8" $f | awk -F'│' '{print $3, $4, $5, $13}'; done
grep -h "tok/s\|liger-gen-fp8 " $R/step_*.log | grep -v "^\s*$" | cut -c1-140 | head -8
python3 - <<PY
import glob, json, os
for f in sorted(glob.glob("$R/step*/step.json")):
    for m in json.load(open(f))["models"].values():
        for p, r in m["providers"].items():
            pr = r.get("profile") or {}; k = pr.get("kernel_ms", {})
            q = [(t["name"][:26], round(t["ms"], 1)) for t in pr.get("top_kernels", []) if t["class"] in ("liger_gen", "quantize")][:5]
            print(f.split("/")[-2], p[:14], "tok/s %.0f peak %.2f" % (r.get("tokens_per_s") or 0, r.get("peak_allocated_gib") or 0), "gemm %.1f quant %.1f" % (k.get("gemm", 0), k.get("quantize", 0)), q)
PY
grep "fp8_cast_transpose\|glu_fp8" $R/tune.log 2>/dev/null | cut -c1-160 | tail -6
