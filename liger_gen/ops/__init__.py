"""The op set: one module per op family, each holding everything about it end to end.

An op module defines, top to bottom: the plain-PyTorch and float64 references; the launch-settings dataclass
(``KernelConfig``) and its search ``Space`` (params, constraints, analytic heuristic); the tuning ``Problem``
(inputs, float64 truth, launchers, bytes moved); ``tuning_problems(model, rows, dtype, device, seed)``, the
problems a model's shapes give; the ``torch.library`` custom ops with fake and autograd implementations; and the
public function that ``liger_gen.functional`` re-exports. Kernel source lives in ``templates/<template>.py.jinja``.

Each module names its pieces ``SPACE``, ``PROBLEM`` and ``tuning_problems`` so the tuner, the tables and the CLI
can treat every op alike. Modules are imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# op name → module. Ops that share kernels (swiglu/geglu) may share a template but keep separate tables.
OP_MODULES: dict[str, str] = {
    "rms_norm": "liger_gen.ops.rms_norm",
    "fused_add_rms_norm": "liger_gen.ops.fused_add_rms_norm",
    "layer_norm": "liger_gen.ops.layer_norm",
    "rope": "liger_gen.ops.rope",
    "swiglu": "liger_gen.ops.swiglu",
    "geglu": "liger_gen.ops.geglu",
    "cross_entropy": "liger_gen.ops.cross_entropy",
    "fused_linear_cross_entropy": "liger_gen.ops.fused_linear_cross_entropy",
    "kl_div": "liger_gen.ops.kl_div",
    "jsd": "liger_gen.ops.jsd",
}


def available_ops() -> tuple[str, ...]:
    """Names of the ops whose modules are present in this installation, in registry order."""
    out = []
    for name, module in OP_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            out.append(name)
    return tuple(out)


def get_op(op: str) -> ModuleType:
    """The module of ``op`` (with ``SPACE``, ``PROBLEM`` and ``tuning_problems``); KeyError names the known ops."""
    if op not in OP_MODULES or importlib.util.find_spec(OP_MODULES[op]) is None:
        raise KeyError(f"unknown op {op!r}; known: {', '.join(available_ops())}")
    return importlib.import_module(OP_MODULES[op])


def template_of(op: str) -> str:
    """The template family that renders ``op``'s kernels (its hash keys the op's tuned tables)."""
    return get_op(op).SPACE.template
