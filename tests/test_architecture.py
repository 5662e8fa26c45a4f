"""The shape of the package: no import cycles, the machinery below ``ops/`` never imports the ops, and every op
is one spec that names its space, templates and custom ops."""

import importlib.util
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


@pytest.mark.parametrize("module", ["liger_gen.runtime.ops", "liger_gen.runtime.tables", "liger_gen.runtime.binding",
                                    "liger_gen.codegen.spec", "liger_gen.codegen.build", "liger_gen.tuning.tuner",
                                    "liger_gen.tuning.report"])
def test_the_machinery_below_the_ops_does_not_import_them(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.startswith(('liger_gen.ops', 'liger_gen.functional'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


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
