"""Cost of the device-side target check of cross_entropy and fused_linear_cross_entropy on a GPU.

    python benchmarks/target_check_cost.py

For each shape: the check kernel's own GPU time (torch.profiler, mean over the timed calls), and the wall time
of one forward + backward with the check and with it switched off (the op modules' ``check_targets`` replaced by
a no-op), each the median of 5 rounds of back-to-back calls after a warm-up. Prints a markdown table.
"""

from __future__ import annotations

import statistics
import time

import torch

import liger_gen.ops.lm_head.cross_entropy as ce_mod
import liger_gen.ops.lm_head.fused_linear_cross_entropy as flce_mod
from liger_gen.functional import cross_entropy, fused_linear_cross_entropy


def wall_ms(step, calls=20, rounds=5):
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def check_kernel_us(step, calls=20):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if "targets_in_range" in e.name]
    return sum(times) / calls if times else float("nan")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| op, shape (bf16) | check kernel µs | wall ms with check | wall ms without | difference µs |")
    print("|---|---:|---:|---:|---:|")
    for op, rows, hidden, vocab in (("cross_entropy", 8192, None, 128256), ("cross_entropy", 256, None, 32000),
                                    ("fused_linear_cross_entropy", 8192, 4096, 128256),
                                    ("fused_linear_cross_entropy", 256, 1024, 32000)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
        if op == "cross_entropy":
            logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

            def step():
                cross_entropy(logits, target).backward()
            shape = f"{rows}×{vocab}"
        else:
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            w = (torch.randn(vocab, hidden, device="cuda", generator=gen) / hidden**0.5).to(torch.bfloat16)
            w.requires_grad_()

            def step():
                fused_linear_cross_entropy(x, w, target).backward()
            shape = f"{rows}×{hidden}×{vocab}"
        with_check = wall_ms(step)
        kernel = check_kernel_us(step)
        saved = (ce_mod.check_targets, flce_mod.check_targets)
        ce_mod.check_targets = flce_mod.check_targets = lambda *args: None
        try:
            without = wall_ms(step)
        finally:
            ce_mod.check_targets, flce_mod.check_targets = saved
        print(f"| {op} {shape} | {kernel:.2f} | {with_check:.4f} | {without:.4f} | "
              f"{(with_check - without) * 1e3:+.1f} |")


if __name__ == "__main__":
    main()
