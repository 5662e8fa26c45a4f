"""nn.Module drop-ins for transformers' and PyTorch's modules."""

from __future__ import annotations

import torch
from torch import nn

from liger_gen import functional as F
from liger_gen.ops.norms.layer_norm import LayerNorm
from liger_gen.ops.glu.glu import GLUMLP, SwiGLUMLP
from liger_gen.reference import CASTING_MODES


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

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm of ``hidden_states``; with ``residual``, ``(RMSNorm(residual + hidden_states), residual +
        hidden_states)`` in one pass (``liger_gen.functional.fused_add_rms_norm``; the pre-norm decoder's residual
        add before this norm)."""
        if residual is None:
            return F.rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode)
        if self.weight is None or residual.shape != hidden_states.shape:
            s = residual + hidden_states  # broadcasting, or no weight: the add, then the norm
            return F.rms_norm(s, self.weight, self.variance_epsilon, self.offset, self.casting_mode), s
        return F.fused_add_rms_norm(hidden_states, residual, self.weight, self.variance_epsilon, self.offset,
                                    self.casting_mode)

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


__all__ = ["CrossEntropyLoss", "GLUMLP", "LayerNorm", "RMSNorm", "SwiGLUMLP"]
