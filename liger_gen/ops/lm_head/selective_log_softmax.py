"""Per-token log-probabilities of chosen tokens from hidden states and the LM head, without the full logits:
the building block of preference and RL losses (DPO, KTO, GRPO, ...). References, search space, tuning problem,
custom ops and the public op.

For hidden states x (rows, hidden), LM head W (vocab, hidden), optional bias b and chosen tokens y:

    u = logit_scale · (x @ W^T + b)            c = softcap · tanh(u / softcap)  (c = u without a softcap)
    z = c / temperature                          log p = z_y − logsumexp(z)       (0 where y = ignore_index)
    entropy = logsumexp(z) − Σ_v softmax(z)_v · z_v

This is ``log_softmax(z).gather(-1, y)`` (TRL's ``selective_log_softmax``) and the entropy TRL's trainers log
and regularise with, computed in chunks of rows: each chunk's logits come from a GEMM with fp32 accumulation
(stored in x's dtype or in fp32, a tuned choice), one Triton launch reduces them to the per-token statistics;
the backward recomputes each chunk's logits, one launch turns them into d/d(logits) in place, and two more
GEMMs give dx and dW (dW summed in fp32 or added in x's dtype, a tuned choice). Optional per-token statistics
that trainers log (not differentiable): log Σ_v p_v² (WPO weights), the mean of z, whether y is the argmax.

Kernels: ``templates/selective_log_softmax.py.jinja``; the chunk plan is tuned with them under the same
extra-memory budget as the fused linear cross-entropy (256 MiB).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from liger_gen.codegen.problems import REL_TOL, TARGET_BYTES, Inputs
from liger_gen.codegen.spaces import Param
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.lm_head.chunks import (CHUNK_PLAN_PARAMS, MAX_TUNING_ROWS, TARGET_DTYPES, ChunkEngine,
                                          ChunkPlanConfig, ChunkPlanSpace, LMHeadProblem, check_lm_head,
                                          lm_head_tuning_problems)
from liger_gen.runtime.binding import Differentiable, Kernel, saved
from liger_gen.runtime.ops import (check_float_arg, check_kernel_dtypes, check_same_device, check_targets, describe,
                                   uses_triton)

#: the per-token outputs, in the order the 2-D op returns them
OUTPUT_NAMES = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class LogProbOptions(NamedTuple):
    """The scalar options of one call: the logit transform and the ignored token id."""

    ignore_index: int = -100
    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0


# ------------------------------------------------------------------------------------------------ references


def _transform(logits: torch.Tensor, options: LogProbOptions) -> torch.Tensor:
    u = logits * options.logit_scale
    if options.softcap is not None:
        u = options.softcap * torch.tanh(u / options.softcap)
    return u / options.temperature


def _token_stats(z: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """(log p_y, entropy, log Σp², mean z, is_top1) of transformed logits z (rows, vocab), 0 / False where y is
    ignored; differentiable in z by autograd."""
    valid = target != ignore_index
    y = torch.where(valid, target, 0).long()
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, y[:, None])[:, 0]
    p = logp_all.exp()
    entropy = -torch.where(p > 0, p * logp_all, 0.0).sum(-1)  # a masked (-inf) logit adds 0, not 0·(−inf)
    log_sq = torch.logsumexp(2 * logp_all, dim=-1)
    mean = z.mean(-1)
    top1 = z.argmax(-1) == y
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    return (torch.where(valid, logp, zero), torch.where(valid, entropy, zero), torch.where(valid, log_sq, zero),
            torch.where(valid, mean, zero), top1 & valid)


def selective_log_softmax_torch(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                                bias: torch.Tensor | None = None, temperature: float = 1.0,
                                ignore_index: int = -100, softcap: float | None = None, logit_scale: float = 1.0):
    """Plain PyTorch, unfused: the LM head in x's dtype (as transformers' ``lm_head``), the logits upcast to
    fp32 (float64 for float64 inputs), then ``log_softmax`` and the entropy. Returns (log_probs, entropy) of x's
    leading shape; differentiable by autograd."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    logits = x @ lm_head_weight.t() if bias is None else x @ lm_head_weight.t() + bias
    z = _transform(logits.to(dtype).reshape(-1, lm_head_weight.shape[0]),
                   LogProbOptions(ignore_index, temperature, softcap, logit_scale))
    logp, entropy, *_ = _token_stats(z, target.reshape(-1), ignore_index)
    return logp.view(target.shape), entropy.view(target.shape)


