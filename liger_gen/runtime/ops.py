"""What every op's runtime binding shares: which path a tensor takes, the per-shape kernel choice, input checks.

A binding asks ``kernel_module(space, tensor, dims, rows, **variant)`` for the rendered kernel module of one call
shape, where ``space`` is its op spec's search-space class (the runtime is handed the op's description, never a
name to look up). The launch config is chosen once per (space, device, dtype, dims, rows, variant) and memoised:
a call costs a dict lookup plus the Triton launch. The runtime never benchmarks on its own. The custom ops
themselves live in each op's module under ``liger_gen/ops``, bound through ``liger_gen.runtime.binding``.
"""

from __future__ import annotations

import functools
import numbers
import os
from types import ModuleType
from typing import Any, Mapping

import torch

from liger_gen.codegen import launch
from liger_gen.codegen.build import load_variant
from liger_gen.codegen.spaces import DeviceLimits, Space
from liger_gen.runtime import tables
from liger_gen.runtime.devices import current_gpu

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if not launch.STORE:  # first launches of a key look in the compiled kernel cache
    from liger_gen.runtime.compiled import launch_failed as _compiled_failed, lookup as _compiled_lookup

    launch.STORE.append(_compiled_lookup)
    launch.STORE_FAILED.append(_compiled_failed)


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: CPU tensors then run the Triton kernels in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_custom_op() -> bool:
    """Whether an op must be called as its registered custom op rather than through its eager
    ``autograd.Function``: while torch.compile traces (no graph break) and while ``torch.jit.trace`` records (the
    trace then holds the op, which replays with its own autograd; a Function would be traced through into the
    kernel launch, which cannot be recorded)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


#: ``transforms_active()``: whether a torch.func transform (grad, vjp, jacrev, vmap, ...) is active, where the
#: ops take their transformable binding (``liger_gen.runtime.binding``). One C++ call (torch 2.0 and later; the
#: check ``autograd.Function.apply`` itself makes): about 25 ns measured on a CPU host, a tenth of
#: ``use_custom_op()``, so it may sit on the eager path.
transforms_active = torch._C._are_functorch_transforms_active


def host_checkable(*tensors: torch.Tensor) -> bool:
    """Whether a check on the host may read these tensors' values (``bool(...)``): not while torch.compile or
    torch.jit.trace record, and not for a tensor that torch.func wraps (vmap batches it: its values are per
    element, and a data-dependent branch on them is an error). An op's own call, inside the transform, sees the
    unwrapped values and checks them there."""
    if use_custom_op():
        return False
    return not transforms_active() or not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def uses_triton(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the Triton kernels (CUDA, or CPU under the interpreter)."""
    return t.is_cuda or (t.is_cpu and interpreter_enabled())  # attributes: no torch.device object per call


@functools.lru_cache(maxsize=None)
def device_info(device: torch.device) -> tuple[str | None, DeviceLimits]:
    """(canonical GPU name or None, limits) of a device; CPU means the interpreter."""
    if device.type == "cuda":
        gpu = current_gpu(device)
        return (gpu[0] if gpu else None), DeviceLimits.from_device(device)
    return None, DeviceLimits.interpreter()


@functools.lru_cache(maxsize=None)
def module_for(template: str, config, variant: tuple) -> ModuleType:
    """Rendered and imported kernel module of one config (rendering happens once per distinct config)."""
    return load_variant(template, {**config.to_dict(), **dict(variant)})


_chosen: dict[tuple, dict] = {}  # what _variant chose, for chosen_configs()
#: called by ``clear_caches`` (modules that keep per-shape state built on the choices register here)
CACHE_CLEARERS: list = []


@functools.lru_cache(maxsize=4096)
def _variant(space: type[Space], device: torch.device, dtype: torch.dtype, dims: tuple | int, rows: int,
             variant: tuple, heuristic_only: bool) -> tuple[ModuleType, Any, DeviceLimits]:
    gpu, limits = device_info(device)
    found = tables.lookup(space, dtype, dims if isinstance(dims, int) else dict(dims), rows, gpu, limits,
                          variant=dict(variant))
    _chosen[(space.__name__, str(dtype), repr(dims), int(rows), repr(variant), heuristic_only)] = {
        "config": found["config"].to_dict(), "source": found["source"],
        **({"tuned_at": found["dims"]} if "dims" in found else {})}
    return module_for(space.template, found["config"], variant), found["config"], limits


