"""GPU names: map what ``torch.cuda.get_device_name()`` reports to the short names tables are filed under."""

from __future__ import annotations

import re

import torch

# (pattern on the reported name, canonical short name); first match wins, so specific names come first
_GPU_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bGH200\b", "gh200"),
    (r"\bH200\b", "h200"),
    (r"\bH100\b", "h100"),
    (r"\bH800\b", "h800"),
    (r"\bH20\b", "h20"),
    (r"\bGB200\b", "gb200"),
    (r"\bB200\b", "b200"),
    (r"\bB300\b", "b300"),
    (r"\bA100\b", "a100"),
    (r"\bA800\b", "a800"),
    (r"\bA10G\b", "a10g"),
    (r"\bA10\b", "a10"),
    (r"\bL40S\b", "l40s"),
    (r"\bL40\b", "l40"),
    (r"\bL4\b", "l4"),
    (r"\bRTX 6000 Ada\b", "rtx6000ada"),
    (r"\bRTX 5090\b", "rtx5090"),
    (r"\bRTX 4090\b", "rtx4090"),
    (r"\bRTX 3090\b", "rtx3090"),
    (r"\bMI300X\b", "mi300x"),
    (r"\bMI325X\b", "mi325x"),
)
KNOWN_GPUS: tuple[str, ...] = tuple(sorted({short for _, short in _GPU_PATTERNS}))
#: The form of every name ``canonical_gpu_name`` returns: lower-case words of letters and digits joined by '-'.
GPU_SLUG = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def canonical_gpu_name(reported: str) -> str:
    """Short table name for a reported device name: 'NVIDIA H200' → 'h200'.

    Unknown devices get a lower-case slug of the reported name ('Foo GPU X' → 'foo-gpu-x'), so they can still
    have tables of their own.
    """
    for pattern, short in _GPU_PATTERNS:
        if re.search(pattern, reported, flags=re.IGNORECASE):
            return short
    slug = re.sub(r"[^a-z0-9]+", "-", reported.lower().removeprefix("nvidia ")).strip("-")
    return slug or "unknown"


def current_gpu(device: torch.device | int | None = None) -> tuple[str, str] | None:
    """(canonical name, reported name) of the current CUDA device, or None when no GPU is visible."""
    if not torch.cuda.is_available():
        return None
    reported = torch.cuda.get_device_name(device)
    return canonical_gpu_name(reported), reported
