"""Rotary position embedding (Su et al., 2021, RoFormer): references, search space, tuning problem, custom ops
and the public op.

transformers' ``apply_rotary_pos_emb`` (rotate_half layout), with partial rotary as GPT-NeoX / Phi do it:

    r = cos.shape[-1]
    out[..., :r] = x[..., :r]·cos + rotate_half(x[..., :r])·sin,   rotate_half(x) = cat(−x2, x1)
    out[..., r:] = x[..., r:]
    dx[..., :r]  = g·cos + rotate_half^T(g·sin),   rotate_half^T(y) = cat(y2, −y1)   (rotation by −θ)

Kernels: ``templates/rope.py.jinja``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from liger_gen.codegen.problems import REL_TOL, Inputs, Problem, randn, reference_by_autograd
from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2, warps_for
from liger_gen.codegen.spec import OpSpec
from liger_gen.runtime import plans
from liger_gen.runtime.binding import Differentiable, Kernel, PlannedOp, saved
from liger_gen.runtime.ops import (check_kernel_dtypes, check_same_device, check_tensor, describe, kernel_module,
                                   uses_triton)

POSITION_DTYPES = (torch.int32, torch.int64)

# ------------------------------------------------------------------------------------------------ references


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: ``cat(−x2, x1)`` with x1, x2 the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_out_dtype(x_dtype: torch.dtype, cos_dtype: torch.dtype, sin_dtype: torch.dtype | None = None) -> torch.dtype:
    """Dtype of ``x·cos + rotate_half(x)·sin`` under PyTorch's promotion (bf16 q with fp32 cos gives fp32)."""
    return torch.promote_types(torch.promote_types(x_dtype, cos_dtype), sin_dtype or cos_dtype)


