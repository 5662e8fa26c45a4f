python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_plans.py -k fused_add > $R/pytest_gpu_plans.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"
timeout 110 python3 -m liger_gen.cli bench-step --models qwen2.5-0.5b,llama3.2-1b --providers liger-gen-unfused-add,liger-kernel,liger-gen --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step > $R/step.log 2>&1; echo "step rc=$? $(( $(date +%s)-t0 ))s"
tar czf $OUT/resH.tgz -C $R .
tail -n 1 $R/pytest_gpu_plans.log
grep -A10 "Speed, memory" $R/step.log | cut -c1-150 | tail -7
grep -A10 "GPU time per step" $R/step.log | cut -c1-175 | tail -7
