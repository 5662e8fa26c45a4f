# H200 call 3: tables for the GLM-4.5-Air and Qwen2.5-VL-7B shapes that had none (the FLCE at 4096 x 151552, RoPE
# over 64 of 128 dims, SwiGLU at 10944/1408, the vision tower's RMSNorm at 1280, RoPE at head_dim 80, SwiGLU at
# 3420), then run_f.sh's two steps again with them, on the image's transformers 5.17.
export PYTHONUNBUFFERED=1
R=/tmp/res_h; mkdir -p $R; t0=$(date +%s); left() { echo $(( 580 - ($(date +%s)-t0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/opt .whl/optuna-*.whl .whl/alembic-*.whl .whl/colorlog-*.whl .whl/sqlalchemy-*.whl .whl/mako-*.whl .whl/liger_kernel-*.whl && export PYTHONPATH=$PWD:/tmp/opt || exit
for m in glm4.5-air-4l qwen2.5-vl-7b-4l; do timeout 120 python3 -m liger_gen.cli tune --gpu h200 --ops rms_norm,rope,swiglu,fused_linear_cross_entropy --model $m --rows 8192,16384 --trials 10 --budget-s 16 >> $R/tune.log 2>&1; echo "tune $m rc=$? $(( $(date +%s)-t0 ))s"; done
tar czf $R/tuned.tgz liger_gen/tuned/h200; tar czf $OUT/res_h.tgz -C $R .
timeout 170 python3 -m liger_gen.cli bench-step --model glm4.5-air-4l --batch-size 4 --providers transformers,liger-gen --warmup-steps 2 --steps 5 --profile-steps 1 --out $R/moe > $R/moe.log 2>&1; echo "moe rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_h.tgz -C $R .
[ $(left) -gt 70 ] && { timeout $(left) python3 -m liger_gen.cli bench-step --model qwen2.5-vl-7b-4l --providers transformers,liger-kernel,liger-gen --warmup-steps 2 --steps 8 --profile-steps 1 --out $R/vl > $R/vl.log 2>&1; echo "vl rc=$? $(( $(date +%s)-t0 ))s"; tar czf $OUT/res_h.tgz -C $R .; }
tail -12 $R/tune.log | cut -c1-170; grep -E "^│|rror" $R/moe.log $R/vl.log | cut -c1-200
