"""nn.Module drop-ins for transformers' and PyTorch's modules."""

from __future__ import annotations

import torch
from torch import nn

from liger_gen import functional as F
from liger_gen.ops.layer_norm import LayerNorm
from liger_gen.ops.swiglu import SwiGLUMLP
from liger_gen.reference import CASTING_MODES


class RMSNorm(nn.Module):
    """Drop-in for transformers' ``LlamaRMSNorm`` (same parameter name ``weight``, same state_dict).

    Args:
        hidden_size: size of the last dim of the input.
        eps: added to the mean square (stored as ``variance_epsilon``, as in transformers).
        offset: added to the weight in the formula (1.0 for Gemma-style weights stored as w − 1).
        casting_mode: "llama", "gemma" or "none"; see ``liger_gen.functional.rms_norm``.
        init_value: initial value of every weight element (1.0 by default; 0.0 for Gemma-style).

    Shape: input (..., hidden_size) → output of the same shape.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 init_value: float = 1.0, device=None, dtype=None):
        super().__init__()
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"RMSNorm: casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")
        self.weight = nn.Parameter(torch.full((hidden_size,), float(init_value), device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}, "
                f"casting_mode={self.casting_mode!r}")


__all__ = ["LayerNorm", "RMSNorm", "SwiGLUMLP"]
