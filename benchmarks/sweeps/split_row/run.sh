# Each design of cross_entropy's split-row kernel (ticket or program id, acquire or volatile polling, release or
# relaxed arrival, or no wait at all), timed at 8192 x 128256 bf16. Run from the repository root on a GPU
# machine; the template is rewritten per design and restored at the end.
# Logs: benchmarks/results/h200_2026-12-02/split_row/designs*.log
cp liger_gen/templates/cross_entropy.py.jinja /tmp/ce.orig
for d in nowait pid_nowait atomic relaxed volatile atomic_pid volatile_pid relaxed_nowait relaxed_wait; do
  cp /tmp/ce.orig liger_gen/templates/cross_entropy.py.jinja
  python benchmarks/sweeps/split_row/make_design.py "$d"
  timeout 75 python benchmarks/sweeps/split_row/split_designs.py "$d" 2>&1 | grep -v Warning
done
cp /tmp/ce.orig liger_gen/templates/cross_entropy.py.jinja