def rope_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in plain PyTorch, exactly transformers' ``apply_rotary_pos_emb`` (differentiable by autograd).

    With ``position_ids``, cos/sin are (max_position, r) tables and are indexed first, as older transformers
    did (``cos = cos[position_ids]``). With r < head_dim the first r dims are rotated and the rest passed
    through, as GPT-NeoX's ``apply_rotary_pos_emb`` does (same rounding, same dtype promotion).
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = q_rot * cos + rotate_half(q_rot) * sin
    k_embed = k_rot * cos + rotate_half(k_rot) * sin
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def rope_float64(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact RoPE in float64 (no intermediate rounding); differentiable, so autograd gives the float64 grads."""
    return rope_torch(q.double(), k.double(), cos.double(), sin.double(), position_ids, unsqueeze_dim)


def _rope_bwd_torch(dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    position_ids: torch.Tensor | None, q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's backward formula in PyTorch (fp32, rounded once), for (batch, heads, seq, head_dim) grads."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    r = cos.shape[-1]

    def one(g):
        g_rot = g[..., :r].float()
        gs = g_rot * sin
        dx = g_rot * cos + torch.cat((gs[..., r // 2:], -gs[..., : r // 2]), dim=-1)  # rotate_half^T(g·sin)
        return torch.cat([dx, g[..., r:].float()], dim=-1).to(q_dtype)

    return one(dq_out), one(dk_out)


def _cos_sin_grads(dq_out, dk_out, q, k, cos, sin, position_ids):
    """d cos, d sin (in their dtypes) for (batch, heads, seq, head_dim) q, k: fp32 sums over heads (and over
    the batch for batch-1 cos/sin, or scattered into the table rows with position_ids). Plain PyTorch: only
    computed when cos or sin requires grad, which transformers' cos/sin (from a non-trainable buffer) never do."""
    r = cos.shape[-1]
    d_cos = d_sin = None
    for g, x in ((dq_out, q), (dk_out, k)):
        g_rot, x_rot = g[..., :r].float(), x[..., :r].float()
        dc, ds = (g_rot * x_rot).sum(1), (g_rot * rotate_half(x_rot)).sum(1)  # (batch, seq, r)
        d_cos, d_sin = (dc, ds) if d_cos is None else (d_cos + dc, d_sin + ds)
    if position_ids is None:
        if cos.shape[0] == 1 and d_cos.shape[0] != 1:
            d_cos, d_sin = d_cos.sum(0, keepdim=True), d_sin.sum(0, keepdim=True)
    else:
        n_positions = cos.shape[0]
        pos = position_ids.expand(d_cos.shape[0], d_cos.shape[1]).reshape(-1).long()
        pos = torch.where(pos < 0, pos + n_positions, pos)
        d_cos = d_cos.new_zeros((n_positions, r)).index_add_(0, pos, d_cos.reshape(-1, r))
        d_sin = d_sin.new_zeros((n_positions, r)).index_add_(0, pos, d_sin.reshape(-1, r))
    return d_cos.to(cos.dtype), d_sin.to(sin.dtype)


# ------------------------------------------------------------------------------------------------ search space


@dataclass(frozen=True)
class RoPEConfig(KernelConfig):
    """Launch settings of one RoPE variant (``templates/rope.py.jinja``).

    BLOCK_HALF (next_power_of_2(rotary_dim / 2)) and BLOCK_PASS (next_power_of_2(head_dim − rotary_dim), 0
    without pass-through dims) follow from the dims. A program takes BLOCK_M rows (batch·seq positions), loads
    their cos/sin once, and walks all heads BLOCK_H at a time (BLOCK_H is clamped to each tensor's head count
    at launch). ``qk_launches`` 1 rotates q and k in one launch (one program does both, one load of cos/sin);
    2 launches the kernel for q, then for k.
    """

    BLOCK_HALF: int
    BLOCK_PASS: int = 0
    BLOCK_M_FWD: int = 1
    BLOCK_H_FWD: int = 8
    num_warps_fwd: int = 4
    num_stages_fwd: int = 1
    qk_launches_fwd: int = 1
    BLOCK_M_BWD: int = 1
    BLOCK_H_BWD: int = 8
    num_warps_bwd: int = 4
    num_stages_bwd: int = 1
    qk_launches_bwd: int = 1


def _floor_power_of_2(n: int) -> int:
    """Largest power of two <= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


class RoPESpace(Space):
    """Search space, constraints and heuristic of RoPE for dims ``{"n_q_heads", "n_kv_heads", "head_dim",
    "rotary_dim"}`` and a dtype; rows = batch·seq."""

    op = "rope"
    template = "rope"
    config_cls = RoPEConfig
    DIMS = ("n_q_heads", "n_kv_heads", "head_dim", "rotary_dim")
    MAX_HEAD_DIM = 1024  # a (BLOCK_M, BLOCK_H, head_dim) tile per step; no model uses more than 256
    # fp32 values one thread may hold (x tile of both halves + pass-through, and the four cos/sin halves)
    MAX_ELEMS_PER_THREAD = 64
    TARGET_TILE = 2048  # x elements per step in the heuristic: ~16 per thread at 4 warps
    BLOCK_H_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)

    PARAMS = (
        Param("BLOCK_M_FWD", (1, 2, 4, 8, 16, 32), "fwd"),
        Param("BLOCK_H_FWD", BLOCK_H_CHOICES, "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16), "fwd"),
        Param("num_stages_fwd", (1, 2, 3), "fwd"),
        Param("qk_launches_fwd", (1, 2), "fwd"),
        Param("BLOCK_M_BWD", (1, 2, 4, 8, 16, 32), "bwd"),
        Param("BLOCK_H_BWD", BLOCK_H_CHOICES, "bwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16), "bwd"),
        Param("num_stages_bwd", (1, 2, 3), "bwd"),
        Param("qk_launches_bwd", (1, 2), "bwd"),
    )

    def check_dims(self) -> None:
        d = self.dims
        self.head_dim, self.rotary_dim = d["head_dim"], d["rotary_dim"]
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"{self.op}: rotary_dim must be even and <= head_dim, got rotary_dim={self.rotary_dim}, "
                             f"head_dim={self.head_dim}")
        if self.head_dim > self.MAX_HEAD_DIM:
            raise ValueError(f"{self.op} supports head_dim <= {self.MAX_HEAD_DIM}, got head_dim={self.head_dim}")
        self.block_half = next_power_of_2(self.rotary_dim // 2)
        pass_width = self.head_dim - self.rotary_dim
        self.block_pass = next_power_of_2(pass_width) if pass_width else 0
        self.max_block_h = next_power_of_2(max(d["n_q_heads"], d["n_kv_heads"]))

    def _head_elems(self) -> int:
        """Elements of one head in a tile: both rotated halves and the pass-through dims."""
        return 2 * self.block_half + self.block_pass

    def live_elements(self, block_m: int, block_h: int) -> int:
        """fp32 values a program holds per step: the x tile and the four cos/sin halves of its rows."""
        return block_m * (min(block_h, self.max_block_h) * self._head_elems() + 4 * self.block_half)

    def heuristic(self) -> RoPEConfig:
        """Analytic default, valid for every supported dims: ~2K-element tiles of at most as many heads as the
        key has (a block of heads wider than k's head count is mostly masked lanes in k's launch), more rows
        per program for the rest of the tile, ~16 elements per thread.

        The head cap follows the H200 tables: at Llama-3.2-1B's and Qwen2.5-0.5B's shapes the tuned configs
        use 8 and 2 heads per block with 4-32 rows and ran 1.26-1.6x the all-heads rule this replaces."""
        e = self._head_elems()
        kv = self.dims["n_kv_heads"]  # one k head (multi-query attention): not measured, all of q's heads as before
        heads = _floor_power_of_2(min(self.dims["n_q_heads"], kv)) if kv > 1 else self.max_block_h
        block_h = min(self.max_block_h, self.BLOCK_H_CHOICES[-1], _floor_power_of_2(self.TARGET_TILE // e), heads)
        block_m = min(32, _floor_power_of_2(self.TARGET_TILE // (block_h * e)))
        warps = warps_for(self.live_elements(block_m, block_h), max_warps=8, per_thread=16)
        warps = min(warps, self.limits.max_threads_per_block // 32)
        config = RoPEConfig(
            BLOCK_HALF=self.block_half, BLOCK_PASS=self.block_pass,
            BLOCK_M_FWD=block_m, BLOCK_H_FWD=block_h, num_warps_fwd=warps, num_stages_fwd=1, qk_launches_fwd=1,
            BLOCK_M_BWD=block_m, BLOCK_H_BWD=block_h, num_warps_bwd=warps, num_stages_bwd=1, qk_launches_bwd=1,
        )
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for {self.dims}: {problems}"
        return config

    def shape_violations(self, config: RoPEConfig) -> list[str]:
        """Derived block sizes, redundant head blocks, threads, registers and shared memory of both kernels."""
        problems: list[str] = []
        if config.BLOCK_HALF != self.block_half:
            problems.append(f"BLOCK_HALF={config.BLOCK_HALF} is not next_power_of_2(rotary_dim / 2)={self.block_half}")
        if config.BLOCK_PASS != self.block_pass:
            problems.append(f"BLOCK_PASS={config.BLOCK_PASS} is not {self.block_pass} "
                            f"(next_power_of_2(head_dim - rotary_dim), 0 when equal)")
        for phase, block_m, block_h, warps, stages in (
            ("fwd", config.BLOCK_M_FWD, config.BLOCK_H_FWD, config.num_warps_fwd, config.num_stages_fwd),
            ("bwd", config.BLOCK_M_BWD, config.BLOCK_H_BWD, config.num_warps_bwd, config.num_stages_bwd),
        ):
            if block_h > self.max_block_h:  # clamped at launch: the same kernel as max_block_h, measured twice
                problems.append(f"{phase}: BLOCK_H={block_h} > next_power_of_2(max heads)={self.max_block_h}")
            problems += self.threads_violations(phase, warps, self.live_elements(block_m, block_h),
                                                self.MAX_ELEMS_PER_THREAD)
            # pipelining the head loop keeps (stages - 1) x tiles in shared memory
            smem = (stages - 1) * block_m * min(block_h, self.max_block_h) * self._head_elems() * self.element_size
            problems += self.smem_violations(phase, smem)
        return problems


# ------------------------------------------------------------------------------------------------ tuning


def llama_cos_sin(seq: int, rotary_dim: int, dtype: torch.dtype, device, base: float = 500000.0):
    """cos/sin (1, seq, rotary_dim) as LlamaRotaryEmbedding makes them (Llama 3's rope_theta by default): fp32
    math, cast to the activations' dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].to(device, dtype), emb.sin()[None].to(device, dtype)


def sequence_length(rows: int, longest: int = 4096) -> int:
    """The sequence length of a batch of ``rows`` tokens in the bench and tuning shapes: one sequence up to 4096
    tokens, else gcd(rows, 4096) (16384 tokens are 4 sequences of 4096) — or one sequence when that gcd is
    below 64, so that the rotations differ across positions (a sequence of 1 is the identity)."""
    rows = int(rows)
    if rows <= longest:
        return max(rows, 1)  # zero rows: one empty batch of sequences of 1
    seq = math.gcd(rows, longest)
    return seq if seq >= 64 else rows


class RoPEProblem(Problem):
    """RoPE at rows = batch·seq tokens in ``dtype``: q, k in transformers' layout (a (b, s, h, d) projection
    viewed as (b, h, s, d)), cos/sin (1, seq, rotary_dim) in ``dtype`` as LlamaRotaryEmbedding gives them."""

    SPACE = RoPESpace
    OUTPUTS = ("q_out", "k_out")
    # each pass: q, k (or their gradients) in and out, cos and sin in
    BYTES_FORMULA = "4·R·(Hq + Hkv)·D·s + 4·S·D·s"

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        """The model's attention RoPE: rotary_dim = the model's ``rotary_dim`` (partial rotary), else head_dim."""
        return {"n_q_heads": model.num_attention_heads, "n_kv_heads": model.num_key_value_heads,
                "head_dim": model.head_dim, "rotary_dim": getattr(model, "rotary_dim", None) or model.head_dim}

    @classmethod
    def bench_dims(cls, model, rows: int) -> dict[str, int]:
        seq = sequence_length(rows)
        return {"rows": int(rows), "batch": int(rows) // seq, "seq": seq, **cls.shape(model)}

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        b, s, hq, hk, hd = dims["batch"], dims["seq"], dims["n_q_heads"], dims["n_kv_heads"], dims["head_dim"]

        def heads(n):  # transformers' layout: a (b, s, h, d) projection viewed as (b, h, s, d)
            return randn(gen, (b, s, n, hd), dtype, device).transpose(1, 2)

        cos, sin = llama_cos_sin(s, dims["rotary_dim"], dtype, device)
        return Inputs({"q": heads(hq), "k": heads(hk), "cos": cos, "sin": sin}, grad_of=("q", "k"),
                      upstream={"q_out": heads(hq), "k_out": heads(hk)})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        return reference_by_autograd(inputs, lambda t, o: rope_float64(t["q"], t["k"], t["cos"], t["sin"]),
                                     cls.OUTPUTS)

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        qk = dims["rows"] * (dims["n_q_heads"] + dims["n_kv_heads"]) * dims["head_dim"] * s
        one_pass = 2 * qk + 2 * dims["seq"] * dims["rotary_dim"] * s
        return {"fwd": one_pass, "bwd": one_pass}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seq_len: int | None = None, seed: int = 0,
                 limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        self.seq = seq_len or sequence_length(self.rows)
        if self.rows % self.seq:
            raise ValueError(f"rows={self.rows} is not a multiple of seq_len={self.seq}")
        inputs = self.make_inputs(self.problem_dims, dtype, self.device, self.device_generator, {})
        q, k = inputs.tensors["q"], inputs.tensors["k"]
        self.buffers = {
            **inputs.tensors, "dq_out": inputs.upstream["q_out"], "dk_out": inputs.upstream["k_out"],
            "q_out": torch.empty_like(q), "k_out": torch.empty_like(k),
            "dq": torch.empty_like(q), "dk": torch.empty_like(k),
        }
        self.ref = self.reference(inputs)
        tol = REL_TOL[dtype]
        self.tol = {"q_out": tol, "k_out": tol, "dq": tol, "dk": tol}
        self.outputs = {"fwd": ("q_out", "k_out"), "bwd": ("dq", "dk")}

    @property
    def problem_dims(self) -> dict[str, int]:
        return {"rows": self.rows, "batch": self.rows // self.seq, "seq": self.seq, **self.dims}

    def launcher(self, module, phase: str):
        b = self.buffers
        if phase == "fwd":
            return lambda: module.forward(b["q"], b["k"], b["cos"], b["sin"], None, b["q_out"], b["k_out"])
        if phase == "bwd":
            return lambda: module.backward(b["dq_out"], b["dk_out"], b["cos"], b["sin"], None, b["dq"], b["dk"])
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The model's attention RoPE (rotary_dim as ``RoPEProblem.shape`` says), one problem per token count."""
    return [RoPEProblem(dtype, RoPEProblem.shape(model), r, device, seed=seed) for r in rows]


SPEC = OpSpec("rope", RoPESpace, RoPEProblem, tuning_problems, custom_ops=("liger_gen::rope_fwd", "liger_gen::rope_bwd"))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ binding
# The ops take q, k in (batch, heads, seq, head_dim) index order with unit head_dim stride and any other
# strides (the public function transposes unsqueeze_dim=2 layouts into this order as views).


def _dims(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> dict[str, int]:
    return {"n_q_heads": q.shape[1], "n_kv_heads": k.shape[1], "head_dim": q.shape[-1], "rotary_dim": cos.shape[-1]}


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              position_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q_out, k_out in the promoted dtype of (q, cos, sin), laid out like q and k (when they are dense)."""
    out_dtype = rope_out_dtype(q.dtype, cos.dtype, sin.dtype)
    q_out, k_out = torch.empty_like(q, dtype=out_dtype), torch.empty_like(k, dtype=out_dtype)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    if uses_triton(q) and q.numel() and k.numel():
        module, _, _ = kernel_module(RoPESpace, q, _dims(q, k, cos), q.shape[0] * q.shape[2])
        module.forward(q, k, cos, sin, position_ids, q_out, k_out)
    else:  # CPU without the interpreter (only reached when the op is called directly), or zero heads
        q_ref, k_ref = rope_torch(q, k, cos, sin, position_ids, 1)
        q_out.copy_(q_ref)
        k_out.copy_(k_ref)
    return q_out, k_out


def _bwd_impl(dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              position_ids: Optional[torch.Tensor], q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """dq, dk in q's dtype (fp32 math, one rounding), laid out like the incoming grads."""
    if dq_out.stride(-1) != 1:
        dq_out = dq_out.contiguous()
    if dk_out.stride(-1) != 1:
        dk_out = dk_out.contiguous()
    dq, dk = torch.empty_like(dq_out, dtype=q_dtype), torch.empty_like(dk_out, dtype=q_dtype)
    if dq.numel() == 0 and dk.numel() == 0:
        return dq, dk
    if uses_triton(dq_out) and dq.numel() and dk.numel():
        module, _, _ = kernel_module(RoPESpace, dq, _dims(dq_out, dk_out, cos), dq_out.shape[0] * dq_out.shape[2])
        module.backward(dq_out, dk_out, cos, sin, position_ids, dq, dk)
    else:
        dq_ref, dk_ref = _rope_bwd_torch(dq_out, dk_out, cos, sin, position_ids, q_dtype)
        dq.copy_(dq_ref)
        dk.copy_(dk_ref)
    return dq, dk


def _bwd_layout(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(g if g.stride(-1) == 1 else g.contiguous(), dtype=dtype)


def _fwd_fake(q, k, cos, sin, position_ids):
    out_dtype = rope_out_dtype(q.dtype, cos.dtype, sin.dtype)
    return torch.empty_like(q, dtype=out_dtype), torch.empty_like(k, dtype=out_dtype)


def _bwd_fake(dq_out, dk_out, cos, sin, position_ids, q_dtype):
    return _bwd_layout(dq_out, q_dtype), _bwd_layout(dk_out, q_dtype)


rope_fwd = Kernel("rope_fwd", _fwd_impl, _fwd_fake)
rope_bwd = Kernel("rope_bwd", _bwd_impl, _bwd_fake)


def _save(ctx, inputs, output):
    q, k, cos, sin, position_ids = inputs
    q_out, k_out = output
    keep_qk = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]  # q and k only for cos/sin gradients
    saved(ctx, cos, sin, position_ids, *((q, k) if keep_qk else (None, None)))
    ctx.q_dtype = q.dtype
    ctx.out_meta = ((q_out.shape, q_out.dtype), (k_out.shape, k_out.dtype))


def _backward(ctx, dq_out, dk_out):
    cos, sin, position_ids, q, k = ctx.saved_tensors
    q_out_meta, k_out_meta = ctx.out_meta
    if dq_out is None:  # an output autograd did not materialise: its grad is zero
        dq_out = torch.zeros(q_out_meta[0], dtype=q_out_meta[1], device=cos.device)
    if dk_out is None:
        dk_out = torch.zeros(k_out_meta[0], dtype=k_out_meta[1], device=cos.device)
    need_q, need_k, need_cos, need_sin = ctx.needs_input_grad[:4]
    dq = dk = d_cos = d_sin = None
    if need_q or need_k:
        dq, dk = rope_bwd.run(ctx, dq_out, dk_out, cos, sin, position_ids, ctx.q_dtype)
    if (need_cos or need_sin) and q is not None:
        d_cos, d_sin = _cos_sin_grads(dq_out, dk_out, q, k, cos, sin, position_ids)
    return (dq if need_q else None), (dk if need_k else None), (d_cos if need_cos else None), \
        (d_sin if need_sin else None), None


rope_4d = Differentiable(rope_fwd, _save, _backward, reference="liger_gen.reference.rope_torch")
"""(q_out, k_out) of (batch, heads, seq, head_dim)-indexed q, k with unit head_dim stride, differentiable in q,
k, cos and sin."""


# ------------------------------------------------------------------------------------------------ eager plan


class _Plan(plans.Plan):
    """One validated call shape of ``rope`` on the Triton path, in the kernels' (batch, heads, seq, head_dim)
    order: the kernel module, the output dtype and the launches ``_fwd_impl`` and ``_bwd_impl`` make, recorded
    (``liger_gen.runtime.plans``). ``transposed``: the public q, k are (batch, seq, heads, head_dim)."""

    __slots__ = ("q_dtype", "out_dtype", "module", "transposed")
    BACKWARD = rope_bwd
    GRAD_INPUTS = (0, 1)

    def __init__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool):
        super().__init__(q.device)
        self.q_dtype = q.dtype
        self.out_dtype = rope_out_dtype(q.dtype, cos.dtype, sin.dtype)
        self.module = kernel_module(RoPESpace, q, _dims(q, k, cos), q.shape[0] * q.shape[2])[0]
        self.transposed = transposed

    def inputs(self, q, k, cos, sin, position_ids, unsqueeze_dim, half_tables):
        if self.transposed:
            return q.transpose(1, 2), k.transpose(1, 2), cos, sin, position_ids
        return q, k, cos, sin, position_ids

    def needs_grad(self, inputs) -> bool:
        return inputs[0].requires_grad or inputs[1].requires_grad

    def forward(self, q, k, cos, sin, position_ids):
        q_out = torch.empty_like(q, dtype=self.out_dtype)
        k_out = torch.empty_like(k, dtype=self.out_dtype)
        self.fwd((q, k, cos, sin, position_ids, q_out, k_out), self.module.forward, q, k, cos, sin, position_ids,
                 q_out, k_out)
        return q_out, k_out

    def backward(self, dq_out, dk_out, cos, sin, position_ids, q_dtype):
        if dq_out.stride(-1) != 1 or dk_out.stride(-1) != 1:
            return _bwd_impl(dq_out, dk_out, cos, sin, position_ids, self.q_dtype)
        key = (dq_out.shape, dq_out.stride(), dq_out.dtype, dk_out.shape, dk_out.stride(), dk_out.dtype)
        launches = self.launches_for(key)
        dq = torch.empty_like(dq_out, dtype=self.q_dtype)
        dk = torch.empty_like(dk_out, dtype=self.q_dtype)
        launches((dq_out, dk_out, cos, sin, position_ids, dq, dk), self.module.backward, dq_out, dk_out, cos, sin,
                 position_ids, dq, dk)
        return dq, dk

    def result(self, outputs, *args):
        q_out, k_out = outputs
        if self.transposed:
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        return q_out, k_out


def _key(q, k, cos, sin, position_ids, unsqueeze_dim, half_tables):
    plain = plans.PLAIN
    if half_tables is not False or type(unsqueeze_dim) is not int or type(q) not in plain or type(k) not in plain \
            or type(cos) not in plain or type(sin) not in plain or not (
                position_ids is None or type(position_ids) is torch.Tensor):
        return None
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, cos.shape, cos.stride(),
            cos.dtype, cos.device, sin.shape, sin.stride(), sin.dtype, sin.device, plans.meta_or_none(position_ids),
            unsqueeze_dim, cos.requires_grad or sin.requires_grad)


def _checked(q, k, cos, sin, position_ids, unsqueeze_dim, half_tables):
    """``rope``'s checks: (cos, sin) as the op takes them (widened for ``half_tables``), unsqueeze_dim as 1 or 2,
    and whether the kernels take the call (else the plain-PyTorch path)."""
    op = "rope"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(op, name, t)
    if not isinstance(half_tables, bool):
        raise TypeError(f"{op}: half_tables must be a bool, got {type(half_tables).__name__}")
    if half_tables and cos.dim() and sin.dim():
        if cos.shape != sin.shape:
            raise ValueError(f"{op}: cos and sin must have the same shape; got {describe('cos', cos)} and "
                             f"{describe('sin', sin)}")
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if position_ids is not None:
        check_tensor(op, "position_ids", position_ids)
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(f"{op}: unsqueeze_dim must be 1 (q, k as (batch, heads, seq, head_dim)) or 2 ((batch, "
                         f"seq, heads, head_dim)), or -3 / -2; got {unsqueeze_dim!r}")
    unsqueeze_dim = unsqueeze_dim % 4
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    layout = "(batch, heads, seq, head_dim)" if unsqueeze_dim == 1 else "(batch, seq, heads, head_dim)"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}; "
                             f"got {describe(name, t)}")
    batch, seq, head_dim = q.shape[0], q.shape[seq_dim], q.shape[-1]
    if k.shape[0] != batch or k.shape[seq_dim] != seq or k.shape[-1] != head_dim:
        raise ValueError(f"{op}: k must match q's batch, seq and head_dim in {layout}; got {describe('q', q)} "
                         f"and {describe('k', k)}")
    for a, b, ta, tb in (("q", "k", q, k), ("cos", "sin", cos, sin)):
        for name, t in ((a, ta), (b, tb)):
            if not t.is_floating_point():
                raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16; got {describe(name, t)}")
        if ta.dtype != tb.dtype:
            raise TypeError(f"{op}: {a} and {b} must have the same dtype; got {describe(a, ta)} and {describe(b, tb)}")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos and sin must have the same shape; got {describe('cos', cos)} and "
                         f"{describe('sin', sin)}")
    rotary_dim = cos.shape[-1] if cos.dim() else 0
    if position_ids is None:
        if cos.dim() != 3 or cos.shape[1] != seq or cos.shape[0] not in (1, batch):
            raise ValueError(f"{op}: without position_ids, cos and sin must be (batch or 1, seq, rotary_dim) = "
                             f"({batch} or 1, {seq}, rotary_dim) for {describe('q', q)} with unsqueeze_dim="
                             f"{unsqueeze_dim}; got {describe('cos', cos)}")
    else:
        if position_ids.dtype not in POSITION_DTYPES:
            raise TypeError(f"{op}: position_ids must be int32 or int64; got {describe('position_ids', position_ids)}")
        if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
            raise ValueError(f"{op}: position_ids must be (batch or 1, seq) = ({batch} or 1, {seq}) for "
                             f"{describe('q', q)}; got {describe('position_ids', position_ids)}")
        if cos.dim() != 2:
            raise ValueError(f"{op}: with position_ids, cos and sin must be (max_position, rotary_dim) tables; "
                             f"got {describe('cos', cos)}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"{op}: rotary_dim = cos.shape[-1] must be even, >= 2 and <= head_dim={head_dim}; got "
                         f"{describe('cos', cos)} for {describe('q', q)}")
    check_same_device(op, q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if not uses_triton(q):
        return cos, sin, unsqueeze_dim, False
    check_kernel_dtypes(op, q=q, cos=cos)
    if head_dim > RoPESpace.MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {head_dim} exceeds the kernel's limit {RoPESpace.MAX_HEAD_DIM}; "
                         f"got {describe('q', q)}")
    return cos, sin, unsqueeze_dim, True


