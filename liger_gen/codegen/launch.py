"""Lean launches of a rendered module's Triton kernels on CUDA.

``kernel[grid](*args, **constexprs)`` through Triton's ``JITFunction`` binds the arguments, computes their
specialization, looks the compiled kernel up and builds launch metadata on every call: on a slow host that is
15-25 µs per launch, several times the cost of the launch itself. ``make_lean`` gives a module's
``@triton.jit`` kernels (``<name>_kernel``) a launch path that keeps, per device and per *argument key*, the
``CompiledKernel`` Triton produced; later calls with the same key go straight to the compiled kernel's launcher
(``CompiledKernel.run``, the call Triton itself ends with). The kernels stay ``JITFunction``s for everything
else.

The argument key is at least as fine as Triton's own specialization, so two calls with one key always get the
same compiled kernel from Triton: a tensor contributes its dtype and whether its address is 16-byte aligned; an
int its value (``arg_key``'s coarser form — whether it equals 1, whether 16 divides it, its width: int32, int64,
uint64 — indexes the compiled kernel cache); floats, bools and None their kind; keyword arguments (constexprs
and launch options) their values and types. An argument of another kind, a callable grid, a constexpr passed by
position, a keyword argument that is not a plain value, Triton's launch hooks (a profiler such as Proton),
``TRITON_DEBUG``, an instrumentation mode (sanitizers) or a Triton that lacks the pieces used here all take
Triton's own path, ``JITFunction.run``, unchanged. The direct path skips what ``JITFunction.run`` does besides
the launch: its pre-run hooks (none are registered on these kernels) and its check that globals the kernel
reads have not changed (the rendered modules never rebind them).

The first call of a key looks in the compiled kernel cache (``liger_gen.runtime.compiled``) through the
``STORE`` hook before asking Triton to compile; with a hit the kernel is loaded without invoking the Triton
compiler. ``RECORDERS`` are called with every kernel Triton compiled here (``liger-gen build`` collects them).
``capture()`` collects a thread's launches without running them, for the tuner's compile workers
(``liger_gen.tuning.compile_pool``).
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any, Callable, Sequence

import torch

#: ``STORE(module_stem, kernel_name, key_text, fn, device_index)`` -> CompiledKernel or None (set by the runtime).
STORE: list[Callable[..., Any]] = []
#: called as ``recorder(module_stem, kernel_name, key_text, compiled_kernel)`` after Triton compiled a key.
RECORDERS: list[Callable[..., None]] = []
#: called as ``hook(module_stem, kernel_name, key_text)`` when a kernel from ``STORE`` failed to launch.
STORE_FAILED: list[Callable[..., None]] = []

_I32 = 2 ** 31
_I64 = 2 ** 63
_lock = threading.Lock()
#: entries one launch index of a kernel holds before it starts over (the per-shape index is rebuilt from the
#: per-specialization one; a key that never matches again, such as a NaN constexpr, cannot grow it without bound)
MAX_ENTRIES = 4096


_tls = threading.local()  # the open ``record()`` of this thread, if any
_recordings = 0  # open ``record()``s in all threads: the hot path reads only this global


def _remember(index: dict, key: tuple, entry: tuple) -> None:
    """``index[key] = entry``, the index started over once it holds ``MAX_ENTRIES`` (call with ``_lock`` held)."""
    if len(index) >= MAX_ENTRIES:
        index.clear()
    index[key] = entry


def arg_key(a: Any) -> tuple:
    """The part of the launch key one positional argument contributes (TypeError for kinds not handled)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    t = type(a)
    if t is bool:
        return ("b", a)
    if t is int:
        if -_I32 <= a < _I32:
            width = 32
        elif -_I64 <= a < _I64:
            width = 64
        elif 0 <= a < 2 * _I64:
            width = "u64"
        else:
            raise TypeError(f"no launch key for an int outside uint64/int64: {a}")  # Triton refuses it itself
        return ("i", a == 1, a % 16 == 0, width)
    if t is float:
        return ("f",)
    if a is None:
        return ("n",)
    raise TypeError(f"no launch key for an argument of type {t.__name__}")


