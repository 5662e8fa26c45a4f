"""Warming a peer library's autotuned Triton kernels before a timed run, and saying how long it took.

Liger-Kernel's kernels that carry ``@triton.autotune`` (its fused MoE's grouped GEMMs, keyed by the hidden and
intermediate sizes, among them) benchmark every config of their space the first time they meet a key, inside the
first forward and backward at the model's shapes; at a large MoE that is minutes. The training-step benchmark
runs that pass apart (:func:`warm_autotune`: one forward and backward, gradients dropped, no optimizer step, so the
weights and the loss curve are those of a run without it) before its warm-up and timed steps, and reports its
wall time and how many (kernel, key) entries the autotuners gained.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from liger_gen.training import step_loss, sync

#: What the benchmark reports for a provider whose autotune warm-up did not run, and why.
NOT_RUN = {"s": None, "kernels_tuned": None}


def autotuners(package: str) -> list[Any]:
    """Every ``triton.runtime.autotuner.Autotuner`` bound to a module-level name of the loaded modules of
    ``package`` (``"liger_kernel"``: the package and its submodules), once each; [] without Triton."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return []
    found: dict[int, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Autotuner):
                found.setdefault(id(value), value)
    return list(found.values())


def _entries(tuners: list[Any]) -> dict[int, int]:
    return {id(t): len(getattr(t, "cache", None) or {}) for t in tuners}


def warm_autotune(model, batch, device: torch.device, package: str = "liger_kernel") -> dict[str, Any]:
    """One forward and backward of ``model`` on ``batch`` (``liger_gen.training.step_loss``), then its gradients
    dropped (``zero_grad(set_to_none=True)``): what the first step's kernels need to autotune and compile, apart
    from the timed steps. Returns ``{"s": wall seconds, between two device syncs, "kernels_tuned": (kernel, key)
    entries the autotuners of ``package`` gained, "reason": None}``."""
    before = _entries(autotuners(package))
    sync(device)
    t0 = time.perf_counter()
    step_loss(model, batch).backward()
    sync(device)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    after = _entries(autotuners(package))  # modules the pass imported count from zero
    return {"s": seconds, "kernels_tuned": sum(n - before.get(key, 0) for key, n in after.items()), "reason": None}


def not_run(reason: str) -> dict[str, Any]:
    """The report of an autotune warm-up that did not run: no time, no count, and why."""
    return {**NOT_RUN, "reason": reason}
