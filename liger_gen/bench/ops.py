"""The ops of ``liger-gen bench``: one ``Case`` per op — the functions each provider calls.

Everything else about the op at a model's shape comes from its op spec's problem class
(``liger_gen.ops.get_spec(op).problem``, see ``liger_gen.codegen.problems.Problem``), the same description the
tuner and the contract tests read: the dims, the seeded inputs and upstream gradients, the float64 truth of
every output and gradient, the minimal bytes of one training step (forward + backward) and, for matmul ops, its
flops — pure functions of the dims, so they can be checked without a GPU.

Minimal bytes ("speed of light" traffic; R rows, H hidden, I intermediate, V vocab, s the element size):

* layers (norms, RoPE, GLU) — the forward reads its inputs and writes its outputs (plus the fp32 per-row
  statistics a backward needs: rstd, mean); the backward reads the upstream gradients and the saved inputs and
  writes the gradients. Each tensor counted once per pass.
* losses (cross-entropy, FLCE, KL, JSD) — the upstream gradient is a scalar known to be applied last, so the
  floor is one read of every input and one write of every gradient (what a gradient-in-forward kernel moves).

Re-reads inside a pass, scratch buffers and any extra kernels a provider launches are not counted: this is the
floor every implementation has to move, so GB/s is comparable across providers.

A provider function takes ``(tensors, options)`` (dicts) and returns the tuple of differentiable outputs named
by ``Case.outputs``; gradients are taken for ``Inputs.grad_of`` and named ``"d" + input name``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from liger_gen import functional as lg
from liger_gen.codegen.problems import IGNORE_INDEX, Inputs, Problem
from liger_gen.models import PRESETS, ModelShape, resolve_model
from liger_gen.ops import get_spec
from liger_gen.ops.fp8.linear import Fp8LinearProblem
from liger_gen.ops.optim.adamw import adamw_torch, hyperparameters
from liger_gen.reference import (clamped_swiglu_gate_up_torch, cross_entropy_torch, fused_add_rms_norm_torch,
                                 fused_linear_jsd_torch, geglu_torch, glu_torch, jsd_torch, kl_div_torch,
                                 layer_norm_torch, moe_permute_torch, moe_unpermute_torch, rms_norm_torch, rope_torch,
                                 selective_log_softmax_torch, squared_relu_torch, swiglu_torch)

# A model small enough for Triton's interpreter on the CPU (``--model tiny``), from the one model registry.
TINY = PRESETS["tiny"]

Tensors = dict[str, torch.Tensor]
Options = dict[str, Any]
ProviderFn = Callable[[Tensors, Options], tuple]

__all__ = ["CASES", "Case", "Inputs", "TINY", "bench_model", "get_case"]


@dataclass(frozen=True)
class Case:
    """The providers of one op; the op at a shape is its spec's problem class (``Case.problem``)."""

    op: str
    eager: ProviderFn
    eager_note: str
    liger_gen: ProviderFn
    liger_kernel: Callable[[], ProviderFn] | None = None
    liger_kernel_note: str = ""
    # extra peers for this op only: provider name -> (loader returning a ProviderFn, note)
    peers: dict[str, tuple[Callable[[], ProviderFn], str]] = field(default_factory=dict)
    # the problem class of an op that has no spec (nothing of its own to tune: fp8_linear's GEMMs are cuBLASLt's)
    shapes: type[Problem] | None = None
    # what torch-compile compiles, where it is not ``eager`` (an eager op that torch.compile cannot trace), and a note
    compiled: ProviderFn | None = None
    compiled_note: str = ""

    @property
    def problem(self) -> type[Problem]:
        """The op's problem class: dims, inputs, float64 truth, bytes and flops at a model's shape."""
        return self.shapes if self.shapes is not None else get_spec(self.op).problem

    @property
    def default_rows(self) -> int:
        return self.problem.DEFAULT_ROWS

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.problem.OUTPUTS

    @property
    def bytes_formula(self) -> str:
        return self.problem.BYTES_FORMULA

    @property
    def flops_formula(self) -> str:
        return self.problem.FLOPS_FORMULA

    def dims(self, model: ModelShape, rows: int) -> dict[str, int]:
        return self.problem.bench_dims(model, rows)

    def bytes(self, dims: dict[str, int], element_size: int) -> int:
        return self.problem.step_bytes(dims, element_size)

    def flops(self, dims: dict[str, int]) -> int:
        return self.problem.step_flops(dims)

    def make(self, dims: dict[str, int], dtype: torch.dtype, device, gen: torch.Generator,
             model: ModelShape) -> Inputs:
        return self.problem.make_inputs(dims, dtype, device, gen, self.problem.options(model))

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        return self.problem.reference(inputs)

    def lookup_dims(self, dims: dict[str, int]) -> dict[str, int]:
        return self.problem.space_dims(dims)

    def gradient_names(self, inputs: Inputs) -> tuple[str, ...]:
        return tuple("d" + name for name in inputs.grad_of)


