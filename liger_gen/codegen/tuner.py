"""Optuna search over an op's space, one study per (op, phase, dtype, dims, variant, rows bucket).

For each phase (forward and backward kernels are tuned separately):
  1. the analytic heuristic is enqueued first, so it is always measured;
  2. TPE samples the space; a sample that violates a constraint is pruned before anything compiles;
  3. each sample is built, checked against the float64 reference on the device (a wrong variant is pruned,
     never kept), then timed (median kernel time, L2 flushed); compile or launch errors prune the trial;
  4. a local polish moves the best point one param at a time to a neighbouring choice while that is faster;
  5. the best few and the heuristic are re-timed in alternation, and the winner must beat the heuristic's
     re-timed median or the heuristic is kept — so a tuned entry is never slower than the default.
Every trial's params, status and time are kept in the table entry. With ``storage`` (an Optuna storage URL,
e.g. ``sqlite:///tune.db`` or a journal file) an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Iterable, Mapping

import optuna

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.render import template_hash
from liger_gen.codegen.spaces import dtype_name
from liger_gen.codegen.timing import Timer, gpu_timer

Builder = Callable[[str, Mapping[str, Any]], Any]


class _TrialFailed(Exception):
    pass


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
        retime_rounds: rounds of alternating re-timing.
        polish_trials: variants measured by the local polish after the search (one param moved at a time to its
            neighbouring choice, from the best point, while that improves); None: a quarter of ``n_trials``.
        on_trial: called after every finished trial (progress bars).
    """

    MEASURED = ("ok", "wrong", "error")
    MAX_TRIALS_FACTOR = 4

    def __init__(self, *, n_trials: int = 24, timer: Timer | None = None, build: Builder | None = None,
                 storage: Any = None, seed: int = 0, retime_top: int = 3, retime_rounds: int = 3,
                 polish_trials: int | None = None, on_trial: Callable[[], None] | None = None):
        if n_trials < 1:
            raise ValueError(f"n_trials must be >= 1, got {n_trials}")
        self.n_trials = n_trials
        self.timer = timer or gpu_timer
        self.build = build or load_variant
        self.storage = storage
        self.seed = seed
        self.retime_top = retime_top
        self.retime_rounds = retime_rounds
        self.polish_trials = max(0, n_trials // 4) if polish_trials is None else polish_trials
        self.on_trial = on_trial

    def study_name(self, problem, phase: str) -> str:
        """Unique per op, phase, dtype, shape, variant options and template text (so edits start fresh)."""
        return f"{problem.op}:{phase}:{problem.key()}:{template_hash(problem.template)}"

    def _evaluate(self, problem, config, phase: str) -> float:
        """Build, check and time one variant; _TrialFailed with the status and reason if it cannot be kept."""
        problems = problem.space.violations(config)
        if problems:
            raise _TrialFailed("invalid", "; ".join(problems))
        params = problem.template_params(config)
        try:
            module = self.build(problem.template, params)
            error = problem.check(module, phase)
        except Exception as exc:  # compile, resource and launch errors: prune, keep tuning
            raise _TrialFailed("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if error is not None:
            raise _TrialFailed("wrong", error)
        return float(self.timer(problem.launcher(module, phase), params))

    def _tune_phase(self, problem, phase: str, heuristic) -> tuple[optuna.Study, list[dict[str, Any]]]:
        space = problem.space
        study = optuna.create_study(
            study_name=self.study_name(problem, phase), storage=self.storage, direction="minimize",
            load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=max(1, min(8, self.n_trials // 3))),
        )
        study.enqueue_trial(space.phase_params(heuristic, phase), skip_if_exists=True)

        # TPE re-proposes points of small categorical spaces; a repeat reuses the recorded outcome instead of
        # re-measuring, and does not count against the budget of ``n_trials`` measured variants.
        outcomes: dict[tuple, tuple[str, Any]] = {}
        for t in study.trials:
            if t.state.is_finished() and t.user_attrs.get("status") not in (None, "duplicate"):
                outcomes[tuple(sorted(t.params.items()))] = (t.user_attrs["status"], t.value)

        def objective(trial: optuna.Trial) -> float:
            config = space.suggest(trial, phase, heuristic)
            key = tuple(sorted(trial.params.items()))
            if key in outcomes:
                status, value = outcomes[key]
                trial.set_user_attr("status", "duplicate")
                if status == "ok":
                    return value
                raise optuna.TrialPruned(f"repeat of a {status} variant")
            try:
                ms = self._evaluate(problem, config, phase)
            except _TrialFailed as failed:
                status, reason = failed.args
                outcomes[key] = (status, None)
                trial.set_user_attr("status", status)
                trial.set_user_attr("reason", reason)
                raise optuna.TrialPruned(reason) from None
            outcomes[key] = ("ok", ms)
            trial.set_user_attr("status", "ok")
            return ms

        def measured() -> int:
            return sum(1 for status, _ in outcomes.values() if status in self.MEASURED)

        def progress(_study, trial) -> None:
            if self.on_trial and trial.user_attrs.get("status") in self.MEASURED:
                self.on_trial()

        max_trials = self.MAX_TRIALS_FACTOR * self.n_trials
        already = measured()
        while measured() < self.n_trials and len(study.trials) < max_trials:
            study.optimize(objective, n_trials=min(self.n_trials - measured(), max_trials - len(study.trials)),
                           callbacks=[progress], gc_after_trial=False)
        for _ in range(max(0, self.n_trials - (measured() - already)) if self.on_trial else 0):
            self.on_trial()  # budget not reached (space exhausted or resumed study): keep the bar's total honest
        polished = self._polish(study, space, phase, objective, outcomes, progress)
        for _ in range(max(0, self.polish_trials - polished) if self.on_trial else 0):  # as above
            self.on_trial()
        records = [
            {"number": t.number, "params": t.params, "status": t.user_attrs.get("status", t.state.name.lower()),
             "ms": t.value, **({"reason": t.user_attrs["reason"]} if "reason" in t.user_attrs else {}),
             **({"polish": True} if t.user_attrs.get("polish") else {})}
            for t in study.trials if t.state.is_finished()
        ]
        return study, records

    def _polish(self, study, space, phase: str, objective, outcomes: dict, progress) -> int:
        """Local search around the best point: move one param at a time to its neighbouring choice (half or
        double for the power-of-two params), keep a move that is faster, repeat from the new best. Returns the
        number of variants measured (at most ``polish_trials``); every move is an ordinary, recorded trial."""
        # a resumed study has already spent part of the budget
        measured = sum(1 for t in study.trials if t.user_attrs.get("polish") and t.user_attrs.get("status") in
                       self.MEASURED)
        already = measured
        for _ in range(self.MAX_TRIALS_FACTOR * max(1, self.polish_trials)):  # bounds moves that measure nothing
            ok = [(v, k) for k, (st, v) in outcomes.items() if st == "ok" and v is not None]
            if not ok or measured >= self.polish_trials:
                break
            best_ms, best_key = min(ok)
            moves = [m for m in _neighbours(space.params(phase), dict(best_key))
                     if tuple(sorted(m.items())) not in outcomes]
            if not moves:
                break
            improved = False
            for move in moves:
                if measured >= self.polish_trials:
                    break
                study.enqueue_trial(move, user_attrs={"polish": True})
                study.optimize(objective, n_trials=1, callbacks=[progress], gc_after_trial=False)
                trial = study.trials[-1]
                status, ms = outcomes.get(tuple(sorted(trial.params.items())), (None, None))
                if trial.user_attrs.get("status") in self.MEASURED:
                    measured += 1
                if status == "ok" and ms < best_ms:
                    improved = True
                    break
            if not improved:
                break
        return measured - already

    def _retime(self, problem, phase: str, configs: list) -> list[float]:
        """Median time of each config over ``retime_rounds`` rounds, alternating, in a rotating order."""
        modules = [self.build(problem.template, problem.template_params(c)) for c in configs]
        times: list[list[float]] = [[] for _ in configs]
        for r in range(self.retime_rounds):
            order = list(range(len(configs)))
            order = order[r % len(order):] + order[: r % len(order)]
            for i in order:
                params = problem.template_params(configs[i])
                times[i].append(float(self.timer(problem.launcher(modules[i], phase), params)))
        return [statistics.median(t) for t in times]

    def tune(self, problem) -> dict[str, Any]:
        """Tune both phases of ``problem``; returns a table entry (see ``liger_gen.runtime.tables``)."""
        space = problem.space
        heuristic = space.heuristic()
        best = heuristic
        timing: dict[str, dict[str, float]] = {}
        trials: dict[str, list] = {}
        for phase in problem.phases:
            study, records = self._tune_phase(problem, phase, heuristic)
            trials[phase] = records
            ok = sorted((t for t in study.trials if t.user_attrs.get("status") == "ok" and t.value is not None),
                        key=lambda t: t.value)
            candidates, seen = [heuristic], {tuple(sorted(space.phase_params(heuristic, phase).items()))}
            for t in ok:
                key = tuple(sorted(t.params.items()))
                if key not in seen and len(candidates) <= self.retime_top:
                    seen.add(key)
                    candidates.append(dataclasses.replace(heuristic, **t.params))
            medians = self._retime(problem, phase, candidates)
            winner = min(range(len(candidates)), key=lambda i: (medians[i], i))  # ties keep the heuristic
            best = dataclasses.replace(best, **space.phase_params(candidates[winner], phase))
            timing[phase] = {"tuned": medians[winner], "heuristic": medians[0]}
        return {
            "dtype": dtype_name(problem.dtype),
            "dims": dict(problem.dims),
            "rows": problem.rows,
            "variant": dict(problem.variant),
            "config": best.to_dict(),
            "heuristic": heuristic.to_dict(),
            "timing_ms": timing,
            "bytes": {phase: problem.bytes_moved(phase) for phase in problem.phases},
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


def merge_entries(table: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``table`` with ``entries`` added, replacing any entry of the same (dtype, dims, variant, rows)."""
    from liger_gen.runtime.tables import entry_sort_key as key
    fresh = {key(e) for e in entries}
    return {**table, "entries": [e for e in table["entries"] if key(e) not in fresh] + list(entries)}


def tune_to_table(op: str, problems: Iterable, out_root, *, gpu: str, device_name: str, compute_capability: str,
                  tuner: Tuner) -> tuple[Any, list[dict[str, Any]]]:
    """Tune every problem, merge the entries into ``<out_root>/<gpu>/<op>.json`` (atomic write), re-read it.

    An existing table is kept and extended only if it belongs to this GPU, template and Triton version;
    otherwise it is replaced. Returns (path, new entries).
    """
    from liger_gen.runtime import tables

    path = tables.table_path(out_root, gpu, op)
    table = tables.new_table(op, gpu, device_name, compute_capability)
    if path.exists():
        try:
            old = tables.load_table(path)
            if not tables.foreign_reasons(old, op=op, gpu=gpu):
                table["entries"] = old["entries"]
        except tables.TableError:
            pass
    entries = []
    for problem in problems:  # may be a generator that builds each problem (GPU buffers) after the last is freed
        entries.append(tuner.tune(problem))
        del problem
    tables.write_table(path, merge_entries(table, entries))
    tables.load_table(path)  # re-read: what was written must parse
    tables.clear_caches()
    return path, entries
