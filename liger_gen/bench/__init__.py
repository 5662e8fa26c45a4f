"""``liger-gen bench``: every op at one model's shapes, liger-gen against its peers, in one run.

For each op (``liger_gen.bench.ops.CASES``) and provider, one forward + backward (a training step of the op:
inputs and upstream gradients fixed, gradients taken with ``torch.autograd.grad`` so nothing accumulates):

Providers
    liger-gen            the public function of ``liger_gen.functional``, tuned table for this GPU
    liger-gen-heuristic  the same inside ``liger_gen.runtime.tables.heuristic_only()``
    torch-eager          the op's plain-PyTorch reference (``<op>_torch``) or the transformers formula
    torch-compile        ``torch.compile(dynamic=False)`` of that function (compiled in the warm-up, never timed)
    liger-kernel         the matching Liger-Kernel autograd Function, when ``liger_kernel`` imports
    cut-cross-entropy    ``cut_cross_entropy.linear_cross_entropy`` (fused_linear_cross_entropy only)

A provider that is not installed or fails is recorded with its error; the run goes on.

Metrics (per op and provider)
    kernel ms    CUDA: summed device kernel time of one forward + backward from ``torch.profiler``, the L2 cache
                 flushed (256 MiB int32 write) before each of ``iters`` iterations and the flush kernels excluded
                 (``summarize_kernels``); median over iterations. CPU (``device="cpu"``): no device kernels exist
                 (Triton's interpreter runs in the host process), so it is the host-clock median of one
                 forward + backward, method "cpu-wall".
    wall ms      back-to-back calls (no flush), one synchronize, host clock / n; the median of ``WALL_ROUNDS``
                 such loops (``wall_rounds_ms`` keeps each), measured before the kernel timing's profiler runs.
                 n is at most ``wall_iters`` and is cut so the loops last about ``WALL_BUDGET_S`` in all.
    host ms      host-overhead estimate = max(0, wall ms − kernel ms): the time per call the device does not spend
                 in this op's kernels when calls are issued back to back (Python, launches, host syncs). Close to
                 the host overhead when a call is host-bound; about 0 when the device is the bottleneck (it can
                 even be negative before clamping, since back-to-back calls find their inputs in L2:
                 ``wall_minus_kernel_ms`` keeps the raw value).
    peak MiB     CUDA only: ``torch.cuda.max_memory_allocated()`` during one forward + backward minus
                 ``torch.cuda.memory_allocated()`` just before it. Allocated before (not counted): the inputs, the
                 upstream gradients, the float64 reference and the L2 flush buffer. Counted: everything the call
                 allocates — outputs, saved activations, workspaces and the returned gradients — at its peak.
                 Providers that write gradients into their inputs (see each note) need no gradient buffers.
    GB/s, % copy minimal bytes of the step (``Case.bytes``) / kernel time, and its share of the device-to-device
                 copy bandwidth measured in the same run (2 GiB copy, read + written bytes / time).
    TFLOP/s, % mm fused_linear_cross_entropy: its flops / kernel time, and the share of a large ``torch.mm``
                 (8192³ in the run's dtype) measured in the same run.
    speed-up     kernel (and wall) time of torch-compile and of liger-kernel over this provider's.
    rel err      relative L2 error of every output and gradient against the float64 reference (computed once
                 per op); above ``REL_TOL[dtype]`` the result is flagged ``correct: false``.

``run_bench`` returns the result as a dict (schema in ``liger_gen.bench.report``); the CLI writes it as JSON,
draws the PNG and prints the table.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from liger_gen.bench.labels import label
from liger_gen.bench.ops import CASES, Case, Inputs, bench_model, get_case
from liger_gen.console import NO_PROGRESS, ProgressBar
from liger_gen.optional import installed_version

PROVIDERS = ("liger-gen", "liger-gen-heuristic", "torch-eager", "torch-compile", "liger-kernel", "cut-cross-entropy",
             "torchao")
SCHEMA_VERSION = 1
FLUSH_BYTES = 256 * 1024**2  # > 5x the 50 MiB L2 of an H100/H200
COPY_BYTES = 2 * 1024**3  # copy-ceiling probe (source tensor; as much is written)
MM_SIZE = 8192  # matmul-ceiling probe: MM_SIZE³ GEMM
CPU_COPY_BYTES = 32 * 1024**2
CPU_MM_SIZE = 256
WALL_BUDGET_S = 0.3  # the wall loops of one provider last about this long in all (at least 3 calls each)
WALL_ROUNDS = 5  # wall loops per provider; the median is reported
CPU_ROWS = 64  # default rows with device="cpu": Triton's interpreter is slow

__all__ = ["PROVIDERS", "Provider", "run_bench", "summarize_kernels", "summarize_flush", "device_events",
           "bench_model", "get_case", "CASES"]


# ------------------------------------------------------------------------------------------------ profiler helpers


def device_time_us(evt: Any) -> float:
    """Device time of one profiler event (a kernel, memcpy or memset), in microseconds.

    ``self_device_time_total`` / ``device_time_total`` (the project needs torch >= 2.5, which has them; the older
    ``*cuda_time*`` spellings only warn there). For a device-side event each is its duration, so ``time_range`` is
    the last resort.
    """
    for attr in ("self_device_time_total", "device_time_total"):
        try:
            value = getattr(evt, attr)
        except Exception:  # noqa: BLE001 - a property may raise on odd event kinds
            continue
        if value:
            return float(value)
    tr = getattr(evt, "time_range", None)
    return float(tr.end - tr.start) if tr is not None else 0.0


def device_events(events: Iterable[Any]) -> list[tuple[float, str, float]]:
    """CUDA-side events of a profile as ``(start_us, name, duration_us)`` in start order.

    Kineto records each GPU activity as its own event with ``device_type`` CUDA; the CPU ops that launched them
    are skipped (nothing is counted twice), and so are GPU ranges of ``record_function`` annotations.
    """
    out = []
    for evt in events:
        if getattr(getattr(evt, "device_type", None), "name", None) != "CUDA":
            continue
        if getattr(evt, "is_user_annotation", False):
            continue
        tr = getattr(evt, "time_range", None)
        out.append((float(tr.start) if tr is not None else 0.0, str(evt.name), device_time_us(evt)))
    out.sort(key=lambda e: e[0])
    return out


def summarize_flush(kevents: list[tuple[float, str, float]], n_flushes: int) -> dict:
    """What the L2 flush looks like, from a profile of ``n_flushes`` flushes alone: its kernel names, events per
    flush, whether that count was exact, and its mean time. RuntimeError if the profile is empty (no CUPTI)."""
    if not kevents:
        raise RuntimeError("the profiler recorded no CUDA events for the L2 flush; kernel timing is impossible "
                           "(is CUPTI available?)")
    per_flush = len(kevents) / n_flushes
    return {"names": sorted({name for _, name, _ in kevents}), "events_per_flush": max(1, round(per_flush)),
            "exact": per_flush == int(per_flush), "mean_us": sum(d for _, _, d in kevents) / n_flushes}


def summarize_kernels(kevents: list[tuple[float, str, float]], n_iters: int, flush: dict) -> dict:
    """Per-iteration kernel time (ms) of a profile of ``n_iters`` x (flush; forward + backward).

    If the flush's kernel names occur exactly ``n_iters · events_per_flush`` times, no provider kernel shares a
    name with the flush: those events are dropped by name ("exclude-flush-by-name") and, since one stream runs
    everything in issue order, each flush starts an iteration, which gives per-iteration sums (median, min).
    Otherwise everything is summed and ``n_iters`` times the flush's mean time is subtracted
    ("subtract-flush-mean"; mean only). ``kernels`` breaks the time down by kernel name (µs and calls per
    iteration). ``ms`` is the median when known, else the mean.
    """
    flush_names = set(flush["names"])
    n_flush_like = sum(1 for _, name, _ in kevents if name in flush_names)
    breakdown: dict[str, dict[str, float]] = {}
    per_iter: list[float] | None = None

    def add(name: str, dur: float) -> None:
        b = breakdown.setdefault(name, {"us_per_iter": 0.0, "calls_per_iter": 0.0})
        b["us_per_iter"] += dur / n_iters
        b["calls_per_iter"] += 1.0 / n_iters

    if flush.get("exact", True) and n_flush_like == n_iters * flush["events_per_flush"]:
        method = "exclude-flush-by-name"
        buckets: list[float] = []
        prev_flush = False
        for _, name, dur in kevents:
            if name in flush_names:
                if not prev_flush:
                    buckets.append(0.0)
                prev_flush = True
                continue
            prev_flush = False
            if not buckets:
                buckets.append(0.0)
            buckets[-1] += dur
            add(name, dur)
        total = sum(buckets)
        per_iter = buckets if len(buckets) == n_iters else None
    else:
        method = "subtract-flush-mean"
        for _, name, dur in kevents:
            add(name, dur)
        total = sum(d for _, _, d in kevents) - n_iters * flush["mean_us"]
    res = {"method": method, "iters": n_iters, "mean_ms": total / n_iters / 1e3,
           "median_ms": statistics.median(per_iter) / 1e3 if per_iter else None,
           "min_ms": min(per_iter) / 1e3 if per_iter else None,
           "kernels": dict(sorted(breakdown.items(), key=lambda kv: -kv[1]["us_per_iter"]))}
    res["ms"] = res["median_ms"] if res["median_ms"] is not None else res["mean_ms"]
    return res


def summarize_host_times(times_s: list[float]) -> dict:
    """The "kernel" summary of a CPU run: host-clock times of single forward + backward calls (seconds in)."""
    ms = [t * 1e3 for t in times_s]
    med = statistics.median(ms)
    return {"method": "cpu-wall", "iters": len(ms), "mean_ms": sum(ms) / len(ms), "median_ms": med,
            "min_ms": min(ms), "kernels": {}, "ms": med}


def wall_time(step: Callable[[], Any], sync: Callable[[], None], max_iters: int, rounds: int = WALL_ROUNDS,
              budget_s: float = WALL_BUDGET_S) -> tuple[float, int, list[float]]:
    """(median ms per call over ``rounds`` loops of back-to-back calls, calls per loop, every loop's ms per call).

    One synchronised call sets the loop length (``wall_iterations`` with ``budget_s / rounds``); each loop ends
    with one synchronize. The median over loops keeps one descheduled loop from moving the figure."""
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    n = wall_iterations((time.perf_counter() - t0) * 1e3, max_iters, budget_s / rounds)
    per_call = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        per_call.append((time.perf_counter() - t0) * 1e3 / n)
    return statistics.median(per_call), n, per_call


def wall_iterations(kernel_ms: float | None, max_iters: int, budget_s: float = WALL_BUDGET_S) -> int:
    """Calls in the wall-time loop: enough for ``budget_s`` at ``kernel_ms`` per call, between 3 and ``max_iters``."""
    if not kernel_ms or kernel_ms <= 0 or not math.isfinite(kernel_ms):
        return max(1, min(3, max_iters))
    return max(min(3, max_iters), min(max_iters, int(budget_s * 1e3 / kernel_ms)))


# ------------------------------------------------------------------------------------------------ providers


@dataclass
class Provider:
    """One implementation of a case: ``fn(tensors, options) -> outputs``; ``context`` wraps all of its work."""

    name: str
    fn: Callable | None = None
    status: str = "ok"
    note: str = ""
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    lookup: bool = False  # record liger-gen's config lookup (an op with a table of its own)


def _liger_kernel_provider(case: Case) -> Provider:
    if case.liger_kernel is None:
        return Provider("liger-kernel", status="not available", note=f"Liger-Kernel has no {case.op}")
    try:
        fn = case.liger_kernel()
    except ImportError as exc:
        return Provider("liger-kernel", status="not installed", note=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a broken install must not stop the run
        return Provider("liger-kernel", status=f"error: {type(exc).__name__}: {exc}")
    return Provider("liger-kernel", fn, note=case.liger_kernel_note)


def _peer_provider(name: str, case: Case) -> Provider | None:
    if name not in case.peers:
        return None  # not applicable to this op: no row
    loader, note = case.peers[name]
    try:
        fn = loader()
    except ImportError as exc:
        return Provider(name, status="not installed", note=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        return Provider(name, status=f"error: {type(exc).__name__}: {exc}")
    return Provider(name, fn, note=note)


def _compile_provider(case: Case) -> Provider:
    # dynamic=False: the one static shape per op that the first call would get anyway. Each case's eager
    # function is its own code object, so ten ops do not run into dynamo's recompile limit.
    fn, note = (case.compiled, case.compiled_note) if case.compiled is not None else (case.eager, case.eager_note)
    return Provider("torch-compile", torch.compile(fn, dynamic=False), note=f"torch.compile(dynamic=False) of: {note}")


def _heuristic_provider(case: Case) -> Provider:
    from liger_gen.runtime.tables import heuristic_only

    return Provider("liger-gen-heuristic", case.liger_gen, context=heuristic_only, lookup=case.shapes is None,
                    note="liger_gen.functional inside heuristic_only()")


# provider name -> builder(case) -> Provider, or None where the provider does not apply to the op
PROVIDER_BUILDERS: dict[str, Callable[[Case], Provider | None]] = {
    "liger-gen": lambda case: Provider("liger-gen", case.liger_gen, lookup=case.shapes is None,
                                       note="liger_gen.functional, tuned table"),
    "liger-gen-heuristic": _heuristic_provider,
    "torch-eager": lambda case: Provider("torch-eager", case.eager, note=case.eager_note),
    "torch-compile": _compile_provider,
    "liger-kernel": _liger_kernel_provider,
    "cut-cross-entropy": lambda case: _peer_provider("cut-cross-entropy", case),
    "torchao": lambda case: _peer_provider("torchao", case),
}


def build_providers(case: Case, names: list[str]) -> list[Provider]:
    """The providers of ``names`` that apply to ``case`` (a builder that raises gives an error entry)."""
    out = []
    for name in names:
        try:
            prov = PROVIDER_BUILDERS[name](case)
        except Exception as exc:  # noqa: BLE001
            prov = Provider(name, status=f"error: {type(exc).__name__}: {exc}")
        if prov is not None:
            out.append(prov)
    return out


# ------------------------------------------------------------------------------------------------ one measurement


@dataclass
class Settings:
    """How much to measure: profiled iterations, the wall loop's maximum, untimed warm-up calls."""

    iters: int = 10
    wall_iters: int = 100
    warmup: int = 2


class _Private:
    """A provider's own copies of the inputs and upstream gradients (in-place peers must not disturb others)."""

    def __init__(self, inputs: Inputs):
        self.tensors = {n: (t.detach().clone().requires_grad_(True) if n in inputs.grad_of else t.detach().clone())
                        for n, t in inputs.tensors.items()}
        self.upstream = {n: (None if u is None else u.detach().clone()) for n, u in inputs.upstream.items()}
        self.leaves = [self.tensors[n] for n in inputs.grad_of]
        self.options = inputs.options


def make_step(fn: Callable, priv: _Private, output_names: tuple[str, ...]) -> Callable[[], tuple]:
    """One forward + backward of ``fn`` on ``priv``: returns (outputs, gradients).

    The upstream gradients are fixed at the first call, in each output's dtype (1 for a scalar loss), so no
    cast or fill kernel runs inside a timed call.
    """
    ups: list[torch.Tensor] | None = None

    def step():
        nonlocal ups
        outs = fn(priv.tensors, priv.options)
        outs = tuple(outs)
        if len(outs) != len(output_names):
            raise RuntimeError(f"provider returned {len(outs)} outputs, expected {len(output_names)} "
                               f"({', '.join(output_names)})")
        if ups is None:
            ups = []
            for name, out in zip(output_names, outs):
                up = priv.upstream[name]
                ups.append(torch.ones_like(out) if up is None else up if up.dtype == out.dtype else up.to(out.dtype))
        grads = torch.autograd.grad(outs, priv.leaves, ups) if priv.leaves else ()  # () : not differentiable
        return outs, grads

    return step


def rel_errors(outs: tuple, grads: tuple, ref: dict[str, torch.Tensor], output_names: tuple[str, ...],
               grad_names: tuple[str, ...]) -> dict[str, float]:
    """Relative L2 error of each output and gradient against its float64 reference (NaN stays NaN)."""
    from liger_gen.codegen.problems import rel_l2

    errs = {}
    for name, got in list(zip(output_names, outs)) + list(zip(grad_names, grads)):
        if got is None:
            errs[name] = float("nan")
        else:
            errs[name] = rel_l2(got.detach(), ref[name])
    return errs


class _Timer:
    """Device-specific parts of a measurement: synchronisation, kernel time, peak memory."""

    def __init__(self, device: torch.device, flush_buf: torch.Tensor | None = None, flush: dict | None = None):
        self.device, self.flush_buf, self.flush = device, flush_buf, flush
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def kernel(self, step: Callable[[], Any], iters: int) -> dict:
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            return summarize_host_times(times)

        def body():
            for _ in range(iters):
                self.flush_buf.fill_(0x2A)
                step()

        self.sync()
        return summarize_kernels(profile_device_events(body, self.device), iters, self.flush)

    def peak_extra_bytes(self, step: Callable[[], Any]) -> int | None:
        if not self.cuda:
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        result = step()
        self.sync()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del result
        return int(peak)


def profile_device_events(body: Callable[[], None], device: torch.device) -> list[tuple[float, str, float]]:
    """Run ``body`` under ``torch.profiler`` (CPU + CUDA activities) and return its CUDA-side events."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Pp]rofiler clears events.*")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            body()
            torch.cuda.synchronize(device)
        return device_events(prof.events())


def bench_provider(case: Case, inputs: Inputs, ref: dict[str, torch.Tensor] | None, prov: Provider,
                   settings: Settings, timer: _Timer, dtype: torch.dtype, dims: dict[str, int]) -> dict:
    """Measure one provider on one case (see the module docstring); raises what the provider raises."""
    res: dict[str, Any] = {"op": case.op, "provider": prov.name, "status": prov.status, "note": prov.note}
    if prov.status != "ok":
        return res
    grad_names = case.gradient_names(inputs)
    with (prov.context() if prov.context else contextlib.nullcontext()):
        if prov.lookup:
            try:
                from liger_gen.ops import get_spec
                from liger_gen.runtime.devices import current_gpu
                from liger_gen.runtime.tables import lookup

                # what the runtime picks on this device: CPU tensors (the interpreter) never read a table
                gpu = current_gpu(timer.device)[0] if timer.cuda else None
                found = lookup(get_spec(case.op).space, dtype, case.lookup_dims(dims), dims["rows"], gpu)
                res["lookup"] = {"source": found["source"], "rows": found["rows"],
                                 "config": found["config"].to_dict(),
                                 **({"tuned_at": found["dims"]} if "dims" in found else {})}
            except Exception as exc:  # noqa: BLE001 - informative only
                res["lookup"] = {"source": "?", "error": f"{type(exc).__name__}: {exc}"}

        priv = _Private(inputs)
        step = make_step(prov.fn, priv, case.outputs)

        t0 = time.perf_counter()  # warm-up: compilation, autotuning, allocator; never timed
        for _ in range(max(1, settings.warmup)):
            step()
        timer.sync()
        res["warmup_s"] = round(time.perf_counter() - t0, 3)

        if ref is not None:  # correctness on fresh copies: in-place providers have changed their own
            fresh = _Private(inputs)
            outs, grads = make_step(prov.fn, fresh, case.outputs)()
            timer.sync()
            res["rel_err"] = rel_errors(outs, grads, ref, case.outputs, grad_names)
            del outs, grads, fresh

        # wall time first: before the profiled kernel timing, so nothing the profiler leaves behind is counted
        res["wall_ms"], res["wall_iters"], res["wall_rounds_ms"] = wall_time(step, timer.sync, settings.wall_iters)
        res["peak_extra_bytes"] = timer.peak_extra_bytes(step)
        res["kernel"] = timer.kernel(step, settings.iters)
        res["wall_minus_kernel_ms"] = res["wall_ms"] - res["kernel"]["ms"]
        res["host_overhead_ms"] = max(0.0, res["wall_minus_kernel_ms"])
    return res


# ------------------------------------------------------------------------------------------------ ceilings


def measure_copy(device: torch.device, nbytes: int, reps: int = 10) -> dict:
    """Device-to-device copy of an ``nbytes`` uint8 tensor: median time, and read + written bytes / time."""
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = _time_reps(lambda: dst.copy_(src), device, reps)
    med = statistics.median(times)
    return {"bytes": nbytes, "bytes_moved": 2 * nbytes, "reps": reps, "median_ms": med, "times_ms": times,
            "gbps": 2 * nbytes / (med * 1e-3) / 1e9}


def measure_matmul(device: torch.device, n: int, dtype: torch.dtype, reps: int = 10) -> dict:
    """``torch.mm`` of two n x n matrices in ``dtype``: median time and 2·n³ flops / time in TFLOP/s."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((n, n), generator=gen, device=device).to(dtype)
    b = torch.randn((n, n), generator=gen, device=device).to(dtype)
    out = torch.empty((n, n), dtype=dtype, device=device)
    times = _time_reps(lambda: torch.mm(a, b, out=out), device, reps)
    med = statistics.median(times)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "flops": 2 * n**3, "reps": reps,
            "median_ms": med, "times_ms": times, "tflops": 2 * n**3 / (med * 1e-3) / 1e12}


