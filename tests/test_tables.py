"""Tuned-table lookup: order, validation and fall-backs (no GPU needed: the GPU name is passed in)."""

import dataclasses
import json

import pytest
import torch

from liger_gen.ops.rms_norm import RMSNormSpace
from liger_gen.runtime import tables

OP, GPU, N = "rms_norm", "h200", 256


def _entry(rows, config, dtype="bfloat16", n_cols=N):
    return {"dtype": dtype, "dims": {"n_cols": n_cols}, "rows": rows, "config": config.to_dict()}


def _tuned_config(**changes):
    return dataclasses.replace(RMSNormSpace(N, torch.bfloat16).heuristic(), **changes)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tables.ENV_TUNED_DIR, str(tmp_path))
    monkeypatch.setattr(tables, "packaged_root", lambda: tmp_path / "packaged-empty")
    tables.reset_warnings()
    tables.clear_caches()
    yield tmp_path
    tables.clear_caches()


def _write(root, table, gpu=GPU):
    tables.write_table(tables.table_path(root, gpu, OP), table)
    tables.clear_caches()


def _table(entries, **overrides):
    t = tables.new_table(OP, GPU, "NVIDIA H200", "9.0")
    t["entries"] = entries
    t.update(overrides)
    return t


def test_missing_table_warns_once_and_uses_heuristic(user_dir):
    with pytest.warns(tables.TunedTableWarning, match="no tuned rms_norm config"):
        found = tables.lookup(OP, torch.bfloat16, N, 1000, GPU)
    assert found["source"] == "heuristic"
    assert found["config"] == RMSNormSpace(N, torch.bfloat16).heuristic()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tables.lookup(OP, torch.bfloat16, N, 1000, GPU)  # second time: no warning


def test_valid_table_is_used_with_nearest_rows_bucket(user_dir):
    small, large = _tuned_config(BLOCK_M_FWD=1), _tuned_config(BLOCK_M_FWD=4)
    _write(user_dir, _table([_entry(1024, small), _entry(65536, large)]))
    assert tables.lookup(OP, torch.bfloat16, N, 2000, GPU)["config"] == small
    found = tables.lookup(OP, torch.bfloat16, N, 30000, GPU)
    assert found["config"] == large and found["source"] == "user" and found["rows"] == 65536
    # dtype and n_cols must match exactly
    with pytest.warns(tables.TunedTableWarning):
        assert tables.lookup(OP, torch.float16, N, 2000, GPU)["source"] == "heuristic"


def test_user_dir_comes_before_packaged(user_dir, tmp_path, monkeypatch):
    packaged = tmp_path / "pkg"
    monkeypatch.setattr(tables, "packaged_root", lambda: packaged)
    _write(packaged, _table([_entry(4096, _tuned_config(BLOCK_M_FWD=8))]))
    _write(user_dir, _table([_entry(4096, _tuned_config(BLOCK_M_FWD=2))]))
    assert tables.lookup(OP, torch.bfloat16, N, 4096, GPU)["config"].BLOCK_M_FWD == 2
    (user_dir / GPU / f"{OP}.json").unlink()
    tables.clear_caches()
    found = tables.lookup(OP, torch.bfloat16, N, 4096, GPU)
    assert found["source"] == "packaged" and found["config"].BLOCK_M_FWD == 8


@pytest.mark.parametrize("override,reason", [
    ({"gpu": "a100"}, "tuned on GPU"),
    ({"triton_version": "2.1.0"}, "Triton"),
    ({"template_hash": "0123456789abcdef"}, "template"),
])
def test_foreign_table_warns_and_falls_back(user_dir, override, reason):
    # a foreign table filed under this GPU's folder (e.g. copied by hand) must still not be used
    _write(user_dir, _table([_entry(4096, _tuned_config(BLOCK_M_FWD=8))], **override))
    with pytest.warns(tables.TunedTableWarning, match=reason):
        found = tables.lookup(OP, torch.bfloat16, N, 4096, GPU)
    assert found["source"] == "heuristic"


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format_version": 1}', "", "[" * 100000 + "]" * 100000,
                                  '{"format_version": ' + "9" * 5000 + "}",
                                  json.dumps({"format_version": 1, "op": OP, "gpu": GPU, "template_hash": "x",
                                              "triton_version": "3", "entries": [{"dtype": "bfloat16"}]})])
