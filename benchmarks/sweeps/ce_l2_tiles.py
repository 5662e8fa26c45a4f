"""Cross-entropy's two-pass gradient kernel at 8192 x 128256 bf16 with the largest vocab tiles (16K and 32K
columns on 16 or 32 warps: few rows in flight, so a row may still be in L2 for its second pass), against
Liger-Kernel's kernel alone. Times are GPU kernel time from torch.profiler (the op benchmark's measure), summed
per kernel name over 20 calls. Needs CUDA (H200 log: benchmarks/results/h200_2026-12-03/ce_inplace/).

    python benchmarks/sweeps/ce_l2_tiles.py
"""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from ce_inplace import ce_grad_kernel  # noqa: E402

from liger_gen.codegen.build import load_variant  # noqa: E402
from liger_gen.ops.lm_head.cross_entropy import CrossEntropyProblem  # noqa: E402

ROWS, VOCAB, CALLS = 8192, 128256, 20


def kernel_ms(fn, calls=CALLS):
    """{kernel name: mean ms per call} of fn's CUDA kernels over ``calls`` calls, after 3 untimed ones."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and getattr(e, "device_time_total", 0) > 0:
            out[e.key[:60]] = e.device_time_total / 1000 / calls
    return out


def show(name, times):
    total = sum(times.values())
    parts = ", ".join(f"{k} {v:.4f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:3])
    print(f"{total:8.4f} ms  {name}   [{parts}]", flush=True)
    return total


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; CE {ROWS}x{VOCAB} bf16, kernel ms per call")
    logits0 = torch.randn(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16) * 2
    target = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        base = logits0.clone().requires_grad_(True)

        def lk():  # a non-leaf input, as logits are in training: no AccumulateGrad copy of the gradient
            x = base.view(ROWS, VOCAB)
            loss = LigerCrossEntropyFunction.apply(x, target, None, -100, 0.0, 0.0, "mean", None)[0]
            (g,) = torch.autograd.grad(loss, x)
            return g
        show("Liger-Kernel 0.8.5 forward+backward (in place)", kernel_ms(lk))
        del base
    except ImportError as e:
        print("Liger-Kernel missing:", e)
    p = CrossEntropyProblem(torch.bfloat16, {"vocab": VOCAB}, ROWS, "cuda", seed=0)
    h = p.space.heuristic()
    show(f"liger-gen packaged step (heuristic {h.BLOCK_V_BWD}/{h.num_warps_bwd}w)",
         kernel_ms(p.launcher(load_variant("cross_entropy", p.template_params(h)), "fwd")))
    for bv, w in ((8192, 16), (16384, 32), (32768, 32)):
        c = type(h)(**{**h.to_dict(), "BLOCK_V_BWD": bv, "num_warps_bwd": w, "L2_HINTS": 1})
        if p.space.violations(c):
            print("invalid", bv, w, p.space.violations(c))
            continue
        show(f"liger-gen template BV={bv} w={w} hints=1",
             kernel_ms(p.launcher(load_variant("cross_entropy", p.template_params(c)), "fwd")))
    del p
    torch.cuda.empty_cache()
    x = logits0.clone()
    dx = torch.empty_like(x)
    loss = torch.empty(ROWS, device="cuda", dtype=torch.float32)
    for bv, w, hints, st in ((2048, 4, 0, 1), (4096, 8, 1, 1), (8192, 16, 1, 1), (16384, 16, 1, 1), (16384, 32, 0, 1),
                             (32768, 32, 0, 1), (32768, 32, 1, 1), (32768, 16, 0, 1), (32768, 32, 0, 2)):
        for inplace in (0, 1):
            dst = x if inplace else dx
            go = lambda: ce_grad_kernel[(ROWS,)](x, target, dst, loss, ROWS, VOCAB, VOCAB, 1.0 / ROWS, ROWS,
                                                BLOCK_V=bv, HINTS=hints, NUM_STAGES=st, num_warps=w)
            try:
                show(f"minimal {'over logits' if inplace else 'separate dx'} BV={bv} w={w} hints={hints} st={st}",
                     kernel_ms(go))
            except Exception as e:  # noqa: BLE001 - report and go on
                print("failed", bv, w, repr(e)[:120])
    for bv, w, hints in ((2048, 4, 0), (32768, 32, 1)):
        for excl, after in ((1, 0), (2, 0), (0, 1), (1, 1), (2, 1)):
            go = lambda: ce_grad_kernel[(ROWS,)](x, target, dx, loss, ROWS, VOCAB, VOCAB, 1.0 / ROWS, ROWS,
                                                BLOCK_V=bv, HINTS=hints, NUM_STAGES=1, EXCLUDE_TARGET=excl,
                                                MASK_AFTER=after, num_warps=w)
            show(f"minimal separate dx BV={bv} w={w} hints={hints} exclude_target={excl} mask_after={after}",
                 kernel_ms(go))
    out = torch.empty_like(logits0)
    show("copy of the logits (one read + one write)", kernel_ms(lambda: out.copy_(logits0)))


if __name__ == "__main__":
    main()
