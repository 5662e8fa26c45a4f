"""Functional ops: drop-in replacements for the transformers / PyTorch computations they name.

Each function is defined in its op's module under ``liger_gen/ops`` (with its docstring: shapes, dtypes, the
formula it follows and the errors it raises) and re-exported here.
"""

from liger_gen.ops.fused_add_rms_norm import fused_add_rms_norm
from liger_gen.ops.geglu import geglu, geglu_gate_up
from liger_gen.ops.layer_norm import layer_norm
from liger_gen.ops.rms_norm import rms_norm
from liger_gen.ops.rope import rope
from liger_gen.ops.swiglu import swiglu, swiglu_gate_up

__all__ = ["fused_add_rms_norm", "geglu", "geglu_gate_up", "layer_norm", "rms_norm", "rope", "swiglu",
           "swiglu_gate_up"]
