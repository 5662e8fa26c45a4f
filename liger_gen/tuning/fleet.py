"""The fleet: work units, the worker processes of one host, and the hosts of one shared run.

Several GPUs (``tune_ops`` with ``devices``): one worker process per GPU, all on one Optuna storage. The unit
of work is one op at one dtype and token count (``WorkUnit``); a worker claims a unit, and then each problem it
gives, by creating a claim study whose name is unique per run — the storage lets exactly one creation succeed —
so every study is run start to finish by one worker with the same seeded sequence as on one GPU. Workers store
their entries in the claim study's user attrs; the lead reads them back in unit order and writes the same tables
a one-GPU run writes. A worker that dies leaves its studies in the storage: the same command with the same
``--storage`` resumes them.

Several hosts (``TuneJob.shared``, ``liger-gen tune --run-id``): tuner processes on several machines, each with its
own workers, share one database storage (PostgreSQL; SQLite stays the storage of one machine, and a journal file
serves hosts that mount one disk with working file locks). The claims are named by the run id every host is
given, so each unit is still tuned once, and:

- a unit claim records its owner (host name, pid) and a ``beat`` counter that the owner raises on every trial and
  problem (written at most every ``BEAT_INTERVAL_S``);
- the first host stores the run's plan (units, tuner settings, model) and every other host checks its own
  against it, so hosts started with different options stop at once; a table-writing host stores the priors (the
  configs of the tables it replaces) and every host tunes from those;
- once its own workers have tried every unit, a host waits for the units claimed by others. A unit is abandoned
  when its latest attempt's owner is a process of this host that is gone, or when its ``beat`` has not changed
  for ``stale_s`` seconds of this host's clock (host clocks are never compared). An abandoned unit is taken
  over by creating the claim ``<unit claim>:retry<k>`` (one creator wins) and tuning it in the waiting process;
  its problems keep the entries already stored, and a problem its dead attempt had claimed without storing an
  entry is claimed again as ``<problem claim>:retry<k>``. The Optuna studies are named by problem, so the
  trials already stored are resumed. An owner that sees a retry claim of its unit at its next beat stops
  working on it;
- a unit is done when any of its attempts is; entries are read back in one-GPU order (unit, then position),
  one per problem;
- only a process with ``write_tables`` writes the tables (``driver.run_tuning``); the others only tune.

Re-running a host's command with the same run id resumes it: its own dead attempts (this host, pid gone) are
taken over at once.

Why claims of its own rather than Optuna's shared studies (several processes optimizing one study through one
storage): a table must not depend on which worker or host ran what. Each study's sampler is re-seeded from (seed,
finished trials, place in the batch) (``search.Tuner._sampler``), so the points it tries depend only on its own
stored history; workers trading trials of one study would make that history, and with it the points, the
polish's walk and the winner, depend on their timing. And a study is more than its trials: after the search
come the polish and the re-timing of the finalists in alternation, which compares them in one process on one
GPU. So the fleet hands out whole studies: a claim (``claims.claim``: a study created as a lock, which the
storage lets exactly one process create) gives one unit, and each of its problems, to one process, which runs
every study of it start to finish with the same seeded sequence as a one-GPU run. Optuna's storages still hold
the studies (so an interrupted one resumes) and the claims.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import multiprocessing
import os
import queue as queue_module
import time
import traceback
import uuid
from typing import Any, Callable, Mapping, Sequence

try:
    import optuna
except ImportError:  # a training-only install: ``liger-gen tune`` says what to install
    optuna = None

from liger_gen.codegen.spaces import dtype_from_name
from liger_gen.codegen.spec import OpSpec
from liger_gen.optional import installed_version
from liger_gen.tuning.claims import (CLAIM_PREFIX, Heartbeat, TakenOver, attempt_name, attempts, base_name, claim,
                                     claim_problem, owner_text, pid_alive, problem_claim, retry_index, same_host,
                                     study_attrs, this_process)
from liger_gen.tuning.search import Tuner
from liger_gen.tuning.storage import open_storage
from liger_gen.tuning.tables import neighbour_priors, problem_key


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    """One op at one dtype and token count: what one worker claims and tunes start to finish.

    ``index`` is the unit's place in a one-GPU run (tables are assembled in that order); ``budget_s`` the seconds
    of search and polish for all the problems the unit gives (None: no cap)."""

    index: int
    op: str
    dtype: str
    rows: int
    budget_s: float | None = None


def plan_units(specs: Sequence[OpSpec], model, rows: Sequence[int], dtypes: Sequence[str], *,
               budget_s: float | None = None) -> list[WorkUnit]:
    """Units in one-GPU order (op, dtype, rows), at the token counts each spec tunes for ``rows``
    (``OpSpec.tuning_rows``: ops that cap their tuning rows give fewer). ``budget_s``: seconds of search and polish
    per op, split evenly over the op's units. ValueError for a budget that is not positive."""
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 seconds or None, got {budget_s}")
    units: list[WorkUnit] = []
    for spec in specs:
        pairs = [(d, r) for d in dtypes for r in spec.tuning_rows(model, rows)]
        share = None if budget_s is None else budget_s / max(1, len(pairs))
        for d, r in pairs:
            units.append(WorkUnit(len(units), spec.name, d, int(r), share))
    return units


