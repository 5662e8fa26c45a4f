# FP8 on the H200, with the forward GEMM's fast accumulation: exactness and per-projection times, training steps,
# convergence (warm-up + cosine), and the fp8_quantize table. Results are packed after each step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
export LIGER_GEN_COMMIT=$(git rev-parse HEAD 2>/dev/null) PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resC.tgz -C $R . ; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $R/gpu_start.csv
timeout 80 python3 benchmarks/fp8_linear_check.py --model llama3-8b --out $R/check > $R/check.log 2>&1; echo "check rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 150 python3 -m liger_gen.cli bench-step --model llama3-8b-4l --providers liger-kernel,liger-gen,liger-gen-fp8,torchao-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step8b > $R/step8b.log 2>&1; echo "step8b rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 60 python3 -m liger_gen.cli bench-step --model llama3.2-1b --providers liger-kernel,liger-gen,liger-gen-fp8 --lr 1e-4 --steps 10 --warmup-steps 2 --profile-steps 1 --out $R/step1b > $R/step1b.log 2>&1; echo "step1b rc=$? $(( $(date +%s)-t0 ))s"; pack
timeout 200 python3 benchmarks/fp8_convergence.py --steps 500 --warmup 50 --out $R/conv > $R/conv.log 2>&1; echo "conv rc=$? $(( $(date +%s)-t0 ))s"; pack
for m in llama3-8b llama3.2-1b; do
left=$(( 545 - ($(date +%s)-t0) )); [ $left -gt 40 ] || break
timeout $left python3 -m liger_gen.cli tune --gpu h200 --ops fp8_quantize --model $m --rows 4096,16384 --trials 12 --budget-s 50 >> $R/tune.log 2>&1; echo "tune $m rc=$? $(( $(date +%s)-t0 ))s"
done
tar czf $R/tuned_h200.tgz liger_gen/tuned/h200; pack
tail -n 10 $R/check.log
grep -h -A8 "Speed, memory" $R/step8b.log $R/step1b.log | cut -c1-150; grep -h "fp8\|liger-kernel " $R/step8b.log | grep "│" | tail -4 | cut -c1-170
tail -n 5 $R/conv.log; tail -n 4 $R/tune.log
