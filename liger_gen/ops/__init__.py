"""The op set, by family: one module per op, each holding everything about it end to end.

    norms/        row_norm (shared) · rms_norm · fused_add_rms_norm · layer_norm · rms_norm_fp8 (with the FP8
                  operands of its output)
    glu/          activations (shared) · glu (swiglu, geglu; + glu_space) · clamped_swiglu · moe (moe_permute)
                  · squared_relu (Nemotron's non-gated MLP activation) · glu_fp8 (with the FP8 operands of its
                  output and gradients) · mlp (GLUMLP, the module apply_to installs)
    lm_head/      chunks (shared) · cross_entropy (+ cross_entropy_space, cross_entropy_rows)
                  · fused_linear_cross_entropy (+ fused_linear_cross_entropy_plan) · selective_log_softmax
                  · fused_linear_jsd (distillation) · post_training (preference and RL losses)
    divergence/   rows (shared) · kl_div · jsd
    fp8/          quantize (shared: the standalone FP8 quantize op) · cast_transpose (both axes in one op)
                  · linear (fp8_linear, GEMMs by torch._scaled_mm)
    optim/        adamw (the update liger_gen.optim.AdamW runs per parameter)
    rope.py

An op module defines, top to bottom: the plain-PyTorch and float64 references; the launch-settings dataclass
(``KernelConfig``) and its search ``Space`` (params, constraints, analytic heuristic); the tuning ``Problem``
(inputs, float64 truth, launchers, bytes moved); ``SPEC``, the op's ``OpSpec`` (``liger_gen.codegen.spec``)
that the tuner, the tables, the bench and the contract tests read; the ``torch.library`` custom ops with one
autograd definition (``liger_gen.runtime.binding``); and the public function that ``liger_gen.functional``
re-exports. Kernel source lives in ``templates/<template>.py.jinja``. An op too large for one module keeps its
op module (the one ``OP_MODULES`` names, with ``SPECS``) and moves whole layers into companion modules of its
family named after it: ``<op>_space`` (settings and search space), ``<op>_rows`` (a row-level API other ops of
the family build on), ``<op>_plan`` (a launch plan and how a call resolves it). Under the import rule below a
companion module is one more module of the family, not its shared module: it may import the family's other
modules (``cross_entropy_rows`` launches cross-entropy's kernels), and ``chunks`` imports none of them.

Where two ops of a family need the same piece, it lives once in the family's shared module. The imports follow
one rule (``tests/test_architecture.py``): an op module imports its own family's modules and the machinery below
``ops/`` (codegen, runtime, files, ...), never another family's op module nor anyone's ``_private`` name; a
family's shared module imports none of the ops. One cross-family edge is declared: the LM-head family may import
the divergence family's shared module (``divergence.rows``), because distillation is a divergence of the
LM head's logits; the divergence family imports nothing of the LM head.

This registry is for the entry points (CLI, bench, tests) that start from an op's name; nothing below ``ops/``
imports it. Modules are imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util

from liger_gen.codegen.spec import OpSpec

# op name → module. Ops that share kernels (swiglu/geglu) share a template but keep separate tables.
OP_MODULES: dict[str, str] = {
    "rms_norm": "liger_gen.ops.norms.rms_norm",
    "fused_add_rms_norm": "liger_gen.ops.norms.fused_add_rms_norm",
    "layer_norm": "liger_gen.ops.norms.layer_norm",
    "rms_norm_fp8": "liger_gen.ops.norms.rms_norm_fp8",
    "rope": "liger_gen.ops.rope",
    "swiglu": "liger_gen.ops.glu.glu",
    "geglu": "liger_gen.ops.glu.glu",
    "clamped_swiglu": "liger_gen.ops.glu.clamped_swiglu",
    "squared_relu": "liger_gen.ops.glu.squared_relu",
    "glu_fp8": "liger_gen.ops.glu.glu_fp8",
    "moe_permute": "liger_gen.ops.glu.moe",
    "cross_entropy": "liger_gen.ops.lm_head.cross_entropy",
    "fused_linear_cross_entropy": "liger_gen.ops.lm_head.fused_linear_cross_entropy",
    "kl_div": "liger_gen.ops.divergence.kl_div",
    "jsd": "liger_gen.ops.divergence.jsd",
    "fp8_quantize": "liger_gen.ops.fp8.quantize",
    "fp8_cast_transpose": "liger_gen.ops.fp8.cast_transpose",
    "selective_log_softmax": "liger_gen.ops.lm_head.selective_log_softmax",
    "fused_linear_jsd": "liger_gen.ops.lm_head.fused_linear_jsd",
    "adamw": "liger_gen.ops.optim.adamw",
}


def available_ops() -> tuple[str, ...]:
    """Names of the ops whose modules are present in this installation, in registry order."""
    return tuple(name for name, module in OP_MODULES.items() if importlib.util.find_spec(module) is not None)


def get_spec(op: str) -> OpSpec:
    """The ``OpSpec`` of ``op``; KeyError names the known ops."""
    if op not in OP_MODULES or importlib.util.find_spec(OP_MODULES[op]) is None:
        raise KeyError(f"unknown op {op!r}; known: {', '.join(available_ops())}")
    return importlib.import_module(OP_MODULES[op]).SPECS[op]


def all_specs() -> tuple[OpSpec, ...]:
    """Every op's spec, in registry order."""
    return tuple(get_spec(op) for op in available_ops())