def test_corrupt_table_warns_and_falls_back(user_dir, text):
    path = tables.table_path(user_dir, GPU, OP)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.warns(tables.TunedTableWarning):
        found = tables.lookup(OP, torch.bfloat16, N, 4096, GPU)
    assert found["source"] == "heuristic"


@pytest.mark.parametrize("changes,words", [
    ({"BLOCK_N": 64}, "BLOCK_N"),                       # too narrow for 256 columns: would compute garbage
    ({"TILES_PER_PROGRAM": 10**6, "dw_strategy": "blocked"}, "TILES_PER_PROGRAM"),  # would spin for minutes
    ({"BLOCK_M_FWD": 3}, "BLOCK_M_FWD"),                 # not a power of two: fails at launch
    ({"num_warps_bwd": 3}, "num_warps_bwd"),
    ({"BWD_PREFETCH": True}, "BWD_PREFETCH"),
])
def test_entry_with_invalid_config_is_not_used(user_dir, changes, words):
    bad = _tuned_config().to_dict() | changes
    t = _table([{"dtype": "bfloat16", "dims": {"n_cols": N}, "rows": 4096, "config": bad}])
    _write(user_dir, t)
    with pytest.warns(tables.TunedTableWarning, match=words):
        assert tables.lookup(OP, torch.bfloat16, N, 4096, GPU)["source"] == "heuristic"


def test_entry_whose_config_is_not_an_object_is_rejected(user_dir):
    t = _table([{"dtype": "bfloat16", "dims": {"n_cols": N}, "rows": 4096, "config": []}])
    _write(user_dir, t)
    with pytest.warns(tables.TunedTableWarning, match="corrupt"):
        assert tables.lookup(OP, torch.bfloat16, N, 4096, GPU)["source"] == "heuristic"


def test_no_gpu_means_heuristic_without_warning(user_dir):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tables.lookup(OP, torch.float32, N, 10, None)["source"] == "heuristic"


def test_heuristic_only_ignores_tables(user_dir):
    _write(user_dir, _table([_entry(4096, _tuned_config(BLOCK_M_FWD=8))]))
    with tables.heuristic_only():
        assert tables.lookup(OP, torch.bfloat16, N, 4096, GPU)["source"] == "heuristic"


def test_write_table_sorted_and_atomic(tmp_path):
    path = tables.table_path(tmp_path, GPU, OP)
    entries = [_entry(65536, _tuned_config()), _entry(1024, _tuned_config()), _entry(1024, _tuned_config(), "float16")]
    tables.write_table(path, _table(entries))
    data = tables.load_table(path)
    assert [(e["dtype"], e["rows"]) for e in data["entries"]] == [("bfloat16", 1024), ("bfloat16", 65536),
                                                                   ("float16", 1024)]
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    text = path.read_text()
    assert text == json.dumps(json.loads(text), indent=1, sort_keys=True) + "\n"


def test_packaged_tables_parse_and_belong_to_their_gpu():
    from liger_gen.codegen.spaces import space_for
    from liger_gen.ops import available_ops

    root = tables.packaged_root()
    ops = set()
    for path in root.glob("*/*.json"):
        table = tables.load_table(path)
        assert table["gpu"] == path.parent.name and table["op"] == path.stem
        ops.add(table["op"])
        for e in table["entries"]:
            space = space_for(table["op"], e["dims"], getattr(torch, e["dtype"]))
            assert not space.violations(space.config_cls.from_dict(e["config"])), (path, e["dims"], e["rows"])
    assert ops == set(available_ops())  # every op has a packaged (H200) table
