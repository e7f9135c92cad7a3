"""The package's layering: runtimes never import exporters (exporters may run runtimes), and the
shared graph layout lives in ``spec_plugins.graphs``, which imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_backends_never_import_exporters():
    for f in sorted((ROOT / "backends").glob("*.py")):
        bad = {m for m in _imports(f) if m.startswith("spec_plugins.exporters")}
        assert not bad, f"{f.name} imports {sorted(bad)}"


def test_graphs_import_neither_backends_nor_exporters():
    for f in sorted((ROOT / "spec_plugins" / "graphs").glob("*.py")):
        bad = {m for m in _imports(f) if m.startswith(("spec_plugins.exporters", "spec_plugins.backends"))}
        assert not bad, f"{f.name} imports {sorted(bad)}"


def test_the_import_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from spec_plugins.exporters.onnx_export import export_model\n")
    assert "spec_plugins.exporters.onnx_export" in _imports(f)


def _package_modules() -> dict[str, Path]:
    """Every module of the package by its import name (``backends/`` and ``exporters/`` are
    ``spec_plugins.backends`` / ``spec_plugins.exporters``)."""
    out = {}
    for base, pkg in ((ROOT / "spec_plugins", "spec_plugins"), (ROOT / "backends", "spec_plugins.backends"),
                      (ROOT / "exporters", "spec_plugins.exporters")):
        for f in base.rglob("*.py"):
            if base.name == "spec_plugins" and f.relative_to(base).parts[0] in ("backends", "exporters"):
                continue  # a development symlink to the directories above
            parts = list(f.relative_to(base).with_suffix("").parts)
            out[".".join([pkg] + (parts[:-1] if parts[-1] == "__init__" else parts))] = f
    return out


def _runtime_imports(path: Path) -> set[str]:
    """Modules imported anywhere in a file (inside functions too), except under ``if TYPE_CHECKING``."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.If) and isinstance(ch.test, ast.Name) and ch.test.id == "TYPE_CHECKING":
                continue
            if isinstance(ch, ast.Import):
                out.update(a.name for a in ch.names)
            elif isinstance(ch, ast.ImportFrom) and ch.module:
                out.update([ch.module] + [f"{ch.module}.{a.name}" for a in ch.names])
            visit(ch)

    visit(ast.parse(path.read_text()))
    return out


def import_circles() -> list[list[str]]:
    """Strongly connected groups of the package's modules under every runtime import, lazy ones
    included: an import made inside a function is still an edge, it only hides the circle."""
    mods = _package_modules()
    graph: dict[str, set[str]] = {}
    for m, f in mods.items():
        deps = set()
        for name in _runtime_imports(f):
            parts = name.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods), None)
            if target is not None and target != m and target != "spec_plugins":
                deps.add(target)
        graph[m] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in graph:
        if v not in index:
            strong(v)
    return circles


def test_no_import_circles():
    """No two modules of the package import each other, directly or through others, even lazily
    (the package's own ``__init__`` re-exports aside)."""
    assert import_circles() == []


def test_the_circle_check_finds_a_lazy_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "spec_plugins"
    pkg.mkdir()
    (pkg / "a.py").write_text("from spec_plugins.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from spec_plugins.a import y\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spec_plugins.a import y\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert import_circles() == [["spec_plugins.a", "spec_plugins.b"]]
