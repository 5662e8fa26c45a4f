"""Compile workers for the tuner: processes that compile variants' Triton kernels for the tuning GPU on the
host's CPU cores, so that the tuning process only loads them from Triton's cache and times them.

How a variant is compiled ahead of its first launch:

1. The tuning process runs the variant's launcher once under ``liger_gen.codegen.launch.capture()``: its PyTorch
   work runs, its Triton launches are only noted (kernel name, positional and keyword arguments).
2. Each tensor argument becomes Triton's ``MockTensor`` of the same dtype (``OffsetTensor`` when its address is
   not 16-byte aligned, so the specialisation is the same); scalars and keyword arguments are sent as they are.
3. A worker — a spawned process that never touches CUDA — renders and imports the same module, points Triton at
   a driver that only reports the tuning GPU's target (``TargetDriver``), and calls each kernel's
   ``JITFunction.run(..., warmup=True)``. Triton's own binder computes the specialisation and cache key the
   launch in the tuning process computes, and Triton compiles into the same cache folder (``TRITON_CACHE_DIR``
   or ``triton.knobs.cache.dir`` of the tuning process).
4. At the variant's first launch, Triton in the tuning process finds that entry and loads it without compiling.

The search never depends on the workers: a variant whose capture or compile fails, or that no worker has started
yet, is compiled by the tuning process at its first launch, as without workers. A tuner gives the same results
with any number of workers (``Tuner(batch=...)`` fixes the search order; the pool only changes when compiles
happen).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import importlib
import multiprocessing
import threading
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

try:
    from triton.runtime.jit import MockTensor
except ImportError:  # pragma: no cover - a Triton without MockTensor: no compile workers
    MockTensor = object


class OffsetTensor(MockTensor):
    """A ``MockTensor`` whose address is ``offset`` bytes past a 16-byte boundary: Triton specialises pointers
    on 16-byte alignment, so an unaligned view must be described as one."""

    def __init__(self, dtype, offset: int):
        super().__init__(dtype)
        self.offset = int(offset)

    def data_ptr(self):  # noqa: D102 - MockTensor's interface
        return self.offset


class TargetDriver:
    """The part of a Triton driver that compiling needs: the current device, stream and target. A compile worker
    has no GPU; it compiles for the target the tuning process reported."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def describe(value: Any) -> Any:
    """A launch argument as a compile worker gets it (TypeError for kinds that cannot be sent)."""
    if isinstance(value, torch.Tensor):
        offset = value.data_ptr() % 16
        return MockTensor(value.dtype) if offset == 0 else OffsetTensor(value.dtype, offset)
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise TypeError(f"a {type(value).__name__} launch argument is not sent to compile workers")


def _init_worker(target, env: Mapping[str, str]) -> None:
    os.environ.update(env)
    from triton.runtime.driver import driver

    driver.set_active(TargetDriver(target))
    importlib.import_module("liger_gen.codegen.build")  # imported once here, not at the first compile

    try:  # Triton hashes its own library into every cache key, once per process: do it before the first compile
        from triton.compiler.compiler import triton_key

        triton_key()
    except Exception:  # noqa: BLE001 - a Triton without it computes the key its own way
        pass


def _ready() -> int:
    return os.getpid()


def _compile(template: str, params: Mapping[str, Any], launches: list) -> tuple[int, float]:
    """In a worker: compile ``launches`` (kernel name, args, kwargs) of the variant; (kernels, seconds)."""
    from liger_gen.codegen.build import load_variant

    start = time.monotonic()
    module = load_variant(template, params)
    for name, args, kwargs in launches:
        fn = getattr(module, name)
        fn.run(*args, grid=(1,), warmup=True, **kwargs)
    return len(launches), time.monotonic() - start


def triton_cache_env() -> dict[str, str]:
    """The Triton and liger-gen cache folders of this process, for workers (they must compile into the same)."""
    env = {}
    try:
        from triton import knobs

        folder = getattr(knobs.cache, "dir", None)
        if folder:
            env["TRITON_CACHE_DIR"] = str(folder)
    except (ImportError, AttributeError):
        if os.environ.get("TRITON_CACHE_DIR"):
            env["TRITON_CACHE_DIR"] = os.environ["TRITON_CACHE_DIR"]
    from liger_gen.codegen.build import ENV_CACHE_DIR, cache_dir

    try:
        env[ENV_CACHE_DIR] = str(cache_dir())
    except OSError:
        pass
    return env


@dataclass
class PoolStats:
    """What a pool did: variants sent, compiled by workers, not sent (capture or argument kinds), failed in a
    worker, compiled by the tuning process instead (not started when needed); seconds the tuning process waited
    for workers, and seconds the workers spent compiling."""

    sent: int = 0
    compiled: int = 0
    not_sent: int = 0
    failed: int = 0
    not_started: int = 0
    waited_s: float = 0.0
    worker_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "compiled": self.compiled, "not_sent": self.not_sent, "failed": self.failed,
                "not_started": self.not_started, "waited_s": round(self.waited_s, 3),
                "worker_s": round(self.worker_s, 3)}


