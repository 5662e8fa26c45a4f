# Does a torch.profiler session change the host time of later calls in the same process?
import time, statistics, torch, liger_gen
pc = time.perf_counter
x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True); dy = torch.randn_like(x)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
xs = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True); dys = torch.randn_like(xs)
F = liger_gen.functional
def loops(f, n=100, rounds=5):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize(); t = pc()
        for _ in range(n): f()
        torch.cuda.synchronize(); out.append((pc() - t) / n * 1e6)
    return statistics.median(out)
big = lambda: torch.autograd.grad(F.rms_norm(x, w), (x, w), dy)
small = lambda: torch.autograd.grad(F.rms_norm(xs, w), (xs, w), dys)
for _ in range(20): big(); small()
before = (loops(big), loops(small))
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
    for _ in range(10): big()
    torch.cuda.synchronize()
after = (loops(big), loops(small))
print(f"rms_norm fwd+bwd per call (us): 16384x4096 before profiler {before[0]:.1f} after {after[0]:.1f}; "
      f"8x4096 before {before[1]:.1f} after {after[1]:.1f}")