def key_text(key: tuple) -> str:
    """A stable text form of a launch key without its device (what the compiled kernel cache indexes)."""
    def part(p):
        if isinstance(p, torch.dtype):
            return str(p).removeprefix("torch.")
        if isinstance(p, tuple):
            return [part(q) for q in p]
        if p is None or isinstance(p, (bool, int, float, str)):
            return p
        raise TypeError(f"no launch key text for a value of type {type(p).__name__}")
    return json.dumps([part(p) for p in key[1:]], separators=(",", ":"))


def _hooks_idle(runtime_knobs) -> bool:
    """True when no launch hook is registered (Triton 3.6 keeps empty HookChains; newer ones may use None)."""
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime_knobs, name, None)
        if hook is not None and (getattr(hook, "calls", None) is None or hook.calls):
            return False
    return True


def _instrumented(knobs) -> bool:
    """True when Triton is asked to build instrumented kernels (sanitizer modes, stage-inspection hooks): those are
    other kernels than the memoised ones, so Triton's own path runs."""
    c = getattr(knobs, "compilation", None)
    return bool(getattr(c, "instrumentation_mode", "") or getattr(c, "fpsan_homomorphic_casts", False)
                or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None)


class LeanLaunch:
    """The lean launch path, mixed into a ``JITFunction`` (``make_lean``) or wrapping a JIT-function-like object
    (``LeanKernel``): ``kernel[grid](*args, **kwargs)`` as for the JITFunction, which stays what it is for
    everything else (``isinstance``, ``.fn``, ``.src``, ``triton.compile(ASTSource(kernel, ...))``). Its state
    lives in ``_lean_*`` attributes. ``module_stem`` names the rendered module (``<op>_<sha256 of its
    source>``), which with the kernel's name and the key text identifies a compiled kernel across processes.
    """

    def _lean_setup(self, fn, module_stem: str) -> None:
        import triton

        self._lean_fn = fn
        self._lean_stem = module_stem
        self._lean_name = fn.__name__
        self._lean_entries: dict[tuple, tuple] = {}  # per Triton specialization (arg_key)
        self._lean_fast: dict[tuple, tuple] = {}  # the same entries per call shape (ints by value)
        self._lean_knobs = getattr(triton, "knobs", None)
        self._lean_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        self._lean_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
                             or (lambda device: torch.cuda.current_stream(device).cuda_stream))
        self._lean_params = tuple(fn.arg_names)
        self._lean_defaults = {name: p.default for name, p in fn.signature.parameters.items()
                               if p.default is not p.empty}
        params = getattr(fn, "params", None) or []
        constexpr = [i for i, p in enumerate(params) if getattr(p, "is_constexpr", False)]
        # positional arguments are keyed by kind, so only the leading runtime parameters may be passed by position
        self._lean_max_positional = constexpr[0] if constexpr else len(self._lean_params)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._lean_launch(grid, args, kwargs)

    def _lean_direct(self) -> bool:
        k = self._lean_knobs
        return k is not None and not k.runtime.debug and _hooks_idle(k.runtime) and not _instrumented(k)

    def _lean_jit(self, grid, args: tuple, kwargs: dict):
        return self._lean_fn.run(*args, grid=grid, warmup=False, **kwargs)

    def _lean_launch(self, grid, args: tuple, kwargs: dict):
        if _recordings:
            captured = getattr(_tls, "capture", None)
            if captured is not None:  # ``capture()``: note the launch, run nothing
                captured.append((self._lean_name, args, dict(kwargs)))
                return None
            if getattr(_tls, "recording", None) is not None:
                return self._lean_record(_tls.recording, grid, args, kwargs)
        if type(grid) is not tuple or len(args) > self._lean_max_positional or not self._lean_direct():
            return self._lean_jit(grid, args, kwargs)
        device = self._lean_device()
        try:  # ints by value, without a call per int: one entry per call shape, found by one dict lookup
            key = (device, *[a if type(a) is int else arg_key(a) for a in args], *kwargs.items(),
                   tuple(map(type, kwargs.values())))  # BLOCK=1, True and 1.0 are equal keys, other kernels
            entry = self._lean_fast.get(key)
        except TypeError:  # an argument kind without a key, or an unhashable keyword value
            return self._lean_jit(grid, args, kwargs)
        if entry is None:
            return self._lean_miss(key, grid, args, kwargs)
        run, function, packed, tail = entry
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._lean_stream(device), function, packed,
            None, None, None, *args, *tail)
        return None

    def _lean_key(self, device, args: tuple, kwargs: dict) -> tuple:
        """The per-call-shape key ``_lean_launch`` builds inline (TypeError for arguments without one)."""
        return (device, *[a if type(a) is int else arg_key(a) for a in args], *kwargs.items(),
                tuple(map(type, kwargs.values())))

    def _lean_record(self, recording: "Recording", grid, args: tuple, kwargs: dict):
        """Launch as usual, then add the launch (with its memoised entry, or None if it took Triton's own
        path) to ``recording``."""
        _tls.recording = None
        try:
            result = self._lean_launch(grid, args, kwargs)
        finally:
            _tls.recording = recording
        entry = device = None
        if type(grid) is tuple and len(args) <= self._lean_max_positional and self._lean_direct():
            device = self._lean_device()
            try:
                entry = self._lean_fast.get(self._lean_key(device, args, kwargs))
            except TypeError:
                entry = None
        recording.launches.append((self, entry, grid, args, device))
        return result

    def _lean_miss(self, key: tuple, grid, args: tuple, kwargs: dict):
        """A call shape not seen yet: the entry of its Triton specialization (``arg_key``), else a first call."""
        try:
            coarse = (key[0], *map(arg_key, args), *kwargs.items())  # what key_text writes for the kernel cache
            entry = self._lean_entries.get(coarse + key[-1:])  # with the keyword values' types, as ``key``
        except TypeError:  # an int that fits no Triton int type
            return self._lean_jit(grid, args, kwargs)
        if entry is None:
            return self._lean_first(coarse, grid, args, kwargs, fast_key=key)
        with _lock:
            _remember(self._lean_fast, key, entry)
        self._lean_run(entry, grid, key[0], args)
        return None

    def _lean_run(self, entry: tuple, grid: tuple, device, args: tuple) -> None:
        """Launch a memoised entry (the same call as ``_lean_launch``'s, which inlines it: that path is hot)."""
        run, function, packed, tail = entry
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._lean_stream(device), function, packed,
            None, None, None, *args, *tail)

    def _lean_tail(self, args: tuple, kwargs: dict) -> tuple | None:
        """The values of the parameters after the positional ones, in order (None if one is missing)."""
        tail = []
        for name in self._lean_params[len(args):]:
            if name in kwargs:
                tail.append(kwargs[name])
            elif name in self._lean_defaults:
                tail.append(self._lean_defaults[name])
            else:
                return None
        return tuple(tail)

    def _lean_first(self, key: tuple, grid: tuple, args: tuple, kwargs: dict, fast_key: tuple | None = None):
        """First call of a key: the compiled kernel cache, else Triton (which compiles or reads its own cache).
        The entry is memoised under ``key`` and, for later calls of the same shape, ``fast_key``."""
        try:
            text = key_text(key)
        except TypeError:  # a keyword argument that is not a plain value (a tensor passed by name)
            return self._lean_jit(grid, args, kwargs)
        stem, name = self._lean_stem, self._lean_name
        tail = self._lean_tail(args, kwargs)
        compiled = None
        for store in STORE:
            compiled = store(stem, name, text, self._lean_fn, key[0])
            if compiled is not None:
                break
        if compiled is None:
            compiled = self._lean_jit(grid, args, kwargs)  # compiles (or loads) and launches
            for record in RECORDERS:
                record(stem, name, text, compiled)
            launched = True
        else:
            launched = False
        if tail is None or compiled is None or not hasattr(compiled, "packed_metadata"):
            return compiled if launched else self._lean_jit(grid, args, kwargs)
        run = compiled.run  # loads the binary and builds the launcher on first access
        entry = (run, compiled.function, compiled.packed_metadata, tail)
        types = tuple(map(type, kwargs.values()))
        with _lock:
            _remember(self._lean_entries, key + (types,), entry)
            if fast_key is not None:
                _remember(self._lean_fast, fast_key, entry)
        if not launched:
            try:
                self._lean_run(entry, grid, key[0], args)
            except Exception:  # noqa: BLE001 - a cached kernel that cannot be launched: Triton's own path
                with _lock:
                    self._lean_entries.pop(key + (types,), None)
                    if fast_key is not None:
                        self._lean_fast.pop(fast_key, None)
                for on_failure in STORE_FAILED:
                    on_failure(stem, name, text)
                return self._lean_jit(grid, args, kwargs)
        return compiled


