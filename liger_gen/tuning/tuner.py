"""Optuna search over an op's space, one study per (op, phase, dtype, dims, variant, rows bucket); work spread
over several GPUs through one shared Optuna storage.

For each phase (forward and backward kernels are tuned separately):
  1. the analytic heuristic is enqueued first, then the config an earlier tuning chose for the same problem (a
     ``prior``: ``prior_configs`` reads it from the tables being replaced, of any template version), so both
     are always measured;
  2. TPE samples the space, ``batch`` points at a time from the same finished history (each from its own
     seed); a sample that violates a constraint is pruned before anything compiles. With compile workers
     (``compile_pool``), a batch's variants compile on the CPU while the GPU measures the batch's first ones;
  3. each sample is built, checked against the float64 reference on the device (a wrong variant is pruned,
     never kept), then timed (``timing.gpu_timer``: CUDA-graph replay, L2 flushed); compile, launch and timing
     errors prune the trial;
  4. a local polish moves the best point one param at a time to a neighbouring choice while that is faster;
  5. the best few and the heuristic are re-timed in alternation (round by round, in a rotating order), and the
     winner must beat the heuristic's re-timed median by ``retime_margin`` or the heuristic is kept — so a tuned
     entry is never slower than the default.
Every trial's params, status, time and timing method are kept in the table entry, with the re-timing rounds.

Reproducible and resumable: the sampler is re-seeded before every trial from (seed, number of finished
trials, and its place in the batch), so a study's sequence of points depends only on its stored history and
the batch size, not on the compile workers. With ``storage`` (an Optuna
storage) a study interrupted anywhere — Ctrl-C, a killed worker — resumes where it stopped and ends at the
entry an uninterrupted run gives (with a deterministic timer; on a GPU up to timing noise).

Time cap: ``tune(problem, budget_s=...)`` splits the budget evenly over the phases; in each, the search stops
once the next trial would end past ``search_share`` of the phase's share, the polish once it would end past the
share; re-timing always runs. A cut is recorded in the entry (``search``).

Several GPUs (``tune_ops`` with ``devices``): one worker process per GPU, all on one Optuna storage. The unit
of work is one op at one dtype and token count (``WorkUnit``); a worker claims a unit, and then each problem it
gives, by creating a claim study whose name is unique per run — the storage lets exactly one creation succeed —
so every study is run start to finish by one worker with the same seeded sequence as on one GPU. Workers store
their entries in the claim study's user attrs; the lead reads them back in unit order and writes the same tables
a one-GPU run writes. A worker that dies leaves its studies in the storage: the same command with the same
``--storage`` resumes them.

Several hosts (``TuneJob.shared``, ``liger-gen tune --run-id``): tuner processes on several machines, each with its
own workers, share one database storage (PostgreSQL; SQLite stays the storage of one machine, and a journal file
serves hosts that mount one disk with working file locks). The claims are named by the run id every host is given, so each unit is still tuned once, and:

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
- only a process with ``write_tables`` writes the tables (``report.run_tuning``); the others only tune.

Re-running a host's command with the same run id resumes it: its own dead attempts (this host, pid gone) are
taken over at once.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import multiprocessing
import os
import queue as queue_module
import re
import socket
import stat
import statistics
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

try:
    import optuna
    from optuna.study import StudyDirection
    from optuna.trial import TrialState
except ImportError:  # a training-only install: ``Tuner`` and ``liger-gen tune`` say what to install
    optuna = StudyDirection = TrialState = None

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.render import template_hash
from liger_gen.codegen.spaces import dtype_from_name, dtype_name
from liger_gen.codegen.spec import OpSpec
from liger_gen.runtime.ops import interpreter_enabled
from liger_gen.tuning.timing import Timer, events_timer, gpu_timer, timing_method

Builder = Callable[[str, Mapping[str, Any]], Any]
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED) if TrialState is not None else ()


class _TrialFailed(Exception):
    pass


def _key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


class Tuner:
    """Tunes one op for given problems and returns table entries.

    ``n_trials`` counts measured variants (built, checked, and timed or rejected); constraint violations
    and repeats of an earlier point are not counted, up to ``MAX_TRIALS_FACTOR × n_trials`` Optuna trials.

    Args:
        n_trials: measured variants per phase and shape (the heuristic counts as one).
        timer: ``timer(launch, params) -> ms``; ``gpu_timer`` by default.
        build: ``build(op, params) -> module``; ``load_variant`` by default (tests inject failures here).
        storage: Optuna storage URL or object; None keeps studies in memory.
        seed: TPE seed.
        retime_top: how many of the best trials are re-timed against the heuristic.
        retime_rounds: rounds of alternating re-timing (each candidate timed once per round).
        retime_margin: fraction by which the best candidate's re-timed median must be below the heuristic's to
            replace it (0.01: 1% faster); within the margin the heuristic is kept.
        polish_trials: variants measured by the local polish after the search (one param moved at a time to its
            neighbouring choice, from the best point, while that improves); None: a quarter of ``n_trials``.
        search_share: part of a phase's time budget given to the search; the polish may use the rest.
        fallback_timer: timer that re-times every candidate when ``timer`` measured them by different methods
            (a CUDA graph for some, events for others); ``events_timer`` when ``timer`` is the default.
        on_trial: called after every finished trial (progress bars).
        clock: seconds, monotonic (``time.monotonic``; tests pass a fake clock).
        batch: points TPE proposes at once from the same history (each from its own seed), measured one after
            the other; part of the search's definition (the same seed and batch give the same search), and what
            lets ``compile_pool`` compile a whole batch in parallel. 1 (the default): one point at a time.
        compile_workers: compile processes (``liger_gen.tuning.compile_pool.CompilePool``, started at the first
            variant on a CUDA device) that compile each batch's variants, and the polish's next moves, on the
            host's CPU cores while the GPU times; 0: every variant compiles at its first launch. Workers change
            when compiles happen, never which variants are measured.
        compile_pool: a pool object to use instead (``submit(problem, config, phase)``, ``wait(...)``; tests).
    """

    MEASURED = ("ok", "wrong", "error")
    MAX_TRIALS_FACTOR = 4

    def __init__(self, *, n_trials: int = 24, timer: Timer | None = None, build: Builder | None = None,
                 storage: Any = None, seed: int = 0, retime_top: int = 3, retime_rounds: int = 3,
                 retime_margin: float = 0.01, polish_trials: int | None = None, search_share: float = 0.8,
                 fallback_timer: Timer | None = None, on_trial: Callable[[], None] | None = None,
                 clock: Callable[[], float] | None = None, batch: int = 1, compile_workers: int = 0,
                 compile_pool: Any = None):
        from liger_gen.optional import require

        require("optuna", "liger-gen's tuner")
        if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
            raise ValueError(f"n_trials must be an int >= 1, got {n_trials!r}")
        if retime_rounds < 1 or retime_top < 0:
            raise ValueError(f"retime_rounds must be >= 1 and retime_top >= 0, got {retime_rounds}, {retime_top}")
        if not 0 <= retime_margin < 1:
            raise ValueError(f"retime_margin must be in [0, 1), got {retime_margin}")
        if not 0 < search_share <= 1:
            raise ValueError(f"search_share must be in (0, 1], got {search_share}")
        if polish_trials is not None and polish_trials < 0:
            raise ValueError(f"polish_trials must be >= 0, got {polish_trials}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        if isinstance(compile_workers, bool) or not isinstance(compile_workers, int) or compile_workers < 0:
            raise ValueError(f"compile_workers must be an int >= 0, got {compile_workers!r}")
        self.batch = batch
        self.compile_workers = compile_workers
        self.compile_pool = compile_pool
        self.n_trials = n_trials
        self.timer = timer or gpu_timer
        self.fallback_timer = fallback_timer if fallback_timer is not None else (
            events_timer if self.timer is gpu_timer else None)
        self.build = build or load_variant
        self.storage = storage
        self.seed = seed
        self.retime_top = retime_top
        self.retime_rounds = retime_rounds
        self.retime_margin = retime_margin
        self.polish_trials = max(0, n_trials // 4) if polish_trials is None else polish_trials
        self.search_share = search_share
        self.on_trial = on_trial
        self.clock = clock or time.monotonic

    def study_name(self, problem, phase: str) -> str:
        """Unique per op, phase, dtype, shape, variant options, template text (so edits start fresh) and batch
        size (a search of other batches is another search; one point at a time keeps the plain name)."""
        name = f"{problem.op}:{phase}:{problem.key()}:{template_hash(problem.template)}"
        return name if self.batch == 1 else f"{name}:batch{self.batch}"

    def _sampler(self, n_finished: int, slot: int = 0) -> optuna.samplers.BaseSampler:
        """TPE seeded from (seed, trials finished so far, place in the batch): a batch's points depend only on the
        finished history.

        No constant liar (Optuna 5's default): the points of a batch are drawn from the finished history alone
        (the batch's own points are still running), and a trial left RUNNING by a killed worker must not steer
        the resumed search."""
        return optuna.samplers.TPESampler(seed=(self.seed * 1_000_003 + n_finished + 7_919 * slot) % 2**32,
                                          n_startup_trials=max(1, min(8, self.n_trials // 3)), constant_liar=False)

    def _pool(self, problem) -> Any:
        """The compile pool for ``problem``'s variants, or None (no pool, or a problem that runs no compiled
        kernels: on the CPU, or under Triton's interpreter). Tuners of one process share its pool."""
        if self.compile_pool is not None:
            return self.compile_pool
        if not self.compile_workers or getattr(problem, "device", None) is None or problem.device.type != "cuda" \
                or interpreter_enabled():
            return None
        from liger_gen.tuning.compile_pool import shared_pool

        return shared_pool(self.compile_workers)

    def start_compile_workers(self) -> None:
        """Start this process's compile workers now (if the tuner has any), so that their start-up (importing
        Triton and liger-gen) overlaps other work instead of delaying the first batch."""
        if self.compile_pool is None and self.compile_workers and not interpreter_enabled():
            from liger_gen.tuning.compile_pool import shared_pool

            shared_pool(self.compile_workers).start()

    def pool_stats(self) -> dict[str, Any] | None:
        """What this process's compile workers did so far (``PoolStats.to_dict``), or None without a pool."""
        if self.compile_pool is not None:
            stats = getattr(self.compile_pool, "stats", None)
            return stats.to_dict() if hasattr(stats, "to_dict") else None
        if not self.compile_workers:
            return None
        from liger_gen.tuning.compile_pool import started_pool

        pool = started_pool(self.compile_workers)
        return None if pool is None else pool.stats.to_dict()

    def _precompile(self, problem, phase: str, configs: Iterable) -> None:
        """Hand ``configs`` (valid, not yet measured) to the compile pool, if there is one for ``problem``."""
        pool = self._pool(problem)
        if pool is not None:
            for config in configs:
                pool.submit(problem, config, phase)

    def _requeue_stale(self, study: optuna.Study) -> None:
        """Prepare a study for a (resumed) run; what a killed or interrupted run left running or queued is closed,
        and queued again only where the search would not ask for it by itself:

        - a point queued by hand or by an older version, without a batch mark: closed (it would run ahead of
          the search);
        - a point of a batch some of whose points were measured: queued again, in order, with its marks, so the
          batch ends as in an uninterrupted run;
        - a point of a batch none of whose points was measured, or a polish move: closed. The resumed run
          proposes the same points again (the same finished history and seeds), and the polish the same move.

        Copies are queued before the originals are closed, each naming its original (``retry_of``), so an
        interrupt in here loses nothing and queues nothing twice."""
        trials = study.get_trials(deepcopy=False)
        stale = sorted((t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)),
                       key=lambda t: t.number)
        if not stale:
            return
        measured_batches = {t.user_attrs.get("batch") for t in trials if t.state in FINISHED}
        copied = {t.user_attrs.get("retry_of") for t in trials}
        for t in stale:
            b = t.user_attrs.get("batch")
            if b is not None and b >= 0 and not t.user_attrs.get("polish") and b in measured_batches \
                    and t.number not in copied:
                study.enqueue_trial(_params_of(t), user_attrs={"batch": b, "retry_of": t.number})
        for t in stale:
            if t.state == TrialState.WAITING:
                study.tell(study.ask(), state=TrialState.FAIL)  # ask() takes the oldest queued point: this one
            else:
                study.tell(t.number, state=TrialState.FAIL)

    def _ask_batch(self, study: optuna.Study, space, phase: str, heuristic, k: int) -> list:
        """The next batch of (trial, config): the queued points if any (all of them), else ``k`` points TPE
        proposes from the finished history, the i-th from the sampler seeded with (seed, finished, i)."""
        queued = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        n_finished = len(study.get_trials(deepcopy=False, states=FINISHED))
        batch = []
        for slot in range(queued or k):
            study.sampler = self._sampler(n_finished, slot)
            trial = study.ask()
            config = space.suggest(trial, phase, heuristic)
            if "batch" not in trial.user_attrs:
                trial.set_user_attr("batch", n_finished)
            batch.append((trial, config))
        return batch

    def _measure(self, study: optuna.Study, trial, objective, progress) -> None:
        """Run ``objective`` on an asked trial and tell the study (pruned when the objective prunes). Anything
        else raised leaves the trial running, as a killed process does; the next run queues it again."""
        try:
            value = objective(trial)
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, value)
        progress(study, trial)

    def _out_of_time(self, deadline: float | None, durations: list[float]) -> bool:
        """True when the next trial, as long as the median of the last few, would end past ``deadline``."""
        if deadline is None:
            return False
        expected = statistics.median(durations[-5:]) if durations else 0.0
        return self.clock() + expected > deadline

    def _evaluate(self, problem, config, phase: str) -> float:
        """Build, check and time one variant; _TrialFailed with the status and reason if it cannot be kept."""
        problems = problem.space.violations(config)
        if problems:
            raise _TrialFailed("invalid", "; ".join(problems))
        params = problem.template_params(config)
        pool = self._pool(problem)
        if pool is not None:
            pool.wait(problem, config, phase)
        try:
            module = self.build(problem.template, params)
            error = problem.check(module, phase)
            ms = None if error is not None else self.timer(problem.launcher(module, phase), params)
        except Exception as exc:  # compile, resource, launch and timing errors: prune, keep tuning
            raise _TrialFailed("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if error is not None:
            raise _TrialFailed("wrong", error)
        if not (math.isfinite(ms) and ms >= 0):
            raise _TrialFailed("error", f"timer returned {ms!r} ms")
        return ms

    def _tune_phase(self, problem, phase: str, heuristic, budget_s: float | None = None, prior=None):
        """Search, polish and record one phase; returns (study, trial records, search summary). ``prior``: a
        config measured right after the heuristic (an earlier winner), or None."""
        space = problem.space
        study = optuna.create_study(study_name=self.study_name(problem, phase), storage=self.storage,
                                    direction="minimize", load_if_exists=True, sampler=self._sampler(0))
        self._requeue_stale(study)

        def finished():
            return study.get_trials(deepcopy=False, states=FINISHED)

        heuristic_key = _key(space.phase_params(heuristic, phase))
        done = {_key(_params_of(t)) for t in study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.WAITING))}
        for start in (heuristic, prior):
            if start is not None and _key(space.phase_params(start, phase)) not in done:
                study.enqueue_trial(space.phase_params(start, phase), user_attrs={"batch": 0})
                done.add(_key(space.phase_params(start, phase)))

        # TPE re-proposes points of small categorical spaces; a repeat reuses the recorded outcome instead of
        # re-measuring, and does not count against the budget of ``n_trials`` measured variants.
        outcomes: dict[tuple, tuple[str, Any]] = {}
        for t in finished():
            if t.user_attrs.get("status") not in (None, "duplicate"):
                outcomes[_key(t.params)] = (t.user_attrs["status"], t.value)
        durations: list[float] = []  # seconds per measured variant, for the time budget

        def objective(trial: optuna.Trial) -> float:
            config = space.suggest(trial, phase, heuristic)
            key = _key(trial.params)
            if key in outcomes:
                status, value = outcomes[key]
                trial.set_user_attr("status", "duplicate")
                if status == "ok":
                    return value
                raise optuna.TrialPruned(f"repeat of a {status} variant")
            start = self.clock()
            try:
                ms = self._evaluate(problem, config, phase)
            except _TrialFailed as failed:
                status, reason = failed.args
                outcomes[key] = (status, None)
                trial.set_user_attr("status", status)
                trial.set_user_attr("reason", reason)
                raise optuna.TrialPruned(reason) from None
            finally:
                durations.append(self.clock() - start)
            outcomes[key] = ("ok", float(ms))
            trial.set_user_attr("status", "ok")
            trial.set_user_attr("method", timing_method(ms))
            if getattr(ms, "note", ""):
                trial.set_user_attr("timing_note", ms.note)
            return float(ms)

        def measured() -> int:
            return sum(1 for status, _ in outcomes.values() if status in self.MEASURED)

        def progress(_study, trial) -> None:
            if self.on_trial and trial.user_attrs.get("status") in self.MEASURED:
                self.on_trial()

        start = self.clock()
        search_end = None if budget_s is None else start + self.search_share * budget_s
        polish_end = None if budget_s is None else start + budget_s
        max_trials = self.MAX_TRIALS_FACTOR * self.n_trials
        already, cut = measured(), None
        while cut is None and measured() < self.n_trials and len(finished()) < max_trials:
            if heuristic_key in outcomes and self._out_of_time(search_end, durations):
                cut = "search"
                break
            before = len(finished())
            k = max(1, min(self.batch, self.n_trials - measured(), max_trials - len(finished())))
            batch = self._ask_batch(study, space, phase, heuristic, k)
            self._precompile(problem, phase, [c for t, c in batch
                                              if _key(t.params) not in outcomes and not space.violations(c)])
            for i, (trial, _config) in enumerate(batch):
                if i and heuristic_key in outcomes and self._out_of_time(search_end, durations):
                    for rest, _ in batch[i:]:  # the rest of the batch is dropped, not measured
                        study.tell(rest, state=TrialState.FAIL)
                    cut = "search"
                    break
                self._measure(study, trial, objective, progress)
            if len(finished()) == before:  # no trial completed or was pruned: do not spin
                break
        for _ in range(max(0, self.n_trials - (measured() - already)) if self.on_trial else 0):
            self.on_trial()  # budget not reached (space exhausted, time cut or resumed): keep the bar's total honest
        polished, polish_cut = self._polish(study, space, phase, objective, outcomes, progress, polish_end,
                                            durations, problem=problem, heuristic=heuristic)
        for _ in range(max(0, self.polish_trials - polished) if self.on_trial else 0):  # as above
            self.on_trial()
        records = []
        for number, t in enumerate(finished()):  # numbered in order, interrupted (failed) trials left out
            record = {"number": number, "params": t.params,
                      "status": t.user_attrs.get("status", t.state.name.lower()), "ms": t.value}
            for attr in ("reason", "method", "timing_note"):
                if attr in t.user_attrs:
                    record[attr] = t.user_attrs[attr]
            if t.user_attrs.get("polish"):
                record["polish"] = True
            records.append(record)
        summary = {
            "trials": sum(1 for r in records if r["status"] in self.MEASURED and not r.get("polish")),
            "polish_trials": sum(1 for r in records if r["status"] in self.MEASURED and r.get("polish")),
            "budget_s": None if budget_s is None else round(budget_s, 3),
            "cut": cut or polish_cut,
        }
        return study, records, summary

    def _polish(self, study, space, phase: str, objective, outcomes: dict, progress, deadline: float | None = None,
                durations: list[float] | None = None, problem=None, heuristic=None) -> tuple[int, str | None]:
        """Local search around the best point: move one param at a time to its neighbouring choice (half or
        double for the power-of-two params), keep a move that is faster, repeat from the new best. Returns the
        number of variants measured (at most ``polish_trials``) and "polish" if ``deadline`` stopped it; every
        move is an ordinary, recorded trial. The next ``batch`` moves are handed to the compile pool ahead."""
        durations = durations if durations is not None else []
        # a resumed study has already spent part of the budget
        measured = sum(1 for t in study.get_trials(deepcopy=False, states=FINISHED)
                       if t.user_attrs.get("polish") and t.user_attrs.get("status") in self.MEASURED)
        already = measured

        def measure_next() -> Any:
            trial = study.ask()
            self._measure(study, trial, objective, progress)
            return trial

        for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):  # moves a killed run queued
            if measure_next().user_attrs.get("status") in self.MEASURED:
                measured += 1
        for _ in range(self.MAX_TRIALS_FACTOR * max(1, self.polish_trials)):  # bounds moves that measure nothing
            # the fastest point, ties to the one measured first (``outcomes`` is in measurement order, also when
            # rebuilt from the storage), so a resumed polish walks from the point an uninterrupted one does
            ok = [(v, i, k) for i, (k, (st, v)) in enumerate(outcomes.items()) if st == "ok" and v is not None]
            if not ok or measured >= self.polish_trials:
                break
            best_ms, _, best_key = min(ok)
            # a move that switches a param on which others depend takes those from the heuristic (and drops the
            # ones that no longer apply), so every move is a whole point, known before it is measured
            moves = []
            for m in _neighbours(space.params(phase), dict(best_key)):
                if heuristic is not None:
                    m = space.phase_params(dataclasses.replace(heuristic, **m), phase)
                if _key(m) not in outcomes and m not in moves:
                    moves.append(m)
            if not moves:
                break
            improved = False
            for j, move in enumerate(moves):
                if measured >= self.polish_trials:
                    break
                if self._out_of_time(deadline, durations):
                    return measured - already, "polish"
                if problem is not None and heuristic is not None:  # this move and the next ones, compiled ahead
                    ahead = [dataclasses.replace(heuristic, **m) for m in moves[j:j + self.batch]]
                    self._precompile(problem, phase, [c for c in ahead if not space.violations(c)])
                study.enqueue_trial(move, user_attrs={"polish": True, "batch": -1})
                trial = measure_next()
                status, ms = outcomes.get(_key(trial.params), (None, None))
                if trial.user_attrs.get("status") in self.MEASURED:
                    measured += 1
                if status == "ok" and ms < best_ms:
                    improved = True
                    break
            if not improved:
                break
        return measured - already, None

    def _retime(self, problem, phase: str, configs: list, timer: Timer | None = None):
        """Time every config once per round for ``retime_rounds`` rounds, in a rotating order, so drift and
        clock changes hit every config alike. Returns (medians, per-round times, set of timing methods)."""
        timer = timer or self.timer
        modules = [self.build(problem.template, problem.template_params(c)) for c in configs]
        times: list[list[float]] = [[] for _ in configs]
        methods: set[str] = set()
        for r in range(self.retime_rounds):
            order = list(range(len(configs)))
            order = order[r % len(order):] + order[: r % len(order)]
            for i in order:
                try:  # as in the search: a config that cannot be timed (or times to nonsense) cannot win
                    ms = timer(problem.launcher(modules[i], phase), problem.template_params(configs[i]))
                    methods.add(timing_method(ms))
                    value = float(ms)
                except Exception:  # noqa: BLE001 - any launch/timer failure disqualifies this config
                    value = math.inf
                times[i].append(value if math.isfinite(value) and value >= 0 else math.inf)
        medians = [statistics.median(t) for t in times]
        if not any(math.isfinite(m) for m in medians):
            raise RuntimeError(f"{problem.op} {phase}: no candidate (the heuristic included) could be re-timed")
        return medians, times, methods

    @staticmethod
    def _valid_config(space, config: Mapping[str, Any] | None):
        """``config`` (a dict) as a config of ``space``, or None when it is not one or violates a constraint."""
        if config is None:
            return None
        try:
            config = space.config_cls.from_dict(config)
        except (TypeError, ValueError):
            return None
        return None if space.violations(config) else config

    def refresh(self, problem, old: Mapping[str, Any]) -> dict[str, Any]:
        """Re-time an existing entry's finalists under the running Triton and return the new entry: per phase,
        the heuristic, the configs the old entry re-timed (its best few) and its winner, each re-checked
        against the constraints and the float64 gate, re-timed in alternation like ``tune``'s finalists, and the
        fastest kept if it beats the heuristic by the margin. No search: a small fraction of a tune's cost."""
        space = problem.space
        heuristic = space.heuristic()
        best = heuristic
        try:
            old_config = space.config_cls.from_dict(old["config"])
        except (KeyError, TypeError, ValueError):
            old_config = heuristic
        nearest = old.get("nearest") if isinstance(old.get("nearest"), Mapping) else None
        near = self._valid_config(space, nearest.get("config")) if nearest is not None else None
        timing: dict[str, dict[str, float]] = {}
        methods: dict[str, str] = {}
        retimes: dict[str, list] = {}
        searches: dict[str, dict] = {}
        for phase in problem.phases:
            params = [r.get("params") for r in old.get("retime", {}).get(phase, [])]
            params.append(space.phase_params(old_config, phase))
            if near is not None:  # the nearest-dims evidence is re-timed too
                params.append(space.phase_params(near, phase))
            candidates, seen, dropped = [heuristic], {_key(space.phase_params(heuristic, phase))}, 0
            for p in params:
                if not isinstance(p, Mapping) or _key(p) in seen:
                    continue
                seen.add(_key(p))
                try:
                    config = dataclasses.replace(heuristic, **p)
                    self._evaluate(problem, config, phase)  # constraints, build, float64 gate (and one timing)
                except (TypeError, _TrialFailed):
                    dropped += 1
                    continue
                candidates.append(config)
            medians, rounds, used = self._retime(problem, phase, candidates)
            method = used.pop() if len(used) == 1 else "mixed"
            fastest = min(range(len(candidates)), key=lambda i: (medians[i], i))
            winner = fastest if medians[fastest] < medians[0] * (1 - self.retime_margin) else 0
            best = dataclasses.replace(best, **space.phase_params(candidates[winner], phase))
            timing[phase] = {"tuned": medians[winner], "heuristic": medians[0] if math.isfinite(medians[0]) else None}
            keys = [_key(space.phase_params(c, phase)) for c in candidates]
            if near is not None and _key(space.phase_params(near, phase)) in keys:
                at = medians[keys.index(_key(space.phase_params(near, phase)))]
                timing[phase]["nearest"] = at if math.isfinite(at) else None
            methods[phase] = method
            retimes[phase] = [{"params": space.phase_params(c, phase), "ms": rounds[i], "median": medians[i]}
                              for i, c in enumerate(candidates)]
            searches[phase] = {"refresh": True, "finalists": len(candidates), "dropped": dropped, "cut": None}
        return {
            "dtype": dtype_name(problem.dtype), "dims": dict(problem.dims), "rows": problem.rows,
            "variant": dict(problem.variant), "config": best.to_dict(), "heuristic": heuristic.to_dict(),
            **({"nearest": {**nearest, "config": near.to_dict()}} if near is not None else {}),
            "timing_ms": timing, "timing_method": methods,
            "bytes": {phase: problem.bytes_moved(phase) for phase in problem.phases},
            "search": searches, "retime": retimes, "trials": old.get("trials", {}),
        }

    def tune(self, problem, budget_s: float | None = None, prior: Mapping[str, Any] | None = None,
             neighbours: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """Tune every phase of ``problem``; returns a table entry (see ``liger_gen.runtime.tables``).

        ``budget_s``: seconds of search and polish for the whole problem, split evenly over its phases (None:
        no cap; the re-timing is not counted). ``prior``: the config an earlier tuning chose for this problem
        (a table entry's ``config``), measured right after the heuristic; ignored unless it is a valid config of
        the problem's space (a table from an older template may hold one that no longer is). ``neighbours``:
        entries tuned at other dims (``dims``, ``rows``, ``config``), nearest first (``neighbour_priors``); the
        first valid one here is measured right after the heuristic when there is no prior, and re-timed beside
        it, and the entry records it (``nearest``) and its time (``timing_ms[phase]["nearest"]``): the evidence
        for the runtime's nearest-dims rule (``tables.nearest_allowed``)."""
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s must be > 0 seconds or None, got {budget_s}")
        space = problem.space
        heuristic = space.heuristic()
        best = heuristic
        share = None if budget_s is None else budget_s / len(problem.phases)
        prior = self._valid_config(space, prior)
        near = nearest = None
        for candidate in neighbours:
            near = self._valid_config(space, candidate.get("config"))
            if near is not None:
                nearest = {"dims": dict(candidate["dims"]), "rows": candidate["rows"], "config": near.to_dict()}
                break
        timing: dict[str, dict[str, float]] = {}
        methods: dict[str, str] = {}
        trials: dict[str, list] = {}
        retimes: dict[str, list] = {}
        searches: dict[str, dict] = {}
        for phase in problem.phases:
            study, records, searches[phase] = self._tune_phase(problem, phase, heuristic, share,
                                                               prior if prior is not None else near)
            trials[phase] = records
            ok = sorted((r for r in records if r["status"] == "ok" and r["ms"] is not None),
                        key=lambda r: (r["ms"], r["number"]))
            candidates, seen = [heuristic], [_key(space.phase_params(heuristic, phase))]
            if near is not None and _key(space.phase_params(near, phase)) not in seen:
                candidates.append(near)
                seen.append(_key(space.phase_params(near, phase)))
            top = len(candidates) + self.retime_top
            for r in ok:
                if _key(r["params"]) not in seen and len(candidates) < top:
                    seen.append(_key(r["params"]))
                    candidates.append(dataclasses.replace(heuristic, **r["params"]))
            medians, rounds, used = self._retime(problem, phase, candidates)
            method = used.pop() if len(used) == 1 else "mixed"
            if method == "mixed" and self.fallback_timer is not None:  # compare like with like
                medians, rounds, used = self._retime(problem, phase, candidates, self.fallback_timer)
                method = used.pop() if len(used) == 1 else "mixed"
            fastest = min(range(len(candidates)), key=lambda i: (medians[i], i))
            winner = fastest if medians[fastest] < medians[0] * (1 - self.retime_margin) else 0
            best = dataclasses.replace(best, **space.phase_params(candidates[winner], phase))
            timing[phase] = {"tuned": medians[winner],  # finite: a config that could not be re-timed never wins
                             "heuristic": medians[0] if math.isfinite(medians[0]) else None}
            if near is not None:
                at = medians[seen.index(_key(space.phase_params(near, phase)))]
                timing[phase]["nearest"] = at if math.isfinite(at) else None
            methods[phase] = method
            retimes[phase] = [{"params": space.phase_params(c, phase), "ms": rounds[i], "median": medians[i]}
                              for i, c in enumerate(candidates)]
        return {
            "dtype": dtype_name(problem.dtype),
            "dims": dict(problem.dims),
            "rows": problem.rows,
            "variant": dict(problem.variant),
            "config": best.to_dict(),
            "heuristic": heuristic.to_dict(),
            **({"nearest": nearest} if nearest is not None else {}),
            "timing_ms": timing,
            "timing_method": methods,
            "bytes": {phase: problem.bytes_moved(phase) for phase in problem.phases},
            "search": searches,
            "retime": retimes,
            "trials": trials,
        }


def _params_of(trial) -> dict[str, Any]:
    """A trial's params; for a queued trial (not started, so no params yet), the params it was queued with."""
    return dict(trial.params or trial.system_attrs.get("fixed_params", {}))


def _neighbours(params: tuple, point: dict[str, Any]) -> list[dict[str, Any]]:
    """Points one step from ``point``: each param moved to the previous or next of its choices."""
    out = []
    for param in params:
        if param.name not in point or point[param.name] not in param.choices:
            continue
        i = param.choices.index(point[param.name])
        for j in (i - 1, i + 1):
            if 0 <= j < len(param.choices):
                out.append({**point, param.name: param.choices[j]})
    return out


def problem_key(problem) -> tuple:
    """The table key of the entry ``problem`` gives (``tables.entry_sort_key`` of it)."""
    from liger_gen.runtime.tables import entry_sort_key

    return entry_sort_key({"dtype": dtype_name(problem.dtype), "dims": dict(problem.dims), "rows": problem.rows,
                           "variant": dict(problem.variant)})


def prior_entries(specs: Iterable[OpSpec], roots: Iterable[Any], gpu: str, *,
                  trials: bool = True) -> dict[str, dict[tuple, dict]]:
    """op → entry key → the whole entry of the tables for ``gpu`` found under ``roots`` (the first root holding
    an entry wins), whatever template or Triton version they were tuned with; with ``trials``, with their
    trial-log fields (what ``Tuner.refresh`` re-times). Unreadable tables are skipped."""
    from liger_gen.runtime import tables

    roots = list(roots)
    out: dict[str, dict[tuple, dict]] = {}
    for spec in specs:
        found: dict[tuple, dict] = {}
        for root in roots:
            path = tables.table_path(root, gpu, spec.name)
            try:
                table = tables.load_table(path, spec.space)
            except tables.TableError:
                continue
            if table["op"] != spec.name:
                continue
            for entry in (tables.with_trials(path, table) if trials else table)["entries"]:
                found.setdefault(tables.entry_sort_key(entry), entry)
        out[spec.name] = found
    return out


def prior_configs(specs: Iterable[OpSpec], roots: Iterable[Any], gpu: str) -> dict[str, dict[tuple, dict]]:
    """op → entry key → config of ``prior_entries`` (no trial logs read): a re-tune starts from what won before,
    and every prior is re-validated and re-measured like any other trial."""
    return {op: {key: entry["config"] for key, entry in found.items()}
            for op, found in prior_entries(specs, roots, gpu, trials=False).items()}


def neighbour_priors(priors: Mapping[tuple, Mapping[str, Any]], problem) -> list[dict[str, Any]]:
    """The priors of one op (entry key → config, ``prior_configs``) tuned at other dims than ``problem``'s, nearest
    first (``tables.neighbour_entries``), as ``{"dims", "rows", "config"}``: what ``Tuner.tune`` times beside the
    heuristic at a shape no table has."""
    from liger_gen.runtime import tables

    entries = [{"dtype": key[0], "dims": dict(key[1]), "variant": dict(key[2]), "rows": key[3], "config": config}
               for key, config in priors.items()]
    return [{k: e[k] for k in ("dims", "rows", "config")}
            for e in tables.neighbour_entries(entries, problem.dtype, dict(problem.dims), problem.rows,
                                              dict(problem.variant))]


def merge_entries(table: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``table`` with ``entries`` added, replacing any entry of the same (dtype, dims, variant, rows)."""
    from liger_gen.runtime.tables import entry_sort_key as key
    fresh = {key(e) for e in entries}
    return {**table, "entries": [e for e in table["entries"] if key(e) not in fresh] + list(entries)}


def write_entries(space, entries: list[dict[str, Any]], out_root, *, gpu: str, device_name: str,
                  compute_capability: str) -> Path:
    """Merge ``entries`` into ``<out_root>/<gpu>/<op>.json`` for ``space``'s op (an op spec's ``space``; atomic
    write, trial logs to ``<op>.trials.json``), re-read it; returns the path.

    An existing table is kept and extended only if it belongs to this GPU, the current templates and Triton
    version; otherwise it is replaced. The read, merge and write happen under the table's lock (``tables.locked``), so
    tuners writing the same table at once keep each other's entries.
    """
    from liger_gen.runtime import tables

    path = tables.table_path(out_root, gpu, space.op)
    table = tables.new_table(space, gpu, device_name, compute_capability)
    with tables.locked(path):
        try:
            old = tables.load_table(path, space)
            if not tables.foreign_reasons(old, space=space, gpu=gpu, strict=True):
                table["entries"] = tables.with_trials(path, old)["entries"]
        except tables.TableError:  # missing, corrupt or foreign: replaced
            pass
        tables.write_table(path, merge_entries(table, entries))
        tables.load_table(path)  # re-read: what was written must parse
    tables.clear_caches()
    return path


def tune_to_table(space, problems: Iterable, out_root, *, gpu: str, device_name: str, compute_capability: str,
                  tuner: Tuner) -> tuple[Any, list[dict[str, Any]]]:
    """Tune every problem in this process and merge the entries into ``space``'s table
    ``<out_root>/<gpu>/<op>.json``.

    Returns (path, new entries). ``problems`` may be a generator that builds each problem (GPU buffers) after
    the last is freed.
    """
    entries = []
    for problem in problems:
        entries.append(tuner.tune(problem))
        del problem
    path = write_entries(space, entries, out_root, gpu=gpu, device_name=device_name,
                         compute_capability=compute_capability)
    return path, entries


# ------------------------------------------------------------------------------------------------ work units

CLAIM_PREFIX = "liger-gen-claim"


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


class JournalError(ValueError):
    """A tuning journal cannot be resumed as is: a bad record with valid ones after it, a record Optuna cannot
    replay, or a path that is not a regular file."""


class JournalWarning(UserWarning):
    """Something about a tuning journal the user should know: a torn tail was cut off, or a stale lock waits."""


#: How old Optuna's journal lock must be before liger-gen says it was probably left by a dead process.
STALE_LOCK_S = 2.0


def repair_journal(path: str | os.PathLike) -> int:
    """Make a journal file that ends in a torn record resumable; returns the number of bytes cut off (0: intact).

    A write cut short (disk full, power loss, a process killed mid-write) leaves a last line without its newline,
    or with bytes that are not a JSON record; Optuna then fails on every later run (its next record lands on the
    same line). Such a tail — everything after the last valid record, when no valid record follows — is moved to
    ``<journal>.torn-<unix time>`` and the journal is truncated to its valid records, with a ``JournalWarning``.
    A bad record followed by valid ones is not a tear but corruption: ``JournalError`` names the file and line and
    nothing is changed. The scan holds Optuna's own journal lock, so it never races a writer.
    """
    import json
    import warnings

    from optuna.storages.journal import JournalFileSymlinkLock

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(mode):  # a FIFO would block the read below forever
        raise JournalError(f"tuning journal {path} is not a regular file (mode {stat.filemode(mode)})")
    lock = JournalFileSymlinkLock(str(path))
    lock_file = Path(str(path) + ".lock")
    try:
        age = time.time() - lock_file.lstat().st_mtime
    except OSError:
        age = None
    if age is not None and age >= STALE_LOCK_S:
        warnings.warn(f"liger-gen: the journal lock {lock_file} is {age:.0f} s old: a tuner that stopped while "
                      f"writing {path} left it (or one is writing now). Optuna breaks a lock after its 30 s grace "
                      f"period, so this run may wait up to 30 s before it starts; delete the lock file if no "
                      f"tuner is running.", JournalWarning, stacklevel=2)
    lock.acquire()
    try:
        data = path.read_bytes()
        good_end, good_records, bad_line, line_no, start = 0, 0, None, 0, 0
        while start < len(data):
            end = data.find(b"\n", start)
            line_no += 1
            line = data[start:] if end < 0 else data[start:end]
            try:
                if end < 0:
                    raise ValueError("no newline")
                record = json.loads(line)
                if not (isinstance(record, dict) and type(record.get("op_code")) is int):
                    raise ValueError("not an Optuna journal record (an object with an int op_code)")
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if bad_line is None:
                    bad_line = (line_no, exc)
            else:
                if bad_line is not None:
                    raise JournalError(
                        f"tuning journal {path}: line {bad_line[0]} is not a valid record ({bad_line[1]}), and "
                        f"valid records follow it (line {line_no}): the file is corrupt in the middle, not cut "
                        f"short, so it cannot be resumed. Nothing was changed; move it aside to start the studies "
                        f"over (tables already written are kept).")
                good_end, good_records = end + 1, good_records + 1
            if end < 0:
                break
            start = end + 1
        torn = len(data) - good_end
        if torn:
            aside = path.with_name(f"{path.name}.torn-{int(time.time())}")
            aside.write_bytes(data[good_end:])
            with open(path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
            warnings.warn(f"liger-gen: tuning journal {path} ended in {torn} bytes that are not a complete record "
                          f"(line {bad_line[0]}: a write cut short by a full disk, a power loss or a killed "
                          f"process); cut them off (saved in {aside}) and resuming from the {good_records} records "
                          f"before them.", JournalWarning, stacklevel=2)
        return torn
    finally:
        lock.release()


def open_storage(spec: Any):
    """An Optuna storage from ``spec``: None stays None (in memory); a URL (``sqlite:///tune.db``,
    ``postgresql://...``) opens that database; any other string or path is a journal file (``JournalStorage``,
    safe for several processes on one disk; created with its folder, and first checked by ``repair_journal``: a
    torn tail is cut off, a corrupt middle raises ``JournalError``); a storage object is returned as is.

    A database other than SQLite (PostgreSQL, shared by the hosts of a ``--run-id`` run) is opened with
    connections checked before use (a server restart or a closed idle connection is not an error), and its
    tables are created by the first opener (hosts starting at once retry the creation the other won). A missing
    driver raises ``MissingExtraError`` with the pip command; a server that cannot be reached, ``StorageError``."""
    if spec is None or not isinstance(spec, (str, os.PathLike)):
        return spec
    spec = str(spec)
    if "://" in spec:
        if spec.startswith("sqlite"):
            return optuna.storages.get_storage(spec)
        return _open_database(spec)
    from optuna.storages.journal import JournalFileBackend

    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    repair_journal(spec)
    try:  # the storage replays every record now: a record that parses but is not what Optuna wrote fails here
        return optuna.storages.JournalStorage(JournalFileBackend(spec))
    except Exception as exc:  # noqa: BLE001 - whatever Optuna raises on a corrupt record
        raise JournalError(f"tuning journal {spec} cannot be replayed by Optuna ({type(exc).__name__}: {exc}): a "
                           f"record in it is corrupt. Nothing was changed; move it aside to start the studies over "
                           f"(tables already written are kept).") from exc


class StorageError(ValueError):
    """A tuning storage cannot be opened (a database that cannot be reached, refuses the login, ...)."""


def display_storage(spec: Any) -> str:
    """``spec`` as it may be printed: the password of a database URL replaced by ``***`` (SQLAlchemy's own URL
    parsing, so a password holding '/', ':' or '@' is hidden too)."""
    text = str(spec)
    if "://" not in text:
        return text
    try:
        from sqlalchemy.engine import make_url

        return make_url(text).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses: hide everything between :// and the last @
        return re.sub(r"^([^:/]+://)[^@]*@", r"\1***@", text)


def _open_database(url: str):
    """An RDB storage on ``url`` (not SQLite): see ``open_storage``."""
    import sqlalchemy.exc

    from liger_gen.optional import MissingExtraError

    shown = display_storage(url)
    url = _with_driver(url)
    for attempt in range(6):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
            return optuna.storages.get_storage(storage)  # Optuna's cache of finished trials in front of it
        except ImportError as exc:
            cause, missing = exc, None
            while cause is not None and missing is None:
                missing = getattr(cause, "name", None)
                cause = cause.__cause__ or cause.__context__
            dialect = url.split("://", 1)[0]
            if dialect in ("postgresql", "postgresql+psycopg2"):
                hint = ("pip install 'liger-gen[tune]' (it brings psycopg2-binary; from a source checkout: pip "
                        "install -e '.[tune]'), or pip install psycopg2-binary")
            elif dialect == "postgresql+psycopg":
                hint = "pip install 'psycopg[binary]'"
            else:
                hint = "pip install the Python driver that SQLAlchemy names for it"
            raise MissingExtraError(f"the tuning storage {shown} needs the database driver "
                                    f"{missing or dialect}, which is not installed ({exc}); install it with: "
                                    f"{hint}") from exc
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as exc:
            # several hosts creating the tables of an empty database at once: all but one fail on a duplicate
            # table or type; by the next try the winner's tables are there
            last = exc
            time.sleep(0.1 * 2 ** attempt)
        except (sqlalchemy.exc.SQLAlchemyError, ValueError) as exc:  # ValueError: a malformed URL (its port)
            raise StorageError(f"cannot open the tuning storage {shown}: {type(exc).__name__}: "
                               f"{_first_line(exc)}") from exc
    raise StorageError(f"cannot create Optuna's tables in the tuning storage {shown}: {type(last).__name__}: "
                       f"{_first_line(last)}") from last


#: Seconds a PostgreSQL connection attempt may take, and the TCP keepalive settings that notice a server gone
#: silent (a host must not hang forever on a dead connection; the other hosts would take its units over).
CONNECT_TIMEOUT_S = 20
_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


def _engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options: connections checked before use; for PostgreSQL through psycopg2 or psycopg, a
    connect timeout and TCP keepalives (libpq's parameters)."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.split("://", 1)[0] in ("postgresql", "postgresql+psycopg2", "postgresql+psycopg"):
        kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S, **_KEEPALIVES}
    return kwargs


def _with_driver(url: str) -> str:
    """``url`` with the PostgreSQL driver that is installed: a ``postgresql://`` URL names none, and SQLAlchemy
    2.1 takes psycopg (3) for it, 2.0 psycopg2 (the driver liger-gen's ``tune`` extra brings); with only psycopg2
    installed it becomes ``postgresql+psycopg2://``. Any other URL, or one that names its driver, is kept."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if scheme != "postgresql":
        return url

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: blocked in sys.modules
            return False

    return f"postgresql+psycopg2{sep}{rest}" if installed("psycopg2") and not installed("psycopg") else url


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else ""


def claim(storage, name: str) -> int | None:
    """Create the study ``name`` in ``storage``; its id if this call created it, None if it already existed.

    Exactly one of several processes creating the same name succeeds (a unique name in an RDB; the first
    creation in a journal's order)."""
    try:
        return storage.create_new_study([StudyDirection.MINIMIZE], name)
    except optuna.exceptions.DuplicatedStudyError:
        return None


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
    process writes the tables (``report.run_tuning`` reads it), ``stale_s`` how long an attempt of another host
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


class TakenOver(Exception):
    """Another process took over the unit attempt this one works on (a retry claim of it exists)."""


#: Least seconds between two writes of a unit attempt's ``beat`` (every trial and problem raises it).
BEAT_INTERVAL_S = 0.5
#: Seconds between two notices of a host that waits (for a table-writing host to join, ...).
REMIND_S = 300.0
#: Seconds a unit claim may stay without its owner record (written right after the claim) before it counts as
#: abandoned by a process that stopped in between.
OWNERLESS_S = 30.0
_RETRY = ":retry"
_RETRY_RE = re.compile(r":retry(\d+)$")
_TOKEN = uuid.uuid4().hex  # tells this process from an earlier one that had the same host name and pid


def _unit_claim(run_id: str, unit: WorkUnit) -> str:
    return f"{CLAIM_PREFIX}:{run_id}:unit:{unit.index}"


def _problem_claim(run_id: str, op: str, key: str) -> str:
    return f"{CLAIM_PREFIX}:{run_id}:problem:{op}:{key}"


def attempt_name(base: str, k: int) -> str:
    """The claim of attempt ``k`` of the claim ``base``: ``base`` itself, then ``base:retry1``, ``base:retry2``..."""
    return base if k == 0 else f"{base}{_RETRY}{k}"


def _base_name(name: str) -> str:
    return _RETRY_RE.sub("", name)


def _retry_index(name: str) -> int:
    found = _RETRY_RE.search(name)
    return int(found.group(1)) if found else 0


def _study_attrs(storage, name: str) -> dict[str, Any] | None:
    """The user attrs of the study ``name``; None if there is no such study."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    return storage.get_study_user_attrs(study_id)


def attempts(storage, base: str) -> list[tuple[int, str, dict[str, Any]]]:
    """The attempts at the claim ``base``, oldest first: (k, claim name, user attrs) of ``base``, ``base:retry1``,
    ... as far as they exist (retry k+1 is only ever created after retry k)."""
    out: list[tuple[int, str, dict[str, Any]]] = []
    while True:
        name = attempt_name(base, len(out))
        attrs = _study_attrs(storage, name)
        if attrs is None:
            return out
        out.append((len(out), name, attrs))


@functools.lru_cache(maxsize=None)
def _machine() -> tuple[str | None, int | None]:
    """(boot id, PID namespace) of this process on Linux, None where they cannot be read: with the host name
    they say whether a pid recorded in a claim can be looked up here."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        boot = None
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return boot, pidns


def this_process() -> dict[str, Any]:
    """The ``owner`` a unit claim of this process records: host name and pid, the boot id and PID namespace that
    make the pid meaningful (containers that share the host name, machines with the same name), and a token that
    tells this process from an earlier one with the same pid (a container's process 1)."""
    boot, pidns = _machine()
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot": boot, "pidns": pidns, "token": _TOKEN}


def same_host(owner: Mapping[str, Any], me: Mapping[str, Any]) -> bool:
    """Whether the process ``owner`` of a claim ran where ``me`` runs, so that its pid can be checked here: the
    same host name, and the same boot and PID namespace where both are known (after a reboot, or from another
    container or machine of the same name, only the heartbeat tells)."""
    return owner.get("host") == me["host"] and all(
        owner.get(k) == me.get(k) for k in ("boot", "pidns") if owner.get(k) is not None and me.get(k) is not None)


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` of this host is running (a zombie is not); True when it cannot be told."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return True  # os.kill(0, ...) would signal this process group: never ask about such a pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, as another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def owner_text(owner: Any) -> str:
    """'host pid 123' for a claim's ``owner`` attr; 'an unknown process' when it has none (yet)."""
    if not isinstance(owner, Mapping) or "host" not in owner:
        return "an unknown process"
    return f"{owner['host']} pid {owner.get('pid', '?')}"


class _Heartbeat:
    """The ``owner`` and ``beat`` of one unit attempt: recorded when it is claimed, the beat raised by every call
    and written at most every ``BEAT_INTERVAL_S``. With ``fenced`` (a shared run), each write also looks for
    the next retry claim of the unit and raises ``TakenOver`` when another process has created it."""

    def __init__(self, storage, study_id: int, name: str, *, fenced: bool):
        self.storage, self.study_id, self.name, self.fenced = storage, study_id, name, fenced
        self.successor = attempt_name(_base_name(name), _retry_index(name) + 1)
        self.count = 0
        storage.set_study_user_attr(study_id, "owner", this_process())
        storage.set_study_user_attr(study_id, "beat", 0)
        self.written = time.monotonic()

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.written < BEAT_INTERVAL_S:
            return
        self.written = now
        self.storage.set_study_user_attr(self.study_id, "beat", self.count)
        successor = _study_attrs(self.storage, self.successor) if self.fenced else None
        if successor is not None:
            raise TakenOver(f"{self.name} was taken over by {owner_text(successor.get('owner'))} (as "
                            f"{self.successor}), which saw no progress of this process for its stale time")


def _claim_problem(storage, base: str, attempt: str, retry: bool) -> int | None:
    """Claim the problem ``base`` for the unit attempt ``attempt``: the claim's id, or None when the problem is
    not this attempt's to tune. A first attempt of a unit claims ``base`` (taken: another unit gives the same
    problem and tunes it). A retry skips a problem any attempt of which holds an entry, and claims the next retry
    of a problem whose latest claim an earlier attempt of the same unit made (one of another unit's is left to
    that unit)."""
    if not retry:
        study_id = claim(storage, base)
    else:
        found = attempts(storage, base)
        if any("entry" in attrs for _, _, attrs in found):
            return None
        if not found:
            study_id = claim(storage, base)
        else:
            k, name, attrs = found[-1]
            by = attrs.get("attempt")
            if by is None:  # claimed an instant ago, or by a process that died right after claiming: look again
                time.sleep(1.0)
                attrs = _study_attrs(storage, name) or {}
                if "entry" in attrs:
                    return None
                by = attrs.get("attempt")
            if by is not None and _base_name(by) != _base_name(attempt):
                return None
            study_id = claim(storage, attempt_name(base, k + 1))
    if study_id is not None:
        storage.set_study_user_attr(study_id, "attempt", attempt)
    return study_id


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
    heartbeat = beat[0] = _Heartbeat(storage, unit_id, name, fenced=job.shared)
    retry = _retry_index(name) > 0
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
            problem_id = _claim_problem(storage, _problem_claim(job.run_id, unit.op, problem.key()), name, retry)
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
            item = (attrs["unit"], attrs["pos"], _retry_index(study.study_name), attrs["entry"])
            problem = _base_name(study.study_name)
            if problem not in found or item[:3] < found[problem][:3]:
                found[problem] = item
    out: dict[str, list[dict[str, Any]]] = {}
    for index, _pos, _k, entry in sorted(found.values(), key=lambda f: f[:3]):
        out.setdefault(by_index[index].op, []).append(entry)
    return out


def finished_units(storage, run_id: str, units: Sequence[WorkUnit]) -> set[int]:
    """Indices of the units of ``run_id`` that an attempt (the first claim or a retry) finished."""
    names = {_unit_claim(run_id, u): u.index for u in units}
    return {names[_base_name(s.study_name)] for s in storage.get_all_studies()
            if _base_name(s.study_name) in names and s.user_attrs.get("done")}


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

    out: dict[str, Any] = {"triton": _version("triton"), "torch": torch.__version__, "liger-gen": _version("liger-gen")}
    for op in ops:
        space = getattr(specs.get(op), "space", None)
        for template in (getattr(space, "template", None), *getattr(space, "also_renders", ())):
            if template is not None:
                out[f"template {template}"] = template_hash(template)
    return out


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _tuplify(value: Any) -> Any:
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value


def _wait_for_attr(storage, name: str, key: str, *, timeout: float | None, poll: float,
                   on_wait: Callable[[], None] | None = None) -> Any:
    """The user attr ``key`` of the study ``name`` once it is set; None after ``timeout`` seconds (None: never)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said = None  # when on_wait last ran: at the first wait, then every REMIND_S
    while True:
        attrs = _study_attrs(storage, name) or {}
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
    value, see ``cuda_visible``, or None for a worker that leaves it alone). None or one entry: in this process,
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
