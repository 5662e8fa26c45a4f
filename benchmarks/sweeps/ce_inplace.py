"""Cross-entropy's training step at 8192 x 128256 bf16: where the gradient is written (a separate dlogits buffer
or over the logits), how many programs stay resident (one row per program, or a persistent grid of a few
programs per SM, so the rows between the two passes fit in L2), vocab tile, warps, stages and L2 eviction hints.
Timed against the copy rate, liger-gen's packaged kernel and Liger-Kernel's in-place kernel in the same run.
Needs CUDA (H200 log: benchmarks/results/h200_2026-12-03/ce_inplace/).

    python benchmarks/sweeps/ce_inplace.py
"""
import itertools
import os
import time

import torch
import triton
import triton.language as tl
import triton.testing

from liger_gen.codegen.build import load_variant
from liger_gen.ops.lm_head.cross_entropy import CrossEntropyProblem, _launch_forward
from liger_gen.ops.lm_head.cross_entropy_rows import CrossEntropyOptions

dev = "cuda"
ROWS, VOCAB = 8192, 128256


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


@triton.jit
def ce_grad_kernel(x_ptr, y_ptr, dx_ptr, loss_ptr, n_rows, n_cols, stride, inv_n, n_prog,
                   BLOCK_V: tl.constexpr, HINTS: tl.constexpr, NUM_STAGES: tl.constexpr,
                   EXCLUDE_TARGET: tl.constexpr = 0, MASK_AFTER: tl.constexpr = 0):
    """Mean cross-entropy rows and their gradient for a unit upstream gradient: pass 1 over a row (online max and
    sum), pass 2 re-reads it and writes softmax − onehot, scaled by 1/n. Rows loop over a grid of n_prog.
    EXCLUDE_TARGET: pass 1 leaves the target column out of the sum and adds it at the end (as liger-gen's kernel
    does, for 1 − p_y to fp32 accuracy): 1 with a compare in every tile, 2 only in the tile that holds the
    target. MASK_AFTER: load masked columns as 0 and set them to −inf after (as liger-gen's kernel does, which
    also soft-caps)."""
    pid = tl.program_id(0)
    cols0 = tl.arange(0, BLOCK_V)
    for row in range(pid, n_rows, n_prog):
        base = tl.cast(row, tl.int64) * stride
        y = tl.load(y_ptr + row)
        x_y = tl.load(x_ptr + base + y).to(tl.float32)
        m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
        for start in tl.range(0, n_cols, BLOCK_V, num_stages=NUM_STAGES):
            cols = start + cols0
            mask = cols < n_cols
            fill = 0.0 if MASK_AFTER else float("-inf")
            if HINTS:
                x = tl.load(x_ptr + base + cols, mask=mask, other=fill, eviction_policy="evict_last")
            else:
                x = tl.load(x_ptr + base + cols, mask=mask, other=fill)
            x = x.to(tl.float32)
            if MASK_AFTER:
                x = tl.where(mask, x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            if EXCLUDE_TARGET == 1:
                e = tl.where(cols == y, 0.0, tl.exp(x - m_new))
            elif EXCLUDE_TARGET == 2:  # the same, only in the tile that holds the target
                if (y >= start) & (y < start + BLOCK_V):
                    e = tl.where(cols == y, 0.0, tl.exp(x - m_new))
                else:
                    e = tl.exp(x - m_new)
            else:
                e = tl.exp(x - m_new)
            s = s * tl.exp(m - m_new) + tl.sum(e, axis=0)
            m = m_new
        if EXCLUDE_TARGET:
            s = s + tl.exp(x_y - m)
        lse = m + tl.log(s)
        tl.store(loss_ptr + row, lse - x_y)
        for start in tl.range(0, n_cols, BLOCK_V, num_stages=NUM_STAGES):
            cols = start + cols0
            mask = cols < n_cols
            if HINTS:
                x = tl.load(x_ptr + base + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            else:
                x = tl.load(x_ptr + base + cols, mask=mask, other=0.0)
            g = tl.exp(x.to(tl.float32) - lse) * inv_n
            g = tl.where(cols == y, g - inv_n, g)
            if HINTS:
                tl.store(dx_ptr + base + cols, g.to(dx_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first")
            else:
                tl.store(dx_ptr + base + cols, g.to(dx_ptr.dtype.element_ty), mask=mask)


def main():
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gpu = torch.cuda.get_device_name(0)
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, {sms} SMs; CE {ROWS}x{VOCAB} bf16",
          flush=True)
    logits0 = torch.randn(ROWS, VOCAB, device=dev, dtype=torch.bfloat16) * 2
    target = torch.randint(0, VOCAB, (ROWS,), device=dev)
    nbytes = logits0.numel() * 2
    out = torch.empty_like(logits0)
    copy_ms = bench(lambda: out.copy_(logits0))
    copy_gbs = 2 * nbytes / copy_ms / 1e6
    print(f"copy ceiling: {copy_ms:.4f} ms for {2 * nbytes / 1e9:.2f} GB -> {copy_gbs:,.0f} GB/s; "
          f"one read + one write of the logits at that rate: {2 * nbytes / copy_gbs / 1e6:.4f} ms", flush=True)
    results = []

    def record(name, ms):
        results.append((ms, name))
        print(f"  {ms:.4f} ms  {name}", flush=True)

    # liger-gen's packaged kernel: heuristic config, separate dlogits buffer (what training runs) and over the logits
    p = CrossEntropyProblem(torch.bfloat16, {"vocab": VOCAB}, ROWS, dev, seed=0)
    h = p.space.heuristic()
    mod = load_variant("cross_entropy", p.template_params(h))
    record(f"liger-gen packaged step (heuristic {h.BLOCK_V_BWD}/{h.num_warps_bwd}w, separate dlogits)",
           bench(p.launcher(mod, "fwd")))
    b = p.buffers
    x_ip = logits0.clone()
    opts = CrossEntropyOptions()
    for bv, w, hints in ((2048, 4, 0), (2048, 4, 1), (4096, 8, 0), (4096, 8, 1), (8192, 16, 1)):
        c = type(h)(**{**h.to_dict(), "BLOCK_V_BWD": bv, "num_warps_bwd": w, "L2_HINTS": hints})
        m2 = load_variant("cross_entropy", p.template_params(c))

        def step_ip(m2=m2):
            _launch_forward(m2, x_ip, target, None, opts, loss_rows=b["loss_rows"], zl_rows=b["zl_rows"],
                            lse=b["lse"], q=None, scale=b["scale"], dlogits=x_ip, loss=b["loss"], zl=b["zl"])
            m2.scale_grad_(x_ip, b["grad_loss"])
        record(f"liger-gen template over the logits BV={bv} w={w} hints={hints}", bench(step_ip))
    del p, b
    torch.cuda.empty_cache()

    # Liger-Kernel (in place), forward + backward
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        xl = logits0.clone().requires_grad_(True)

        def lk():
            loss = LigerCrossEntropyFunction.apply(xl, target, None, -100, 0.0, 0.0, "mean", None)[0]
            loss.backward()
            xl.grad = None
        record("Liger-Kernel 0.8.5 forward+backward (in place)", bench(lk))
        del xl
    except ImportError as e:
        print("Liger-Kernel missing:", e)

    # the minimal two-pass kernel: where the gradient goes x residency x tile x stages x hints
    loss = torch.empty(ROWS, device=dev, dtype=torch.float32)
    dx = torch.empty_like(logits0)
    x = logits0.clone()
    ref_loss = torch.nn.functional.cross_entropy(logits0.float(), target, reduction="none")
    t0 = time.time()
    grid_rows = [("one row per program", ROWS)] + [(f"{k}/SM persistent", k * sms) for k in (1, 2, 4, 8)]
    tiles = ((2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), (8192, 32), (16384, 32))
    for (bv, w), stages, hints in itertools.product(tiles, (1, 3), (0, 1)):
        for label, nprog in grid_rows:
            for inplace in (0, 1):
                dst = x if inplace else dx
                go = lambda: ce_grad_kernel[(nprog,)](x, target, dst, loss, ROWS, VOCAB, VOCAB, 1.0 / ROWS, nprog,
                                                     BLOCK_V=bv, HINTS=hints, NUM_STAGES=stages, num_warps=w)
                try:
                    x.copy_(logits0)
                    go()
                    torch.cuda.synchronize()
                    err = ((loss - ref_loss).abs().max() / ref_loss.abs().max()).item()
                    ms = bench(go, 100)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported and skipped
                    print(f"  failed BV={bv} w={w} st={stages}: {repr(e)[:120]}")
                    continue
                record(f"minimal {'over logits' if inplace else 'separate dx '} BV={bv:5d} w={w:2d} st={stages} "
                       f"hints={hints} {label} (loss err {err:.1e})", ms)
    print(f"minimal-kernel sweep: {time.time() - t0:.0f} s")
    results.sort()
    print("\nfastest 15 (ms, % of the copy rate for one read + one write of the logits):")
    for ms, name in results[:15]:
        print(f"  {ms:.4f}  {100 * 2 * nbytes / copy_gbs / 1e6 / ms:5.1f}%  {name}")
    for ms, name in sorted(results, key=lambda r: r[1]):
        if not name.startswith("minimal"):
            print(f"  {ms:.4f}  {100 * 2 * nbytes / copy_gbs / 1e6 / ms:5.1f}%  {name}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ce_inplace_results.tsv"), "w") as f:
            for ms, name in results:
                f.write(f"{ms:.5f}\t{name}\n")


if __name__ == "__main__":
    main()
