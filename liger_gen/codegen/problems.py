"""Tuning problems: the inputs, float64 truth and launch closures the tuner needs for one op and shape.

A problem allocates its inputs once on the target device, computes the float64 reference once, and then for
any variant module can (a) check it — outputs poisoned with NaN before the launch, relative L2 error against
float64 under the dtype's tolerance — and (b) hand the timer a closure that launches one phase. Each op's
problem class lives in its module under ``liger_gen/ops``; this module holds the base class and tolerances.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

from liger_gen.codegen.spaces import DeviceLimits, dtype_name

# Relative L2 error allowed against float64, per output dtype — the one place tolerances are set. About four
# units of roundoff of the dtype (bf16 2^-8, fp16 2^-11), since each output is rounded once or twice from fp32
# math; fp32 outputs get 1e-5 for the fp32 accumulation over long rows and many rows (dW, dbias).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# Outputs computed and stored in fp32 from low-precision inputs (losses, lse, rstd): fp32 accumulation only.
FP32_OUT_TOL = 1e-5


def rel_l2(actual: torch.Tensor, expected: torch.Tensor, chunk: int = 1 << 24) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (NaN anywhere gives NaN, which fails every check).

    Computed ``chunk`` elements at a time, so checking a (65536, 128256) output needs no full float64 copy.
    """
    a, e = actual.reshape(-1), expected.reshape(-1)
    if a.numel() != e.numel():
        raise ValueError(f"rel_l2: {tuple(actual.shape)} and {tuple(expected.shape)} differ in size")
    num = torch.zeros((), dtype=torch.float64, device=a.device)
    den = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), chunk):
        e64 = e[start:start + chunk].to(a.device, torch.float64)
        num += (a[start:start + chunk].double() - e64).square().sum()
        den += e64.square().sum()
    denom = den.sqrt().item()
    return num.sqrt().item() / (denom if denom > 0 else 1.0)


def float64_grads(fn: Callable[..., Any], inputs: Sequence[torch.Tensor | None], wrt: Sequence[int],
                  upstream: Sequence[torch.Tensor | None]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Float64 truth by autograd: ``fn``'s outputs at the float64 copies of ``inputs`` and the gradients of the
    inputs at positions ``wrt``, for the upstream gradients ``upstream`` (one per output; None: ones). Floating
    inputs are taken in float64; others (class indices) as they are.

    Every reference gradient in the tuner's problems and the bench's cases comes from here, by autograd of the
    op's float64 reference, so no formula for a gradient is written twice. Returns (outputs, gradients), all
    float64 and detached; None inputs stay None.
    """
    with torch.enable_grad():
        xs = [t if t is None or not t.is_floating_point() else t.detach().double().requires_grad_(i in wrt)
              for i, t in enumerate(inputs)]
        outs = fn(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        ups = [torch.ones_like(o) if u is None else u.double() for o, u in zip(outs, upstream)]
        pairs = [(o, u) for o, u in zip(outs, ups) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], [xs[i] for i in wrt], [u for _, u in pairs]) if wrt else ()
    return tuple(o.detach() for o in outs), tuple(grads)


class Problem:
    """One op at (rows, dims) in ``dtype`` on ``device``: buffers, float64 truth, checks and launchers.

    Subclasses set ``op`` and ``SPACE``, fill ``self.buffers`` (name → tensor, inputs and outputs),
    ``self.ref`` (output name → float64 truth), ``self.tol`` (output name → relative L2 tolerance) and
    ``self.outputs`` (phase → output names), and implement ``launcher`` and ``bytes_moved``. ``variant``
    holds render-time options that are not tuned (e.g. ``casting_mode``); they are part of the table entry.
    """

    op: ClassVar[str]
    SPACE: ClassVar[type]

    def __init__(self, dtype: torch.dtype, dims: Mapping[str, int] | int, rows: int, device: torch.device | str,
                 *, seed: int = 0, limits: DeviceLimits | None = None, variant: Mapping[str, Any] | None = None):
        self.dtype, self.rows = dtype, int(rows)
        self.device = torch.device(device)
        self.limits = limits or (DeviceLimits.from_device(self.device) if self.device.type == "cuda"
                                 else DeviceLimits.interpreter())
        self.space = self.SPACE(dims, dtype, self.limits)
        self.dims = self.space.dims
        self.variant = dict(variant or {})
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.buffers: dict[str, torch.Tensor] = {}
        self.ref: dict[str, torch.Tensor] = {}
        self.tol: dict[str, float] = {}
        self.outputs: dict[str, tuple[str, ...]] = {}

    @property
    def phases(self) -> tuple[str, ...]:
        return self.space.phases

    @property
    def template(self) -> str:
        return self.space.template

    def randn(self, *shape: int, scale: float = 1.0, shift: float = 0.0, dtype: torch.dtype | None = None):
        """Seeded normal samples (drawn on the CPU so every device sees the same inputs)."""
        t = shift + scale * torch.randn(shape, generator=self.generator, dtype=torch.float64)
        return t.to(self.device, dtype or self.dtype)

    def template_params(self, config) -> dict[str, Any]:
        """Everything the template needs to render ``config`` for this problem."""
        return {**config.to_dict(), **self.variant}

    def key(self) -> str:
        """Study-name part that identifies the problem: dtype, dims, rows and variant options."""
        dims = ",".join(f"{k}={v}" for k, v in self.dims.items())
        variant = ",".join(f"{k}={v}" for k, v in sorted(self.variant.items()))
        return f"{dtype_name(self.dtype)}:{dims}:{self.rows}:{variant}"

    def launcher(self, module, phase: str) -> Callable[[], None]:
        """A closure that launches ``phase`` of ``module`` once on the problem's buffers."""
        raise NotImplementedError

    def bytes_moved(self, phase: str) -> int:
        """Minimal bytes of a phase: each input read once, each output written once."""
        raise NotImplementedError

    def flops(self, phase: str) -> int:
        """Floating-point operations of a phase, for matmul-bound ops (0 for memory-bound ones)."""
        return 0

    def prepare(self, phase: str) -> None:
        """Restore inputs a phase overwrites (in-place kernels); called before every check."""

    def check(self, module, phase: str) -> str | None:
        """Run ``phase`` once on NaN-poisoned outputs; None if every output is within tolerance, else why not."""
        self.prepare(phase)
        names = self.outputs[phase]
        for name in names:
            if self.buffers[name].is_floating_point():
                self.buffers[name].fill_(float("nan"))
        self.launcher(module, phase)()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for name in names:
            err = rel_l2(self.buffers[name], self.ref[name])
            if not err <= self.tol[name]:
                return f"{name}: relative L2 error {err:.3g} > {self.tol[name]:.1g}"
        return None
