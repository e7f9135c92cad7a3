"""``export onnx`` and ``export check`` at their edges: the config target's quantization, a float16
export's head graph checked alone, the quantized weights file's mode, ``--json`` on a shape
mismatch, and an ``--out`` that cannot be written although ``os.access`` says it can."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from typer.testing import CliRunner  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from spec_plugins.cli import app  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.exporters.parity import ParityReport, check_export  # noqa: E402
from spec_plugins.exporters.parity_rule import compare  # noqa: E402
from spec_plugins.graphs.manifest import Manifest  # noqa: E402
from spec_plugins.graphs.quant import QuantScheme  # noqa: E402
from test_onnx_runtime import tiny_model_dir  # noqa: E402, F401  (a fixture: tiny llama + tokenizer on disk)


def _strict_json(text: str) -> dict:
    """``text`` parsed as JSON proper: Infinity and NaN, which Python's json accepts, are refused."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# ---- 1. export onnx takes the config target's quantize ---------------------------------------------
def test_export_onnx_takes_the_config_targets_quantize(tiny_model_dir, tmp_path):  # noqa: F811
    """A target {backend: onnxruntime, dtype: float16, quantize: int8} was exported float16 but not
    quantized, so the same target with ``path:`` refused the export. The config's scheme is
    exported; a --quantize that says otherwise is refused, naming both, before anything is written."""
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

    target = {"backend": "onnxruntime", "model": str(tiny_model_dir), "dtype": "float16", "quantize": "int8"}
    cfg = tmp_path / "ortq.json"
    cfg.write_text(json.dumps({"target": target}))
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(cfg), "--out", str(tmp_path / "q")])
    assert res.exit_code == 0, res.output
    g = Manifest.read(tmp_path / "q").graph("verify")
    assert g.dtype == "float16" and (g.quantization or {}).get("name") == "int8-b32-sym-acc4", g
    rt = OnnxRuntime.from_config(OnnxRuntime.Config(**target, path=str(tmp_path / "q")))  # the same target loads it
    assert rt.vocab_size == 32

    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(cfg), "--out", str(tmp_path / "q4"),
                                   "--quantize", "int4"])
    assert res.exit_code == 2, res.output
    assert "--quantize asks for int4-b32-sym-acc4" in res.output and "quantize: int8 (int8-b32-sym-acc4)" in res.output
    assert not (tmp_path / "q4").exists()


# ---- 2. export check --graph eagle on a float16 export ---------------------------------------------
def test_head_graph_of_a_float16_export_checks_alone(tiny_model_dir, tmp_path):  # noqa: F811
    """The EAGLE graph of a float16 export is traced over the float16 target's weights. Checked
    with the verify graph it passed (the float16 model was loaded first and cached by name);
    checked alone (--graph eagle) its head was rebuilt on a float32 model and failed."""
    from helpers import save_random_heads

    from spec_plugins.config import SpecConfig
    from spec_plugins.exporters.onnx_export import export_config

    heads = save_random_heads(tiny_llama(vocab=32, seed=4, sharpness=4.0), tmp_path / "heads")
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": str(tiny_model_dir), "dtype": "float16"},
                            "proposer": {"type": "eagle", "heads": str(heads["eagle"])}})
    export_config(cfg, tmp_path / "exp")
    assert [g.dtype for g in Manifest.read(tmp_path / "exp").graphs] == ["float16", "float32"]
    alone = check_export(tmp_path / "exp", gamma=1, max_new_tokens=4, only=["eagle"])
    assert alone.cases and all(c.graph == "eagle" for c in alone.cases)
    assert alone.ok, alone.format()
    whole = check_export(tmp_path / "exp", gamma=1, max_new_tokens=4)
    assert whole.ok, whole.format()
    eagle = [(c.case, c.max_abs) for c in whole.cases if c.graph == "eagle"]
    assert eagle == [(c.case, c.max_abs) for c in alone.cases]  # the same comparison either way


# ---- 3. quantized weights file mode ---------------------------------------------------------------
def test_quantized_weights_file_has_the_export_files_mode(tmp_path):
    """onnx writes external data owner-only (0600): a quantized export's weights were unreadable to
    other users though the export directory is made 0755 for them. They get the umask's mode, as
    every other file of the export."""
    old = os.umask(0o022)
    try:
        export_models(tmp_path / "q", (tiny_llama(vocab=32, seed=2), None, "tiny"), feature_layers=(),
                      quantize=QuantScheme(bits=8))
    finally:
        os.umask(old)
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "q").iterdir() if p.is_file()}
    data = "verify.int8-b32-sym-acc4.onnx.data"
    assert data in files, files
    assert files == {name: 0o644 for name in files}, {n: oct(m) for n, m in files.items()}