# ------------------------------------------------------------------------------------------------ providers


def _rms_norm_eager(t, o):
    return (rms_norm_torch(t["x"], t["w"], o["eps"], 0.0, "llama"),)


def _rms_norm_lg(t, o):
    return (lg.rms_norm(t["x"], t["w"], eps=o["eps"], offset=0.0, casting_mode="llama"),)


def _lk_rms_norm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # LigerRMSNorm's defaults: offset 0, casting "llama", in_place=True (dx overwrites dy)
    return lambda t, o: (LigerRMSNormFunction.apply(t["x"], t["w"], o["eps"], 0.0, "llama", True),)


def _fused_add_eager(t, o):
    return fused_add_rms_norm_torch(t["x"], t["residual"], t["w"], o["eps"], 0.0, "llama")


def _fused_add_lg(t, o):
    return lg.fused_add_rms_norm(t["x"], t["residual"], t["w"], eps=o["eps"], offset=0.0, casting_mode="llama")


def _fused_add_fp8_eager(t, o):
    from liger_gen.runtime.fp8 import quantize_reference

    y, s = fused_add_rms_norm_torch(t["x"], t["residual"], t["w"], o["eps"], 0.0, "llama")
    quantize_reference(y, -1)  # the operands the FP8 projections take: timed, not compared (they are exact
    quantize_reference(y, 0)  # functions of y, which is)
    return y, s


def _fused_add_fp8_lg(t, o):
    out = lg.rms_norm_fp8(t["x"], t["w"], eps=o["eps"], offset=0.0, casting_mode="llama", residual=t["residual"])
    return out.y, out.sum


def _lk_fused_add():
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    # LigerFusedAddRMSNorm's defaults: offset 0, casting "llama", in_place=False
    return lambda t, o: tuple(LigerFusedAddRMSNormFunction.apply(t["x"], t["residual"], t["w"], o["eps"], 0.0,
                                                                 "llama", False))


def _layer_norm_eager(t, o):
    return (layer_norm_torch(t["x"], t["w"], t["b"], o["eps"]),)


def _layer_norm_lg(t, o):
    return (lg.layer_norm(t["x"], t["w"], t["b"], eps=o["eps"]),)


def _lk_layer_norm():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda t, o: (LigerLayerNormFunction.apply(t["x"], t["w"], t["b"], o["eps"]),)


def _rope_eager(t, o):
    return rope_torch(t["q"], t["k"], t["cos"], t["sin"])


def _rope_lg(t, o):
    return lg.rope(t["q"], t["k"], t["cos"], t["sin"])


def _lk_rope():
    from liger_kernel.ops.rope import LigerRopeFunction

    return lambda t, o: tuple(LigerRopeFunction.apply(t["q"], t["k"], t["cos"], t["sin"]))


def _swiglu_eager(t, o):
    return (swiglu_torch(t["gate"], t["up"]),)


def _swiglu_lg(t, o):
    return (lg.swiglu(t["gate"], t["up"]),)


def _lk_swiglu():
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return lambda t, o: (LigerSiLUMulFunction.apply(t["gate"], t["up"]),)


def _geglu_eager(t, o):
    return (geglu_torch(t["gate"], t["up"], "tanh"),)


def _geglu_lg(t, o):
    return (lg.geglu(t["gate"], t["up"], approximate="tanh"),)


def _lk_geglu():
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return lambda t, o: (LigerGELUMulFunction.apply(t["gate"], t["up"]),)


def _glu_fp8_eager(t, o):
    from liger_gen.runtime.fp8 import quantize_reference

    y = glu_torch(t["gate"], t["up"], o["activation"])
    quantize_reference(y, -1)  # the operands the FP8 down projection takes: timed, not compared (they are exact
    quantize_reference(y, 0)  # functions of y, which is)
    return (y,)


