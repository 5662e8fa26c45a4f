# Where the host time of one RMSNorm / RoPE forward+backward goes on this machine.
import cProfile, io, pstats, sys, time, torch, liger_gen
pc = time.perf_counter
def per_call(f, n=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = pc()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (pc() - t) / n * 1e6
def cpu_only(f, n=300):  # host time per call with the GPU never the bottleneck (tiny tensors)
    return per_call(f, n)
dev, bf = "cuda", torch.bfloat16
x = torch.randn(16384, 4096, device=dev, dtype=bf, requires_grad=True); dy = torch.randn_like(x)
w = torch.ones(4096, device=dev, dtype=bf, requires_grad=True)
xs = torch.randn(8, 4096, device=dev, dtype=bf, requires_grad=True); dys = torch.randn_like(xs)
q = torch.randn(4, 32, 4096, 128, device=dev, dtype=bf, requires_grad=True)
k = torch.randn(4, 8, 4096, 128, device=dev, dtype=bf, requires_grad=True)
cos = torch.randn(1, 4096, 128, device=dev, dtype=bf); sin = torch.randn_like(cos)
gq, gk = torch.randn_like(q), torch.randn_like(k)
qs = torch.randn(1, 32, 8, 128, device=dev, dtype=bf, requires_grad=True); ks = torch.randn(1, 8, 8, 128, device=dev, dtype=bf, requires_grad=True)
cs = torch.randn(1, 8, 128, device=dev, dtype=bf); gqs, gks = torch.randn_like(qs), torch.randn_like(ks)
F = liger_gen.functional
class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a): return a.view_as(a)
    @staticmethod
    def backward(ctx, g): return g
rows = {}
rows["noop Function fwd+bwd (8x4096)"] = cpu_only(lambda: torch.autograd.grad(Noop.apply(xs), (xs,), dys))
rows["torch x*w fwd+bwd (8x4096)"] = cpu_only(lambda: torch.autograd.grad(xs * w, (xs, w), dys))
rows["rms_norm fwd no_grad (8x4096)"] = None
with torch.no_grad():
    rows["rms_norm fwd no_grad (8x4096)"] = cpu_only(lambda: F.rms_norm(xs, w))
rows["rms_norm fwd+bwd (8x4096)"] = cpu_only(lambda: torch.autograd.grad(F.rms_norm(xs, w), (xs, w), dys))
rows["rms_norm fwd+bwd (16384x4096)"] = per_call(lambda: torch.autograd.grad(F.rms_norm(x, w), (x, w), dy))
with torch.no_grad():
    rows["rope fwd no_grad (1x32x8x128)"] = cpu_only(lambda: F.rope(qs, ks, cs, cs))
rows["rope fwd+bwd (1x32x8x128)"] = cpu_only(lambda: torch.autograd.grad(F.rope(qs, ks, cs, cs), (qs, ks), (gqs, gks)))
rows["rope fwd+bwd (4x32x4096x128)"] = per_call(lambda: torch.autograd.grad(F.rope(q, k, cos, sin), (q, k), (gq, gk)))
torch.autograd.set_multithreading_enabled(False)
rows["[no autograd threads] rms_norm fwd+bwd (8x4096)"] = cpu_only(lambda: torch.autograd.grad(F.rms_norm(xs, w), (xs, w), dys))
rows["[no autograd threads] rope fwd+bwd (1x32x8x128)"] = cpu_only(lambda: torch.autograd.grad(F.rope(qs, ks, cs, cs), (qs, ks), (gqs, gks)))
torch.autograd.set_multithreading_enabled(True)
for name, f in (("rms_norm", lambda: torch.autograd.grad(F.rms_norm(xs, w), (xs, w), dys)),
                ("rope", lambda: torch.autograd.grad(F.rope(qs, ks, cs, cs), (qs, ks), (gqs, gks)))):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): f()
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(f"=== cProfile {name} x300\n", s.getvalue())
print("\n== host time per call (us) ==")
for k_, v in rows.items(): print(f"{k_:52s} {v:8.1f}")
