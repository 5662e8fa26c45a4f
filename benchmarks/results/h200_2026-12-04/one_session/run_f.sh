python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null)
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
timeout 100 python3 benchmarks/results/h200_2026-12-04/one_session/first_step_garbage.py llama3-8b-4l > $R/first_step_garbage.log 2>&1; echo "leak rc=$? $(( $(date +%s)-t0 ))s"
timeout 200 python3 -m liger_gen.cli bench-step --models llama3.2-1b,qwen2.5-0.5b,llama3-8b-4l --providers transformers,liger-gen-unfused-add,liger-kernel,liger-gen --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step > $R/step.log 2>&1; echo "step rc=$? $(( $(date +%s)-t0 ))s"
timeout 120 python3 benchmarks/step_memory_at_peak.py --model llama3-8b-4l --providers liger-kernel,liger-gen --top 14 --json $R/memory_llama3-8b-4l.json > $R/memory_llama3-8b-4l.log 2>&1; echo "mem rc=$? $(( $(date +%s)-t0 ))s"
tar czf $OUT/resF.tgz -C $R .
grep "^step" $R/first_step_garbage.log
grep -A16 "Speed, memory" $R/step.log | cut -c1-175 | tail -13
grep "peak" $R/memory_llama3-8b-4l.log
