"""Distillation losses from hidden states and two LM heads, without the full logits: the generalised
Jensen-Shannon divergence and forward / reverse KL between teacher and student. References, search space,
tuning problem, custom ops and the public ops.

For student hidden states x_s (rows, H_s) and head W_s (V, H_s), teacher x_t (rows, H_t) and W_t (V, H_t), and
temperature T: Q = softmax(x_s W_sᵀ / T), P = softmax(x_t W_tᵀ / T) per row, M = beta·P + (1 − beta)·Q,

    JSD_beta = beta·KL(P ‖ M) + (1 − beta)·KL(Q ‖ M)       0 < beta < 1   (GKD, Agarwal et al. 2024)
    beta = 0: KL(P ‖ Q) (forward KL),  beta = 1: KL(Q ‖ P) (reverse KL)
    loss = Σ_rows divergence / n_valid    (rows whose target is ignore_index are left out)

the same as ``liger_gen.functional.jsd`` of the two log-softmaxes and TRL's ``GKDTrainer.generalized_jsd_loss``
(``reduction="batchmean"``) with labels; without them TRL divides by the logits' first dim, which
``reduction="batchmean"`` reproduces (a constant factor on the loss and its gradients). The rows go in chunks:
two GEMMs give the chunk's student and teacher logits (fp32 accumulation, stored in x's dtype or fp32 as the plan
says), one Triton launch reduces them to the rows' divergence and writes the student logits' gradient over them,
and two more GEMMs give the chunk's dx_s and dW_s — in the forward, so nothing is recomputed; the backward only
scales them by the upstream gradient. The teacher gets no gradient. Kernels: ``templates/fused_linear_jsd.py.jinja``;
the chunk plan is tuned with them under the fused linear cross-entropy's extra-memory budget (256 MiB).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import Inputs, Problem, randn, targets
from liger_gen.codegen.spaces import Param
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.divergence.rows import check_beta, jsd_mode, jsd_rows
from liger_gen.ops.lm_head.chunks import (CHUNK_PLAN_PARAMS, MAX_TUNING_ROWS, TARGET_DTYPES, ChunkEngine,
                                          ChunkPlanConfig, check_lm_head, lm_head_logits, lm_head_tuning_problems)
from liger_gen.ops.lm_head.cross_entropy_rows import scale_in_place
from liger_gen.ops.lm_head.selective_log_softmax import SelectiveLogSoftmaxProblem, SelectiveLogSoftmaxSpace
from liger_gen.runtime.binding import Differentiable, Kernel, saved
from liger_gen.runtime.ops import check_float_arg, check_kernel_dtypes, check_same_device, describe, uses_triton

# ------------------------------------------------------------------------------------------------ references


def _divergence_rows(zs: torch.Tensor, zt: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """Per-row divergence of raw student / teacher logits (rows, V), in their dtype, differentiable."""
    s = torch.log_softmax(zs / temperature, dim=-1)
    t = torch.log_softmax(zt / temperature, dim=-1)
    return jsd_rows(s, t, beta)


def fused_linear_jsd_torch(student_x, student_lm_head_weight, teacher_x, teacher_lm_head_weight, target=None,
                           beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                           student_bias=None, teacher_bias=None) -> torch.Tensor:
    """Plain PyTorch, unfused: both heads (and biases) in their inputs' dtype (as transformers' ``lm_head``), the
    logits in fp32 (float64 if either input is float64), the teacher detached; the loss 0-d fp32,
    differentiable for the student."""
    dtype = torch.promote_types(torch.promote_types(student_x.dtype, teacher_x.dtype), torch.float32)
    v = student_lm_head_weight.shape[0]
    zs = _head(student_x, student_lm_head_weight, student_bias).to(dtype).reshape(-1, v)
    with torch.no_grad():
        zt = _head(teacher_x, teacher_lm_head_weight, teacher_bias).to(dtype).reshape(-1, v)
    rows = _divergence_rows(zs, zt, beta, temperature)
    if target is None:
        return rows.sum() / max(rows.numel(), 1)
    valid = target.reshape(-1) != ignore_index
    return torch.where(valid, rows, 0.0).sum() / valid.sum().clamp(min=1)


def _head(x, w, bias):
    return x @ w.t() if bias is None else x @ w.t() + bias


def fused_linear_jsd_float64(student_x, student_w, teacher_x, teacher_w, target=None, beta: float = 0.5,
                             temperature: float = 1.0, ignore_index: int = -100, rows_per_chunk: int = 256,
                             student_bias=None, teacher_bias=None):
    """The float64 truth, chunk by chunk: (loss, dx_s, dW_s) with 2-D inputs, and db_s when ``student_bias`` is
    given; the loss 0-d float64."""
    rows = student_x.shape[0]
    w64 = student_w.detach().double().requires_grad_()
    wt64 = teacher_w.detach().double()
    b64 = None if student_bias is None else student_bias.detach().double().requires_grad_()
    bt64 = None if teacher_bias is None else teacher_bias.detach().double()
    valid = torch.ones(rows, dtype=torch.bool, device=student_x.device) if target is None else \
        target.reshape(-1) != ignore_index
    n = valid.sum().clamp(min=1).double()
    total = torch.zeros((), dtype=torch.float64, device=student_x.device)
    dx = torch.zeros(student_x.shape, dtype=torch.float64, device=student_x.device)
    for lo in range(0, rows, rows_per_chunk):
        hi = min(lo + rows_per_chunk, rows)
        xc = student_x[lo:hi].detach().double().requires_grad_()
        with torch.enable_grad():
            r = _divergence_rows(_head(xc, w64, b64), _head(teacher_x[lo:hi].double(), wt64, bt64), beta,
                                 temperature)
            part = torch.where(valid[lo:hi], r, 0.0).sum() / n
            part.backward()
        total += part.detach()
        dx[lo:hi] = xc.grad
    dw = w64.grad if w64.grad is not None else torch.zeros_like(w64)
    if b64 is None:
        return total, dx, dw
    return total, dx, dw, b64.grad if b64.grad is not None else torch.zeros_like(b64)


# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class FusedLinearJSDConfig(ChunkPlanConfig):
    """Chunk plan (``chunks.ChunkPlanConfig``; with LOGITS_FP32=0 the student's gradient is written over its
    logits) and launch settings of one variant.

    BLOCK_V, num_warps, num_stages: the divergence kernel (one program per row, BLOCK_V columns a step).
    """

    CHUNK_ROWS: int = 512
    BLOCK_V: int = 4096
    num_warps: int = 8
    num_stages: int = 1


class FusedLinearJSDSpace(SelectiveLogSoftmaxSpace):
    """Search space, constraints and heuristic at dims ``{"hidden": H_s, "vocab": V}`` (the student's; the
    teacher's width changes only its GEMM) and a dtype: as ``selective_log_softmax``'s, with two logits buffers
    (student and teacher) per chunk and one kernel. Tuned as one phase ("fwd": the loss and the gradients)."""

    op = "fused_linear_jsd"
    template = "fused_linear_jsd"
    config_cls = FusedLinearJSDConfig
    LOGITS_BUFFERS = 2
    PARAMS = (
        *CHUNK_PLAN_PARAMS,
        Param("BLOCK_V", SelectiveLogSoftmaxSpace.BLOCK_V_CHOICES, "fwd"),
        Param("num_warps", (1, 2, 4, 8, 16), "fwd"),
        Param("num_stages", (1, 2, 3), "fwd"),
    )

    def tile_config(self, block: int, warps: int, **plan) -> FusedLinearJSDConfig:
        return FusedLinearJSDConfig(BLOCK_V=block, num_warps=warps, **plan)

    def tiles(self, config: FusedLinearJSDConfig):
        return (("fwd", config.BLOCK_V, config.num_warps, config.num_stages),)


# ------------------------------------------------------------------------------------------------ chunk loop

#: float16 logit gradients are written times 2^8: an entry (1 − beta)·Q·(s − log M) of about 1/vocab is then
#: normal (≥ 2^-14) down to probabilities near 2^-22; |dz| ≤ 2^9 / temperature per row in L1 stays far from
#: float16's maximum, and dx, dW are divided back in the backward's one scaling pass
FP16_DZ_SCALE = 256.0


class _Distill(ChunkEngine):
    """One call's chunk loop (``chunks.ChunkEngine``, x and w the student's): each chunk's step is the teacher's
    logits GEMM and the divergence kernel between the two."""

    SPACE = FusedLinearJSDSpace
    CPU_BYTES_PER_LOGIT = 24  # two fp32 working copies of the logits on the CPU paths

    def __init__(self, xs, ws, xt, wt, target, beta: float, temperature: float, ignore_index: int, plan=None,
                 student_bias=None, teacher_bias=None):
        self.xt, self.wt, self.teacher_bias = xt, wt, teacher_bias
        self.beta, self.temperature, self.ignore_index = beta, temperature, ignore_index
        super().__init__(xs, ws, student_bias, target, plan)
        self.dz_scale = FP16_DZ_SCALE if xs.dtype == torch.float16 else 1.0
        # a teacher of another dtype (mixed precision): its logits in fp32, never rounded (the kernel reads each
        # buffer in its own dtype); fewer rows per chunk keep the two buffers within the plan's bytes
        self.teacher_logits_dtype = self.logits_dtype if xt.dtype == xs.dtype else torch.float32
        e = torch.empty((), dtype=self.logits_dtype).element_size()
        if self.teacher_logits_dtype != self.logits_dtype and e < 4:
            self.chunk = max(1, self.chunk * 2 * e // (e + 4))

    def run(self, need_dx: bool, need_dw: bool, need_db: bool = False):
        """(loss, dx or None, dW or None, db or None, scale): the mean divergence over valid rows (0-d fp32),
        dz_scale times the gradients of the rows' sum, and the (1,) fp32 factor 1 / (max(valid rows, 1)·dz_scale)
        that makes them the mean's. Keeping the factor out of the logit gradients (and, for float16, multiplying
        them by FP16_DZ_SCALE) keeps 16-bit gradients of large vocabularies above float16's subnormal range."""
        dev, rows = self.x.device, self.rows
        loss_rows = torch.zeros(rows, dtype=torch.float32, device=dev)
        if self.target is None:
            scale = torch.full((1,), 1.0 / (max(rows, 1) * self.dz_scale), dtype=torch.float32, device=dev)
        else:
            valid = (self.target != self.ignore_index).sum().clamp(min=1).float()
            scale = (1.0 / (valid * self.dz_scale)).reshape(1)
        if rows == 0:
            dx, dw, db = self.grad_outputs(need_dx, need_dw, need_db)
            return loss_rows.sum(), dx, dw, db, scale
        zt_buf = torch.empty((self.chunk, self.vocab), dtype=self.teacher_logits_dtype, device=dev)
        mode = jsd_mode(self.beta)

        def step(lo, hi, zs, grad):
            zt = lm_head_logits(self.xt[lo:hi], self.wt, self.teacher_bias, zt_buf[:hi - lo])
            label = None if self.target is None else self.target[lo:hi]
            if self.module is not None:
                self.module.divergence(zs, zt, grad, label, loss_rows[lo:hi], 1.0 / self.temperature,
                                       self.dz_scale, self.beta, mode, self.ignore_index)
            else:
                self._divergence_torch(zs, zt, grad, label, loss_rows[lo:hi])

        dx, dw, db = self.walk(step, need_dx, need_dw, need_db)
        return loss_rows.sum() * (scale[0] * self.dz_scale), dx, dw, db, scale

    # the plain CPU path's kernel, closed form (no autograd: it runs inside the custom op, below autograd)
    def _divergence_torch(self, zs, zt, grad, label, loss_rows):
        s = torch.log_softmax(zs.float() / self.temperature, dim=-1)
        t = torch.log_softmax(zt.float() / self.temperature, dim=-1)
        valid = torch.ones(s.shape[0], dtype=torch.bool, device=s.device) if label is None else \
            label != self.ignore_index
        loss_rows.copy_(torch.where(valid, jsd_rows(s, t, self.beta), 0.0))
        if grad is None:
            return
        q = s.exp()
        p = t.exp()
        b = self.beta
        if b == 0.0:
            g = -p
        elif b == 1.0:
            g = torch.where(q > 0, q * (s - t + 1), 0.0)
        else:
            log_m = torch.logaddexp(t + math.log(b), s + math.log1p(-b))
            g = torch.where(q > 0, (1 - b) * q * (s - log_m), 0.0)
        dz = (g - q * g.sum(-1, keepdim=True)) * (self.dz_scale / self.temperature)
        grad.copy_(torch.where(valid[:, None], dz, 0.0))


