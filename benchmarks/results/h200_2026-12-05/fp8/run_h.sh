# H200: glu_fp8's table at Llama-3-8B width, the Llama-3-8B-width step with every FP8 table, the 32-layer
# Llama-3-8B step, the host time per call of the bf16 ops (200 calls per wall loop), then the FP8 convergence run
# with each stack's own bf16 run (as far as the time left allows; the JSON is written after each provider).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null) PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resH.tgz -C $R . ; }; left() { echo $(( ${BUDGET:-585} - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 80 python3 -m liger_gen.cli tune --gpu h200 --ops glu_fp8 --model llama3-8b --rows 4096,16384 --trials 12 --budget-s 30 > $R/tune_glu.log 2>&1; echo "tune_glu rc=$? $(( $(date +%s)-t0 ))s"
tar czf $R/tuned.tgz liger_gen/tuned/h200; pack
timeout 140 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 170 python3 -m liger_gen.cli bench-step --model llama3-8b --batch-size 4 --providers liger-kernel,liger-gen-fp8,liger-gen --lr 1e-4 --steps 6 --warmup-steps 2 --profile-steps 1 --out $R/step8b32 > $R/step8b32.log 2>&1; echo "step8b32 rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 50 python3 -m liger_gen.cli bench --model llama3-8b --ops rms_norm,fused_add_rms_norm,layer_norm,rope,swiglu,geglu,cross_entropy --providers liger-gen --iters 3 --wall-iters 200 --out $R/host > $R/host.log 2>&1; echo "host rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout $(left) python3 benchmarks/fp8_convergence.py --steps 400 --warmup 50 --providers bf16,compile-bf16,liger-gen-fp8,torchao-fp8 --out $R/conv > $R/conv.log 2>&1; echo "conv rc=$? $(( $(date +%s)-t0 ))s"; pack
grep "glu_fp8" $R/tune_glu.log | cut -c1-200 | tail -4
grep -h -A9 "Speed, memory" $R/step8b.log | cut -c1-150; grep -i "error\|Traceback" $R/step8b.log | head -3
grep -h -A7 "Speed, memory" $R/step8b32.log | cut -c1-150; grep -i "error\|Traceback\|out of memory" $R/step8b32.log | head -3
grep "│" $R/host.log | awk -F'│' '{print $2, $4, $5, $6}'
tail -n 7 $R/conv.log
python3 -c "
import json; import os
d={}
for f in ('$R/step8b/step.json', '$R/step8b32/step.json'):
  if os.path.exists(f): d.update(json.load(open(f))['models'])
for m in d.values():
  for p, r in m['providers'].items():
    pr = r.get('profile') or {}; k = pr.get('kernel_ms', {})
    print(p[:14], 'gemm %.1f quant %.1f liger_gen %.1f' % (k.get('gemm', 0), k.get('quantize', 0), k.get('liger_gen', 0)), [(t['name'][:28], round(t['ms'], 1)) for t in pr.get('top_kernels', []) if t['class'] in ('liger_gen', 'quantize')][:6])
"
