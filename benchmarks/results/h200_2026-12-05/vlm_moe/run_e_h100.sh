# H100: where the vision-language step waits for the host (vl_host.py, transformers 5.25), then the
# vision-language step of the three providers on the image's transformers 5.17 (Liger-Kernel 0.8.5's Qwen2.5-VL
# forward imports an output class transformers 5.25 renamed).
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R/e517; t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lk .whl/liger_kernel-*.whl || exit
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
PYTHONPATH=$PWD:/tmp/site timeout 200 python3 benchmarks/results/h200_2026-12-05/vlm_moe/vl_host.py $R transformers,liger-gen > $R/vl_host.log 2>&1; echo "host rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_e.tgz -C $R .
cat $R/vl_host.log | grep -v Warning | tail -40
PYTHONPATH=$PWD:/tmp/lk timeout $(( 570 - ($(date +%s)-t0) )) python3 -m liger_gen.cli bench-step --model qwen2.5-vl-7b-4l --providers transformers,liger-kernel,liger-gen --warmup-steps 2 --steps 8 --profile-steps 1 --out $R/e517/vl > $R/e517/vl.log 2>&1; echo "vl517 rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_e.tgz -C $R .
grep -E "^│|transformers 5|error" $R/e517/vl.log | cut -c1-200
