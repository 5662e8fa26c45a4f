#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site OMP_NUM_THREADS=2
L=$OUT/r2; mkdir -p $L/fsdp $L/bench
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $L/env.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $L/env.txt 2>&1
git log -1 --format=%H >> $L/env.txt 2>/dev/null; git status --short | head -30 >> $L/env.txt 2>/dev/null
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_compiled_kernels.py tests/test_rms_norm.py tests/test_rope.py tests/test_glu.py > $L/pytest_gpu.log 2>&1; echo "pytest rc=$?" >> $L/pytest_gpu.log
tail -3 $L/pytest_gpu.log
python3 .gpu/profiler_effect.py > $L/profiler_effect.log 2>&1; tail -1 $L/profiler_effect.log
python3 .gpu/host_profile.py > $L/host_profile.log 2>&1; tail -11 $L/host_profile.log
python3 .gpu/lean_probe.py > $L/lean_probe.log 2>&1; tail -3 $L/lean_probe.log
for i in 1 2; do
  echo "\$ liger-gen bench --model llama3-8b --ops rms_norm,rope,swiglu --providers liger-gen,liger-kernel --iters 5 --out bench/run$i" > $L/bench/run$i.log
  timeout 120 python3 -m liger_gen.cli bench --model llama3-8b --ops rms_norm,rope,swiglu --providers liger-gen,liger-kernel --iters 5 --out $L/bench/run$i >> $L/bench/run$i.log 2>&1
  grep -E "^│ (rms_norm|rope|swiglu)" $L/bench/run$i.log | cut -c1-90
done
for m in llama3.2-1b qwen2.5-0.5b; do for k in transformers liger-kernel liger-gen; do
  f=$L/fsdp/${m}_${k}
  echo "\$ torchrun --standalone --nproc-per-node 1 -m liger_gen.examples.train_fsdp --model $m --dtype bfloat16 --batch-size 8 --seq-len 2048 --steps 10 --parallel fsdp --kernels $k --metrics-file ${m}_${k}.jsonl" > $f.log
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m liger_gen.examples.train_fsdp --model $m --dtype bfloat16 --batch-size 8 --seq-len 2048 --steps 10 --parallel fsdp --kernels $k --metrics-file $f.jsonl >> $f.log 2>&1
  echo "rc=$?" >> $f.log
  echo "$m $k $(grep '"rank"' $f.log | tail -1 | cut -c90-220) $(tail -1 $f.log)"
done; done
cd $OUT && tar czf r2.tgz r2 && rm -rf r2
