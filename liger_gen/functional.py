"""Functional ops: drop-in replacements for the transformers / PyTorch computations they name.

Each function is defined in its op's module under ``liger_gen/ops`` (with its docstring: shapes, dtypes, the
formula it follows and the errors it raises) and re-exported here.
"""

from liger_gen.ops.optim.adamw import adamw_step
from liger_gen.ops.glu.clamped_swiglu import clamped_swiglu, clamped_swiglu_gate_up
from liger_gen.ops.lm_head.cross_entropy import cross_entropy
from liger_gen.ops.norms.fused_add_rms_norm import fused_add_rms_norm
from liger_gen.ops.fp8.linear import fp8_linear
from liger_gen.ops.fp8.cast_transpose import fp8_cast_transpose
from liger_gen.ops.fp8.quantize import fp8_quantize
from liger_gen.ops.lm_head.fused_linear_cross_entropy import fused_linear_cross_entropy
from liger_gen.ops.lm_head.fused_linear_jsd import fused_linear_jsd, fused_linear_kl_div
from liger_gen.ops.glu.glu import geglu, geglu_gate_up
from liger_gen.ops.glu.glu_fp8 import glu_fp8
from liger_gen.ops.divergence.jsd import jsd
from liger_gen.ops.divergence.kl_div import kl_div
from liger_gen.ops.norms.layer_norm import layer_norm
from liger_gen.ops.lm_head.post_training import (fused_linear_cpo, fused_linear_dpo, fused_linear_grpo,
                                                 fused_linear_kto, fused_linear_orpo, fused_linear_simpo)
from liger_gen.ops.glu.moe import moe_experts, moe_permute, moe_routing, moe_unpermute
from liger_gen.ops.glu.squared_relu import squared_relu
from liger_gen.ops.norms.rms_norm import rms_norm
from liger_gen.ops.norms.rms_norm_fp8 import rms_norm_fp8
from liger_gen.ops.rope import rope
from liger_gen.ops.lm_head.selective_log_softmax import selective_log_softmax
from liger_gen.ops.glu.glu import swiglu, swiglu_gate_up

__all__ = ["adamw_step", "clamped_swiglu", "clamped_swiglu_gate_up", "cross_entropy", "fp8_cast_transpose", "fp8_linear",
           "fp8_quantize", "fused_add_rms_norm", "fused_linear_cpo", "fused_linear_cross_entropy", "fused_linear_dpo",
           "fused_linear_grpo", "fused_linear_jsd", "fused_linear_kl_div", "fused_linear_kto", "fused_linear_orpo",
           "fused_linear_simpo", "geglu", "geglu_gate_up", "glu_fp8", "jsd", "kl_div", "layer_norm", "moe_experts",
           "moe_permute", "moe_routing", "moe_unpermute", "rms_norm", "rms_norm_fp8", "rope", "selective_log_softmax",
           "squared_relu", "swiglu", "swiglu_gate_up"]
