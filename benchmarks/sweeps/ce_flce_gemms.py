"""Measurement behind cross_entropy's heuristic and the FLCE plan space (H200 log: benchmarks/results/h200_2026-11-30/
sweep_ce_flce_gemms_h200.log). Needs CUDA.

1. cross_entropy at 8192 x 128256 bf16, GRAD_IN_FWD=1: training-step time over L2_HINTS x BLOCK_V_BWD x
   num_warps_bwd (BLOCK_M_BWD=1), each variant first checked against float64.
2. The device-to-device copy ceiling.
3. The three GEMMs of one FLCE chunk (logits, dx, dW += / dW =) at Llama-3-8B's LM head for several chunk sizes.

    python benchmarks/sweeps/ce_flce_gemms.py
"""
import itertools
import os

import torch
import triton
import triton.testing

from liger_gen.codegen.build import load_variant
from liger_gen.ops.lm_head.cross_entropy import CrossEntropyProblem
from liger_gen.ops.lm_head.cross_entropy_space import CrossEntropyConfig
OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
def bench(fn, rep=60):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
p = CrossEntropyProblem(torch.bfloat16, {"vocab": 128256}, 8192, dev, seed=0)
space = p.space; h = space.heuristic()
rows = []
for hints, bv, w in itertools.product((0, 1), (2048, 4096, 8192, 16384, 32768), (4, 8, 16, 32)):
    c = CrossEntropyConfig(**{**h.to_dict(), "GRAD_IN_FWD": 1, "BLOCK_V_BWD": bv, "num_warps_bwd": w, "L2_HINTS": hints})
    if space.violations(c): continue
    try:
        m = load_variant("cross_entropy", p.template_params(c))
        err = p.check(m, "fwd")
        rows.append((round(bench(p.launcher(m, "fwd")), 4), hints, bv, w, err))
    except Exception as e:
        rows.append((9e9, hints, bv, w, repr(e)[:100]))
rows.sort(key=lambda r: r[0])
print("CE 8192x128256 bf16 GRAD_IN_FWD=1 fwd+bwd ms (ms, L2_HINTS, BV, warps, err):")
for r in rows[:10]: print("  ", r)
print("  best without hints:", [r for r in rows if r[1] == 0][0])
# GRAD_IN_FWD=0 best few
for hints in (0, 1):
    c = CrossEntropyConfig(**{**h.to_dict(), "GRAD_IN_FWD": 0, "BLOCK_V_BWD": 4096, "num_warps_bwd": 8, "BLOCK_V_FWD": 4096, "num_warps_fwd": 8, "L2_HINTS": hints})
    m = load_variant("cross_entropy", p.template_params(c))
    print("GRAD_IN_FWD=0 4096/8 hints", hints, round(bench(p.launcher(m, "fwd")), 4), p.check(m, "fwd"))
del p; torch.cuda.empty_cache()
# copy ceiling
a = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
ms = bench(lambda: b.copy_(a)); print(f"copy 2 GiB: {ms:.3f} ms = {2*2*2**30/ms/1e6:.0f} GB/s (read+write)")
del a, b
# per-GEMM times for FLCE chunks
hd, v = 4096, 128256
x = torch.randn(8192, hd, device=dev, dtype=torch.bfloat16)
w = (torch.randn(v, hd, device=dev) * 0.03).to(torch.bfloat16)
dw = torch.zeros(v, hd, device=dev, dtype=torch.bfloat16)
for c in (512, 768, 1024, 1536, 2048, 8192):
    xc = x[:c]; lg = torch.empty(c, v, device=dev, dtype=torch.bfloat16); dx = torch.empty(c, hd, device=dev, dtype=torch.bfloat16)
    t1 = bench(lambda: torch.mm(xc, w.t(), out=lg), 30)
    t2 = bench(lambda: torch.mm(lg, w, out=dx), 30)
    t3 = bench(lambda: dw.addmm_(lg.t(), xc), 30)
    t4 = bench(lambda: torch.mm(lg.t(), xc, out=dw), 30)
    n = 8192 // c
    print(f"chunk {c}: logits {t1:.3f} dx {t2:.3f} dW+= {t3:.3f} dW= {t4:.3f} ms per chunk; x{n} chunks = {(t1+t2+t3)*n:.2f} ms")
    del lg, dx
