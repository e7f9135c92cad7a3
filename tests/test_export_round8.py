"""ONNX export and the ONNX Runtime section, round 8: a llama.cpp section's ``dtype`` (its KV
cache's type) is not taken for the graph's weights, a bare LookupError prints more than
``error: None``, ``device_id`` with ``device: cpu`` and an unknown ``graph`` are refused by field,
and a draft model's load error names its config section."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from typer.testing import CliRunner  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from spec_plugins.cli import app  # noqa: E402
from spec_plugins.config import ConfigError, SpecConfig  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.graphs.manifest import Manifest, ManifestError  # noqa: E402
from test_onnx_runtime import tiny_model_dir  # noqa: E402, F401  (a fixture: tiny llama + tokenizer on disk)


def _export(cfg: dict, tmp_path, out) -> object:
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    return CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "c.json"), "--out", str(out)])


# ---- 1. a llama.cpp section exports its model in float32 -----------------------------------------
@pytest.mark.parametrize("kv_dtype", [None, "float16"])
def test_export_of_a_llamacpp_config_writes_float32_graphs(tiny_model_dir, tmp_path, kv_dtype):  # noqa: F811
    """A llama.cpp section always has ``dtype`` (None, or its KV cache's type); the exporter took it
    for the weights' dtype and ``export onnx`` failed with ``error: None``."""
    llama = {"backend": "llamacpp", "model": str(tiny_model_dir), "dtype": kv_dtype}
    cfg = {"target": llama, "proposer": {"type": "draft_model", "model": llama}}
    out = tmp_path / "exp"
    res = _export(cfg, tmp_path, out)
    assert res.exit_code == 0, res.output
    assert {g.name: g.dtype for g in Manifest.read(out).graphs} == {"verify": "float32", "draft": "float32"}


def test_torch_and_onnxruntime_sections_keep_their_own_dtype(tiny_model_dir, tmp_path):  # noqa: F811
    """Their ``dtype`` is the weights' dtype: float16 sections export float16 graphs."""
    torch_t = {"backend": "torch", "model": str(tiny_model_dir), "dtype": "float16"}
    ort_d = {"backend": "onnxruntime", "model": str(tiny_model_dir), "dtype": "float16"}
    out = tmp_path / "exp"
    res = _export({"target": torch_t, "proposer": {"type": "draft_model", "model": ort_d}}, tmp_path, out)
    assert res.exit_code == 0, res.output
    assert {g.name: g.dtype for g in Manifest.read(out).graphs} == {"verify": "float16", "draft": "float16"}


@pytest.mark.parametrize("command", ["onnx", "check"])
def test_a_bare_lookup_error_is_printed_with_its_type_and_origin(tiny_model_dir, tmp_path, monkeypatch,  # noqa: F811
                                                                  command):
    """``str(KeyError(None))`` is ``None``: the command printed ``error: None``."""
    from spec_plugins.exporters import onnx_export, parity

    def lookup(*_a, **_k):
        return {}[None]

    monkeypatch.setattr(onnx_export, "export_config", lookup)
    monkeypatch.setattr(parity, "check_export", lookup)
    if command == "onnx":
        res = _export({"target": {"backend": "torch", "model": str(tiny_model_dir)}}, tmp_path, tmp_path / "x")
    else:
        res = CliRunner().invoke(app, ["export", "check", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "error: unexpected KeyError(None) raised in lookup (test_export_round8.py:" in res.output, res.output


def test_a_lookup_error_with_a_message_is_printed_as_it_is():
    from spec_plugins.cli import error_message

    assert error_message(KeyError("no recorded output for a prompt")) == "no recorded output for a prompt"
    assert error_message(LookupError("no backend 'x'")) == "no backend 'x'"
    assert error_message(KeyError("x")) == "unexpected KeyError('x')"


# ---- 2. the onnxruntime section's device_id and graph ---------------------------------------------
def _ort(**fields) -> SpecConfig:
    return SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "smollm2-135m-instruct", **fields}})


def test_device_id_with_device_cpu_is_refused_by_field():
    with pytest.raises(ConfigError, match="target: device_id: 3 picks a CUDA device, but device is cpu"):
        _ort(device="cpu", device_id=3)
    with pytest.raises(ConfigError, match="proposer: model: device_id: 1 picks a CUDA device"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "smollm2-135m-instruct"},
                          "proposer": {"type": "draft_model", "model": {"backend": "onnxruntime", "device": "cpu",
                                                                        "model": "smollm2-135m-instruct",
                                                                        "device_id": 1}}})
    for ok in (_ort(device="cpu"), _ort(device="cpu", device_id=0), _ort(device="cuda", device_id=3),
               _ort(device_id=2)):
        assert SpecConfig.parse(ok.model_dump(mode="json")) == ok  # a dumped config carries every field


@pytest.mark.parametrize("graph", ["foo", "medusa-block", "Verify"])
def test_a_graph_no_export_holds_is_refused_by_field(graph):
    """``graph`` was any string, refused only once the manifest was read. A head graph's name is
    taken and refused on load by its kind (test_onnx_runtime's medusa export)."""
    with pytest.raises(ConfigError, match="target: graph: Input should be 'verify', 'draft', 'medusa', 'eagle'"):
        _ort(graph=graph)
    assert [_ort(graph=g).target.graph for g in ("draft", "parallel-block")] == ["draft", "parallel-block"]


# ---- 3. a draft model's load error names its section ----------------------------------------------
@pytest.fixture(scope="module")
def draft_export(tmp_path_factory):
    """An export of a target and a draft graph (tiny llamas), and one of a target alone."""
    root = tmp_path_factory.mktemp("drafts")
    model, draft = tiny_llama(vocab=32, seed=2), tiny_llama(vocab=32, seed=3)
    export_models(root / "both", (model, None, "tiny"), draft=(draft, "tiny-draft"), feature_layers=())
    export_models(root / "verify", (model, None, "tiny"), feature_layers=())
    return root


@pytest.mark.parametrize("section,error,message", [
    ({"path": "both", "model": "tiny-draft", "dtype": "float16"}, ValueError,
     r"proposer\.model: path \S+both holds graph 'draft' in float32, but the config asks for dtype: float16"),
    ({"path": "both", "model": "other"}, ValueError,
     r"proposer\.model: path \S+both holds graph 'draft' exported from model 'tiny-draft'"),
    ({"path": "verify", "model": "tiny"}, ManifestError,
     r"proposer\.model: no graph 'draft' in the export; it holds: verify"),
])
def test_a_draft_models_load_error_names_its_config_section(draft_export, section, error, message):
    from spec_plugins.proposers.draft_model import DraftModelProposer

    fields = {"backend": "onnxruntime", "device": "cpu", "graph": "draft", **section,
              "path": str(draft_export / section["path"])}
    with pytest.raises(error, match=message) as caught:
        DraftModelProposer(DraftModelProposer.Config(model=fields))
    assert type(caught.value) is error and isinstance(caught.value.__cause__, error)
    assert not str(caught.value.__cause__).startswith("proposer.model")  # the runtime's own words
