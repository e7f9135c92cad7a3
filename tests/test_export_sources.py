"""What an ONNX export is made from, as its manifest records it: the decoder layers the verify
graph returns (export on first use), the positions it is exact for (a sliding window), and where
its model and heads live (local paths made absolute)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")

from conftest import tiny_llama
from helpers import plain_greedy, save_random_heads
from spec_plugins.backends.onnx_cache import export_cache_dir
from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime, create_session
from spec_plugins.exporters.onnx_export import export_config, export_models
from test_onnx_runtime import tiny_model_dir  # noqa: F401  (the fixture)

from spec_plugins.config import SpecConfig
from spec_plugins.graphs.manifest import Manifest


def _hf(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory)).eval()


@pytest.mark.parametrize("named", [True, False])
def test_first_use_export_returns_the_layers_the_section_names(named, tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """``feature_layers`` on an onnxruntime target without a path, named or (not named) read from
    the drafter's config as `export onnx --feature-layers auto` does: the graph exported on first
    use returns those layers (an EAGLE-3 drafter's 1, 2, where this model's default is 2, 1, 1),
    in a cache directory of its own; the drafter pairs with it and decodes the model's greedy
    tokens (only the backend line differs from a torch config)."""
    from spec_plugins.decoder import SpeculativeDecoder

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    model, m = _hf(tiny_model_dir), str(tiny_model_dir)
    heads = save_random_heads(model, tmp_path / "heads")
    assert export_cache_dir(m, feature_layers=[1, 2]) != export_cache_dir(m)
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 6]
    named_layers = {"feature_layers": [1, 2]} if named else {}
    cfg = SpecConfig.parse({"target": {"backend": "onnxruntime", "model": m, **named_layers},
                            "proposer": {"type": "eagle", "heads": str(heads["eagle"]), "num_draft_tokens": 3},
                            "sampling": {"temperature": 0.0}})
    dec = SpeculativeDecoder.from_config(cfg)
    assert dec.target.capabilities.feature_layers == (1, 2)
    got = dec.generate(prompt, max_new_tokens=12).token_ids
    assert got == plain_greedy(model, prompt, 12, eos=[31])
    default = OnnxRuntime.from_config(OnnxRuntime.Config(model=m))  # the default layers: another export
    assert default.capabilities.feature_layers == (2, 1, 1)
    assert sorted(p.name for p in (tmp_path / "cache" / "onnx").iterdir()) == sorted(
        [export_cache_dir(m).name, export_cache_dir(m, feature_layers=[1, 2]).name])


def test_feature_layers_are_checked_before_export_and_against_a_path(
        tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """Layers the model lacks are refused before anything is written; with ``path`` the export's
    own layers must be the ones the section names."""
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    m = str(tiny_model_dir)
    with pytest.raises(ValueError, match=r"numbered 1\.\.2, got \[5\]"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model=m, feature_layers=[1, 5]))
    assert not any((tmp_path / "cache" / "onnx").glob("*/manifest.json"))
    export_models(tmp_path / "exp", (_hf(tiny_model_dir), None, m))
    with pytest.raises(ValueError, match=r"returning decoder layers \[2, 1, 1\], not feature_layers: \[1, 2\]"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model=m, path=str(tmp_path / "exp"), feature_layers=[1, 2]))
    rt = OnnxRuntime.from_config(OnnxRuntime.Config(model=m, path=str(tmp_path / "exp"), feature_layers=[2, 1, 1]))
    assert rt.capabilities.feature_layers == (2, 1, 1)


def test_a_sliding_window_at_the_context_caps_the_graph(tmp_path):
    """A model whose window is its whole context exports as full attention, with the window as the
    manifest's context cap: a longer max_context (where the model slides and the graph would not)
    is refused, and within it the graph gives the model's logits."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=32, sliding_window=32)).eval()
    export_models(tmp_path / "w", (model, None, "mistral-w32"))
    g = Manifest.read(tmp_path / "w").graph("verify")
    assert (g.max_context, g.context_cap) == (32, 32)
    session = create_session(tmp_path / "w" / g.file)
    with pytest.raises(ValueError, match="max_context 64 exceeds the 32 positions .* sliding window"):
        OnnxRuntime(session, g, max_context=64)
    rt = OnnxRuntime(session, g, max_context=32)
    seq = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0, -1]
    torch.testing.assert_close(rt.prefill([seq]).logits.reshape(-1), want, atol=1e-4, rtol=1e-4)


