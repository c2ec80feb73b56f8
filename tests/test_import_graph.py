"""The package's modules import each other without a cycle, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "testbed"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every testbed module ``path`` imports anywhere in its text (top level or inside a function)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = ".".join(base[:len(base) - node.level + 1]) if node.level else ""
            mod = ".".join(x for x in (root, node.module) if x)
            # `from . import live` imports the module testbed.live; `from .schema import X` the module schema
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            # a submodule always runs its own package's __init__ first: that edge is Python's, not ours
            if t and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}
    return {m: _imports(p, m, set(files)) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert len(graph) > 30 and "testbed.units" in graph["testbed.run"]  # the walk sees the package
    assert cycles(graph) == []


def test_the_walk_finds_a_cycle_when_there_is_one():
    graph = import_graph()
    graph["testbed.schema"] = graph["testbed.schema"] | {"testbed.run"}  # run -> ... -> schema -> run
    found = cycles(graph)
    assert found and any({"testbed.schema", "testbed.run"} <= set(c) for c in found)


def test_function_level_imports_count(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("def f():\n    from .run import main\n    return main\n")
    assert _imports(p, "testbed.x", {"testbed.x", "testbed.run"}) == {"testbed.run"}
