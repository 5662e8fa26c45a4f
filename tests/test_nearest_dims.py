"""The nearest-dims rule against hand-edited and odd tables: ``tables.lookup`` never raises because of a table,
malformed timings are not evidence, roots keep their order, ``liger-gen verify`` follows the runtime, the tuner's
neighbour list is the same on every host, and clamped SwiGLU's heuristic is valid at every width."""

import dataclasses
import json
import warnings

import pytest
import torch

from liger_gen.codegen.problems import Problem
from liger_gen.ops.norms.rms_norm import RMSNormSpace
from liger_gen.runtime import tables

OP, GPU = "rms_norm", "h200"
SPACE = RMSNormSpace
FITS = dataclasses.replace(RMSNormSpace(256, torch.bfloat16).heuristic(), BLOCK_M_FWD=1, num_warps_fwd=1)
CALL = 200  # n_cols of the lookups: no entry there; FITS (BLOCK_N 256) is valid at it


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """(user root, packaged root): $LIGER_GEN_TUNED_DIR and a stand-in for the packaged tables."""
    user, packaged = tmp_path / "user", tmp_path / "packaged"
    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(user))
    monkeypatch.setattr(tables, "packaged_root", lambda: packaged)
    tables.reset_warnings()
    tables.clear_caches()
    yield user, packaged
    tables.clear_caches()


def _entry(n_cols, config=FITS, dtype="bfloat16", rows=1024, ratio=0.5, **fields):
    """An entry at ``n_cols`` whose tuning timed the nearest config at ``ratio`` of the current heuristic."""
    timing = {phase: {"heuristic": ms, "tuned": ms, "nearest": ms * ratio}
              for phase, ms in (("fwd", 0.2), ("bwd", 0.6))}
    heuristic = RMSNormSpace(n_cols, torch.bfloat16).heuristic().to_dict()
    return {"dtype": dtype, "dims": {"n_cols": n_cols}, "rows": rows, "config": config.to_dict(),
            "heuristic": heuristic, "timing_ms": timing, **fields}


def _evidence():
    """Three entries of good evidence (nearest at 0.5x the heuristic) around CALL."""
    return [_entry(160), _entry(1024), _entry(2048)]


def _write(root, entries, **overrides):
    table = tables.new_table(SPACE, GPU, "NVIDIA H200", "9.0")
    table["entries"] = entries
    table.update(overrides)
    path = tables.table_path(root, GPU, OP)
    path.parent.mkdir(parents=True, exist_ok=True)
    # json.dumps, not write_table: hand-edited values (NaN, huge ints) are written as they are
    path.write_text(json.dumps(table))
    tables.clear_caches()
    tables.reset_warnings()
    return path


def _lookup(n_cols=CALL, dtype=torch.bfloat16, rows=1000):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tables.TunedTableWarning)
        return tables.lookup(SPACE, dtype, n_cols, rows, GPU)


BAD_TIMINGS = {
    "huge int": {"fwd": {"heuristic": 0.2, "nearest": 10 ** 400}, "bwd": {"heuristic": 0.6, "nearest": 0.3}},
    "ratio underflows": {"fwd": {"heuristic": 1e308, "nearest": 5e-324}, "bwd": {"heuristic": 1e308, "nearest": 0}},
    "strings": {"fwd": {"heuristic": "0.2", "nearest": "0.1"}, "bwd": {"heuristic": "0.6", "nearest": "0.3"}},
    "bools": {"fwd": {"heuristic": True, "nearest": True}, "bwd": {"heuristic": True, "nearest": False}},
    "negative phase": {"fwd": {"heuristic": 0.2, "nearest": -0.5}, "bwd": {"heuristic": 0.6, "nearest": 0.6}},
    "nan": {"fwd": {"heuristic": 0.2, "nearest": float("nan")}, "bwd": {"heuristic": 0.6, "nearest": 0.3}},
    "inf": {"fwd": {"heuristic": float("inf"), "nearest": 0.1}, "bwd": {"heuristic": 0.6, "nearest": 0.3}},
    "zero": {"fwd": {"heuristic": 0, "nearest": 0}, "bwd": {"heuristic": 0, "nearest": 0}},
    "null": {"fwd": {"heuristic": 0.2, "nearest": None}, "bwd": {"heuristic": 0.6, "nearest": 0.3}},
    "one phase only": {"fwd": {"heuristic": 0.2, "nearest": 0.1}, "bwd": {"heuristic": 0.6}},
    "phase a list": {"fwd": [0.2, 0.1], "bwd": {"heuristic": 0.6, "nearest": 0.3}},
    "phase a number": {"fwd": 0.2, "bwd": {"heuristic": 0.6, "nearest": 0.3}},
    "a list": [{"heuristic": 0.2, "nearest": 0.1}],
    "a string": "fast",
    "empty": {},
    "null timing": None,
}


