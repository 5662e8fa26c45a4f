"""Optuna search over an op's space: one study per (op, phase, dtype, dims, variant, rows bucket), run start to
finish by one ``Tuner`` (the fleet, ``fleet.py``, spreads studies over GPUs and hosts).

For each phase (forward and backward kernels are tuned separately):
  1. the analytic heuristic is enqueued first, then the config an earlier tuning chose for the same problem (a
     ``prior``: ``tables.prior_configs`` reads it from the tables being replaced, of any template version), so
     both are always measured;
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
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Iterable, Mapping

try:
    import optuna
    from optuna.trial import TrialState
except ImportError:  # a training-only install: ``Tuner`` and ``liger-gen tune`` say what to install
    optuna = TrialState = None

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.render import template_hash
from liger_gen.codegen.spaces import dtype_name
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
