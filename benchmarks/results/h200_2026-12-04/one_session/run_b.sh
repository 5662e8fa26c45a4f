#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null)
L="python3 -m liger_gen.cli"
R=/tmp/res; mkdir -p $R
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > $R/gpu_start.csv
python3 -c "import torch,triton,transformers; print(torch.__version__, triton.__version__, transformers.__version__)" > $R/versions.txt
$L build --gpu h200 --model llama3.2-1b --replace > $R/build_llama3.2-1b.log 2>&1; echo "build1 rc=$? $(( $(date +%s)-t0 ))s"
$L build --gpu h200 --model qwen2.5-0.5b > $R/build_qwen2.5-0.5b.log 2>&1; echo "build2 rc=$? $(( $(date +%s)-t0 ))s"
for m in llama3.2-1b qwen2.5-0.5b; do $L verify --gpu h200 --model $m --require-compiled > $R/verify_$m.log 2>&1; echo "verify $m rc=$?"; done
tar czf $OUT/compiled.tgz -C liger_gen/tuned/h200 compiled
for m in llama3-8b llama3.2-1b qwen2.5-0.5b; do
  timeout 140 $L bench --model $m --ops rms_norm,fused_add_rms_norm,layer_norm,rope,swiglu,cross_entropy,fused_linear_cross_entropy --providers liger-gen,torch-compile,liger-kernel --iters 5 --wall-iters 20 --out $R/ops > $R/bench_$m.log 2>&1; echo "bench $m rc=$? $(( $(date +%s)-t0 ))s"
done
timeout 170 $L bench-step --models llama3.2-1b,qwen2.5-0.5b,llama3-8b-4l --providers transformers,liger-gen-unfused-add,liger-kernel,liger-gen --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step > $R/step.log 2>&1; echo "step rc=$? $(( $(date +%s)-t0 ))s"
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_integration.py > $R/pytest_gpu_integration.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_end.csv
tar czf $OUT/res.tgz -C $R .
tail -n 1 $R/pytest_gpu_integration.log
