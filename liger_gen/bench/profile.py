"""Where a training step's GPU time goes: every GPU activity of a ``torch.profiler`` trace put in one class
(GEMM, attention, liger-gen's kernels, other Triton kernels, optimizer, elementwise, memcpy/other), the busy time
(the union of the activity intervals) and the idle time of a step.

``summarize_profile`` gives the ``profile`` dict of ``liger-gen bench-step``'s JSON (``liger_gen.bench.step``);
:func:`classify_kernel` lists the rules.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"

#: Classes of GPU activity, in report order (``idle`` is computed, not classified).
KERNEL_CLASSES: tuple[str, ...] = ("gemm", "attention", "quantize", "liger_gen", "triton_other", "optimizer",
                                   "elementwise", "other")
CLASS_LABELS = {"gemm": "GEMM", "attention": "attn", "quantize": "fp8 quant", "liger_gen": "liger-gen",
                "triton_other": "triton other",
                "optimizer": "optim", "elementwise": "elem/reduce", "other": "memcpy/other", "idle": "idle"}

_KERNEL_DEF = re.compile(r"^def\s+(\w+_kernel)\s*\(", re.MULTILINE)
#: the templates of liger-gen's standalone FP8 quantization: every kernel they define is ``quantize``
QUANTIZE_TEMPLATES = ("fp8_quantize.py.jinja", "fp8_cast_transpose.py.jinja", "fp8_cast.jinja")
#: Inductor kernels that reduce an amax or cast to float8 (torchao's float8 training fuses its scaling into such
#: kernels under torch.compile)
_QUANTIZE = re.compile(r"^triton_.*(?:amax|float8|fp8)", re.IGNORECASE)
_INDUCTOR_GEMM = re.compile(r"^triton_tem_.*(?:mm|conv)", re.IGNORECASE)
_ATTENTION = re.compile(r"flash|fmha|sdpa|efficient_attention|attention|_attn", re.IGNORECASE)
_OPTIMIZER = re.compile(r"multi_tensor_apply|adam|FusedOptimizer", re.IGNORECASE)
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|splitkreduce", re.IGNORECASE)
_BARE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def liger_gen_kernel_names(templates_dir: Path = TEMPLATES_DIR) -> frozenset[str]:
    """Names of the Triton kernels liger-gen's templates define (``def <name>_kernel(`` in ``*.jinja``).

    Triton names a compiled kernel after its Python function, so these are the names the profiler reports.
    """
    names: set[str] = set()
    for path in sorted(Path(templates_dir).glob("*.jinja")):
        names.update(_KERNEL_DEF.findall(path.read_text(encoding="utf-8")))
    return frozenset(names)


def quantize_kernel_names(templates_dir: Path = TEMPLATES_DIR) -> frozenset[str]:
    """Names of the kernels of liger-gen's standalone FP8 quantization (``QUANTIZE_TEMPLATES``): the amax
    passes and casts, which the profile counts as ``quantize``, not ``liger_gen``."""
    return frozenset(name for template in QUANTIZE_TEMPLATES
                     for name in _KERNEL_DEF.findall((Path(templates_dir) / template).read_text(encoding="utf-8")))


@functools.cache
def _quantize_names() -> frozenset[str]:
    return quantize_kernel_names()


def _named(base: str, names: Iterable[str]) -> bool:
    """``base`` is one of ``names``, optionally with the suffix older Tritons appended (``_0d1d2d``)."""
    return base in names or any(base.startswith(n + "_") and re.fullmatch(r"[0-9a-z]+", base[len(n) + 1:])
                                for n in names)


def classify_kernel(name: str, liger_gen_names: Iterable[str] | None = None) -> str:
    """The class in ``KERNEL_CLASSES`` of a GPU activity named ``name`` (as torch.profiler reports it).

    Rules, first match wins:

    0. ``quantize``: FP8 quantization, liger-gen's quantize kernels (``quantize_kernel_names()``) or an Inductor
       kernel whose name holds ``amax``, ``float8`` or ``fp8`` (a bf16 model's compiled step has none: its reductions are sums and
       means), so the quantization's share of an FP8 step is one figure whoever fused it.
    1. ``optimizer``: ``multi_tensor_apply`` kernels (fused AdamW, foreach ops) and anything named adam,
       liger-gen's ``adamw_kernel`` included, so an optimizer step is one figure whoever runs it.
    2. ``liger_gen``: a liger-gen template kernel (``liger_gen_kernel_names()``), optionally with a suffix that
       older Tritons appended (``rms_norm_fwd_kernel_0d1d2d``).
    3. Inductor kernels (``triton_*``): its matmul templates (``triton_tem_fused_mm...``) are ``gemm``, the
       rest ``triton_other`` (checked before attention: a fused pointwise kernel may carry an SDPA op name).
    4. ``attention``: flash / fmha / sdpa / efficient_attention (before GEMM: ``fmha_cutlassF...`` is attention).
    5. ``gemm``: cuBLAS / cuBLASLt / CUTLASS kernels (gemm, gemv, cutlass, cublas, xmma, nvjet, splitKreduce).
    6. ``triton_other``: any other bare identifier (Triton kernels are named after a Python function, e.g.
       Liger-Kernel's ``_rms_norm_forward_kernel``; CUDA C++ kernels are reported with ``void ...<...>(...)``).
    7. ``elementwise``: PyTorch's native C++ kernels (names with ``::`` or ``void``): elementwise, reductions,
       copies, index/gather/scatter, embedding.
    8. ``other``: memcpy, memset and anything not recognised.
    """
    names = liger_gen_kernel_names() if liger_gen_names is None else liger_gen_names
    base = name.strip()
    if _QUANTIZE.match(base) or _named(base, _quantize_names()):
        return "quantize"
    if _OPTIMIZER.search(base) and not base.startswith("triton_"):
        return "optimizer"
    if _named(base, names):
        return "liger_gen"
    if base.startswith("triton_"):
        return "gemm" if _INDUCTOR_GEMM.match(base) else "triton_other"
    if _ATTENTION.search(base):
        return "attention"
    if _GEMM.search(base):
        return "gemm"
    if _BARE_NAME.match(base):
        return "triton_other"
    if "::" in base or base.startswith("void "):
        return "elementwise"
    return "other"


def busy_union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlapping time counted once), same unit."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"intervals: end {end} < start {start}")
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


@dataclass(frozen=True)
class DeviceEvent:
    """One GPU activity from a profile: name, start and duration in microseconds."""

    name: str
    start_us: float
    duration_us: float


def summarize_profile(events: Sequence[DeviceEvent], n_steps: int, ms_per_step: float | None,
                      profiled_wall_s: float | None = None, liger_gen_names: Iterable[str] | None = None,
                      top: int = 15) -> dict[str, Any]:
    """Per-step kernel time by class, GPU busy time, idle time and the top kernels of ``n_steps`` profiled steps.

    Args:
        events: GPU activities (kernels, memcpy, memset) of the profiled steps.
        n_steps: how many steps the profile covers (>= 1).
        ms_per_step: the unprofiled step time (ms) ``idle_ms`` is computed from (None: idle is None).
        profiled_wall_s: wall time of the profiled steps (s), reported as ``profiled_ms_per_step``.

    Returns the ``profile`` dict of ``liger_gen.bench.step``'s docstring (all times in ms per step;
    ``kernel_calls`` launches per step). Raises ValueError if ``n_steps < 1``.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    names = liger_gen_kernel_names() if liger_gen_names is None else frozenset(liger_gen_names)
    kernel_ms = {c: 0.0 for c in KERNEL_CLASSES}
    calls = {c: 0 for c in KERNEL_CLASSES}
    per_name: dict[str, list] = {}
    for ev in events:
        cls = classify_kernel(ev.name, names)
        kernel_ms[cls] += ev.duration_us / 1e3
        calls[cls] += 1
        entry = per_name.setdefault(ev.name, [cls, 0.0, 0])
        entry[1] += ev.duration_us / 1e3
        entry[2] += 1
    busy_ms = busy_union_us((ev.start_us, ev.start_us + ev.duration_us) for ev in events) / 1e3 / n_steps
    tops = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "steps": n_steps,
        "kernel_ms": {c: v / n_steps for c, v in kernel_ms.items()},
        "kernel_calls": {c: v / n_steps for c, v in calls.items()},
        "busy_ms": busy_ms,
        "idle_ms": None if ms_per_step is None else ms_per_step - busy_ms,
        "profiled_ms_per_step": None if profiled_wall_s is None else 1e3 * profiled_wall_s / n_steps,
        "top_kernels": [{"name": n[:200], "class": c, "ms": ms / n_steps, "calls": k / n_steps}
                        for n, (c, ms, k) in tops],
    }


def device_events(prof) -> list[DeviceEvent]:
    """The GPU activities of a finished ``torch.profiler.profile`` in start order (GPU-side user annotations
    skipped): ``liger_gen.bench.device_events``, the op harness's filter, as DeviceEvent records."""
    from liger_gen.bench import device_events as gpu_activities

    return [DeviceEvent(name, start, duration) for start, name, duration in gpu_activities(prof.events())]
