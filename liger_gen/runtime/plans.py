"""Per-call-shape plans of the eager ops: the checks and the kernel choice made once, the launches replayed.

On a slow host an eager forward + backward of a memory-bound op spends more time in Python than its kernels take
on the GPU: argument checks, the table lookup, the template's launch function, the launch key. None of it
changes between calls with the same shapes, strides, dtypes, devices and scalar arguments. An op that uses a
plan keys its calls by exactly those; the first call of a key runs the checks and builds the op's plan object
(which holds what the kernels need: the kernel module, output shapes and dtypes, grid sizes), later calls of
the key go straight to it. A plan's ``Launches`` record the lean launches its launch function makes
(``liger_gen.codegen.launch.record``) and replay them with the new call's tensors (``compile_replay``); where a
replay does not apply the launch function runs as usual.

Plans are used only in eager mode on plain tensors: not while torch.compile or torch.jit.trace record (those
see the custom ops), not under functorch transforms or forward-mode AD, not for tensor subclasses (DTensor and others take the
op's full path, which refuses or handles them).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch.autograd import forward_ad

from liger_gen.codegen import launch
from liger_gen.runtime.ops import CACHE_CLEARERS, use_custom_op

#: plans one op keeps before it starts over (a key that never repeats cannot grow the cache without bound)
MAX_PLANS = 4096
#: calls of one plan's launch function that may be recorded before it gives up on a replay
RECORD_TRIES = 3

_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: scalar argument types a plan key may hold (by value: 1 and 1.0 give the same result; bools are refused)
NUMBERS = (float, int)
_lock = threading.Lock()
_caches: list[dict] = []


def new_cache() -> dict:
    """An op's plan cache (emptied by ``clear``, which ``liger_gen.runtime.ops.clear_caches`` calls)."""
    cache: dict = {}
    _caches.append(cache)
    return cache


def remember(cache: dict, key: tuple, plan: Any) -> Any:
    """``cache[key] = plan`` (the cache started over once it holds ``MAX_PLANS``); returns ``plan``."""
    with _lock:
        if len(cache) >= MAX_PLANS:
            cache.clear()
        cache[key] = plan
    return plan


def clear() -> None:
    """Forget every plan (after the tables, the tuned folder or the heuristics changed)."""
    with _lock:
        for cache in _caches:
            cache.clear()


CACHE_CLEARERS.append(clear)


def eager(*tensors: Any) -> bool:
    """Whether a call with these arguments may use a plan: eager mode (no torch.compile or torch.jit.trace
    recording, no functorch transform, no forward-mode AD level, whose dual tensors a plan's direct launches
    would not see) and every argument a plain ``torch.Tensor`` or ``nn.Parameter``."""
    for t in tensors:
        if type(t) not in _PLAIN:
            return False
    return not use_custom_op() and not torch._C._are_functorch_transforms_active() and forward_ad._current_level < 0


#: launch layouts one plan keeps per backward (those seen by one forward shape are few; never grow without bound)
MAX_LAYOUTS = 8


def launches_for(cache: dict, key: tuple, record: bool) -> "Launches":
    """The ``Launches`` of ``key`` in a plan's per-layout ``cache`` (made, with ``record``, on first use; the
    cache starts over once it holds ``MAX_LAYOUTS``)."""
    launches = cache.get(key)
    if launches is None:
        if len(cache) >= MAX_LAYOUTS:
            cache.clear()
        launches = cache[key] = Launches(record=record)
    return launches


class Launches:
    """The kernel launches of one launch function at one call shape: recorded at the first call, replayed
    after. ``launches(slots, launch_fn, *args)`` runs ``launch_fn(*args)``, or its recorded launches with the
    tensors of ``slots`` (the tensors the launches read and write, None where absent) in the recorded places.
    ``record=False`` never records (CPU tensors: the interpreter's kernels have no lean launches to replay)."""

    __slots__ = ("replay", "tries_left")

    def __init__(self, record: bool = True) -> None:
        self.replay: Callable[..., bool] | None = None
        self.tries_left = RECORD_TRIES if record else 0

    def __call__(self, slots: Sequence[Any], launch_fn: Callable[..., Any], *args: Any) -> None:
        replay = self.replay
        if replay is not None:
            if not replay(*slots):
                launch_fn(*args)
            return
        if self.tries_left <= 0:
            launch_fn(*args)
            return
        self.tries_left -= 1
        with launch.record() as recording:
            launch_fn(*args)
        self.replay = launch.compile_replay(recording, slots)
