"""Shape of the code base: lines per package, import cycles inside ``liger_gen``, bytes of the shipped tables.

    python benchmarks/code_metrics.py

The import graph has one node per module of ``liger_gen`` and an edge A → B wherever A imports B, at module
level or inside a function (``from pkg import name`` counts as importing ``pkg.name`` when that is a module).
A package is not counted as imported by its own submodules: Python runs it first, but it does not import back.
``tests/test_architecture.py`` asserts that this graph has no cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "liger_gen"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module → the ``liger_gen`` modules it imports anywhere in its text."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                while target and target not in mods:  # "liger_gen.ops.norms.rms_norm.rms_norm" → its module
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def package_cycles(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Pairs of subpackages (``ops``, ``runtime``, ...) that import each other, directly or through others."""
    def top(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    edges: dict[str, set[str]] = {}
    for a, bs in graph.items():
        for b in bs:
            if top(a) != top(b):
                edges.setdefault(top(a), set()).add(top(b))

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            v = todo.pop()
            for w in edges.get(v, ()):
                if w == b:
                    return True
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return False

    names = sorted(edges)
    return {(a, b) for i, a in enumerate(names) for b in names[i + 1:] if reaches(a, b) and reaches(b, a)}


def lines(folder: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in folder.rglob("*.py"))


def main() -> None:
    for sub in ("ops", "bench", "codegen", "tuning", "runtime", "templates"):
        folder = PACKAGE / sub
        if not folder.is_dir():
            continue
        n = lines(folder) if sub != "templates" else sum(len(p.read_text().splitlines())
                                                          for p in folder.glob("*.jinja"))
        print(f"lines {sub:<10} {n:>6}")
    graph = import_graph()
    found = cycles(graph)
    print(f"import cycles (modules in one strongly connected component): {len(found)}")
    for comp in found:
        print("   ", " ⇄ ".join(m.removeprefix("liger_gen.") for m in comp))
    pairs = package_cycles(graph)
    print(f"subpackage pairs that import each other: {len(pairs)}",
          ", ".join(f"{a}⇄{b}" for a, b in sorted(pairs)))
    tables = sorted((PACKAGE / "tuned").rglob("*.json"))
    shipped = [p for p in tables if not p.name.endswith(".trials.json")]
    trials = [p for p in tables if p.name.endswith(".trials.json")]
    print(f"shipped table bytes: {sum(p.stat().st_size for p in shipped)} in {len(shipped)} files"
          f" (trial logs beside them: {sum(p.stat().st_size for p in trials)} in {len(trials)} files)")


if __name__ == "__main__":
    main()