class CompilePool:
    """``workers`` compile processes for one tuning process (see the module docstring).

    ``submit(problem, config, phase)`` captures the variant's launches and queues their compile; ``wait`` (before
    the variant's first launch) waits for a compile that a worker has started, and withdraws one no worker has
    started (the tuning process then compiles it itself). ``executor`` replaces the process pool (tests).
    """

    MAX_WAIT_S = 300.0

    def __init__(self, workers: int, *, target: Any = None, executor: concurrent.futures.Executor | None = None):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"compile workers must be an int >= 1, got {workers!r}")
        self.workers = workers
        self.stats = PoolStats()
        self._futures: dict[tuple, concurrent.futures.Future] = {}
        self._waited: set[tuple] = set()  # variants whose first launch has come: nothing more to wait for
        self._executor = executor
        self._target = target
        self._started = False

    def _pool(self) -> concurrent.futures.Executor:
        if self._executor is None:
            if self._target is None:
                from triton.runtime.driver import driver

                self._target = driver.active.get_current_target()
            self._executor = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                initargs=(self._target, triton_cache_env()))
        return self._executor

    def start(self) -> None:
        """Start every worker now (each imports Triton and liger-gen once); compiles sent later find them up."""
        pool = self._pool()
        if not self._started:
            self._started = True
            for _ in range(self.workers):
                pool.submit(_ready)

    @staticmethod
    def _key(problem, params: Mapping[str, Any], phase: str) -> tuple:
        return (problem.op, problem.key(), phase, tuple(sorted(params.items())))

    def submit(self, problem, config, phase: str) -> None:
        """Capture ``config``'s launches of ``phase`` on ``problem`` and queue their compile (once per variant)."""
        from liger_gen.codegen.build import load_variant
        from liger_gen.codegen.launch import capture

        params = problem.template_params(config)
        key = self._key(problem, params, phase)
        if key in self._futures:
            return
        try:
            module = load_variant(problem.template, params)
            with capture() as launches:
                problem.launcher(module, phase)()
            payload = [(name, tuple(describe(a) for a in args), {k: describe(v) for k, v in kwargs.items()})
                       for name, args, kwargs in launches]
            pickle.dumps(payload)
        except Exception as exc:  # noqa: BLE001 - the tuning process compiles this variant itself
            self.stats.not_sent += 1
            self.stats.errors.append(f"{problem.op} {phase}: not sent ({type(exc).__name__}: {exc})"[:300])
            return
        if not payload:
            return
        try:
            self._futures[key] = self._pool().submit(_compile, problem.template, params, payload)
        except Exception as exc:  # noqa: BLE001 - a worker died (killed, out of memory): start new ones later
            self.stats.not_sent += 1
            self.stats.errors.append(f"{problem.op} {phase}: the workers stopped ({type(exc).__name__}: {exc})"[:300])
            self._drop_executor()
            return
        self.stats.sent += 1

    def wait(self, problem, config, phase: str) -> None:
        """Before ``config``'s first launch: wait for its compile if a worker has it, else withdraw it."""
        key = self._key(problem, problem.template_params(config), phase)
        future = self._futures.get(key)
        if future is None or key in self._waited:
            return
        self._waited.add(key)
        if future.cancel():
            self.stats.not_started += 1
            return
        start = time.monotonic()
        try:
            _, seconds = future.result(timeout=self.MAX_WAIT_S)
            self.stats.compiled += 1
            self.stats.worker_s += seconds
        except Exception as exc:  # noqa: BLE001 - a worker's compile error: the launch compiles (and reports) it
            self.stats.failed += 1
            self.stats.errors.append(f"{problem.op} {phase}: {type(exc).__name__}: {str(exc)[:200]}")
        finally:
            self.stats.waited_s += time.monotonic() - start

    def _drop_executor(self) -> None:
        executor, self._executor, self._started = self._executor, None, False
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the workers (compiles not started are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._started = False
        self._futures.clear()
        self._waited.clear()

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_shared: dict[int, CompilePool] = {}
_shared_lock = threading.Lock()


def shared_pool(workers: int) -> CompilePool:
    """This process's pool of ``workers`` compile workers (started on first use, stopped at exit)."""
    with _shared_lock:
        pool = _shared.get(workers)
        if pool is None:
            pool = _shared[workers] = CompilePool(workers)
            if len(_shared) == 1:
                atexit.register(close_shared)
        return pool


def started_pool(workers: int) -> CompilePool | None:
    """The pool ``shared_pool(workers)`` returned in this process, or None if none was started."""
    return _shared.get(workers)


def close_shared() -> None:
    """Stop every shared pool of this process."""
    with _shared_lock:
        pools = list(_shared.values())
        _shared.clear()
    for pool in pools:
        pool.close()
