"""Kernel timing for the tuner: CUDA-graph replay with the L2 flushed, so launch overhead cannot pick a winner.

A timer is any callable ``timer(launch, params) -> ms``: ``launch`` runs one variant once (one phase: it may be
several kernel launches and cuBLAS calls, e.g. cross_entropy's forward + backward or fused_linear_cross_entropy's
chunk loop), ``params`` are the variant's template params. The GPU timers ignore ``params``; tests pass a
deterministic cost model instead. Times are in milliseconds. A GPU timer returns a ``Timing`` (a float that
also says how it was measured); the tuner records that method with every trial.

``graph_timer`` (method ``"graph"``): after a warm-up launch on a side stream, ``n`` repetitions of
(write a buffer of twice the L2 size; ``launch()``) are captured in one CUDA graph, and ``n`` flushes alone in a
second graph. The two graphs are replayed in alternation, each replay timed with CUDA events; the time of one
launch is the median over replay pairs of (graph − flushes-only graph) / n. On the GPU a replay issues every
kernel back to back, so the host-side cost of a launch (Python, argument packing, the driver call: 5-20 µs for a
Triton kernel, more for a launch made of several kernels) is absent from the number, while every input is still
read from HBM. Subtracting the flush graph also removes the write-back of the flush's own dirty lines; what is
left includes the write-back of the variant's outputs, which it does owe.

``events_timer`` (method ``"events"``): ``triton.testing.do_bench`` — CUDA events around each launch, L2
flushed before each. Host launch overhead leaks into it whenever the GPU work of a launch is shorter than its
host work. ``gpu_timer`` (the tuner's default) uses the graph timer and falls back to this one, recording
``"events"`` and the reason, when a launch cannot be captured (it synchronizes with the host, or allocates or
calls something graphs reject).

``triton.testing.do_bench_cudagraph`` is not used: in Triton 3.6 (and unchanged in 3.9) it captures
``rep / estimate`` launches back to back with no L2 flush between them, so an input that fits in the 50 MB L2 of
an H100/H200 is timed from the cache after the first launch — a variant would be rewarded for L2 reuse that
training, where other kernels evicted every input, does not get. It also captures in the default "global" mode,
so any other thread's CUDA call during the capture breaks it.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Mapping, Sequence

Timer = Callable[[Callable[[], None], Mapping[str, Any]], float]

#: Lower bound of the L2 flush buffer (bytes); the buffer is twice the device's L2 when that is larger.
MIN_FLUSH_BYTES = 64 << 20


class Timing(float):
    """A time in ms that remembers how it was measured: ``method`` ("graph", "events") and ``note`` (why a
    fallback happened). It behaves as a float everywhere else."""

    method: str
    note: str

    def __new__(cls, ms: float, method: str, note: str = "") -> "Timing":
        obj = super().__new__(cls, ms)
        obj.method = method
        obj.note = note
        return obj

    def __getnewargs__(self):  # pickling keeps the method
        return float(self), self.method, self.note


def timing_method(ms: float, default: str = "custom") -> str:
    """How ``ms`` was measured: ``ms.method`` for a ``Timing``, else ``default`` (a test's cost model)."""
    return getattr(ms, "method", default)


class GraphCaptureError(RuntimeError):
    """``launch`` could not be captured in a CUDA graph (it syncs, or allocates in a way graphs reject)."""


def graph_plan(launch_ms: float, flush_ms: float, *, graph_ms: float = 4.0, rep_ms: float = 60.0,
               max_launches: int = 100, min_replays: int = 3, max_replays: int = 25) -> tuple[int, int]:
    """(launches per graph, timed replays per graph) for a launch of about ``launch_ms`` after a flush of
    ``flush_ms``: enough launches that one replay lasts about ``graph_ms`` (1..``max_launches``), enough replay
    pairs that the timed replays last about ``rep_ms`` in all (``min_replays``..``max_replays``)."""
    if launch_ms < 0 or flush_ms < 0 or not graph_ms > 0 or not rep_ms > 0:
        raise ValueError(f"graph_plan: times must be >= 0 (got launch {launch_ms}, flush {flush_ms}, graph "
                         f"{graph_ms}, rep {rep_ms} ms)")
    per = max(launch_ms + flush_ms, 1e-4)
    launches = int(min(max_launches, max(1, graph_ms // per)))
    replays = int(min(max_replays, max(min_replays, rep_ms // (2 * launches * per))))
    return launches, replays


def per_launch_ms(graph_times: Sequence[float], flush_times: Sequence[float], launches: int) -> float:
    """One launch's time from paired replays: median over pairs of (graph − flush-only graph) / ``launches``.

    Pairs are replays taken back to back, so clock and temperature drift cancel within a pair. Never below
    1 ns (a difference lost in noise must not read as free)."""
    if len(graph_times) != len(flush_times) or not graph_times:
        raise ValueError(f"per_launch_ms: need as many graph as flush replays (got {len(graph_times)} and "
                         f"{len(flush_times)}), at least one")
    if launches < 1:
        raise ValueError(f"per_launch_ms: launches must be >= 1, got {launches}")
    diff = statistics.median(g - f for g, f in zip(graph_times, flush_times))
    return max(diff / launches, 1e-6)


_flush_buffers: dict[int, Any] = {}
_side_streams: dict[int, Any] = {}


def flush_buffer(device: int):
    """The device's L2 flush buffer: int8, twice the L2 size and at least ``MIN_FLUSH_BYTES`` (cached)."""
    import torch

    if device not in _flush_buffers:
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        _flush_buffers[device] = torch.empty(max(2 * l2, MIN_FLUSH_BYTES), dtype=torch.int8,
                                             device=torch.device("cuda", device))
    return _flush_buffers[device]


def _side_stream(device: int):
    import torch

    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def graph_timer(launch: Callable[[], None], params: Mapping[str, Any] | None = None, *, graph_ms: float = 4.0,
                rep_ms: float = 60.0) -> Timing:
    """Median device time of one ``launch()`` in ms, from CUDA-graph replays with the L2 flushed before each
    launch (see the module docstring). Raises ``GraphCaptureError`` if the launch cannot be captured; errors of
    the launch itself (during the warm-up, outside any capture) propagate unchanged."""
    import torch

    device = torch.cuda.current_device()
    flush = flush_buffer(device)
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        launch()  # warm-up on the capture stream: module load, cuBLAS workspace, first allocations
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        for _ in range(3):
            flush.zero_()
            launch()
        marks[1].record()
        for _ in range(3):
            flush.zero_()
        marks[2].record()
        stream.synchronize()
        flush_ms = marks[1].elapsed_time(marks[2]) / 3
        launch_ms = max(marks[0].elapsed_time(marks[1]) / 3 - flush_ms, 0.0)
        launches, replays = graph_plan(launch_ms, flush_ms, graph_ms=graph_ms, rep_ms=rep_ms)

        with_launch, flushes_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        try:
            # thread_local: a compile or progress thread calling CUDA meanwhile does not break the capture
            with torch.cuda.graph(with_launch, stream=stream, capture_error_mode="thread_local"):
                for _ in range(launches):
                    flush.zero_()
                    launch()
            with torch.cuda.graph(flushes_only, stream=stream, capture_error_mode="thread_local"):
                for _ in range(launches):
                    flush.zero_()
        except Exception as exc:
            try:
                torch.cuda.synchronize(device)
            except Exception:
                pass
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise GraphCaptureError(f"{type(exc).__name__}: {first}") from exc

        with_launch.replay()  # the first replay uploads the graph
        flushes_only.replay()
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(replays)]
        for e0, e1, e2 in events:
            e0.record()
            with_launch.replay()
            e1.record()
            flushes_only.replay()
            e2.record()
        stream.synchronize()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph_times = [e0.elapsed_time(e1) for e0, e1, _ in events]
    flush_times = [e1.elapsed_time(e2) for _, e1, e2 in events]
    del with_launch, flushes_only
    return Timing(per_launch_ms(graph_times, flush_times, launches), "graph")


def events_timer(launch: Callable[[], None], params: Mapping[str, Any] | None = None, *, warmup_ms: float = 10,
                 rep_ms: float = 50) -> Timing:
    """Median time of ``launch`` in ms from CUDA events around each launch, L2 flushed before each
    (``triton.testing.do_bench``). Includes host launch overhead where it exceeds the GPU work."""
    import triton.testing

    ms = triton.testing.do_bench(launch, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return Timing(float(ms), "events")


def gpu_timer(launch: Callable[[], None], params: Mapping[str, Any] | None = None) -> Timing:
    """The tuner's default timer: ``graph_timer``, or ``events_timer`` (method "events", ``note`` saying why)
    for a launch that cannot be captured in a CUDA graph."""
    try:
        return graph_timer(launch, params)
    except GraphCaptureError as exc:
        ms = events_timer(launch, params)
        return Timing(float(ms), "events", note=f"CUDA graph capture failed: {exc}")
