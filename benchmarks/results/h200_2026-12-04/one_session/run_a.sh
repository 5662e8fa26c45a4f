#!/bin/bash
# build + verify + training steps + GPU tests of the fused residual add
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null)
L="python3 -m liger_gen.cli"
mkdir -p $OUT/a
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > $OUT/a/gpu_start.csv
python3 -c "import torch,triton,transformers; print(torch.__version__, triton.__version__, transformers.__version__)" > $OUT/a/versions.txt
$L build --gpu h200 --model llama3.2-1b --replace > $OUT/a/build_llama3.2-1b.log 2>&1; echo "build1 rc=$? $(( $(date +%s)-t0 ))s"
$L build --gpu h200 --model qwen2.5-0.5b > $OUT/a/build_qwen2.5-0.5b.log 2>&1; echo "build2 rc=$? $(( $(date +%s)-t0 ))s"
mkdir -p $OUT/a/compiled && cp -r liger_gen/tuned/h200/compiled/. $OUT/a/compiled/
for m in llama3.2-1b qwen2.5-0.5b; do $L verify --gpu h200 --model $m --require-compiled > $OUT/a/verify_$m.log 2>&1; echo "verify $m rc=$?"; done
timeout 330 $L bench-step --models llama3.2-1b,qwen2.5-0.5b,llama3-8b-4l --providers transformers,liger-gen-unfused-add,liger-kernel,liger-gen --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $OUT/a/step > $OUT/a/step.log 2>&1; echo "step rc=$? $(( $(date +%s)-t0 ))s"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_integration.py -x > $OUT/a/pytest_gpu_integration.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $OUT/a/gpu_end.csv
tail -n 3 $OUT/a/build_*.log | grep wrote; grep -h "exit" $OUT/a/verify_*.log
grep -A40 "Speed, memory" $OUT/a/step.log | cut -c1-200
tail -n 2 $OUT/a/pytest_gpu_integration.log
