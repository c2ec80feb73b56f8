"""No module of the package uses another module's private names: ``from X import _name`` and
``X._name`` (X a module of the package) stay inside X. A name that crosses a module boundary is
public; a private module (``_cli``) may be imported, its names only if they are public."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "testbed"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(pkg: Path) -> dict[str, Path]:
    out = {}
    for path in pkg.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def private_uses(pkg: Path) -> list[str]:
    """``path:line: module.name`` for every use of another module's private name in package ``pkg``."""
    modules = _modules(pkg)
    top = pkg.name
    found = []
    for name, path in sorted(modules.items()):
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound: dict[str, str] = {}  # local name -> the package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == top:
                        bound[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom):
                root = ".".join(base[:len(base) - node.level + 1]) if node.level else ""
                mod = ".".join(x for x in (root, node.module) if x)
                if mod.split(".")[0] != top:
                    continue
                for a in node.names:
                    if f"{mod}.{a.name}" in modules:  # a module: its private names are checked where used
                        bound[a.asname or a.name] = f"{mod}.{a.name}"
                    elif _private(a.name) and mod != name:
                        found.append(f"{path.relative_to(pkg.parent)}:{node.lineno}: {mod}.{a.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain = _dotted(node.value)
            if not chain or chain[0] not in bound:
                continue
            mod = ".".join([bound[chain[0]]] + chain[1:])
            if mod in modules and mod != name:
                found.append(f"{path.relative_to(pkg.parent)}:{node.lineno}: {mod}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    assert len(_modules(PKG)) > 30 and "testbed.live.run" in _modules(PKG)  # the walk sees the package
    assert private_uses(PKG) == []


def test_the_scan_finds_each_form_of_a_private_use(tmp_path):
    """A package written with every form the rule forbids (and the forms it allows): the scan names
    exactly the forbidden ones."""
    pkg = tmp_path / "pkgx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_cli.py").write_text("def entry(): pass\n")
    (pkg / "a.py").write_text("_HIDDEN = 1\n\ndef _own():\n    return _HIDDEN\n\nclass C:\n    def f(self):\n"
                              "        return self._x\n")
    (pkg / "sub" / "__init__.py").write_text("from ..a import _own\n")  # 1: relative, from a subpackage
    (pkg / "sub" / "b.py").write_text(
        "from .. import a\n"
        "from ..a import C\n"
        "from .._cli import entry\n"          # allowed: a public name of a private module
        "import pkgx.a\n"
        "import pkgx.a as aa\n"
        "from pkgx.a import _HIDDEN as h\n"   # 2: absolute, renamed
        "x = a._HIDDEN\n"                     # 3: module attribute
        "y = pkgx.a._own\n"                   # 4: through the package's dotted path
        "z = aa._own\n"                       # 5: through an alias
        "w = C()._x + a.__name__.__len__()\n"  # allowed: an object's attribute, dunders
        "entry()\n")
    got = private_uses(pkg)
    assert sorted(g.split(": ")[1] for g in got) == ["pkgx.a._HIDDEN", "pkgx.a._HIDDEN", "pkgx.a._own", "pkgx.a._own",
                                                     "pkgx.a._own"], got
    assert any(g.startswith(str(Path("pkgx/sub/__init__.py")) + ":1:") for g in got)
