"""Per-call-shape plans of the eager ops: the checks and the kernel choice made once, the launches replayed.

On a slow host an eager forward + backward of a memory-bound op spends more time in Python than its kernels take
on the GPU: argument checks, the table lookup, the template's launch function, the launch key. None of it
changes between calls with the same shapes, strides, dtypes, devices and scalar arguments. An op keys its calls
by exactly those (its ``key`` function, built with ``meta``; a call it cannot key raises ``Unplanned``); the
first call of a key runs the op's checks and builds its ``Plan`` (which holds what the kernels need: the kernel
module, output shapes and dtypes, grid sizes), later calls of the key go straight to it. A plan's ``Launches``
record the lean launches its launch functions make (``liger_gen.codegen.launch.record``) and replay them with
the new call's tensors (``compile_replay``); where a replay does not apply the launch function runs as usual.
``liger_gen.runtime.binding.PlannedOp`` is the one place that keys, looks up, prepares and runs plans.

Plans are used only in eager mode on plain tensors: not while torch.compile or torch.jit.trace record (those
see the custom ops), not under functorch transforms or forward-mode AD, not for tensor subclasses (DTensor and
others take the op's full path, which refuses or handles them).
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

#: the tensor types a plan serves (subclasses such as DTensor take the full path)
PLAIN = _PLAIN = (torch.Tensor, torch.nn.Parameter)
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


class Unplanned(Exception):
    """Raised by an op's key function for a call no plan may serve (a tensor subclass, a non-tensor where a
    tensor belongs, an option of a type the key cannot hold exactly): the call takes the op's full path, whose
    checks raise the op's own error where the call is wrong."""


def meta(t: Any) -> tuple:
    """(shape, stride, dtype, device) of a plain tensor, what a plan key holds of it; ``Unplanned`` for anything
    else (a subclass such as DTensor, None, a non-tensor)."""
    if type(t) not in _PLAIN:
        raise Unplanned
    return t.shape, t.stride(), t.dtype, t.device


def meta_or_none(t: Any) -> tuple | None:
    """``meta`` of an optional tensor argument: None for None."""
    return None if t is None else meta(t)


def number(value: Any) -> float | int:
    """A float or int option as a key holds it (1 and 1.0 give the same key: ops take both as the same float);
    ``Unplanned`` for bools, other types and NaN (which equals no key)."""
    if type(value) not in NUMBERS or value != value:
        raise Unplanned
    return value


def exact(value: Any) -> tuple:
    """An option of any hashable type as a key holds it, with its type (True, 1 and 1.0 give different keys)."""
    try:
        hash(value)
    except TypeError:
        raise Unplanned from None
    return type(value), value


def eager_mode() -> bool:
    """Whether a call may use a plan at all: eager mode (no torch.compile or torch.jit.trace recording, no
    functorch transform, no forward-mode AD level, whose dual tensors a plan's direct launches would not see)."""
    return not use_custom_op() and not torch._C._are_functorch_transforms_active() and forward_ad._current_level < 0


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


class Plan:
    """One validated call shape of an op on its kernel path, built by the op's ``prepare`` (after the op's checks
    passed) and kept under the call's key by ``liger_gen.runtime.binding.PlannedOp``.

    A subclass sets ``BACKWARD`` (the backward ``Kernel`` whose calls from the op's ``backward`` the plan serves)
    and ``GRAD_INPUTS`` (positions of the forward custom op's arguments that may require grad), and implements

    * ``inputs(*args)``: the forward custom op's leading tensor arguments (None where an optional one is absent)
      for the public call ``args`` (views only: anything that would copy makes the call shape unplannable,
      decided in ``prepare``); ``tail`` holds the op's remaining arguments, the same for every call of the plan;
    * ``forward(*tensors)``: the forward custom op's outputs for ``tensors + tail``, as its impl returns them, its
      launches through ``self.fwd`` (recorded and replayed on CUDA);
    * ``backward(*args)``: the backward kernel's outputs for its ``Kernel.run`` arguments, as its impl returns
      them, launches through ``self.launches_for(layout key)``;
    * ``result(outputs, *args)``: the public result from the outputs the op's ``Differentiable`` returns.
    """

    __slots__ = ("record", "fwd", "bwd", "tail")
    BACKWARD: Any = None
    GRAD_INPUTS: tuple[int, ...] = (0,)

    def __init__(self, device: torch.device, tail: tuple = ()):
        self.tail = tail
        self.record = device.type == "cuda"  # the interpreter's kernels have no lean launches to replay
        self.fwd = Launches(record=self.record)
        self.bwd: dict[tuple, Launches] = {}  # per layout of the incoming gradients

    def launches_for(self, key: tuple) -> "Launches":
        """The backward's ``Launches`` for one layout of its gradients (``key``)."""
        return launches_for(self.bwd, key, self.record)

    def needs_grad(self, tensors: tuple) -> bool:
        """Whether a forward argument of ``GRAD_INPUTS`` requires grad (asked only with grad mode on)."""
        for i in self.GRAD_INPUTS:
            t = tensors[i]
            if t is not None and t.requires_grad:
                return True
        return False

    def inputs(self, *args: Any) -> tuple:
        raise NotImplementedError

    def forward(self, *tensors: Any) -> Any:
        raise NotImplementedError

    def backward(self, *args: Any) -> Any:
        raise NotImplementedError

    def result(self, outputs: Any, *args: Any) -> Any:
        return outputs


#: what ``PlannedOp`` keeps under a key whose calls no plan serves (the op's ``prepare`` returned None)
NO_PLAN = object()
