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


def install_hint(module: str) -> str:
    """How to install the optional dependency ``module`` (its liger-gen extra when it has one)."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return f"pip install {top}"
    return f"pip install 'liger-gen[{extra}]' (from a source checkout: pip install -e '.[{extra}]')"


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise ``MissingExtraError`` saying that ``purpose`` needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed ({exc}); install it with: "
                                f"{install_hint(top)}") from exc


def missing_extra_message(exc: BaseException) -> str | None:
    """For an ImportError of an optional dependency (``MissingExtraError``, or a ``ModuleNotFoundError`` of a
    module in ``EXTRAS``), the message that says what to install; None for any other error."""
    if isinstance(exc, MissingExtraError):
        return str(exc)
    name = getattr(exc, "name", None)
    if isinstance(exc, ModuleNotFoundError) and name and name.split(".")[0] in EXTRAS:
        return f"{name.split('.')[0]} is not installed; install it with: {install_hint(name)}"
    return None


def installed_version(dist: str, module: str | None = None) -> str | None:
    """The installed version of the distribution ``dist`` (its metadata), or, where it has none and ``module`` is
    given, that module's ``__version__`` ("unknown" without one); None when neither is there."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    if module:
        try:
            return getattr(importlib.import_module(module), "__version__", "unknown")
        except Exception:  # noqa: BLE001 - a module that fails to import has no version to report
            return None
    return None
