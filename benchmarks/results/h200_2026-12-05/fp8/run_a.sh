# FP8 on the H200: exactness and per-projection times, the GPU test files, training steps, convergence.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null) PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
python3 -c "import torch, triton, transformers, torchao; print(torch.__version__, triton.__version__, transformers.__version__, torchao.__version__)" > $R/versions.txt 2>&1
timeout 130 python3 benchmarks/fp8_linear_check.py --model llama3-8b --out $R/check > $R/check.log 2>&1; echo "check rc=$? $(( $(date +%s)-t0 ))s"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8.py tests/test_fp8_tuning.py > $R/pytest_fp8.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"
timeout 230 python3 -m liger_gen.cli bench-step --model llama3-8b-4l,llama3.2-1b --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step > $R/step.log 2>&1; echo "step rc=$? $(( $(date +%s)-t0 ))s"
timeout $(( 575 - ($(date +%s)-t0) )) python3 benchmarks/fp8_convergence.py --steps 300 --out $R/conv > $R/conv.log 2>&1; echo "conv rc=$? $(( $(date +%s)-t0 ))s"
tar czf $OUT/resA.tgz -C $R .
tail -n 12 $R/check.log; tail -n 3 $R/pytest_fp8.log
grep -A14 "Speed, memory" $R/step.log | cut -c1-175; grep -i "error\|Traceback" $R/step.log | head -5
tail -n 5 $R/conv.log