class LeanKernel(LeanLaunch):
    """The lean launch path around a JIT-function-like object ``fn`` (one that is not a ``JITFunction`` class
    ``make_lean`` can extend); its other attributes are ``fn``'s."""

    def __init__(self, fn, module_stem: str):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._lean_setup(fn, module_stem)

    def __getattr__(self, name):  # the JITFunction's own attributes (src, debug, arg_names, ...)
        if name.startswith("__") or name.startswith("_lean") or name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __repr__(self) -> str:
        return f"LeanKernel({self._lean_stem}:{self._lean_name})"


_lean_classes: dict[type, type] = {}


def make_lean(fn, module_stem: str):
    """Give the ``JITFunction`` ``fn`` the lean launch path in place (its class becomes a subclass that only adds
    ``LeanLaunch``); returns ``fn``."""
    cls = type(fn)
    with _lock:
        lean = _lean_classes.get(cls)
        if lean is None:
            lean = _lean_classes[cls] = type(f"Lean{cls.__name__}", (LeanLaunch, cls), {"__module__": __name__})
    fn.__class__ = lean
    fn._lean_setup(fn, module_stem)
    return fn


def wrap_module_kernels(module, module_stem: str) -> None:
    """Give each ``<name>_kernel`` JITFunction of ``module`` the lean launch path (``make_lean``; interpreted
    kernels and kernels another kernel calls are left alone)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - a Triton without the module layout used here
        return
    jitted = {name: obj for name, obj in vars(module).items() if isinstance(obj, JITFunction)}
    for name, fn in jitted.items():
        if not name.endswith("_kernel") or not hasattr(fn, "arg_names"):
            continue
        if any(f"{name}(" in other.src for other_name, other in jitted.items() if other_name != name):
            continue
        make_lean(fn, module_stem)


# ------------------------------------------------------------------------------------------ record and replay


class Recording:
    """What ran inside one ``record()``: ``launches`` holds (kernel, entry, grid, args, device) per lean launch
    (entry None: it took Triton's own path); ``other_work`` names the first PyTorch operator that did more than
    make a view (a copy, an allocation, a fill), which a replay of the launches alone would leave out."""

    def __init__(self):
        self.launches: list[tuple] = []
        self.other_work: str | None = None


_VIEWS_ONLY = None


def _views_only_mode(recording: Recording):
    """A dispatch mode that lets every operator run and notes in ``recording`` the first one that is not a view
    (views change metadata only; anything else is work on the device a replay would not repeat). The mode class
    is made once: a class made per call is a reference cycle (class, dict, function), and its closure would keep
    the recording, with every tensor the recorded launches took, alive until the garbage collector ran (seen on
    the first training step: the LM head's gradient held for a step)."""
    global _VIEWS_ONLY
    if _VIEWS_ONLY is None:
        from torch.utils._python_dispatch import TorchDispatchMode

        class ViewsOnly(TorchDispatchMode):
            def __init__(self, recording: Recording):
                super().__init__()
                self.recording = recording

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                recording = self.recording
                if recording is not None and recording.other_work is None \
                        and not getattr(func, "is_view", False) and func.overloadpacket is not torch.ops.aten.detach:
                    recording.other_work = str(func)
                return func(*args, **(kwargs or {}))

        _VIEWS_ONLY = ViewsOnly
    return _VIEWS_ONLY(recording)


@contextlib.contextmanager
def record():
    """Record the lean launches this thread makes inside the block (they still run), and whether any PyTorch
    operator other than a view ran there. Nested blocks record into the innermost one."""
    global _recordings
    recording = Recording()
    outer = getattr(_tls, "recording", None)
    _tls.recording = recording
    with _lock:
        _recordings += 1
    mode = _views_only_mode(recording)
    try:
        with mode:
            yield recording
    finally:
        mode.recording = None  # the mode object may outlive the block (torch's mode stack, a traceback)
        _tls.recording = outer
        with _lock:
            _recordings -= 1


@contextlib.contextmanager
def capture():
    """Collect the lean launches this thread makes inside the block without running them: the block yields a
    list that gets one ``(kernel name, positional args, keyword args)`` per launch (what compiling the kernel
    ahead of its first launch needs; ``liger_gen.tuning.compile_pool``). PyTorch work in the block still runs."""
    global _recordings
    launches: list[tuple[str, tuple, dict]] = []
    outer = getattr(_tls, "capture", None)
    _tls.capture = launches
    with _lock:
        _recordings += 1
    try:
        yield launches
    finally:
        _tls.capture = outer
        with _lock:
            _recordings -= 1


def compile_replay(recording: Recording, slots: Sequence[Any]) -> Callable[..., bool] | None:
    """A function ``replay(*tensors) -> bool`` that makes ``recording``'s launches again with ``tensors`` in the
    places of ``slots`` (the tensors the recorded call was given, in the same order; None entries are skipped),
    or None when the recording cannot be replayed: nothing was launched, a launch took Triton's own path, other
    PyTorch work ran, the launches used more than one device, or a tensor argument is not the data of exactly one
    slot (an internal temporary, or two slots sharing one address).

    Each recorded launch is repeated through the compiled kernel's launcher with the same grid, scalars and
    constexprs, and a tensor argument replaced by its slot's new tensor (a view of a slot with the slot's data
    address counts as the slot: the kernels take addresses). ``replay`` returns False, launching nothing, when
    the recorded kernels would not be the ones Triton picks now: another current device, a tensor whose
    16-byte alignment differs from the recorded one, or launch hooks, debug or instrumentation switched on.
    The caller then runs its launch function as usual. The recorded scalars are only valid for calls whose
    shapes, strides, dtypes and scalar arguments equal the recorded call's: the caller keys replays by those.
    """
    if not recording.launches or recording.other_work is not None:
        return None
    ptrs = [None if s is None else s.data_ptr() for s in slots]
    device = recording.launches[0][4]
    names: dict[str, Any] = {}
    lines = []
    for i, (kernel, entry, grid, args, dev) in enumerate(recording.launches):
        if entry is None or dev != device:
            return None
        run, function, packed, tail = entry
        n = len(grid)
        g = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        names.update({f"r{i}": run, f"f{i}": function, f"p{i}": packed,
                      f"g{i}x": g[0], f"g{i}y": g[1], f"g{i}z": g[2]})
        call = [f"g{i}x", f"g{i}y", f"g{i}z", "st", f"f{i}", f"p{i}", "None", "None", "None"]
        for j, a in enumerate((*args, *tail)):
            if isinstance(a, torch.Tensor):
                match = [k for k, p in enumerate(ptrs) if p is not None and p == a.data_ptr()]
                if len(match) != 1:
                    return None
                call.append(f"s{match[0]}")
            else:
                names[f"c{i}_{j}"] = a
                call.append(f"c{i}_{j}")
        lines.append(f"    r{i}({', '.join(call)})")
    first = recording.launches[0][0]
    knobs = {id(k._lean_knobs): k for k, *_ in recording.launches}
    checks = [f"d{n}()" for n in range(len(knobs))]
    names.update({f"d{n}": k._lean_direct for n, k in enumerate(knobs.values())})
    names.update(cur=first._lean_device, stream=first._lean_stream, D=device)
    checks.append("cur() == D")
    for k, p in enumerate(ptrs):
        if p is not None:
            checks.append(f"{'not ' if p % 16 else ''}s{k}.data_ptr() % 16 == 0")
    params = ", ".join(f"s{k}" for k in range(len(slots)))
    src = (f"def replay({params}):\n"
           f"    if not ({' and '.join(checks)}):\n"
           f"        return False\n"
           f"    st = stream(D)\n" + "\n".join(lines) + "\n    return True\n")
    scope: dict[str, Any] = dict(names)
    exec(compile(src, f"<liger_gen replay of {first._lean_stem}>", "exec"), scope)  # noqa: S102 - generated above
    replay = scope["replay"]
    replay.source = src
    return replay
