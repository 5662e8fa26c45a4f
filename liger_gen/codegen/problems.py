"""Problems: an op at one shape — its seeded inputs, float64 truth, minimal bytes — and, for the tuner, checks and
launch closures.

A problem class is the one description of "the op at a shape". Its class methods describe the op at a model's
shape for every consumer: ``shape(model)`` (the space dims), ``bench_dims``, ``make_inputs`` (seeded inputs and
upstream gradients as an ``Inputs``), ``reference`` (float64 outputs and gradients, by autograd of the op's float64
reference through ``float64_grads``), ``phase_bytes``/``step_bytes`` and ``step_flops``. ``liger-gen bench`` and
the contract tests call them directly; a problem instance (what the tuner gets) builds its buffers and truth from
the same methods, then can (a) check a variant module — outputs poisoned with NaN before the launch, relative L2
error against float64 under the dtype's tolerance — and (b) hand the timer a closure that launches one phase.
Each op's problem class lives in its module under ``liger_gen/ops``; this module holds the base class, the
tolerances and the seeded-input helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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



REF_CHUNK_ELEMENTS = 1 << 25  # elements of one float64 temporary in the chunked helpers: 256 MB
IGNORE_INDEX = -100
IGNORE_FRACTION = 0.05  # share of targets / labels set to ignore_index in the loss ops' inputs
TARGET_BYTES = 8  # int64 targets and labels
STAT_BYTES = 4  # fp32 per-row statistics (rstd, mean)


@dataclass
class Inputs:
    """One op's inputs on the device.

    tensors: every input tensor by name, as the op takes them (none requires grad; callers take copies). An
        absent optional input (LayerNorm without bias) is None.
    grad_of: the names of the inputs to differentiate; their gradients are named ``"d" + name``.
    upstream: output name -> upstream gradient of that output, or None for a scalar loss (gradient 1).
    options: non-tensor arguments (eps, beta, ...).
    """

    tensors: dict[str, torch.Tensor | None]
    grad_of: tuple[str, ...]
    upstream: dict[str, torch.Tensor | None]
    options: dict[str, Any] = field(default_factory=dict)


def chunk_rows(width: int, budget: int = REF_CHUNK_ELEMENTS) -> int:
    """Rows per chunk so that one (rows, width) temporary stays around ``budget`` elements."""
    return max(1, budget // max(1, width))


def randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
          scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Seeded N(shift, scale²) samples drawn with ``gen`` (on its device) in fp32, in chunks (bounded
    temporaries), stored on ``device`` in ``dtype``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(-1)
    for lo in range(0, flat.numel(), REF_CHUNK_ELEMENTS):
        n = min(REF_CHUNK_ELEMENTS, flat.numel() - lo)
        chunk = torch.randn(n, generator=gen, device=gen.device, dtype=torch.float32)
        flat[lo:lo + n] = (chunk * scale + shift).to(device, dtype)
    return out


def log_probs(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype, device: torch.device | str,
              scale: float = 2.0) -> torch.Tensor:
    """Seeded log_softmax of N(0, scale²) logits, normalised in fp32 row chunk by row chunk, in ``dtype``."""
    out = torch.empty((rows, vocab), dtype=dtype, device=device)
    step = chunk_rows(vocab)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        z = torch.randn((hi - lo, vocab), generator=gen, device=gen.device, dtype=torch.float32).to(device)
        out[lo:hi] = torch.log_softmax(z * scale, dim=-1).to(dtype)
    return out


def targets(gen: torch.Generator, rows: int, vocab: int, device: torch.device | str,
            ignore_fraction: float = IGNORE_FRACTION, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """int64 class indices in [0, vocab) with ``ignore_fraction`` of them set to ``ignore_index``."""
    t = torch.randint(0, vocab, (rows,), generator=gen, device=gen.device)
    ignore = torch.rand(rows, generator=gen, device=gen.device) < ignore_fraction
    return t.masked_fill(ignore, ignore_index).to(device)


def reference_by_autograd(inputs: Inputs, fn64: Callable[[dict, dict], tuple],
                          output_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Float64 outputs and gradients of ``fn64`` (a float64 reference taking ``(tensors, options)``) by
    ``float64_grads``: each output name and each ``"d" + input`` name maps to a float64 tensor (upstream
    gradients as ``inputs.upstream`` gives them, 1 for scalar losses)."""
    names = list(inputs.tensors)
    outs, grads = float64_grads(lambda *ts: fn64(dict(zip(names, ts)), inputs.options),
                                [inputs.tensors[n] for n in names], [names.index(n) for n in inputs.grad_of],
                                [inputs.upstream[n] for n in output_names])
    ref = dict(zip(output_names, outs))
    ref.update({"d" + n: g for n, g in zip(inputs.grad_of, grads)})
    return ref


