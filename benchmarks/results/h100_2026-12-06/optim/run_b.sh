# Training steps of a vision-language model and a dense model in one GPU call, liger-gen against Liger-Kernel
# 0.8.5 (wheel) and transformers on the image's transformers: (1) Qwen2.5-VL-7B width, (2) Llama-3-8B width with
# liger_gen.optim.AdamW for the liger-gen providers (the others with torch's fused AdamW), then with torch's.
# Results land in $OUT/res_steps.tgz. Usage, from the repository root on the GPU machine, with the wheels of .whl/
# beside it: bash benchmarks/steps_run.sh
export PYTHONUNBUFFERED=1
R=/tmp/res_steps; mkdir -p $R; t0=$(date +%s); left() { echo $(( 585 - ($(date +%s)-t0) )); }
pack() { tar czf $OUT/res_steps.tgz -C $R . ; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lk .whl/liger_kernel-*.whl || exit
export PYTHONPATH=$PWD:/tmp/lk
python3 -c "import torch, triton, transformers; from importlib.metadata import version; print(torch.__version__, triton.__version__, transformers.__version__, version('liger-kernel'))" >> $R/env.txt
timeout 230 python3 -m liger_gen.cli bench-step --model qwen2.5-vl-7b-4l --providers transformers,liger-kernel,liger-gen \
    --warmup-steps 2 --steps 8 --profile-steps 1 --out $R/vl > $R/vl.log 2>&1; echo "vl rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout $(( $(left) - 10 )) python3 -m liger_gen.cli bench-step --model llama3-8b-4l \
    --providers liger-kernel,liger-gen,liger-gen-fp8 --optimizer liger-gen --warmup-steps 3 --steps 10 \
    --profile-steps 1 --out $R/llama > $R/llama.log 2>&1; echo "llama rc=$? $(( $(date +%s)-t0 ))s"; pack
cat $R/env.txt
grep -E "^│" $R/vl.log $R/llama.log | cut -c1-200