def selective_log_softmax_float64(x, lm_head_weight, target, bias=None, options: LogProbOptions = LogProbOptions(),
                                  g_logp=None, g_entropy=None, rows_per_chunk: int = 256):
    """The float64 truth, chunk by chunk (no (rows, vocab) float64 temporary of all rows): (log_probs, entropy,
    dx, dW, db) for upstream gradients ``g_logp``, ``g_entropy`` ((rows,) or None); the gradients are None when
    both upstream gradients are None."""
    rows = x.shape[0]
    w64 = lm_head_weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    logp = torch.empty(rows, dtype=torch.float64, device=x.device)
    entropy = torch.empty(rows, dtype=torch.float64, device=x.device)
    want = g_logp is not None or g_entropy is not None
    dx = torch.zeros(x.shape, dtype=torch.float64, device=x.device) if want else None
    for lo in range(0, rows, rows_per_chunk):
        hi = min(lo + rows_per_chunk, rows)
        xc = x[lo:hi].detach().double().requires_grad_()
        with torch.enable_grad():
            logits = xc @ w64.t() if b64 is None else xc @ w64.t() + b64
            lp, ent, *_ = _token_stats(_transform(logits, options), target[lo:hi], options.ignore_index)
            if want:
                total = 0.0
                if g_logp is not None:
                    total = total + (lp * g_logp[lo:hi].double()).sum()
                if g_entropy is not None:
                    total = total + (ent * g_entropy[lo:hi].double()).sum()
                total.backward()
        logp[lo:hi], entropy[lo:hi] = lp.detach(), ent.detach()
        if want:
            dx[lo:hi] = xc.grad
    if not want:
        return logp, entropy, None, None, None
    return logp, entropy, dx, w64.grad if w64.grad is not None else torch.zeros_like(w64), \
        None if b64 is None else (b64.grad if b64.grad is not None else torch.zeros_like(b64))


# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class SelectiveLogSoftmaxConfig(ChunkPlanConfig):
    """Chunk plan (``chunks.ChunkPlanConfig``: CHUNK_ROWS, LOGITS_FP32, DW_FP32) and launch settings of one
    variant.

    BLOCK_V_*, num_warps_*, num_stages_*: the statistics (fwd) and gradient (bwd) kernels: one program per row,
        walking the vocab in BLOCK_V columns.
    """

    BLOCK_V_FWD: int = 4096
    num_warps_fwd: int = 8
    num_stages_fwd: int = 1
    BLOCK_V_BWD: int = 4096
    num_warps_bwd: int = 8
    num_stages_bwd: int = 1


