"""The ONNX export takes back what it made when it fails part-way: the directories above ``--out``
it created go with its temporary directory (the TensorRT build shares the mechanism)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import tiny_llama
from spec_plugins.exporters import onnx_export
from spec_plugins.exporters.onnx_export import export_models


def _failing_graph(*args, **kwargs):
    raise RuntimeError("export failed in the graph step")


def test_a_failed_export_removes_the_parents_it_created_and_keeps_those_it_found(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "graph_entry", _failing_graph)
    model = tiny_llama(vocab=32, seed=2)
    with pytest.raises(RuntimeError, match="graph step"):
        export_models(tmp_path / "new" / "a" / "out", (model, None, "tiny"))
    assert list(Path(tmp_path).iterdir()) == []
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("x")
    with pytest.raises(RuntimeError, match="graph step"):
        export_models(tmp_path / "old" / "b" / "out", (model, None, "tiny"))
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["keep.txt"]
