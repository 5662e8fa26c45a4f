# On an H100: glu_fp8's exactness and its fused kernels (column amaxes kept elementwise, 256 rows per program)
# against the GLU then fp8_cast_transpose, heuristic configs; then the Llama-3-8B-width step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null) PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resJ.tgz -C $R . ; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 45 python3 -c "
import sys, json, torch; sys.path.insert(0, 'benchmarks'); import fp8_linear_check as c
dev = torch.device('cuda'); f = []; c.check_glu(dev, f); c.check_norm(dev, f); m = c.resolve_model('llama3-8b')
print(json.dumps({'glu': c.time_glu(m, 16384, 20, dev), 'norm': c.time_norm(m, 16384, 20, dev), 'failures': f}))" > $R/glu_check.log 2>&1; echo "glu_check rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 135 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
grep -v "Warn\|warn\|found =" $R/glu_check.log | tail -3 | cut -c1-600
grep -h -A9 "Speed, memory" $R/step8b.log | cut -c1-170; grep -i "error\|Traceback" $R/step8b.log | head -3
python3 -c "
import json; d=json.load(open('$R/step8b/step.json'))['models']
for m in d.values():
  for p, r in m['providers'].items():
    pr = r.get('profile') or {}; k = pr.get('kernel_ms', {})
    print(p, 'gemm %.1f quant %.1f liger_gen %.1f' % (k.get('gemm', 0), k.get('quantize', 0), k.get('liger_gen', 0)), [(t['name'][:28], round(t['ms'], 1)) for t in pr.get('top_kernels', []) if t['class'] in ('liger_gen', 'quantize')][:6])
"
