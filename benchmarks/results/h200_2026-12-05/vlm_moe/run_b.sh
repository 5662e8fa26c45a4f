# H200 call 2: the GLM-4.5-Air-width MoE step of Liger-Kernel (its modules composed for glm4_moe), its fused MoE's
# autotune warmed and timed before the steps; same batches and weights (seed 0) as run_a.sh's providers.
source benchmarks/results/h200_2026-12-05/vlm_moe/common.sh
timeout $(left) python3 -m liger_gen.cli bench-step --model glm4.5-air-4l --batch-size 4 --providers liger-kernel --warmup-steps 2 --steps 5 --profile-steps 1 --out $R/moe_lk > $R/moe_lk.log 2>&1; echo "moe_lk rc=$? $(( $(date +%s)-t0 ))s"; pack b
summary; grep -i "error\|Traceback\|out of memory" $R/*.log | head -6
