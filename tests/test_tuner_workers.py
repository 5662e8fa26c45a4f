"""Tuning spread over worker processes through one shared Optuna storage, on the CPU with a deterministic cost
model and fake problems: the tables must equal a one-worker run's, a dead worker's studies must resume, and the
end-of-run summary must compute the gains it prints."""

import io
import json
import math
import os
import time

import optuna
import pytest
import torch
from rich.console import Console

from liger_gen.tuning import report
from liger_gen.codegen.spaces import dtype_from_name
from liger_gen.tuning.claims import claim
from liger_gen.tuning.driver import TuneSettings, TuneTarget, cuda_visible, run_tuning
from liger_gen.tuning.fleet import TuneJob, WorkUnit, plan_units, tune_ops
from liger_gen.tuning.search import Tuner
from liger_gen.tuning.storage import open_storage
from liger_gen.tuning.tables import write_entries
from liger_gen.models import ModelShape, PRESETS
from liger_gen.ops import get_spec
from liger_gen.ops.norms.layer_norm import LayerNormSpace
from liger_gen.runtime import tables
from test_tuner import FakeRMSNormProblem, fake_build

optuna.logging.set_verbosity(optuna.logging.WARNING)

MODEL = ModelShape("tiny", 96, 192, 4, 2, 24, 1000, 1e-5)
CPU = TuneTarget(device="cpu", device_name="fake GPU", compute_capability="9.0")  # tables "for" an H200, tuned here
DIE_AT = "LIGER_GEN_TEST_DIE_AT"  # worker processes exit abruptly at this timer call
BARRIER = "LIGER_GEN_TEST_BARRIER"
_calls = [0, 0]  # timer calls, barrier passed (per process)


class FakeLayerNormProblem(FakeRMSNormProblem):
    op = "layer_norm"
    SPACE = LayerNormSpace


FAKES = {"rms_norm": FakeRMSNormProblem, "layer_norm": FakeLayerNormProblem}


