"""liger-gen: Triton kernels for LLM training, generated from templates and tuned per GPU.

    import liger_gen
    liger_gen.apply_to(model)                      # patch a transformers model in place
    y = liger_gen.functional.rms_norm(x, weight)   # or call the ops directly

The submodules load on first use, so importing ``liger_gen.runtime`` or ``liger_gen.codegen`` (the tuner, a
table lookup) does not register the ops.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["apply_to", "functional", "nn", "__version__"]

_LAZY = {"functional": "liger_gen.functional", "nn": "liger_gen.nn"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    if name == "apply_to":
        return importlib.import_module("liger_gen.integrations.transformers").apply_to
    raise AttributeError(f"module 'liger_gen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
