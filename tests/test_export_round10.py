"""ONNX export and ONNX Runtime, round 10: `export check` compares the hidden states and features the
drafters read, holds float16 graphs' real-prompt cases to a tight bound and quantized graphs' logit
scale (a baked-in temperature failed neither before), `device: cuda` refuses ONNX Runtime's silent
CPU fallback, and the head proposers open the export's own head graphs."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import tiny_llama
from spec_plugins.exporters.onnx_export import export_models
from spec_plugins.exporters.parity import check_export
from test_heads import eagle, medusa
from test_onnx_runtime import exported  # noqa: F401  (a fixture: a tiny target + draft export)

from spec_plugins.graphs.manifest import Manifest, ManifestError
from spec_plugins.graphs.quant import QuantScheme


def rescale_output(directory: Path, name: str, factor: float) -> None:
    """Multiply the verify graph's output ``name`` by ``factor`` after export, as an exporter bug
    would leave it (the graph's own consumers keep the true value); the manifest keeps its size."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    data = json.loads((directory / "manifest.json").read_text())
    entry = next(g for g in data["graphs"] if g["name"] == "verify")
    path = directory / entry["file"]
    g = onnx.load(str(path))
    for n in g.graph.node:
        n.output[:] = [o + "_raw" if o == name else o for o in n.output]
        n.input[:] = [i + "_raw" if i == name else i for i in n.input]
    g.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), f"{name}_scale"))
    g.graph.node.append(helper.make_node("Mul", [f"{name}_raw", f"{name}_scale"], [name], name=f"bug_{name}"))
    onnx.save(g, str(path))
    entry["size_bytes"] = path.stat().st_size
    (directory / "manifest.json").write_text(json.dumps(data))


# ---- 1. hidden states and features are compared ------------------------------------------------
def test_check_compares_hidden_and_features(tmp_path):
    """Only the logits were compared: halved hidden states and zeroed features passed, though the
    Medusa / EAGLE / EAGLE-3 drafters on ONNX Runtime read exactly those."""
    model = tiny_llama(vocab=32, seed=2, sharpness=4.0)
    export_models(tmp_path / "e", (model, None, "tiny"), feature_layers=(1, 2))
    rescale_output(tmp_path / "e", "hidden", 0.5)
    rescale_output(tmp_path / "e", "features", 0.0)
    rep = check_export(tmp_path / "e", gamma=2, max_new_tokens=8, models={"tiny": model})
    assert not rep.ok, rep.format()
    bad = [c for c in rep.cases if not c.ok]
    assert {c.output for c in bad} == {"hidden", "features"}
    assert {c.case.split()[0] for c in bad} == {"random", "real"}  # both kinds of case see them
    # the reference: halved outputs are half their scale off, zeroed ones all of it
    assert all(abs(c.rel - 0.5) < 1e-3 for c in bad if c.output == "hidden")
    assert all(abs(c.rel - 1.0) < 1e-3 for c in bad if c.output == "features")


def test_an_honest_export_passes_with_every_output_compared(tmp_path):
    model = tiny_llama(vocab=32, seed=2, sharpness=4.0)
    export_models(tmp_path / "e", (model, None, "tiny"), feature_layers=(1, 2))
    rep = check_export(tmp_path / "e", gamma=2, max_new_tokens=8, models={"tiny": model})
    assert rep.ok, rep.format()
    outputs = {(c.case.split()[0], c.output) for c in rep.cases}
    assert outputs == {(k, o) for k in ("random", "real") for o in ("logits", "hidden", "features")}
    json.dumps(rep.to_dict())  # the report stays valid JSON


# ---- 2. tolerances that a baked-in temperature misses -------------------------------------------
def test_float16_real_prompt_cases_fail_scaled_logits(tmp_path):
    """rtol 0.2 held every float16 case: logits x0.85 (0.15 off) passed. The real-prompt cases now
    have their own bound, far above float16 rounding there and below the scaling."""
    model = tiny_llama(vocab=32, seed=2, sharpness=4.0).half()
    export_models(tmp_path / "h", (model, None, "tiny"), feature_layers=())
    shutil.copytree(tmp_path / "h", tmp_path / "scaled")
    rescale_output(tmp_path / "scaled", "logits", 0.85)
    rep = check_export(tmp_path / "scaled", gamma=2, max_new_tokens=8, models={"tiny": model})
    assert not rep.ok, rep.format()
    bad = [c for c in rep.cases if not c.ok]
    assert bad and all(c.case.startswith("real") and c.output == "logits" for c in bad)
    assert all(abs(c.rel - 0.15) < 0.01 for c in bad)
    from spec_plugins.exporters.parity import REAL_RTOL

    honest = check_export(tmp_path / "h", gamma=2, max_new_tokens=8, models={"tiny": model})
    assert honest.ok and honest.real_tolerances == {"verify": REAL_RTOL["float16"]}, honest.format()
    assert max(c.rel for c in honest.cases if c.case.startswith("real")) < REAL_RTOL["float16"] / 5


