"""Optional dependencies: which extra brings each, and the error that says how to install it.

Training needs only torch, Triton, Jinja2, click and rich. ``liger-gen tune`` needs Optuna (``liger-gen[tune]``),
``apply_to`` and the training benchmark need transformers (``liger-gen[transformers]``), the bench's plots
matplotlib (``liger-gen[bench]``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"optuna": "tune", "transformers": "transformers", "tokenizers": "transformers", "matplotlib": "bench"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the pip command that installs it."""


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise ``MissingExtraError`` saying that ``purpose`` needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        extra = EXTRAS.get(top)
        hint = f"pip install 'liger-gen[{extra}]'" if extra else f"pip install {top}"
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed ({exc}); install it with: "
                                f"{hint}") from exc
