"""Export round 14: the quantized parity bound by the scheme's bits (one projection's weights lost
in an int8 graph passed the 4-bit bound), a damaged first-use export in the cache exported again
(every later load failed asking for an export no command makes), and the GGUF grid on a model
that is not a GGUF refused before the export traces anything."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.exporters.parity import QUANT_RTOL, QUANT_RTOL_BITS, check_export  # noqa: E402
from spec_plugins.graphs.manifest import Manifest, ManifestError  # noqa: E402
from spec_plugins.graphs.quant import QuantScheme  # noqa: E402
from test_onnx_runtime import tiny_model_dir  # noqa: E402, F401  (the fixture)


# ---- 1. the quantized bound by bits ------------------------------------------------------------
def _weighty_llama(seed: int) -> torch.nn.Module:
    """A tiny llama whose layers move its logits: random init leaves a projection's share of them
    far below any quantization rounding, so losing one would show in no bound."""
    model = tiny_llama(vocab=32, seed=seed, sharpness=4.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(5.0)
    return model


def _zero_scales(directory, node: str) -> None:
    """Zero the block scales of MatMulNBits ``node`` in place (the files keep their sizes, so the
    manifest's size check passes): the projection's output is lost."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    g = Manifest.read(directory).graph("verify")
    file = directory / g.file
    model = onnx.load(str(file), load_external_data=False)
    scales = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and node in n.name).input[2]
    t = next(t for t in model.graph.initializer if t.name == scales)
    info = ExternalDataInfo(t)
    if info.location:
        with open(directory / info.location, "r+b") as fh:
            fh.seek(info.offset)
            fh.write(bytes(info.length))
    else:
        t.raw_data = np.zeros(len(t.raw_data) // 4, np.float32).tobytes()
        before = file.stat().st_size
        onnx.save(model, str(file))
        assert file.stat().st_size == before


@pytest.mark.parametrize("node", ["/layers.1/self_attn/v_proj/", "/layers.1/mlp/down_proj/"])
def test_int8_check_fails_a_projection_with_its_scales_zeroed(tmp_path, node):
    """Every quantized graph was held to the 4-bit bound, which an int8 graph with one projection's
    scales zeroed met (its logit scale too, and greedy is held only to the graph itself). The int8
    bound fails it on its logits; the honest export passes it, and --rtol still
    overrides the default."""
    model = _weighty_llama(seed=2)
    export_models(tmp_path / "q", (model, None, "t"), quantize=QuantScheme(bits=8, block_size=16))
    shutil.copytree(tmp_path / "q", tmp_path / "bad")
    _zero_scales(tmp_path / "bad", node)
    rep = check_export(tmp_path / "bad", gamma=2, max_new_tokens=8, models={"t": model})
    assert not rep.ok, rep.format()
    bad = [c for c in rep.cases if not c.ok]
    outputs = {c.output for c in bad}
    assert "logits" in outputs and "scale" not in outputs and all("real" in c.case for c in bad), rep.format()
    assert all(g.identical for g in rep.greedy)  # its own greedy output: no help here
    honest = check_export(tmp_path / "q", gamma=2, max_new_tokens=8, models={"t": model})
    assert honest.ok and honest.tolerances == {"verify": QUANT_RTOL_BITS[8]}, honest.format()
    loose = check_export(tmp_path / "bad", gamma=2, max_new_tokens=8, rtol=QUANT_RTOL, models={"t": model})
    assert loose.ok and loose.tolerances == {"verify": QUANT_RTOL}, loose.format()  # what HEAD held it to


def test_int4_keeps_the_loose_bound_and_passes(tmp_path):
    """The int4 bound is not tightened: an honest int4 export of the same model passes at it."""
    model = _weighty_llama(seed=2)
    export_models(tmp_path / "q", (model, None, "t"), quantize=QuantScheme(bits=4, block_size=32))
    rep = check_export(tmp_path / "q", gamma=2, max_new_tokens=8, models={"t": model})
    assert rep.ok and rep.tolerances == {"verify": QUANT_RTOL} == {"verify": QUANT_RTOL_BITS[4]}, rep.format()


# ---- 2. a damaged export in the cache ------------------------------------------------------------
def _truncate(file) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", ["graph", "manifest"])
def test_damaged_cache_export_is_exported_again(tiny_model_dir, tmp_path, monkeypatch, caplog, damage):  # noqa: F811
    """A truncated verify.onnx (or manifest.json) in the cache made every later load fail with
    ManifestError '... export again', and no command writes into the cache: it is exported again,
    with a warning, and decodes as it did."""
    from spec_plugins.backends.onnx_cache import export_cache_dir
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime
    from spec_plugins.registry import EXPORTERS

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    m = str(tiny_model_dir)
    cfg = OnnxRuntime.Config(model=m)
    first = OnnxRuntime.from_config(cfg)
    want = first.prefill([[1, 2, 3, 4]]).logits
    directory = export_cache_dir(m)
    _truncate(directory / ("verify.onnx" if damage == "graph" else "manifest.json"))
    exports = []
    real = EXPORTERS.get("onnx")
    monkeypatch.setitem(EXPORTERS._entries, "onnx", lambda *a, **k: exports.append(a[1]) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="spec_plugins.backends.onnx_cache"):
        again = OnnxRuntime.from_config(cfg)
    assert exports == [directory], exports
    assert f"the cached export {directory} cannot be loaded" in caplog.text
    assert "exporting it again" in caplog.text
    Manifest.read(directory)  # whole again
    torch.testing.assert_close(again.prefill([[1, 2, 3, 4]]).logits, want, rtol=0, atol=0)


def test_damaged_default_with_named_layers_is_exported_again(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """Named layers read the default export's manifest first: a damaged one is exported again
    too, rather than failing the lookup."""
    from spec_plugins.backends.onnx_cache import export_cache_dir, first_use_export

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    m = str(tiny_model_dir)
    default = first_use_export(m, None, "float32", None)
    _truncate(default / "verify.onnx")
    assert first_use_export(m, None, "float32", [2, 1, 1]) == default == export_cache_dir(m)  # the default layers
    assert Manifest.read(default).graph("verify").feature_layers == [2, 1, 1]


def test_a_damaged_path_export_is_not_exported_again(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """A user's ``path:`` export is theirs: damaged, it stays an error naming it, untouched."""
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(vocab=32, seed=4, sharpness=4.0)
    export_models(tmp_path / "mine", (model, None, str(tiny_model_dir)))
    _truncate(tmp_path / "mine" / "verify.onnx")
    before = sorted(os.listdir(tmp_path / "mine"))
    with pytest.raises(ManifestError, match="export again"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model=str(tiny_model_dir), path=str(tmp_path / "mine")))
    assert sorted(os.listdir(tmp_path / "mine")) == before and not (tmp_path / "cache").exists()


# ---- 3. --gguf-grid on a model that is not a GGUF --------------------------------------------------
@pytest.mark.parametrize("how", ["flags", "config"])
def test_gguf_grid_on_a_transformers_model_is_refused_before_export(tiny_model_dir, tmp_path, monkeypatch,  # noqa: F811
                                                                     how):
    """``--quantize int4 --gguf-grid`` (or the section's ``quant_grid: gguf``) on a transformers
    directory was refused by the quantizer only after the whole graph was traced; now before
    ``export_config`` runs, naming the model."""
    from typer.testing import CliRunner

    import spec_plugins.exporters.onnx_export as onnx_export
    from spec_plugins.cli import app

    def no_export(*a, **k):
        raise AssertionError("export_config ran: the refusal came after tracing")

    monkeypatch.setattr(onnx_export, "export_config", no_export)
    target = {"backend": "onnxruntime", "model": str(tiny_model_dir)}
    flags = ["--quantize", "int4", "--gguf-grid"]
    if how == "config":
        target.update(quantize="int4", quant_grid="gguf")
        flags = []
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"target": target}))
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(cfg), "--out", str(tmp_path / "out"), *flags])
    assert res.exit_code == 2 and not isinstance(res.exception, AssertionError), res.output
    assert f"the target model {str(tiny_model_dir)!r} is not a GGUF file" in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_gguf_grid_on_first_use_is_refused_before_tracing(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """The same refusal on a ``backend: onnxruntime`` section that exports on first use (no
    ``path:``): before the exporter is called, naming the model; nothing cached."""
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime
    from spec_plugins.registry import EXPORTERS

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    exporter = EXPORTERS.get("onnx")
    called = []
    monkeypatch.setattr(EXPORTERS, "get", lambda name: (called.append(name), exporter)[1])
    cfg = OnnxRuntime.Config(model=str(tiny_model_dir), quantize="int4", quant_grid="gguf")
    with pytest.raises(ValueError, match=f"the target model {str(tiny_model_dir)!r} is not a GGUF file"):
        OnnxRuntime.from_config(cfg)
    assert called == [] and not list((tmp_path / "cache").glob("**/manifest.json"))


def test_the_int8_bound_grows_with_the_block():
    """Activations are quantized per block too, so an honest int8 export's error grows with the
    block (SmolLM2: 0.065 at 32, 0.117 at 128, 0.224 at 256, which 0.2 failed): the bound grows
    as the root of the block's share past 32, and never past the loosest."""
    from spec_plugins.exporters.parity import quant_rtol

    assert quant_rtol({"bits": 8, "block_size": 16}) == quant_rtol({"bits": 8, "block_size": 32}) == 0.2
    assert quant_rtol({"bits": 8, "block_size": 128}) == pytest.approx(0.4)
    assert 0.224 * 2 < quant_rtol({"bits": 8, "block_size": 256}) < QUANT_RTOL
    assert quant_rtol({"bits": 4, "block_size": 256}) == quant_rtol({"bits": 4, "block_size": 32}) == QUANT_RTOL
    assert quant_rtol({}) == QUANT_RTOL