def chosen_configs() -> list[tuple[tuple, dict]]:
    """Every (space, dtype, dims, rows, variant, heuristic-only) → {config, source, and ``tuned_at``: the dims of
    a neighbouring entry that stood in} this process chose, sorted:
    the choice is a table lookup (or the heuristic), never a measurement, so every rank of a job with the same
    tables and shapes gets the same list."""
    return sorted(_chosen.items(), key=lambda kv: repr(kv[0]))


def kernel_module(space: type[Space], t: torch.Tensor, dims: Mapping[str, int] | int, rows: int,
                  **variant: Any) -> tuple[ModuleType, Any, DeviceLimits]:
    """(kernel module, config, device limits) for the op of ``space`` (its spec's search-space class) at one
    call shape on ``t``'s device and dtype.

    ``dims`` are the op's feature dims (a bare int for one-dim ops); ``variant`` the render-time options that
    are not tuned (e.g. ``casting_mode="llama"``). Memoised per shape: a call builds the cache key and looks it up.
    """
    key = dims if isinstance(dims, int) else tuple(dims.items())
    return _variant(space, t.device, t.dtype, key, int(rows), tuple(sorted(variant.items())),
                    tables.heuristic_only_enabled())


def clear_caches() -> None:
    """Forget chosen variants (after writing tables or changing $LIGER_GEN_TUNED_DIR)."""
    _variant.cache_clear()
    _chosen.clear()
    module_for.cache_clear()
    tables.clear_caches()
    from liger_gen.runtime import compiled

    compiled.clear()
    for clear in CACHE_CLEARERS:
        clear()


# ------------------------------------------------------------------------------------------ autograd helpers


def no_double_backward(op: str, reference: str) -> None:
    """Raise if autograd is building a graph through a backward: the kernels have no second derivative."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"liger_gen {op}: double backward (create_graph=True) is not supported; use "
                           f"{reference} where second derivatives are needed")


# ------------------------------------------------------------------------------------------ input checks


def describe(name: str, t: torch.Tensor) -> str:
    """'x of shape (4, 8), dtype torch.float16, device cpu': how errors name a tensor."""
    return f"{name} of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(op: str, name: str, t: Any, *, dtypes: tuple[torch.dtype, ...] | None = None,
                 min_dim: int = 0) -> None:
    """TypeError unless ``t`` is a tensor (of one of ``dtypes`` if given) with at least ``min_dim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} must be {names}; got {describe(name, t)}")
    if t.dim() < min_dim:
        raise ValueError(f"{op}: {name} must have at least {min_dim} dim(s); got {describe(name, t)}")


def check_float_arg(op: str, name: str, value: Any) -> float:
    """``value`` as a Python float; TypeError for bools, strings and anything that is not a real number (NumPy
    scalars such as ``np.float32`` are real numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, numbers.Real)):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_kernel_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    """TypeError naming the first tensor whose dtype the Triton kernels do not take (None entries are skipped)."""
    for name, t in tensors.items():
        if t is not None and t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{op}: the Triton kernel supports float32, bfloat16 and float16; got "
                            f"{describe(name, t)} (float64 runs only on the plain-PyTorch CPU path)")


@functools.lru_cache(maxsize=None)
def _checks_module() -> ModuleType:
    return load_variant("checks", {})


def check_targets(op: str, target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Class indices outside [0, n_classes) that are not ``ignore_index`` stop the op, as in PyTorch.

    CUDA: one launch of a device-side assertion (``templates/checks.py.jinja``), no host synchronisation: the
    error surfaces at the next synchronisation as "device-side assert triggered", as PyTorch's CUDA cross-entropy
    reports it, and the launch is captured by CUDA graphs. CPU: ValueError naming the first bad value. Called
    inside the ops' implementations, so it runs also where torch.compile or torch.jit.trace recorded the op; a
    call while they are recording (where a host check cannot run), or on a target a torch.func transform wraps,
    returns (``host_checkable``; the op's own call checks the unwrapped values). ``target`` is 1-D, any stride.
    """
    if target.is_cuda:
        _checks_module().targets_in_range(target, n_classes, ignore_index)
        return
    if target.numel() == 0 or not host_checkable(target):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        raise ValueError(f"{op}: {describe('target', target)} holds class indices outside [0, {n_classes}) "
                         f"that are not ignore_index={ignore_index}: e.g. {int(target[bad][0])} at position "
                         f"{int(bad.nonzero()[0, 0])}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """ValueError naming every tensor if they are not all on one device (None entries are skipped)."""
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        raise ValueError(f"{op}: tensors must be on one device; got "
                         + "; ".join(describe(k, v) for k, v in present.items()))
