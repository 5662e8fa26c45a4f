# Second call: the FP8 convergence run (400 steps, warm-up + cosine), then the before/after of the ops/tuning/
# integrations restructure: before = 17a73b4 (its liger_gen/ carried as .before), after = this tree; kernel times
# (`bench`) and steps (`bench-step`), before and after alternating. Results are packed after each step.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R; t0=$(date +%s); pack() { tar czf $OUT/resE.tgz -C $R . ; }
PYTHONPATH=$PWD:/tmp/site timeout 240 python3 benchmarks/fp8_convergence.py --steps 400 --warmup 50 --out $R/conv > $R/conv.log 2>&1; echo "conv rc=$? $(( $(date +%s)-t0 ))s"; pack
O=rms_norm,fused_add_rms_norm,layer_norm,rope,swiglu,geglu,cross_entropy,fused_linear_cross_entropy
for round in 1 2; do for side in before after; do
  if [ $side = before ]; then P=$PWD/.before:/tmp/site; else P=$PWD:/tmp/site; fi
  [ $(( 560 - ($(date +%s)-t0) )) -gt 60 ] || break 2
  PYTHONPATH=$P timeout 70 python3 -P -m liger_gen.cli bench --model llama3-8b --ops $O --providers liger-gen --iters 5 --wall-iters 20 --out $R/ops_${side}_$round > $R/ops_${side}_$round.log 2>&1; echo "ops $side $round rc=$? $(( $(date +%s)-t0 ))s"
  [ $(( 560 - ($(date +%s)-t0) )) -gt 50 ] || break 2
  PYTHONPATH=$P timeout 80 python3 -P -m liger_gen.cli bench-step --models llama3.2-1b,qwen2.5-0.5b --providers liger-gen --steps 10 --warmup-steps 2 --out $R/step_${side}_$round > $R/step_${side}_$round.log 2>&1; echo "step $side $round rc=$? $(( $(date +%s)-t0 ))s"
  pack
done; done
tail -n 6 $R/conv.log
for f in $R/ops_*_1.log $R/step_*_1.log; do echo "== $f"; grep "│" $f | cut -c1-150 | tail -10; done
