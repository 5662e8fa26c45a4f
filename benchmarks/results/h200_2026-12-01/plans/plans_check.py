# Replayed launches (per-shape plans) of rms_norm and rope on the GPU: bit-identical to the full path, close to
# float64, and the host time per forward + backward before/after.
import statistics, sys, time, torch, liger_gen
from liger_gen.ops import rms_norm as N, rope as R
from liger_gen.reference import rms_norm_torch, rope_torch
F = liger_gen.functional
dev = "cuda"
torch.manual_seed(0)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
fails = []
def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()

def check(name, ok, info=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {info}")
    if not ok: fails.append(name)

# ---------------------------------------------------------------- rms_norm
def rms_case(name, x, w, mode="llama", offset=0.0, dy_fn=None, expect_bwd_replay=True):
    for it in range(4):
        xx = x.detach().clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
        ww = w.detach().clone().requires_grad_()
        y = F.rms_norm(xx, ww, 1e-6, offset, mode)
        dy = dy_fn(y) if dy_fn else torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (xx, ww), dy)
        # the full path (the custom-op Function) on the same tensors
        x2 = xx.detach().requires_grad_(); w2 = ww.detach().requires_grad_()
        y2 = N.rms_norm_2d(x2 if x2.dim() == 2 else x2.contiguous(), w2, 1e-6, offset, mode)[0]
        g2 = torch.autograd.grad(y2, (x2, w2), dy)
        same = torch.equal(y, y2) and torch.equal(gx, g2[0]) and torch.equal(gw, g2[1])
        xr = xx.detach().double().requires_grad_(); wr = ww.detach().double().requires_grad_()
        yr = rms_norm_torch(xr, wr, 1e-6, offset, mode); gr = torch.autograd.grad(yr, (xr, wr), dy.double())
        err = max(rel(y, yr), rel(gx, gr[0]), rel(gw, gr[1]))
        if it == 3:
            plan = [p for p in N._PLANS.values() if p.shape == xx.shape and p.x_dtype == xx.dtype]
            fr = any(p.fwd.replay is not None for p in plan)
            br = any(l.replay is not None for p in plan for l in p.bwd.values())
            check(f"rms {name}", same and err < 4 * TOL[x.dtype] and fr and br == expect_bwd_replay,
                  f"bit-identical={same} err={err:.2e} fwd_replay={fr} bwd_replay={br}")

bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
rms_case("16x4096 bf16", torch.randn(16, 4096, device=dev, dtype=bf), torch.randn(4096, device=dev, dtype=bf))
rms_case("2x7x4096 bf16, fp32 w", torch.randn(2, 7, 4096, device=dev, dtype=bf), torch.randn(4096, device=dev))
rms_case("33x896 fp16 gemma", torch.randn(33, 896, device=dev, dtype=f16), torch.randn(896, device=dev, dtype=f16), "gemma", 1.0)
rms_case("5x72 fp32 none", torch.randn(5, 72, device=dev), torch.randn(72, device=dev), "none")
rms_case("16384x4096 bf16", torch.randn(16384, 4096, device=dev, dtype=bf), torch.randn(4096, device=dev, dtype=bf))
rms_case("2-D row-strided view", torch.randn(16, 8192, device=dev, dtype=bf)[:, :4096], torch.randn(4096, device=dev, dtype=bf))
rms_case("dy transposed (copied: no bwd replay)", torch.randn(64, 512, device=dev, dtype=bf), torch.randn(512, device=dev, dtype=bf),
         dy_fn=lambda y: torch.randn(y.shape[1], y.shape[0], device=dev, dtype=y.dtype).t(), expect_bwd_replay=False)
rms_case("dy expanded (row stride 0: replayed)", torch.randn(64, 512, device=dev, dtype=bf), torch.randn(512, device=dev, dtype=bf),
         dy_fn=lambda y: torch.randn(512, device=dev, dtype=y.dtype).expand_as(y))
# same shape, misaligned x: the replay declines and the launch function runs (another specialization)
base = torch.randn(16 * 4096 + 1, device=dev, dtype=bf)
xa = base[:16 * 4096].view(16, 4096); xm = base[1:].view(16, 4096)
w = torch.randn(4096, device=dev, dtype=bf)
outs = []
for xx in (xa, xm, xa, xm):
    y = F.rms_norm(xx, w); outs.append(torch.equal(y, N.rms_norm_2d(xx, w, 1e-6, 0.0, "llama")[0]))
check("rms aligned/misaligned alternating", all(outs), str(outs))
# no_grad and inference_mode
with torch.inference_mode():
    xi = torch.randn(16, 4096, device=dev, dtype=bf)
    check("rms inference_mode", torch.equal(F.rms_norm(xi, w), N.rms_norm_2d(xi, w, 1e-6, 0.0, "llama")[0]))
# another stream
s = torch.cuda.Stream(); xs = torch.randn(16, 4096, device=dev, dtype=bf)
with torch.cuda.stream(s):
    ys = F.rms_norm(xs, w)
s.synchronize()
check("rms side stream", torch.equal(ys, N.rms_norm_2d(xs, w, 1e-6, 0.0, "llama")[0]))

