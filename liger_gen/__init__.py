"""liger-gen: Triton kernels for LLM training, generated from templates and tuned per GPU.

    import liger_gen
    liger_gen.apply_to(model)                      # patch a transformers model in place
    y = liger_gen.functional.rms_norm(x, weight)   # or call the ops directly
    optimizer = liger_gen.optim.AdamW(model.parameters(), lr=3e-4)  # AdamW with a fused update kernel

Importing the package registers every op's ``torch.library`` custom ops, so traces and exported programs that
use them load after ``import liger_gen``. The warnings liger-gen gives (each a ``UserWarning`` subclass, its text
starting with ``liger-gen:``) are importable from here to filter them: ``TunedTableWarning``,
``CompiledKernelWarning``, ``KernelCacheWarning``, ``PackedSequenceWarning`` and the tuner's ``JournalWarning``.
"""

from liger_gen import functional, nn, optim
from liger_gen._version import __version__
from liger_gen.codegen.build import KernelCacheWarning
from liger_gen.integrations.transformers import apply_to
from liger_gen.integrations.transformers.packing import PackedSequenceWarning
from liger_gen.runtime.compiled import CompiledKernelWarning
from liger_gen.runtime.fp8 import Float8Recipe
from liger_gen.runtime.tables import TunedTableWarning

# (the tuner's JournalWarning lives beside Optuna's storages: imported when asked for, and not by ``import *``)
__all__ = ["CompiledKernelWarning", "Float8Recipe", "KernelCacheWarning", "PackedSequenceWarning", "TunedTableWarning",
           "apply_to", "functional", "nn", "optim", "__version__"]


def __getattr__(name: str):
    if name == "JournalWarning":
        from liger_gen.tuning.storage import JournalWarning

        return JournalWarning
    raise AttributeError(f"module 'liger_gen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"JournalWarning"})