def _prepare(q, k, cos, sin, position_ids, unsqueeze_dim, half_tables) -> _Plan | None:
    cos, sin, unsqueeze_dim, kernel = _checked(q, k, cos, sin, position_ids, unsqueeze_dim, half_tables)
    if not kernel or cos.requires_grad or sin.requires_grad or not q.numel() or not k.numel() or \
            not q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1:
        return None  # the full path (the plain-PyTorch path, table gradients, nothing to launch, or copies)
    transposed = unsqueeze_dim == 2
    if transposed:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return _Plan(q, k, cos, sin, transposed)


def _full(q, k, cos, sin, position_ids, unsqueeze_dim, half_tables):
    cos, sin, unsqueeze_dim, kernel = _checked(q, k, cos, sin, position_ids, unsqueeze_dim, half_tables)
    if not kernel:
        return rope_torch(q, k, cos, sin, position_ids, unsqueeze_dim)
    if unsqueeze_dim == 2:  # (batch, seq, heads, d) → (batch, heads, seq, d) views: the kernel reads strides
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    q_out, k_out = rope_4d(q, k, cos, sin, position_ids)
    if unsqueeze_dim == 2:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


rope_planned = PlannedOp(rope_4d, key=_key, prepare=_prepare, full=_full)
"""``rope`` through per-call-shape plans (``liger_gen.runtime.binding.PlannedOp``)."""


