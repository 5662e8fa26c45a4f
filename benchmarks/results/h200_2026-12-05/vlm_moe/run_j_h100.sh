# The Qwen2.5-VL-7B-width step with the vision attention in one variable-length call per block, checked and timed
# in one GPU call: (1) the vision-attention GPU tests under transformers 5.25 (wheels in .whl/: the families that
# exist only there), (2) bench-step's Qwen2.5-VL step of transformers, Liger-Kernel 0.8.5 and liger-gen under the
# image's transformers (Liger-Kernel's Qwen2.5-VL forward imports an output class transformers 5.25 renamed),
# (3) GLM-4.5-Air's MoE step of transformers, liger-gen and liger-gen with FP8 projections (the experts stay bf16),
# (4) the host synchronisations and wall time of one liger-gen step (vl_host.py). Results land in $OUT/res_vl.tgz.
# Usage, from the repository root on the GPU machine, with the wheels of .whl/ beside it (transformers 5.25 and what
# it needs, Liger-Kernel 0.8.5): bash benchmarks/vl_attention_run.sh
export PYTHONUNBUFFERED=1
R=/tmp/res_vl; mkdir -p $R; t0=$(date +%s); left() { echo $(( 580 - ($(date +%s)-t0) )); }
pack() { tar czf $OUT/res_vl.tgz -C $R . ; }
HOST=benchmarks/results/h200_2026-12-05/vlm_moe/vl_host.py
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lk .whl/liger_kernel-*.whl || exit
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_vision_attention.py \
    -k gpu > $R/pytest_gpu.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; pack
export PYTHONPATH=$PWD:/tmp/lk
python3 -c "import torch, triton, transformers; from importlib.metadata import version; print(torch.__version__, triton.__version__, transformers.__version__, version('liger-kernel'))" >> $R/env.txt
timeout 220 python3 -m liger_gen.cli bench-step --model qwen2.5-vl-7b-4l --providers transformers,liger-kernel,liger-gen \
    --warmup-steps 2 --steps 8 --profile-steps 1 --out $R/vl > $R/vl.log 2>&1; echo "vl rc=$? $(( $(date +%s)-t0 ))s"; pack
[ $(left) -gt 200 ] && { timeout $(( $(left) - 80 )) python3 -m liger_gen.cli bench-step --model glm4.5-air-4l --batch-size 4 \
    --providers transformers,liger-gen,liger-gen-fp8 --warmup-steps 2 --steps 5 --profile-steps 1 --out $R/moe > $R/moe.log 2>&1; echo "moe rc=$? $(( $(date +%s)-t0 ))s"; pack; }
[ $(left) -gt 60 ] && { mkdir -p $R/host; timeout $(( $(left) - 10 )) python3 $HOST $R/host liger-gen,liger-kernel > $R/host/vl_host.log 2>&1; echo "host rc=$?"; pack; }
cat $R/env.txt; tail -3 $R/pytest_gpu.log
grep -E "^│" $R/vl.log $R/moe.log | cut -c1-190
grep -E "wall|x /" $R/host/vl_host.log 2>/dev/null | head -30 | cut -c1-190
