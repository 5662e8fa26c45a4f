"""Host (Python) cost of one RMSNorm forward+backward call, with the kernel launches stubbed out.

Compares the two bindings of the same kernels: the torch.library custom op (what torch.compile traces) and the
eager autograd.Function that ``liger_gen.functional.rms_norm`` uses outside compilation. Runs on the CPU with
``TRITON_INTERPRET=1`` so no GPU is needed; only the Python and dispatcher work is measured.

    TRITON_INTERPRET=1 python benchmarks/host_overhead.py
"""

import os
import statistics
import time

import torch

import liger_gen
from liger_gen.ops.norms.rms_norm import RMSNormSpace
from liger_gen.runtime import ops


def per_call_us(step, n=2000, repeats=11):
    """Median over ``repeats`` of the mean wall time of ``n`` calls, in µs."""
    for _ in range(100):
        step()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def main():
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels are stubbed out, but the Triton path is taken)")
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    dy = torch.ones(64, 256)
    liger_gen.functional.rms_norm(x, w).backward(dy)  # build the variant, then stub its launches
    module, _, _ = ops.kernel_module(RMSNormSpace, x.detach(), 256, 64, casting_mode="llama")
    module.forward = lambda *a: None
    module.backward = lambda *a: None

    def eager():
        liger_gen.functional.rms_norm(x, w).backward(dy)

    def custom_op():
        torch.ops.liger_gen.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")[0].backward(dy)

    print(f"torch {torch.__version__}")
    print(f"custom op (dispatcher) fwd+bwd: {per_call_us(custom_op):7.1f} µs/call")
    print(f"eager autograd.Function fwd+bwd: {per_call_us(eager):7.1f} µs/call")


if __name__ == "__main__":
    main()
