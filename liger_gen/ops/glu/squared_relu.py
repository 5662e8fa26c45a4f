"""Squared ReLU (So et al., 2021, "Primer: Searching for Efficient Transformers for Language Modeling"), the
activation of Nemotron's MLP: references, search space, tuning problem, custom ops, the public op and the
``SquaredReLUMLP`` module.

    y = relu(x)²,   dy/dx = 2·relu(x)            elementwise over (..., n_cols)

transformers' ``NemotronMLP`` computes ``down_proj(act_fn(up_proj(x)))`` with ``act_fn = ACT2FN["relu2"]``
(``torch.square(relu(x))``): not gated, one projection in. Kernels: ``templates/squared_relu.py.jinja``; the space
and launch settings are the GLU kernels' (``GLUSpace``: the same row tiles), with one input stream forward and
two backward, under this op's name and table (``tuned/<gpu>/squared_relu.json``).

Rounding (as PyTorch eager on half-precision tensors): relu is exact and the square is computed in fp32 and
rounded once; the backward forms 2·relu(x) in the input dtype (pow's backward) and rounds dy times it once,
zero where relu(x) <= 0 (relu's backward). float32 inputs see no intermediate rounding. The eager expression and
these kernels agree bit for bit (on the GPU; Triton's CPU interpreter converts fp32 to bf16 by truncation).
"""

from __future__ import annotations

import torch
from torch import nn

from liger_gen.codegen.problems import REL_TOL, Inputs, Problem, chunk_rows, float64_grads, randn
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.glu.activations import GLUPlan
from liger_gen.ops.glu.glu import as_rows
from liger_gen.ops.glu.glu_space import GLUSpace, MLPActivationProblem
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import check_kernel_dtypes, describe, kernel_module, uses_triton

# ------------------------------------------------------------------------------------------------ references


def squared_relu_torch(x: torch.Tensor) -> torch.Tensor:
    """``torch.square(relu(x))`` in plain PyTorch, exactly as transformers' ``ReLUSquaredActivation``
    (``ACT2FN["relu2"]``) writes it (differentiable by autograd; the same bits as ``torch.relu(x) ** 2``)."""
    return torch.square(nn.functional.relu(x))


def squared_relu_float64(x: torch.Tensor) -> torch.Tensor:
    """Exact ``relu(x)²`` in float64 (no intermediate rounding); differentiable by autograd."""
    return squared_relu_torch(x.double())


# ------------------------------------------------------------------------------------------------ space


class SquaredReLUSpace(GLUSpace):
    """The GLU kernels' params, constraints and heuristic for the squared-ReLU kernels (dims ``{"n_cols":
    intermediate}``), under this op's name (its table) and template.

    One tensor streams in forward (x) and two backward (dy, x), against the GLU's two and three, so pipelined
    stages need less shared memory; about 3 fp32 values per element stay live backward (dy, r, the product), as in
    the GLU's forward, so the backward gets the GLU forward's per-thread bound (estimates, not measurements). The
    heuristic is the GLU's (tiles of ~2K elements, up to 1024 columns wide, 4 warps): analytic; no GPU timings of
    these kernels back it yet."""

    op = "squared_relu"
    template = "squared_relu"
    STREAMS_FWD = 1
    STREAMS_BWD = 2
    MAX_ELEMS_PER_THREAD_BWD = 64


# ------------------------------------------------------------------------------------------------ tuning


