"""Measurement behind LayerNorm's backward kernel structure. Needs CUDA.

LayerNorm's backward (dx = rstd·(g − mean(g) − xhat·mean(g·xhat)), g = dy·w; dW = Σ dy·xhat; dB = Σ dy) ran at
about 70% of the copy rate at 16384 × 4096 bf16 where RMSNorm's, from the same template family, ran at about
87%. This sweep times stand-alone backward kernels that differ from the packaged one in one structural choice
each, over the launch settings the tuner searches, against the packaged kernel (heuristic and tuned) and
RMSNorm's at the same shape:

    FUSED    the two per-row sums in one reduction (tl.reduce over a pair) instead of two tl.sum calls
    VEC_ACC  dW and dB summed per tile into a row vector instead of a BLOCK_M x BLOCK_N accumulator
    PREFETCH the next tile's loads issued before this tile's reductions

Every variant is checked against the float64 reference first (LayerNormProblem.check).

    python benchmarks/sweeps/layer_norm_bwd.py [--shapes 16384x4096,16384x2880,4096x3072]
"""
import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl
import triton.testing

from liger_gen.codegen.build import load_variant
from liger_gen.ops.norms.layer_norm import LayerNormConfig, LayerNormProblem
from liger_gen.ops.norms.rms_norm import RMSNormConfig, RMSNormProblem


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _load_tile(dy_ptr, x_ptr, mean_ptr, rstd_ptr, tile, n_rows, n_cols, cols, col_mask, BLOCK_M: tl.constexpr):
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    return dy, x, mean, rstd


@triton.jit
def ln_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr, n_rows, n_cols,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED: tl.constexpr, VEC_ACC: tl.constexpr,
                  PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if VEC_ACC:
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_iter = tl.cdiv(tl.cdiv(n_rows, BLOCK_M) - pid, step)
    if PREFETCH:
        dy_n, x_n, mean_n, rstd_n = _load_tile(dy_ptr, x_ptr, mean_ptr, rstd_ptr, pid, n_rows, n_cols, cols,
                                               col_mask, BLOCK_M)
    for i in range(n_iter):
        tile = pid + i * step
        if PREFETCH:
            dy, x, mean, rstd = dy_n, x_n, mean_n, rstd_n
            dy_n, x_n, mean_n, rstd_n = _load_tile(dy_ptr, x_ptr, mean_ptr, rstd_ptr, tile + step, n_rows, n_cols,
                                                   cols, col_mask, BLOCK_M)
        else:
            dy, x, mean, rstd = _load_tile(dy_ptr, x_ptr, mean_ptr, rstd_ptr, tile, n_rows, n_cols, cols, col_mask,
                                           BLOCK_M)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy * w[None, :]
        if FUSED:
            s_xhat, s_g = tl.reduce((g * xhat, g), 1, _add_pair)
        else:
            s_xhat = tl.sum(g * xhat, axis=1)
            s_g = tl.sum(g, axis=1)
        dx = (g - xhat * (s_xhat / n_cols)[:, None] - (s_g / n_cols)[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)
        if VEC_ACC:
            dw_acc += tl.sum(dy * xhat, axis=0)
            db_acc += tl.sum(dy, axis=0)
        else:
            dw_acc += dy * xhat
            db_acc += dy
    if VEC_ACC:
        dw_row, db_row = dw_acc, db_acc
    else:
        dw_row, db_row = tl.sum(dw_acc, axis=0), tl.sum(db_acc, axis=0)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw_row, mask=col_mask)
    tl.store(db_partial_ptr + pid.to(tl.int64) * n_cols + cols, db_row, mask=col_mask)


