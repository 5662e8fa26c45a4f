"""The norms' second dW pass: column sums of the backward programs' (P, n_cols) fp32 partial rows, in a fixed
order. One program per BLOCK_C columns walks all P partial rows, so at narrow rows few programs share the work
(896 columns / 64 = 14 programs: 14 of 132 SMs read the partials). This sweep times the kernel's tile shapes
(BLOCK_P x BLOCK_C, warps) at the partial counts the backward strategies make (persistent: 1-4 programs per SM;
blocked: one per 1-4 row tiles of 16384 rows) and the widths of the presets. GPU kernel time from torch.profiler,
mean per call over 50 calls. Needs CUDA.

    python benchmarks/sweeps/dw_reduce.py
"""
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from ce_l2_tiles import kernel_ms as kernel_ms_by_name  # noqa: E402  (torch.profiler, mean ms per call)


@triton.jit
def reduce_kernel(part_ptr, out_ptr, n_partials, n_cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(part_ptr + parts.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=col_mask)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)} ({sms} SMs), torch {torch.__version__}, Triton {triton.__version__}; "
          f"kernel us per call")
    tiles = [(32, 64, 4), (64, 32, 4), (128, 16, 4), (256, 8, 4), (64, 64, 4), (128, 32, 4), (32, 128, 4),
             (16, 64, 2), (64, 16, 2), (128, 8, 2), (32, 32, 2)]
    partials = [sms, 2 * sms, 4 * sms, 1024, 2048, 4096]
    best = {}
    print(f"{'cols':>5} {'P':>5} " + " ".join(f"{p}x{c}/{w}".rjust(9) for p, c, w in tiles))
    for n_cols, n_partials in itertools.product([896, 2048, 2880, 3072, 4096, 8192], partials):
        part = torch.randn(n_partials, n_cols, device="cuda")
        ref = part.double().sum(0)
        out = torch.empty(n_cols, device="cuda")
        row = []
        for p, c, w in tiles:
            def run(p=p, c=c, w=w):
                reduce_kernel[(triton.cdiv(n_cols, c),)](part, out, n_partials, n_cols, BLOCK_P=p, BLOCK_C=c,
                                                         num_warps=w)
            run()
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, (n_cols, n_partials, p, c, err)
            row.append(sum(kernel_ms_by_name(run, calls=50).values()) * 1000)
        k = min(range(len(tiles)), key=row.__getitem__)
        best[(n_cols, n_partials)] = (tiles[k], row[k], row[0])
        print(f"{n_cols:5d} {n_partials:5d} " + " ".join(f"{t:9.2f}" for t in row), flush=True)
    print("\nbest tile per shape (us; the current 32x64/4 for comparison)")
    for (n_cols, n_partials), (tile, t, cur) in best.items():
        print(f"{n_cols:5d} {n_partials:5d}  {tile[0]}x{tile[1]}/{tile[2]}  {t:7.2f}  current {cur:7.2f}  "
              f"grid {triton.cdiv(n_cols, tile[1])}")


if __name__ == "__main__":
    main()
