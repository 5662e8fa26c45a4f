"""The gated linear units: SwiGLU and GeGLU (``glu``), gpt-oss's clamped SwiGLU, and the mixture-of-experts
experts built on them (``moe``); ``glu_fp8``, the GLU that writes the FP8 operands of its output and of its
gradients; ``mlp``, the ``GLUMLP`` module ``apply_to`` installs; and the one non-gated MLP activation with a
kernel, Nemotron's squared ReLU (``squared_relu``), on the same row tiles. ``activations`` holds what they share (the activations and their
references, the per-call-shape plan of the elementwise kernels).

``GLUMLP`` and ``SwiGLUMLP`` were defined in a module ``liger_gen.ops.glu`` before the ops were grouped by
family, and a pickled model names a class by the module that defined it: they stay reachable here, so such
pickles still load.
"""

import importlib

_MOVED = {"GLUMLP": "liger_gen.ops.glu.mlp", "SwiGLUMLP": "liger_gen.ops.glu.glu"}


def __getattr__(name: str):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
