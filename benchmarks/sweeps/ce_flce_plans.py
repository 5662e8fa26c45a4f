"""cross_entropy's gradient-writing kernel over BLOCK_V x BLOCK_M x warps x stages, then whole FLCE calls
(8192 x 4096 x 128256 bf16) for chunk sizes x per-chunk CE settings, with peak extra memory beyond dx and dW
(H200 log: benchmarks/results/h200_2026-11-30/sweep_ce_flce_plans_h200.log). Needs CUDA.

    python benchmarks/sweeps/ce_flce_plans.py
"""
import dataclasses
import itertools
import time

import torch
import triton
import triton.testing

from liger_gen.codegen.build import load_variant
from liger_gen.ops.lm_head.cross_entropy import CrossEntropyProblem
from liger_gen.ops.lm_head.cross_entropy_rows import CrossEntropyOptions
from liger_gen.ops.lm_head.cross_entropy_space import CrossEntropyConfig
from liger_gen.ops.lm_head import fused_linear_cross_entropy as F
from liger_gen.ops.lm_head.fused_linear_cross_entropy_plan import FusedLinearCrossEntropySpace
dev = "cuda"
def bench(fn, rep=60):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
p = CrossEntropyProblem(torch.bfloat16, {"vocab": 128256}, 8192, dev, seed=0)
space = p.space; h = space.heuristic()
rows = []
t0 = time.time()
for bv, bm, w, st in itertools.product((512, 1024, 2048, 4096), (1, 2, 4), (2, 4, 8), (1, 3)):
    c = CrossEntropyConfig(**{**h.to_dict(), "GRAD_IN_FWD": 1, "BLOCK_V_BWD": bv, "BLOCK_M_BWD": bm, "num_warps_bwd": w, "num_stages_bwd": st})
    if space.violations(c): continue
    try:
        m = load_variant("cross_entropy", p.template_params(c))
        err = p.check(m, "fwd")
        rows.append((round(bench(p.launcher(m, "fwd"), 40), 4), bv, bm, w, st, err))
    except Exception as e:
        rows.append((9e9, bv, bm, w, st, repr(e)[:100]))
rows.sort(key=lambda r: r[0])
print(f"CE 8192x128256 bf16 GRAD_IN_FWD=1 (ms, BV, BM, warps, stages, err) [{time.time()-t0:.0f}s]; heuristic {h.BLOCK_V_BWD}/{h.num_warps_bwd}:")
for r in rows[:8]: print("  ", r)
del p; torch.cuda.empty_cache()
m_, hd, v = 8192, 4096, 128256
x = torch.randn(m_, hd, device=dev, dtype=torch.bfloat16)
w = (torch.randn(v, hd, device=dev) * (2 / hd ** 0.5)).to(torch.bfloat16)
t = torch.randint(0, v, (m_,), device=dev)
sp = FusedLinearCrossEntropySpace({"hidden": hd, "vocab": v}, torch.bfloat16)
hh = sp.heuristic(); print("FLCE heuristic", hh)
for chunk in (512, 768, 1024):
    for bv, bm, wp in ((2048, 1, 4), (1024, 2, 4), (4096, 1, 8)):
        plan = dataclasses.replace(hh, CHUNK_ROWS=chunk, CE_BLOCK_V=bv, CE_BLOCK_M=bm, CE_WARPS=wp)
        go = lambda: F._fwd_impl(x, w, t, None, None, CrossEntropyOptions(), True, True, False, plan)
        go(); torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        out = go(); torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - (m_ * hd * 2 + v * hd * 2)
        del out
        print(f"FLCE chunk {chunk} CE {bv}/{bm}/{wp}: {bench(go, 300):.2f} ms, extra {peak/2**20:.0f} MiB", flush=True)
