"""A gated linear unit that writes the FP8 operands of its output and of its gradients: what a decoder layer's
FP8 projections would otherwise quantize in separate ops (the down projection's input h; the gate and up
projections' output gradients). Search space, tuning problem, custom op, the public op, and the eager autograd
Function that ``GLUMLP`` runs under ``apply_to(model, fp8=True)``.

    h = act(gate) · up                                   (``swiglu`` / ``geglu``'s arithmetic, bit for bit)
    q, d   = h per row:    rne_e4m3(h · 2^a_i), 2^-a_i,  a_i = floor(log2(448 / max_j |h_ij|))
    qt, e  = h per column: rne_e4m3(h · 2^b_j), 2^-b_j,  b_j = floor(log2(448 / max_i |h_ij|)), transposed
    backward: dgate, dup as the GLU's; each one's rows and columns operands the same way (a packed gate_up's
              gradient: one pair over the whole (rows, 2·n_cols) buffer, as the gate_up projection reads it)

The operands are ``fp8_cast_transpose``'s of the values written (``liger_gen.runtime.fp8``'s recipe), bit for bit.
Whether the GLU kernels compute the amaxes on the way (then the cast kernel reads the tensor once) or a separate
amax pass does is a tuned choice per direction (``EMIT_FWD``, ``EMIT_BWD``), with the cast tiles. Kernels:
``templates/glu_fp8.py.jinja``, which includes ``templates/glu.py.jinja``.

The public op returns h and its operands, differentiable in gate and up through h (the GLU's backward); the
gradients' operands are handed to the projections only by the eager Function (``liger_gen.runtime.fp8_operands``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch

from liger_gen.codegen.problems import Problem
from liger_gen.codegen.spaces import Param
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.glu.activations import GLU_ACTIVATIONS, glu_torch
from liger_gen.ops.glu.glu import GLUProblem, as_rows, check_glu_inputs, glu_bwd, glu_bwd_into, split_gate_up
from liger_gen.ops.glu.glu_space import GLUConfig, GLUSpace
from liger_gen.runtime import fp8 as recipe
from liger_gen.runtime.binding import Differentiable, Kernel, saved
from liger_gen.runtime.fp8_operands import GRADS
from liger_gen.runtime.ops import (interpreter_enabled, kernel_module, no_double_backward, transforms_active,
                                   use_custom_op, uses_triton)

OP = "glu_fp8"
EMITS = ("amax", "none")
FUSED_TILES = (1, 2, 4, 8, 16, 32, 64)  # row tiles per program (the plain GLU's space stops at 8)

# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class GLUFp8Config(GLUConfig):
    """The GLU kernels' launch settings (``GLUConfig``), each direction's fusion choice (``EMIT_FWD``,
    ``EMIT_BWD``: "amax", the GLU kernel computes the amaxes of what it writes; "none", a separate amax pass
    does) and each direction's cast tile and warps."""

    EMIT_FWD: str = "amax"
    BLOCK_M_CAST_FWD: int = 64
    BLOCK_K_CAST_FWD: int = 64
    num_warps_cast_fwd: int = 4
    EMIT_BWD: str = "amax"
    BLOCK_M_CAST_BWD: int = 64
    BLOCK_K_CAST_BWD: int = 64
    num_warps_cast_bwd: int = 4