# ---- 4. export check --json on a shape mismatch ---------------------------------------------------
def _mismatched_report() -> ParityReport:
    """A report holding a head graph's output of the wrong shape (max|diff| inf) and a good case."""
    import torch

    bad = compare("medusa", "random B=1", torch.zeros(1, 2, 4), torch.zeros(1, 3, 4), 1e-4)
    good = compare("medusa", "random B=2", torch.ones(2, 3, 4), torch.ones(2, 3, 4), 1e-4)
    return ParityReport("exp", tolerances={"medusa": 1e-4}, cases=[bad, good])


def test_report_of_a_shape_mismatch_is_valid_json():
    """A shape mismatch's max|diff| is inf, which json.dumps wrote as Infinity (not JSON): the
    report writes null there, and the case still fails, naming the shapes."""
    d = _mismatched_report().to_dict()
    back = _strict_json(json.dumps(d, allow_nan=False))
    bad, good = back["cases"]
    assert bad["max_abs"] is None and bad["rel"] is None and bad["ok"] is False
    assert "(shape (1, 2, 4) != (1, 3, 4))" in bad["case"]
    assert good["max_abs"] == 0.0 and good["ok"] is True
    assert back["ok"] is False and back["max_abs"] is None


def test_export_check_json_prints_valid_json_on_a_shape_mismatch(tmp_path, monkeypatch):
    from spec_plugins.exporters import parity

    monkeypatch.setattr(parity, "check_export", lambda *a, **k: _mismatched_report())
    res = CliRunner().invoke(app, ["export", "check", str(tmp_path), "--json"])
    assert res.exit_code == 1, res.output
    back = _strict_json(res.stdout)
    assert back["ok"] is False and back["cases"][0]["max_abs"] is None


# ---- 5. an --out that cannot be written -----------------------------------------------------------
def _cli_export(model_dir: Path, out: Path, tmp_path: Path) -> object:
    """``export onnx`` of the torch model in ``model_dir`` into ``out`` (its config in ``tmp_path``)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"target": {"backend": "torch", "model": str(model_dir)}}))
    return CliRunner().invoke(app, ["export", "onnx", "--config", str(cfg), "--out", str(out)])


def test_out_that_cannot_be_created_is_refused_before_the_model_loads(tiny_model_dir, tmp_path,  # noqa: F811
                                                                      monkeypatch):
    """Root under /sys passes os.access, then creating the export's temporary directory failed
    with a PermissionError traceback after the model had loaded. Refused first, by name."""
    from spec_plugins.backends import torch_runtime

    parent = tmp_path / "locked"
    parent.mkdir()
    real_mkdtemp, real_load = tempfile.mkdtemp, torch_runtime.load_weights

    def mkdtemp(suffix=None, prefix=None, dir=None):  # tempfile.mkdtemp's signature
        if dir is not None and Path(dir) == parent:
            raise PermissionError(1, "Operation not permitted", str(parent / ".x"))
        return real_mkdtemp(suffix, prefix, dir)

    loads = []
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(torch_runtime, "load_weights", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    res = _cli_export(tiny_model_dir, parent / "out", tmp_path)
    assert res.exit_code == 2 and not isinstance(res.exception, PermissionError), res.output
    assert f"--out {parent / 'out'}: cannot create it under {parent} (Operation not permitted)" in res.output
    assert loads == [] and list(parent.iterdir()) == []


def test_failed_write_of_out_is_an_error_line_with_nothing_left(tiny_model_dir, tmp_path,  # noqa: F811
                                                                  monkeypatch):
    """Writing --out may still fail once the export runs (the disk fills, a permission changes):
    any OSError there is the usual ``error:`` line, and no partial export is left behind."""
    from spec_plugins.exporters import onnx_export

    def refuse(tmp: Path, out: Path) -> None:
        raise PermissionError(13, "Permission denied", str(out))

    (tmp_path / "w").mkdir()
    monkeypatch.setattr(onnx_export, "move_into_place", refuse)
    res = _cli_export(tiny_model_dir, tmp_path / "w" / "out", tmp_path)
    assert res.exit_code == 2 and not isinstance(res.exception, PermissionError), res.output
    assert f"error: [Errno 13] Permission denied: '{tmp_path / 'w' / 'out'}'" in res.output
    assert list((tmp_path / "w").iterdir()) == []