def spec_problems(unit: WorkUnit, model, device, seed: int, *, specs: Mapping[str, OpSpec]) -> list:
    """The tuning problems of one unit: its op spec's ``tuning_problems`` at the unit's dtype and rows."""
    return list(specs[unit.op].tuning_problems(model, [unit.rows], dtype_from_name(unit.dtype), device, seed))


@dataclasses.dataclass
class TuneJob:
    """Everything a worker needs, picklable: the units, the model shapes, a Tuner (its ``storage`` and
    ``on_trial`` are set by the process that runs it), the run id that names the claims, the storage spec,
    the op specs by name (their ``tuning_problems`` build each unit's problems, unless ``make_problems(unit,
    model, device, seed) -> [Problem]`` is given), the input seed, the device type ("cuda" or "cpu") and the
    canonical GPU name every worker must see (None: not checked).

    A run shared by several hosts (``shared``, with the same ``run_id`` and storage on every host) also checks
    that every host plans the same run, tunes from the priors of a table-writing host, and waits until every
    unit is done, taking over abandoned ones (see the module docstring): ``write_tables`` says whether this
    process writes the tables (``driver.run_tuning`` reads it), ``stale_s`` how long an attempt of another host
    may show no progress before it is taken over, ``poll_s`` how often the storage is read while waiting."""

    units: list[WorkUnit]
    model: Any
    tuner: Tuner
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    storage: Any = None
    specs: Mapping[str, OpSpec] = dataclasses.field(default_factory=dict)
    make_problems: Callable | None = None
    priors: Mapping[str, Mapping[tuple, Mapping[str, Any]]] = dataclasses.field(default_factory=dict)
    seed: int = 0
    device: str = "cuda"
    gpu: str | None = None
    refresh: bool = False  # re-time each problem's existing entry (``priors`` holds whole entries) instead of tuning
    shared: bool = False
    write_tables: bool = True
    stale_s: float = 600.0
    poll_s: float = 2.0


@dataclasses.dataclass
class TuneResult:
    """What ``tune_ops`` returns: entries per op (one-GPU order), seconds per op (``wall``: first unit start
    to last unit end; ``busy``: sum over units of their workers' time), units left unfinished, worker errors."""

    entries: dict[str, list[dict[str, Any]]]
    seconds: dict[str, dict[str, float]]
    unfinished: list[WorkUnit]
    errors: list[str]
    run_id: str


class SharedRunError(ValueError):
    """A host cannot join a shared run: it plans other units or settings than the run was started with."""


#: Seconds between two notices of a host that waits (for a table-writing host to join, ...).
REMIND_S = 300.0
#: Seconds a unit claim may stay without its owner record (written right after the claim) before it counts as
#: abandoned by a process that stopped in between.
OWNERLESS_S = 30.0


def _unit_claim(run_id: str, unit: WorkUnit) -> str:
    return f"{CLAIM_PREFIX}:{run_id}:unit:{unit.index}"


def _unit_tuner(job: TuneJob, storage, report: Callable[[dict], None], worker: Any) -> tuple[Tuner, list]:
    """A copy of the job's tuner on ``storage`` whose trials are reported and beat the running attempt's
    heartbeat (the list's one item, set while an attempt runs)."""
    tuner = copy.copy(job.tuner)
    tuner.storage = storage
    beat: list = [None]

    def on_trial() -> None:
        if beat[0] is not None:
            beat[0]()
        report({"kind": "trial", "worker": worker})

    tuner.on_trial = on_trial
    return tuner, beat


