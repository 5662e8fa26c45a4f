"""liger-gen: Triton kernels for LLM training, generated from templates and tuned per GPU.

    import liger_gen
    liger_gen.apply_to(model)                      # patch a transformers model in place
    y = liger_gen.functional.rms_norm(x, weight)   # or call the ops directly

Importing the package registers every op's ``torch.library`` custom ops, so traces and exported programs that
use them load after ``import liger_gen``.
"""

from liger_gen import functional, nn
from liger_gen._version import __version__
from liger_gen.integrations.transformers import apply_to
from liger_gen.runtime.fp8 import Float8Recipe

__all__ = ["Float8Recipe", "apply_to", "functional", "nn", "__version__"]