class SquaredReLUProblem(MLPActivationProblem):
    """Squared ReLU at (rows, n_cols) in ``dtype`` on ``device``: inputs, float64 truth, checks and launchers.

    x ~ N(0, 2²) (half the elements negative: the masked branch of the backward runs on as many as the other);
    the truth is computed in float64 row chunk by row chunk and kept as float32 (2^-24 relative, far below every
    tolerance)."""

    SPACE = SquaredReLUSpace
    # fwd: x in, y out.  bwd: dy, x in; dx out.
    BYTES_FORMULA = "5·R·I·s"
    LAUNCH_ARGS = {"fwd": ("x", "y"), "bwd": ("dy", "x", "dx")}

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        shape = (dims["rows"], dims["n_cols"])
        return Inputs({"x": randn(gen, shape, dtype, device, 2.0)}, grad_of=("x",),
                      upstream={"y": randn(gen, shape, dtype, device)})

    @classmethod
    def reference(cls, inputs: Inputs, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
        """y and dx in ``dtype`` (float64 unless a caller stores them smaller), from float64 autograd of
        ``squared_relu_float64`` over row chunks."""
        x, dy = inputs.tensors["x"], inputs.upstream["y"]
        ref = {name: torch.empty(x.shape, dtype=dtype, device=x.device) for name in ("y", "dx")}
        step = chunk_rows(x.shape[-1], cls.REF_CHUNK_ELEMENTS)
        for start in range(0, x.shape[0], step):
            rows = slice(start, start + step)
            (y,), (dx,) = float64_grads(squared_relu_float64, (x[rows],), (0,), (dy[rows],))
            ref["y"][rows], ref["dx"][rows] = y, dx
        return ref

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        mn_bytes = dims["rows"] * dims["n_cols"] * s
        return {"fwd": 2 * mn_bytes, "bwd": 3 * mn_bytes}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        m, n = self.rows, self.dims["n_cols"]
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {})
        self.buffers = {
            "x": inputs.tensors["x"], "dy": inputs.upstream["y"],
            "y": torch.empty((m, n), dtype=dtype, device=self.device),
            "dx": torch.empty((m, n), dtype=dtype, device=self.device),
        }
        self.ref = self.reference(inputs, torch.float32)
        self.tol = {"y": REL_TOL[dtype], "dx": REL_TOL[dtype]}
        self.outputs = {"fwd": ("y",), "bwd": ("dx",)}


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The model's MLP activation: one problem per token count at ``intermediate_size``."""
    return [SquaredReLUProblem(dtype, model.intermediate_size, r, device, seed=seed) for r in rows]


_CUSTOM_OPS = ("liger_gen::squared_relu_fwd", "liger_gen::squared_relu_bwd")
SPEC = OpSpec("squared_relu", SquaredReLUSpace, SquaredReLUProblem, tuning_problems, custom_ops=_CUSTOM_OPS)
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ kernels


def _module(x: torch.Tensor):
    module, _, _ = kernel_module(SquaredReLUSpace, x, x.shape[1], x.shape[0])
    return module


def _fwd_into(x: torch.Tensor, y: torch.Tensor) -> None:
    """y = relu(x)² for 2-D x, y with unit column stride (any row strides, views allowed)."""
    if x.numel() == 0:
        return
    if uses_triton(x):
        _module(x).forward(x, y)
    else:  # CPU without the interpreter: plain PyTorch (only reached when the custom op is called directly)
        y.copy_(squared_relu_torch(x))


def _bwd_into(dy: torch.Tensor, x: torch.Tensor, dx: torch.Tensor) -> None:
    """dx of y = relu(x)², written into the given (rows, n_cols) output (views allowed)."""
    if x.numel() == 0:
        return
    if dy.stride(-1) != 1:  # e.g. the expanded gradient of y.sum()
        dy = dy.contiguous()
    if uses_triton(x):
        _module(x).backward(dy, x, dx)
        return
    # the backward formulas autograd runs for square(relu(x)), which is what the kernel reproduces: pow's
    # (dy · 2·r, with 2·r in x's dtype), then relu's (threshold_backward on relu's output)
    r = nn.functional.relu(x)
    dx.copy_(torch.ops.aten.threshold_backward(dy * (2.0 * r), r, 0))