def _run_attempt(job: TuneJob, storage, tuner: Tuner, beat: list, unit: WorkUnit, unit_id: int, name: str,
                 report: Callable[[dict], None], *, worker: Any, device) -> None:
    """Tune ``unit`` under the unit claim ``name`` (id ``unit_id``) just created: build its problems, claim and
    tune each, store each entry in its problem claim, then mark the unit claim done. Another process taking the
    unit over ends the attempt with a "lost" event."""
    heartbeat = beat[0] = Heartbeat(storage, unit_id, name, fenced=job.shared)
    retry = retry_index(name) > 0
    start = time.monotonic()
    report({"kind": "start", "unit": unit.index, "op": unit.op, "worker": worker, "claim": name})
    try:
        make = job.make_problems or functools.partial(spec_problems, specs=job.specs)
        problems = make(unit, job.model, device, job.seed)
        share = None if unit.budget_s is None else unit.budget_s / max(1, len(problems))
        tuned = 0
        for pos in range(len(problems)):
            problem, problems[pos] = problems[pos], None  # freed (GPU buffers) once tuned
            heartbeat()
            problem_id = claim_problem(storage, problem_claim(job.run_id, unit.op, problem.key()), name, retry)
            if problem_id is None:  # the same problem from another row count (capped rows): tuned once
                continue
            prior = job.priors.get(unit.op, {}).get(problem_key(problem))
            if job.refresh and prior is None:  # nothing to refresh at this shape
                report({"kind": "skip", "unit": unit.index, "op": unit.op, "key": problem.key(), "worker": worker})
                continue
            report({"kind": "problem", "unit": unit.index, "op": unit.op, "phases": len(problem.phases),
                    "worker": worker})
            if job.refresh:
                entry = tuner.refresh(problem, prior)
            else:
                near = [] if prior is not None else neighbour_priors(job.priors.get(unit.op, {}), problem)
                entry = tuner.tune(problem, budget_s=share, prior=prior, neighbours=near)
            storage.set_study_user_attr(problem_id, "unit", unit.index)
            storage.set_study_user_attr(problem_id, "pos", pos)
            storage.set_study_user_attr(problem_id, "entry", entry)
            tuned += 1
            del problem
        del problems
    except TakenOver as exc:
        report({"kind": "lost", "unit": unit.index, "op": unit.op, "worker": worker, "reason": str(exc)})
        return
    finally:
        beat[0] = None
        if device is not None and getattr(device, "type", device) == "cuda":
            import torch

            torch.cuda.empty_cache()
    seconds = time.monotonic() - start
    storage.set_study_user_attr(unit_id, "seconds", seconds)
    storage.set_study_user_attr(unit_id, "done", True)
    report({"kind": "done", "unit": unit.index, "op": unit.op, "seconds": seconds, "problems": tuned,
            "worker": worker})


def run_units(job: TuneJob, storage, report: Callable[[dict], None], *, worker: int = 0, device=None) -> None:
    """The worker loop: claim each unit in order (recording this process as its owner, with a heartbeat), build
    its problems, claim and tune each problem, store the entry in the problem's claim study, report events
    (dicts with ``kind``: start, problem, trial, skip, done, and lost when another host took the unit over)."""
    tuner, beat = _unit_tuner(job, storage, report, worker)
    if job.device == "cuda":
        tuner.start_compile_workers()  # they start up while the first problems are built
    for unit in job.units:
        name = _unit_claim(job.run_id, unit)
        unit_id = claim(storage, name)
        if unit_id is None:
            continue
        _run_attempt(job, storage, tuner, beat, unit, unit_id, name, report, worker=worker, device=device)


def collect_entries(storage, run_id: str, units: Sequence[WorkUnit]) -> dict[str, list[dict[str, Any]]]:
    """Entries stored by the workers of ``run_id``, per op, in one-GPU order (unit, then problem): one per
    problem, whichever of its attempts stored it (the first in that order if two did)."""
    by_index = {u.index: u for u in units}
    prefix = f"{CLAIM_PREFIX}:{run_id}:problem:"
    found: dict[str, tuple] = {}
    for study in storage.get_all_studies():
        attrs = study.user_attrs
        if study.study_name.startswith(prefix) and "entry" in attrs and attrs.get("unit") in by_index:
            item = (attrs["unit"], attrs["pos"], retry_index(study.study_name), attrs["entry"])
            problem = base_name(study.study_name)
            if problem not in found or item[:3] < found[problem][:3]:
                found[problem] = item
    out: dict[str, list[dict[str, Any]]] = {}
    for index, _pos, _k, entry in sorted(found.values(), key=lambda f: f[:3]):
        out.setdefault(by_index[index].op, []).append(entry)
    return out


