"""ONNX exports, round 8: damaged graph files are refused by name (exit 2, not a protobuf or ONNX
Runtime traceback), each decoder graph takes its own config section's quantization, the config
target's feature_layers are exported, the manifest's quantization label is held to the graph,
and exporting a head leaves the live module as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from typer.testing import CliRunner  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from spec_plugins.cli import app  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.graphs.manifest import Manifest, ManifestError  # noqa: E402
from spec_plugins.graphs.quant import QuantScheme  # noqa: E402
from test_onnx_runtime import tiny_model_dir  # noqa: E402, F401  (a fixture: tiny llama + tokenizer on disk)

INT8 = QuantScheme(bits=8, block_size=16)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A float export (weights in the graph) and an int8 one (weights in ``.onnx.data``)."""
    root = tmp_path_factory.mktemp("round8")
    model = tiny_llama(vocab=32, seed=2, sharpness=4.0)
    export_models(root / "float", (model, None, "tiny"), feature_layers=())
    export_models(root / "int8", (model, None, "tiny"), feature_layers=(), quantize=INT8)
    return root, model


def _copy(exports, name, tmp_path):
    root, _ = exports
    d = tmp_path / name
    shutil.copytree(root / name, d)
    return d, Manifest.read(d).graph("verify")


# ---- 1. a damaged graph file -----------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "emptied", "weights truncated"])
def test_a_truncated_graph_or_weights_file_is_refused_by_name(exports, tmp_path, damage):
    """``size_bytes`` is what the export wrote (graph + external data); a file that no longer
    holds it gave a protobuf DecodeError (truncated graph), an ONNX Runtime error (an emptied
    graph, truncated weights) or ran."""
    d, g = _copy(exports, "int8" if damage == "weights truncated" else "float", tmp_path)
    f = d / (g.file + ".data" if damage == "weights truncated" else g.file)
    data = f.read_bytes()
    f.write_bytes(b"" if damage == "emptied" else data[: len(data) // 2])
    with pytest.raises(ManifestError, match=f"{f.name}.*(truncated or replaced)"):
        Manifest.read(d)


def test_a_graph_corrupted_in_place_fails_as_an_error_naming_it(exports, tmp_path):
    """Same size, bytes overwritten: ``Manifest.read`` cannot see it (no checksum), so building
    the session fails, and that failure is a ManifestError naming the file, not ONNX Runtime's
    own exception (which ``export check`` let through as a traceback with exit 1)."""
    from spec_plugins.backends.onnxruntime_runtime import create_session
    from spec_plugins.exporters.parity import check_export

    d, g = _copy(exports, "float", tmp_path)
    _corrupt(d / g.file)
    Manifest.read(d)  # the size is right
    with pytest.raises(ManifestError, match=f"cannot load graph .*{g.file}"):
        create_session(d / g.file, "cpu")
    with pytest.raises(ManifestError, match=f"cannot load graph .*{g.file}"):
        check_export(d, gamma=1, max_new_tokens=2, models={"tiny": exports[1]})


def _corrupt(f):
    """Overwrite 4000 bytes a third of the way into ``f``, keeping its size."""
    data = f.read_bytes()
    third = len(data) // 3
    f.write_bytes(data[:third] + b"\xff" * 4000 + data[third + 4000:])


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_graph_makes_generate_and_export_check_exit_2(tiny_model_dir, tmp_path, damage):  # noqa: F811
    out = tmp_path / "exp"
    target = {"backend": "onnxruntime", "model": str(tiny_model_dir), "device": "cpu"}
    (tmp_path / "c.json").write_text(json.dumps({"target": target}))
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "c.json"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    f = out / "verify.onnx"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        _corrupt(f)
    (tmp_path / "p.json").write_text(json.dumps({"target": {**target, "path": str(out)}}))
    for args in (["generate", "-c", str(tmp_path / "p.json"), "-p", "w1 w2", "-n", "2", "--raw"],
                 ["export", "check", str(out), "--gamma", "1", "--max-new-tokens", "2"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "error:" in res.output and "verify.onnx" in res.output, res.output


# ---- 2. and 3. each section's quantization, the target's feature layers -----------------------------
@pytest.mark.parametrize("target_q,draft_q", [("none", "int8"), ("int8", "none")])
def test_export_quantizes_each_graph_with_its_own_sections_scheme(tiny_model_dir, tmp_path, target_q, draft_q):  # noqa: F811
    """The target's ``quantize:`` was applied to the draft graph too, so the same config with
    ``path:`` refused the export it had just made."""
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder

    ort = {"backend": "onnxruntime", "model": str(tiny_model_dir), "device": "cpu"}
    target, draft = {**ort, "quantize": target_q}, {**ort, "quantize": draft_q}
    cfg = {"target": target, "proposer": {"type": "draft_model", "num_draft_tokens": 2, "model": draft}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = tmp_path / "exp"
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "c.json"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    man = Manifest.read(out)
    names = {g.name: (g.quantization or {}).get("name", "none") for g in man.graphs}
    assert names == {"verify": target_q if target_q == "none" else "int8-b32-sym-acc4",
                     "draft": draft_q if draft_q == "none" else "int8-b32-sym-acc4"}
    cfg["target"]["path"] = str(out)
    cfg["proposer"]["model"].update(path=str(out), graph="draft")
    dec = SpeculativeDecoder.from_config(SpecConfig.parse(cfg))  # the same config loads both graphs
    assert len(dec.generate([1, 2, 3], max_new_tokens=3).token_ids) == 3


def test_a_flag_that_disagrees_with_the_draft_sections_quantize_is_refused(tiny_model_dir, tmp_path):  # noqa: F811
    ort = {"backend": "onnxruntime", "model": str(tiny_model_dir), "device": "cpu"}
    cfg = {"target": ort, "proposer": {"type": "draft_model", "model": {**ort, "quantize": "int8"}}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "c.json"), "--out",
                                   str(tmp_path / "x"), "--quantize", "int4"])
    assert res.exit_code == 2, res.output
    assert "the config's proposer.model says quantize: int8" in res.output
    assert not (tmp_path / "x").exists()


def test_export_takes_the_config_targets_feature_layers(tiny_model_dir, tmp_path):  # noqa: F811
    """``--feature-layers auto`` exported low/mid/high ([2, 1, 1]) although the target said
    ``feature_layers: [1]``, so that target with ``path:`` refused the export."""
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

    target = {"backend": "onnxruntime", "model": str(tiny_model_dir), "device": "cpu", "feature_layers": [1]}
    (tmp_path / "c.json").write_text(json.dumps({"target": target}))
    out = tmp_path / "exp"
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "c.json"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert Manifest.read(out).graph("verify").feature_layers == [1]
    rt = OnnxRuntime.from_config(OnnxRuntime.Config(**target, path=str(out)))
    assert rt.capabilities.feature_layers == (1,)
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "c.json"), "--out",
                                   str(tmp_path / "y"), "--feature-layers", "2"])
    assert res.exit_code == 2 and "feature_layers: [1]" in res.output, res.output


