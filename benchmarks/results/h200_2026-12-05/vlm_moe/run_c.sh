# H200 call 3: every family's mini model trained in bf16 on the GPU like transformers (text and vision-language),
# and packed batches against padded ones on the GPU (sdpa/eager in float32, sdpa and FlashAttention-2 in bf16).
source benchmarks/results/h200_2026-12-05/vlm_moe/common.sh
timeout $(left) python3 -m pytest -v -n 8 -rfEsP -p no:cacheprovider --tb=short tests/test_families.py tests/test_vlm_families.py tests/test_packed_sequences.py -k "gpu" > $R/pytest_gpu.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"; pack c
grep -E "(first .*, mean|packed vs padded)" $R/pytest_gpu.log | sort > $R/bf16_and_packed_summary.txt; wc -l $R/bf16_and_packed_summary.txt
tail -15 $R/pytest_gpu.log
