"""``LayerNorm``'s module before the ops were grouped by family (now ``liger_gen.ops.norms.layer_norm``). A pickled
model names a class by the module that defined it; this name keeps such pickles loading. Nothing imports it."""

from liger_gen.ops.norms.layer_norm import LayerNorm

__all__ = ["LayerNorm"]
