#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site OMP_NUM_THREADS=2
L=$OUT/fsdp; mkdir -p $L
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $L/env.txt
python3 -c "import torch, triton, transformers, liger_kernel; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> $L/env.txt 2>&1
pip list 2>/dev/null | grep -i liger >> $L/env.txt
python3 .gpu/host_profile.py > $L/host_profile.log 2>&1 &
HP=$!
wait $HP
for m in llama3.2-1b qwen2.5-0.5b; do for k in transformers liger-kernel liger-gen; do
  cmd="torchrun --standalone --nproc-per-node 1 -m liger_gen.examples.train_fsdp --model $m --dtype bfloat16 --batch-size 8 --seq-len 2048 --steps 10 --parallel fsdp --kernels $k --metrics-file $L/${m}_${k}.jsonl"
  echo "\$ $cmd" > $L/${m}_${k}.log
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m liger_gen.examples.train_fsdp --model $m --dtype bfloat16 --batch-size 8 --seq-len 2048 --steps 10 --parallel fsdp --kernels $k --metrics-file $L/${m}_${k}.jsonl >> $L/${m}_${k}.log 2>&1
  echo "rc=$?" >> $L/${m}_${k}.log
  echo "$m $k $(grep '"rank"' $L/${m}_${k}.log | tail -1 | cut -c1-220) $(tail -1 $L/${m}_${k}.log)"
done; done
tail -14 $L/host_profile.log