def finished_units(storage, run_id: str, units: Sequence[WorkUnit]) -> set[int]:
    """Indices of the units of ``run_id`` that an attempt (the first claim or a retry) finished."""
    names = {_unit_claim(run_id, u): u.index for u in units}
    return {names[base_name(s.study_name)] for s in storage.get_all_studies()
            if base_name(s.study_name) in names and s.user_attrs.get("done")}


class UnitWatch:
    """What a process waiting on a shared run makes of a unit it does not run itself.

    ``check(unit)`` reads the unit's attempts and returns (state, detail):

    - ("done", None): an attempt finished it;
    - ("unclaimed", claim name): nobody has claimed it yet;
    - ("mine", claim name): its latest attempt is this process's and did not finish;
    - ("abandoned", (claim name of the next attempt, why)): its latest attempt's owner is a process of this
      host (``same_host``) that is gone (or an earlier process with this process's pid), or its ``beat`` has
      not changed for ``stale_s`` seconds of ``clock`` since this watch first saw that value (the clocks of
      hosts are never compared);
    - ("running", owner): none of these.
    """

    def __init__(self, storage, run_id: str, stale_s: float, clock: Callable[[], float] = time.monotonic):
        self.storage, self.run_id, self.stale_s, self.clock = storage, run_id, stale_s, clock
        self._seen: dict[int, tuple[str, Any, float]] = {}  # unit -> (latest claim, its beat, when first seen)

    def check(self, unit: WorkUnit) -> tuple[str, Any]:
        base = _unit_claim(self.run_id, unit)
        found = attempts(self.storage, base)
        if any(attrs.get("done") for _, _, attrs in found):
            return "done", None
        if not found:
            return "unclaimed", base
        k, name, attrs = found[-1]
        owner = attrs.get("owner") if isinstance(attrs.get("owner"), Mapping) else {}
        now = self.clock()
        seen = self._seen.get(unit.index)
        if seen is None or seen[:2] != (name, attrs.get("beat")):
            seen = self._seen[unit.index] = (name, attrs.get("beat"), now)
        successor = attempt_name(base, k + 1)
        me = this_process()
        if not owner and now - seen[2] >= OWNERLESS_S:  # its claimer died before recording itself
            return "abandoned", (successor, f"it was claimed {now - seen[2]:.0f} s ago by a process that never "
                                            f"recorded itself (it stopped right after claiming)")
        if same_host(owner, me):
            if owner.get("pid") == me["pid"]:
                if owner.get("token") == me["token"]:
                    return "mine", name
                return "abandoned", (successor, f"its owner {owner_text(owner)} was an earlier process of this "
                                                f"host (this process has that pid now)")
            if not pid_alive(owner.get("pid")):
                return "abandoned", (successor, f"its owner {owner_text(owner)} is no longer running")
        idle = now - seen[2]
        if idle >= self.stale_s:
            return "abandoned", (successor, f"{owner_text(owner)} showed no progress for {idle:.0f} s "
                                            f"(stale after {self.stale_s:g} s)")
        return "running", owner


def _plan(job: TuneJob) -> dict[str, Any]:
    """What every host of a shared run must agree on, as JSON: units, model, tuner and input settings, GPU."""
    import json

    tuner = job.tuner
    if dataclasses.is_dataclass(job.model) and not isinstance(job.model, type):
        model = dataclasses.asdict(job.model)
        model.pop("name", None)  # a config.json's name comes from its folder, which may differ between hosts
    else:
        model = repr(job.model)
    plan = {"units": [[u.index, u.op, u.dtype, u.rows, u.budget_s] for u in job.units], "model": model,
            "tuner": {k: getattr(tuner, k, None) for k in ("n_trials", "polish_trials", "seed", "retime_top",
                                                           "retime_rounds", "retime_margin", "search_share",
                                                           "batch")},
            "seed": job.seed, "refresh": job.refresh, "device": job.device, "gpu": job.gpu,
            "software": _software(sorted({u.op for u in job.units}), job.specs)}
    return json.loads(json.dumps(plan, default=str))


