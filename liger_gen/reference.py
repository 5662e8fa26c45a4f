"""Plain-PyTorch references: the float64 truth for tests and the tuner, and the CPU path of the runtime.

Each op's references are defined in its module under ``liger_gen/ops`` (or its family's shared module); this
module gathers them.
"""

from liger_gen.ops.divergence.jsd import jsd_float64, jsd_torch
from liger_gen.ops.divergence.kl_div import kl_div_float64, kl_div_torch
from liger_gen.ops.glu.activations import (geglu_float64, geglu_torch, glu_float64, glu_gate_up_torch, glu_torch,
                                           swiglu_float64, swiglu_torch)
from liger_gen.ops.glu.clamped_swiglu import (clamped_swiglu_float64, clamped_swiglu_gate_up_torch,
                                              clamped_swiglu_torch)
from liger_gen.ops.glu.moe import moe_experts_torch, moe_permute_torch, moe_unpermute_torch
from liger_gen.ops.glu.squared_relu import squared_relu_float64, squared_relu_torch
from liger_gen.ops.optim.adamw import adamw_float64, adamw_torch
from liger_gen.ops.lm_head.cross_entropy import cross_entropy_float64, cross_entropy_torch
from liger_gen.ops.lm_head.fused_linear_cross_entropy import (fused_linear_cross_entropy_float64,
                                                              fused_linear_cross_entropy_float64_chunked,
                                                              fused_linear_cross_entropy_torch)
from liger_gen.ops.lm_head.fused_linear_jsd import fused_linear_jsd_float64, fused_linear_jsd_torch
from liger_gen.ops.lm_head.selective_log_softmax import selective_log_softmax_float64, selective_log_softmax_torch
from liger_gen.ops.norms.fused_add_rms_norm import fused_add_rms_norm_float64, fused_add_rms_norm_torch
from liger_gen.ops.norms.layer_norm import layer_norm_float64, layer_norm_torch
from liger_gen.ops.norms.row_norm import CASTING_MODES, rms_norm_float64, rms_norm_out_dtype, rms_norm_torch
from liger_gen.ops.rope import rope_float64, rope_out_dtype, rope_torch, rotate_half

__all__ = ["CASTING_MODES", "adamw_float64", "adamw_torch", "clamped_swiglu_float64", "clamped_swiglu_gate_up_torch", "clamped_swiglu_torch",
           "cross_entropy_float64", "cross_entropy_torch", "fused_add_rms_norm_float64",
           "fused_add_rms_norm_torch",
           "fused_linear_cross_entropy_float64", "fused_linear_cross_entropy_float64_chunked",
           "fused_linear_cross_entropy_torch", "fused_linear_jsd_float64", "fused_linear_jsd_torch", "geglu_float64", "geglu_torch",
           "glu_float64", "glu_gate_up_torch", "glu_torch", "jsd_float64", "jsd_torch",
           "kl_div_float64", "kl_div_torch", "layer_norm_float64", "layer_norm_torch",
           "moe_experts_torch", "moe_permute_torch", "moe_unpermute_torch",
           "rms_norm_float64", "rms_norm_out_dtype", "rms_norm_torch", "rope_float64", "rope_out_dtype",
           "rope_torch", "rotate_half", "selective_log_softmax_float64", "selective_log_softmax_torch",
           "squared_relu_float64", "squared_relu_torch", "swiglu_float64", "swiglu_torch"]