def test_logit_scale_is_the_factor_between_distributions():
    """Independent reference: logits scaled by s (and shifted, which softmax ignores) have scale s;
    rounding noise leaves it near 1."""
    from spec_plugins.exporters.parity_rule import compare_scale, logit_scale

    x = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)) * 4
    assert logit_scale(0.5 * x + 3.0, x) == pytest.approx(0.5, abs=1e-6)
    noisy = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    assert logit_scale(noisy, x) == pytest.approx(1.0, abs=0.01)
    assert compare_scale("v", "c", noisy, x, 1.5).ok
    assert not compare_scale("v", "c", 0.5 * x, x, 1.5).ok and not compare_scale("v", "c", 2.0 * x, x, 1.5).ok
    assert not compare_scale("v", "c", x[:, :2], x, 1.5).ok  # a shape mismatch fails, naming the shapes


def test_quantized_check_fails_halved_logits(tmp_path):
    """QUANT_RTOL 0.75 let logits x0.5 pass (greedy is held only to the graph itself); the logit
    scale on real prompts catches it (int8's own bound now does too), and honest int8 passes it."""
    model = tiny_llama(vocab=32, seed=2, sharpness=4.0)
    export_models(tmp_path / "q", (model, None, "tiny"), quantize=QuantScheme(bits=8, block_size=16))
    shutil.copytree(tmp_path / "q", tmp_path / "scaled")
    rescale_output(tmp_path / "scaled", "logits", 0.5)
    rep = check_export(tmp_path / "scaled", gamma=2, max_new_tokens=8, models={"tiny": model})
    assert not rep.ok, rep.format()
    bad = [c for c in rep.cases if not c.ok]
    bad = [c for c in bad if c.output == "scale"]
    assert bad and all(abs(c.rel - 0.5) < 0.05 for c in bad)
    honest = check_export(tmp_path / "q", gamma=2, max_new_tokens=8, models={"tiny": model})
    scale = [c for c in honest.cases if c.output == "scale"]
    assert honest.ok and scale and max(c.rel for c in scale) < 0.05, honest.format()


# ---- 3. device: cuda and ONNX Runtime's CPU fallback --------------------------------------------
def fallback_ort(monkeypatch) -> list:
    """An onnxruntime whose CUDA provider is listed but fails to start: the session comes back on
    the CPU alone, as ONNX Runtime builds it after "Failed to create CUDAExecutionProvider"; torch's
    CUDA stubbed available. Returns the providers each session asked for."""
    import onnxruntime as real

    asked: list = []

    class FallbackSession:
        def __init__(self, path, so, providers, provider_options):
            asked.append(list(providers))
            self._s = real.InferenceSession(path, so, providers=["CPUExecutionProvider"])

        def __getattr__(self, k):
            return getattr(self._s, k)

    fake = SimpleNamespace(SessionOptions=real.SessionOptions, GraphOptimizationLevel=real.GraphOptimizationLevel,
                           capi=real.capi, InferenceSession=FallbackSession,
                           get_available_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: SimpleNamespace(cuda_stream=1234))
    return asked


def test_device_cuda_refuses_the_cpu_fallback(exported, monkeypatch):  # noqa: F811
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime, create_session

    out = exported[0]
    asked = fallback_ort(monkeypatch)
    with pytest.raises(RuntimeError, match=r"fell back to CPUExecutionProvider.*cuDNN and cuBLAS.*CUDA major"):
        create_session(out / "verify.onnx", "cuda")
    with pytest.raises(RuntimeError, match="device 'cuda' requested, but ONNX Runtime could not start"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model="tiny", path=str(out), device="cuda"))
    assert asked and all(a[0] == "CUDAExecutionProvider" for a in asked)  # CUDA was asked for each time


def test_device_auto_warns_of_the_cpu_fallback_and_runs(exported, monkeypatch, caplog):  # noqa: F811
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

    out, model, _ = exported
    asked = fallback_ort(monkeypatch)
    with caplog.at_level(logging.WARNING):
        rt = OnnxRuntime.from_config(OnnxRuntime.Config(model="tiny", path=str(out), device="auto"))
    assert asked == [["CUDAExecutionProvider", "CPUExecutionProvider"]]
    assert any("could not start its CUDAExecutionProvider" in r.getMessage() for r in caplog.records)
    assert rt.device == torch.device("cpu")
    from spec_plugins.backends.torch_runtime import TorchRuntime

    torch.testing.assert_close(rt.prefill([[1, 2, 3]]).logits, TorchRuntime(model).prefill([[1, 2, 3]]).logits,
                               atol=1e-4, rtol=1e-4)


