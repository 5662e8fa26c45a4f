"""The driver of a tuning run: one frozen ``TuneSettings`` (built once, by ``liger-gen tune`` or a test) in, tables
out. ``find_target`` checks the GPUs once, before anything is tuned; ``run_tuning`` plans the units, reads the
priors from the tables being replaced, runs the fleet (``fleet.tune_ops``), writes each op's table as soon as the
op is done (``tables.write_entries``) and prints progress and the summary through ``report``."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from liger_gen.codegen.spaces import dtype_name
from liger_gen.codegen.spec import OpSpec
from liger_gen.tuning import report
from liger_gen.tuning.fleet import TuneJob, TuneResult, plan_units, tune_ops
from liger_gen.tuning.search import Tuner
from liger_gen.tuning.storage import display_storage
from liger_gen.tuning.tables import prior_configs, prior_entries, write_entries


class DeviceError(ValueError):
    """The GPUs this process sees cannot tune the tables asked for; ``param_hint`` names the option at fault (None:
    no one option)."""

    def __init__(self, message: str, param_hint: str | None = None):
        super().__init__(message)
        self.param_hint = param_hint


class NoGPUError(DeviceError):
    """No CUDA GPU is visible: tuning measures kernels on the GPU the tables are for."""


@dataclasses.dataclass(frozen=True)
class TuneTarget:
    """Where a run tunes, as ``find_target`` checked it: the device of this process, the name it reports, its
    compute capability ("9.0"; recorded in the tables), and one ``CUDA_VISIBLE_DEVICES`` value per worker process
    (None: tune in this process; an item None: a worker that leaves the variable alone, as tests on the CPU do)."""

    device: Any
    device_name: str
    compute_capability: str
    workers: tuple[str | None, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "device", torch.device(self.device))
        if self.workers is not None:
            object.__setattr__(self, "workers", tuple(self.workers))


def cuda_visible(devices: Sequence[int]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` values that pin one worker each to ``devices`` (indices as this process sees
    them, so an outer ``CUDA_VISIBLE_DEVICES=2,3`` maps index 0 to "2")."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [v.strip() for v in outer.split(",")] if outer else None
    out = []
    for d in devices:
        if visible is not None:
            if not 0 <= d < len(visible):
                raise ValueError(f"device {d} is not visible (CUDA_VISIBLE_DEVICES={outer!r})")
            out.append(visible[d])
        else:
            out.append(str(d))
    return out


def find_target(gpu: str, devices: Sequence[int] | None = None) -> TuneTarget:
    """Check that this process tunes on the GPU named ``gpu`` (a canonical name, ``devices.current_gpu``) and, with
    ``devices`` (GPU indices, one worker process each), that every one of them is visible and is that GPU; make
    the first of them the current device (one: this process tunes on it; several: the lead's takeovers do).
    ``NoGPUError`` without a visible GPU, ``DeviceError`` for any other mismatch."""
    from liger_gen.runtime.devices import current_gpu

    visible = current_gpu()
    if visible is None:
        raise NoGPUError("no CUDA GPU is visible, and tuning measures kernels on the target GPU.")
    if visible[0] != gpu:
        raise DeviceError(f"--gpu {gpu} does not match the visible GPU {visible[1]!r} ({visible[0]}); "
                          f"tables must be tuned on the GPU they are for.")
    if devices is not None:
        count = torch.cuda.device_count()
        missing = [d for d in devices if d >= count]
        if missing:
            raise DeviceError(f"GPU(s) {missing} not visible: this machine shows {count}",
                              param_hint="--workers/--devices")
        others = [(d, current_gpu(d)) for d in devices if current_gpu(d)[0] != gpu]
        if others:
            raise DeviceError(f"--gpu {gpu}: GPU(s) {', '.join(f'{d} is {n[1]!r}' for d, n in others)}; "
                              f"every worker must tune on the GPU the tables are for.")
        torch.cuda.set_device(devices[0])
    device = torch.device("cuda", torch.cuda.current_device())
    return TuneTarget(device=device, device_name=visible[1],
                      compute_capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                      workers=cuda_visible(devices) if devices is not None and len(devices) > 1 else None)


@dataclasses.dataclass(frozen=True)
class TuneSettings:
    """Everything one tuning run is asked to do, built once and passed down whole.

    Args:
        gpu: canonical name of the GPU the tables are for (h200, ...); names ``<out_root>/<gpu>/``.
        model: the model whose shapes are tuned (``liger_gen.models.ModelShape``).
        specs: the ``OpSpec``s of the ops to tune, in the order their tables are written and summarised.
        rows: token counts to tune (each spec's ``tuning_rows`` of them).
        dtypes: torch dtypes to tune.
        target: where to tune (``find_target``).
        out_root: table root; tables go to ``<out_root>/<gpu>/<op>.json``.
        trials: measured variants per kernel and shape (``Tuner.n_trials``).
        polish: variants of the local polish (None: a quarter of ``trials``).
        seed: sampler and input seed.
        budget_s: seconds of search and polish per op, split over its units (None: no cap).
        storage: Optuna storage spec (``storage.open_storage``). Several workers without one use a journal file
            in ``<out_root>/<gpu>/`` that is removed after a complete run and kept (and named, to resume with
            ``--storage``) otherwise.
        batch: points the search proposes at once (``Tuner.batch``).
        compile_workers: compile processes per tuning process (``Tuner.compile_workers``).
        refresh: re-time the existing entries' finalists instead of searching (``Tuner.refresh``).
        run_id: a run shared by several hosts (``liger-gen tune --run-id``): every host runs the same settings with
            the same ``storage`` (a database URL or a journal path all of them can open) and ``run_id``; each tunes
            the units it claims, waits until the whole run is done and takes over units abandoned by a dead
            process of this host at once, or by any process showing no progress for ``stale_s`` seconds (the
            storage is read every ``poll_s``). None: a run of this host alone.
        write_tables: whether this host writes the tables (False only in a shared run; another host writes them).
        stale_s, poll_s: see ``run_id``.
        tuner, make_problems: a ``Tuner`` and a ``make_problems(unit, model, device, seed)`` to use instead of the
            default tuner and the ops' ``tuning_problems`` (tests).

    ValueError for a shared run without a storage every host can open, or ``write_tables=False`` outside one.
    """

    gpu: str
    model: Any
    specs: tuple[OpSpec, ...]
    rows: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    target: TuneTarget
    out_root: Path
    trials: int = 24
    polish: int | None = None
    seed: int = 0
    budget_s: float | None = None
    storage: Any = None
    batch: int = 1
    compile_workers: int = 0
    refresh: bool = False
    run_id: str | None = None
    write_tables: bool = True
    stale_s: float = 600.0
    poll_s: float = 2.0
    tuner: Tuner | None = None
    make_problems: Callable | None = None

    def __post_init__(self):
        for name in ("specs", "rows", "dtypes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "out_root", Path(self.out_root))
        storage = self.storage
        if self.shared and (storage is None or not isinstance(storage, (str, Path)) or str(storage).rstrip("/") in (
                "sqlite:", "sqlite:///:memory:")):
            raise ValueError(f"a shared run (run_id {self.run_id!r}) needs a storage every host can open: a database "
                             f"URL (postgresql://user@host/db) or a journal file path, got {storage!r}")
        if not self.write_tables and not self.shared:
            raise ValueError("write_tables=False needs a shared run (run_id): some other host must write the tables")

    @property
    def shared(self) -> bool:
        return self.run_id is not None

    @property
    def several(self) -> bool:
        """Whether the run has several worker processes (else it tunes in this process)."""
        return self.target.workers is not None and len(self.target.workers) > 1

    def make_tuner(self) -> Tuner:
        """The ``Tuner`` of these settings (``tuner`` where one is given)."""
        return self.tuner or Tuner(n_trials=self.trials, seed=self.seed, polish_trials=self.polish, batch=self.batch,
                                   compile_workers=self.compile_workers)

    def job(self, tuner: Tuner) -> TuneJob:
        """The fleet's job: the units in one-GPU order and the priors of the tables being replaced (whole entries
        for ``refresh``, configs otherwise; the first of ``out_root`` and the packaged tables that has one)."""
        from liger_gen.runtime.tables import packaged_root

        roots = dict.fromkeys([self.out_root, packaged_root()])
        priors = (prior_entries(self.specs, roots, self.gpu) if self.refresh
                  else prior_configs(self.specs, roots, self.gpu))
        device = self.target.device.type
        job = TuneJob(units=plan_units(self.specs, self.model, list(self.rows), [dtype_name(d) for d in self.dtypes],
                                       budget_s=self.budget_s),
                      model=self.model, tuner=tuner, storage=self.storage, specs={s.name: s for s in self.specs},
                      make_problems=self.make_problems, priors=priors, seed=self.seed, device=device,
                      gpu=self.gpu if (self.several or self.shared) and device == "cuda" else None,
                      refresh=self.refresh, shared=self.shared, write_tables=self.write_tables, stale_s=self.stale_s,
                      poll_s=self.poll_s)
        if self.shared:
            job.run_id = self.run_id
        return job


def run_tuning(settings: TuneSettings) -> TuneResult:
    """Tune the ops of ``settings`` at its model's shapes, write one table per op as soon as the op is done, print
    the time each op took and, at the end, the summary per op and shape with the median gain over the heuristic.

    Returns the ``TuneResult``; the caller decides how to fail when ``unfinished`` or ``errors`` is not empty. In a
    shared run (``settings.run_id``), a host that writes no tables says so at the end; running the same settings
    again resumes the run.
    """
    from liger_gen.optional import require

    optuna = require("optuna", "liger-gen tune")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s, console = settings, report.console
    device_name, run_id, write_tables, several = s.target.device_name, s.run_id, s.write_tables, s.several
    by_name = {spec.name: spec for spec in s.specs}
    ops = list(by_name)
    tuner = s.make_tuner()
    job = s.job(tuner)
    writer_note = "the tables are written by the host(s) started without --no-write-tables"
    own_journal = None
    if several and s.storage is None:
        own_journal = s.out_root / s.gpu / f".tune-{job.run_id}.journal"
        job.storage = str(own_journal)
    workers = len(s.target.workers) if several else 1
    console.print(f"tuning {len(ops)} op(s), {len(job.units)} unit(s) (op x dtype x rows) of {s.model.name} on "
                  f"{device_name} with {workers} worker(s)"
                  + (f", {tuner.compile_workers} compile worker(s) each" if tuner.compile_workers else "")
                  + f", batches of {tuner.batch}; search+polish budget "
                  + (f"{s.budget_s:g} s per op" if s.budget_s else "none")
                  + (f"; studies in {display_storage(job.storage)}" if job.storage else "")
                  + (f"; shared run {run_id!r} on host {socket.gethostname()}"
                     + ("" if write_tables else f" ({writer_note})") if s.shared else ""))
    paths: dict[str, Path] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(f"tuning {s.model.name} on {device_name}", total=None)
        running: dict[int, str] = {}

        def on_event(event: dict) -> None:
            kind = event["kind"]
            if kind == "trial":
                progress.advance(task)
            elif kind == "problem":
                progress.update(task, total=(progress.tasks[0].total or 0)
                                + (tuner.n_trials + tuner.polish_trials) * event["phases"])
            elif kind == "start":
                running[event["worker"]] = event["op"]
            elif kind == "done":
                running.pop(event["worker"], None)
            elif kind == "error":
                console.print(f"[red]worker {event['worker']} failed: {event['error']}[/red]")
            elif kind == "skip":
                console.print(f"{event['op']} {event['key']}: no entry to refresh (tune it without --refresh)")
            elif kind == "waiting" and event["for"] == "writer":
                console.print(f"waiting for a host started without --no-write-tables to join run {run_id!r} "
                              f"(this host tunes from the priors that host stores)")
            elif kind == "waiting":
                console.print(f"waiting for {len(event['units'])} unit(s) being tuned by "
                              f"{', '.join(event['owners'])} (taken over after {s.stale_s:g} s without progress, "
                              f"or at once if their process on this host is gone)")
            elif kind == "takeover":
                console.print(f"[yellow]taking over unit {event['unit']} ({event['op']} {event['dtype']} "
                              f"rows={event['rows']}) as {event['claim'].rsplit(':', 1)[-1]}: {event['why']}"
                              f"[/yellow]")
            elif kind == "lost":
                console.print(f"[yellow]worker {event['worker']} stopped unit {event['unit']} ({event['op']}): "
                              f"{event['reason']}[/yellow]")
            if kind in ("start", "done"):
                progress.update(task, description="tuning " + (", ".join(sorted(set(running.values())))
                                                                 or "...") + f" on {device_name}")

        def on_op_done(op: str, entries: list[dict], seconds: dict[str, float]) -> None:
            done = "refreshed" if s.refresh else "tuned"
            if not write_tables:
                console.print(f"{op}: {len(entries)} shape(s) {done}; {writer_note}")
                return
            if not entries:
                console.print(f"{op}: no shape {done}; its table is left as it is")
                return
            paths[op] = write_entries(by_name[op].space, entries, s.out_root, gpu=s.gpu, device_name=device_name,
                                      compute_capability=s.target.compute_capability)
            cut = sum(1 for e in entries for search in e.get("search", {}).values() if search.get("cut"))
            busy = f" ({seconds['busy']:.1f} s of worker time)" if several else ""
            console.print(f"{op}: {len(entries)} shape(s) {done} in {seconds['wall']:.1f} s{busy}"
                          + (f", {cut} search(es) cut by the time budget" if cut else "") + f"; wrote {paths[op]}")

        start = time.monotonic()
        try:
            result = tune_ops(job, devices=s.target.workers if several else (s.target.workers or None),
                              on_event=on_event, on_op_done=on_op_done)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted; " + ("" if not write_tables else "tables of finished ops are written; ")
                          + (f"run the same command (--storage {display_storage(job.storage)} --run-id {run_id}) to "
                             f"resume the run" if s.shared else
                             f"run the same command with --storage {display_storage(job.storage)} to resume the "
                             f"studies" if job.storage else "with --storage, a run can be resumed") + "[/yellow]")
            raise
        elapsed = time.monotonic() - start
    report.print_run_end(result, ops, elapsed=elapsed, pool=None if several else tuner.pool_stats())
    if result.unfinished or result.errors:
        for error in result.errors:
            console.print(f"[red]{error}[/red]")
        if job.storage and (result.unfinished or not s.shared):
            shown = display_storage(job.storage)
            console.print(f"[yellow]{len(result.unfinished)} unit(s) unfinished; their studies are kept in "
                          f"{shown}: run the same command with --storage {shown}"
                          + (f" --run-id {run_id}" if s.shared else "") + " to resume[/yellow]")
    elif own_journal is not None and own_journal.exists():
        own_journal.unlink()  # every entry is in the tables; the trials too
    if s.shared and not result.unfinished and not write_tables:
        console.print(f"run {run_id!r} is complete; {writer_note}")
    return result
