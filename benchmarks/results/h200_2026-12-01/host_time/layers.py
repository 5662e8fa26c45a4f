# Host cost of each layer of a RoPE / RMSNorm call on this machine (tiny inputs: the device never waits on the host)
import time, statistics, torch, liger_gen
from liger_gen.ops import rope as R, rms_norm as N
from liger_gen.runtime.ops import kernel_module
pc = time.perf_counter
def us(f, n=400, rounds=5):
    for _ in range(30): f()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize(); t = pc()
        for _ in range(n): f()
        torch.cuda.synchronize(); out.append((pc() - t) / n * 1e6)
    return statistics.median(out)
bf, dev = torch.bfloat16, "cuda"
q = torch.randn(1, 32, 8, 128, device=dev, dtype=bf, requires_grad=True); k = torch.randn(1, 8, 8, 128, device=dev, dtype=bf, requires_grad=True)
c = torch.randn(1, 8, 128, device=dev, dtype=bf); gq, gk = torch.randn_like(q), torch.randn_like(k)
qo, ko = torch.empty_like(q), torch.empty_like(k)
module, _, _ = kernel_module(R.RoPESpace, q, R._dims(q, k, c), 8)
kern = module.rope_kernel
rows = {}
rows["rope: F.rope fwd+bwd (autograd.grad)"] = us(lambda: torch.autograd.grad(liger_gen.functional.rope(q, k, c, c), (q, k), (gq, gk)))
rows["rope: rope_4d fwd+bwd (no public checks)"] = us(lambda: torch.autograd.grad(R.rope_4d(q, k, c, c, None), (q, k), (gq, gk)))
with torch.no_grad():
    rows["rope: F.rope fwd, no_grad"] = us(lambda: liger_gen.functional.rope(q, k, c, c))
    rows["rope: _fwd_impl (alloc + module.forward)"] = us(lambda: R._fwd_impl(q, k, c, c, None))
    rows["rope: module.forward (template launch fn)"] = us(lambda: module.forward(q, k, c, c, None, qo, ko))
    rows["rope: 2x torch.empty_like"] = us(lambda: (torch.empty_like(q), torch.empty_like(k)))
    rows["rope: kernel_module lookup"] = us(lambda: kernel_module(R.RoPESpace, q, R._dims(q, k, c), 8))
    # the floor of one launch: the memoised entry's launcher called with precomputed arguments
    run, fn, packed, tail = next(iter(kern._lean_fast.values()))
    rec = {}
    orig = kern._lean_launch
    def spy(grid, args, kwargs):
        rec["grid"], rec["args"], rec["kw"] = grid, args, dict(kwargs)
        return orig(grid, args, kwargs)
    kern._lean_launch = spy
    module.forward(q, k, c, c, None, qo, ko)
    kern._lean_launch = orig
    g, a = rec["grid"], rec["args"]
    rows["rope: CompiledKernel.run, args ready"] = us(lambda: run(g[0], 1, 1, torch._C._cuda_getCurrentRawStream(0), fn, packed, None, None, None, *a, *tail))
    kw = rec["kw"]
    rows["rope: lean launch (key + lookup + run)"] = us(lambda: orig(g, a, kw))
x = torch.randn(8, 4096, device=dev, dtype=bf, requires_grad=True); w = torch.ones(4096, device=dev, dtype=bf, requires_grad=True); dy = torch.randn_like(x)
rows["rms: F.rms_norm fwd+bwd"] = us(lambda: torch.autograd.grad(liger_gen.functional.rms_norm(x, w), (x, w), dy))
rows["rms: rms_norm_2d fwd+bwd (no public checks)"] = us(lambda: torch.autograd.grad(N.rms_norm_2d(x, w, 1e-6, 0.0, "llama")[0], (x, w), dy))
class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b): return a.view_as(a), b.view_as(b)
    @staticmethod
    def backward(ctx, g1, g2): return g1, g2
rows["no-op Function, 2 in / 2 out, fwd+bwd"] = us(lambda: torch.autograd.grad(Noop.apply(q, k), (q, k), (gq, gk)))
for name, v in rows.items(): print(f"{name:48s} {v:8.1f} us")
