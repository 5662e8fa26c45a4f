# On an H100 (sm_90, the same FP8 tensor cores and cuBLASLt kernels as the H200): exactness of the FP8 fusions,
# the FP8 convergence run, the GPU test files, then the Llama-3-8B-width step (heuristic configs, no H100 table).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null) PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resH.tgz -C $R . ; }; left() { echo $(( ${BUDGET:-575} - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
python3 -c "import torch, triton, transformers, torchao; print(torch.__version__, triton.__version__, transformers.__version__, torchao.__version__)" > $R/versions.txt 2>&1
timeout 90 python3 benchmarks/fp8_linear_check.py --model llama3-8b --out $R/check > $R/check.log 2>&1; echo "check rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 240 python3 benchmarks/fp8_convergence.py --steps 400 --warmup 50 --out $R/conv > $R/conv.log 2>&1; echo "conv rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 100 python3 -m pytest -q -p no:cacheprovider -x tests/test_glu_fp8.py tests/test_rms_norm_fp8.py tests/test_fp8_cast_transpose.py > $R/pytest.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"; pack
[ $(left) -gt 60 ] && timeout $(left) python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
cat $R/gpu_start.csv $R/versions.txt; tail -n 12 $R/check.log | cut -c1-150; tail -n 5 $R/conv.log; tail -n 3 $R/pytest.log
grep -h -A9 "Speed, memory" $R/step8b.log | cut -c1-170; grep -i "error\|Traceback" $R/step8b.log | head -3
