# H100: the GPU tests again after their bf16 checks gained first-step gradients per part of the model
# (tests/helpers.py grad_part_rel_l2), on the carried transformers 5.25.
export PYTHONUNBUFFERED=1
R=/tmp/res_i; mkdir -p $R; t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/env.txt
timeout 200 python3 -m pytest -v -n 8 -rfEsP -p no:cacheprovider --tb=short tests/test_families.py tests/test_vlm_families.py tests/test_packed_sequences.py -k "gpu" > $R/pytest_gpu.log 2>&1; echo "pytest rc=$? $(( $(date +%s)-t0 ))s"
grep -E "(first .*, mean|packed vs padded)" $R/pytest_gpu.log | sort -u > $R/bf16_and_packed_summary.txt; tar czf $OUT/res_i.tgz -C $R .
grep -E "passed|failed" $R/pytest_gpu.log | tail -1; grep -E "^(FAILED|ERROR)" $R/pytest_gpu.log | cut -c1-300 | head -12
grep -o "first-step gradients .*" $R/bf16_and_packed_summary.txt | tr ',' '\n' | awk '{print $NF}' | sort -g | tail -3
