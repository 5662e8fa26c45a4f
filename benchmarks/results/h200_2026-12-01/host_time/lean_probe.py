# wall time per fwd+bwd with the lean launch path on and off (Triton's JITFunction.run), same process
import time, torch, liger_gen
from liger_gen.codegen import launch
pc = time.perf_counter
def per_call(f, n=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = pc()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (pc() - t) / n * 1e6
cases = {}
for rows in (64, 16384):
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True); dy = torch.randn_like(x)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cases[f"rms_norm {rows}x4096"] = (lambda x=x, w=w, dy=dy: torch.autograd.grad(liger_gen.functional.rms_norm(x, w), (x, w), dy))
q = torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(4, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
cos = torch.randn(1, 4096, 128, device="cuda", dtype=torch.bfloat16); sin = torch.randn_like(cos)
gq, gk = torch.randn_like(q), torch.randn_like(k)
cases["rope llama3-8b"] = lambda: torch.autograd.grad(liger_gen.functional.rope(q, k, cos, sin), (q, k), (gq, gk))
orig = launch.LeanLaunch._lean_direct
for name, f in cases.items():
    on = per_call(f)
    launch.LeanLaunch._lean_direct = lambda self: False
    off = per_call(f)
    launch.LeanLaunch._lean_direct = orig
    print(f"{name:22s} lean {on:7.1f} us   JITFunction.run {off:7.1f} us")
