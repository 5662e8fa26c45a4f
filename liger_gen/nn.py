"""nn.Module drop-ins for transformers' and PyTorch's modules."""

from __future__ import annotations

import torch
from torch import nn

from liger_gen import functional as F
from liger_gen.ops.norms.layer_norm import LayerNorm
from liger_gen.ops.glu.glu import SwiGLUMLP
from liger_gen.ops.glu.mlp import GLUMLP
from liger_gen.ops.glu.squared_relu import SquaredReLUMLP
from liger_gen.ops.fp8.linear import WEIGHT_DTYPES as FP8_WEIGHT_DTYPES, check_fp8_linear, linear_2d_call
from liger_gen.reference import CASTING_MODES
from liger_gen.runtime.fp8 import Float8Recipe, fp8_unsupported_reason, gemm_dims_reason
from liger_gen.runtime.fp8_operands import LAST_INPUT, eager_tensor


class RMSNorm(nn.Module):
    """Drop-in for transformers' ``LlamaRMSNorm`` (same parameter name ``weight``, same state_dict).

    Args:
        hidden_size: size of the last dim of the input.
        eps: added to the mean square (stored as ``variance_epsilon``, as in transformers).
        offset: added to the weight in the formula (1.0 for Gemma-style weights stored as w − 1).
        casting_mode: "llama", "gemma" or "none"; see ``liger_gen.functional.rms_norm``.
        init_value: initial value of every weight element (1.0 by default; 0.0 for Gemma-style).
        elementwise_affine: False for no weight (``y = x / rms(x)``; ``weight`` is None, as in
            ``torch.nn.RMSNorm(elementwise_affine=False)``).

    Shape: input (..., hidden_size) → output of the same shape; with ``residual`` (same shape), a pair of that
    shape (the normalised sum, the sum).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 init_value: float = 1.0, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"RMSNorm: casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
        if not elementwise_affine and offset != 0.0:
            raise ValueError(f"RMSNorm: offset={offset} needs a weight; got elementwise_affine=False")
        if elementwise_affine:
            self.weight = nn.Parameter(torch.full((hidden_size,), float(init_value), device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        # set by liger_gen.apply_to on a decoder layer's post-attention norm whose residual add it fuses
        self.fuse_residual = False
        # set by liger_gen.apply_to(fp8=...) on the norms before q/k/v and before gate/up of a layer built like
        # Llama's: those FP8 projections (a plain tuple, not submodules); the norm then writes their operands
        self.fp8_consumers: tuple = ()

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm of ``hidden_states``; with ``residual``, ``(RMSNorm(residual + hidden_states), residual +
        hidden_states)`` in one pass (``liger_gen.functional.fused_add_rms_norm``; the pre-norm decoder's residual
        add before this norm). A norm whose output feeds FP8 projections (``fp8_consumers``) also writes their
        e4m3 operands (``liger_gen.functional.rms_norm_fp8``), which they take instead of quantizing it."""
        if self.__dict__.get("fp8_consumers"):
            out = self._fp8_forward(hidden_states, residual)
            if out is not None:
                return out
        if residual is None:
            return F.rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode)
        if self.weight is None or residual.shape != hidden_states.shape:
            s = residual + hidden_states  # broadcasting, or no weight: the add, then the norm
            return F.rms_norm(s, self.weight, self.variance_epsilon, self.offset, self.casting_mode), s
        return F.fused_add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon, self.offset,
                                    self.casting_mode)

    def _fp8_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """The norm with its output's FP8 operands handed to the projections that read it, or None where they
        would not take them (then the plain norm runs): not eager, an output that is not bf16 (the FP8 GEMMs
        take bf16), a device without FP8 GEMMs, a projection gone or no longer FP8."""
        weight = self.weight
        if weight is None or not eager_tensor(x) or x.dtype != torch.bfloat16 or (
                residual is not None and (residual.dtype != torch.bfloat16 or residual.shape != x.shape)) or (
                self.casting_mode == "llama" and weight.dtype != torch.bfloat16) \
                or fp8_unsupported_reason(x.device) is not None:
            return None
        consumers = self.fp8_consumers
        if not all(isinstance(m, Float8Linear) for m in consumers):
            return None
        # the token-axis operand serves the weight gradients: made when a projection will keep it
        cols = torch.is_grad_enabled() and any(m.recipe.keep_fp8_for_backward and m.weight.requires_grad
                                               for m in consumers)
        out = F.rms_norm_fp8(x, weight, self.variance_epsilon, self.offset, self.casting_mode, residual=residual,
                             cols=cols)
        LAST_INPUT.offer(out.y, (out.q, out.dequant_rows, out.qt, out.dequant_cols))
        return out.y if residual is None else (out.y, out.sum)

    def extra_repr(self) -> str:
        shape = "no weight" if self.weight is None else f"{tuple(self.weight.shape)}"
        return f"{shape}, eps={self.variance_epsilon}, offset={self.offset}, casting_mode={self.casting_mode!r}"



