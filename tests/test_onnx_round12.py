"""ONNX exports, round 12: a graph whose weights torch writes one file a tensor (above 2 GiB) is
gathered into one ``.onnx.data``, sized, checked and quantized whole; a weights file ONNX Runtime
cannot read is refused naming it; block sizes ONNX Runtime's quantizer lacks are refused up front;
``device: auto`` runs on the CPU where only onnxruntime, not torch, has CUDA."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from spec_plugins.backends.onnxruntime_runtime import create_session, providers_for  # noqa: E402
from spec_plugins.exporters.onnx_export import _quantize_entry, export_models  # noqa: E402
from spec_plugins.exporters.onnx_verify import dummy_inputs, graph_shape  # noqa: E402

from spec_plugins.graphs.io import input_names  # noqa: E402
from spec_plugins.graphs.manifest import Manifest, ManifestError  # noqa: E402
from spec_plugins.graphs.quant import BLOCK_SIZES, QuantScheme  # noqa: E402

INT8 = QuantScheme(bits=8, block_size=16)


def one_file_a_tensor(path: Path) -> None:
    """Re-save graph ``path`` with each weight in a file of its own, named after the tensor, as
    torch's exporter writes a graph above 2 GiB."""
    model = onnx.load(str(path))
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=256)


@pytest.fixture
def big_graph_exporter(monkeypatch):
    """``torch.onnx.export`` writing as it does above 2 GiB, on tiny models."""
    real = torch.onnx.export

    def export(*args, **kw):
        real(*args, **kw)
        one_file_a_tensor(Path(args[2]))

    monkeypatch.setattr(torch.onnx, "export", export)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=32, seed=2, sharpness=4.0)


@pytest.fixture(scope="module")
def inline(model, tmp_path_factory):
    """The reference: the same model exported with its weights in the graph."""
    out = tmp_path_factory.mktemp("round12") / "inline"
    export_models(out, (model, None, "tiny"), feature_layers=())
    return out