class Variant:
    """Quacks like a rendered layer_norm module for LayerNormProblem's launcher and check."""

    def __init__(self, reducer, block_m, warps, stages, programs_per_sm, fused, vec_acc, prefetch, block_n):
        self.reducer = reducer  # the packaged module: its fixed-order dW/dB reduction kernel
        self.block_m, self.warps, self.stages, self.pps = block_m, warps, stages, programs_per_sm
        self.fused, self.vec_acc, self.prefetch, self.block_n = fused, vec_acc, prefetch, block_n

    def num_bwd_programs(self, n_rows, num_sms):
        return max(1, min(triton.cdiv(n_rows, self.block_m), self.pps * num_sms))

    def backward(self, dy, x, w, mean, rstd, dx, dw, db, dw_partial, db_partial, num_sms):
        n_rows, n_cols = x.shape
        n = self.num_bwd_programs(n_rows, num_sms)
        ln_bwd_kernel[(n,)](dy, x, w, mean, rstd, dx, dw_partial, db_partial, n_rows, n_cols,
                            BLOCK_M=self.block_m, BLOCK_N=self.block_n, FUSED=self.fused, VEC_ACC=self.vec_acc,
                            PREFETCH=self.prefetch, num_warps=self.warps, num_stages=self.stages)
        r = self.reducer
        r.dwdb_reduce_kernel[(triton.cdiv(n_cols, r.REDUCE_BLOCK_C),)](
            dw_partial, db_partial, dw, db, n, n_cols, HAS_WEIGHT=True, HAS_BIAS=True,
            BLOCK_P=r.REDUCE_BLOCK_P, BLOCK_C=r.REDUCE_BLOCK_C, num_warps=4)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def tuned_config(op, n_cols, rows):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "liger_gen", "tuned", "h200", f"{op}.json")
    for e in json.load(open(path))["entries"]:
        if e["dims"].get("n_cols") == n_cols and e["dtype"] == "bfloat16" and int(e.get("rows", 0)) == rows:
            return e["config"]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x4096,16384x2880,4096x3072,16384x2048")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_gbs = None
    a = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy_gbs = 2 * a.numel() / bench(lambda: b.copy_(a)) / 1e6
    del a, b
    print(f"copy ceiling {copy_gbs:.0f} GB/s")
    summary = []
    for shape in args.shapes.split(","):
        rows, n_cols = map(int, shape.split("x"))
        p = LayerNormProblem(torch.bfloat16, {"n_cols": n_cols}, rows, dev, seed=0)
        space = p.space
        heur = space.heuristic()
        reducer = load_variant("layer_norm", p.template_params(heur))
        floor = p.bytes_moved("bwd") / (copy_gbs * 1e6)
        base = {}
        for name, cfg in (("packaged heuristic", heur), ("packaged tuned", tuned_config("layer_norm", n_cols, rows))):
            if cfg is None:
                continue
            cfg = cfg if isinstance(cfg, LayerNormConfig) else LayerNormConfig.from_dict(cfg)
            m = load_variant("layer_norm", p.template_params(cfg))
            base[name] = (bench(p.launcher(m, "bwd")), p.check(m, "bwd"))
        rp = RMSNormProblem(torch.bfloat16, {"n_cols": n_cols}, rows, dev, seed=0)
        rcfg = tuned_config("rms_norm", n_cols, rows)
        rcfg = RMSNormConfig.from_dict(rcfg) if rcfg else rp.space.heuristic()
        rm = load_variant("rms_norm", rp.template_params(rcfg))
        rms_ms = bench(rp.launcher(rm, "bwd"))
        rms_floor = rp.bytes_moved("bwd") / (copy_gbs * 1e6)
        del rp
        results = []
        for block_m, warps, stages, pps, fused, vec, pre in itertools.product(
                (1, 2, 4), (4, 8, 16), (1, 2), (1, 2, 4), (0, 1), (0, 1), (0, 1)):
            elems = block_m * heur.BLOCK_N // (warps * 32) * (2 if pre else 1)
            if elems > 64 or elems < 1:
                continue
            v = Variant(reducer, block_m, warps, stages, pps, fused, vec, pre, heur.BLOCK_N)
            try:
                err = p.check(v, "bwd")
                ms = bench(p.launcher(v, "bwd")) if err is None else float("inf")
            except Exception as e:  # noqa: BLE001 - a sweep records what failed and goes on
                err, ms = repr(e)[:120], float("inf")
            results.append((ms, dict(BLOCK_M=block_m, warps=warps, stages=stages, pps=pps, FUSED=fused,
                                     VEC_ACC=vec, PREFETCH=pre), err))
        results.sort(key=lambda r: r[0])
        print(f"\nLayerNorm backward {rows}x{n_cols} bf16 (minimal bytes at the copy rate: {floor:.4f} ms)")
        for name, (ms, err) in base.items():
            print(f"  {name:20s} {ms:.4f} ms  {100 * floor / ms:5.1f}% of copy  check {err or 'ok'}")
        print(f"  {'RMSNorm (packaged)':20s} {rms_ms:.4f} ms  {100 * rms_floor / rms_ms:5.1f}% of copy")
        for ms, params, err in results[:args.top]:
            print(f"  {ms:.4f} ms  {100 * floor / ms:5.1f}%  {params}  {err or 'ok'}")
        for flag in ("FUSED", "VEC_ACC", "PREFETCH"):
            for val in (0, 1):
                best = next((r for r in results if r[1][flag] == val and r[0] < float("inf")), None)
                if best:
                    print(f"  best with {flag}={val}: {best[0]:.4f} ms {best[1]}")
        failed = [r for r in results if r[2]]
        print(f"  {len(results)} variants, {len(failed)} failed" + (f" (first: {failed[0][2]})" if failed else ""))
        summary.append((shape, base.get("packaged tuned", base["packaged heuristic"])[0], results[0][0], floor,
                        rms_ms, results[0][1]))
        del p
        torch.cuda.empty_cache()
    print("\nshape | packaged (tuned) ms | best variant ms | % of copy packaged -> best | RMSNorm ms | best variant")
    for shape, pk, best, floor, rms, params in summary:
        print(f"{shape} | {pk:.4f} | {best:.4f} | {100 * floor / pk:.1f} -> {100 * floor / best:.1f} | {rms:.4f} | "
              f"{params}")


if __name__ == "__main__":
    main()
