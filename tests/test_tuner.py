"""Tuner logic with an injected deterministic timer (kernels run in the interpreter for the checks)."""

import json

import optuna
import pytest
import torch

from liger_gen.codegen.build import load_variant
from liger_gen.ops.rms_norm import RMSNormProblem
from liger_gen.codegen.tuner import Tuner, tune_to_table
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
    path, entries = tune_to_table("rms_norm", [problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                                  compute_capability="9.0", tuner=tuner)
    assert path == tmp_path / "h200" / "rms_norm.json"
    first = tables.load_table(path)
    assert [e["rows"] for e in first["entries"]] == [20]
    other = RMSNormProblem(torch.float32, 96, 64, "cpu")
    tune_to_table("rms_norm", [other, problem], tmp_path, gpu="h200", device_name="NVIDIA H200",
                  compute_capability="9.0", tuner=tuner)
    merged = tables.load_table(path)
    assert [e["rows"] for e in merged["entries"]] == [20, 64]  # replaced, not duplicated
    assert sorted(p.name for p in path.parent.iterdir()) == ["rms_norm.json"]
    assert json.loads(path.read_text())["template_hash"] == first["template_hash"]


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