def _software(ops: Sequence[str], specs: Mapping[str, Any]) -> dict[str, Any]:
    """The versions a table entry depends on: each op's template hash, Triton's, torch's and liger-gen's (hosts
    on other code would tune other kernels than the table written by the run says)."""
    import torch

    from liger_gen.codegen.render import template_hash

    out: dict[str, Any] = {"triton": installed_version("triton"), "torch": torch.__version__,
                           "liger-gen": installed_version("liger-gen")}
    for op in ops:
        space = getattr(specs.get(op), "space", None)
        for template in (getattr(space, "template", None), *getattr(space, "also_renders", ())):
            if template is not None:
                out[f"template {template}"] = template_hash(template)
    return out


def _tuplify(value: Any) -> Any:
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value


def _wait_for_attr(storage, name: str, key: str, *, timeout: float | None, poll: float,
                   on_wait: Callable[[], None] | None = None) -> Any:
    """The user attr ``key`` of the study ``name`` once it is set; None after ``timeout`` seconds (None: never)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said = None  # when on_wait last ran: at the first wait, then every REMIND_S
    while True:
        attrs = study_attrs(storage, name) or {}
        if key in attrs:
            return attrs[key]
        if deadline is not None and time.monotonic() >= deadline:
            return None
        if on_wait is not None and (said is None or time.monotonic() - said >= REMIND_S):
            on_wait()
            said = time.monotonic()
        time.sleep(poll)


def join_run(job: TuneJob, storage, report: Callable[[dict], None] = lambda event: None) -> TuneJob:
    """Join the shared run ``job.run_id``: the first host stores its plan (``_plan``) and every later one must
    plan the same (``SharedRunError`` says what differs); a table-writing host stores its priors unless another
    was first, a host that writes no tables waits for them (a "waiting" event says so). Returns ``job`` with the
    run's priors, so that every host starts each problem from the same configs."""
    plan = _plan(job)
    run_claim = f"{CLAIM_PREFIX}:{job.run_id}:run"
    study_id = claim(storage, run_claim)
    if study_id is not None:
        storage.set_study_user_attr(study_id, "plan", plan)
    else:
        stored = _wait_for_attr(storage, run_claim, "plan", timeout=10.0, poll=0.2)
        if stored is None:  # its creator died before storing the plan
            storage.set_study_user_attr(storage.get_study_id_from_name(run_claim), "plan", plan)
        elif stored != plan:
            differ = [k for k in plan if plan[k] != stored.get(k)]

            def short(value: Any) -> str:
                text = repr(value)
                return text if len(text) <= 200 else text[:200] + "..."

            raise SharedRunError(
                f"run {job.run_id!r} in this storage was started with other settings: "
                + "; ".join(f"{k}: the run has {short(stored.get(k))}, this host {short(plan[k])}" for k in differ)
                + ". Every host of a shared run must run the same command (only --workers/--devices, --out, "
                  "--no-write-tables and --stale-after may differ); use another --run-id for another run.")
    priors_claim = f"{CLAIM_PREFIX}:{job.run_id}:priors"
    if job.write_tables:
        study_id = claim(storage, priors_claim)
        stored = None
        if study_id is None:
            stored = _wait_for_attr(storage, priors_claim, "priors", timeout=10.0, poll=0.2)
        if stored is None:  # this host is the first table writer (or the first died before storing its priors)
            import json

            stored = json.loads(json.dumps({op: [[list(key), value] for key, value in by_key.items()]
                                            for op, by_key in job.priors.items()}))
            storage.set_study_user_attr(storage.get_study_id_from_name(priors_claim), "priors", stored)
            return job
    else:
        stored = _wait_for_attr(storage, priors_claim, "priors", timeout=None, poll=job.poll_s,
                                on_wait=lambda: report({"kind": "waiting", "for": "writer", "units": []}))
    return dataclasses.replace(job, priors={op: {_tuplify(key): value for key, value in items}
                                            for op, items in stored.items()})


