import dataclasses, sys
import torch, triton.testing
from liger_gen.codegen.build import load_variant
from liger_gen.ops.cross_entropy import CrossEntropyProblem
design = sys.argv[1]
rows, vocab = 8192, 128256
p = CrossEntropyProblem(torch.bfloat16, {"vocab": vocab}, rows, "cuda", seed=0)
h = p.space.heuristic()
out = []
for i, (bv, w, bm) in enumerate(((2048, 4, 1), (8192, 8, 1), (16384, 16, 1), (16384, 32, 1))):
    c = dataclasses.replace(h, GRAD_IN_FWD=1, SPLIT_ROW=1, BLOCK_V_BWD=bv, num_warps_bwd=w, BLOCK_M_BWD=bm)
    if p.space.violations(c):
        print(design, bv, w, bm, "invalid", p.space.violations(c)); continue
    m = load_variant("cross_entropy", p.template_params(c))
    err = p.check(m, "fwd") if i in (0, 2) else "-"
    ms = triton.testing.do_bench(p.launcher(m, "fwd"), warmup=10, rep=40, return_mode="median")
    regs = ""
    try:
        for cache in m.ce_split_kernel.device_caches.values():
            for k in cache[0].values():
                regs = f"regs {k.n_regs} spills {k.n_spills}"
    except Exception as e:
        regs = repr(e)[:60]
    print(f"{design:14s} BV={bv:>5} warps={w:>2} BM={bm}: {ms:.4f} ms  {2*rows*vocab*2/ms/1e6:,.0f} GB/s  check {err or 'ok'}  {regs}", flush=True)
