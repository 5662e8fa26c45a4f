"""Mixture-of-experts experts (Shazeer et al. 2017; top-k routing as in Mixtral, Jiang et al. 2024): the token
permutations around the grouped GEMMs — references, search space, tuning problem, custom ops — and
``moe_experts``, the whole experts computation of transformers' fused ``*Experts`` modules.

    pairs (t, j), t < T, j < k, sorted by expert (stable): sorted row i holds token_i; pos[t, j] is the row of (t, j)
    xs  = x[token]                                     permute (T·k, H)
    h   = act(xs · W_gate[e]ᵀ) · (xs · W_up[e]ᵀ)        grouped GEMM + GLU, per expert e of the row
    ys  = h · W_down[e]ᵀ                               grouped GEMM
    out[t] = Σ_j w[t, j] · ys[pos[t, j]]              unpermute: the routing-weighted sum (T, H)

The GEMMs run as PyTorch's grouped GEMM (``torch._grouped_mm``, CUTLASS on CUDA) or, where it cannot take
the operands, one GEMM per expert; the GLU is ``swiglu_gate_up`` / ``geglu_gate_up``; the two permutations are
this module's kernels (``templates/moe_permute.py.jinja``): one gather, and one fixed-order sum per token in fp32
for the forward and for the input gradient — deterministic, no atomics. The routing weights' gradient is a row
dot product fused into the unpermute backward. Tuned as the op "moe_permute" (its kernels' launch settings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_gen.codegen.problems import REL_TOL, Inputs, Problem, float64_grads, randn
from liger_gen.codegen.spaces import KernelConfig, Param, Space, next_power_of_2
from liger_gen.codegen.spec import OpSpec
from liger_gen.ops.glu.activations import GLU_ACTIVATIONS, act_torch
from liger_gen.runtime.binding import Differentiable, Kernel, saved
from liger_gen.runtime.ops import check_same_device, describe, kernel_module, uses_triton

INDEX_DTYPES = (torch.int64, torch.int32)
TUNING_TOP_K = 8  # pairs per token of the tuning problem (Qwen3-MoE's and DeepSeek-V3's top-k)
TUNING_EXPERTS = 64

# ------------------------------------------------------------------------------------------------ references


def moe_permute_torch(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``x[token]``: the (T·k, H) grouped-GEMM input."""
    return x[token.long()]


