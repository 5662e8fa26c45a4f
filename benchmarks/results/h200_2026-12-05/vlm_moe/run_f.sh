# H200 call 1: the Qwen2.5-VL-7B-width step (transformers, Liger-Kernel, liger-gen in one process), then the
# GLM-4.5-Air-width MoE step of transformers and liger-gen, on the image's transformers 5.17 (Liger-Kernel 0.8.5's
# Qwen2.5-VL forward imports an output class transformers 5.25 renamed). Liger-Kernel's MoE step: run_g.sh.
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); left() { echo $(( 580 - ($(date +%s)-t0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lk .whl/liger_kernel-*.whl && export PYTHONPATH=$PWD:/tmp/lk || exit
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
python3 -c "import torch, triton, transformers; from importlib.metadata import version; print(torch.__version__, triton.__version__, transformers.__version__, version('liger-kernel'))" >> $R/env.txt; cat $R/env.txt
timeout 200 python3 -m liger_gen.cli bench-step --model qwen2.5-vl-7b-4l --providers transformers,liger-kernel,liger-gen --warmup-steps 2 --steps 8 --profile-steps 1 --out $R/vl > $R/vl.log 2>&1; echo "vl rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_f.tgz -C $R .
grep -E "^│" $R/vl.log | cut -c1-190
timeout $(left) python3 -m liger_gen.cli bench-step --model glm4.5-air-4l --batch-size 4 --providers transformers,liger-gen --warmup-steps 2 --steps 5 --profile-steps 1 --out $R/moe > $R/moe.log 2>&1; echo "moe rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_f.tgz -C $R .
grep -E "^│|rror" $R/moe.log | cut -c1-190