def _glu_fp8_lg(t, o):
    return (lg.glu_fp8(t["gate"], t["up"], o["activation"]).y,)


class _RecipeLinear(torch.autograd.Function):
    """``fp8_linear``'s recipe in plain PyTorch: each operand quantized by ``quantize_reference`` (amax, power-of-
    two scale, e4m3 cast as separate PyTorch ops) and the three GEMMs by ``torch._scaled_mm``."""

    @staticmethod
    def forward(ctx, x, w):
        from liger_gen.runtime import fp8 as recipe

        ctx.save_for_backward(x, w)
        xq, xd = recipe.quantize_reference(x, -1)
        wq, wd = recipe.quantize_reference(w, -1)
        return recipe.scaled_mm(xq, xd, wq.t(), wd.t(), torch.bfloat16, fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        from liger_gen.runtime import fp8 as recipe

        x, w = ctx.saved_tensors
        pad = recipe.padded(x.shape[0]) - x.shape[0]
        dyq, dyd = recipe.quantize_reference(dy, -1)
        wtq, wtd = recipe.quantize_reference(w, 0)  # per input feature
        dx = recipe.scaled_mm(dyq, dyd, wtq.t().contiguous().t(), wtd, torch.bfloat16)
        dytq, dytd = recipe.quantize_reference(dy, 0)  # per output feature, over the tokens (padded)
        xtq, xtd = recipe.quantize_reference(x, 0)
        a = F.pad(dytq.view(torch.uint8).t().contiguous(), (0, pad)).view(dytq.dtype)  # (N, Mp) row-major, zeros past
        b = F.pad(xtq.view(torch.uint8), (0, 0, 0, pad)).view(xtq.dtype)  # (Mp, K)
        dw = recipe.scaled_mm(a, dytd.reshape(-1, 1), b.t().contiguous().t(), xtd, torch.bfloat16)
        return dx, dw.to(w.dtype)


def _fp8_linear_eager(t, o):
    return (_RecipeLinear.apply(t["x"], t["weight"]),)


def _fp8_linear_lg(t, o):
    return (lg.fp8_linear(t["x"], t["weight"]),)


def _torchao_fp8_linear():
    """torchao's ``Float8Linear`` with its "rowwise" recipe on the case's weight (``torch.func.functional_call``),
    under ``torch.compile`` on CUDA (its float8 training relies on the compiler to fuse its casts), eager on the
    CPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("rowwise")
    layers: dict = {}

    def fn(t, o):
        x, w = t["x"], t["weight"]
        key = (tuple(w.shape), w.device)
        if key not in layers:
            holder = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"))
            convert_to_float8_training(holder, config=config)
            layer = holder[0]

            def call(x, w):
                return torch.func.functional_call(layer, {"weight": w}, (x,))
            layers[key] = torch.compile(call, dynamic=False) if w.is_cuda else call
        return (layers[key](x, w),)
    return fn


def _clamped_swiglu_eager(t, o):
    return (clamped_swiglu_gate_up_torch(t["gate_up"], o["alpha"], o["limit"]),)


def _clamped_swiglu_lg(t, o):
    return (lg.clamped_swiglu_gate_up(t["gate_up"], o["alpha"], o["limit"]),)


def _squared_relu_eager(t, o):
    return (squared_relu_torch(t["x"]),)


def _squared_relu_lg(t, o):
    return (lg.squared_relu(t["x"]),)


def _moe_permute_eager(t, o):
    return (moe_permute_torch(t["x"], t["token"]), moe_unpermute_torch(t["ys"], t["pos"], t["w"]))


def _moe_permute_lg(t, o):
    return (lg.moe_permute(t["x"], t["token"], t["pos"]), lg.moe_unpermute(t["ys"], t["pos"], t["w"]))


def _ce_eager(t, o):
    return (cross_entropy_torch(t["logits"], t["target"]),)


def _ce_lg(t, o):
    return (lg.cross_entropy(t["logits"], t["target"]),)


def _lk_ce():
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap)
    return lambda t, o: (LigerCrossEntropyFunction.apply(t["logits"], t["target"], None, IGNORE_INDEX, 0.0, 0.0,
                                                         "mean", None)[0],)


def _flce_eager(t, o):
    # transformers' causal-LM loss: the LM head in the activations' dtype, logits upcast, then cross-entropy
    logits = t["x"] @ t["w"].t()
    return (F.cross_entropy(logits.float(), t["target"], ignore_index=IGNORE_INDEX),)


def _flce_lg(t, o):
    return (lg.fused_linear_cross_entropy(t["x"], t["w"], t["target"]),)


def _lk_flce():
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
    #  softcap, return_z_loss, accum_dtype): Liger's default accum_dtype=None sums dW over chunks in the weight's
    #  dtype, as liger-gen's bf16 plans do (DW_FP32=0)
    return lambda t, o: (LigerFusedLinearCrossEntropyFunction.apply(
        t["x"], t["w"], t["target"], None, None, IGNORE_INDEX, 0.0, 0.0, "mean", None, False, None)[0],)


def _cce_flce():
    from cut_cross_entropy import linear_cross_entropy

    return lambda t, o: (linear_cross_entropy(t["x"], t["w"], t["target"], ignore_index=IGNORE_INDEX,
                                              reduction="mean"),)


def _slsm_eager(t, o):
    # TRL's unfused path: the LM head in the activations' dtype, then log_softmax of the fp32 logits, gathered
    return (selective_log_softmax_torch(t["x"], t["w"], t["target"])[0],)


def _slsm_lg(t, o):
    return (lg.selective_log_softmax(t["x"], t["w"], t["target"]),)


def _trl_slsm():
    from trl.kernels import ChunkedLogProbFunction

    # (hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs): TRL's chunked
    # log-probabilities; TRL's trainers score only the non-ignored tokens (compacted) and zero the others
    def run(t, o):
        mask = t["target"] != IGNORE_INDEX
        logp = ChunkedLogProbFunction.apply(t["x"][mask], t["w"], None, t["target"][mask], 1.0, 4096, None, 1.0,
                                            ("log_probs",))[0]
        return (torch.zeros(t["target"].shape, dtype=logp.dtype, device=logp.device).masked_scatter(mask, logp),)

    return run


def _fljsd_eager(t, o):
    return (fused_linear_jsd_torch(t["student_x"], t["student_w"], t["teacher_x"], t["teacher_w"], t["target"],
                                   o.get("beta", 0.5)),)


def _fljsd_lg(t, o):
    return (lg.fused_linear_jsd(t["student_x"], t["student_w"], t["teacher_x"], t["teacher_w"], t["target"],
                                beta=o.get("beta", 0.5)),)


def _lk_fljsd():
    from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction

    # (student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta, ignore_index,
    #  temperature): 2-D inputs, as its module wrapper passes them
    def run(t, o):
        h = t["student_x"].shape[-1]
        return (LigerFusedLinearJSDFunction.apply(t["student_x"].reshape(-1, h), t["student_w"],
                                                  t["teacher_x"].reshape(-1, t["teacher_x"].shape[-1]),
                                                  t["teacher_w"], t["target"].reshape(-1), o.get("beta", 0.5),
                                                  IGNORE_INDEX, 1.0),)

    return run


def _kl_eager(t, o):
    return (kl_div_torch(t["input"], t["target"], "batchmean"),)


def _kl_lg(t, o):
    return (lg.kl_div(t["input"], t["target"], reduction="batchmean"),)


def _lk_kl():
    from liger_kernel.ops.kl_div import LigerKLDivLossFunction

    return lambda t, o: (LigerKLDivLossFunction.apply(t["input"], t["target"], "batchmean", False, 1e-10),)


def _jsd_eager(t, o):
    return (jsd_torch(t["student"], t["teacher"], o["beta"], IGNORE_INDEX, t["label"]),)


def _jsd_lg(t, o):
    return (lg.jsd(t["student"], t["teacher"], beta=o["beta"], ignore_index=IGNORE_INDEX, label=t["label"]),)


def _lk_jsd():
    from liger_kernel.ops.jsd import LigerJSDFunction

    return lambda t, o: (LigerJSDFunction.apply(t["student"], t["teacher"], t["label"], o["beta"], IGNORE_INDEX),)



def _fp8_quantize_eager(t, o):
    from liger_gen.runtime.fp8 import quantize_reference

    fmt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[o["fp8"]]
    q_rows, d_rows = quantize_reference(t["x"], -1, fmt)
    q_cols, d_cols = quantize_reference(t["x"], 0, fmt)
    return q_rows, d_rows, q_cols.t(), d_cols.t()


def _fp8_quantize_lg(t, o):
    fmt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[o["fp8"]]
    q_rows, d_rows = lg.fp8_quantize(t["x"], "rows", fmt)
    q_cols, d_cols = lg.fp8_quantize(t["x"], "cols", fmt)
    return q_rows, d_rows, q_cols[:, : t["x"].shape[0]], d_cols  # the GEMM's padding rows left out


def _fp8_cast_transpose_lg(t, o):
    fmt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[o["fp8"]]
    q_rows, d_rows, q_cols, d_cols = lg.fp8_cast_transpose(t["x"], fmt)
    return q_rows, d_rows, q_cols[:, : t["x"].shape[0]], d_cols


def _adamw_state(t):
    vmax = t.get("max_exp_avg_sq")
    return t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], vmax


def _adamw_eager(t, o):
    p, g, m, v, vmax = _adamw_state(t)
    step = torch.tensor(float(o["step"]), device=p.device)
    torch._fused_adamw_([p], [g], [m], [v], [] if vmax is None else [vmax], [step], lr=o["lr"], beta1=o["beta1"],
                        beta2=o["beta2"], weight_decay=o["weight_decay"], eps=o["eps"], amsgrad=vmax is not None,
                        maximize=o["maximize"])
    return p, m, v


def _adamw_plain(t, o):
    p, g, m, v, vmax = _adamw_state(t)
    adamw_torch(p, g, m, v, vmax, **hyperparameters(o))
    return p, m, v


def _adamw_lg(t, o):
    p, g, m, v, vmax = _adamw_state(t)
    lg.adamw_step(p, g, m, v, vmax, **hyperparameters(o))
    return p, m, v


# ------------------------------------------------------------------------------------------------ the cases

CASES: dict[str, Case] = {c.op: c for c in (
    Case("rms_norm", _rms_norm_eager, "rms_norm_torch (transformers' LlamaRMSNorm)", _rms_norm_lg, _lk_rms_norm,
         "LigerRMSNormFunction(offset=0, casting_mode='llama', in_place=True): dx is written into dy"),
    Case("fused_add_rms_norm", _fused_add_eager, "x + residual, then rms_norm_torch (transformers' decoder)",
         _fused_add_lg, _lk_fused_add,
         "LigerFusedAddRMSNormFunction(offset=0, casting_mode='llama', in_place=False): returns one tensor as both "
         "dx and dresidual"),
    Case("rms_norm_fp8", _fused_add_fp8_eager,
         "x + residual, rms_norm_torch, then quantize_reference of y per row and per column (the e4m3 operands "
         "of the FP8 projections that read it)", _fused_add_fp8_lg),
    Case("layer_norm", _layer_norm_eager, "F.layer_norm", _layer_norm_lg, _lk_layer_norm,
         "LigerLayerNormFunction(eps=1e-5)"),
    Case("rope", _rope_eager, "rope_torch (transformers' apply_rotary_pos_emb)", _rope_lg, _lk_rope,
         "LigerRopeFunction: rotates q and k in their own storage (in place), and dq, dk likewise"),
    Case("swiglu", _swiglu_eager, "silu(gate) * up (transformers' LlamaMLP)", _swiglu_lg, _lk_swiglu,
         "LigerSiLUMulFunction: writes dgate and dup into gate and up (in place)"),
    Case("geglu", _geglu_eager, "gelu(gate, approximate='tanh') * up (transformers' GemmaMLP)", _geglu_lg, _lk_geglu,
         "LigerGELUMulFunction (tanh approximation): writes dgate and dup into gate and up (in place)"),
    Case("glu_fp8", _glu_fp8_eager,
         "silu(gate) * up, then quantize_reference of y per row and per column (the e4m3 operands of the FP8 "
         "down projection that reads it)", _glu_fp8_lg),
    Case("clamped_swiglu", _clamped_swiglu_eager,
         "transformers' GptOssExperts._apply_gate on the interleaved gate_up (alpha 1.702, limit 7)",
         _clamped_swiglu_lg),
    Case("squared_relu", _squared_relu_eager,
         "torch.square(relu(x)) (transformers' ACT2FN['relu2'], NemotronMLP's activation)", _squared_relu_lg),
    Case("moe_permute", _moe_permute_eager,
         "x[token] and the routing-weighted sum of ys[pos] (transformers' grouped experts: index and index_add_)",
         _moe_permute_lg),
    Case("cross_entropy", _ce_eager, "F.cross_entropy of the fp32-upcast logits, mean (transformers' loss)", _ce_lg,
         _lk_ce,
         "LigerCrossEntropyFunction(reduction='mean'): the loss is returned in the logits' dtype (bf16 sum of bf16 "
         "row losses; liger-gen returns fp32); dlogits is written into the logits (in place); two host syncs "
         "(.item()) per forward"),
    Case("fused_linear_cross_entropy", _flce_eager,
         "transformers' causal-LM loss: x @ W.T in the activations' dtype, logits.float(), F.cross_entropy (mean)",
         _flce_lg, _lk_flce,
         "LigerFusedLinearCrossEntropyFunction(reduction='mean', accum_dtype=None, its default): dW summed over "
         "chunks in the weight's dtype, as liger-gen's bf16 plans (DW_FP32=0); host syncs per forward",
         peers={"cut-cross-entropy": (_cce_flce, "cut_cross_entropy.linear_cross_entropy(reduction='mean') with its "
                                      "default filter_eps='high': logit-gradient entries below eps(dtype)/32 are "
                                      "skipped (approximate gradients)")}),
    Case("kl_div", _kl_eager, "F.kl_div(reduction='batchmean')", _kl_lg, _lk_kl,
         "LigerKLDivLossFunction(reduction='batchmean', eps=1e-10): t·(log max(t, eps) − x) and an fp32 loss "
         "(liger-gen returns the inputs' dtype)"),
    Case("selective_log_softmax", _slsm_eager,
         "TRL's unfused selective_log_softmax: x @ W.T in the activations' dtype, log_softmax of the fp32 logits, "
         "gathered at the targets (0 where ignored)", _slsm_lg,
         peers={"trl": (_trl_slsm, "trl.kernels.ChunkedLogProbFunction (4096-column vocab tiles) on the "
                                   "non-ignored tokens, zeros elsewhere, as TRL's fused LM head returns them; "
                                   "boolean-mask compaction syncs the host")}),
    Case("fused_linear_jsd", _fljsd_eager,
         "both LM heads in the activations' dtype, fp32 log_softmax of each, the JSD of the full logits (teacher "
         "detached), beta 0.5, with labels", _fljsd_lg, _lk_fljsd,
         "LigerFusedLinearJSDFunction(jsd_beta=0.5): fp32 logits from the GEMMs, log_softmax and softmax in "
         "PyTorch, its JSD kernel per chunk; one host sync per forward"),
    Case("jsd", _jsd_eager, "jsd_torch (fp32 math), beta 0.5, with labels", _jsd_lg, _lk_jsd,
         "LigerJSDFunction(beta=0.5, shift_labels=label): d student computed in the forward next to an fp32 "
         "(rows, vocab) loss buffer"),
    Case("fp8_quantize", _fp8_quantize_eager,
         "quantize_reference per row and per column (amax, power-of-two scale, e4m3 cast in PyTorch); "
         "torch-compile fuses it as torchao's float8 training does", _fp8_quantize_lg),
    Case("fp8_linear", _fp8_linear_eager,
         "quantize_reference of x, W and dy on the axes of each GEMM, then torch._scaled_mm (the recipe in "
         "plain PyTorch)", _fp8_linear_lg, shapes=Fp8LinearProblem,
         peers={"torchao": (_torchao_fp8_linear, "torchao.float8 Float8Linear, rowwise recipe (power-of-two "
                                                 "scales, as liger-gen's), under torch.compile on CUDA")}),
    Case("fp8_cast_transpose", _fp8_quantize_eager,
         "quantize_reference per row and per column (amax, power-of-two scale, e4m3 cast in PyTorch); "
         "torch-compile fuses both axes as torchao's float8 training does", _fp8_cast_transpose_lg),
    Case("adamw", _adamw_eager,
         "torch._fused_adamw_ on one tensor (what torch.optim.AdamW(fused=True) runs); both update the inputs in "
         "place", _adamw_lg, compiled=_adamw_plain,
         compiled_note="adamw_torch (the update in plain PyTorch, in place; torch.compile cannot trace the fused op)"),
)}


def bench_model(name_or_path: str) -> ModelShape:
    """Anything ``liger_gen.models.resolve_model`` takes (``"tiny"`` is the CPU-sized model)."""
    return resolve_model(name_or_path)


def get_case(op: str) -> Case:
    """The case of ``op``; KeyError names the ops that have one."""
    if op not in CASES:
        raise KeyError(f"no benchmark case for op {op!r}; cases: {', '.join(CASES)}")
    return CASES[op]
