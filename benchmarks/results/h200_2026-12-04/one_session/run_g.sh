python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null)
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_glu.py -k "glumlp" > $R/pytest_gpu_glumlp.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"
timeout 170 python3 -m liger_gen.cli bench-step --models llama3.2-1b,qwen2.5-0.5b,llama3-8b-4l --providers transformers,liger-gen-unfused-add,liger-kernel,liger-gen --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step > $R/step.log 2>&1; echo "step rc=$? $(( $(date +%s)-t0 ))s"
for m in llama3-8b-4l llama3.2-1b; do
timeout 60 python3 benchmarks/step_memory_at_peak.py --model $m --providers liger-kernel,liger-gen --top 16 --json $R/memory_$m.json > $R/memory_$m.log 2>&1; echo "mem $m rc=$? $(( $(date +%s)-t0 ))s"
done
tar czf $OUT/resG.tgz -C $R .
tail -n 1 $R/pytest_gpu_glumlp.log
grep -A16 "Speed, memory" $R/step.log | cut -c1-175 | tail -13
grep -h "peak" $R/memory_*.log
