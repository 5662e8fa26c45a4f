"""The shape of the package: no import cycles, the machinery below ``ops/`` never imports the ops, and every op
is one spec that names its space, templates and custom ops."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "benchmarks" / "code_metrics.py")
code_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_metrics)


def test_the_import_graph_of_liger_gen_has_no_cycle():
    graph = code_metrics.import_graph()
    assert "liger_gen.runtime.ops" in graph and graph["liger_gen.functional"]  # the scan sees the package
    assert code_metrics.cycles(graph) == []
    assert code_metrics.package_cycles(graph) == set()


def test_the_cycle_finder_finds_a_cycle():
    assert code_metrics.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert code_metrics.package_cycles({"p.x.a": {"p.y.b"}, "p.y.b": {"p.x.c"}, "p.x.c": set()}) == {("x", "y")}


BELOW_THE_OPS = ("liger_gen.codegen", "liger_gen.runtime", "liger_gen.tuning", "liger_gen.files")
ABOVE = ("liger_gen.ops", "liger_gen.functional", "liger_gen.nn", "liger_gen.reference", "liger_gen.integrations",
         "liger_gen.bench", "liger_gen.examples", "liger_gen.cli")


def test_the_machinery_below_the_ops_never_imports_them():
    """What codegen, runtime and tuning import, directly or through each other, never reaches the ops or
    anything built on them: they are handed op specs instead. (The package's own ``__init__`` imports the ops, so
    that ``import liger_gen`` registers them; Python runs it first, but nothing below imports it back.)"""
    graph = code_metrics.import_graph()
    for start in (m for m in graph if m.startswith(BELOW_THE_OPS)):
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        reached = sorted(m for m in seen if m.startswith(ABOVE))
        assert reached == [], f"{start} imports {reached}"


def test_import_liger_gen_registers_every_custom_op(tmp_path):
    """A trace saved in one process loads in another after ``import liger_gen`` alone, and that import has
    loaded every op module (so every custom op is registered)."""
    path = tmp_path / "traced.pt"
    save = ("import torch, liger_gen; x = torch.randn(3, 8); w = torch.ones(8); "
            "f = torch.jit.trace(lambda x, w: liger_gen.functional.rms_norm(x, w), (x, w)); "
            f"f.save({str(path)!r})")
    load = ("import sys, torch, liger_gen; from liger_gen.ops import OP_MODULES; "
            "print(sorted(set(m for m in OP_MODULES.values() if m not in sys.modules))); "
            f"f = torch.jit.load({str(path)!r}); print(tuple(f(torch.randn(3, 8), torch.ones(8)).shape))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    for code in (save, load):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env=env)
        assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "(3,", "8)"], out.stdout


def test_every_op_is_one_spec_with_its_space_templates_and_custom_ops():
    from liger_gen.codegen.render import template_hash
    from liger_gen.codegen.spaces import template_names
    from liger_gen.ops import all_specs, available_ops, get_spec

    specs = all_specs()
    assert [s.name for s in specs] == list(available_ops())
    for spec in specs:
        assert spec is get_spec(spec.name)
        assert spec.space.op == spec.name and spec.problem.SPACE is spec.space and spec.problem.op == spec.name
        for name in template_names(spec.space):
            assert len(template_hash(name)) == 16
        assert spec.custom_ops, spec.name
        for qualname in spec.custom_ops:
            namespace, name = qualname.split("::")
            assert hasattr(getattr(torch.ops, namespace), name), qualname
    with pytest.raises(KeyError, match="unknown op 'nope'; known: rms_norm"):
        get_spec("nope")
