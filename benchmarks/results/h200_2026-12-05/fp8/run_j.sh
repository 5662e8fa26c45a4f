# H200, short: glu_fp8's table at Llama-3-8B width, then the Llama-3-8B-width step with every FP8 table.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resJ.tgz -C $R . ; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 75 python3 -m liger_gen.cli tune --gpu h200 --ops glu_fp8 --model llama3-8b --rows 4096,16384 --trials 12 --budget-s 30 > $R/tune_glu.log 2>&1; echo "tune_glu rc=$? $(( $(date +%s)-t0 ))s"
tar czf $R/tuned.tgz liger_gen/tuned/h200; pack
timeout 150 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
grep "glu_fp8" $R/tune_glu.log | cut -c1-200 | tail -4
grep -h -A9 "Speed, memory" $R/step8b.log | cut -c1-150; grep -i "error\|Traceback" $R/step8b.log | head -3
python3 -c "
import json; d=json.load(open('$R/step8b/step.json'))['models']
for m in d.values():
  for p, r in m['providers'].items():
    pr = r.get('profile') or {}; k = pr.get('kernel_ms', {})
    print(p[:14], 'gemm %.1f quant %.1f liger_gen %.1f' % (k.get('gemm', 0), k.get('quantize', 0), k.get('liger_gen', 0)), [(t['name'][:28], round(t['ms'], 1)) for t in pr.get('top_kernels', []) if t['class'] in ('liger_gen', 'quantize')][:6])
"
