# liger_gen.optim.AdamW on the GPU, checked, tuned and timed in one call: (1) its tests and the op contract on
# the GPU, (2) `liger-gen tune --ops adamw` on the visible GPU (table written to the results, not the package),
# (3) `liger-gen bench --ops adamw` against torch's fused AdamW and torch.compile, (4) GLM-4.5-Air's MoE step with
# liger_gen.optim.AdamW for the liger-gen providers (transformers with torch's fused AdamW), then liger-gen with
# torch's fused AdamW on the same machine. Results land in $OUT/res_adamw.tgz.
# Usage, from the repository root on the GPU machine, with the wheels of .whl/ beside it (optuna and what it
# needs): bash benchmarks/adamw_run.sh. TUNE=0 skips the tune (the bench then times the heuristic);
# MOE_PROVIDERS=liger-gen,liger-gen-fp8 leaves transformers out of the MoE step; STEP_ALLOC=expandable runs the
# steps with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (every provider alike: less fragmentation, so
# transformers' step fits an 80 GB GPU).
export PYTHONUNBUFFERED=1
R=/tmp/res_adamw; mkdir -p $R; t0=$(date +%s); left() { echo $(( 585 - ($(date +%s)-t0) )); }
pack() { tar czf $OUT/res_adamw.tgz -C $R . ; }
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H200*) G=h200;; *H100*) G=h100;; *) G=other;; esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/opt .whl/optuna-*.whl \
    .whl/alembic-*.whl .whl/sqlalchemy-*.whl .whl/colorlog-*.whl .whl/mako-*.whl || exit
export PYTHONPATH=$PWD:/tmp/opt
python3 -c "import torch, triton, transformers, optuna; print(torch.__version__, triton.__version__, transformers.__version__, optuna.__version__)" >> $R/env.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_adamw.py tests/test_contract.py -k "adamw" \
    > $R/pytest_gpu.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; pack
[ "${TUNE:-1}" = 1 ] && { timeout 150 python3 -m liger_gen.cli tune --gpu $G --ops adamw --model glm4.5-air-4l \
    --dtype bfloat16,float32 --trials 12 --out $R/tuned > $R/tune.log 2>&1; echo "tune rc=$? $(( $(date +%s)-t0 ))s"; pack; }
export LIGER_GEN_TUNED_DIR=$R/tuned
timeout 120 python3 -m liger_gen.cli bench --model llama3-8b --ops adamw \
    --providers liger-gen,liger-gen-heuristic,torch-eager,torch-compile --out $R/bench > $R/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s)-t0 ))s"; pack
[ "${STEP_ALLOC:-}" = expandable ] && export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout $(( $(left) - 75 )) python3 -m liger_gen.cli bench-step --model glm4.5-air-4l --batch-size 4 \
    --providers ${MOE_PROVIDERS:-transformers,liger-gen,liger-gen-fp8} --optimizer liger-gen --warmup-steps 2 --steps 5 \
    --profile-steps 1 --out $R/moe > $R/moe.log 2>&1; echo "moe rc=$? $(( $(date +%s)-t0 ))s"; pack
[ $(left) -gt 70 ] && { timeout $(( $(left) - 5 )) python3 -m liger_gen.cli bench-step --model glm4.5-air-4l \
    --batch-size 4 --providers liger-gen --warmup-steps 2 --steps 5 --profile-steps 1 --out $R/moe_torch_adamw \
    > $R/moe_torch_adamw.log 2>&1; echo "moe torch adamw rc=$?"; pack; }
echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}" >> $R/env.txt; cat $R/env.txt; tail -2 $R/pytest_gpu.log; grep -E "adamw" $R/tune.log | tail -4
grep -E "│ adamw" $R/bench.log | cut -c1-200
grep -E "^│" $R/moe.log $R/moe_torch_adamw.log | cut -c1-200