class SelectiveLogSoftmaxSpace(ChunkPlanSpace):
    """Search space, constraints and heuristic at dims ``{"hidden": H, "vocab": V}`` and a dtype: the chunk
    plan's (``chunks.ChunkPlanSpace``: its memory budget MAX_EXTRA_BYTES) and the kernels' tiles.

    Tuned as one phase ("fwd": the forward and the backward of one training step, whose chunk plan they share).
    """

    op = "selective_log_softmax"
    template = "selective_log_softmax"
    config_cls = SelectiveLogSoftmaxConfig
    MAX_ELEMS_PER_THREAD = 32
    BLOCK_V_CHOICES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)

    PARAMS = (
        *CHUNK_PLAN_PARAMS,
        Param("BLOCK_V_FWD", BLOCK_V_CHOICES, "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16), "fwd"),
        Param("num_stages_fwd", (1, 2, 3), "fwd"),
        Param("BLOCK_V_BWD", BLOCK_V_CHOICES, "fwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16), "fwd"),
        Param("num_stages_bwd", (1, 2, 3), "fwd"),
    )

    def check_dims(self) -> None:
        super().check_dims()
        self.max_block_v = max(self.BLOCK_V_CHOICES[0], 1 << max(0, (self.vocab - 1).bit_length()))

    def heuristic(self) -> SelectiveLogSoftmaxConfig:
        """Logits in x's dtype, dW summed in x's dtype (bf16), the largest chunk within MAX_EXTRA_BYTES, and
        4096-column (or vocab-wide) tiles at 8 warps."""
        block = min(4096, self.max_block_v)
        return self.largest_chunk(self.tile_config(block, self.fit_warps(8, block, 4), **self.smallest_plan()))

    def tile_config(self, block: int, warps: int, **plan):
        """A config with every kernel at ``block`` columns and ``warps`` warps, and the chunk plan ``plan``."""
        return self.config_cls(BLOCK_V_FWD=block, num_warps_fwd=warps, BLOCK_V_BWD=block, num_warps_bwd=warps,
                               **plan)

    def tiles(self, config) -> tuple[tuple[str, int, int, int], ...]:
        """(kernel, BLOCK_V, num_warps, num_stages) of each kernel of ``config``."""
        return (("fwd", config.BLOCK_V_FWD, config.num_warps_fwd, config.num_stages_fwd),
                ("bwd", config.BLOCK_V_BWD, config.num_warps_bwd, config.num_stages_bwd))

    def shape_violations(self, config: SelectiveLogSoftmaxConfig) -> list[str]:
        problems = self.flag_violations(config)
        for name, block, warps, stages in self.tiles(config):
            if block > self.max_block_v:
                problems.append(f"{name}: BLOCK_V={block} > {self.max_block_v} (vocab={self.vocab})")
            problems += self.threads_violations(name, warps, block, self.MAX_ELEMS_PER_THREAD)
            problems += self.smem_violations(name, (stages - 1) * block * 4)
        return problems + self.memory_violations(config)


# ------------------------------------------------------------------------------------------------ chunk loop


class Chunks(ChunkEngine):
    """One call's chunk loop (``chunks.ChunkEngine``) with the statistics and gradient kernels of the
    log-probabilities as its steps. The preference losses (``post_training``) drive it over chunks of whole
    sequences."""

    SPACE = SelectiveLogSoftmaxSpace
    CPU_BYTES_PER_LOGIT = 12  # the plain path's fp32 working copies of a chunk's logits

    def __init__(self, x, w, bias, target, options: LogProbOptions):
        self.options = options
        super().__init__(x, w, bias, target)
        self.kernel_args = (options.ignore_index, float(options.logit_scale), options.softcap,
                            1.0 / options.temperature)

    def forward(self, need: tuple[bool, bool, bool, bool]):
        """(log_probs, entropy, log_sum_sq, mean, top1 as int8, lse) per row; unrequested ones are None."""
        dev, rows = self.x.device, self.rows
        f32 = dict(dtype=torch.float32, device=dev)
        logp, lse = torch.empty(rows, **f32), torch.empty(rows, **f32)
        extra = [torch.empty(rows, **f32) if need[i] else None for i in range(3)]
        top1 = torch.empty(rows, dtype=torch.int8, device=dev) if need[3] else None
        self.walk(lambda lo, hi, z, _: self.stats(z, self.target[lo:hi], logp[lo:hi], lse[lo:hi],
                                                  [None if t is None else t[lo:hi] for t in (*extra, top1)]))
        return (logp, *extra, top1, lse)

    def stats(self, z, target, logp, lse, parts=(None, None, None, None)):
        """One chunk's per-row statistics of its logits z into logp, lse and the optional ``parts``."""
        if self.module is not None:
            self.module.forward(z, target, logp, lse, *parts, *self.kernel_args)
        else:
            self._forward_torch(z, target, logp, lse, parts)

    def _forward_torch(self, logits, target, logp, lse, parts):
        z = _transform(logits.float(), self.options)
        lse.copy_(torch.logsumexp(z, dim=-1))
        for out, value in zip((logp, *parts), _token_stats(z, target, self.options.ignore_index)):
            if out is not None:
                out.copy_(value)

    def backward(self, g_logp, g_entropy, lse, entropy, need_dx: bool, need_dw: bool, need_db: bool):
        """(dx, dW, db) of Σ g_logp·log_probs + Σ g_entropy·entropy; None where not needed."""
        entropy = lse if entropy is None else entropy  # read only with an entropy gradient

        def step(lo, hi, z, grad):
            self.logits_grad(z, grad, self.target[lo:hi], lse[lo:hi], entropy[lo:hi],
                             None if g_logp is None else g_logp[lo:hi], None if g_entropy is None else g_entropy[lo:hi])

        return self.walk(step, need_dx, need_dw, need_db, grad=True)

    def logits_grad(self, z, grad, target, lse, entropy, g_logp, g_entropy):
        """One chunk's d/d(logits) of Σ g_logp·log p + Σ g_entropy·H into ``grad`` (z itself allowed)."""
        if self.module is not None:
            self.module.backward(z, grad, target, lse, entropy, g_logp, g_entropy, *self.kernel_args)
        else:
            grad.copy_(self._grad_torch(z, target, g_logp, g_entropy))

    def _grad_torch(self, logits, target, g_logp, g_entropy):
        """The kernel's closed form in PyTorch (no autograd: it runs inside the custom op, below autograd, also
        where torch.compile traced the op): dz = g_logp·([v = y] − p) − g_entropy·p·(z − lse + H)."""
        o = self.options
        u = logits.float() * o.logit_scale
        th = torch.tanh(u / o.softcap) if o.softcap is not None else None
        z = (o.softcap * th if th is not None else u) / o.temperature
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        p = torch.exp(z - lse)
        valid = (target != o.ignore_index)[:, None]
        dz = torch.zeros_like(z)
        if g_logp is not None:
            onehot = torch.zeros_like(z).scatter_(1, torch.where(valid[:, 0], target, 0).long()[:, None], 1.0)
            dz += g_logp.float()[:, None] * (onehot - p)
        if g_entropy is not None:
            entropy = lse - torch.where(p > 0, p * z, 0.0).sum(-1, keepdim=True)
            dz -= g_entropy.float()[:, None] * torch.where(p > 0, p * (z - lse + entropy), 0.0)
        if th is not None:
            dz = dz * (1.0 - th * th)
        return torch.where(valid, dz * (o.logit_scale / o.temperature), 0.0)


# ------------------------------------------------------------------------------------------------ tuning


class SelectiveLogSoftmaxProblem(LMHeadProblem):
    """The op at (rows, hidden, vocab) in ``dtype``: one training step (forward and backward) with a random
    upstream gradient of the log-probabilities, 1 in 20 targets ignored."""

    SPACE = SelectiveLogSoftmaxSpace
    OUTPUTS = ("log_probs",)
    # x and W read by the forward's and the backward's logits GEMMs, dx and dW written, the targets read by both
    # passes, log p and lse written (fp32), lse and the upstream gradient read; the logits stay in chunks
    BYTES_FORMULA = "3·R·H·s + 3·V·H·s + 2·8·R + 16·R"
    # four GEMMs of 2·R·H·V: logits in the forward and again in the backward, dx, dW
    FLOPS_FORMULA = "8·R·H·V"

    @classmethod
    def upstream_gradient(cls, gen: torch.Generator, rows: int, device) -> torch.Tensor:
        return torch.randn(rows, generator=gen, device=gen.device, dtype=torch.float32).to(device)

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        t = inputs.tensors
        g = inputs.upstream["log_probs"]
        rows = t["x"].shape[0]
        g = torch.ones(rows, device=t["x"].device) if g is None else g.reshape(rows)
        logp, _, dx, dw, _ = selective_log_softmax_float64(t["x"].reshape(rows, -1), t["w"], t["target"].reshape(-1),
                                                           g_logp=g)
        return {"log_probs": logp.view(t["target"].shape), "dx": dx.view(t["x"].shape), "dw": dw}

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        r, h, v = dims["rows"], dims["hidden"], dims["vocab"]
        return {"fwd": 3 * r * h * s + 3 * v * h * s + r * (2 * TARGET_BYTES + 16)}

    @classmethod
    def step_flops(cls, dims) -> int:
        return 8 * dims["rows"] * dims["hidden"] * dims["vocab"]

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {})
        h, v = self.dims["hidden"], self.dims["vocab"]
        self.g = inputs.upstream["log_probs"]
        self.buffers = {**inputs.tensors,
                        "log_probs": torch.empty(self.rows, dtype=torch.float32, device=self.device),
                        "dx": torch.empty((self.rows, h), dtype=dtype, device=self.device),
                        "dw": torch.empty((v, h), dtype=dtype, device=self.device)}
        self.ref = self.reference(inputs)
        self.set_outputs("log_probs", dtype)

    def set_outputs(self, first: str, dtype: torch.dtype) -> None:
        """The checked outputs of the one phase: ``first`` (fp32, within max(eps, 1e-6)), then dx and dW."""
        eps = torch.finfo(dtype).eps
        self.tol = {first: max(eps, 1e-6), "dx": REL_TOL[dtype], "dw": REL_TOL[dtype]}
        self.outputs = {"fwd": (first, "dx", "dw")}

    def launcher(self, module, phase: str):
        if phase != "fwd":
            raise ValueError(f"phase must be 'fwd' (one training step), got {phase!r}")
        plan = module.plan()
        return lambda: self.step(module, plan)

    def step(self, module, plan: dict) -> None:
        """One training step of the variant ``module`` (chunk plan ``plan``) into the output buffers."""
        b = self.buffers
        run = Chunks(b["x"], b["w"], None, b["target"], LogProbOptions())
        run.module = module
        run.use_plan(SelectiveLogSoftmaxConfig.from_dict(plan))  # the variant's plan, as the tuner times it
        logp, _, _, _, _, lse = run.forward((False, False, False, False))
        dx, dw, _ = run.backward(self.g, None, lse, None, True, True, False)
        b["log_probs"].copy_(logp)
        b["dx"].copy_(dx)
        b["dw"].copy_(dw)


tuning_problems = lm_head_tuning_problems(SelectiveLogSoftmaxProblem)


SPEC = OpSpec("selective_log_softmax", SelectiveLogSoftmaxSpace, SelectiveLogSoftmaxProblem, tuning_problems,
              max_tuning_rows=MAX_TUNING_ROWS,
              custom_ops=("liger_gen::selective_log_softmax_fwd", "liger_gen::selective_log_softmax_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding


def _fwd_impl(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
              ignore_index: int, temperature: float, softcap: float | None, logit_scale: float,
              need_entropy: bool, need_sq: bool, need_mean: bool,
              need_top1: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor]:
    """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, lse) of a 2-D x; unrequested outputs are
    empty tensors (a custom op's outputs are tensors)."""
    check_targets("selective_log_softmax", target, lm_head_weight.shape[0], ignore_index)
    run = Chunks(x, lm_head_weight, bias, target, LogProbOptions(ignore_index, temperature, softcap, logit_scale))
    logp, entropy, sq, mean, top1, lse = run.forward((need_entropy, need_sq, need_mean, need_top1))
    empty = lambda dtype=torch.float32: torch.empty(0, dtype=dtype, device=x.device)  # noqa: E731
    return (logp, empty() if entropy is None else entropy, empty() if sq is None else sq,
            empty() if mean is None else mean, empty(torch.bool) if top1 is None else top1.to(torch.bool), lse)


def _bwd_impl(g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None, x: torch.Tensor,
              lm_head_weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, lse: torch.Tensor,
              entropy: torch.Tensor, ignore_index: int, temperature: float, softcap: float | None,
              logit_scale: float, need_dx: bool, need_dw: bool,
              need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db) for per-row upstream gradients of the log-probabilities and the entropy (recomputes the
    logits chunk by chunk); unrequested ones are empty tensors."""
    run = Chunks(x, lm_head_weight, bias, target, LogProbOptions(ignore_index, temperature, softcap, logit_scale))
    dx, dw, db = run.backward(g_logp, g_entropy, lse, entropy, need_dx, need_dw, need_db)
    empty = x.new_empty(0)
    return (empty if dx is None else dx, empty.clone() if dw is None else dw.to(lm_head_weight.dtype),
            empty.clone() if db is None else db.to(bias.dtype))


def _fwd_fake(x, lm_head_weight, target, bias, ignore_index, temperature, softcap, logit_scale, need_entropy,
              need_sq, need_mean, need_top1):
    rows = x.shape[0]
    f = dict(dtype=torch.float32)
    return (x.new_empty(rows, **f), x.new_empty(rows if need_entropy else 0, **f),
            x.new_empty(rows if need_sq else 0, **f), x.new_empty(rows if need_mean else 0, **f),
            x.new_empty(rows if need_top1 else 0, dtype=torch.bool), x.new_empty(rows, **f))


def _bwd_fake(g_logp, g_entropy, x, lm_head_weight, target, bias, lse, entropy, ignore_index, temperature, softcap,
              logit_scale, need_dx, need_dw, need_db):
    return (x.new_empty(x.shape if need_dx else (0,)),
            lm_head_weight.new_empty(lm_head_weight.shape if need_dw else (0,)),
            x.new_empty((0,)) if bias is None or not need_db else bias.new_empty(bias.shape))


selective_log_softmax_fwd = Kernel("selective_log_softmax_fwd", _fwd_impl, _fwd_fake)
selective_log_softmax_bwd = Kernel("selective_log_softmax_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    x, w, target, bias, ignore_index, temperature, softcap, logit_scale, need_entropy, *_ = inputs
    ctx.mark_non_differentiable(*output[2:])
    saved(ctx, x, w, target, bias, output[5], output[1] if need_entropy else None)
    ctx.options = (ignore_index, temperature, softcap, logit_scale)
    ctx.has_bias = bias is not None


def _backward(ctx, g_logp, g_entropy, *_unused):
    x, w, target, bias, lse, entropy = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[3]
    if (g_logp is None and g_entropy is None) or not (need_dx or need_dw or need_db):
        return (None,) * 12
    if g_entropy is not None and entropy is None:  # cannot happen: entropy is an output only when computed
        raise RuntimeError("liger_gen selective_log_softmax: an entropy gradient without a computed entropy")
    g_logp = None if g_logp is None else g_logp.float().contiguous()
    g_entropy = None if g_entropy is None else g_entropy.float().contiguous()
    dx, dw, db = selective_log_softmax_bwd.run(ctx, g_logp, g_entropy, x, w, target, bias, lse,
                                               lse if entropy is None else entropy, *ctx.options,
                                               need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, None, db if need_db else None) + (None,) * 8


_selective_log_softmax_2d = Differentiable(
    selective_log_softmax_fwd, _save, _backward,
    reference="liger_gen.reference.selective_log_softmax_torch", outputs=5)


def token_log_probs_2d(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                       bias: torch.Tensor | None, options: LogProbOptions, outputs=("log_probs",)):
    """The validated 2-D op: a tuple (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1) with None for
    the names not in ``outputs`` (log_probs always); log_probs and entropy differentiable in x, W and bias."""
    out = _selective_log_softmax_2d(x, lm_head_weight, target, bias, *options, "entropy" in outputs,
                                    "log_sum_sq_probs" in outputs, "mean_logits" in outputs, "is_top1" in outputs)
    return tuple(t if (name == "log_probs" or name in outputs) else None for name, t in zip(OUTPUT_NAMES, out))


# ------------------------------------------------------------------------------------------------ public op


def check_inputs(op: str, x, lm_head_weight, target, bias, ignore_index, temperature, softcap,
                 logit_scale) -> LogProbOptions:
    """Validate every argument (TypeError / ValueError naming the tensor, its shape and dtype); the options."""
    for name, t in (("x", x), ("lm_head_weight", lm_head_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{op}: bias must be a tensor or None, got {type(bias).__name__}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}")
    ignore_index = int(ignore_index)
    if not -2**63 <= ignore_index < 2**63:
        raise ValueError(f"{op}: ignore_index must fit in int64, got {ignore_index}")
    # comparisons, not math.isfinite: torch.compile(dynamic=True) traces these as symbolic floats
    temperature = check_float_arg(op, "temperature", temperature)
    if not 1e-30 < temperature < math.inf:  # 1 / temperature is taken in fp32
        raise ValueError(f"{op}: temperature must be a finite number > 1e-30, got {temperature}")
    logit_scale = check_float_arg(op, "logit_scale", logit_scale)
    if not -math.inf < logit_scale < math.inf:
        raise ValueError(f"{op}: logit_scale must be finite, got {logit_scale}")
    if softcap is not None:
        softcap = check_float_arg(op, "softcap", softcap)
        if not 0.0 < softcap < math.inf:
            raise ValueError(f"{op}: softcap must be None or a finite number > 0, got {softcap}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must be (..., hidden) with hidden >= 1; got {describe('x', x)}")
    hidden = x.shape[-1]
    check_lm_head(op, lm_head_weight, bias, hidden)
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden or lm_head_weight.shape[0] < 1:
        raise ValueError(f"{op}: lm_head_weight must be (vocab, {hidden}) for x's hidden size; got "
                         f"{describe('lm_head_weight', lm_head_weight)} and {describe('x', x)}")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"{op}: target must have x's leading shape {tuple(x.shape[:-1])}; got "
                         f"{describe('target', target)} and {describe('x', x)}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"{op}: target must be int64 or int32 token ids; got {describe('target', target)}")
    vocab = lm_head_weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != vocab):
        raise ValueError(f"{op}: bias must be ({vocab},); got {describe('bias', bias)}")
    check_same_device(op, x=x, lm_head_weight=lm_head_weight, target=target, bias=bias)
    for name, t in (("x", x), ("lm_head_weight", lm_head_weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
    for name, t in (("lm_head_weight", lm_head_weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype; got {describe(name, t)} and {describe('x', x)}")
    if x.dtype == torch.float64 and uses_triton(x):
        check_kernel_dtypes(op, x=x)
    return LogProbOptions(ignore_index, temperature, softcap, logit_scale)


def selective_log_softmax(x: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                          bias: torch.Tensor | None = None, temperature: float = 1.0, ignore_index: int = -100,
                          softcap: float | None = None, logit_scale: float = 1.0,
                          return_entropy: bool = False):
    """Log-probability of each chosen token under the LM head, from hidden states, without the full logits.

    With logits ``u = logit_scale·(x @ lm_head_weight.T + bias)``, soft-capped to ``c = softcap·tanh(u/softcap)``
    if ``softcap`` is given (Gemma 2), and ``z = c / temperature``: ``log p_t = z_t[target_t] −
    logsumexp(z_t)``, i.e. ``torch.log_softmax(z, -1).gather(-1, target[..., None])[..., 0]`` (TRL's
    ``selective_log_softmax``; the per-token log-probabilities of DPO, Rafailov et al. 2023, and of GRPO's
    policy ratio, Shao et al. 2024), and optionally the entropy ``H_t = logsumexp(z_t) − Σ_v softmax(z_t)_v
    z_t,v``. Tokens whose target is ``ignore_index`` get 0 for both (and no gradient), as TRL's fused LM head
    returns them. Logits of −inf (tokens masked out through the bias) contribute nothing.

    The rows are processed in chunks: each chunk's logits come from one GEMM with fp32 accumulation (stored in
    x's dtype like transformers' ``lm_head`` output, or in fp32, as the tuned plan says), one Triton launch
    reduces them to the per-token values; the backward recomputes each chunk's logits, turns them into their
    gradient in place and computes dx and dW with two more GEMMs. Gradients are exact (no filtering of small
    terms); for bfloat16, dW is summed over chunks in fp32 (DW_FP32=1) or added into dW in bf16 with one
    rounding per chunk (DW_FP32=0, as Liger-Kernel's chunked losses do by default), as the plan says: at large
    vocabularies the fp32 accumulator (vocab·hidden·4 bytes) exceeds the memory budget and the plan is the bf16
    one, which costs dW accuracy (relative L2 error of the bf16 dW against float64: 5.3e-3, against 2.9e-3 with
    fp32 sums, at 4096 rows × hidden 64 × vocab 512 in 16 chunks on the plain CPU path). Extra memory is
    bounded by ``SelectiveLogSoftmaxSpace.MAX_EXTRA_BYTES`` (256 MiB) whatever the number of tokens.

    Args:
        x: (..., hidden) float32, bfloat16 or float16 hidden states (e.g. the last decoder layer's output,
            shifted so that row t predicts target t); any strides.
        lm_head_weight: (vocab, hidden), x's dtype, on x's device.
        target: x's leading shape, int64 or int32 token ids in [0, vocab) or ``ignore_index``.
        bias: optional (vocab,), x's dtype.
        temperature: > 1e-30 and finite; the logits are divided by it (sampling temperature of RL rollouts).
        ignore_index: target value of tokens to skip (prompt and padding).
        softcap: None, or > 0 for Gemma-2 style tanh soft-capping (applied before the temperature).
        logit_scale: multiplies the logits first (models with ``logit_scale`` or ``logits_scaling``).
        return_entropy: also return the entropy of each token's distribution.

    Returns:
        log_probs, float32 of x's leading shape (float64 for float64 inputs on the plain CPU path); with
        ``return_entropy``, the tuple (log_probs, entropy). Both are differentiable in x, lm_head_weight and bias
        (double backward and forward-mode AD are not supported; ``torch.func.grad``, ``vjp``, ``jacrev`` and
        ``vmap`` run the kernels).

    CUDA tensors run the tuned chunk plan and Triton kernels for the current GPU; CPU tensors run the same
    chunk loop in plain PyTorch, or with the Triton kernels in Triton's interpreter when ``TRITON_INTERPRET=1``.
    float64 runs the unfused reference on the plain CPU path only.

    Raises:
        TypeError: a tensor argument is not a tensor, x / lm_head_weight / bias are not floating or differ in
            dtype, float64 on the kernel path, target is not int64/int32, a scalar option has the wrong type.
        ValueError: lm_head_weight is not (vocab, hidden), target's shape is not x's leading shape, bias is not
            (vocab,), lm_head_weight is a DeepSpeed ZeRO-3 partition or empty, tensors on different devices,
            temperature <= 1e-30 or infinite, softcap <= 0, a non-finite logit_scale, ignore_index outside int64, or
            (CPU) a target outside [0, vocab) that is not ignore_index; on CUDA such a target stops the program
            with a device-side assertion at the next synchronisation, as PyTorch's cross-entropy does.
    """
    op = "selective_log_softmax"
    options = check_inputs(op, x, lm_head_weight, target, bias, ignore_index, temperature, softcap, logit_scale)
    if not isinstance(return_entropy, bool):
        kind = type(return_entropy)
        raise TypeError(f"{op}: return_entropy must be a Python bool, got {kind.__module__}.{kind.__qualname__} "
                        f"{return_entropy!r}")
    if x.dtype == torch.float64:  # plain CPU path only (checked above): the unfused reference
        check_targets(op, target.reshape(-1), lm_head_weight.shape[0], ignore_index)
        logp, entropy = selective_log_softmax_torch(x, lm_head_weight, target, bias, options.temperature,
                                                    ignore_index, options.softcap, options.logit_scale)
        return (logp, entropy) if return_entropy else logp
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    if x2d.stride(0) != 1 and x2d.stride(1) != 1:  # GEMMs take row- or column-major operands without a copy
        x2d = x2d.contiguous()
    outputs = ("log_probs", "entropy") if return_entropy else ("log_probs",)
    logp, entropy, *_ = token_log_probs_2d(x2d, lm_head_weight, target.reshape(-1).contiguous(), bias, options,
                                           outputs)
    logp = logp.view(target.shape)
    return (logp, entropy.view(target.shape)) if return_entropy else logp