def fake_problems(unit, model, device, seed):
    """One fake problem per unit; building takes a moment, as real inputs and references do. With $BARRIER
    ("folder:n") each process's first call waits until n processes have made one, so every worker gets a unit."""
    barrier = os.environ.get(BARRIER)
    if barrier and not _calls[1]:
        _calls[1] = 1
        folder, n = barrier.rsplit(":", 1)
        open(os.path.join(folder, f"worker-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(folder)) < int(n) and time.monotonic() < deadline:
            time.sleep(0.02)
    time.sleep(0.1)
    return [FAKES[unit.op](dtype_from_name(unit.dtype), model.hidden_size, unit.rows, "cpu", seed=seed)]


def cost(launch, params):
    """Deterministic 'ms' from the params alone (the same in every process: no hash())."""
    _calls[0] += 1
    if os.environ.get(DIE_AT) and _calls[0] >= int(os.environ[DIE_AT]):
        os._exit(3)  # a worker killed mid-trial: no clean-up, its trial stays RUNNING in the storage
    t = 1.0
    for name, value in sorted(params.items()):
        if isinstance(value, int) and value > 0:
            t += 0.1 * abs(math.log2(value) - 2) * (1 + len(name) % 3)
        elif isinstance(value, str):
            t += 0.01 * len(value)
    return t


def job(storage=None, ops=("rms_norm", "layer_norm"), rows=(16, 32, 64)):
    units = plan_units([get_spec(op) for op in ops], MODEL, list(rows), ["float32"])
    tuner = Tuner(n_trials=6, timer=cost, build=fake_build, seed=3, polish_trials=2, retime_rounds=2)
    return TuneJob(units=units, model=MODEL, tuner=tuner, storage=storage, make_problems=fake_problems, device="cpu")


def written(result, root):
    """The tables ``result`` gives, as JSON without the creation time."""
    out = {}
    for op, entries in result.entries.items():
        path = write_entries(get_spec(op).space, entries, root, gpu="h200", device_name="NVIDIA H200", compute_capability="9.0")
        table = json.loads(path.read_text())
        table.pop("created")
        out[op] = table
    return out


@pytest.fixture(scope="module")
def reference():
    """One worker, in this process, studies in memory."""
    return tune_ops(job())


def test_two_workers_write_the_same_tables_as_one(reference, tmp_path, monkeypatch):
    (tmp_path / "barrier").mkdir()
    monkeypatch.setenv(BARRIER, f"{tmp_path / 'barrier'}:2")
    events, done_ops = [], []
    result = tune_ops(job(storage=str(tmp_path / "tune.journal")), devices=[None, None], on_event=events.append,
                      on_op_done=lambda op, entries, seconds: done_ops.append((op, len(entries), seconds["busy"])))
    assert not result.unfinished and not result.errors
    assert result.entries == reference.entries
    assert written(result, tmp_path / "two") == written(reference, tmp_path / "one")
    assert [len(reference.entries[op]) for op in ("rms_norm", "layer_norm")] == [3, 3]
    done = [e["unit"] for e in events if e["kind"] == "done"]
    assert sorted(done) == list(range(6))  # every unit claimed and tuned exactly once
    assert {e["worker"] for e in events if e["kind"] == "done"} == {0, 1}  # both workers took units
    assert sorted(op for op, _, _ in done_ops) == ["layer_norm", "rms_norm"]
    assert all(n == 3 and busy > 0 for _, n, busy in done_ops)
    assert set(result.seconds) == {"rms_norm", "layer_norm"}


def test_a_dead_worker_leaves_its_studies_resumable(reference, tmp_path, monkeypatch):
    storage = str(tmp_path / "tune.journal")
    monkeypatch.setenv(DIE_AT, "50")  # each worker dies inside its second unit
    broken = tune_ops(job(storage=storage), devices=[None, None])
    assert broken.unfinished and any("exited with code 3" in e for e in broken.errors)
    monkeypatch.delenv(DIE_AT)
    resumed = tune_ops(job(storage=storage))  # the same command again, one worker, same storage
    assert not resumed.unfinished and resumed.entries == reference.entries


def test_several_workers_need_a_storage_every_process_can_open():
    with pytest.raises(ValueError, match="shared storage"):
        tune_ops(job(storage=None), devices=[None, None])


def test_run_tuning_prints_times_and_gains_and_removes_its_journal(reference, tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, width=240))
    tuner = Tuner(n_trials=6, timer=cost, build=fake_build, seed=3, polish_trials=2, retime_rounds=2)
    result = run_tuning(TuneSettings(specs=[get_spec("rms_norm"), get_spec("layer_norm")], model=MODEL,
                                     rows=[16, 32, 64], dtypes=[torch.float32], trials=6, out_root=tmp_path,
                                     storage=None, seed=0, gpu="h200",
                                     target=TuneTarget("cpu", "fake GPU", "9.0", workers=[None, None]), tuner=tuner,
                                     make_problems=fake_problems))
    text = out.getvalue()
    assert "rms_norm: 3 shape(s) tuned in" in text and "layer_norm: 3 shape(s) tuned in" in text
    summary = report.gain_summary(reference.entries)
    assert f"median gain over the heuristic {100 * summary['median_gain']:+.1f}% over 6 entries" in text
    assert result.entries == reference.entries
    assert sorted(p.name for p in (tmp_path / "h200").iterdir()) == [
        "layer_norm.json", "layer_norm.trials.json", "rms_norm.json", "rms_norm.trials.json"]
    path = tmp_path / "h200" / "rms_norm.json"
    assert tables.with_trials(path, tables.load_table(path))["entries"] == \
        sorted(reference.entries["rms_norm"], key=tables.entry_sort_key)


# ------------------------------------------------------------------------------------------------ pure parts

def entry(dtype, rows, heur, tuned, cut=None, method="graph"):
    return {"dtype": dtype, "dims": {"n_cols": 4096}, "rows": rows, "variant": {}, "config": {},
            "timing_ms": {"fwd": {"heuristic": heur[0], "tuned": tuned[0]},
                          "bwd": {"heuristic": heur[1], "tuned": tuned[1]}},
            "timing_method": {"fwd": method, "bwd": method}, "bytes": {"fwd": 2_000_000, "bwd": 3_000_000},
            "search": {"fwd": {"cut": cut}, "bwd": {"cut": None}}}


def test_gain_summary():
    summary = report.gain_summary({
        "rms_norm": [entry("bfloat16", 16384, (0.6, 0.4), (0.5, 0.3)),  # 1.0 / 0.8 -> +25%
                     entry("bfloat16", 4096, (0.2, 0.2), (0.2, 0.2), cut="search")],  # 0%
        "rope": [entry("bfloat16", 4096, (1.0, 1.0), (1.0, 1.1)),  # slower: -4.8%
                 entry("float32", 4096, (0.3, 0.3), (0.2, 0.2))],  # +50%
    })
    rows = summary["rows"]
    assert [(r["op"], r["rows"]) for r in rows] == [("rms_norm", 4096), ("rms_norm", 16384), ("rope", 4096),
                                                     ("rope", 4096)]  # table order within an op
    assert [round(r["gain"], 4) for r in rows] == [0.0, 0.25, round(2.0 / 2.1 - 1, 4), 0.5]
    assert summary["median_gain"] == pytest.approx((0.0 + 0.25) / 2)
    assert (summary["min_gain"], summary["max_gain"]) == (pytest.approx(2.0 / 2.1 - 1), pytest.approx(0.5))
    assert [r["op"] for r in summary["slower"]] == ["rope"] and len(summary["cut"]) == 1
    assert rows[1]["tuned_gbps"] == pytest.approx(5_000_000 / 0.8e-3 / 1e9)
    verdict = report.gain_verdict(summary)
    assert "+12.5% over 4 entries" in verdict and "1 tuned entries slower" in verdict and "misses" in verdict
    ok = report.gain_summary({"rms_norm": [entry("bfloat16", 4096, (0.6, 0.6), (0.5, 0.5))]})
    assert "meets the target" in report.gain_verdict(ok)
    assert report.gain_summary({})["median_gain"] is None
    with pytest.raises(ValueError, match="no positive timing_ms"):
        report.gain_summary({"rms_norm": [entry("bfloat16", 4096, (0.0, 0.0), (0.1, 0.1))]})


def test_plan_units_caps_rows_and_splits_the_budget():
    llama = PRESETS["llama3-8b"]
    ce, flce, rms = get_spec("cross_entropy"), get_spec("fused_linear_cross_entropy"), get_spec("rms_norm")
    assert ce.tuning_rows(llama, [4096, 16384, 65536]) == [4096, 16384]
    assert flce.tuning_rows(llama, [4096, 16384, 65536]) == [4096]
    assert rms.tuning_rows(llama, [4096, 16384, 65536]) == [4096, 16384, 65536]
    assert get_spec("kl_div").tuning_rows(llama, [4096, 16384, 65536]) == [4096, 8192]
    units = plan_units([rms, flce], llama, [4096, 16384, 65536],
                       ["bfloat16", "float32"], budget_s=60)
    assert [(u.index, u.op, u.dtype, u.rows) for u in units] == [
        (0, "rms_norm", "bfloat16", 4096), (1, "rms_norm", "bfloat16", 16384), (2, "rms_norm", "bfloat16", 65536),
        (3, "rms_norm", "float32", 4096), (4, "rms_norm", "float32", 16384), (5, "rms_norm", "float32", 65536),
        (6, "fused_linear_cross_entropy", "bfloat16", 4096), (7, "fused_linear_cross_entropy", "float32", 4096)]
    assert [u.budget_s for u in units] == [10.0] * 6 + [30.0] * 2
    assert plan_units([rms], llama, [4096], ["bfloat16"]) == [WorkUnit(0, "rms_norm", "bfloat16", 4096)]
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        plan_units([rms], llama, [4096], ["bfloat16"], budget_s=0)


def test_claims_are_taken_once_and_storage_specs(tmp_path):
    storage = open_storage(tmp_path / "sub" / "tune.journal")
    assert isinstance(storage, optuna.storages.JournalStorage)
    assert claim(storage, "a") is not None and claim(storage, "a") is None
    other = open_storage(str(tmp_path / "sub" / "tune.journal"))  # another process's view of the same file
    assert claim(other, "a") is None and claim(other, "b") is not None
    assert isinstance(open_storage(f"sqlite:///{tmp_path / 'tune.db'}"), optuna.storages.BaseStorage)
    assert open_storage(None) is None


def test_cuda_visible_maps_indices_through_an_outer_mask(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_visible([0, 1]) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert cuda_visible([1, 0]) == ["3", "2"]
    with pytest.raises(ValueError, match="device 2 is not visible"):
        cuda_visible([2])


def test_tune_options_are_checked_before_any_gpu_work():
    from click.testing import CliRunner

    from liger_gen.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--devices", "0,0"])
    assert result.exit_code == 2 and "distinct GPU indices" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--devices", "0,x"])
    assert result.exit_code == 2 and "comma-separated GPU indices" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--budget-s", "-1"])
    assert result.exit_code == 2 and "--budget-s" in result.output
    result = runner.invoke(main, ["tune", "--gpu", "h200", "--workers", "0"])
    assert result.exit_code == 2 and "--workers" in result.output
    help_text = runner.invoke(main, ["tune", "--help"]).output
    assert "--workers" in help_text and "--devices" in help_text and "--budget-s" in help_text


def test_gain_summary_with_a_heuristic_that_could_not_be_retimed():
    """The tuner writes ``heuristic: null`` when the heuristic fails to re-time: the run's summary reports that
    entry without a gain (it used to raise TypeError at the end of `liger-gen tune`)."""
    untimed = entry("bfloat16", 4096, (0.5, 0.5), (0.4, 0.5))
    untimed["timing_ms"]["fwd"]["heuristic"] = None
    summary = report.gain_summary({"rms_norm": [untimed, entry("bfloat16", 16384, (0.6, 0.4), (0.5, 0.3))]})
    assert [r["gain"] for r in summary["rows"]] == [None, pytest.approx(0.25)]
    assert summary["rows"][0]["heuristic_ms"] is None and summary["rows"][0]["tuned_ms"] == pytest.approx(0.9)
    assert summary["median_gain"] == pytest.approx(0.25) and len(summary["untimed"]) == 1
    verdict = report.gain_verdict(summary)
    assert "over 1 entries" in verdict and "1 entries whose heuristic could not be re-timed" in verdict
    console = Console(width=200, record=True)
    console.print(report.gain_table(summary))
    text = console.export_text()
    assert "n/a" in text and "+25.0%" in text
    only = report.gain_summary({"rms_norm": [untimed]})
    assert only["median_gain"] is None and "no entry has a re-timed heuristic" in report.gain_verdict(only)


def test_the_summary_reports_the_nearest_dims_config_and_whether_it_may_stand_in():
    import random

    def near(rows, heur, ratio):
        e = entry("bfloat16", rows, heur, heur)
        e["nearest"] = {"dims": {"n_cols": 2048}, "rows": 16384, "config": {}}
        for phase, ms in zip(("fwd", "bwd"), heur):
            e["timing_ms"][phase]["nearest"] = ms * ratio
        return e

    heurs = [(random.uniform(0.1, 1), random.uniform(0.1, 1)) for _ in range(3)]
    faster = [near(r, h, random.uniform(0.6, 0.9)) for r, h in zip((4096, 16384, 65536), heurs)]
    summary = report.gain_summary({"rms_norm": faster, "rope": [entry("bfloat16", 4096, (1.0, 1.0), (0.9, 0.9))]})
    for row, e in zip(summary["rows"], faster):
        assert row["nearest_dims"] == "n_cols=2048"
        assert row["nearest_ms"] == pytest.approx(sum(t["nearest"] for t in e["timing_ms"].values()))
    assert summary["rows"][-1]["nearest_ms"] is None and summary["rows"][-1]["nearest_dims"] is None
    console = Console(width=240, record=True)
    console.print(report.gain_table(summary))
    text = console.export_text()
    assert "nearest tuned dims" in text and "n_cols=2048" in text
    lines = report.nearest_verdicts({"rms_norm": faster, "rope": []})
    assert len(lines) == 1 and "at 3 new shapes" in lines[0] and "enough to stand in" in lines[0]
    slower = [near(r, h, random.uniform(1.0, 1.4)) for r, h in zip((4096, 16384), heurs)]
    assert "not enough" in report.nearest_verdicts({"rms_norm": slower})[0]


def test_refresh_retimes_the_finalists_of_existing_entries(reference, tmp_path, monkeypatch):
    """`tune --refresh`: each existing entry's finalists (its re-timed candidates and winner) and the heuristic
    are checked and re-timed, no search runs, a table of another Triton version is rewritten as this one's,
    and shapes without an entry are skipped."""
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, width=240))
    args = dict(model=MODEL, dtypes=[torch.float32], trials=6, out_root=tmp_path, storage=None, seed=0, target=CPU,
                gpu="h200", make_problems=fake_problems)
    tuner = Tuner(n_trials=6, timer=cost, build=fake_build, seed=3, polish_trials=2, retime_rounds=2)
    run_tuning(TuneSettings(specs=[get_spec("rms_norm")], rows=[16, 32], tuner=tuner, **args))
    path = tmp_path / "h200" / "rms_norm.json"
    old = tables.with_trials(path, tables.load_table(path))
    stale = {**tables.load_table(path), "triton_version": "2.1.0"}
    tables.write_table(path, stale)
    calls = []

    def counting(launch, params):
        calls.append(1)
        return cost(launch, params)

    refresher = Tuner(n_trials=6, timer=counting, build=fake_build, seed=3, polish_trials=2, retime_rounds=2)
    result = run_tuning(TuneSettings(specs=[get_spec("rms_norm")], rows=[16, 32, 64], tuner=refresher, refresh=True,
                                     **args))
    text = out.getvalue()
    assert "rms_norm: 2 shape(s) refreshed in" in text and "no entry to refresh" in text  # 64 rows: no entry
    new = tables.load_table(path)
    import triton

    assert new["triton_version"] == triton.__version__ and len(new["entries"]) == 2
    for entry in result.entries["rms_norm"]:
        before = next(e for e in old["entries"] if tables.entry_sort_key(e) == tables.entry_sort_key(entry))
        for phase, search in entry["search"].items():
            assert search["refresh"] and search["finalists"] <= len(before["retime"][phase]) + 1
            assert [r["params"] for r in entry["retime"][phase]][0] == \
                get_spec("rms_norm").space({"n_cols": entry["dims"]["n_cols"]}, torch.float32).phase_params(
                    get_spec("rms_norm").space({"n_cols": entry["dims"]["n_cols"]}, torch.float32).heuristic(), phase)
    searched = sum(s["trials"] + s["polish_trials"] for e in old["entries"] for s in e["search"].values())
    assert len(calls) < searched  # no search: a few checks and the re-timing rounds only