class Problem:
    """One op at (rows, dims) in ``dtype`` on ``device``: buffers, float64 truth, checks and launchers.

    The class methods describe the op at a model's shape, for the bench and the tests as for the instances:

    - ``shape(model)``: the space dims (``{"n_cols": hidden_size}``); ``bench_dims(model, rows)`` adds the rows
      (and anything else the inputs need, e.g. RoPE's sequence length);
    - ``options(model)``: the non-tensor arguments a model's call passes (eps, ...);
    - ``make_inputs(dims, dtype, device, gen, options)``: seeded inputs and upstream gradients (``Inputs``);
    - ``reference(inputs)``: float64 outputs (``OUTPUTS``) and gradients (``"d" + input``), by autograd of the
      op's float64 reference;
    - ``phase_bytes(dims, element_size)``: minimal bytes of each tuned phase (each input read once, each output
      written once); ``step_bytes`` those of a training step (forward + backward; by default the phases' sum)
      with ``BYTES_FORMULA`` its formula; ``step_flops`` for matmul ops.

    Subclasses set ``SPACE`` (``op`` is its op's name) and, in ``__init__``, fill ``self.buffers`` (name →
    tensor, inputs and outputs), ``self.ref`` (output name → float64 truth), ``self.tol`` (output name → relative
    L2 tolerance) and ``self.outputs`` (phase → output names), and implement ``launcher``. ``variant`` holds
    render-time options that are not tuned (e.g. ``casting_mode``); they are part of the table entry.
    """

    op: ClassVar[str]  # the op's name: its SPACE's, unless a subclass sets another
    SPACE: ClassVar[type]
    OUTPUTS: ClassVar[tuple[str, ...]] = ()  # the op's differentiable outputs, in its return order
    DEFAULT_ROWS: ClassVar[int] = 16384  # token count of the bench's default shape
    BYTES_FORMULA: ClassVar[str] = ""  # ``step_bytes`` as a formula (R rows, H hidden, ..., s element size)
    FLOPS_FORMULA: ClassVar[str] = ""
    # the dtype the op's activations always have, whatever dtype the bench asks for (None: the bench's); the
    # bench's tolerance and element size follow it (the FP8 linear layer takes and writes bf16)
    ACTIVATION_DTYPE: ClassVar[torch.dtype | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "SPACE" in cls.__dict__ and "op" not in cls.__dict__:  # the op is named once, by its space
            cls.op = cls.SPACE.op

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        """The space dims of ``model`` (a ``liger_gen.models.ModelShape`` or a transformers config)."""
        raise NotImplementedError

    @classmethod
    def shapes(cls, model) -> list[dict[str, int]]:
        """Every feature-dims dict the op runs at in ``model`` (``liger-gen verify`` checks each): ``shape``'s one,
        unless an op runs at several widths in one model."""
        return [cls.shape(model)]

    @classmethod
    def bench_dims(cls, model, rows: int) -> dict[str, int]:
        """The dims ``make_inputs`` and ``step_bytes`` take: ``{"rows": rows, **shape(model)}``."""
        return {"rows": int(rows), **cls.shape(model)}

    @classmethod
    def space_dims(cls, dims: Mapping[str, int]) -> dict[str, int]:
        """The space dims within ``bench_dims`` (what a table is keyed by)."""
        return {name: dims[name] for name in cls.SPACE.DIMS}

    @classmethod
    def options(cls, model) -> dict[str, Any]:
        """The non-tensor arguments of the op as ``model`` calls it."""
        return {}

    @classmethod
    def make_inputs(cls, dims: Mapping[str, int], dtype: torch.dtype, device, gen: torch.Generator,
                    options: Mapping[str, Any]) -> Inputs:
        """Seeded inputs at ``dims`` (``bench_dims``) drawn with ``gen``."""
        raise NotImplementedError

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        """Float64 truth of every output in ``OUTPUTS`` and every gradient ``"d" + name`` of ``inputs.grad_of``."""
        raise NotImplementedError

    @classmethod
    def phase_bytes(cls, dims: Mapping[str, int], s: int) -> dict[str, int]:
        """Minimal bytes of each tuned phase at ``dims`` for element size ``s``."""
        raise NotImplementedError

    @classmethod
    def step_bytes(cls, dims: Mapping[str, int], s: int) -> int:
        """Minimal bytes of one training step (forward + backward): the phases' sum unless a subclass says less."""
        return sum(cls.phase_bytes(dims, s).values())

    @classmethod
    def step_flops(cls, dims: Mapping[str, int]) -> int:
        """Floating-point operations of one training step (0 for memory-bound ops)."""
        return 0

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
        # ``make_inputs`` draws on the problem's device (a CPU draw of a (16384, 128256) input takes minutes)
        self.device_generator = torch.Generator(device=self.device).manual_seed(seed)
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

    @property
    def problem_dims(self) -> dict[str, int]:
        """This problem's dims in ``bench_dims``' form (rows and the space dims)."""
        return {"rows": self.rows, **self.dims}

    def bytes_moved(self, phase: str) -> int:
        """Minimal bytes of a phase (``phase_bytes`` at this problem's dims and input element size)."""
        return self.phase_bytes(self.problem_dims, self.element_size)[phase]

    @property
    def element_size(self) -> int:
        """Bytes per element of the inputs."""
        return torch.empty((), dtype=self.dtype).element_size()

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


class VocabProblem(Problem):
    """A loss over the model's vocabulary: one (vocab,) row of logits or log-probabilities per token; the bench's
    default is 8192 tokens (8192 x 128256 bf16 logits: 2.1 GB)."""

    DEFAULT_ROWS = 8192

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {"vocab": model.vocab_size}
