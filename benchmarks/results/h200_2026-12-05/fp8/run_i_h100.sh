# H100 (no H200 started): the FP8 convergence run with each stack's own bf16 run, the host time per call of the
# bf16 ops (200 calls per wall loop), then the convergence run at 4 sequences a step (under 1.5 passes over the
# text) with the time left.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resI.tgz -C $R . ; }; left() { echo $(( ${BUDGET:-400} - ($(date +%s)-t0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 280 python3 benchmarks/fp8_convergence.py --steps 400 --warmup 50 --providers bf16,compile-bf16,liger-gen-fp8,torchao-fp8 --out $R/conv > $R/conv.log 2>&1; echo "conv rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 50 python3 -m liger_gen.cli bench --model llama3-8b --ops rms_norm,fused_add_rms_norm,layer_norm,rope,swiglu,geglu,cross_entropy --providers liger-gen --iters 3 --wall-iters 200 --out $R/host > $R/host.log 2>&1; echo "host rc=$? $(( $(date +%s)-t0 ))s"; pack
[ $(left) -gt 30 ] && timeout $(left) python3 benchmarks/fp8_convergence.py --steps 400 --warmup 50 --batch-size 4 --providers bf16,liger-gen-fp8,compile-bf16,torchao-fp8 --out $R/conv_b4 > $R/conv_b4.log 2>&1; echo "conv_b4 rc=$? $(( $(date +%s)-t0 ))s"; pack
tail -n 7 $R/conv.log; tail -n 7 $R/conv_b4.log
grep "│" $R/host.log | awk -F'│' '{print $2, $4, $5, $6}'