@pytest.mark.parametrize("bad", list(BAD_TIMINGS))
def test_a_malformed_timing_is_not_evidence_and_never_breaks_lookup(roots, bad):
    user, _ = roots
    entries = _evidence() + [{**_entry(4096), "timing_ms": BAD_TIMINGS[bad]}]
    assert tables.nearest_evidence({"entries": entries}, SPACE) == tables.nearest_evidence(
        {"entries": _evidence()}, SPACE)
    _write(user, entries)
    found = _lookup()
    assert found["source"] == "user" and found["dims"] == {"n_cols": 160} and found["config"] == FITS
    # alone, it is no evidence at all: the heuristic runs
    _write(user, [{**_entry(n), "timing_ms": BAD_TIMINGS[bad]} for n in (160, 1024, 2048)])
    found = _lookup()
    assert found["source"] == "heuristic" and found["config"] == RMSNormSpace(CALL, torch.bfloat16).heuristic()


def test_extreme_but_finite_timings_give_a_ratio_not_an_overflow(roots):
    user, _ = roots
    slow = [{**_entry(n), "timing_ms": {"fwd": {"heuristic": 1e-300, "nearest": 1e300},
                                        "bwd": {"heuristic": 1e-300, "nearest": 1e300}}} for n in (160, 1024, 2048)]
    count, ratio = tables.nearest_evidence({"entries": slow}, SPACE)
    assert count == 3 and ratio > 1e300  # inf, or the largest float
    assert not tables.nearest_allowed({"entries": slow}, SPACE)
    _write(user, slow)
    assert _lookup()["source"] == "heuristic"
    fast = [{**e, "timing_ms": {p: {"heuristic": 1e300, "nearest": 1e-300} for p in ("fwd", "bwd")}} for e in slow]
    assert tables.nearest_evidence({"entries": fast}, SPACE)[1] < 1e-300
    _write(user, fast)
    assert _lookup()["dims"] == {"n_cols": 160}


@pytest.mark.parametrize("change", ["zero dims", "negative dims", "huge dims", "other dim names", "no heuristic",
                                    "heuristic a string", "old heuristic", "unknown dtype", "variant"])
def test_odd_entries_never_break_lookup(roots, change):
    user, _ = roots
    odd = {
        "zero dims": {"dims": {"n_cols": 0}},
        "negative dims": {"dims": {"n_cols": -200}},
        "huge dims": {"dims": {"n_cols": 10 ** 400}},
        "other dim names": {"dims": {"n_cols": 160, "hidden": 4}},
        "no heuristic": {"heuristic": None},
        "heuristic a string": {"heuristic": "heuristic"},
        "old heuristic": {"heuristic": {**_entry(160)["heuristic"], "BLOCK_M_FWD": 64}},
        "unknown dtype": {"dtype": "float8"},
        "variant": {"variant": {"casting_mode": "gemma"}},
    }[change]
    entries = [{**e, **odd} for e in _evidence()]
    _write(user, entries)
    found = _lookup()
    if change == "variant":  # another variant's entries are evidence and neighbours all the same
        assert found["dims"] == {"n_cols": 160}
    else:  # the space rejects those dims, or the recorded heuristic is not today's: no evidence
        assert found["source"] == "heuristic"


def test_a_neighbour_at_huge_or_other_dims_is_ordered_last_or_left_out(roots):
    user, _ = roots
    huge = {**_entry(1024), "dims": {"n_cols": 10 ** 400}}
    other = {**_entry(1024), "dims": {"n_cols": 200, "hidden": 4}}
    entries = [huge, other, *_evidence()]
    assert tables.neighbour_entries(entries, torch.bfloat16, {"n_cols": CALL}, 1000)[-1] is huge
    assert other not in tables.neighbour_entries(entries, torch.bfloat16, {"n_cols": CALL}, 1000)
    _write(user, entries)
    assert _lookup()["dims"] == {"n_cols": 160}


def test_bool_dims_skip_the_table_with_a_warning(roots):
    user, _ = roots
    _write(user, _evidence() + [{**_entry(512), "dims": {"n_cols": True}}])
    with pytest.warns(tables.TunedTableWarning, match="bad dtype/dims"):
        assert tables.lookup(SPACE, torch.bfloat16, CALL, 1000, GPU)["source"] == "heuristic"


def test_no_neighbour_valid_at_the_call_or_of_its_dtype_leaves_the_heuristic(roots):
    user, _ = roots
    wide = dataclasses.replace(RMSNormSpace(1024, torch.bfloat16).heuristic(), BLOCK_M_FWD=1)  # BLOCK_N 1024
    assert RMSNormSpace(CALL, torch.bfloat16).violations(wide)
    _write(user, [_entry(n, wide) for n in (1024, 2048, 4096)])
    assert _lookup()["source"] == "heuristic"
    _write(user, [_entry(n, dtype="float16") for n in (160, 1024, 2048)])
    assert _lookup()["source"] == "heuristic"  # evidence of float16 entries, no bfloat16 neighbour


