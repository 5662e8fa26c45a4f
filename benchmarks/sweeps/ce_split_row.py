"""Measurement of cross_entropy's SPLIT_ROW variants (H200 log: benchmarks/results/h200_2026-12-02/split_row/
sweep_ce_split_row_h200.log, the first shape only: the run was stopped by its time limit). Needs CUDA.

For each (rows, vocab) below, bf16: the training-step time (forward writing dlogits, then the backward) of the
streaming heuristic and of every valid SPLIT_ROW=1 variant over BLOCK_V_BWD x num_warps_bwd x BLOCK_M_BWD, each
first checked against float64; then the best split variant writing its gradient over the logits (in place, as
FLCE's chunks and Liger-Kernel do), and the device-to-device copy ceiling.

    python benchmarks/sweeps/ce_split_row.py
"""
import dataclasses
import itertools

import torch
import triton.testing

from liger_gen.codegen.build import load_variant
from liger_gen.ops.cross_entropy import CrossEntropyProblem


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=20, rep=rep, return_mode="median")


def sweep(rows: int, vocab: int) -> None:
    p = CrossEntropyProblem(torch.bfloat16, {"vocab": vocab}, rows, "cuda", seed=0)
    h = p.space.heuristic()
    minimal = 2 * rows * vocab * 2  # logits read once, dlogits written once
    results = []
    for split, bv, w, bm in itertools.chain(
            [(h.SPLIT_ROW, h.BLOCK_V_BWD, h.num_warps_bwd, h.BLOCK_M_BWD)],
            itertools.product((1,), (2048, 4096, 8192, 16384, 32768), (4, 8, 16, 32), (1, 2))):
        c = dataclasses.replace(h, GRAD_IN_FWD=1, SPLIT_ROW=split, BLOCK_V_BWD=bv, num_warps_bwd=w, BLOCK_M_BWD=bm)
        if p.space.violations(c):
            continue
        try:
            m = load_variant("cross_entropy", p.template_params(c))
            err = p.check(m, "fwd")
            ms = bench(p.launcher(m, "fwd"))
        except Exception as e:  # a variant that fails to compile or run is reported, not fatal
            err, ms = repr(e)[:120], float("inf")
        results.append((ms, split, bv, w, bm, err, c))
    base = results[0]
    results.sort(key=lambda r: r[0])
    print(f"\ncross_entropy {rows}x{vocab} bf16, training step (ms; GB/s of the minimal {minimal / 1e9:.2f} GB):")
    print(f"  heuristic    SPLIT_ROW={base[1]} BLOCK_V_BWD={base[2]} warps={base[3]} BLOCK_M={base[4]}: "
          f"{base[0]:.4f} ms, {minimal / base[0] / 1e6:,.0f} GB/s, check: {base[5] or 'ok'}")
    for ms, split, bv, w, bm, err, _ in results[:12]:
        print(f"  SPLIT_ROW={split} BLOCK_V_BWD={bv:>5} warps={w:>2} BLOCK_M={bm}: {ms:.4f} ms, "
              f"{minimal / ms / 1e6:,.0f} GB/s, check: {err or 'ok'}")
    bad = [r for r in results if r[5]]
    print(f"  {len(results)} variants, {len(bad)} failed the float64 check" + "".join(
        f"\n    failed: SPLIT_ROW={r[1]} BLOCK_V_BWD={r[2]} warps={r[3]} BLOCK_M={r[4]}: {r[5]}" for r in bad[:5]))
    best = next(r for r in results if r[1] == 1 and not r[5])
    m = load_variant("cross_entropy", p.template_params(best[6]))
    b = p.buffers
    work = b["logits"].clone()

    def in_place():
        m.mean_scale(b["target"], None, b["scale"], vocab, p.options.ignore_index)
        m.forward(work, b["target"], None, b["loss_rows"], b["zl_rows"], b["lse"], None, work, b["scale"], None,
                  *p.options.row)
        m.reduce(b["loss_rows"], b["zl_rows"], b["scale"], b["loss"], b["zl"])

    ms = bench(in_place)
    print(f"  best split in place (dlogits over the logits): {ms:.4f} ms, {minimal / ms / 1e6:,.0f} GB/s")
    del p, work
    torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for rows, vocab in ((8192, 128256), (8192, 151936), (4096, 128256)):
        sweep(rows, vocab)
    a = torch.empty(2 * 2 ** 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    print(f"\ncopy 2 GiB: {ms:.3f} ms = {2 * 2 * 2 ** 30 / ms / 1e6:,.0f} GB/s (read + write)")