def moe_unpermute_torch(ys: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``Σ_j weights[:, j] · ys[pos[:, j]]`` (T, H), summed in fp32 in j order (float64 for float64)."""
    acc = torch.float64 if ys.dtype == torch.float64 else torch.float32
    rows = ys[pos.long()].to(acc)
    if weights is not None:
        rows = rows * weights.to(acc)[..., None]
    return rows.sum(1).to(ys.dtype)


def moe_experts_torch(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      top_k_index: torch.Tensor, top_k_weights: torch.Tensor, activation: str = "silu"
                      ) -> torch.Tensor:
    """The experts as transformers' eager loop writes them: for each expert, its tokens' ``act(gate) * up``
    through ``down_proj``, weighted and summed into the tokens' rows (differentiable by autograd)."""
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[token], gate_up_proj[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(act_torch(gate, activation) * up, down_proj[e])
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


# ------------------------------------------------------------------------------------------------ space


@dataclass(frozen=True)
class MoEPermuteConfig(KernelConfig):
    """Launch settings of the permutation kernels: each program moves one row (a token or a sorted pair) in
    BLOCK_H columns at a time. "fwd": the permute and unpermute kernels (also the input gradient's sum);
    "bwd": the unpermute backward (expert outputs' and routing weights' gradients)."""

    BLOCK_H_FWD: int
    num_warps_fwd: int = 4
    BLOCK_H_BWD: int = 1024
    num_warps_bwd: int = 4


class MoEPermuteSpace(Space):
    """Search space of the permutation kernels for one hidden size (dims ``{"hidden": H}``) and dtype."""

    op = "moe_permute"
    template = "moe_permute"
    config_cls = MoEPermuteConfig
    DIMS = ("hidden",)
    MAX_ELEMS_PER_THREAD = 32
    _BLOCK_H = tuple(2 ** k for k in range(6, 14))  # 64 .. 8192

    PARAMS = (
        Param("BLOCK_H_FWD", _BLOCK_H, "fwd"),
        Param("num_warps_fwd", (1, 2, 4, 8, 16), "fwd"),
        Param("BLOCK_H_BWD", _BLOCK_H, "bwd"),
        Param("num_warps_bwd", (1, 2, 4, 8, 16), "bwd"),
    )

    def check_dims(self) -> None:
        self.hidden = self.dims["hidden"]
        self.max_block = max(self._BLOCK_H[0], next_power_of_2(self.hidden))

    def heuristic(self) -> MoEPermuteConfig:
        """Analytic default: a whole row of up to 2048 columns per step, 4 warps (fewer for narrow rows)."""
        block = min(self.max_block, 2048)
        warps = self.fit_warps(4, block)
        config = MoEPermuteConfig(BLOCK_H_FWD=block, num_warps_fwd=warps, BLOCK_H_BWD=block, num_warps_bwd=warps)
        problems = self.violations(config)
        assert not problems, f"heuristic is invalid for hidden={self.hidden}: {problems}"
        return config

    def shape_violations(self, config: MoEPermuteConfig) -> list[str]:
        problems: list[str] = []
        for phase, block, warps in (("fwd", config.BLOCK_H_FWD, config.num_warps_fwd),
                                    ("bwd", config.BLOCK_H_BWD, config.num_warps_bwd)):
            if block > self.max_block:
                problems.append(f"{phase}: BLOCK_H={block} > {self.max_block} (next_power_of_2(hidden="
                                f"{self.hidden})): the extra columns are masked-off work")
            problems += self.threads_violations(phase, warps, block, self.MAX_ELEMS_PER_THREAD)
        return problems


# ------------------------------------------------------------------------------------------------ routing


def moe_routing(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, pos, offsets) of the (T, k) expert choices (int64/int32 in [0, num_experts): ValueError otherwise,
    checked on the CPU at once and on CUDA by a device-side assertion), without a host sync: ``token`` (T·k,) int64 the token
    of each sorted row (rows sorted by expert, stable), ``pos`` (T, k) int64 the sorted row of each choice, and
    ``offsets`` (E,) int32 the end row of each expert's group (``torch._grouped_mm``'s ``offs``)."""
    op = "moe_routing"
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2:
        raise ValueError(f"{op}: top_k_index must be a 2-D (tokens, k) tensor; got "
                         + (describe("top_k_index", top_k_index) if isinstance(top_k_index, torch.Tensor)
                            else type(top_k_index).__name__))
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be an int >= 1, got {num_experts!r}")
    _check_index(op, "top_k_index", top_k_index, None, num_experts)
    return _routing(top_k_index, num_experts)


def _routing(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_routing`` without its checks (for callers that validated ``top_k_index`` once)."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1).long()
    expert, order = torch.sort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=expert.dtype)
    offsets = torch.searchsorted(expert, bounds, right=False).to(torch.int32)
    return order // k, pos.view(tokens, k), offsets


# ------------------------------------------------------------------------------------------------ tuning


class MoEPermuteProblem(Problem):
    """The permutations at (T tokens, hidden) with k = 8 choices per token among 64 experts: the forward permutes
    x and unpermutes expert outputs ys with routing weights w; the backward gives dys, dw (the unpermute's) and
    dx (the permute's, a fixed-order sum over each token's rows)."""

    SPACE = MoEPermuteSpace
    OUTPUTS = ("xs", "out")
    DEFAULT_ROWS = 8192
    BYTES_FORMULA = "(6k + 3)·R·H·s + R·k·(36 + 2s)"

    @classmethod
    def shape(cls, model) -> dict[str, int]:
        return {"hidden": model.hidden_size}

    @classmethod
    def bench_dims(cls, model, rows: int) -> dict[str, int]:
        return {"rows": int(rows), "k": TUNING_TOP_K, **cls.shape(model)}

    @classmethod
    def make_inputs(cls, dims, dtype, device, gen, options) -> Inputs:
        tokens, hidden, k = dims["rows"], dims["hidden"], dims.get("k", TUNING_TOP_K)
        experts = max(TUNING_EXPERTS, k)
        scores = torch.rand((tokens, experts), generator=gen, device=gen.device)
        index = scores.topk(k, dim=-1).indices.to(device)
        token, pos, _ = moe_routing(index, experts)
        w = torch.rand((tokens, k), generator=gen, device=gen.device).to(device, dtype)
        return Inputs({"x": randn(gen, (tokens, hidden), dtype, device), "token": token, "pos": pos,
                       "ys": randn(gen, (tokens * k, hidden), dtype, device), "w": w},
                      grad_of=("x", "ys", "w"),
                      upstream={"xs": randn(gen, (tokens * k, hidden), dtype, device),
                                "out": randn(gen, (tokens, hidden), dtype, device)})

    @classmethod
    def reference(cls, inputs: Inputs) -> dict[str, torch.Tensor]:
        t = inputs.tensors
        (xs, out), (dx, dys, dw) = float64_grads(
            lambda x, ys, w: (moe_permute_torch(x, t["token"]), moe_unpermute_torch(ys, t["pos"], w)),
            (t["x"], t["ys"], t["w"]), (0, 1, 2), (inputs.upstream["xs"], inputs.upstream["out"]))
        return {"xs": xs, "out": out, "dx": dx, "dys": dys, "dw": dw}

    @classmethod
    def phase_bytes(cls, dims, s: int) -> dict[str, int]:
        r, h, k = dims["rows"], dims["hidden"], dims.get("k", TUNING_TOP_K)
        idx = 8 * r * k
        # fwd: permute (read R·k·H, write R·k·H; token) + unpermute (read R·k·H, pos and w, write R·H); bwd: the
        # unpermute's backward (read R·H + R·k·H, pos and w; write R·k·H and the fp32 dw) + the input gradient's
        # sum (read R·k·H and pos, write R·H)
        return {"fwd": s * r * h * (3 * k + 1) + 2 * idx + s * r * k,
                "bwd": s * r * h * (3 * k + 2) + 2 * idx + s * r * k + 4 * r * k}

    def __init__(self, dtype: torch.dtype, dims, rows: int, device, *, seed: int = 0, limits=None):
        super().__init__(dtype, dims, rows, device, seed=seed, limits=limits)
        dims = {"rows": self.rows, "k": TUNING_TOP_K, **self.dims}
        inputs = self.make_inputs(dims, dtype, self.device, self.device_generator, {})
        t = inputs.tensors
        self.buffers = {**t, "dxs": inputs.upstream["xs"], "dout": inputs.upstream["out"],
                        "xs": torch.empty_like(t["ys"]), "out": torch.empty_like(t["x"]),
                        "dys": torch.empty_like(t["ys"]), "dw32": torch.empty(t["w"].shape, device=self.device),
                        "dx": torch.empty_like(t["x"])}
        ref = self.reference(inputs)
        self.ref = {"xs": ref["xs"], "out": ref["out"], "dys": ref["dys"], "dw32": ref["dw"], "dx": ref["dx"]}
        tol = REL_TOL[dtype]
        self.tol = {name: tol for name in self.ref}
        self.outputs = {"fwd": ("xs", "out"), "bwd": ("dys", "dw32", "dx")}

    def launcher(self, module, phase: str):
        b = self.buffers
        if phase == "fwd":
            def fwd():
                module.permute(b["x"], b["token"], b["xs"])
                module.unpermute(b["ys"], b["pos"], b["w"], b["out"])
            return fwd
        if phase == "bwd":
            def bwd():
                module.unpermute_backward(b["dout"], b["ys"], b["pos"], b["w"], b["dys"], b["dw32"])
                module.unpermute(b["dxs"], b["pos"], None, b["dx"])
            return bwd
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")


#: Permuted elements (tokens · k · hidden) of the largest tuning problem: its float64 reference then holds 16 GiB
#: per permuted tensor, and the whole problem fits one H200 (Llama-3-70B's 8192 at 65536 tokens needed 4x more).
MAX_TUNING_ELEMENTS = 2**31


def tuning_row_cap(hidden: int) -> int:
    """The largest power of two of tokens with tokens · ``TUNING_TOP_K`` · hidden <= ``MAX_TUNING_ELEMENTS``."""
    return 1 << max(0, (MAX_TUNING_ELEMENTS // max(1, TUNING_TOP_K * hidden)).bit_length() - 1)


def tuning_problems(model, rows: list[int], dtype: torch.dtype, device, seed: int = 0) -> list[Problem]:
    """The permutations at the model's hidden size, one problem per token count."""
    return [MoEPermuteProblem(dtype, model.hidden_size, r, device, seed=seed) for r in rows]


_CUSTOM_OPS = ("liger_gen::moe_permute_fwd", "liger_gen::moe_unpermute_fwd", "liger_gen::moe_unpermute_bwd")
SPEC = OpSpec("moe_permute", MoEPermuteSpace, MoEPermuteProblem, tuning_problems, custom_ops=_CUSTOM_OPS,
              rows_cap=lambda model: tuning_row_cap(model.hidden_size))
SPECS = {SPEC.name: SPEC}


# ------------------------------------------------------------------------------------------------ kernels


def _on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _module(t: torch.Tensor, rows: int):
    module, _, _ = kernel_module(MoEPermuteSpace, t, t.shape[-1], rows)
    return module


def _permute_impl(x: torch.Tensor, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x[token]; ``pos`` (the inverse permutation) is an input for the backward only."""
    xs = torch.empty((token.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    if xs.numel() == 0:
        return xs
    if torch.compiler.is_compiling() or x.device.type == "cpu":
        _check_range("moe_permute", "token", token, x.shape[0])
    if uses_triton(x):
        _module(x, x.shape[0]).permute(x, token, xs)
    else:  # CPU without the interpreter (the custom op called directly)
        xs.copy_(moe_permute_torch(x, token))
    return xs


def _unpermute_impl(ys: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty((pos.shape[0], ys.shape[1]), dtype=ys.dtype, device=ys.device)
    if out.numel() == 0:
        return out.zero_()
    if pos.shape[1] == 0:
        return out.zero_()
    if _on_cpu(ys):
        _check_range("moe_unpermute", "pos", pos, ys.shape[0])
    if uses_triton(ys):
        _module(ys, pos.shape[0]).unpermute(ys, pos, weights, out)
    else:
        out.copy_(moe_unpermute_torch(ys, pos, weights))
    return out


def _unpermute_bwd_impl(dout: torch.Tensor, ys: torch.Tensor, pos: torch.Tensor,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dys = torch.zeros_like(ys)
    dw = torch.zeros(pos.shape, dtype=torch.float32, device=ys.device)
    if pos.numel() and ys.shape[1]:
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        if uses_triton(ys):
            _module(ys, pos.shape[0]).unpermute_backward(dout, ys, pos, weights, dys, dw)
        else:
            p = pos.long()
            dys.index_put_((p.reshape(-1),), (weights.float()[..., None] * dout.float()[:, None, :]).reshape(
                -1, ys.shape[1]).to(ys.dtype), accumulate=True)  # a row named twice sums, as autograd would
            dw.copy_((dout.float()[:, None, :] * ys[p].float()).sum(-1))
    return dys, dw


moe_permute_fwd = Kernel("moe_permute_fwd", _permute_impl,
                         lambda x, token, pos: x.new_empty((token.shape[0], x.shape[1])))
moe_unpermute_fwd = Kernel("moe_unpermute_fwd", _unpermute_impl,
                           lambda ys, pos, weights: ys.new_empty((pos.shape[0], ys.shape[1])))
moe_unpermute_bwd = Kernel("moe_unpermute_bwd", _unpermute_bwd_impl,
                           lambda dout, ys, pos, weights: (ys.new_empty(ys.shape),
                                                           ys.new_empty(pos.shape, dtype=torch.float32)))


def _permute_save(ctx, inputs, output):
    _, _, pos = inputs
    saved(ctx, pos)


def _permute_backward(ctx, dxs):
    (pos,) = ctx.saved_tensors
    return moe_unpermute_fwd.run(ctx, dxs.contiguous(), pos, None), None, None


def _unpermute_save(ctx, inputs, output):
    ys, pos, weights = inputs
    saved(ctx, ys, pos, weights)
    ctx.weights_dtype = None if weights is None else weights.dtype


def _unpermute_backward(ctx, dout):
    ys, pos, weights = ctx.saved_tensors
    if weights is None:  # an unweighted sum: the weights of the backward kernel are ones
        dys, _ = moe_unpermute_bwd.run(ctx, dout, ys, pos, torch.ones(pos.shape, dtype=ys.dtype, device=ys.device))
        return dys, None, None
    dys, dw = moe_unpermute_bwd.run(ctx, dout, ys, pos, weights)
    return dys, None, dw.to(ctx.weights_dtype)


_permute_2d = Differentiable(moe_permute_fwd, _permute_save, _permute_backward,
                             reference="liger_gen.reference.moe_permute_torch")
_unpermute_2d = Differentiable(moe_unpermute_fwd, _unpermute_save, _unpermute_backward,
                               reference="liger_gen.reference.moe_unpermute_torch")


# ------------------------------------------------------------------------------------------------ public ops


def _check_index(op: str, name: str, t, shape: tuple[int, ...] | None, bound: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: {name} must be an int64 or int32 tensor; got "
                        + (describe(name, t) if isinstance(t, torch.Tensor) else type(t).__name__))
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}; got {describe(name, t)}")
    if not torch.compiler.is_compiling():  # a compiled graph checks inside the op (``_check_range``)
        _check_range(op, name, t, bound)


def _check_range(op: str, name: str, t: torch.Tensor, bound: int) -> None:
    """Indices in [0, bound): on the CPU a ValueError at once; on CUDA a device-side assertion (no host sync;
    the program stops at the next synchronisation, as an out-of-range index in PyTorch's own ops does)."""
    if not t.numel():
        return
    if t.device.type == "cpu":
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= bound:
            raise ValueError(f"{op}: {name} holds indices outside [0, {bound}); got {describe(name, t)} with "
                             f"values in [{low}, {high}]")
    else:
        torch._assert_async(((t >= 0) & (t < bound)).all(), f"{op}: {name} holds indices outside [0, {bound})")


def _check_pairs(op: str, rows: str, pos: torch.Tensor, token: torch.Tensor | None = None) -> None:
    """What the kernels' backwards rely on (``moe_routing`` returns it): ``pos`` (T, k) names each of the T·k
    sorted rows exactly once, since the unpermute backward writes ``dys[pos[t, j]]`` once per pair rather than
    summing; and, with ``token`` (T·k,) given, ``token[pos[t, j]] == t`` for every (t, j), since the permute
    backward sums token t's gradient over the rows ``pos[t]``. Together: pos is a permutation of [0, T·k) and
    token its inverse. Indices are in range already (``_check_index``).

    CPU: ValueError naming the first repeated row, or the first (t, j) where the inverse fails. CUDA, and while
    torch.compile traces: ``torch._assert_async`` (no host synchronisation; the program stops at the next one,
    as an out-of-range index in PyTorch's own ops does)."""
    n = pos.numel()
    if n == 0:
        return
    flat = pos.reshape(-1).long()
    tokens, k = pos.shape
    if torch.compiler.is_compiling() or pos.device.type != "cpu":
        # n indices that reach all n rows are a permutation; clamped so that the check itself reads in bounds
        # (an index out of range then leaves a row unreached and fails the check)
        p = flat.clamp(0, n - 1)
        reached = torch.zeros(n, dtype=torch.bool, device=pos.device).index_fill_(0, p, True)
        torch._assert_async(reached.all(), f"{op}: pos must hold each row of {rows} once (a permutation of its "
                                           f"rows)")
        if token is not None:
            owner = torch.arange(tokens, device=pos.device)[:, None].expand(tokens, k)
            torch._assert_async((token.long()[p].view(tokens, k) == owner).all(),
                                f"{op}: pos must be the inverse of token (token[pos[t, j]] == t)")
        return
    counts = torch.bincount(flat, minlength=n)
    if bool((counts != 1).any()):
        order = flat.argsort(stable=True)
        ordered = flat[order]
        again = order[1:][ordered[1:] == ordered[:-1]].min()  # the first cell that repeats an earlier one
        row = int(flat[again])
        first = int((flat == row).nonzero()[0, 0])
        missing = (counts == 0).nonzero()[:, 0]
        raise ValueError(
            f"{op}: pos must hold each row of {rows} once (a permutation of [0, {n}) such as moe_routing returns: "
            f"the backward writes each row's gradient once, it does not sum a repeated row); got "
            f"{describe('pos', pos)} in which row {row} appears {int(counts[row])} times (pos[{first // k}, "
            f"{first % k}] and pos[{int(again) // k}, {int(again) % k}]) and {missing.numel()} row(s) never "
            f"appear (the first: row {int(missing[0])})")
    if token is None:
        return
    owner = token.long()[pos.long()]
    bad = (owner != torch.arange(tokens)[:, None]).nonzero()
    if bad.numel():
        t, j = (int(v) for v in bad[0])
        row = int(pos[t, j])
        raise ValueError(
            f"{op}: pos must be the inverse of token (token[pos[t, j]] == t for every t, j, as moe_routing returns "
            f"them: the backward sums token t's gradient over the rows pos[t]); got {describe('pos', pos)} and "
            f"{describe('token', token)} where pos[{t}, {j}] = {row} but token[{row}] = {int(token[row])}")


def _check_rows(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
        raise TypeError(f"{op}: {name} must be a 2-D floating tensor (rows, hidden); got "
                        + (describe(name, t) if isinstance(t, torch.Tensor) else type(t).__name__))


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def moe_permute(x: torch.Tensor, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x[token]``: each token's hidden state once per expert that chose it, grouped by expert.

    Args:
        x: (T, H) float32, bfloat16 or float16, any row stride.
        token: (T·k,) int64/int32, the token of each sorted row (``moe_routing``).
        pos: (T, k) int64/int32, the sorted row of each (token, choice): the inverse of ``token``, which the
            backward uses to sum each token's k gradient rows in a fixed order (no atomics). It must be a
            permutation of [0, T·k) with ``token[pos[t, j]] == t`` for every (t, j), as ``moe_routing`` returns
            them; checked when x requires grad (the forward does not read pos).

    Returns:
        (T·k, H) in x's dtype. Differentiable in x: dx[t] = Σ_j dxs[pos[t, j]] (= Σ_{i: token_i = t} dxs[i]).

    Raises:
        TypeError: x not a 2-D floating tensor, token or pos not integer tensors. ValueError: shapes that do
        not match, indices out of range, a pos that names a row twice or is not token's inverse (naming the
        first such row or (t, j)), tensors on different devices. Values are checked on the CPU at once; on CUDA
        by device-side assertions, with no host synchronisation: the program stops at the next synchronisation
        (as with an out-of-range index in PyTorch's own ops) with "device-side assert triggered".
    """
    op = "moe_permute"
    _check_rows(op, "x", x)
    if not isinstance(token, torch.Tensor) or token.dtype not in INDEX_DTYPES or token.dim() != 1:
        raise TypeError(f"{op}: token must be a 1-D int64 or int32 tensor; got "
                        + (describe("token", token) if isinstance(token, torch.Tensor) else type(token).__name__))
    _check_index(op, "pos", pos, None, max(1, token.shape[0]))
    if pos.dim() != 2 or pos.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: pos must be (T, k) with T = x's rows {x.shape[0]}; got {describe('pos', pos)}")
    _check_index(op, "token", token, (pos.numel(),), x.shape[0])
    check_same_device(op, x=x, token=token, pos=pos)
    if x.requires_grad and torch.is_grad_enabled():  # the forward reads token only; its backward reads pos
        _check_pairs(op, "xs", pos, token)
    return _permute(x, token, pos)


def _permute(x: torch.Tensor, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``moe_permute`` without its checks."""
    if not uses_triton(x):
        return moe_permute_torch(x, token)
    return _permute_2d(_unit_columns(x), token.contiguous(), pos.contiguous())


def moe_unpermute(ys: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = Σ_j weights[t, j] · ys[pos[t, j]]``: the routing-weighted sum of each token's expert outputs.

    Args:
        ys: (T·k, H) float32, bfloat16 or float16, the experts' outputs in sorted-row order.
        pos: (T, k) int64/int32, the sorted row of each (token, choice) (``moe_routing``): a permutation of
            [0, T·k), since the backward writes dys[pos[t, j]] = weights[t, j] · dout[t] once per pair rather
            than summing a repeated row; checked when ys requires grad (the forward and dw are right for any
            pos in range).
        weights: (T, k) floating routing weights, or None for a plain sum. Not required to sum to 1.

    Returns:
        (T, H) in ys's dtype, summed in fp32 in j order. Differentiable in ys and weights (the weights'
        gradient in their dtype: dw[t, j] = <dout[t], ys[pos[t, j]]>).

    Raises:
        TypeError / ValueError as ``moe_permute`` for ys, pos (out of range, or a row named twice) and weights.
    """
    op = "moe_unpermute"
    _check_rows(op, "ys", ys)
    _check_index(op, "pos", pos, None, ys.shape[0])
    if pos.dim() != 2 or pos.numel() != ys.shape[0]:
        raise ValueError(f"{op}: pos must be (T, k) with T·k = ys's rows {ys.shape[0]}; got {describe('pos', pos)}")
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point() \
                or tuple(weights.shape) != tuple(pos.shape):
            raise ValueError(f"{op}: weights must be a floating tensor of pos's shape {tuple(pos.shape)}; got "
                             + (describe("weights", weights) if isinstance(weights, torch.Tensor)
                                else type(weights).__name__))
    check_same_device(op, ys=ys, pos=pos, weights=weights)
    if ys.requires_grad and torch.is_grad_enabled():  # the forward and dw are right for any pos; dys is not
        _check_pairs(op, "ys", pos)
    return _unpermute(ys, pos, weights)


def _unpermute(ys: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``moe_unpermute`` without its checks."""
    if not uses_triton(ys):
        return moe_unpermute_torch(ys, pos, weights)
    return _unpermute_2d(_unit_columns(ys), pos.contiguous(), None if weights is None else weights.contiguous())


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(S, N) rows of a (S, K) times their expert's b[e] (E, K, N), experts' rows ending at ``offsets``: PyTorch's
    grouped GEMM where it takes the operands (CUDA, bfloat16, 16-byte aligned rows), else one GEMM per expert
    (which reads the offsets on the host)."""
    aligned = a.shape[1] % 8 == 0 and b.shape[2] % 8 == 0
    if a.is_cuda and a.dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offsets)
    if torch.compiler.is_compiling():
        # a traced graph cannot read the offsets on the host: every expert's GEMM over all rows, each row kept
        # from its own expert (E times the FLOPs; only where the grouped GEMM cannot take the operands)
        expert = torch.searchsorted(offsets, torch.arange(a.shape[0], device=a.device, dtype=offsets.dtype),
                                    right=True)
        out = a.new_zeros((a.shape[0], b.shape[2]))
        for e in range(b.shape[0]):
            out = torch.where((expert == e)[:, None], a @ b[e], out)
        return out
    bounds = [0] + offsets.tolist()
    parts = [a[start:end] @ b[e] for e, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.cat(parts) if parts else a.new_empty((0, b.shape[2]))


def moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The experts of a mixture-of-experts layer: ``Σ_j w[t, j] · down_e(act(gate_e(x_t)) · up_e(x_t))`` over
    each token's chosen experts e = top_k_index[t, j] — what transformers' fused ``*Experts`` modules compute
    (Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...), with their weight layout.

    The pairs are sorted by expert (``moe_routing``, no host sync on CUDA), gathered (``moe_permute``), sent
    through the two grouped GEMMs with the GLU between them, and summed back per token with the routing weights
    (``moe_unpermute``); the backward runs the same kernels' gradients and the GEMMs' own (autograd).

    Args:
        x: (T, H) float32, bfloat16 or float16.
        gate_up_proj: (E, 2·I, H), x's dtype: each expert's gate (first I rows) and up projections.
        down_proj: (E, H, I), x's dtype.
        top_k_index: (T, k) int64/int32 expert indices in [0, E).
        top_k_weights: (T, k) floating routing weights.
        activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU).

    Returns:
        (T, H) in x's dtype. Differentiable in x, both weight tensors and the routing weights.

    Raises:
        TypeError: non-tensors, non-floating weights or activations, dtypes that differ, integer tensors of
            another dtype. ValueError: shapes that do not match, an unknown activation, indices out of range
            (checked on the CPU), tensors on different devices.
    """
    from liger_gen.ops.glu.mlp import glu_gate_up_product

    op = "moe_experts"
    _check_rows(op, "x", x)
    if uses_triton(x) and x.dtype == torch.float64:
        raise TypeError(f"{op}: the kernel path supports float32, bfloat16 and float16; got {describe('x', x)} "
                        f"(float64 runs only on the plain-PyTorch CPU path)")
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise TypeError(f"{op}: {name} must be a 3-D tensor (experts, out, in); got "
                            + (describe(name, w) if isinstance(w, torch.Tensor) else type(w).__name__))
        if w.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype}; got {describe(name, w)}")
    experts, width2, hidden = gate_up_proj.shape
    if hidden != x.shape[1] or width2 % 2 or tuple(down_proj.shape) != (experts, hidden, width2 // 2):
        raise ValueError(f"{op}: gate_up_proj must be (E, 2·I, H) and down_proj (E, H, I) with H = x's "
                         f"{x.shape[1]}; got {describe('gate_up_proj', gate_up_proj)} and "
                         f"{describe('down_proj', down_proj)}")
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {GLU_ACTIVATIONS}, got {activation!r}")
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: top_k_index must be (T, k) with T = x's rows {x.shape[0]}; got "
                         + (describe("top_k_index", top_k_index) if isinstance(top_k_index, torch.Tensor)
                            else type(top_k_index).__name__))
    _check_index(op, "top_k_index", top_k_index, None, experts)
    if not isinstance(top_k_weights, torch.Tensor) or not top_k_weights.is_floating_point() \
            or top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"{op}: top_k_weights must be a floating tensor of top_k_index's shape "
                         f"{tuple(top_k_index.shape)}; got " + (describe("top_k_weights", top_k_weights)
                                                                 if isinstance(top_k_weights, torch.Tensor)
                                                                 else type(top_k_weights).__name__))
    check_same_device(op, x=x, gate_up_proj=gate_up_proj, down_proj=down_proj, top_k_index=top_k_index,
                      top_k_weights=top_k_weights)
    # top_k_index was validated above; token and pos come from it, so the permutations need no further checks
    token, pos, offsets = _routing(top_k_index, experts)
    xs = _permute(x, token, pos)
    gate_up = _grouped_mm(xs, gate_up_proj.transpose(1, 2), offsets)
    h = glu_gate_up_product(gate_up, activation)
    ys = _grouped_mm(h, down_proj.transpose(1, 2), offsets)
    return _unpermute(ys, pos, top_k_weights.to(ys.dtype) if top_k_weights.dtype != ys.dtype else top_k_weights)