def test_relative_model_and_head_paths_are_recorded_absolute(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """An export made with paths relative to the working directory names the model and heads by
    absolute path, so it is found from any directory and loads under either spelling of the model;
    another model is still refused."""
    from spec_plugins.models import resolve_model

    heads = save_random_heads(_hf(tiny_model_dir), tmp_path / "heads")
    monkeypatch.chdir(tmp_path)
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": tiny_model_dir.name},
                            "proposer": {"type": "eagle", "heads": "heads/eagle"}})
    man = export_config(cfg, "exp")
    assert {g.source_model for g in man.graphs} == {str(tiny_model_dir.resolve())}
    assert man.graph("eagle").source_heads == str(heads["eagle"].resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recorded = Manifest.read(tmp_path / "exp").graph("verify").source_model
    assert resolve_model(recorded).directory == tiny_model_dir.resolve()
    exp = str(tmp_path / "exp")
    assert OnnxRuntime.from_config(OnnxRuntime.Config(model=str(tiny_model_dir), path=exp)).vocab_size == 32
    monkeypatch.chdir(tmp_path)
    assert OnnxRuntime.from_config(OnnxRuntime.Config(model=tiny_model_dir.name, path=exp)).vocab_size == 32
    tiny_llama(vocab=32, seed=7).save_pretrained(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="exported from model"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model="other", path=exp))


def test_named_default_layers_share_the_default_export(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """An EAGLE-3 drafter reading the model's default layers (named, as ``target_for`` names a
    drafter's layers) uses the default first-use export, in either order: the graph is exported
    once (a key of its own for them exported it a second time)."""
    from spec_plugins.backends import onnx_cache as ort_rt
    from spec_plugins.registry import EXPORTERS

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    real, made = EXPORTERS.get("onnx"), []
    monkeypatch.setattr(EXPORTERS, "get", lambda name: (lambda *a, **kw: made.append(kw) or real(*a, **kw)))
    m = str(tiny_model_dir)
    default = export_cache_dir(m)
    assert ort_rt.first_use_export(m, None, "float32", [2, 1, 1]) == default  # named first: becomes the default
    assert ort_rt.first_use_export(m, None, "float32", None) == default
    assert ort_rt.first_use_export(m, None, "float32", [2, 1, 1]) == default
    assert len(made) == 1 and list((tmp_path / "cache" / "onnx").iterdir()) == [default]
    assert ort_rt.first_use_export(m, None, "float32", [1, 2]) != default and len(made) == 2


def test_an_export_moved_with_its_project_still_loads(tmp_path, monkeypatch):
    """Model and export named by relative paths, the project folder moved (another checkout): the
    recorded absolute path is gone and the same-named model loads it; another model is refused."""
    import shutil

    model = tiny_llama(vocab=32, seed=3)
    proj = tmp_path / "projA"
    proj.mkdir()
    monkeypatch.chdir(proj)
    model.save_pretrained("tiny")
    tiny_llama(vocab=32, seed=4).save_pretrained("other")
    export_models("exp", (model, None, "tiny"))
    shutil.move(str(proj), str(tmp_path / "projB"))
    monkeypatch.chdir(tmp_path / "projB")
    assert OnnxRuntime.from_config(OnnxRuntime.Config(model="tiny", path="exp")).vocab_size == 32
    with pytest.raises(ValueError, match="exported from model"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model="other", path="exp"))