# ---- 4. the quantization label -----------------------------------------------------------------------
@pytest.mark.parametrize("which", ["int8", "float"])
def test_a_quantization_label_the_graph_does_not_bear_out_is_refused(exports, tmp_path, which):
    """An int8 graph labelled null loaded with quantize: none and pad_single off (which keeps
    speculation exact on quantized graphs); a float graph labelled int8 loaded as int8."""
    d, _ = _copy(exports, which, tmp_path)
    man = json.loads((d / "manifest.json").read_text())
    man["graphs"][0]["quantization"] = None if which == "int8" else {"name": INT8.name, "accuracy_level": 4}
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ManifestError, match="quantization is .* but .* holds (quantized|no quantized)"):
        Manifest.read(d)


# ---- 5. exporting a head leaves the live module alone -------------------------------------------------
def test_exporting_a_head_leaves_the_live_module_as_it_was(tmp_path):
    """``export_head`` called ``module.float()`` on the caller's module: a float16 drafter exported
    on first use became float32 in place, its embeddings no longer the target's tensor."""
    from test_heads import eagle

    from spec_plugins.exporters.onnx_heads import check_head, export_head, export_head_file

    model = tiny_llama(vocab=32, seed=2).half()
    drafter = eagle(model).train()
    emb = drafter.embed_weight
    before = {n: t.dtype for n, t in [*drafter.named_parameters(), *drafter.named_buffers()]}
    export_head_file(drafter, tmp_path / "head.onnx")
    entry = export_head(drafter, tmp_path / "eagle.onnx", "eagle", "tiny", None)
    check_head(tmp_path, entry, None, 1e-4, module=drafter)
    after = {n: t.dtype for n, t in [*drafter.named_parameters(), *drafter.named_buffers()]}
    assert after == before and before["fuse.weight"] == torch.float16
    assert drafter.embed_weight is emb and emb.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert drafter.training


# ---- 6. an export moved with its project ------------------------------------------------------------
def test_trained_heads_load_from_the_model_of_a_moved_export(tiny_model_dir, tmp_path):  # noqa: F811
    """An export whose recorded model path is gone but whose config names the moved model (same
    directory name) is accepted: plain decoding ran, but Medusa and EAGLE loaded the LM head and
    embeddings from the recorded, missing path. Both now decode as plain greedy does."""
    from helpers import save_random_heads
    from transformers import AutoModelForCausalLM

    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder

    a = tmp_path / "A" / "tiny-model"
    shutil.copytree(tiny_model_dir, a)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"target": {"backend": "torch", "model": str(a)}}))
    assert CliRunner().invoke(app, ["export", "onnx", "--config", str(cfg), "--out", str(tmp_path / "exp"),
                                     "--feature-layers", "1,2"]).exit_code == 0
    b = tmp_path / "B" / "tiny-model"
    b.parent.mkdir()
    shutil.move(str(a), str(b))
    heads = save_random_heads(AutoModelForCausalLM.from_pretrained(str(b)).eval(), tmp_path / "heads")
    target = {"backend": "onnxruntime", "model": str(b), "path": str(tmp_path / "exp")}
    want = SpeculativeDecoder.from_config(SpecConfig.parse({"target": target})).generate([1, 2, 3], 6).token_ids
    for kind in ("medusa", "eagle"):
        dec = SpeculativeDecoder.from_config(SpecConfig.parse({"target": target,
                                                               "proposer": {"type": kind, "heads": str(heads[kind])}}))
        assert dec.generate([1, 2, 3], 6).token_ids == want, kind