# ------------------------------------------------------------------------------------------------ tuning


class FusedLinearJSDProblem(SelectiveLogSoftmaxProblem):
    """The op at (rows, hidden, vocab) in ``dtype``: one training step (the loss and the student's gradients),
    beta 0.5 (the mixture: the costliest mode), the teacher as wide as the student, 1 in 20 rows ignored. The
    model shape, row count and flops (four GEMMs of 2·R·H·V: student and teacher logits, dx, dW) are
    selective_log_softmax's."""

    SPACE = FusedLinearJSDSpace
    OUTPUTS = ("loss",)
    # x_s, x_t, W_s and W_t read by the logits GEMMs, dx and dW written (dW read and written per chunk is not
    # counted), the targets read; the logits stay in chunks
    BYTES_FORMULA = "3·R·H·s + 3·V·H·s + 8·R"

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        r, h, v = dims["rows"], dims["hidden"], dims["vocab"]
        scale = 2.0 / math.sqrt(h)
        return Inputs({"student_x": randn(gen, (r, h), dtype, device),
                       "student_w": randn(gen, (v, h), dtype, device, scale),
                       "teacher_x": randn(gen, (r, h), dtype, device),
                       "teacher_w": randn(gen, (v, h), dtype, device, scale),
                       "target": targets(gen, r, v, device)}, grad_of=("student_x", "student_w"),
                      upstream={"loss": None}, options={"beta": 0.5})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        t = inputs.tensors
        loss, dx, dw = fused_linear_jsd_float64(t["student_x"], t["student_w"], t["teacher_x"], t["teacher_w"],
                                                t["target"], inputs.options.get("beta", 0.5))
        return {"loss": loss, "dstudent_x": dx, "dstudent_w": dw}

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        r, h, v = dims["rows"], dims["hidden"], dims["vocab"]
        return {"fwd": 3 * r * h * s + 3 * v * h * s + 8 * r}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seed: int = 0, limits=None):
        Problem.__init__(self, dtype, dims, rows, device, seed=seed, limits=limits)
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {})
        self.buffers = dict(inputs.tensors)
        ref = self.reference(inputs)
        self.ref = {"loss": ref["loss"], "dx": ref["dstudent_x"], "dw": ref["dstudent_w"]}
        self.buffers.update(loss=torch.empty((), dtype=torch.float32, device=self.device),
                            dx=torch.empty_like(inputs.tensors["student_x"]),
                            dw=torch.empty_like(inputs.tensors["student_w"]))
        self.set_outputs("loss", dtype)

    def step(self, module, plan: dict) -> None:
        b = self.buffers
        run = _Distill(b["student_x"], b["student_w"], b["teacher_x"], b["teacher_w"], b["target"], 0.5, 1.0, -100,
                       plan)
        run.module = module
        loss, dx, dw, _, scale = run.run(True, True)
        b["loss"].copy_(loss)
        torch.mul(dx, scale[0], out=b["dx"])
        torch.mul(dw, scale[0], out=b["dw"])


