# H200 call 1: the Qwen2.5-VL-7B-width step (transformers, Liger-Kernel, liger-gen in one process), then the
# GLM-4.5-Air-width MoE step of transformers and liger-gen (Liger-Kernel's, with its autotune, is run_b.sh).
source benchmarks/results/h200_2026-12-05/vlm_moe/common.sh
timeout 240 python3 -m liger_gen.cli bench-step --model qwen2.5-vl-7b-4l --providers transformers,liger-kernel,liger-gen --warmup-steps 2 --steps 8 --profile-steps 1 --out $R/vl > $R/vl.log 2>&1; echo "vl rc=$? $(( $(date +%s)-t0 ))s"; pack a
timeout $(left) python3 -m liger_gen.cli bench-step --model glm4.5-air-4l --batch-size 4 --providers transformers,liger-gen --warmup-steps 2 --steps 5 --profile-steps 1 --out $R/moe > $R/moe.log 2>&1; echo "moe rc=$? $(( $(date +%s)-t0 ))s"; pack a
summary; grep -i "error\|Traceback\|out of memory" $R/*.log | head -6; tail -5 $R/vl.log