class GLUFp8Space(GLUSpace):
    """Search space, constraints and heuristic for one width (dims ``{"n_cols": intermediate}``) and dtype; the
    activation is a render-time variant with its own table entries."""

    op = OP
    template = "glu_fp8"
    config_cls = GLUFp8Config
    MAX_ELEMS_PER_THREAD_CAST = 64
    # rows per program of the heuristic's fused kernels: a program writes one column atomic per column of its
    # tile, so the column atomics number rows x n_cols / FUSED_ROWS (the amax atomics bound those kernels)
    FUSED_ROWS = 256
    _CAST_M = (8, 16, 32, 64, 128)
    _CAST_K = (16, 32, 64, 128, 256)
    _WARPS = (1, 2, 4, 8, 16)
    PARAMS = tuple(replace(p, choices=FUSED_TILES) if p.name.startswith("TILES_") else p
                   for p in GLUSpace.PARAMS) + (
        Param("EMIT_FWD", EMITS, "fwd"), Param("BLOCK_M_CAST_FWD", _CAST_M, "fwd"),
        Param("BLOCK_K_CAST_FWD", _CAST_K, "fwd"), Param("num_warps_cast_fwd", _WARPS, "fwd"),
        Param("EMIT_BWD", EMITS, "bwd"), Param("BLOCK_M_CAST_BWD", _CAST_M, "bwd"),
        Param("BLOCK_K_CAST_BWD", _CAST_K, "bwd"), Param("num_warps_cast_bwd", _WARPS, "bwd"),
    )

    def heuristic(self) -> GLUFp8Config:
        """Fused amaxes both ways on tiles of up to 256 columns, each program walking ``FUSED_ROWS`` rows (one
        column atomic per 256 rows, as the cast + transpose op's amax pass); 64 x 64 cast tiles at 4 warps
        (narrower where the row is)."""
        block_n = min(self.max_block_n, 256)
        block_m = max(1, min(16, self.TILE_TARGET // block_n))
        tiles = max(1, self.FUSED_ROWS // block_m)
        base = asdict(GLUSpace(self.dims, self.dtype, self.limits).heuristic())
        for phase in ("FWD", "BWD"):
            base.update({f"BLOCK_N_{phase}": block_n, f"BLOCK_M_{phase}": block_m, f"TILES_{phase}": tiles})
        cast_k = min(64, self.max_block_n)
        warps = self.fit_warps(4, 64 * cast_k, 8)
        config = GLUFp8Config(**base, BLOCK_K_CAST_FWD=cast_k, num_warps_cast_fwd=warps,
                              BLOCK_K_CAST_BWD=cast_k, num_warps_cast_bwd=warps)
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for n_cols={self.n_cols}: {problems}"
        return config

    def shape_violations(self, config: GLUFp8Config) -> list[str]:
        """The GLU kernels' checks, and each cast tile's width and threads."""
        return super().shape_violations(config) + self.tile_violations(
            "fwd cast", config.BLOCK_M_CAST_FWD, config.BLOCK_K_CAST_FWD, config.num_warps_cast_fwd, self.n_cols,
            self.MAX_ELEMS_PER_THREAD_CAST) + self.tile_violations(
            "bwd cast", config.BLOCK_M_CAST_BWD, config.BLOCK_K_CAST_BWD, config.num_warps_cast_bwd, self.n_cols,
            self.MAX_ELEMS_PER_THREAD_CAST)


# ------------------------------------------------------------------------------------------------ tuning


class GLUFp8Problem(GLUProblem):
    """The GLU with its FP8 operands at (rows, n_cols) in ``dtype``, ``activation`` of ``GLU_ACTIVATIONS``.

    Outputs: h (forward), dgate and dup (backward) against float64 as ``swiglu``'s; the check also holds every
    operand (``q_*``, ``d_*``) to the recipe's quantization of the tensor the kernel wrote, exactly."""

    SPACE = GLUFp8Space
    ACTIVATION_CHOICES = GLU_ACTIVATIONS
    # fwd: gate, up read, h written, h read again by the cast, its two e4m3 operands and their scales written.
    # bwd (the tuned phase): dy, gate, up read, dgate and dup written and read again, their four operands written.
    # A step of the public op (the bench's) runs the plain GLU backward: dy, gate, up read, dgate, dup written
    BYTES_FORMULA = "4·R·I·s + R·I + I·⌈R⌉₁₆ + 4·(R + I) (fwd) + 5·R·I·s (bwd)"
    OPERANDS = {"fwd": ("y",), "bwd": ("dgate", "dup")}

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        mn, m, n = dims["rows"] * dims["n_cols"], dims["rows"], dims["n_cols"]
        operands = mn + n * recipe.padded(m) + 4 * (m + n)  # q, qt and their fp32 scales
        return {"fwd": 4 * mn * s + operands, "bwd": 7 * mn * s + 2 * operands}

    @classmethod
    def step_bytes(cls, dims, s: int) -> int:
        """The forward's bytes and the plain GLU backward's (the public op's step)."""
        return cls.phase_bytes(dims, s)["fwd"] + 5 * dims["rows"] * dims["n_cols"] * s

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, activation: str | None = None,
                 fp8: str = "e4m3", seed: int = 0, limits=None):
        if fp8 != "e4m3":  # (the table entries name the format; the GLU kernels write e4m3 operands only)
            raise ValueError(f"glu_fp8 writes e4m3 operands only, got fp8={fp8!r}")
        super().__init__(dtype, dims, rows, device, activation=activation, seed=seed, limits=limits)
        self.variant["fp8"] = "e4m3"
        # the operands of y, dgate and dup: (q, d_rows, qt, d_cols) each
        self.operand_buffers = {name: _new_operands(self.buffers[name]) for name in ("y", "dgate", "dup")}

    def launcher(self, module, phase: str):
        b, ops, exact = self.buffers, self.operand_buffers, interpreter_enabled()
        if phase == "fwd":
            return lambda: module.forward_fp8(b["gate"], b["up"], b["y"], *_launch(ops["y"]), exact)
        if phase == "bwd":
            grads = [_launch(ops["dgate"]), _launch(ops["dup"])]
            return lambda: module.backward_fp8(b["dy"], b["gate"], b["up"], b["dgate"], b["dup"], None, grads, exact)
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")

    def check(self, module, phase: str) -> str | None:
        """The GLU's outputs against float64, then each operand against the recipe's quantization of the tensor
        written: every value and scale exactly, the columns' padding zero."""
        for name in self.OPERANDS[phase]:
            for scales in self.operand_buffers[name][1::2]:
                scales.fill_(float("nan"))
        error = super().check(module, phase)
        if error is not None:
            return error
        for name in self.OPERANDS[phase]:
            error = recipe.operand_mismatch(self.buffers[name], *self.operand_buffers[name])
            if error is not None:
                return f"{name}: {error}"
        return None


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The model's MLP activation before an FP8 down projection, at ``intermediate_size``, per token count."""
    activation = "silu" if getattr(model, "hidden_act", "silu") in ("silu", "swish") else "gelu_tanh"
    return [GLUFp8Problem(dtype, model.intermediate_size, r, device, activation=activation, seed=seed) for r in rows]


# the public op's backward is the GLU's custom op; the gradients' operands are the eager Function's
SPEC = OpSpec(OP, GLUFp8Space, GLUFp8Problem, tuning_problems,
              custom_ops=("liger_gen::glu_fp8_fwd", "liger_gen::glu_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ kernels


def _new_operands(x: torch.Tensor, rows: bool = True, cols: bool = True) -> tuple:
    """Empty (q, d_rows (rows, 1), qt, d_cols (n_cols, 1)) for 2-D x; an axis not wanted is (None, None)."""
    m, n = x.shape
    out = [None] * 4
    if rows:
        out[0] = x.new_empty((m, n), dtype=recipe.E4M3)
        out[1] = x.new_empty((m, 1), dtype=torch.float32)
    if cols:
        out[2] = x.new_empty((n, recipe.padded(m)), dtype=recipe.E4M3)
        out[3] = x.new_empty((n, 1), dtype=torch.float32)
    return tuple(out)


def _launch(operands: tuple) -> tuple:
    """The operands as the template's launchers take them: scales as vectors, a missing axis as None."""
    q, d_rows, qt, d_cols = operands
    return q, None if d_rows is None else d_rows.view(-1), qt, None if d_cols is None else d_cols.view(-1)


def glu_fp8_forward_into(gate: torch.Tensor, up: torch.Tensor, y: torch.Tensor, activation: str,
                         cols: bool) -> tuple:
    """y = act(gate) · up (2-D, unit column stride; gate and up may be halves of one packed buffer) and y's
    operands (q, d_rows (rows, 1), qt, d_cols (n_cols, 1); the last two None unless ``cols``)."""
    if not uses_triton(gate) or not gate.numel():  # the recipe in plain PyTorch (and nothing to launch)
        y.copy_(glu_torch(gate, up, activation))
        return recipe.operands_reference(y, cols)
    operands = _new_operands(y, cols=cols)
    module = kernel_module(GLUFp8Space, gate, gate.shape[1], gate.shape[0], activation=activation, fp8="e4m3")[0]
    module.forward_fp8(gate, up, y, *_launch(operands), interpreter_enabled())
    return operands


def glu_fp8_backward_into(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor,
                          dup: torch.Tensor, packed: torch.Tensor | None, activation: str) -> list[tuple]:
    """dgate and dup (as ``glu_bwd_into``; they may be gate and up) and their operands: [dgate's, dup's], or
    [packed's] when they are the halves of ``packed`` (rows, 2·n_cols)."""
    targets = [dgate, dup] if packed is None else [packed]
    if not uses_triton(gate) or not gate.numel():
        glu_bwd_into(dy, gate, up, dgate, dup, activation)
        return [recipe.operands_reference(t) for t in targets]
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    operands = [_new_operands(t) for t in targets]
    module = kernel_module(GLUFp8Space, gate, gate.shape[1], gate.shape[0], activation=activation, fp8="e4m3")[0]
    module.backward_fp8(dy, gate, up, dgate, dup, packed, [_launch(o) for o in operands], interpreter_enabled())
    return operands


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(gate: torch.Tensor, up: torch.Tensor, activation: str, cols: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, q, d_rows, qt, d_cols) of 2-D gate, up with unit column stride; qt and d_cols empty unless ``cols``."""
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    q, d_rows, qt, d_cols = glu_fp8_forward_into(gate, up, y, activation, cols)
    if not cols:
        qt, d_cols = gate.new_empty((0,), dtype=recipe.E4M3), gate.new_empty((0,), dtype=torch.float32)
    return y, q, d_rows, qt, d_cols


def _fwd_fake(gate, up, activation, cols):
    m, n = gate.shape
    if cols:
        qt, d_cols = gate.new_empty((n, recipe.padded(m)), dtype=recipe.E4M3), gate.new_empty((n, 1),
                                                                                                dtype=torch.float32)
    else:
        qt, d_cols = gate.new_empty((0,), dtype=recipe.E4M3), gate.new_empty((0,), dtype=torch.float32)
    return (gate.new_empty((m, n)), gate.new_empty((m, n), dtype=recipe.E4M3),
            gate.new_empty((m, 1), dtype=torch.float32), qt, d_cols)


glu_fp8_fwd = Kernel("glu_fp8_fwd", _fwd_impl, _fwd_fake)


def _save(ctx, inputs, output):
    gate, up, activation, _cols = inputs
    saved(ctx, gate, up)
    ctx.activation = activation


def _backward(ctx, dy, *_operands):
    """The GLU's backward through h; the operands have no gradient."""
    if dy is None:
        return None, None, None, None
    gate, up = ctx.saved_tensors
    dgate, dup = glu_bwd.run(ctx, dy, gate, up, ctx.activation)
    return dgate, dup, None, None


glu_fp8_2d = Differentiable(glu_fp8_fwd, _save, _backward, outputs=5, reference="liger_gen.reference.glu_torch")
"""(h, q, d_rows, qt, d_cols) of 2-D gate, up with unit column stride, differentiable in both through h."""


# ------------------------------------------------------------------------------------------------ public op


class Fp8GLUOutput(NamedTuple):
    """What ``glu_fp8`` returns: the GLU's output and its FP8 operands."""

    y: torch.Tensor
    q: torch.Tensor
    dequant_rows: torch.Tensor
    qt: torch.Tensor | None
    dequant_cols: torch.Tensor | None


def glu_fp8(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", cols: bool = True) -> Fp8GLUOutput:
    """``act(gate) * up`` (``swiglu`` / ``geglu``, bit for bit) that also returns the e4m3 operands of its
    output for the FP8 linear layer that reads it (a down projection): ``fp8_cast_transpose(y)`` from the same
    kernels.

    ``y = act(gate) · up`` (Shazeer, 2020) with act silu, gelu_tanh or gelu; the operands follow
    ``liger_gen.runtime.fp8``'s recipe (dynamic power-of-two scales, round to nearest even).

    Args:
        gate: (..., intermediate) float32, bfloat16 or float16; any leading dims, any strides.
        up: gate's shape, dtype and device.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU).
        cols: also return the columns operand (the weight gradient's); False for a frozen down projection.

    Returns:
        ``Fp8GLUOutput(y, q, dequant_rows, qt, dequant_cols)``: y of gate's shape and dtype, differentiable in
        gate and up; q (rows, intermediate) float8_e4m3fn and dequant_rows (rows, 1) fp32, rows being the
        product of the leading dims; qt (intermediate, rows rounded up to a multiple of 16) float8_e4m3fn with
        zeros past the last row and dequant_cols (intermediate, 1) fp32, or both None when ``cols`` is False.

    Raises:
        TypeError: gate or up not a floating tensor, their dtypes differ, float64 on the kernel path.
        ValueError: an unknown activation, gate 0-dim, the shapes differ, the tensors on different devices.
    """
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"{OP}: activation must be one of {GLU_ACTIVATIONS}, got {activation!r}")
    kernel = check_glu_inputs(OP, gate, up)
    n_cols = gate.shape[-1]
    gate2, up2 = as_rows(gate, n_cols), as_rows(up, n_cols)
    if not kernel and not (use_custom_op() or transforms_active()):
        # the plain-PyTorch path in eager mode: autograd of the reference, then the recipe
        y = glu_torch(gate, up, activation)
        return Fp8GLUOutput(y, *recipe.operands_reference(y.detach().reshape(gate2.shape), bool(cols)))
    y, q, d_rows, qt, d_cols = glu_fp8_2d(gate2, up2, activation, bool(cols))
    return Fp8GLUOutput(y.view(gate.shape), q.detach(), d_rows.detach(), qt.detach() if cols else None,
                        d_cols.detach() if cols else None)


# ------------------------------------------------------------------------------------------------ GLUMLP's


class GLUFp8Function(torch.autograd.Function):
    """``GLUMLP``'s product in eager FP8 training: h and its operands (the down projection's input) forward;
    dgate and dup backward, with their operands handed to the gate and up projections when ``grads`` (through
    ``liger_gen.runtime.fp8_operands.GRADS``), written over gate and up when ``overwrite`` (the caller owns
    them, as ``GLUMLP``'s in-place backward). ``packed``: the (rows, 2·n_cols) tensor gate and up are the halves
    of (its gradient is returned, and quantized, whole). Inputs 2-D with unit column stride."""

    @staticmethod
    def forward(ctx, gate, up, activation, cols, grads, overwrite, packed=None):
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        q, d_rows, qt, d_cols = glu_fp8_forward_into(gate, up, y, activation, cols)
        ctx.save_for_backward(*((packed,) if packed is not None else (gate, up)))
        ctx.activation, ctx.grads, ctx.overwrite = activation, grads, overwrite
        ctx.mark_non_differentiable(q, d_rows, *(t for t in (qt, d_cols) if t is not None))
        return y, q, d_rows, qt, d_cols

    @staticmethod
    def backward(ctx, dy, *_operands):
        no_double_backward(OP, "liger_gen.reference.glu_torch")
        saved_tensors = overwritten_saved_tensors(ctx)
        packed = saved_tensors[0] if len(saved_tensors) == 1 else None
        gate, up = saved_tensors if packed is None else split_gate_up(packed)
        if ctx.overwrite:
            dgate, dup, grad = gate, up, packed
        else:
            grad = None if packed is None else torch.empty_like(packed)
            dgate, dup = (torch.empty_like(gate), torch.empty_like(up)) if grad is None else split_gate_up(grad)
        if ctx.grads:
            operands = glu_fp8_backward_into(dy, gate, up, dgate, dup, grad, ctx.activation)
        else:
            glu_bwd_into(dy, gate, up, dgate, dup, ctx.activation)
        if ctx.overwrite:
            for t in saved_tensors:
                torch.autograd.graph.increment_version(t)
        if ctx.grads:  # after the version bump: the projections look the gradients up as they are now
            for target, ops in zip([dgate, dup] if grad is None else [grad], operands):
                GRADS.offer(target, ops)
        if grad is not None:
            return None, None, None, None, None, None, grad
        return dgate, dup, None, None, None, None, None


def overwritten_saved_tensors(ctx) -> tuple:
    """``ctx.saved_tensors`` of a GLU backward that writes its gradients over its saved gate and up; a second
    backward through the same graph finds them bumped and gets this error instead of PyTorch's."""
    try:
        return ctx.saved_tensors
    except RuntimeError as e:  # the version bump of an earlier backward through this node
        raise RuntimeError("liger_gen GLUMLP: a second backward through the same graph (retain_graph=True) "
                           "cannot run: the first wrote the gradients over the MLP's saved gate and up "
                           "activations to save memory. Set `in_place_backward = False` on the GLUMLP "
                           "modules (e.g. for m in model.modules(): if isinstance(m, liger_gen.nn.GLUMLP): "
                           "m.in_place_backward = False) to keep them.") from e


def glu_fp8_product(gate: torch.Tensor, up: torch.Tensor | None, activation: str, *, cols: bool, grads: bool,
                    overwrite: bool) -> tuple[torch.Tensor, tuple]:
    """``GLUMLP``'s FP8 product of (gate, up), or of a packed gate_up when ``up`` is None: (h of gate's leading
    shape, h's operands (q, d_rows, qt, d_cols)); see ``GLUFp8Function``. The caller has checked the inputs."""
    if up is None:
        width = gate.shape[-1]
        packed = as_rows(gate, width)
        half_gate, half_up = split_gate_up(packed)
        y, *operands = GLUFp8Function.apply(half_gate, half_up, activation, cols, grads, overwrite, packed)
        return y.view(*gate.shape[:-1], width // 2), tuple(operands)
    n_cols = gate.shape[-1]
    y, *operands = GLUFp8Function.apply(as_rows(gate, n_cols), as_rows(up, n_cols), activation, cols, grads,
                                        overwrite)
    return y.view(gate.shape), tuple(operands)