class CrossEntropyLoss(nn.Module):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` (classes in the last dim) that runs
    ``liger_gen.functional.cross_entropy``.

    Args:
        weight: optional (vocab,) class weights, kept as a buffer as torch does.
        ignore_index, reduction, label_smoothing: as in ``torch.nn.CrossEntropyLoss``.
        lse_square_scale: z-loss coefficient (PaLM): adds ``lse_square_scale · lse²`` per non-ignored row.
        softcap: if given, logits become ``softcap · tanh(logits / softcap)`` first (Gemma-2).
        return_z_loss: forward returns ``(loss, z_loss)``.
        return_token_accuracy, return_predicted_tokens: the forward also returns the token accuracy and/or the
            argmax classes, after the loss (and z-loss), as ``liger_gen.functional.cross_entropy`` does.
        use_token_scaling: weigh each row's loss by its detached target probability (the Dynamic Fine-Tuning
            loss, Wu et al. 2025).

    Shape: input (..., vocab) float32/bfloat16/float16, target (...) int64 or int32 → 0-dim float32 loss
    ((...) for ``reduction="none"``).
    """

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, lse_square_scale: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, return_token_accuracy: bool = False,
                 return_predicted_tokens: bool = False, use_token_scaling: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.lse_square_scale, self.softcap, self.return_z_loss = lse_square_scale, softcap, return_z_loss
        self.return_token_accuracy, self.return_predicted_tokens = return_token_accuracy, return_predicted_tokens
        self.use_token_scaling = use_token_scaling

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return F.cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing,
                               self.lse_square_scale, self.softcap, self.return_z_loss,
                               return_token_accuracy=self.return_token_accuracy,
                               return_predicted_tokens=self.return_predicted_tokens,
                               use_token_scaling=self.use_token_scaling)


class Float8Linear(nn.Linear):
    """``torch.nn.Linear`` whose forward and backward GEMMs run in FP8 (``liger_gen.functional.fp8_linear``).

    The parameters, their names and the state_dict are ``nn.Linear``'s (``weight`` (out_features, in_features)
    bf16 or fp32, optional ``bias``); ``recipe`` (a ``liger_gen.Float8Recipe``) says how the GEMMs quantize.
    ``from_linear`` converts an existing ``nn.Linear`` in place, which is what ``liger_gen.apply_to(model,
    fp8=True)`` does to a decoder's projections.

    Forward: a bf16 input runs the FP8 GEMMs and returns bf16. Under ``torch.autocast`` with a bf16 autocast
    dtype (CUDA or CPU), an input of another float dtype is cast to bf16 first, as ``F.linear`` would compute in
    bf16 there. Otherwise (a float32 or float16 input outside autocast, an fp16 autocast, a device without FP8
    GEMMs such as a GPU before compute capability 8.9, or the meta device, or a weight or bias neither bf16 nor
    fp32, e.g. after ``model.half()``) the layer computes ``torch.nn.functional.linear``, as ``nn.Linear`` does
    (under a bf16 autocast: in bf16); nothing is logged per call.

    Args:
        in_features, out_features: K and N; both multiples of 16 (the FP8 GEMM's requirement).
        bias, device, dtype: as ``nn.Linear``'s.
        recipe: a ``Float8Recipe`` (None: the defaults).

    Shape: (..., in_features) → (..., out_features).

    Raises:
        ValueError: in_features or out_features not a multiple of 16.
        TypeError: recipe not a ``Float8Recipe``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Float8Recipe | None = None):
        _check_fp8_layer(in_features, out_features, recipe)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else Float8Recipe()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Float8Recipe | None = None) -> "Float8Linear":
        """Make ``linear`` a ``Float8Linear`` in place and return it: its class changes and ``recipe`` is set, so
        its Parameter objects, hooks, optimizer state and any DDP/FSDP wrapping around it stay valid. A
        ``Float8Linear`` gets the new recipe.

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear`` (subclasses other than ``Float8Linear`` are refused:
                their forward would be lost), or recipe is not a ``Float8Recipe``.
            ValueError: its in_features or out_features is not a multiple of 16.
        """
        if type(linear) is not nn.Linear and not isinstance(linear, Float8Linear):
            raise TypeError(f"Float8Linear.from_linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        _check_fp8_layer(linear.in_features, linear.out_features, recipe)
        linear.__class__ = cls
        linear.recipe = recipe if recipe is not None else Float8Recipe()
        return linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input
        if x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):  # (no FP8 GEMM elsewhere)
            if torch.get_autocast_dtype(x.device.type) != torch.bfloat16:
                return nn.functional.linear(x, self.weight, self.bias)
            if x.is_floating_point():
                x = x.to(torch.bfloat16)
        if x.dtype != torch.bfloat16 or self.weight.dtype not in FP8_WEIGHT_DTYPES or (
                self.bias is not None and self.bias.dtype not in FP8_WEIGHT_DTYPES) \
                or fp8_unsupported_reason(x.device) is not None:
            return nn.functional.linear(x, self.weight, self.bias)
        check_fp8_linear("Float8Linear", x, self.weight, self.bias)
        return linear_2d_call(x, self.weight, self.bias, self.recipe, source=input)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def _check_fp8_layer(in_features: int, out_features: int, recipe) -> None:
    if recipe is not None and not isinstance(recipe, Float8Recipe):
        raise TypeError(f"Float8Linear: recipe must be a liger_gen.Float8Recipe, got {type(recipe).__name__}")
    reason = gemm_dims_reason(in_features, out_features)
    if reason:
        raise ValueError(f"Float8Linear: the FP8 GEMM cannot take a ({out_features}, {in_features}) weight: "
                         f"{reason}")


__all__ = ["CrossEntropyLoss", "Float8Linear", "GLUMLP", "LayerNorm", "RMSNorm", "SquaredReLUMLP", "SwiGLUMLP"]
