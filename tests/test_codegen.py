"""Rendering and the content-addressed kernel cache."""

import multiprocessing as mp
import os

import jinja2
import pytest
import torch

from liger_gen.codegen import build, render
from liger_gen.ops.rms_norm import RMSNormSpace


def _params(**changes):
    return {**RMSNormSpace(200, torch.float32).heuristic().to_dict(), "casting_mode": "llama", **changes}


def test_render_is_deterministic_and_strict():
    a = render.render("rms_norm", _params())
    assert a == render.render("rms_norm", dict(reversed(list(_params().items()))))
    assert a != render.render("rms_norm", _params(casting_mode="gemma"))
    params = _params()
    del params["BLOCK_M_BWD"]
    with pytest.raises(jinja2.UndefinedError, match="BLOCK_M_BWD"):
        render.render("rms_norm", params)
    compile(a, "rms_norm.py", "exec")  # valid Python
    assert len(render.template_hash("rms_norm")) == 16


@pytest.mark.parametrize("strategy", ["blocked", "persistent"])
def test_variants_render_each_strategy(strategy):
    text = render.render("rms_norm", _params(dw_strategy=strategy))
    assert ("tl.num_programs(0)" in text) == (strategy == "persistent")


def test_cache_rewrites_tampered_file_before_import(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGER_GEN_CACHE_DIR", str(tmp_path / "k"))
    path, source = build.materialize("rms_norm", _params(BLOCK_M_FWD=2))
    good = path.read_text()
    assert good == source
    path.write_text("raise SystemExit('tampered')\n")
    assert build.materialize("rms_norm", _params(BLOCK_M_FWD=2))[0] == path
    assert path.read_text() == good
    module = build.load_variant("rms_norm", _params(BLOCK_M_FWD=2))
    assert module.BLOCK_M_FWD == 2
    # executed from the verified text in memory: no bytecode cache that could be swapped behind our back
    assert not (path.parent / "__pycache__").exists()


def test_cache_refuses_group_writable_dir(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setenv("LIGER_GEN_CACHE_DIR", str(d))
    with pytest.raises(PermissionError, match="writable"):
        build.cache_dir()


def _materialize(args):
    cache, n = args
    os.environ["LIGER_GEN_CACHE_DIR"] = cache
    return [str(build.materialize("rms_norm", _params(BLOCK_M_FWD=1 + i % 2))[0]) for i in range(n)]


def test_concurrent_writers_leave_complete_files(tmp_path):
    cache = str(tmp_path / "c")
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.map(_materialize, [(cache, 20), (cache, 20)])
    paths = set(results[0]) | set(results[1])
    assert len(paths) == 2
    for p in paths:
        text = open(p).read()
        assert render.source_hash(text) in p
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]
