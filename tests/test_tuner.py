"""Tuner logic with an injected deterministic timer (kernels run in the interpreter for the checks)."""

import json
import os
import time

import optuna
import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.codegen.problems import Problem
from liger_gen.ops.norms.rms_norm import RMSNormProblem, RMSNormSpace
from liger_gen.tuning.search import Tuner
from liger_gen.tuning.tables import tune_to_table
from liger_gen.runtime import tables

optuna.logging.set_verbosity(optuna.logging.WARNING)


def cost_model(launch, params):
    """Deterministic 'time': favours BLOCK_M_FWD=4, 2 forward warps and the blocked dW strategy."""
    return (1.0 + abs(params["BLOCK_M_FWD"] - 4) + 0.3 * abs(params["num_warps_fwd"] - 2)
            + 0.1 * params["num_stages_fwd"] + (0.0 if params["dw_strategy"] == "blocked" else 0.7)
            + 0.05 * params["num_warps_bwd"])


@pytest.fixture
def problem():
    return RMSNormProblem(torch.float32, 96, 20, "cpu", seed=1)


class FakeRMSNormProblem(Problem):
    """RMSNorm's space and keys without buffers: every variant checks out and launches nothing (tests of the
    search logic that need no kernel; the cost model stands in for the time)."""

    op = "rms_norm"
    SPACE = RMSNormSpace

    def check(self, module, phase):
        return None

    def launcher(self, module, phase):
        return lambda: None

    def bytes_moved(self, phase):
        return 4 * self.rows * self.dims["n_cols"] * (2 if phase == "fwd" else 3)


def fake_build(template, params):
    """No rendering, no compiling: the fake problems launch nothing."""
    return None


@pytest.fixture
def fast():
    return FakeRMSNormProblem(torch.float32, 96, 20, "cpu", seed=1)


def test_heuristic_is_first_trial_and_winner_never_slower(problem):
    entry = Tuner(n_trials=10, timer=cost_model, seed=3).tune(problem)
    heuristic = problem.space.heuristic()
    for phase in ("fwd", "bwd"):
        first = entry["trials"][phase][0]
        assert first["number"] == 0
        assert first["params"] == problem.space.phase_params(heuristic, phase)
        assert entry["timing_ms"][phase]["tuned"] <= entry["timing_ms"][phase]["heuristic"]
    # the cost model's favourite fwd settings are reachable in 10 trials of TPE with this seed
    assert entry["timing_ms"]["fwd"]["tuned"] < entry["timing_ms"]["fwd"]["heuristic"]
    assert entry["config"]["BLOCK_N"] == 128
    assert not problem.space.violations(problem.space.config_cls.from_dict(entry["config"]))


def test_failing_and_wrong_variants_are_pruned(problem):
    class Corrupt:
        """A variant that computes the wrong thing: forward writes y then scales it."""

        def __init__(self, module):
            self.module = module

        def forward(self, x, w, y, rstd, eps, offset):
            self.module.forward(x, w, y, rstd, eps, offset)
            y.mul_(1.01)

        def __getattr__(self, name):
            return getattr(self.module, name)

    def build(op, params):
        if params["num_warps_fwd"] == 2:
            raise RuntimeError("out of resources: shared memory, Required: 300000")
        module = load_variant(op, params)
        return Corrupt(module) if params["BLOCK_M_FWD"] == 4 else module

    entry = Tuner(n_trials=14, timer=cost_model, build=build, seed=0).tune(problem)
    statuses = {r["status"] for r in entry["trials"]["fwd"]}
    assert {"error", "wrong", "ok"} <= statuses
    for r in entry["trials"]["fwd"]:
        if r["params"].get("num_warps_fwd") == 2:
            assert r["status"] in ("error", "invalid") and r["ms"] is None
        elif r["params"].get("BLOCK_M_FWD") == 4 and r["status"] != "invalid":
            assert r["status"] == "wrong" and "relative L2 error" in r["reason"]
    assert entry["config"]["num_warps_fwd"] != 2 and entry["config"]["BLOCK_M_FWD"] != 4


