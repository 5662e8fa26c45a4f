"""Tuning problems: the inputs, float64 truth and launch closures the tuner needs for one op and shape.

A problem allocates its inputs once on the target device, computes the float64 reference once, and then for
any variant module can (a) check it — outputs poisoned with NaN before the launch, relative L2 error against
float64 under the dtype's tolerance — and (b) hand the timer a closure that launches one phase.
"""

from __future__ import annotations

from typing import Callable

import torch

from liger_gen.codegen.spaces import DeviceLimits, RMSNormSpace
from liger_gen.reference import rms_norm_out_dtype

# Relative L2 error allowed against float64, per output dtype: about four units of roundoff of the dtype
# (bf16 2^-8, fp16 2^-11), since each output is rounded once or twice (llama casting) from fp32 math;
# fp32 outputs get 1e-5 for the fp32 accumulation over long rows and many rows (dW).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (NaN anywhere gives NaN, which fails every check)."""
    a, e = actual.double(), expected.double()
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


class RMSNormProblem:
    """RMSNorm at (rows, n_cols) in ``dtype`` on ``device``: inputs, float64 truth, checks and launchers."""

    op = "rms_norm"
    phases = ("fwd", "bwd")

    def __init__(self, dtype: torch.dtype, n_cols: int, rows: int, device: torch.device | str,
                 casting_mode: str = "llama", eps: float = 1e-6, seed: int = 0,
                 limits: DeviceLimits | None = None):
        self.dtype, self.n_cols, self.rows = dtype, int(n_cols), int(rows)
        self.device = torch.device(device)
        self.casting_mode, self.eps = casting_mode, eps
        self.limits = limits or (DeviceLimits.from_device(self.device) if self.device.type == "cuda"
                                 else DeviceLimits.interpreter())
        self.space = RMSNormSpace(self.n_cols, dtype, self.limits)
        g = torch.Generator(device="cpu").manual_seed(seed)
        shape = (self.rows, self.n_cols)
        self.x = torch.randn(shape, generator=g).to(self.device, dtype)
        self.w = (1.0 + 0.1 * torch.randn(self.n_cols, generator=g)).to(self.device, dtype)
        self.dy = torch.randn(shape, generator=g).to(self.device, dtype)
        self.rstd = torch.rsqrt(self.x.float().pow(2).mean(-1) + eps)
        out_dtype = rms_norm_out_dtype(dtype, dtype, casting_mode)
        self.y = torch.empty(shape, dtype=out_dtype, device=self.device)
        self.rstd_out = torch.empty(self.rows, dtype=torch.float32, device=self.device)
        self.dx = torch.empty(shape, dtype=dtype, device=self.device)
        self.dw = torch.empty(self.n_cols, dtype=dtype, device=self.device)
        self.dw_partial = torch.empty((self.rows, self.n_cols), dtype=torch.float32, device=self.device)
        # float64 truth: n = x·rstd, y = n·w, dx = rstd·(g − n·mean(g·n)) with g = dy·w, dW = Σ dy·n
        x64, w64, dy64 = self.x.double(), self.w.double(), self.dy.double()
        rstd64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
        n64 = x64 * rstd64
        g64 = dy64 * w64
        self.ref = {
            "y": n64 * w64,
            "rstd": rstd64.squeeze(-1),
            "dx": (g64 - n64 * (g64 * n64).mean(-1, keepdim=True)) * rstd64,
            "dw": (dy64 * n64).sum(0),
        }
        self.tol = REL_TOL[dtype]

    def launcher(self, module, phase: str) -> Callable[[], None]:
        """A closure that launches ``phase`` of ``module`` once on the problem's buffers."""
        if phase == "fwd":
            return lambda: module.forward(self.x, self.w, self.y, self.rstd_out, self.eps, 0.0)
        if phase == "bwd":
            return lambda: module.backward(self.dy, self.x, self.w, self.rstd, self.dx, self.dw, self.dw_partial,
                                           0.0, self.limits.num_sms)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")

    def check(self, module, phase: str) -> str | None:
        """Run ``phase`` once on NaN-poisoned outputs; None if every output is within tolerance, else why not."""
        outputs = {"fwd": ("y", "rstd"), "bwd": ("dx", "dw")}[phase]
        buffers = {"y": self.y, "rstd": self.rstd_out, "dx": self.dx, "dw": self.dw}
        for name in outputs:
            buffers[name].fill_(float("nan"))
        self.launcher(module, phase)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tol = {"y": self.tol, "rstd": 1e-5, "dx": self.tol, "dw": self.tol}
        for name in outputs:
            err = rel_l2(buffers[name], self.ref[name])
            if not err <= tol[name]:
                return f"{name}: relative L2 error {err:.3g} > {tol[name]:.1g}"
        return None

    def bytes_moved(self, phase: str) -> int:
        """Minimal bytes of a phase: each input read once, each output written once."""
        e = self.x.element_size()
        mn, m, n = self.rows * self.n_cols, self.rows, self.n_cols
        if phase == "fwd":
            return mn * e + n * e + mn * self.y.element_size() + m * 4
        return 2 * mn * e + n * e + m * 4 + mn * e + n * e


PROBLEMS = {"rms_norm": RMSNormProblem}
