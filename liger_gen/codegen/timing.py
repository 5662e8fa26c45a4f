"""Kernel timing for the tuner.

``gpu_timer`` is the median of CUDA-event timings with the L2 cache flushed before every repetition
(``triton.testing.do_bench`` writes a buffer larger than L2 between runs), so a variant is timed reading its
inputs from HBM as it does in training. Times are in milliseconds.

A timer is any callable ``timer(launch, params) -> ms``: ``launch`` runs the variant once, ``params`` are the
variant's template params. The GPU timer ignores ``params``; tests pass a deterministic cost model instead.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

Timer = Callable[[Callable[[], None], Mapping[str, Any]], float]


def gpu_timer(launch: Callable[[], None], params: Mapping[str, Any] | None = None, *, warmup_ms: float = 10,
              rep_ms: float = 50) -> float:
    """Median kernel time of ``launch`` in ms (CUDA events, L2 flushed before each repetition)."""
    import triton.testing

    return float(triton.testing.do_bench(launch, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
