# H100 call (the H200 did not start): run_c.sh's GPU tests, then run_a.sh's vision-language step.
source benchmarks/results/h200_2026-12-05/vlm_moe/common.sh
timeout 300 python3 -m pytest -v -n 8 -rfEsP -p no:cacheprovider --tb=short tests/test_families.py tests/test_vlm_families.py tests/test_packed_sequences.py -k "gpu" > $R/pytest_gpu.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"; pack d
grep -E "(first .*, mean|packed vs padded)" $R/pytest_gpu.log | sort > $R/bf16_and_packed_summary.txt; wc -l $R/bf16_and_packed_summary.txt
grep -E "passed|failed" $R/pytest_gpu.log | tail -2; grep -E "^(FAILED|ERROR)" $R/pytest_gpu.log | head -12
timeout $(left) python3 -m liger_gen.cli bench-step --model qwen2.5-vl-7b-4l --providers transformers,liger-kernel,liger-gen --warmup-steps 2 --steps 8 --profile-steps 1 --out $R/vl > $R/vl.log 2>&1; echo "vl rc=$? $(( $(date +%s)-t0 ))s"; pack d
summary; grep -i "error\|Traceback\|out of memory" $R/vl.log | head -6