# ------------------------------------------------------------------------------------------------ public op


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1,
         half_tables: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k (Su et al., 2021, RoFormer): transformers' ``apply_rotary_pos_emb``.

    ``out = x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = cat(−x2, x1)`` (x1, x2 the two halves of the
    rotated dims). With ``r = cos.shape[-1] < head_dim`` only ``x[..., :r]`` is rotated and ``x[..., r:]`` is
    passed through unchanged (partial rotary, as GPT-NeoX / Phi / StableLM do).

    Args:
        q: (batch, n_q_heads, seq, head_dim) with ``unsqueeze_dim=1``, or (batch, seq, n_q_heads, head_dim)
            with ``unsqueeze_dim=2``; float32, bfloat16 or float16; any strides (e.g. transformers'
            ``(b, s, h, d).transpose(1, 2)`` projection views are read in place).
        k: like q with n_kv_heads heads (any count: MHA, GQA, MQA with one KV head), same batch, seq, head_dim
            and dtype.
        cos, sin: without position_ids, per-position tables of shape (batch or 1, seq, r) as transformers'
            rotary embeddings return them; with position_ids, (max_position, r) tables. r must be even and
            <= head_dim. Floating; same dtype for both (may differ from q's: see Returns).
        position_ids: None (current transformers: cos/sin are already per position), or a (batch or 1, seq)
            int32/int64 tensor: cos/sin are then gathered at these positions inside the kernel, i.e. the
            result equals ``rope(q, k, cos[position_ids], sin[position_ids])`` (the layout older transformers
            used). Negative positions count from the end of the table, like PyTorch indexing.
        unsqueeze_dim: 1 for (batch, heads, seq, head_dim) q/k, 2 for (batch, seq, heads, head_dim); -3 and -2
            are the same dims counted from the end (transformers unsqueezes cos/sin at this dim).
        half_tables: cos and sin hold one angle per rotated pair (last dim r/2, as GPT-OSS's rotary embedding
            returns them) rather than ``cat(freqs, freqs)``: they are widened to r first (a copy of the tables,
            which are small next to q and k). r is then twice their last dim.

    Returns:
        (q_out, k_out): new tensors of q's and k's shapes, in the dtype PyTorch's promotion gives
        ``q·cos + rotate_half(q)·sin`` (bf16 q with bf16 cos/sin → bf16, each product rounded to bf16 before
        the sum as PyTorch does; bf16 q with fp32 cos/sin → fp32). Laid out like q and k when those are dense.
        Differentiable in q and k: the backward is the rotation by −θ, ``dq = g·cos + rotate_half^T(g·sin)``,
        computed in fp32 and rounded once to q's dtype. cos and sin get gradients only if they require grad
        (transformers' never do: they come from a non-trainable buffer); those are computed in plain PyTorch
        (fp32 sums over heads, batch and, with position_ids, table rows), and only then are q and k saved.
        On the kernel path q_out and k_out come from one autograd node (one launch rotates both): backpropagate
        them together, as attention does, or keep the graph (``retain_graph=True``) for a second backward.

    CUDA tensors run the tuned Triton kernel for the current GPU; CPU tensors run plain PyTorch (bit-identical
    to transformers), or the same Triton kernel in Triton's interpreter when ``TRITON_INTERPRET=1``. float64 is
    accepted on the plain-PyTorch path only.

    Raises:
        TypeError: an argument is not a tensor; q/k or cos/sin are not floating or differ in dtype; float64 on
            the kernel path; position_ids is not int32/int64; half_tables is not a bool.
        ValueError: q or k is not 4-D; k's batch, seq or head_dim differs from q's; cos and sin differ in
            shape; r is odd, zero or larger than head_dim; cos's seq differs from q's or its batch is neither
            1 nor q's batch; with position_ids, cos is not a 2-D table or position_ids is not (batch or 1,
            seq); head_dim exceeds 1024 on the kernel path; unsqueeze_dim is not 1, 2, -3 or -2; tensors
            are on different devices.

    Not checked: position values on the kernel path (that would need a host sync). A position still out of
    range after wrapping negatives reads cos = sin = 0 (its rows of q_out/k_out are zero in the rotated dims);
    the kernel never reads outside the table. The plain-PyTorch path raises IndexError, as indexing does.
    """
    return rope_planned(q, k, cos, sin, position_ids, unsqueeze_dim, half_tables)