def test_a_session_that_got_cuda_passes_the_provider_check():
    from spec_plugins.backends.onnx_providers import check_session_providers

    got = SimpleNamespace(get_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    check_session_providers(got, ["CUDAExecutionProvider", "CPUExecutionProvider"], "cuda", "g.onnx")
    cpu = SimpleNamespace(get_providers=lambda: ["CPUExecutionProvider"])
    check_session_providers(cpu, ["CPUExecutionProvider"], "cpu", "g.onnx")  # CPU asked for, CPU given


# ---- 4. the head proposers open the export's head graphs ----------------------------------------
def _head(kind: str, model, seed: int):
    return eagle(model, seed) if kind == "eagle" else medusa(model, seed=seed)


def _load(kind: str, directory: Path, model):
    from spec_plugins.heads import EagleDrafter, MedusaHeads

    return (EagleDrafter if kind == "eagle" else MedusaHeads).from_pretrained(str(directory), model)


def _proposer(kind: str, rt, head):
    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.medusa import MedusaProposer

    if kind == "eagle":
        return EagleProposer(EagleProposer.Config(heads="unused"), target=rt, drafter=head)
    return MedusaProposer(MedusaProposer.Config(heads="unused"), target=rt, heads=head)


@pytest.fixture
def opened(monkeypatch, tmp_path):
    """The graph files the head proposers open (a fresh head cache under tmp_path)."""
    from spec_plugins.backends import onnxruntime_runtime

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    files: list[Path] = []
    real = onnxruntime_runtime.create_session

    def record(file, *a, **k):
        files.append(Path(file))
        return real(file, *a, **k)

    monkeypatch.setattr(onnxruntime_runtime, "create_session", record)
    return files


def _export_with_head(tmp_path, kind: str, model, seed: int = 0) -> tuple[Path, Path]:
    """A head saved as training saves it, loaded back on ``model`` and exported with it, as
    `export onnx` of a config with that proposer does: (export directory, head directory)."""
    from spec_plugins.heads import save_head

    head = _head(kind, model, seed)
    heads = tmp_path / f"{kind}-head"
    save_head(head, head.config.to_dict(), heads)
    out = tmp_path / "exp"
    export_models(out, (model, None, "tiny"), heads=[(kind, _load(kind, heads, model), str(heads))])
    return out, heads


def _target(out: Path):
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

    return OnnxRuntime.from_config(OnnxRuntime.Config(model="tiny", path=str(out)))


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_the_proposer_opens_the_exports_head_graph(tmp_path, opened, kind):
    """The proposers re-exported the head into the cache and ran that unchecked graph, never the
    export's own (which `export check` checks)."""
    model = tiny_llama(vocab=32, seed=2)
    out, heads = _export_with_head(tmp_path, kind, model)
    rt = _target(out)
    opened.clear()
    _proposer(kind, rt, _load(kind, heads, model))
    assert opened[-1] == out / f"{kind}.onnx"
    assert not (tmp_path / "cache" / "onnx-heads").exists()


def test_a_float16_exports_head_graph_is_opened(tmp_path, opened):
    """A float16 export's head graph is traced over the float16 target's embeddings, the proposer's
    head over the float32 model's: that rounding is not another head."""
    model = tiny_llama(vocab=32, seed=2)
    out, heads = _export_with_head(tmp_path, "eagle", model.half())
    rt = _target(out)
    opened.clear()
    _proposer("eagle", rt, _load("eagle", heads, tiny_llama(vocab=32, seed=2)))
    assert opened[-1] == out / "eagle.onnx"


def test_a_head_the_export_was_not_made_with_runs_the_cached_graph(tmp_path, opened):
    model = tiny_llama(vocab=32, seed=2)
    out, _ = _export_with_head(tmp_path, "eagle", model)
    rt = _target(out)
    opened.clear()
    _proposer("eagle", rt, _head("eagle", model, seed=1))
    assert opened[-1].parent.parent == tmp_path / "cache" / "onnx-heads" and opened[-1].is_file()


def test_a_head_retrained_after_the_export_is_refused(tmp_path, opened):
    """The export's graph names the head directory the proposer loads, whose weights changed since:
    running either graph silently would draft from weights other than the export's or the check's."""
    from spec_plugins.heads import save_head

    model = tiny_llama(vocab=32, seed=2)
    out, heads = _export_with_head(tmp_path, "eagle", model)
    retrained = _head("eagle", model, seed=1)
    save_head(retrained, retrained.config.to_dict(), heads)
    rt = _target(out)
    with pytest.raises(ManifestError, match=r"eagle\.onnx \(graph 'eagle'\) was exported from .*now holds other "
                                            r"weights.*export again"):
        _proposer("eagle", rt, _load("eagle", heads, model))
    assert Manifest.read(out).graph("eagle").source_heads == str(heads.resolve())