def _wait_for_run(job: TuneJob, storage, report: Callable[[dict], None], note_done: Callable[[WorkUnit], None],
                  errors: list[str], done: set[int], *, worker: Any, device: Callable[[], Any]) -> None:
    """After this host's workers have tried every unit of a shared run: until every unit is done, wait for the
    units other processes run, take over abandoned ones (``UnitWatch``) and tune them in this process. A unit
    whose takeover fails here is given up (its error added to ``errors``)."""
    watch = UnitWatch(storage, job.run_id, job.stale_s)
    tuner, beat = _unit_tuner(job, storage, report, worker)
    given_up: set[int] = set()
    waiting_for: list[int] | None = None
    while True:
        pending = [u for u in job.units if u.index not in done and u.index not in given_up]
        if not pending:
            return
        took = False
        running: list[tuple[WorkUnit, Any]] = []
        for unit in pending:
            state, detail = watch.check(unit)
            if state == "done":
                note_done(unit)
            elif state == "mine":
                given_up.add(unit.index)
            elif state == "running":
                running.append((unit, detail))
            else:
                name, why = (detail, "nobody had claimed it") if state == "unclaimed" else detail
                unit_id = claim(storage, name)
                if unit_id is None:  # another waiting process was first
                    continue
                took = True
                report({"kind": "takeover", "unit": unit.index, "op": unit.op, "dtype": unit.dtype,
                        "rows": unit.rows, "claim": name, "why": why, "worker": worker})
                try:
                    _run_attempt(job, storage, tuner, beat, unit, unit_id, name, report, worker=worker,
                                 device=device())
                except Exception as exc:  # noqa: BLE001 - reported; the run waits on for the other units
                    errors.append(f"unit {unit.index} ({unit.op} {unit.dtype} rows={unit.rows}), taken over as "
                                  f"{name}: {type(exc).__name__}: {exc}")
                    given_up.add(unit.index)
        if not took:
            indices = [u.index for u, _ in running]
            if running and indices != waiting_for:
                waiting_for = indices
                report({"kind": "waiting", "for": "units", "units": indices,
                        "owners": sorted({owner_text(o) for _, o in running})})
            time.sleep(job.poll_s)


