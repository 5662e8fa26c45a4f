"""Optuna search over an op's space, one study per (op, phase, dtype, dims, variant, rows bucket); work spread
over several GPUs through one shared Optuna storage.

For each phase (forward and backward kernels are tuned separately):
  1. the analytic heuristic is enqueued first, then the config an earlier tuning chose for the same problem (a
     ``prior``: ``prior_configs`` reads it from the tables being replaced, of any template version), so both
     are always measured;
  2. TPE samples the space; a sample that violates a constraint is pruned before anything compiles;
  3. each sample is built, checked against the float64 reference on the device (a wrong variant is pruned,
     never kept), then timed (``timing.gpu_timer``: CUDA-graph replay, L2 flushed); compile, launch and timing
     errors prune the trial;
  4. a local polish moves the best point one param at a time to a neighbouring choice while that is faster;
  5. the best few and the heuristic are re-timed in alternation (round by round, in a rotating order), and the
     winner must beat the heuristic's re-timed median by ``retime_margin`` or the heuristic is kept — so a tuned
     entry is never slower than the default.
Every trial's params, status, time and timing method are kept in the table entry, with the re-timing rounds.

Reproducible and resumable: the sampler is re-seeded before every trial from (seed, number of finished
trials), so a study's sequence of points depends only on its stored history. With ``storage`` (an Optuna
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
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import multiprocessing
import os
import queue as queue_module
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
    """

    MEASURED = ("ok", "wrong", "error")
    MAX_TRIALS_FACTOR = 4

    def __init__(self, *, n_trials: int = 24, timer: Timer | None = None, build: Builder | None = None,
                 storage: Any = None, seed: int = 0, retime_top: int = 3, retime_rounds: int = 3,
                 retime_margin: float = 0.01, polish_trials: int | None = None, search_share: float = 0.8,
                 fallback_timer: Timer | None = None, on_trial: Callable[[], None] | None = None,
                 clock: Callable[[], float] | None = None):
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
        """Unique per op, phase, dtype, shape, variant options and template text (so edits start fresh)."""
        return f"{problem.op}:{phase}:{problem.key()}:{template_hash(problem.template)}"

    def _sampler(self, n_finished: int) -> optuna.samplers.BaseSampler:
        """TPE seeded from (seed, trials finished so far): the next point depends only on the finished history.

        No constant liar (Optuna 5's default): a study runs one trial at a time, and a trial left RUNNING by a
        killed worker must not steer the resumed search."""
        return optuna.samplers.TPESampler(seed=(self.seed * 1_000_003 + n_finished) % 2**32,
                                          n_startup_trials=max(1, min(8, self.n_trials // 3)), constant_liar=False)

    def _run_one(self, study: optuna.Study, objective, callbacks) -> None:
        study.sampler = self._sampler(len(study.get_trials(deepcopy=False, states=FINISHED)))
        study.optimize(objective, n_trials=1, callbacks=callbacks, gc_after_trial=False)

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
        # a run killed between queueing a point and starting it leaves it WAITING, and it would run ahead of
        # the search: close such points (they are re-queued below or by the polish if still wanted)
        for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            study.tell(study.ask(), state=TrialState.FAIL)

        def finished():
            return study.get_trials(deepcopy=False, states=FINISHED)

        heuristic_key = _key(space.phase_params(heuristic, phase))
        done = {_key(t.params) for t in finished()}
        for start in (heuristic, prior):
            if start is not None and _key(space.phase_params(start, phase)) not in done:
                study.enqueue_trial(space.phase_params(start, phase))
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
        while measured() < self.n_trials and len(finished()) < max_trials:
            if heuristic_key in outcomes and self._out_of_time(search_end, durations):
                cut = "search"
                break
            before = len(finished())
            self._run_one(study, objective, [progress])
            if len(finished()) == before:  # a trial neither completed nor pruned: do not spin on it
                break
        for _ in range(max(0, self.n_trials - (measured() - already)) if self.on_trial else 0):
            self.on_trial()  # budget not reached (space exhausted, time cut or resumed): keep the bar's total honest
        polished, polish_cut = self._polish(study, space, phase, objective, outcomes, progress, polish_end,
                                            durations)
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
                durations: list[float] | None = None) -> tuple[int, str | None]:
        """Local search around the best point: move one param at a time to its neighbouring choice (half or
        double for the power-of-two params), keep a move that is faster, repeat from the new best. Returns the
        number of variants measured (at most ``polish_trials``) and "polish" if ``deadline`` stopped it; every
        move is an ordinary, recorded trial."""
        durations = durations if durations is not None else []
        # a resumed study has already spent part of the budget
        measured = sum(1 for t in study.get_trials(deepcopy=False, states=FINISHED)
                       if t.user_attrs.get("polish") and t.user_attrs.get("status") in self.MEASURED)
        already = measured
        for _ in range(self.MAX_TRIALS_FACTOR * max(1, self.polish_trials)):  # bounds moves that measure nothing
            ok = [(v, k) for k, (st, v) in outcomes.items() if st == "ok" and v is not None]
            if not ok or measured >= self.polish_trials:
                break
            best_ms, best_key = min(ok)
            moves = [m for m in _neighbours(space.params(phase), dict(best_key)) if _key(m) not in outcomes]
            if not moves:
                break
            improved = False
            for move in moves:
                if measured >= self.polish_trials:
                    break
                if self._out_of_time(deadline, durations):
                    return measured - already, "polish"
                study.enqueue_trial(move, user_attrs={"polish": True})
                self._run_one(study, objective, [progress])
                trial = study.get_trials(deepcopy=False)[-1]
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
        timing: dict[str, dict[str, float]] = {}
        methods: dict[str, str] = {}
        retimes: dict[str, list] = {}
        searches: dict[str, dict] = {}
        for phase in problem.phases:
            params = [r.get("params") for r in old.get("retime", {}).get(phase, [])]
            params.append(space.phase_params(old_config, phase))
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
            methods[phase] = method
            retimes[phase] = [{"params": space.phase_params(c, phase), "ms": rounds[i], "median": medians[i]}
                              for i, c in enumerate(candidates)]
            searches[phase] = {"refresh": True, "finalists": len(candidates), "dropped": dropped, "cut": None}
        return {
            "dtype": dtype_name(problem.dtype), "dims": dict(problem.dims), "rows": problem.rows,
            "variant": dict(problem.variant), "config": best.to_dict(), "heuristic": heuristic.to_dict(),
            "timing_ms": timing, "timing_method": methods,
            "bytes": {phase: problem.bytes_moved(phase) for phase in problem.phases},
            "search": searches, "retime": retimes, "trials": old.get("trials", {}),
        }

    def tune(self, problem, budget_s: float | None = None, prior: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Tune every phase of ``problem``; returns a table entry (see ``liger_gen.runtime.tables``).

        ``budget_s``: seconds of search and polish for the whole problem, split evenly over its phases (None:
        no cap; the re-timing is not counted). ``prior``: the config an earlier tuning chose for this problem
        (a table entry's ``config``), measured right after the heuristic; ignored unless it is a valid config of
        the problem's space (a table from an older template may hold one that no longer is)."""
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s must be > 0 seconds or None, got {budget_s}")
        space = problem.space
        heuristic = space.heuristic()
        best = heuristic
        share = None if budget_s is None else budget_s / len(problem.phases)
        if prior is not None:
            try:
                prior = space.config_cls.from_dict(prior)
            except ValueError:
                prior = None
            if prior is not None and space.violations(prior):
                prior = None
        timing: dict[str, dict[str, float]] = {}
        methods: dict[str, str] = {}
        trials: dict[str, list] = {}
        retimes: dict[str, list] = {}
        searches: dict[str, dict] = {}
        for phase in problem.phases:
            study, records, searches[phase] = self._tune_phase(problem, phase, heuristic, share, prior)
            trials[phase] = records
            ok = sorted((r for r in records if r["status"] == "ok" and r["ms"] is not None),
                        key=lambda r: (r["ms"], r["number"]))
            candidates, seen = [heuristic], {_key(space.phase_params(heuristic, phase))}
            for r in ok:
                if _key(r["params"]) not in seen and len(candidates) <= self.retime_top:
                    seen.add(_key(r["params"]))
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
            "timing_ms": timing,
            "timing_method": methods,
            "bytes": {phase: problem.bytes_moved(phase) for phase in problem.phases},
            "search": searches,
            "retime": retimes,
            "trials": trials,
        }


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
    torn tail is cut off, a corrupt middle raises ``JournalError``); a storage object is returned as is."""
    if spec is None or not isinstance(spec, (str, os.PathLike)):
        return spec
    spec = str(spec)
    if "://" in spec:
        return optuna.storages.get_storage(spec)
    from optuna.storages.journal import JournalFileBackend

    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    repair_journal(spec)
    try:  # the storage replays every record now: a record that parses but is not what Optuna wrote fails here
        return optuna.storages.JournalStorage(JournalFileBackend(spec))
    except Exception as exc:  # noqa: BLE001 - whatever Optuna raises on a corrupt record
        raise JournalError(f"tuning journal {spec} cannot be replayed by Optuna ({type(exc).__name__}: {exc}): a "
                           f"record in it is corrupt. Nothing was changed; move it aside to start the studies over "
                           f"(tables already written are kept).") from exc


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
    canonical GPU name every worker must see (None: not checked)."""

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


@dataclasses.dataclass
class TuneResult:
    """What ``tune_ops`` returns: entries per op (one-GPU order), seconds per op (``wall``: first unit start
    to last unit end; ``busy``: sum over units of their workers' time), units left unfinished, worker errors."""

    entries: dict[str, list[dict[str, Any]]]
    seconds: dict[str, dict[str, float]]
    unfinished: list[WorkUnit]
    errors: list[str]
    run_id: str


def _unit_claim(run_id: str, unit: WorkUnit) -> str:
    return f"{CLAIM_PREFIX}:{run_id}:unit:{unit.index}"


def _problem_claim(run_id: str, op: str, key: str) -> str:
    return f"{CLAIM_PREFIX}:{run_id}:problem:{op}:{key}"


def run_units(job: TuneJob, storage, report: Callable[[dict], None], *, worker: int = 0, device=None) -> None:
    """The worker loop: claim each unit in order, build its problems, claim and tune each problem, store the
    entry in the problem's claim study, report events (dicts with ``kind``: start, problem, trial, done)."""
    tuner = copy.copy(job.tuner)
    tuner.storage = storage
    tuner.on_trial = lambda: report({"kind": "trial", "worker": worker})
    for unit in job.units:
        unit_id = claim(storage, _unit_claim(job.run_id, unit))
        if unit_id is None:
            continue
        start = time.monotonic()
        report({"kind": "start", "unit": unit.index, "op": unit.op, "worker": worker})
        make = job.make_problems or functools.partial(spec_problems, specs=job.specs)
        problems = make(unit, job.model, device, job.seed)
        share = None if unit.budget_s is None else unit.budget_s / max(1, len(problems))
        tuned = 0
        for pos in range(len(problems)):
            problem, problems[pos] = problems[pos], None  # freed (GPU buffers) once tuned
            problem_id = claim(storage, _problem_claim(job.run_id, unit.op, problem.key()))
            if problem_id is None:  # the same problem from another row count (capped rows): tuned once
                continue
            prior = job.priors.get(unit.op, {}).get(problem_key(problem))
            if job.refresh and prior is None:  # nothing to refresh at this shape
                report({"kind": "skip", "unit": unit.index, "op": unit.op, "key": problem.key(), "worker": worker})
                continue
            report({"kind": "problem", "unit": unit.index, "op": unit.op, "phases": len(problem.phases),
                    "worker": worker})
            entry = tuner.refresh(problem, prior) if job.refresh else tuner.tune(problem, budget_s=share, prior=prior)
            storage.set_study_user_attr(problem_id, "unit", unit.index)
            storage.set_study_user_attr(problem_id, "pos", pos)
            storage.set_study_user_attr(problem_id, "entry", entry)
            tuned += 1
            del problem
        del problems
        if device is not None and getattr(device, "type", device) == "cuda":
            import torch

            torch.cuda.empty_cache()
        seconds = time.monotonic() - start
        storage.set_study_user_attr(unit_id, "seconds", seconds)
        storage.set_study_user_attr(unit_id, "done", True)
        report({"kind": "done", "unit": unit.index, "op": unit.op, "seconds": seconds, "problems": tuned,
                "worker": worker})


def collect_entries(storage, run_id: str, units: Sequence[WorkUnit]) -> dict[str, list[dict[str, Any]]]:
    """Entries stored by the workers of ``run_id``, per op, in one-GPU order (unit, then problem)."""
    by_index = {u.index: u for u in units}
    prefix = f"{CLAIM_PREFIX}:{run_id}:problem:"
    found = []
    for study in storage.get_all_studies():
        attrs = study.user_attrs
        if study.study_name.startswith(prefix) and "entry" in attrs and attrs.get("unit") in by_index:
            found.append((attrs["unit"], attrs["pos"], attrs["entry"]))
    out: dict[str, list[dict[str, Any]]] = {}
    for index, _pos, entry in sorted(found, key=lambda f: (f[0], f[1])):
        out.setdefault(by_index[index].op, []).append(entry)
    return out


def finished_units(storage, run_id: str, units: Sequence[WorkUnit]) -> set[int]:
    """Indices of the units of ``run_id`` whose worker finished them."""
    names = {_unit_claim(run_id, u): u.index for u in units}
    return {names[s.study_name] for s in storage.get_all_studies()
            if s.study_name in names and s.user_attrs.get("done")}


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


def tune_ops(job: TuneJob, *, devices: Sequence[Any] | None = None, on_event: Callable[[dict], None] | None = None,
             on_op_done: Callable[[str, list[dict], dict[str, float]], None] | None = None) -> TuneResult:
    """Tune every unit of ``job``; one worker process per entry of ``devices`` (each a ``CUDA_VISIBLE_DEVICES``
    value, see ``cuda_visible``, or None for a worker that leaves it alone). None or one entry: in this process,
    on the current device.

    Several workers need ``job.storage`` to be a spec every process can open (a journal file path or a
    database URL); ValueError otherwise. ``on_event(event)`` sees every worker event in this process (progress);
    ``on_op_done(op, entries, seconds)`` is called once all of an op's units are finished, with its entries in
    one-GPU order. The result is the same, entry for entry, whichever worker ran which unit.
    """
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

    def handle(event: dict) -> None:
        kind, now = event["kind"], time.monotonic()
        if kind == "start":
            started.setdefault(event["op"], now)
            current[event["worker"]] = event["unit"]
        elif kind == "done":
            op = event["op"]
            done.add(event["unit"])
            busy[op] = busy.get(op, 0.0) + event["seconds"]
            current.pop(event["worker"], None)
            if units_of[op] <= done:
                ended[op] = now
                entries[op] = collect_entries(state["storage"], job.run_id, job.units).get(op, [])
                if on_op_done is not None:
                    on_op_done(op, entries[op], {"wall": ended[op] - started.get(op, now), "busy": busy[op]})
        elif kind == "error":
            unit = current.get(event["worker"])
            where = f" on unit {unit} ({job.units[unit].op} {job.units[unit].dtype} rows={job.units[unit].rows})" \
                if unit is not None else ""
            errors.append(f"worker {event['worker']}{where}: {event['error']}")
        if on_event is not None:
            on_event(event)

    if devices is None or len(devices) <= 1:
        storage = open_storage(job.storage)
        state["storage"] = storage if storage is not None else optuna.storages.InMemoryStorage()
        device = None
        if job.device is not None:
            import torch

            device = torch.device("cuda", torch.cuda.current_device()) if job.device == "cuda" \
                else torch.device(job.device)
        run_units(job, state["storage"], handle, worker=0, device=device)
    else:
        if job.storage is None or not isinstance(job.storage, (str, os.PathLike)):
            raise ValueError("several workers need a shared storage that every process can open: a journal file "
                             f"path or a database URL, got {job.storage!r}")
        state["storage"] = open_storage(job.storage)
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
