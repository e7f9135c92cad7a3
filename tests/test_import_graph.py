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
