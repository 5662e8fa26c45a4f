"""What a benchmark's times are: on the CPU they come from a functional run (the kernels in Triton's interpreter,
or liger-gen's plain-PyTorch path), which checks that the pipeline runs and agrees with the reference, not how
fast anything is. Every CPU result says so where it is read: its table's title or caption, the JSON it is written
to (``functional_run`` and ``functional_run_reason``) and the caption of its plot."""

from __future__ import annotations

import os


def functional_run_reason(device_type: str, interpret: bool | None = None) -> str | None:
    """The one-line reason a run on ``device_type`` is a functional run, or None on a GPU. ``interpret``: whether
    liger-gen ran its Triton kernels in Triton's interpreter (default: ``TRITON_INTERPRET=1`` in the
    environment, which Triton reads when it is imported)."""
    if device_type != "cpu":
        return None
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
    how = ("liger-gen's Triton kernels in Triton's interpreter" if interpret else
           "liger-gen's plain-PyTorch path (TRITON_INTERPRET=1 not set)")
    return f"functional run on the CPU ({how}): the times check that it runs, they are not performance"


def label(result: dict, device_type: str, interpret: bool | None = None) -> dict:
    """Add ``functional_run`` (bool) and ``functional_run_reason`` (str or None) to ``result``; returns it."""
    reason = functional_run_reason(device_type, interpret)
    result["functional_run"] = reason is not None
    result["functional_run_reason"] = reason
    return result
