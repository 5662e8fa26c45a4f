"""Whether LayerNorm's wide-row backward rule (8K-element row tiles, 16 warps at 4096 columns, one program per SM,
prefetch; ``LayerNormSpace.heuristic``) would also speed up RMSNorm's and fused add + RMSNorm's backward: each
op's backward at its heuristic, its packaged H200 entry and that rule, bf16, checked against float64. Needs CUDA;
run from the repository root (H200 log: benchmarks/results/h200_2026-12-02/layer_norm/norm_wide_bwd_check.log).

    python benchmarks/sweeps/norm_wide_bwd_check.py
"""
import dataclasses, json, torch, triton.testing
from liger_gen.codegen.build import load_variant
from liger_gen.ops.norms.rms_norm import RMSNormConfig, RMSNormProblem
from liger_gen.ops.norms.fused_add_rms_norm import FusedAddRMSNormConfig, FusedAddRMSNormProblem
def bench(f): return triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median")
for op, P, C in (("rms_norm", RMSNormProblem, RMSNormConfig), ("fused_add_rms_norm", FusedAddRMSNormProblem, FusedAddRMSNormConfig)):
    ents = json.load(open(f"liger_gen/tuned/h200/{op}.json"))["entries"]
    for rows, n in ((16384, 4096), (16384, 2880), (16384, 3072), (65536, 4096), (16384, 2048)):
        p = P(torch.bfloat16, {"n_cols": n}, rows, "cuda", seed=0)
        h = p.space.heuristic()
        t = next((C.from_dict(e["config"]) for e in ents if e["dims"]["n_cols"] == n and int(e["rows"]) == rows and e["dtype"] == "bfloat16"), None)
        out = []
        for name, cfg in (("heuristic", h), ("tuned", t),
                          ("ln-wide", dataclasses.replace(h, BLOCK_M_BWD=8192 // h.BLOCK_N if h.BLOCK_N <= 4096 else 1, num_warps_bwd=16 if h.BLOCK_N == 4096 else 8, PROGRAMS_PER_SM=1, BWD_PREFETCH=1, num_stages_bwd=1, dw_strategy="persistent", TILES_PER_PROGRAM=1))):
            if cfg is None: continue
            v = p.space.violations(cfg)
            if v: out.append(f"{name} invalid"); continue
            m = load_variant(op, p.template_params(cfg))
            out.append(f"{name} {bench(p.launcher(m, 'bwd')):.4f} {p.check(m, 'bwd') or 'ok'}")
        print(op, rows, n, " | ".join(out), flush=True)
        del p; torch.cuda.empty_cache()