def test_table_written_atomically_reread_and_merged(problem, tmp_path):
    tuner = Tuner(n_trials=4, timer=cost_model)
    path, entries = tune_to_table(RMSNormSpace, [problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                                  compute_capability="9.0", tuner=tuner)
    assert path == tmp_path / "h200" / "rms_norm.json"
    first = tables.load_table(path)
    assert [e["rows"] for e in first["entries"]] == [20]
    other = RMSNormProblem(torch.float32, 96, 64, "cpu")
    tune_to_table(RMSNormSpace, [other, problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                  compute_capability="9.0", tuner=tuner)
    merged = tables.load_table(path)
    assert [e["rows"] for e in merged["entries"]] == [20, 64]  # replaced, not duplicated
    assert sorted(p.name for p in path.parent.iterdir()) == ["rms_norm.json", "rms_norm.trials.json"]
    assert json.loads(path.read_text())["template_hashes"] == first["template_hashes"]
    logged = tables.with_trials(path, merged)["entries"]
    assert [sorted(e["trials"]) for e in logged] == [["bwd", "fwd"], ["bwd", "fwd"]]  # the logs, beside it


def test_study_resumes_from_storage(problem, tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    calls = []

    def counting_timer(launch, params):
        calls.append(1)
        return cost_model(launch, params)

    Tuner(n_trials=5, timer=counting_timer, storage=storage, retime_rounds=1).tune(problem)
    first = len(calls)
    calls.clear()
    entry = Tuner(n_trials=5, timer=counting_timer, storage=storage, retime_rounds=1).tune(problem)
    # the second run finds 5 measured trials per phase and only re-times the candidates
    assert len(calls) < first
    measured = [r for r in entry["trials"]["fwd"] if r["status"] in Tuner.MEASURED]
    polish = [r for r in measured if r.get("polish")]
    assert len(measured) - len(polish) == 5 and len(polish) <= 1  # polish budget: 5 // 4, spent once


def test_repeated_points_are_not_measured_twice(problem):
    ticks = []
    entry = Tuner(n_trials=12, timer=cost_model, retime_rounds=1, on_trial=lambda: ticks.append(1)).tune(problem)
    for phase in ("fwd", "bwd"):
        records = entry["trials"][phase]
        measured = [r for r in records if r["status"] in Tuner.MEASURED]
        assert len([r for r in measured if not r.get("polish")]) == 12
        keys = [tuple(sorted(r["params"].items())) for r in measured]
        assert len(set(keys)) == len(keys)  # every measured point is distinct
        for r in records:
            if r["status"] == "duplicate":
                assert tuple(sorted(r["params"].items())) in keys
    assert len(ticks) == 2 * (12 + 3)  # once per measured variant of the search and the polish budget (12 // 4)


def test_wrong_reference_is_caught(problem):
    """The correctness gate itself can fail: a reference that disagrees makes every variant 'wrong'."""
    problem.ref["y"] = problem.ref["y"] * 1.5
    module = load_variant("rms_norm", problem.template_params(problem.space.heuristic()))
    assert "y: relative L2 error" in problem.check(module, "fwd")
    assert problem.check(module, "bwd") is None


def test_local_polish_walks_to_a_neighbouring_optimum(problem):
    """With one search trial (the heuristic) only the polish can move: it must climb BLOCK_M_FWD one halving or
    doubling at a time to the cost model's optimum, and record each move as a polish trial."""
    heuristic = problem.space.heuristic()
    target = 2 * heuristic.BLOCK_M_FWD  # one doubling away, so a single polish move reaches it

    def timer(launch, params):
        return 1.0 + abs(params["BLOCK_M_FWD"] - target) + 0.01 * params["num_stages_fwd"]

    entry = Tuner(n_trials=1, timer=timer, seed=0, polish_trials=6).tune(problem)
    assert entry["config"]["BLOCK_M_FWD"] == target
    polish = [t for t in entry["trials"]["fwd"] if t.get("polish")]
    assert 1 <= len([t for t in polish if t["status"] in Tuner.MEASURED]) <= 6
    assert all(sum(t["params"][k] != entry["heuristic"][k] for k in t["params"]) >= 1 for t in polish)
    assert entry["timing_ms"]["fwd"]["tuned"] < entry["timing_ms"]["fwd"]["heuristic"]


def test_polish_zero_measures_nothing_extra(problem):
    entry = Tuner(n_trials=2, timer=cost_model, seed=0, polish_trials=0).tune(problem)
    assert not any(t.get("polish") for phase in entry["trials"].values() for t in phase)


# ------------------------------------------------------------------------------ timing methods and re-timing

def test_timing_pure_helpers_and_method():
    from liger_gen.tuning.timing import Timing, graph_plan, per_launch_ms, timing_method
    import pickle

    # 20 us kernel after a 35 us flush: 72 launches make a ~4 ms graph; replay pairs fill ~60 ms (7 pairs)
    assert graph_plan(0.020, 0.035) == (72, 7)
    assert graph_plan(42.0, 0.035) == (1, 3)  # a long launch: one per graph, the minimum of replays
    assert graph_plan(0.0, 0.0)[0] == 100  # capped
    with pytest.raises(ValueError, match="times must be >= 0"):
        graph_plan(-1.0, 0.0)
    # paired differences: drift common to a pair cancels; the median of pairs resists one outlier pair
    assert per_launch_ms([4.0, 4.1, 9.0], [2.0, 2.1, 2.0], 100) == pytest.approx(0.02)
    assert per_launch_ms([1.0], [1.5], 10) == 1e-6  # never free
    with pytest.raises(ValueError, match="as many graph as flush"):
        per_launch_ms([1.0, 2.0], [1.0], 1)
    t = Timing(0.5, "graph")
    assert t == 0.5 and timing_method(t) == "graph" and timing_method(0.5) == "custom"
    back = pickle.loads(pickle.dumps(Timing(0.25, "events", "why")))
    assert (float(back), back.method, back.note) == (0.25, "events", "why")


def test_gpu_timer_falls_back_to_events_and_says_why(monkeypatch):
    from liger_gen.tuning import timing

    def no_capture(launch, params=None):
        raise timing.GraphCaptureError("RuntimeError: operation not permitted when stream is capturing")

    monkeypatch.setattr(timing, "graph_timer", no_capture)
    monkeypatch.setattr(timing, "events_timer", lambda launch, params=None: timing.Timing(0.7, "events"))
    ms = timing.gpu_timer(lambda: None, {})
    assert ms == 0.7 and ms.method == "events" and "not permitted when stream is capturing" in ms.note


def test_trials_and_entry_record_the_timing_method(fast):
    from liger_gen.tuning.timing import Timing

    def graph(launch, p):
        return Timing(cost_model(launch, p), "graph")

    entry = Tuner(build=fake_build, n_trials=4, timer=graph, seed=0).tune(fast)
    assert entry["timing_method"] == {"fwd": "graph", "bwd": "graph"}
    ok = [r for r in entry["trials"]["fwd"] if r["status"] == "ok"]
    assert ok and all(r["method"] == "graph" for r in ok)
    # plain floats (a cost model) are recorded as "custom"
    entry = Tuner(build=fake_build, n_trials=2, timer=cost_model, seed=0).tune(fast)
    assert entry["timing_method"]["fwd"] == "custom"


def test_mixed_timing_methods_are_retimed_with_one_method(fast):
    from liger_gen.tuning.timing import Timing

    heuristic = fast.template_params(fast.space.heuristic())

    def timer(launch, p):  # the heuristic could not be captured in a graph, the others could
        return Timing(cost_model(launch, p), "events" if p == heuristic else "graph")

    calls = []

    def fallback(launch, p):
        calls.append(1)
        return Timing(cost_model(launch, p), "events")

    tuner = Tuner(build=fake_build, n_trials=12, timer=timer, fallback_timer=fallback, seed=0, polish_trials=0,
                  retime_rounds=2)
    entry = tuner.tune(fast)
    assert entry["timing_method"]["fwd"] == "events"
    assert len(calls) >= 2 * len(entry["retime"]["fwd"])  # every candidate, every round, by the one method


def test_retime_alternates_candidates_round_by_round(fast):
    order = []

    def timer(launch, p):
        order.append(p["BLOCK_M_FWD"])
        return 1.0

    import dataclasses

    configs = [dataclasses.replace(fast.space.heuristic(), BLOCK_M_FWD=b) for b in (1, 2, 4, 8)]
    tuner = Tuner(build=fake_build, n_trials=1, timer=timer, retime_rounds=3)
    medians, rounds, methods = tuner._retime(fast, "fwd", configs)
    assert order == [1, 2, 4, 8, 2, 4, 8, 1, 4, 8, 1, 2]  # interleaved, rotating: never one block at a time
    assert rounds == [[1.0] * 3] * 4 and medians == [1.0] * 4 and methods == {"custom"}


def test_winner_must_beat_the_heuristic_by_the_margin(fast):
    heuristic = fast.space.heuristic()

    def timer(launch, p):  # every other variant is 0.5% faster than the heuristic: within noise
        return 1.0 if p["BLOCK_M_FWD"] == heuristic.BLOCK_M_FWD and p["num_warps_fwd"] == heuristic.num_warps_fwd \
            else 0.995

    kept = Tuner(build=fake_build, n_trials=6, timer=timer, seed=0, retime_margin=0.01).tune(fast)
    assert kept["timing_ms"]["fwd"]["tuned"] == kept["timing_ms"]["fwd"]["heuristic"] == 1.0
    assert {k: kept["config"][k] for k in ("BLOCK_M_FWD", "num_warps_fwd")} == \
        {"BLOCK_M_FWD": heuristic.BLOCK_M_FWD, "num_warps_fwd": heuristic.num_warps_fwd}
    taken = Tuner(build=fake_build, n_trials=6, timer=timer, seed=0, retime_margin=0.0).tune(fast)
    assert taken["timing_ms"]["fwd"]["tuned"] == 0.995
    assert taken["retime"]["fwd"][0]["params"] == fast.space.phase_params(heuristic, "fwd")
    assert len(taken["retime"]["fwd"][0]["ms"]) == 3  # every round kept


# ------------------------------------------------------------------------------ time budget

def test_time_budget_cuts_the_search_and_is_recorded(fast):
    now = [0.0]

    def timer(launch, p):  # every measurement takes one 'second' of a fake clock
        now[0] += 1.0
        return cost_model(launch, p)

    # 10 s for the problem: 5 s per phase, 4 s of it for the search, then the polish up to 5 s
    entry = Tuner(build=fake_build, n_trials=20, timer=timer, seed=0, clock=lambda: now[0]).tune(fast, budget_s=10)
    for phase in ("fwd", "bwd"):
        search = entry["search"][phase]
        assert search["budget_s"] == 5.0 and search["cut"] in ("search", "polish")
        assert search["trials"] <= 5 and search["trials"] + search["polish_trials"] <= 6
        assert entry["timing_ms"][phase]["tuned"] <= entry["timing_ms"][phase]["heuristic"]  # re-timing still ran
    free = Tuner(build=fake_build, n_trials=6, timer=cost_model, seed=0).tune(fast)
    assert free["search"]["fwd"] == {"trials": 6, "polish_trials": free["search"]["fwd"]["polish_trials"],
                                     "budget_s": None, "cut": None}
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        Tuner(build=fake_build, n_trials=2, timer=cost_model).tune(fast, budget_s=0)


# ------------------------------------------------------------------------------ interruption and resume

class Killed(BaseException):
    """Stands for a killed process: Optuna does not catch it, so the trial stays RUNNING in the storage."""


class Interrupt:
    """cost_model that raises ``exc`` at its ``at``-th call."""

    def __init__(self, at, exc):
        self.at, self.exc, self.calls = at, exc, 0

    def __call__(self, launch, params):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc
        return cost_model(launch, params)


@pytest.mark.parametrize("batch", [1, 3])  # one point at a time; batches of 3 (killed with points still queued)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, Killed])  # the trial ends FAIL / stays RUNNING
@pytest.mark.parametrize("at", [1, 4, 9, 12, 16])  # the heuristic, the search, the polish, the backward phase
def test_interrupted_study_resumes_to_the_same_entry(fast, tmp_path, at, exc, batch):
    from liger_gen.tuning.storage import open_storage

    settings = dict(build=fake_build, n_trials=8, seed=5, polish_trials=3, retime_rounds=2, batch=batch)
    reference = Tuner(timer=cost_model, **settings).tune(fast)
    with pytest.raises(exc):
        Tuner(timer=Interrupt(at, exc), storage=open_storage(tmp_path / "run.journal"), **settings).tune(fast)
    resumed = Tuner(timer=cost_model, storage=open_storage(tmp_path / "run.journal"), **settings).tune(fast)
    assert resumed == reference


def test_points_left_queued_by_a_killed_run_do_not_change_the_entry(fast, tmp_path):
    from liger_gen.tuning.storage import open_storage

    settings = dict(n_trials=6, seed=2, polish_trials=2, retime_rounds=1)
    reference = Tuner(build=fake_build, timer=cost_model, **settings).tune(fast)
    storage = open_storage(tmp_path / "run.journal")
    tuner = Tuner(build=fake_build, timer=cost_model, storage=storage, **settings)
    study = optuna.create_study(study_name=tuner.study_name(fast, "fwd"), storage=storage)
    study.enqueue_trial({"BLOCK_M_FWD": 16, "num_warps_fwd": 8, "num_stages_fwd": 1})  # queued, never started
    assert tuner.tune(fast) == reference


def test_a_timer_that_returns_nan_prunes_the_trial(fast):
    heuristic = fast.template_params(fast.space.heuristic())

    def timer(launch, p):
        return float("nan") if p != heuristic and p["BLOCK_M_FWD"] == 4 else cost_model(launch, p)

    entry = Tuner(build=fake_build, n_trials=10, timer=timer, seed=0, polish_trials=2).tune(fast)
    bad = [r for r in entry["trials"]["fwd"] if r["params"].get("BLOCK_M_FWD") == 4 and r["status"] != "invalid"]
    assert bad and all(r["status"] in ("error", "duplicate") for r in bad)
    assert any("timer returned nan" in r.get("reason", "") for r in bad)
    assert entry["config"]["BLOCK_M_FWD"] != 4


def test_retime_disqualifies_configs_that_fail_or_time_to_nonsense(fast):
    """A config whose re-timing raises, or gives NaN, inf or a negative time, cannot win; if no config at all
    can be re-timed the tuner says so instead of writing a meaningless entry."""
    import dataclasses

    configs = [dataclasses.replace(fast.space.heuristic(), BLOCK_M_FWD=b) for b in (1, 2, 4, 8)]
    bad = {2: RuntimeError("launch failed"), 4: float("nan"), 8: -5.0}

    def timer(launch, p):
        value = bad.get(p["BLOCK_M_FWD"], 1.0)
        if isinstance(value, Exception):
            raise value
        return value

    tuner = Tuner(build=fake_build, n_trials=1, timer=timer, retime_rounds=2)
    medians, rounds, _ = tuner._retime(fast, "fwd", configs)
    assert medians[0] == 1.0 and all(m == float("inf") for m in medians[1:])

    def broken(launch, p):
        raise RuntimeError("no GPU")

    with pytest.raises(RuntimeError, match="could be re-timed"):
        Tuner(build=fake_build, n_trials=1, timer=broken)._retime(fast, "fwd", configs)
    with pytest.raises(ValueError, match="n_trials"):
        Tuner(n_trials=2.5)


@pytest.mark.parametrize("tear", ["cut_mid_record", "garbage_appended", "garbage_line_appended", "empty_line_cut"])
def test_a_journal_with_a_torn_tail_resumes_to_the_same_entry(fast, tmp_path, tear):
    """Disk full or power loss while a record was written: the torn tail is cut off (and kept aside), with a
    warning, and the resumed run ends at the uninterrupted entry. Optuna alone fails on every later run."""
    from liger_gen.tuning.storage import JournalWarning, open_storage

    settings = dict(build=fake_build, n_trials=8, seed=5, polish_trials=3, retime_rounds=2)
    reference = Tuner(timer=cost_model, **settings).tune(fast)
    journal = tmp_path / "run.journal"
    with pytest.raises(Killed):
        Tuner(timer=Interrupt(9, Killed), storage=open_storage(journal), **settings).tune(fast)
    data = journal.read_bytes()
    torn = {"cut_mid_record": data[:-17], "garbage_appended": data + b'{"op_code": 5, "wor',
            "garbage_line_appended": data + b"\x00\x00\x00\n", "empty_line_cut": data + b"\n{"}[tear]
    journal.write_bytes(torn)
    with pytest.warns(JournalWarning, match="not a complete record"):
        storage = open_storage(journal)
    resumed = Tuner(timer=cost_model, storage=storage, **settings).tune(fast)
    assert resumed == reference
    aside = list(tmp_path.glob("run.journal.torn-*"))
    assert len(aside) == 1 and torn.endswith(aside[0].read_bytes())


def test_a_journal_corrupt_in_the_middle_is_a_clear_error(fast, tmp_path):
    from liger_gen.tuning.storage import JournalError, open_storage

    journal = tmp_path / "run.journal"
    Tuner(build=fake_build, timer=cost_model, n_trials=3, seed=1, polish_trials=0,
          storage=open_storage(journal)).tune(fast)
    lines = journal.read_bytes().splitlines(keepends=True)
    lines.insert(3, b"garbage\n")
    journal.write_bytes(b"".join(lines))
    with pytest.raises(JournalError, match=r"run.journal: line 4 is not a valid record.*corrupt in the middle"):
        open_storage(journal)
    assert journal.read_bytes() == b"".join(lines)  # nothing changed


def test_a_stale_journal_lock_is_named_in_a_warning(fast, tmp_path):
    """A worker killed while holding Optuna's journal lock leaves it; Optuna waits out its 30 s grace period.
    The warning says so (here the lock's owner 'finishes' after 0.5 s, so the test does not wait 30 s)."""
    import threading

    from liger_gen.tuning.storage import JournalWarning, open_storage

    journal = tmp_path / "run.journal"
    Tuner(build=fake_build, timer=cost_model, n_trials=2, seed=1, polish_trials=0,
          storage=open_storage(journal)).tune(fast)
    lock = tmp_path / "run.journal.lock"
    os.symlink(journal, lock)
    os.utime(lock, (time.time() - 600, time.time() - 600), follow_symlinks=False)
    threading.Timer(0.5, lock.unlink).start()
    with pytest.warns(JournalWarning, match=r"run.journal.lock is 600 s old.*30 s"):
        open_storage(journal)


@pytest.mark.parametrize("bad", [b"{}\n", b'{"op_codf": 0, "worker_id": "x"}\n', b"[1, 2]\n"])
def test_a_record_that_parses_but_is_not_optunas_is_a_clear_error(fast, tmp_path, bad):
    """Valid JSON in the middle that is not an Optuna record used to reach Optuna's replay (KeyError)."""
    from liger_gen.tuning.storage import JournalError, open_storage

    journal = tmp_path / "run.journal"
    Tuner(build=fake_build, timer=cost_model, n_trials=3, seed=1, polish_trials=0,
          storage=open_storage(journal)).tune(fast)
    lines = journal.read_bytes().splitlines(keepends=True)
    lines.insert(2, bad)
    journal.write_bytes(b"".join(lines))
    with pytest.raises(JournalError, match=r"run.journal: line 3 is not a valid record"):
        open_storage(journal)


def test_a_record_optuna_cannot_replay_is_a_clear_error(fast, tmp_path):
    """A record of the right form whose content Optuna rejects: JournalError naming the file, not Optuna's error."""
    import json as json_module

    from liger_gen.tuning.storage import JournalError, open_storage

    journal = tmp_path / "run.journal"
    Tuner(build=fake_build, timer=cost_model, n_trials=3, seed=1, polish_trials=0,
          storage=open_storage(journal)).tune(fast)
    lines = journal.read_bytes().splitlines(keepends=True)
    record = json_module.loads(lines[1])
    record.pop("study_id", None)
    record.pop("trial_id", None)
    record["op_code"] = 4  # a trial op without its trial: Optuna's replay fails on it
    lines[1] = json_module.dumps(record).encode() + b"\n"
    journal.write_bytes(b"".join(lines))
    with pytest.raises(JournalError, match=r"run.journal cannot be replayed by Optuna"):
        open_storage(journal)


def test_a_fifo_named_as_the_journal_is_refused_at_once(tmp_path):
    import signal

    from liger_gen.tuning.storage import JournalError, open_storage

    os.mkfifo(tmp_path / "run.journal")
    signal.alarm(20)  # a hang fails the test instead of the run
    try:
        with pytest.raises(JournalError, match="not a regular file"):
            open_storage(tmp_path / "run.journal")
    finally:
        signal.alarm(0)


def _favourite(space, **changes):
    """A valid config that the cost model prices below the heuristic in both phases."""
    import dataclasses

    for bm in (2, 4, 8, 1):
        for warps in (1, 2, 4, 8):
            config = dataclasses.replace(space.heuristic(), BLOCK_M_FWD=bm, BLOCK_M_BWD=bm, num_warps_fwd=warps,
                                         num_warps_bwd=warps, **changes)
            if not space.violations(config) and config != space.heuristic():
                return config
    raise AssertionError("no alternative config")


def test_a_prior_winner_is_measured_right_after_the_heuristic(fast):
    prior = _favourite(fast.space)
    def timer(launch, params):  # the prior's params of either phase are the fastest there are
        return 1.0 if any(all(params[k] == v for k, v in fast.space.phase_params(prior, phase).items())
                          for phase in ("fwd", "bwd")) else 2.0

    entry = Tuner(n_trials=2, timer=timer, build=fake_build, seed=0, polish_trials=0).tune(fast, prior=prior.to_dict())
    for phase in ("fwd", "bwd"):
        numbers = {r["number"]: r["params"] for r in entry["trials"][phase]}
        assert numbers[0] == fast.space.phase_params(fast.space.heuristic(), phase)
        assert numbers[1] == fast.space.phase_params(prior, phase)
    assert entry["config"] == prior.to_dict()  # the prior wins its re-timing here
    # a prior that is not a valid config of the space (an older template's, a hand edit) is not measured
    bad = {**prior.to_dict(), "BLOCK_N": 7}
    entry = Tuner(n_trials=2, timer=cost_model, build=fake_build, seed=0, polish_trials=0).tune(fast, prior=bad)
    assert all(r["params"].get("BLOCK_N") != 7 for phase in entry["trials"].values() for r in phase)
    entry = Tuner(n_trials=2, timer=cost_model, build=fake_build, seed=0, polish_trials=0).tune(
        fast, prior={"no": "such field"})
    assert entry["config"]["BLOCK_N"] == fast.space.heuristic().BLOCK_N


def test_prior_configs_come_from_the_tables_being_replaced_of_any_template(tmp_path):
    from liger_gen.ops import get_spec
    from liger_gen.tuning.tables import prior_configs, problem_key

    spec = get_spec("rms_norm")
    config = _favourite(RMSNormSpace(96, torch.float32))
    table = tables.new_table(RMSNormSpace, "h200", "NVIDIA H200", "9.0")
    table["template_hashes"] = {"rms_norm": "0123456789abcdef"}  # an older template's table
    problem = RMSNormProblem(torch.float32, 96, 20, "cpu")
    table["entries"] = [{"dtype": "float32", "dims": {"n_cols": 96}, "rows": 20, "variant": problem.variant,
                         "config": config.to_dict()}]
    tables.write_table(tables.table_path(tmp_path / "a", "h200", "rms_norm"), table)
    priors = prior_configs([spec, get_spec("layer_norm")], [tmp_path / "missing", tmp_path / "a"], "h200")
    assert priors == {"rms_norm": {problem_key(problem): config.to_dict()}, "layer_norm": {}}


def untied(launch, params):
    """cost_model plus a tiny per-point offset: no two points time alike."""
    import zlib

    return cost_model(launch, params) + 1e-7 * (zlib.crc32(repr(sorted(params.items())).encode()) % 1000)


@pytest.mark.parametrize("at", [2, 4, 5, 8, 12])  # the sampler's calls: inside the first and later batches
def test_an_interrupt_while_a_batch_is_proposed_resumes_to_the_same_entry(fast, at, monkeypatch):
    settings = dict(build=fake_build, timer=untied, n_trials=8, seed=5, polish_trials=3, retime_rounds=1, batch=3)
    reference = Tuner(**settings).tune(fast)
    original, calls = optuna.samplers.TPESampler.sample_independent, [0]

    def interrupted(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    storage = optuna.storages.InMemoryStorage()
    monkeypatch.setattr(optuna.samplers.TPESampler, "sample_independent", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Tuner(storage=storage, **settings).tune(fast)
    monkeypatch.setattr(optuna.samplers.TPESampler, "sample_independent", original)
    assert Tuner(storage=storage, **settings).tune(fast) == reference


@pytest.mark.parametrize("at", [3, 5, 7])  # killed inside a batch, then interrupted while resuming
def test_an_interrupt_while_a_run_is_resumed_loses_no_point(fast, at, monkeypatch):
    settings = dict(build=fake_build, n_trials=8, seed=5, polish_trials=3, retime_rounds=1, batch=3)
    reference = Tuner(timer=untied, **settings).tune(fast)
    storage = optuna.storages.InMemoryStorage()

    class KilledAt:
        calls = 0

        def __call__(self, launch, params):
            self.calls += 1
            if self.calls == at:
                raise Killed
            return untied(launch, params)

    with pytest.raises(Killed):
        Tuner(timer=KilledAt(), storage=storage, **settings).tune(fast)
    original = optuna.Study.enqueue_trial

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(optuna.Study, "enqueue_trial", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Tuner(timer=untied, storage=storage, **settings).tune(fast)
    monkeypatch.setattr(optuna.Study, "enqueue_trial", original)
    assert Tuner(timer=untied, storage=storage, **settings).tune(fast) == reference


def test_a_polish_move_that_ties_the_best_resumes_to_the_same_entry(fast, tmp_path):
    from liger_gen.tuning.storage import open_storage

    settings = dict(build=fake_build, n_trials=8, seed=5, polish_trials=3, retime_rounds=1, batch=2)
    reference = Tuner(timer=cost_model, **settings).tune(fast)  # cost_model times many points alike
    with pytest.raises(Killed):
        Tuner(timer=Interrupt(24, Killed), storage=open_storage(tmp_path / "run.journal"), **settings).tune(fast)
    resumed = Tuner(timer=cost_model, storage=open_storage(tmp_path / "run.journal"), **settings).tune(fast)
    assert resumed == reference


def test_the_batch_is_part_of_the_study_name_and_of_a_shared_run_plan(fast):
    from liger_gen.tuning.fleet import TuneJob, _plan

    one, eight = Tuner(build=fake_build, n_trials=2), Tuner(build=fake_build, n_trials=2, batch=8)
    assert one.study_name(fast, "fwd") != eight.study_name(fast, "fwd")
    assert _plan(TuneJob(units=[], model="m", tuner=one)) != _plan(TuneJob(units=[], model="m", tuner=eight))


def test_a_new_shape_times_the_config_tuned_at_the_nearest_dims_beside_the_heuristic(fast):
    import random

    near = _favourite(fast.space)
    slow = 1.0 + random.random()  # fresh 'times' each run; the phases' params are told apart, not the phases
    quick = slow * random.uniform(0.3, 0.9)

    def timer(launch, params):
        return quick if any(all(params[k] == v for k, v in fast.space.phase_params(near, phase).items())
                            for phase in ("fwd", "bwd")) else slow

    bad = {**near.to_dict(), "BLOCK_N": 7}  # tuned at dims where this tile fitted: skipped here
    neighbours = [{"dims": {"n_cols": 80}, "rows": 16, "config": bad},
                  {"dims": {"n_cols": 128}, "rows": 20, "config": near.to_dict()}]
    entry = Tuner(n_trials=2, timer=timer, build=fake_build, seed=0, polish_trials=0).tune(fast, neighbours=neighbours)
    assert entry["nearest"] == {"dims": {"n_cols": 128}, "rows": 20, "config": near.to_dict()}
    for phase in ("fwd", "bwd"):
        assert entry["trials"][phase][1]["params"] == fast.space.phase_params(near, phase)  # measured second
        assert entry["timing_ms"][phase]["nearest"] == pytest.approx(quick)
        assert entry["timing_ms"][phase]["heuristic"] == pytest.approx(slow)
    count, ratio = tables.nearest_evidence({"entries": [entry]})
    assert count == 1 and ratio == pytest.approx(quick / slow)
    # a refresh (after a Triton upgrade) re-times the nearest config too
    again = Tuner(timer=timer, build=fake_build).refresh(fast, entry)
    assert again["nearest"] == entry["nearest"]
    assert all(again["timing_ms"][p]["nearest"] == pytest.approx(quick) for p in ("fwd", "bwd"))
    # no neighbour that fits: nothing recorded
    entry = Tuner(n_trials=2, timer=timer, build=fake_build, seed=0, polish_trials=0).tune(fast, neighbours=neighbours[:1])
    assert "nearest" not in entry and all("nearest" not in t for t in entry["timing_ms"].values())


def test_neighbour_priors_are_the_other_dims_of_the_op_nearest_first():
    from liger_gen.tuning.tables import neighbour_priors, problem_key

    problems = {n: FakeRMSNormProblem(torch.float32, n, 20, "cpu") for n in (64, 96, 200, 1000)}
    priors = {problem_key(p): {"n": n} for n, p in problems.items() if n != 96}
    priors[problem_key(FakeRMSNormProblem(torch.float16, 100, 20, "cpu"))] = {"n": "fp16"}  # other dtype
    assert [(p["dims"], p["config"]) for p in neighbour_priors(priors, problems[96])] == [
        ({"n_cols": 64}, {"n": 64}), ({"n_cols": 200}, {"n": 200}), ({"n_cols": 1000}, {"n": 1000})]
    priors[problem_key(problems[96])] = {"n": 96}
    assert neighbour_priors(priors, problems[64])[0]["dims"] == {"n_cols": 96}  # its own dims are not a neighbour