def _worker_main(worker: int, visible: str | None, job: TuneJob, events) -> None:
    """Entry point of a spawned worker: pin the GPU, open the shared storage, run the units."""
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before anything initialises CUDA in this process
    try:
        import torch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        device = torch.device(job.device, 0) if job.device == "cuda" else torch.device(job.device)
        if job.gpu is not None:
            from liger_gen.runtime.devices import current_gpu

            seen = current_gpu()
            if seen is None or seen[0] != job.gpu:
                raise RuntimeError(f"worker {worker} (CUDA_VISIBLE_DEVICES={visible}) sees {seen}, not {job.gpu}")
        run_units(job, open_storage(job.storage), events.put, worker=worker, device=device)
    except KeyboardInterrupt:
        events.put({"kind": "error", "worker": worker, "error": "interrupted"})
        raise SystemExit(130) from None
    except BaseException as exc:
        events.put({"kind": "error", "worker": worker, "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()})
        raise SystemExit(1) from None


def _local_device(job: TuneJob):
    """The device this process tunes on: the current CUDA device, or ``job.device`` (None: left to the problems)."""
    if job.device is None:
        return None
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if job.device == "cuda" else torch.device(job.device)


def tune_ops(job: TuneJob, *, devices: Sequence[Any] | None = None, on_event: Callable[[dict], None] | None = None,
             on_op_done: Callable[[str, list[dict], dict[str, float]], None] | None = None) -> TuneResult:
    """Tune every unit of ``job``; one worker process per entry of ``devices`` (each a ``CUDA_VISIBLE_DEVICES``
    value, see ``driver.cuda_visible``, or None for a worker that leaves it alone). None or one entry: in this process,
    on the current device.

    Several workers need ``job.storage`` to be a spec every process can open (a journal file path or a
    database URL); ValueError otherwise. ``on_event(event)`` sees every worker event in this process (progress);
    ``on_op_done(op, entries, seconds)`` is called once all of an op's units are finished, with its entries in
    one-GPU order. The result is the same, entry for entry, whichever worker ran which unit.

    A shared run (``job.shared``: other hosts run the same job with the same ``run_id`` and storage) first joins
    the run (``join_run``: same plan, the run's priors), then, once this host's workers have tried every unit,
    waits until every unit is done, taking over the abandoned ones in this process (``UnitWatch``; events
    "waiting" and "takeover"); ``on_op_done`` is also called for ops that other hosts finished.
    """
    if job.shared and not (job.stale_s > 0 and job.poll_s > 0):
        raise ValueError(f"stale_s and poll_s must be > 0 seconds, got {job.stale_s} and {job.poll_s}")
    units_of: dict[str, set[int]] = {}
    for unit in job.units:
        units_of.setdefault(unit.op, set()).add(unit.index)
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    busy: dict[str, float] = {}
    done: set[int] = set()
    errors: list[str] = []
    current: dict[int, int] = {}  # worker -> unit it is on
    entries: dict[str, list[dict]] = {}
    state: dict[str, Any] = {}
    began = time.monotonic()

    def op_finished(op: str) -> None:
        if op in entries or not units_of[op] <= done:
            return
        now = ended[op] = time.monotonic()
        entries[op] = collect_entries(state["storage"], job.run_id, job.units).get(op, [])
        if on_op_done is not None:
            on_op_done(op, entries[op], {"wall": now - started.get(op, began), "busy": busy.get(op, 0.0)})

    def handle(event: dict) -> None:
        kind = event["kind"]
        if kind == "start":
            started.setdefault(event["op"], time.monotonic())
            current[event["worker"]] = event["unit"]
        elif kind == "done":
            op = event["op"]
            done.add(event["unit"])
            busy[op] = busy.get(op, 0.0) + event["seconds"]
            current.pop(event["worker"], None)
            op_finished(op)
        elif kind == "lost":
            current.pop(event["worker"], None)
        elif kind == "error":
            unit = current.get(event["worker"])
            where = f" on unit {unit} ({job.units[unit].op} {job.units[unit].dtype} rows={job.units[unit].rows})" \
                if unit is not None else ""
            errors.append(f"worker {event['worker']}{where}: {event['error']}")
        if on_event is not None:
            on_event(event)

    def note_done(unit: WorkUnit) -> None:  # finished by another process
        done.add(unit.index)
        op_finished(unit.op)

    several = devices is not None and len(devices) > 1
    if not several:
        storage = open_storage(job.storage)
        state["storage"] = storage if storage is not None else optuna.storages.InMemoryStorage()
    else:
        if job.storage is None or not isinstance(job.storage, (str, os.PathLike)):
            raise ValueError("several workers need a shared storage that every process can open: a journal file "
                             f"path or a database URL, got {job.storage!r}")
        state["storage"] = open_storage(job.storage)
    if job.shared:
        job = join_run(job, state["storage"], handle)
    lead, chosen = 0, []

    def local_device():  # the device of this process's takeovers, chosen when the first one starts
        if not chosen:
            chosen.append(_local_device(job))
        return chosen[0]

    if not several:
        run_units(job, state["storage"], handle, worker=0, device=local_device())
    else:
        lead = len(devices)  # the worker number of this process's own takeovers
        tuner = copy.copy(job.tuner)
        tuner.storage, tuner.on_trial = None, None  # each worker opens the storage and reports its own trials
        job = dataclasses.replace(job, tuner=tuner)
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        events = context.Queue()
        procs = [context.Process(target=_worker_main, args=(w, dev, job, events), name=f"liger-gen-tune-{w}")
                 for w, dev in enumerate(devices)]
        for p in procs:
            p.start()
        try:
            while True:
                try:
                    handle(events.get(timeout=0.2))
                except queue_module.Empty:
                    if not any(p.is_alive() for p in procs):
                        break
            while True:  # what the last workers sent just before exiting
                try:
                    handle(events.get(timeout=0.5))
                except queue_module.Empty:
                    break
        except BaseException:
            for p in procs:
                p.join(timeout=5)  # an interrupt reaches the workers too: let them close their trials
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join()
            raise
        for p in procs:
            p.join()
            if p.exitcode and not any(e.startswith(f"worker {procs.index(p)}") for e in errors):
                errors.append(f"worker {procs.index(p)} exited with code {p.exitcode}")
    if job.shared:
        _wait_for_run(job, state["storage"], handle, note_done, errors, done, worker=lead, device=local_device)
    all_done = done | finished_units(state["storage"], job.run_id, job.units)  # a unit can end between the
    unfinished = [u for u in job.units if u.index not in all_done]            # last event read and the exit
    for op, indices in units_of.items():
        if op not in entries and indices <= all_done:
            entries[op] = collect_entries(state["storage"], job.run_id, job.units).get(op, [])
            if on_op_done is not None:
                now = time.monotonic()
                on_op_done(op, entries[op], {"wall": now - started.get(op, now), "busy": busy.get(op, 0.0)})
    seconds = {op: {"wall": ended.get(op, time.monotonic()) - started[op], "busy": busy.get(op, 0.0)}
               for op in started}
    return TuneResult(entries=entries, seconds=seconds, unfinished=unfinished, errors=errors, run_id=job.run_id)
