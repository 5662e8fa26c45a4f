# H200 call 2: the GLM-4.5-Air-width MoE step of Liger-Kernel (its modules composed for glm4_moe) on transformers
# 5.17, its fused MoE's autotune warmed and timed before the steps (same weights and batches as run_f.sh's); then,
# on transformers 5.25, every family's mini model in bf16 and packed against padded batches (tests, -k gpu).
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); left() { echo $(( 580 - ($(date +%s)-t0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lk .whl/liger_kernel-*.whl || exit
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
PYTHONPATH=$PWD:/tmp/lk timeout 420 python3 -m liger_gen.cli bench-step --model glm4.5-air-4l --batch-size 4 --providers liger-kernel --warmup-steps 2 --steps 5 --profile-steps 1 --out $R/moe_lk > $R/moe_lk.log 2>&1; echo "moe_lk rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_g.tgz -C $R .
grep -E "^│|rror" $R/moe_lk.log | cut -c1-190
[ $(left) -gt 90 ] && { PYTHONPATH=$PWD:/tmp/site timeout $(left) python3 -m pytest -v -n 8 -rfEsP -p no:cacheprovider --tb=short tests/test_families.py tests/test_vlm_families.py tests/test_packed_sequences.py -k "gpu" > $R/pytest_gpu.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_g.tgz -C $R .; }
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^(FAILED|ERROR)" $R/pytest_gpu.log | head -8