def _fwd_impl(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _fwd_into(x, y)
    return y


def _bwd_impl(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _bwd_into(dy, x, dx)
    return dx


# ------------------------------------------------------------------------------------------------ binding


squared_relu_fwd = Kernel("squared_relu_fwd", _fwd_impl, lambda x: x.new_empty(x.shape))
squared_relu_bwd = Kernel("squared_relu_bwd", _bwd_impl, lambda dy, x: x.new_empty(x.shape))


def _save(ctx, inputs, output):
    (x,) = inputs  # relu(x) is recomputed from x: the only tensor saved
    saved(ctx, x)


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return (squared_relu_bwd.run(ctx, dy, x),)


squared_relu_2d = Differentiable(squared_relu_fwd, _save, _backward, reference="liger_gen.reference.squared_relu_torch")
"""relu(x)² of a 2-D x with unit column stride, differentiable in x."""


# ------------------------------------------------------------------------------------------------ input checks


def check_squared_relu_input(op: str, x) -> bool:
    """Validate x of a squared-ReLU op; returns whether the Triton kernels take it (else plain PyTorch).

    TypeError: not a tensor, not floating point, float64 on the kernel path. ValueError: 0-dim.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dim (..., intermediate); got {describe('x', x)}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16; got {describe('x', x)}")
    kernel = uses_triton(x)
    if kernel:
        check_kernel_dtypes(op, x=x)
    return kernel


# ------------------------------------------------------------------------------------------------ eager plans


class _Plan(GLUPlan):
    """``GLUPlan`` of ``squared_relu``: its one input x stands where a packed gate_up would (one tensor in, its
    gradient one tensor out); no tail, no extra kernel arguments."""

    __slots__ = ()
    BACKWARD = squared_relu_bwd
    GRAD_INPUTS = (0,)
    PACKED = True

    def __init__(self, x2d: torch.Tensor, shape: torch.Size):
        super().__init__(x2d, _module(x2d), (), (), shape, shape)

    def halves(self, tensors) -> tuple[torch.Tensor]:
        return (tensors[0].view(self.rows, self.n_cols),)


def _key(x):
    return (plans.meta(x),)


def _prepare(x) -> _Plan | None:
    if not check_squared_relu_input("squared_relu", x) or not x.numel():
        return None  # the full path (the plain-PyTorch path, or nothing to launch)
    x2 = as_rows(x, x.shape[-1])
    in_place = x2.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and x2.stride(-1) == 1
    return _Plan(x2, x.shape) if in_place else None  # else the full path (copies first)


def _full(x):
    if not check_squared_relu_input("squared_relu", x):
        return squared_relu_torch(x)
    return squared_relu_2d(as_rows(x, x.shape[-1])).view(x.shape)


squared_relu_planned = PlannedOp(squared_relu_2d, key=_key, prepare=_prepare, full=_full)
"""``squared_relu`` (x) through per-call-shape plans (``binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (So et al., 2021, "Primer"): ``relu(x)²``, elementwise — transformers' ``ACT2FN["relu2"]``
    (``ReLUSquaredActivation``), the activation of ``NemotronMLP``: ``down_proj(relu2(up_proj(x)))``.

    Numerics as PyTorch eager (``torch.relu(x) ** 2``), bit for bit: the square in fp32, rounded once to the input
    dtype; the backward ``dx = dy · 2·relu(x)`` as autograd computes it (2·relu(x) in the input dtype, the product
    rounded once), 0 where x <= 0. It saves only x and recomputes relu(x) from it. NaN propagates (relu(NaN) is
    NaN, as in PyTorch).

    Args:
        x: (..., intermediate) float32, bfloat16 or float16; any leading dims, any strides (column slices of a
            bigger tensor are read in place; transposed views are copied).

    Returns:
        y of x's shape and dtype, contiguous. Differentiable in x.

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run plain PyTorch (bit-identical
    to transformers), or the same Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 is
    accepted on the plain-PyTorch path only.

    Raises:
        TypeError: x is not a tensor, is not floating point, or is float64 on the kernel path.
        ValueError: x is 0-dim.
    """
    return squared_relu_planned(x)


# ------------------------------------------------------------------------------------------------ module


class SquaredReLUMLP(nn.Module):
    """A non-gated squared-ReLU MLP around existing projections: ``down_proj(relu(up_proj(x))²)`` with the
    activation in one liger-gen kernel each way — transformers' ``NemotronMLP``, which ``liger_gen.apply_to``
    swaps for it.

    Args:
        up_proj: the input projection (``nn.Module``, hidden → intermediate; Nemotron's ``nn.Linear``, with bias
            when ``config.mlp_bias``).
        down_proj: the output projection (intermediate → hidden).

    The projections are the modules given (no new parameters): the state_dict keys and the Parameter objects are
    the original MLP's. Shape: (..., hidden) → (..., hidden).

    Raises:
        TypeError: a projection that is not an nn.Module.
    """

    def __init__(self, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        for name, module in (("up_proj", up_proj), ("down_proj", down_proj)):
            if not isinstance(module, nn.Module):
                raise TypeError(f"SquaredReLUMLP: {name} must be an nn.Module, got {type(module).__name__}")
        self.up_proj, self.down_proj = up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(squared_relu(self.up_proj(x)))

