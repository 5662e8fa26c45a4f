"""Peak extra memory and time of fused linear cross-entropy on the plain-PyTorch CPU path against unfused torch.

    python benchmarks/flce_cpu_memory.py [--shapes 4096x1024x32000:float32,256x2048x32000:bfloat16]

Memory is counted as the tests count it (``tests/conftest.py``'s StoragePeak: live tensor storages created during
one forward + backward, at their peak), minus the gradients of x and W that both return. Time is one forward +
backward after a warm-up call, wall clock. Prints one markdown row per shape and provider.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"  # the plain path; the interpreter would take minutes at these shapes

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import StoragePeak  # noqa: E402

from liger_gen.functional import fused_linear_cross_entropy  # noqa: E402
from liger_gen.ops.lm_head.fused_linear_cross_entropy import fused_linear_cross_entropy_torch  # noqa: E402


def measure(fn, x, w, target):
    def step():
        x.grad = w.grad = None
        fn(x, w, target).backward()

    step()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    x.grad = w.grad = None
    with StoragePeak() as meter:
        fn(x, w, target).backward()
    grads = x.grad.untyped_storage().nbytes() + w.grad.untyped_storage().nbytes()
    return (meter.peak - grads) / 2**20, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x1024x32000:float32,256x2048x32000:bfloat16")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| rows × hidden × vocab, dtype | provider | extra MiB | s per fwd+bwd |")
    print("|---|---|---:|---:|")
    for spec in args.shapes.split(","):
        dims, dtype = spec.split(":")
        rows, hidden, vocab = (int(v) for v in dims.split("x"))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, hidden, generator=gen).to(getattr(torch, dtype)).requires_grad_()
        w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(x.dtype).requires_grad_()
        target = torch.randint(0, vocab, (rows,), generator=gen)
        for name, fn in (("liger-gen (plain CPU path)", fused_linear_cross_entropy),
                         ("torch, unfused", fused_linear_cross_entropy_torch)):
            mib, seconds = measure(fn, x, w, target)
            print(f"| {rows}×{hidden}×{vocab}, {dtype} | {name} | {mib:,.0f} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
