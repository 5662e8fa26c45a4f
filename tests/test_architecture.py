"""The shape of the package: no import cycles, the machinery below ``ops/`` never imports the ops, the ops import
along their families, and every op is one spec that names its space, templates and custom ops."""

import ast
import importlib.util
import pickle
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


# The op families (``liger_gen/ops/<family>/``) and each one's shared module. Every other module of a family is an
# op module; ``liger_gen.ops.rope`` is an op module of no family.
# The fp8 family's shared module is its quantize op, which imports no op: the FP8 linear layers build on it (the
# recipe every FP8-emitting kernel follows is below ops/, in liger_gen.runtime.fp8).
# The optim family's one op, adamw, is its shared module as well.
FAMILIES = {"norms": "row_norm", "glu": "activations", "lm_head": "chunks", "divergence": "rows", "fp8": "quantize",
            "optim": "adamw"}
# Declared edges between families: the LM-head losses include distillation, a divergence of the head's logits, so
# they may import the divergence family's shared module (its per-row JSD); nothing else crosses families.
CROSS_FAMILY = {"lm_head": {"liger_gen.ops.divergence.rows"}}
# Old module paths kept so that pickles naming them load (a pickle names a class by its defining module).
COMPAT = {"liger_gen.ops.layer_norm": {"liger_gen.ops.norms.layer_norm"}}


def _family(module: str) -> str | None:
    """The family of a module under ``liger_gen.ops`` (its package, or a module in it), else None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in FAMILIES else None


def private_imports(modules: dict[str, Path]) -> dict[str, list[str]]:
    """module → the ``_private`` names it takes from other ``liger_gen`` modules (``from m import _x``)."""
    out: dict[str, list[str]] = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("liger_gen"):
                out.setdefault(name, []).extend(f"{node.module}.{a.name}" for a in node.names
                                                if a.name.startswith("_") and not a.name.startswith("__"))
    return out


def family_violations(graph: dict[str, set[str]], private: dict[str, list[str]]) -> list[str]:
    """What breaks the family rule: an op module imports only its own family's modules and the machinery below
    ``ops/`` (plus ``CROSS_FAMILY``'s declared edges), never another module's ``_private`` name; a family's
    shared module imports none of the ops; the compatibility aliases import only their new home, and nothing
    imports them."""
    problems: list[str] = []
    ops = sorted(m for m in graph if m == "liger_gen.ops" or m.startswith("liger_gen.ops."))
    for module in ops:
        problems += [f"{module} imports the private name {n}" for n in private.get(module, [])]
        deps = graph[module]
        if module == "liger_gen.ops":
            continue
        if module in COMPAT:
            problems += [f"{module} (an old path kept for pickles) imports {d}" for d in sorted(deps - COMPAT[module])]
            continue
        family = _family(module)
        shared = family is not None and module == f"liger_gen.ops.{family}.{FAMILIES[family]}"
        for dep in sorted(deps):
            if dep in COMPAT:
                problems.append(f"{module} imports {dep}, an old path kept only for pickles")
            elif not dep.startswith(ABOVE):
                continue  # the machinery below the ops
            elif shared and dep.startswith("liger_gen.ops"):
                problems.append(f"{module} (the {family} family's shared module) imports the op module {dep}")
            elif family is not None and _family(dep) == family:
                continue
            elif dep in CROSS_FAMILY.get(family, ()):
                continue
            else:
                problems.append(f"{module} ({family or 'no'} family) imports {dep}")
    return problems


def test_the_ops_import_along_their_families():
    graph = code_metrics.import_graph()
    assert "liger_gen.ops.norms.row_norm" in graph and graph["liger_gen.ops.norms.rms_norm"]  # the scan sees them
    for family, shared in FAMILIES.items():
        assert f"liger_gen.ops.{family}.{shared}" in graph, (family, shared)
    for module in code_metrics.modules():
        if module.startswith("liger_gen.ops."):
            parts = module.split(".")
            assert parts[2] in FAMILIES or module in COMPAT or module == "liger_gen.ops.rope", \
                f"{module} is in no family: put it under one of {sorted(FAMILIES)} or name it in this test"
    assert family_violations(graph, private_imports(code_metrics.modules())) == []


def test_the_family_rule_finds_each_kind_of_violation():
    graph = {
        "liger_gen.ops": set(),
        "liger_gen.ops.norms.row_norm": {"liger_gen.runtime.ops", "liger_gen.ops.norms.rms_norm"},
        "liger_gen.ops.norms.rms_norm": {"liger_gen.ops.norms.row_norm", "liger_gen.codegen.spec"},
        "liger_gen.ops.glu.glu": {"liger_gen.ops.norms.row_norm", "liger_gen.ops.glu.activations"},
        "liger_gen.ops.glu.activations": set(),
        "liger_gen.ops.lm_head.fused_linear_jsd": {"liger_gen.ops.divergence.rows", "liger_gen.ops.lm_head.chunks"},
        "liger_gen.ops.lm_head.chunks": set(),
        "liger_gen.ops.divergence.rows": set(),
        "liger_gen.ops.divergence.jsd": {"liger_gen.ops.lm_head.chunks", "liger_gen.ops.layer_norm"},
        "liger_gen.ops.layer_norm": {"liger_gen.ops.norms.layer_norm"},
        "liger_gen.ops.norms.layer_norm": {"liger_gen.ops.norms.row_norm"},
    }
    private = {"liger_gen.ops.norms.rms_norm": ["liger_gen.ops.norms.row_norm._helper"]}
    assert family_violations(graph, private) == [
        "liger_gen.ops.divergence.jsd imports liger_gen.ops.layer_norm, an old path kept only for pickles",
        "liger_gen.ops.divergence.jsd (divergence family) imports liger_gen.ops.lm_head.chunks",
        "liger_gen.ops.glu.glu (glu family) imports liger_gen.ops.norms.row_norm",
        "liger_gen.ops.norms.rms_norm imports the private name liger_gen.ops.norms.row_norm._helper",
        "liger_gen.ops.norms.row_norm (the norms family's shared module) imports the op module "
        "liger_gen.ops.norms.rms_norm",
    ]


def test_pickles_naming_the_modules_before_the_families_load():
    """``torch.save(model)`` pickles a patched model's ``LayerNorm`` and ``GLUMLP`` by their defining modules, which
    were ``liger_gen.ops.layer_norm`` and ``liger_gen.ops.glu`` before the ops were grouped by family (and
    ``liger_gen.ops.glu.glu`` for ``GLUMLP`` before it got its own module)."""
    import liger_gen.nn as lnn

    linear = torch.nn.Linear
    mlp = lnn.GLUMLP("silu", linear(16, 8), gate_proj=linear(8, 16), up_proj=linear(8, 16))
    for module, new, olds in ((lnn.LayerNorm(8), b"liger_gen.ops.norms.layer_norm\n", [b"liger_gen.ops.layer_norm\n"]),
                              (mlp, b"liger_gen.ops.glu.mlp\n", [b"liger_gen.ops.glu\n", b"liger_gen.ops.glu.glu\n"])):
        data = pickle.dumps(module, protocol=0)  # protocol 0 names modules as text lines
        assert new in data
        for old in olds:
            assert type(pickle.loads(data.replace(new, old))) is type(module)


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
