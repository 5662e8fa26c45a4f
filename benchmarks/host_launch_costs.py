"""Host cost per call on the GPU machine: an empty Triton launch, a plain-torch forward+backward, and RMSNorm
forward(+backward) of liger-gen and Liger-Kernel on a tiny input (64 x 4096 bf16, so the GPU work is negligible and
the wall time per call is the host's). Back-to-back calls, one synchronize, wall clock / n. Needs CUDA
(H200 log: benchmarks/results/h200_2026-11-30/host_launch_costs_h200.log).

    python benchmarks/host_launch_costs.py
"""
import time, torch, triton, triton.language as tl
import liger_gen
@triton.jit
def noop(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
xs = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True); dys = torch.randn_like(xs)
def per_call(f, n=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
res = {
 "triton noop launch": per_call(lambda: noop[(1,)](x, 1, BLOCK=16)),
 "torch x*w fwd+bwd (small)": per_call(lambda: torch.autograd.grad(xs * w, (xs, w), dys)),
 "liger-gen rms_norm fwd+bwd (small 64x4096)": per_call(lambda: torch.autograd.grad(liger_gen.functional.rms_norm(xs, w), (xs, w), dys)),
 "liger-gen rms_norm fwd only (small)": per_call(lambda: liger_gen.functional.rms_norm(xs, w)),
 "torch.empty cuda": per_call(lambda: torch.empty(64, 4096, device="cuda")),
}
try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    res["liger-kernel rms_norm fwd+bwd (small)"] = per_call(lambda: torch.autograd.grad(LigerRMSNormFunction.apply(xs, w, 1e-6), (xs, w), dys))
except Exception as e: print(e)
for k, v in res.items(): print(f"{k:50s} {v:8.1f} us")