def _logits(graph: Path, model) -> np.ndarray:
    shape = graph_shape(model)
    args = dummy_inputs(shape, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    session = create_session(graph, "cpu", threads=1)
    return session.run(["logits"], {n: a.numpy() for n, a in zip(input_names(shape.num_layers), args)})[0]


@pytest.mark.parametrize("scheme", [None, INT8])
def test_a_graph_written_one_file_a_tensor_is_gathered_sized_and_checked_whole(
        big_graph_exporter, model, inline, tmp_path, scheme):
    """torch writes a graph above 2 GiB one file a tensor: the manifest recorded the .onnx file's
    bytes alone (the CLI printed 0.1 MiB for a 2.3 GB graph), a truncated weight file passed
    Manifest.read, and quantizing left every fp32 weight file behind. The export now keeps the
    weights in one <graph>.data file, counted in size_bytes, and computes what the inline graph does."""
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        man = export_models(out, (model, None, "tiny"), feature_layers=(), quantize=scheme)
    finally:
        os.umask(old)
    g = man.graph("verify")
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", g.file, g.file + ".data"])
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes  # the export files' mode (test_export_check's rule)
    assert g.size_bytes == (out / g.file).stat().st_size + (out / (g.file + ".data")).stat().st_size
    Manifest.read(out)
    if scheme is None:
        ref = Manifest.read(inline).graph("verify")
        np.testing.assert_array_equal(_logits(out / g.file, model), _logits(inline / ref.file, model))
    with open(out / (g.file + ".data"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(ManifestError, match=r"\.onnx\.data hold .* bytes, not the"):
        Manifest.read(out)


def test_quantizing_deletes_every_file_of_the_float_graph(inline, tmp_path):
    """The quantizer deleted verify.onnx and verify.onnx.data only: a graph kept one file a tensor
    left all of them next to the quantized graph."""
    shutil.copy(inline / "verify.onnx", tmp_path / "verify.onnx")
    one_file_a_tensor(tmp_path / "verify.onnx")
    assert len(list(tmp_path.iterdir())) > 3
    g = Manifest.read(inline).graph("verify")
    g.source_model = "tiny"
    _quantize_entry(tmp_path, g, INT8, lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([g.file, g.file + ".data"])
    assert g.size_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_weights_file_onnx_runtime_cannot_read_is_refused_naming_it(inline, tmp_path, damage):
    """ONNX Runtime's own error for such a graph is a bare ``Fail``, which was let through raw."""
    shutil.copy(inline / "verify.onnx", tmp_path / "verify.onnx")
    one_file_a_tensor(tmp_path / "verify.onnx")
    victim = next(p for p in sorted(tmp_path.iterdir()) if p.name != "verify.onnx")
    if damage == "truncate":
        os.truncate(victim, 10)
    else:
        victim.unlink()
    with pytest.raises(ManifestError, match=f"cannot load graph .*verify.onnx: its weights file .*{victim.name}"):
        create_session(tmp_path / "verify.onnx", "cpu")


def test_a_head_graph_written_one_file_a_tensor_moves_into_place_whole(big_graph_exporter, model, tmp_path):
    """A head exported on first use moved only its .onnx file out of the temporary directory (its
    weights were deleted with it), and its size_bytes counted that file alone."""
    from spec_plugins.exporters.onnx_heads import (
        check_head,
        export_head,
        export_head_file,
    )
    from test_heads import eagle

    module = eagle(model)
    (tmp_path / "a").mkdir()
    entry = export_head(module, tmp_path / "a" / "eagle.onnx", "eagle", "tiny", None)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["eagle.onnx", "eagle.onnx.data"]
    assert entry.size_bytes == sum(p.stat().st_size for p in (tmp_path / "a").iterdir())
    path = export_head_file(module, tmp_path / "b" / "eagle.onnx")
    assert sorted(p.name for p in path.parent.iterdir()) == files
    cases = check_head(path.parent, entry, model, 1e-4, module)
    assert cases and all(c.ok for c in cases), cases


@pytest.mark.parametrize("block", [512, 4096, 48])
def test_block_sizes_the_quantizer_lacks_are_refused_up_front(tmp_path, block):
    """Any power of two >= 16 passed, and 512 or more failed inside ONNX Runtime after a whole
    export with a raw RuntimeError; refused by the scheme, the config field and the CLI flag."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app
    from spec_plugins.config import ConfigError, SpecConfig

    with pytest.raises(ValueError, match=f"power of two from 16 to 256 .*got {block}"):
        QuantScheme(bits=8, block_size=block)
    with pytest.raises(ConfigError, match="power of two from 16 to 256"):
        SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "smollm2-135m-instruct", "quantize": "int4",
                                     "quant_block_size": block}})
    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "missing.yaml"), "--out",
                                   str(tmp_path / "out"), "--quantize", "int8", "--block-size", str(block)])
    assert res.exit_code == 2 and f"--block-size {block}: block_size must be" in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_the_block_sizes_allowed_are_those_onnx_runtime_quantizes(inline, tmp_path):
    """The reference is ONNX Runtime's quantizer itself: every allowed size quantizes, 512 does not."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    from spec_plugins.exporters.onnx_quantize import quantize_graph

    for bits in (4, 8):
        for block in BLOCK_SIZES:
            info = quantize_graph(inline / "verify.onnx", tmp_path / f"q{bits}-{block}.onnx", QuantScheme(bits, block))
            assert info["quantized_matmuls"] > 0
        q = MatMulNBitsQuantizer(onnx.load(str(inline / "verify.onnx")), bits=bits, block_size=512)
        with pytest.raises(RuntimeError):
            q.process()


def test_device_auto_runs_on_the_cpu_where_only_onnxruntime_has_cuda(inline, monkeypatch, caplog):
    """onnxruntime-gpu lists its CUDA provider on any machine: ``auto`` took it and then failed on
    a CPU torch ("this torch has no CUDA"); now it warns and runs on the CPU. ``device: cuda``
    still fails, naming why."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="spec_plugins.backends.onnx_providers"):
        session = create_session(inline / "verify.onnx", "auto", threads=1)
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert "device 'auto'" in caplog.text and "torch has no CUDA" in caplog.text
    with pytest.raises(ValueError, match="device: 'cuda' needs a CUDA device"):
        create_session(inline / "verify.onnx", "cuda")
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert providers_for("auto", cuda, torch_cuda=True) == cuda
    assert providers_for("auto", cuda, torch_cuda=False) == ["CPUExecutionProvider"]


@pytest.mark.parametrize("layout", ["torch", "mixed", "dotted"])
def test_gathering_streams_the_weights_file_by_file(inline, model, tmp_path, monkeypatch, layout):
    """gather_weights loaded every weight into memory (onnx.load with its external data) while
    the exporter still held the torch model, and kept the tensor files until the merged one was
    written: the model once more in memory and on disk. It now copies them file by file into
    <graph>.data, laid out as onnx's own writer lays them (the reference), the graph computing as
    before. ``torch``: tensor files named by location alone, as torch writes them; ``mixed``: one
    weight already in verify.onnx.data; ``dotted``: that file named "./verify.onnx.data" (it was
    deleted as a stale merge before its weight was read)."""
    from onnx.external_data_helper import ExternalDataInfo
    from spec_plugins.exporters.onnx_verify import gather_weights

    graph = tmp_path / "g" / "verify.onnx"
    graph.parent.mkdir()
    shutil.copy(inline / "verify.onnx", graph)
    one_file_a_tensor(graph)
    proto = onnx.load(str(graph), load_external_data=False)
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for t in external:
        del t.external_data[1:]  # location only: no offset, no length
    if layout in ("mixed", "dotted"):
        (graph.parent / ExternalDataInfo(external[0]).location).replace(graph.with_name("verify.onnx.data"))
        external[0].external_data[0].value = "./verify.onnx.data" if layout == "dotted" else "verify.onnx.data"
    onnx.save_model(proto, str(graph))
    want = _logits(graph, model)
    ref = tmp_path / "ref" / "verify.onnx"
    ref.parent.mkdir()
    onnx.save_model(onnx.load(str(graph)), str(ref), save_as_external_data=True, location="verify.onnx.data",
                    size_threshold=256)  # the threshold one_file_a_tensor wrote with
    loads, real = [], onnx.load_external_data_for_model
    monkeypatch.setattr(onnx, "load_external_data_for_model", lambda *a, **kw: loads.append(a) or real(*a, **kw))
    size = gather_weights(graph)
    assert loads == []
    assert sorted(p.name for p in graph.parent.iterdir()) == ["verify.onnx", "verify.onnx.data"]
    assert size == sum(p.stat().st_size for p in graph.parent.iterdir())
    assert graph.with_name("verify.onnx.data").read_bytes() == ref.with_name("verify.onnx.data").read_bytes()
    monkeypatch.undo()
    np.testing.assert_array_equal(_logits(graph, model), want)


def test_a_cached_head_graph_without_its_weights_is_exported_again(big_graph_exporter, model, tmp_path,
                                                                   monkeypatch, caplog):
    """A head above 2 GiB exported on first use before the cache moved its weights files along
    (only head.onnx) stayed broken: head_session found the file, never exported it again and
    failed 'export again', which no command does for the cache. It now exports it again, saying why."""
    from spec_plugins.exporters.onnx_heads import _head_cases, export_head, float_eval
    from test_heads import eagle

    from spec_plugins import models
    from spec_plugins.graphs.manifest import EXPORTER_VERSION
    from spec_plugins.heads import runner

    module = eagle(model)
    monkeypatch.setattr(models, "cache_root", lambda: tmp_path)
    path = tmp_path / "onnx-heads" / f"eagledrafter-{runner.weights_key(module)}-v{EXPORTER_VERSION}" / "head.onnx"
    path.parent.mkdir(parents=True)
    (tmp_path / "old").mkdir()
    entry = export_head(module, tmp_path / "old" / "head.onnx", "head", "", None)
    one_file_a_tensor(tmp_path / "old" / "head.onnx")
    (tmp_path / "old" / "head.onnx").replace(path)  # what the cache held: the graph, its weights left behind
    with caplog.at_level(logging.WARNING, logger="spec_plugins.heads.runner"):
        session = runner.head_session(module)
    assert "cannot be loaded" in caplog.text and "exporting it again" in caplog.text
    assert sorted(p.name for p in path.parent.iterdir()) == ["head.onnx", "head.onnx.data"]
    path.write_bytes(path.read_bytes()[:200])  # the graph itself truncated in the cache: exported again too
    with caplog.at_level(logging.WARNING, logger="spec_plugins.heads.runner"):
        session = runner.head_session(module)
    assert sorted(p.name for p in path.parent.iterdir()) == ["head.onnx", "head.onnx.data"]
    with torch.no_grad(), float_eval(module):
        cases = _head_cases(entry, module, session, 1e-4)
    assert cases and all(c.ok for c in cases), cases