def _time_reps(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """Milliseconds of each of ``reps`` calls after two warm-ups: CUDA events on a GPU, the host clock on the CPU."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


# ------------------------------------------------------------------------------------------------ metadata


def git_state() -> dict:
    """Commit of the liger-gen checkout (``$LIGER_GEN_COMMIT`` overrides it; best effort, None without git)."""
    env = os.environ.get("LIGER_GEN_COMMIT")
    if env:
        return {"commit": env, "dirty": None, "source": "LIGER_GEN_COMMIT"}
    repo = Path(__file__).resolve().parents[2]

    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *cmd], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain",
                                                                      "--untracked-files=no")), "source": "git"}
    except Exception:  # noqa: BLE001 - no git, no repository (an installed wheel), no commit yet
        return {"commit": None, "dirty": None, "source": None}


def run_metadata(device: torch.device, command: str | None) -> dict:
    """GPU, library versions, git commit, command line and date of this run."""
    meta: dict[str, Any] = {"device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                    sm_count=props.multi_processor_count, total_memory_gib=round(props.total_memory / 2**30, 1))
    else:
        meta["gpu"] = "cpu"
    meta["versions"] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": installed_version("triton", "triton"),
        "transformers": installed_version("transformers"),
        "liger-kernel": installed_version("liger-kernel", "liger_kernel"),
        "cut-cross-entropy": installed_version("cut-cross-entropy", "cut_cross_entropy"),
        "liger-gen": installed_version("liger-gen", "liger_gen"),
    }
    meta["python"] = sys.version.split()[0]
    meta["git"] = git_state()
    meta["command"] = command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    meta["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    meta["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return meta


# ------------------------------------------------------------------------------------------------ the run


def _advancing(cases: list[Case], progress: ProgressBar) -> Iterable[Case]:
    """``cases``, the bar advanced after each one's loop body (a ``continue`` included)."""
    for case in cases:
        yield case
        progress.advance(case.op)


def _short_error(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"error: {type(exc).__name__}: {first}"


def run_bench(model, *, ops: list[str] | None = None, providers: list[str] | None = None, rows: int | None = None,
              dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
              settings: Settings | None = None, seed: int = 0, command: str | None = None,
              log: Callable[[str], None] | None = None, progress: ProgressBar = NO_PROGRESS) -> dict:
    """Benchmark ``ops`` (default: every op with a case) at ``model``'s shapes for each of ``providers``.

    Args:
        model: a ``liger_gen.models.ModelShape`` (``bench_model("tiny")`` for CPU runs).
        ops: op names (``liger_gen.bench.ops.CASES``); KeyError for an unknown one.
        providers: names from ``PROVIDERS`` (default: all); ValueError for an unknown one.
        rows: token count of every op; None picks each case's default (16384 for norms, RoPE and GLUs, 8192 for
            the vocabulary ops) on CUDA, ``CPU_ROWS`` on the CPU.
        dtype: activation dtype (float32, bfloat16 or float16).
        device: "cuda" (needs a GPU: RuntimeError otherwise) or "cpu" (kernels in Triton's interpreter when
            TRITON_INTERPRET=1, else plain PyTorch; kernel time is host time).
        settings: iterations (``Settings``).
        seed: input seed.
        command: the command line to record (default: ``sys.argv``).
        log: progress lines (default: stderr).
        progress: advanced once per op (``liger_gen.console.progress_bar``; default: no bar).

    Returns:
        The result dict (``liger_gen.bench.report`` documents and validates it), metrics derived; on the CPU
        ``functional_run`` is true and ``functional_run_reason`` says why the times are not performance
        (``liger_gen.bench.labels``).
    """
    from liger_gen.bench import report
    from liger_gen.codegen.problems import REL_TOL
    from liger_gen.codegen.spaces import dtype_name

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    settings = settings or Settings()
    ops = list(ops or CASES)
    cases = [get_case(op) for op in ops]
    providers = list(providers or PROVIDERS)
    unknown = [p for p in providers if p not in PROVIDER_BUILDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; known: {', '.join(PROVIDER_BUILDERS)}")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for, but no CUDA GPU is visible")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device}")

    t_start = time.perf_counter()
    meta = run_metadata(device, command)
    meta["gpu_slug"] = report.gpu_slug(meta["gpu"])
    log(f"[bench] {model.name} on {meta['gpu']}: measuring the copy and matmul ceilings ...")
    cuda = device.type == "cuda"
    meta["ceilings"] = {"copy": measure_copy(device, COPY_BYTES if cuda else CPU_COPY_BYTES),
                        "matmul": measure_matmul(device, MM_SIZE if cuda else CPU_MM_SIZE, dtype)}
    log(f"[bench] copy {meta['ceilings']['copy']['gbps']:,.0f} GB/s, matmul "
        f"{meta['ceilings']['matmul']['tflops']:,.1f} TFLOP/s")

    flush_buf = flush = None
    if cuda:
        flush_buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        flush_buf.fill_(0x2A)
        profile_device_events(lambda: flush_buf.fill_(0x2A), device)  # throwaway: CUPTI start-up
        n_probe = max(settings.iters, 10)

        def flushes():
            for _ in range(n_probe):
                flush_buf.fill_(0x2A)

        flush = summarize_flush(profile_device_events(flushes, device), n_probe)
        meta["l2_flush"] = {"bytes": FLUSH_BYTES, **flush}
    timer = _Timer(device, flush_buf, flush)

    op_info: dict[str, dict] = {}
    results: list[dict] = []
    progress.start(len(cases))
    for case in _advancing(cases, progress):
        r = rows if rows is not None else (case.default_rows if cuda else CPU_ROWS)
        dims = case.dims(model, r)
        op_dtype = case.problem.ACTIVATION_DTYPE or dtype  # an op whose activations have one dtype keeps it
        tol = REL_TOL[op_dtype]
        itemsize = torch.empty((), dtype=op_dtype).element_size()
        info: dict[str, Any] = {"dims": dims, "bytes": case.bytes(dims, itemsize), "bytes_formula": case.bytes_formula,
                                "flops": case.flops(dims), "flops_formula": case.flops_formula, "tolerance": tol}
        op_info[case.op] = info
        log(f"[bench] {case.op} {dims}: inputs and float64 reference ...")
        gen = torch.Generator(device=device).manual_seed(seed)
        try:
            inputs = case.make(dims, dtype, device, gen, model)
        except Exception as exc:  # noqa: BLE001 - one op's failure is recorded, the others still run
            traceback.print_exc()
            info["error"] = _short_error(exc)
            continue
        info["outputs"], info["gradients"] = list(case.outputs), list(case.gradient_names(inputs))
        ref = None
        t0 = time.perf_counter()
        try:
            ref = case.reference(inputs)
        except Exception as exc:  # noqa: BLE001 - timings still mean something without it
            traceback.print_exc()
            info["reference_error"] = _short_error(exc)
        timer.sync()
        info["reference_s"] = round(time.perf_counter() - t0, 3)

        for prov in build_providers(case, providers):
            log(f"[bench] {case.op} {prov.name} ...")
            try:
                res = bench_provider(case, inputs, ref, prov, settings, timer, dtype, dims)
            except Exception as exc:  # noqa: BLE001 - recorded, never crashes the run
                traceback.print_exc()
                res = {"op": case.op, "provider": prov.name, "status": _short_error(exc), "note": prov.note}
            if res.get("rel_err"):
                res["correct"] = all(v <= tol for v in res["rel_err"].values())  # NaN compares False
            results.append(res)
            if cuda:
                torch.cuda.empty_cache()
        del inputs, ref
        if cuda:
            torch.cuda.empty_cache()

    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    data = {
        "schema": SCHEMA_VERSION,
        "benchmark": "liger-gen bench",
        "meta": meta,
        "config": {"model": dict(vars(model)), "dtype": dtype_name(dtype), "ops": ops, "providers": providers,
                   "rows": rows, "iters": settings.iters, "wall_iters": settings.wall_iters,
                   "warmup": settings.warmup, "seed": seed, "wall_budget_s": WALL_BUDGET_S,
                   "flush_bytes": FLUSH_BYTES if cuda else 0},
        "ops": op_info,
        "results": results,
    }
    label(data, device.type, meta["triton_interpret"])
    return report.derive(data)
