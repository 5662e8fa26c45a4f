import os, time, torch, triton
import liger_gen
from liger_gen.ops.rms_norm import RMSNormSpace
from liger_gen.runtime import ops

def per_call(f, n=300):
    for _ in range(20): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6

xs = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True); dys = torch.randn_like(xs)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
module, cfg, lim = ops.kernel_module(RMSNormSpace, xs.detach(), 4096, 64, casting_mode="llama")
y = torch.empty_like(xs); rstd = torch.empty(64, device="cuda"); dx = torch.empty_like(xs); dw = torch.empty_like(w)
dwp = torch.empty(module.num_bwd_programs(64, lim.num_sms), 4096, device="cuda")
xd, wd = xs.detach(), w.detach()

class Dummy(torch.autograd.Function):
    launch = False
    @staticmethod
    def forward(ctx, x, w):
        if Dummy.launch: module.forward(x, w, y, rstd, 1e-6, 0.0)
        return y
    @staticmethod
    def backward(ctx, g):
        if Dummy.launch: module.backward(g, xd, wd, rstd, dx, dw, dwp, 0.0, lim.num_sms)
        return dx, dw
res = {}
for mt in (True, False):
    with torch.autograd.set_multithreading_enabled(mt):
        Dummy.launch = False
        res[f"mt={mt} dummy fn no launch"] = per_call(lambda: torch.autograd.grad(Dummy.apply(xs, w), (xs, w), dys))
        Dummy.launch = True
        res[f"mt={mt} dummy fn raw launches"] = per_call(lambda: torch.autograd.grad(Dummy.apply(xs, w), (xs, w), dys))
        res[f"mt={mt} liger-gen rms fwd+bwd"] = per_call(lambda: torch.autograd.grad(liger_gen.functional.rms_norm(xs, w), (xs, w), dys))
        res[f"mt={mt} torch x*w fwd+bwd"] = per_call(lambda: torch.autograd.grad(xs * w, (xs, w), dys))
res["raw fwd+bwd launches, no autograd"] = per_call(lambda: (module.forward(xd, wd, y, rstd, 1e-6, 0.0), module.backward(dys, xd, wd, rstd, dx, dw, dwp, 0.0, lim.num_sms)))
import threading
print("threads:", [t.name for t in threading.enumerate()])
for k, v in res.items(): print(f"{k:45s} {v:8.1f} us")