tuning_problems = lm_head_tuning_problems(FusedLinearJSDProblem)

SPEC = OpSpec("fused_linear_jsd", FusedLinearJSDSpace, FusedLinearJSDProblem, tuning_problems,
              max_tuning_rows=MAX_TUNING_ROWS,
              custom_ops=("liger_gen::fused_linear_jsd_fwd", "liger_gen::fused_linear_jsd_scale_grads"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(student_x: torch.Tensor, student_w: torch.Tensor, teacher_x: torch.Tensor, teacher_w: torch.Tensor,
              target: torch.Tensor | None, beta: float, temperature: float, ignore_index: int, need_dx: bool,
              need_dw: bool, student_bias: torch.Tensor | None, teacher_bias: torch.Tensor | None,
              need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dx, dW, db, scale) of 2-D inputs: dx, dW, db the gradients of the rows' sum (empty when not
    needed), scale the (1,) fp32 factor that makes them the loss's."""
    run = _Distill(student_x, student_w, teacher_x, teacher_w, target, beta, temperature, ignore_index,
                   student_bias=student_bias, teacher_bias=teacher_bias)
    loss, dx, dw, db, scale = run.run(need_dx, need_dw, need_db)
    empty = student_x.new_empty(0)
    return (loss, empty if dx is None else dx, empty.clone() if dw is None else dw.to(student_w.dtype),
            empty.clone() if db is None else db.to(student_bias.dtype), scale)


def _fwd_fake(student_x, student_w, teacher_x, teacher_w, target, beta, temperature, ignore_index, need_dx,
              need_dw, student_bias, teacher_bias, need_db):
    db = student_x.new_empty(0) if not need_db else student_bias.new_empty(student_bias.shape)
    return (student_x.new_empty((), dtype=torch.float32), student_x.new_empty(student_x.shape if need_dx else (0,)),
            student_w.new_empty(student_w.shape if need_dw else (0,)), db,
            student_x.new_empty(1, dtype=torch.float32))


def _scale_grads_impl(grad_loss: torch.Tensor, dx: torch.Tensor, dw: torch.Tensor, db: torch.Tensor,
                      scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward in a recorded graph: the forward's gradients times scale and the upstream gradient, as new
    tensors."""
    g = grad_loss.float() * scale[0]
    return (dx * g).to(dx.dtype), (dw * g).to(dw.dtype), (db * g).to(db.dtype)


fused_linear_jsd_fwd = Kernel("fused_linear_jsd_fwd", _fwd_impl, _fwd_fake)
fused_linear_jsd_scale_grads = Kernel("fused_linear_jsd_scale_grads", _scale_grads_impl,
                                      lambda grad_loss, dx, dw, db, scale: (torch.empty_like(dx), torch.empty_like(dw),
                                                                            torch.empty_like(db)))


def _save(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    saved(ctx, *output[1:])
    ctx.needs, ctx.used = (inputs[8], inputs[9], inputs[12]), False


def _backward(ctx, grad_loss, *_unused):
    need_dx, need_dw, need_db = ctx.needs
    if grad_loss is None or not (need_dx or need_dw or need_db):
        return (None,) * 13
    if not ctx.eager:  # the custom op's node, whose backward may be traced: new tensors, no mutation
        dx, dw, db = fused_linear_jsd_scale_grads.op(grad_loss, *ctx.saved_tensors)
    else:
        # the forward's own buffers, scaled in place (no second dW-sized buffer): a second backward through the
        # same graph (retain_graph=True) raises instead of returning wrong values
        if ctx.used:
            raise RuntimeError("liger_gen fused_linear_jsd: backward ran twice through one forward "
                               "(retain_graph=True); the gradients computed in the forward were already consumed. "
                               "Call the op again for a second backward.")
        ctx.used = True
        dx, dw, db, scale = ctx.saved_tensors
        g = grad_loss.float() * scale[0]
        dx, dw, db = scale_in_place(dx, g), scale_in_place(dw, g), scale_in_place(db, g)
    return (dx if need_dx else None, dw if need_dw else None) + (None,) * 8 + (db if need_db else None, None, None)


_fused_linear_jsd_2d = Differentiable(fused_linear_jsd_fwd, _save, _backward,
                                      reference="liger_gen.reference.fused_linear_jsd_torch", outputs=1)


# ------------------------------------------------------------------------------------------------ public ops


#: ``fused_linear_jsd``'s normalisations of the summed divergence: over the (valid) tokens, or TRL's
#: ``generalized_jsd_loss(reduction="batchmean")`` (over the first dim of the logits when no labels are given)
REDUCTIONS = ("token_mean", "batchmean")


def _check(op: str, student_x, student_w, teacher_x, teacher_w, target, beta, temperature, ignore_index,
           student_bias=None, teacher_bias=None):
    for name, t in (("student_x", student_x), ("student_lm_head_weight", student_w), ("teacher_x", teacher_x),
                    ("teacher_lm_head_weight", teacher_w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
    if target is not None and not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: target must be a tensor or None, got {type(target).__name__}")
    beta = check_beta(op, beta)
    temperature = check_float_arg(op, "temperature", temperature)
    if not 1e-30 < temperature < math.inf:
        raise ValueError(f"{op}: temperature must be a finite number > 1e-30 (> 0), got {temperature}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}")
    if not -2**63 <= ignore_index < 2**63:
        raise ValueError(f"{op}: ignore_index must fit in int64, got {ignore_index}")
    if student_x.dim() < 1 or student_x.shape[-1] < 1:
        raise ValueError(f"{op}: student_x must be (..., hidden); got {describe('student_x', student_x)}")
    if teacher_x.shape[:-1] != student_x.shape[:-1] or teacher_x.dim() != student_x.dim():
        raise ValueError(f"{op}: teacher_x must have student_x's leading shape {tuple(student_x.shape[:-1])}; got "
                         f"{describe('teacher_x', teacher_x)} and {describe('student_x', student_x)}")
    for name, x, w in (("student", student_x, student_w), ("teacher", teacher_x, teacher_w)):
        check_lm_head(op, w, None, x.shape[-1])
        if w.dim() != 2 or w.shape[1] != x.shape[-1] or w.shape[0] < 1:
            raise ValueError(f"{op}: {name}_lm_head_weight must be (vocab, {x.shape[-1]}) for {name}_x's hidden "
                             f"size; got {describe(f'{name}_lm_head_weight', w)} and {describe(f'{name}_x', x)}")
        if w.dtype != x.dtype:
            raise TypeError(f"{op}: {name}_lm_head_weight must have {name}_x's dtype; got "
                            f"{describe(f'{name}_lm_head_weight', w)} and {describe(f'{name}_x', x)}")
    if teacher_w.shape[0] != student_w.shape[0]:
        raise ValueError(f"{op}: the teacher's vocabulary must be the student's: got "
                         f"{describe('teacher_lm_head_weight', teacher_w)} and "
                         f"{describe('student_lm_head_weight', student_w)}")
    mixed = (torch.float32, torch.bfloat16, torch.float16)
    if teacher_x.dtype != student_x.dtype and not (teacher_x.dtype in mixed and student_x.dtype in mixed):
        raise TypeError(f"{op}: teacher_x must have student_x's dtype (or both be float32/bfloat16/float16: mixed "
                        f"precision); got {describe('teacher_x', teacher_x)} and {describe('student_x', student_x)}")
    for name, b, w in (("student_bias", student_bias, student_w), ("teacher_bias", teacher_bias, teacher_w)):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or b.shape != (w.shape[0],):
            got = describe(name, b) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{op}: {name} must be ({w.shape[0]},), one value per vocabulary entry; got {got}")
        if b.dtype != w.dtype:
            raise TypeError(f"{op}: {name} must have its head's dtype {w.dtype}; got {describe(name, b)}")
    if target is not None:
        if target.shape != student_x.shape[:-1]:
            raise ValueError(f"{op}: target must have student_x's leading shape {tuple(student_x.shape[:-1])}; got "
                             f"{describe('target', target)}")
        if target.dtype not in TARGET_DTYPES:
            raise TypeError(f"{op}: target must be int64 or int32 token ids; got {describe('target', target)}")
    check_same_device(op, student_x=student_x, student_lm_head_weight=student_w, teacher_x=teacher_x,
                      teacher_lm_head_weight=teacher_w, target=target, student_bias=student_bias,
                      teacher_bias=teacher_bias)
    if torch.float64 in (student_x.dtype, teacher_x.dtype) and uses_triton(student_x):
        check_kernel_dtypes(op, student_x=student_x, teacher_x=teacher_x)
    return beta, temperature, int(ignore_index)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(0) == 1 or x2d.stride(1) == 1 else x2d.contiguous()


def _check_reduction(op: str, reduction) -> str:
    if not isinstance(reduction, str):
        raise TypeError(f"{op}: reduction must be one of {REDUCTIONS}, got {type(reduction).__name__} "
                        f"{reduction!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {type(reduction).__name__} "
                         f"{reduction!r}")
    return reduction


def _batchmean_factor(student_x: torch.Tensor, target: torch.Tensor | None, reduction: str) -> float:
    """What turns the token mean into ``reduction``'s: max(tokens, 1) / max(B, 1) for "batchmean" without a
    target (B = student_x.shape[0], 1 for a single (H,) token), else 1. From shapes only: no host sync."""
    if reduction == "token_mean" or target is not None:
        return 1.0
    tokens = math.prod(student_x.shape[:-1])
    batch = student_x.shape[0] if student_x.dim() >= 2 else 1
    return max(tokens, 1) / max(batch, 1)


def fused_linear_jsd(student_x: torch.Tensor, student_lm_head_weight: torch.Tensor, teacher_x: torch.Tensor,
                     teacher_lm_head_weight: torch.Tensor, target: torch.Tensor | None = None, beta: float = 0.5,
                     temperature: float = 1.0, ignore_index: int = -100, *,
                     reduction: str = "token_mean", student_bias: torch.Tensor | None = None,
                     teacher_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence between the teacher's and the student's next-token distributions,
    from hidden states and LM heads, without the full logits (distillation; GKD, Agarwal et al. 2024).

    With ``Q = softmax(student_x @ student_lm_head_weight.T / temperature)`` and ``P`` the same of the teacher,
    per token, and ``M = beta·P + (1 − beta)·Q``: ``JSD_beta = beta·KL(P ‖ M) + (1 − beta)·KL(Q ‖ M)``;
    ``beta = 0`` is the forward KL ``KL(P ‖ Q)`` and ``beta = 1`` the reverse KL ``KL(Q ‖ P)`` (the limits of
    JSD_beta/beta and JSD_beta/(1 − beta), as TRL's ``generalized_jsd_loss`` and Liger-Kernel's JSD define the
    endpoints). The logits are not scaled back by temperature². The loss normalises S = Σ JSD_beta over the
    tokens whose ``target`` is not ``ignore_index`` (over all tokens without a target):

        reduction="token_mean" (default):   loss = S / max(n, 1)    n = the tokens in S
        reduction="batchmean" (TRL's):      loss = S / max(n, 1)    with a target
                                            loss = S / max(B, 1)    without one: B = student_x.shape[0], the
                                                                    sequences of (B, T, H) input (1 for (H,))

    "batchmean" is TRL's ``GKDTrainer.generalized_jsd_loss(reduction="batchmean")``: ``sum / logits.size(0)``
    without labels, ``sum / (labels != -100).sum()`` with them. The two differ only without a target on input of
    3 or more dims, by the constant factor n / B (T for (B, T, H)), in the loss and in its gradients. (TRL's
    ``GKDTrainer.compute_loss`` passes labels, and ``num_items_in_batch`` when the Trainer gives it: then S is
    divided by that count, which is ``loss · n / num_items_in_batch`` of the default.)

    Exact gradients for the student (x and head), computed in the forward chunk by chunk; the teacher gets none.
    Extra memory is bounded by ``FusedLinearJSDSpace.MAX_EXTRA_BYTES`` (256 MiB) for any number of tokens,
    besides the student's gradients.

    Args:
        student_x: (..., H_s) float32, bfloat16 or float16 hidden states. student_lm_head_weight: (vocab, H_s),
            student_x's dtype.
        teacher_x: student_x's leading shape, (..., H_t), student_x's dtype. teacher_lm_head_weight: (vocab,
            H_t), the student's vocabulary.
        target: optional, student_x's leading shape, int64/int32: tokens equal to ``ignore_index`` are left out
            (the other values are not read as classes).
        beta: in [0, 1]. temperature: > 0, finite.
        reduction: "token_mean" or "batchmean" (keyword only), as above.
        student_bias, teacher_bias: optional (vocab,) LM-head biases, each in its head's dtype (keyword only):
            the logits are ``x @ W.T + bias`` (then divided by temperature); the student's bias gets its gradient.

    Mixed precision: the teacher may have another dtype than the student among float32, bfloat16 and float16
    (e.g. a bf16 student distilled from an fp32 teacher, or the reverse; each head in its hidden states'
    dtype): each head's GEMM runs in its own dtype and the teacher's logits are kept in fp32 (fewer rows per
    chunk keep the extra memory within the plan's). Under ``torch.autocast`` on the inputs' device the hidden
    states, heads and biases of both are cast to the autocast dtype first, as autocast casts them for the heads'
    GEMMs (the casts are differentiable: fp32 master weights get fp32 gradients).

    Returns the loss, 0-d float32 (float64 for float64 inputs, on the plain CPU path only), differentiable in
    student_x, student_lm_head_weight and student_bias (double backward is not supported).

    Raises:
        TypeError: a non-tensor, non-floating or mismatched dtypes, a target that is not int64/int32, float64 on
            the kernel path. ValueError: shapes (teacher_x's leading shape, a head that is not (vocab, hidden), a
            teacher of another vocabulary, a bias that is not (vocab,)), beta outside [0, 1], temperature ≤ 0 or
            infinite, a reduction not in
            ("token_mean", "batchmean") (TypeError if not a string), tensors on different devices, a DeepSpeed
            ZeRO-3 partition as a head.
    """
    op = "fused_linear_jsd"
    beta, temperature, ignore_index = _check(op, student_x, student_lm_head_weight, teacher_x,
                                             teacher_lm_head_weight, target, beta, temperature, ignore_index,
                                             student_bias, teacher_bias)
    factor = _batchmean_factor(student_x, target, _check_reduction(op, reduction))
    device_type = student_x.device.type
    if torch.is_autocast_enabled(device_type):
        # as autocast runs the heads' GEMMs: every operand in the autocast dtype (differentiable casts)
        dtype = torch.get_autocast_dtype(device_type)
        cast = [None if t is None else t.to(dtype) for t in (student_x, student_lm_head_weight, teacher_x,
                                                              teacher_lm_head_weight, student_bias, teacher_bias)]
        with torch.autocast(device_type, enabled=False):
            loss = _token_mean(*cast[:4], target, beta, temperature, ignore_index, *cast[4:])
    else:
        loss = _token_mean(student_x, student_lm_head_weight, teacher_x, teacher_lm_head_weight, target, beta,
                           temperature, ignore_index, student_bias, teacher_bias)
    # a constant on the 0-d loss: autograd scales the chunk gradients by it in their one scaling pass
    return loss if factor == 1.0 else loss * factor


def _token_mean(student_x, student_lm_head_weight, teacher_x, teacher_lm_head_weight, target, beta, temperature,
                ignore_index, student_bias=None, teacher_bias=None) -> torch.Tensor:
    """``fused_linear_jsd`` with reduction="token_mean", without its checks."""
    flat_target = None if target is None else target.reshape(-1).contiguous()
    if torch.float64 in (student_x.dtype, teacher_x.dtype):  # plain CPU path only (checked): the unfused reference
        return fused_linear_jsd_torch(student_x, student_lm_head_weight, teacher_x, teacher_lm_head_weight,
                                      flat_target, beta, temperature, ignore_index, student_bias, teacher_bias)
    grad = torch.is_grad_enabled()
    need_dx = grad and student_x.requires_grad
    need_dw = grad and student_lm_head_weight.requires_grad
    need_db = grad and student_bias is not None and student_bias.requires_grad
    if torch.jit.is_tracing():  # a trace records these flags as constants: compute all (autograd drops extras)
        need_dx = need_dw = True
        need_db = student_bias is not None
    return _fused_linear_jsd_2d(_rows(student_x), student_lm_head_weight, _rows(teacher_x).detach(),
                                teacher_lm_head_weight.detach(), flat_target, beta, temperature, ignore_index,
                                need_dx, need_dw, student_bias,
                                None if teacher_bias is None else teacher_bias.detach(), need_db)[0]


def fused_linear_kl_div(student_x: torch.Tensor, student_lm_head_weight: torch.Tensor, teacher_x: torch.Tensor,
                        teacher_lm_head_weight: torch.Tensor, target: torch.Tensor | None = None,
                        reverse: bool = False, temperature: float = 1.0, ignore_index: int = -100, *,
                        reduction: str = "token_mean", student_bias: torch.Tensor | None = None,
                        teacher_bias: torch.Tensor | None = None) -> torch.Tensor:
    """KL divergence between the teacher's and the student's next-token distributions from hidden states and LM
    heads, without the full logits: ``KL(P ‖ Q) = Σ_v P·(log P − log Q)`` (forward KL, the classic distillation
    loss of Hinton et al. 2015, ``F.kl_div(student_logp, teacher_logp, log_target=True)``), or with
    ``reverse=True`` ``KL(Q ‖ P)`` (reverse KL, MiniLLM, Gu et al. 2024). ``fused_linear_jsd`` with beta 0 or 1:
    the same arguments (``reduction``, the biases, mixed precision and autocast too), result, gradients and
    errors."""
    if not isinstance(reverse, bool):
        raise TypeError(f"fused_linear_kl_div: reverse must be a bool, got {type(reverse).__name__} {reverse!r}")
    return fused_linear_jsd(student_x, student_lm_head_weight, teacher_x, teacher_lm_head_weight, target,
                            1.0 if reverse else 0.0, temperature, ignore_index, reduction=reduction,
                            student_bias=student_bias, teacher_bias=teacher_bias)
