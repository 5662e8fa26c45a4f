# H200, shortest: the Llama-3-8B-width step with the reworked GLU kernels (glu_fp8 on its heuristic config, the
# other ops on their H200 tables), Liger-Kernel and liger-gen bf16 and FP8.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 110 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen-fp8,liger-gen --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/resK.tgz -C $R .
grep -h -A8 "Speed, memory" $R/step8b.log | cut -c1-150; grep -i "error\|Traceback" $R/step8b.log | head -3