# ---------------------------------------------------------------- rope
def rope_case(name, b, hq, hk, s, d, r, dtype, cdtype, unsq=1, pos=False, gq_fn=None, expect_bwd=True):
    for it in range(4):
        if unsq == 1:
            q = torch.randn(b, hq, s, d, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(b, hk, s, d, device=dev, dtype=dtype, requires_grad=True)
        else:
            q = torch.randn(b, s, hq, d, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(b, s, hk, d, device=dev, dtype=dtype, requires_grad=True)
        if pos:
            cos = torch.randn(2 * s, r, device=dev, dtype=cdtype); sin = torch.randn(2 * s, r, device=dev, dtype=cdtype)
            pid = torch.randint(0, 2 * s, (b, s), device=dev)
        else:
            cos = torch.randn(1, s, r, device=dev, dtype=cdtype); sin = torch.randn(1, s, r, device=dev, dtype=cdtype); pid = None
        qo, ko = F.rope(q, k, cos, sin, pid, unsq)
        gq = gq_fn(qo) if gq_fn else torch.randn_like(qo); gk = torch.randn_like(ko)
        dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
        q4, k4 = (q, k) if unsq == 1 else (q.transpose(1, 2), k.transpose(1, 2))
        q4 = q4.detach().requires_grad_(); k4 = k4.detach().requires_grad_()
        qo2, ko2 = R.rope_4d(q4, k4, cos, sin, pid)
        g4 = (gq, gk) if unsq == 1 else (gq.transpose(1, 2), gk.transpose(1, 2))
        dq2, dk2 = torch.autograd.grad((qo2, ko2), (q4, k4), g4)
        if unsq == 2:
            qo2, ko2, dq2, dk2 = (t.transpose(1, 2) for t in (qo2, ko2, dq2, dk2))
        same = all(torch.equal(a, c) for a, c in ((qo, qo2), (ko, ko2), (dq, dq2), (dk, dk2)))
        qr = q.detach().double().requires_grad_(); kr = k.detach().double().requires_grad_()
        qor, kor = rope_torch(qr, kr, cos.double(), sin.double(), pid, unsq)
        dqr, dkr = torch.autograd.grad((qor, kor), (qr, kr), (gq.double(), gk.double()))
        err = max(rel(qo, qor), rel(ko, kor), rel(dq, dqr), rel(dk, dkr))
        if it == 3:
            plan = list(R._PLANS.values())[-1]
            fr = plan.fwd.replay is not None
            br = any(l.replay is not None for l in plan.bwd.values())
            check(f"rope {name}", same and err < 4 * TOL[dtype] and fr and br == expect_bwd,
                  f"bit-identical={same} err={err:.2e} fwd_replay={fr} bwd_replay={br}")

rope_case("llama 2x32/8x128x128 bf16", 2, 32, 8, 128, 128, 128, bf, bf)
rope_case("bshd layout", 2, 32, 8, 64, 128, 128, bf, bf, unsq=2)
rope_case("position_ids, fp32 tables", 2, 12, 2, 40, 64, 64, bf, f32, pos=True)
rope_case("partial rotary fp16 MQA", 1, 8, 1, 33, 96, 32, f16, f16)
rope_case("fp32", 1, 4, 4, 17, 64, 64, f32, f32)
rope_case("llama3-8b 4x32/8x4096x128", 4, 32, 8, 4096, 128, 128, bf, bf)
rope_case("grad from a transposed layout", 2, 8, 8, 64, 128, 128, bf, bf,
          gq_fn=lambda t: torch.randn(t.shape[0], t.shape[2], t.shape[1], t.shape[3], device=dev, dtype=t.dtype).transpose(1, 2))

# ---------------------------------------------------------------- host time per forward + backward
pc = time.perf_counter
def us(f, n=300, rounds=7):
    for _ in range(30): f()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize(); t = pc()
        for _ in range(n): f()
        torch.cuda.synchronize(); out.append((pc() - t) / n * 1e6)
    return statistics.median(out)
class Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b): return a.view_as(a), b.view_as(b)
    @staticmethod
    def backward(ctx, g1, g2): return g1, g2
x = torch.randn(8, 4096, device=dev, dtype=bf, requires_grad=True); w = torch.ones(4096, device=dev, dtype=bf, requires_grad=True); dy = torch.randn_like(x)
q = torch.randn(1, 32, 8, 128, device=dev, dtype=bf, requires_grad=True); k = torch.randn(1, 8, 8, 128, device=dev, dtype=bf, requires_grad=True)
c = torch.randn(1, 8, 128, device=dev, dtype=bf); gq, gk = torch.randn_like(q), torch.randn_like(k)
X = torch.randn(16384, 4096, device=dev, dtype=bf, requires_grad=True); DY = torch.randn_like(X)
rows = {
    "rms 8x4096: F.rms_norm (plan)": lambda: torch.autograd.grad(F.rms_norm(x, w), (x, w), dy),
    "rms 8x4096: rms_norm_2d (full path, no checks)": lambda: torch.autograd.grad(N.rms_norm_2d(x, w, 1e-6, 0.0, "llama")[0], (x, w), dy),
    "rms 16384x4096: F.rms_norm (plan)": lambda: torch.autograd.grad(F.rms_norm(X, w), (X, w), DY),
    "rms 16384x4096: rms_norm_2d (full path)": lambda: torch.autograd.grad(N.rms_norm_2d(X, w, 1e-6, 0.0, "llama")[0], (X, w), DY),
    "rope tiny: F.rope (plan)": lambda: torch.autograd.grad(F.rope(q, k, c, c), (q, k), (gq, gk)),
    "rope tiny: rope_4d (full path, no checks)": lambda: torch.autograd.grad(R.rope_4d(q, k, c, c, None), (q, k), (gq, gk)),
    "no-op Function 2 in/2 out": lambda: torch.autograd.grad(Noop.apply(q, k), (q, k), (gq, gk)),
}
res = {name: [] for name in rows}
for rep in range(3):  # interleaved: host noise hits every row alike
    for name, f in rows.items():
        res[name].append(us(f))
print("\nhost-bound wall per forward + backward (median of 7 loops of 300 calls; 3 interleaved repeats)")
for name, v in res.items():
    print(f"{name:50s} " + " ".join(f"{t:7.1f}" for t in v) + " us")
print("FAILS:", fails)
sys.exit(1 if fails else 0)