def test_an_exact_entry_in_a_later_root_beats_a_neighbour_in_an_earlier_one(roots):
    user, packaged = roots
    exact = dataclasses.replace(FITS, BLOCK_M_FWD=2)
    _write(user, _evidence())
    _write(packaged, [_entry(CALL, exact)])
    found = _lookup()
    assert found["source"] == "packaged" and found["config"] == exact and "dims" not in found
    # without the exact entry, the first root whose table has the evidence gives the neighbour, even when a
    # later root's is nearer
    _write(packaged, _evidence() + [_entry(192, dataclasses.replace(FITS, BLOCK_M_FWD=4))])
    found = _lookup()
    assert found["source"] == "user" and found["dims"] == {"n_cols": 160}
    _write(user, [_entry(160)])  # one entry: too little evidence in the user table, the packaged one's is used
    found = _lookup()
    assert found["source"] == "packaged" and found["dims"] == {"n_cols": 192}


def test_a_table_of_an_older_template_offers_no_neighbour(roots):
    user, _ = roots
    _write(user, _evidence(), template_hashes={"rms_norm": "0" * 16})
    with pytest.warns(tables.TunedTableWarning, match="template hashes differ"):
        assert tables.lookup(SPACE, torch.bfloat16, CALL, 1000, GPU)["source"] == "heuristic"


def test_verify_names_the_entry_the_runtime_uses_when_a_table_holds_an_invalid_exact_entry(roots):
    """A table whose entry at the dims is invalid there is not one 'without an entry': the runtime takes no
    neighbour from it, and verify must not say one stands in."""
    from liger_gen import verify
    from liger_gen.ops import get_spec

    user, _ = roots
    wide = dataclasses.replace(RMSNormSpace(1024, torch.bfloat16).heuristic(), BLOCK_M_FWD=1)
    _write(user, _evidence() + [_entry(CALL, wide)])  # the exact entry's config is invalid at CALL
    runtime = _lookup()
    spec = get_spec(OP)
    space = spec.space({"n_cols": CALL}, torch.bfloat16, None)
    loaded = {(str(user), OP): tables.check_table_file(tables.table_path(user, GPU, OP), spec.space, GPU)[0]}
    finding = verify._find(verify.Report(), spec, space, torch.bfloat16, 1000, [("user", user)], loaded)
    assert runtime["source"] == finding.source == "heuristic"
    assert "stands in" not in finding.detail


def test_the_neighbour_list_is_the_same_from_the_stored_priors_of_a_shared_run():
    """Every host of a shared run tunes from the priors the first table writer stored (as JSON): the neighbour
    list built from them is the one that host built from its own."""
    from liger_gen.tuning.fleet import _tuplify
    from liger_gen.tuning.tables import neighbour_priors, problem_key

    def key(n, dtype=torch.bfloat16, rows=1024, variant=None):
        p = _Launchless(dtype, n, rows, "cpu", variant=variant)
        return p, problem_key(p)

    priors = {}
    for n, rows, variant in ((160, 1024, {}), (160, 1024, {"casting_mode": "gemma"}), (1024, 4096, {}),
                             (160, 4096, {"casting_mode": "llama"}), (96, 1024, {"casting_mode": "none"})):
        priors[key(n, rows=rows, variant=variant)[1]] = {"n": n, "rows": rows, **variant}
    problem = key(CALL, rows=2048, variant={"casting_mode": "llama"})[0]
    stored = json.loads(json.dumps([[list(k), v] for k, v in priors.items()]))
    again = {_tuplify(k): v for k, v in stored}
    assert neighbour_priors(again, problem) == neighbour_priors(priors, problem)
    assert neighbour_priors(priors, problem)[0]["config"] == {"n": 160, "rows": 4096, "casting_mode": "llama"}


class _Launchless(Problem):
    """RMSNorm's space and keys without buffers: every config checks out and launches nothing."""

    op = "rms_norm"
    SPACE = RMSNormSpace

    def check(self, module, phase):
        return None

    def launcher(self, module, phase):
        return lambda: None

    def bytes_moved(self, phase):
        return 4 * self.rows * self.dims["n_cols"]


@pytest.mark.parametrize("nearest", ["a string", {"config": "x"}, {"config": None}, {"config": [1, 2]},
                                     {"config": {"BLOCK_N": 7}}, {"dims": {"n_cols": 80}}, None])
def test_refresh_ignores_a_hand_edited_nearest_field(nearest):
    from liger_gen.tuning.search import Tuner

    problem = _Launchless(torch.float32, 96, 20, "cpu")
    heuristic = problem.space.heuristic()
    old = {**_entry(96, heuristic, dtype="float32", rows=20), "nearest": nearest}
    entry = Tuner(timer=lambda launch, params: 1.0, build=lambda template, params: None).refresh(problem, old)
    assert "nearest" not in entry and all("nearest" not in t for t in entry["timing_ms"].values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_clamped_swiglu_heuristic_is_valid_at_every_width(dtype):
    from liger_gen.ops.glu.clamped_swiglu import ClampedSwiGLUSpace

    widths = sorted({*range(1, 4097), *range(4097, 65537, 37), *(2 ** k + d for k in range(17) for d in (-1, 0, 1)
                                                                  if 1 <= 2 ** k + d <= 65536)})
    for n in widths:
        space = ClampedSwiGLUSpace({"n_cols": n}, dtype)
        config = space.heuristic()
        assert not space.violations(config), (n, config)
        assert config.BLOCK_N_BWD * config.BLOCK_M_BWD == (512 if n > 16 else 256), (n, config)
