"""Export hardening: what the TensorRT builder may replace and its default context, the power of
the quantized parity check, float head graphs in quantized exports, the GGUF grid's refusals, the
quantization flags of ``export onnx``, and a refused dtype leaving no directories behind. The
TensorRT paths tested here run without TensorRT: the checks come before it is imported."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.exporters.parity import check_export  # noqa: E402
from spec_plugins.graphs.manifest import Manifest  # noqa: E402
from spec_plugins.graphs.quant import QuantScheme  # noqa: E402

NO_TRT = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")


def _eagle(model):
    from spec_plugins.heads import EagleConfig, EagleDrafter

    torch.manual_seed(0)
    return EagleDrafter(EagleConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                    draft_vocab_size=16), model.lm_head.weight, model.model.embed_tokens.weight,
                        torch.arange(0, 32, 2))


@pytest.fixture(scope="module")
def with_eagle(tmp_path_factory):
    """An export of a tiny target (256 positions) with an EAGLE head graph (max_context 0)."""
    model = tiny_llama(vocab=32, seed=2)
    out = tmp_path_factory.mktemp("onnx") / "export"
    export_models(out, (model, None, "tiny"), heads=[("eagle", _eagle(model), "unused")])
    return out


# ---- TensorRT: what --out may be, the default context --------------------------------------------
def test_engine_build_refuses_an_out_it_must_not_replace(with_eagle, tmp_path, monkeypatch):
    """--out was rmtree'd whatever it held: a user's folder, the ONNX export being read, the cwd.
    Now only a new or empty directory or previous engines qualify, checked before TensorRT loads."""
    from spec_plugins.exporters.tensorrt_build import build_engines

    user = tmp_path / "my_project"
    (user / "src").mkdir(parents=True)
    (user / "src" / "main.py").write_text("print('important')\n")
    with pytest.raises(ValueError, match="my_project is not empty and holds no TensorRT engines"):
        build_engines(with_eagle, user)
    assert (user / "src" / "main.py").read_text() == "print('important')\n"
    with pytest.raises(ValueError, match="is the ONNX export"):
        build_engines(with_eagle, with_eagle)
    assert (with_eagle / "manifest.json").is_file()
    monkeypatch.chdir(user)
    with pytest.raises(ValueError, match="current directory or one above it"):
        build_engines(with_eagle, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_project"]  # no temporary directory left


def test_engine_out_check_accepts_new_empty_and_previous_engines(with_eagle, tmp_path):
    from spec_plugins.exporters.tensorrt_build import check_engine_out
    from spec_plugins.graphs.engines import BuildEnv, EngineManifest

    check_engine_out(with_eagle, tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_engine_out(with_eagle, tmp_path / "empty")
    prev = tmp_path / "prev"
    prev.mkdir()
    EngineManifest(engines=[], built_with=BuildEnv("10.0", "GPU", (9, 0)).to_dict(), precision="fp32",
                   limits={}, onnx_manifest_sha256="0").write(prev)
    (prev / "verify.plan").write_bytes(b"old")
    check_engine_out(with_eagle, prev)
    with pytest.raises(ValueError, match="is the ONNX export .* or holds it"):
        check_engine_out(with_eagle, with_eagle.parent)


def test_default_context_ignores_head_graphs(with_eagle):
    """Head graphs record max_context 0; the default --max-context took the min over them too."""
    from spec_plugins.exporters.tensorrt_build import default_context

    man = Manifest.read(with_eagle)
    assert [(g.name, g.max_context) for g in man.graphs] == [("verify", 256), ("eagle", 0)]
    assert default_context(man) == 256 and default_context(man, ["verify"]) == 256


@NO_TRT
def test_export_tensorrt_cli_default_context_with_a_head_graph(with_eagle, tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    res = CliRunner().invoke(app, ["export", "tensorrt", "--onnx", str(with_eagle), "--out", str(tmp_path / "e")])
    assert res.exit_code == 2 and "spec-plugins[tensorrt]" in res.output, res.output  # got past the limits


# ---- quantized exports: the check's power, float heads -------------------------------------------
def test_quantized_check_fails_another_model_and_honours_rtol(tmp_path):
    """Every quantized case was forced ok: another model's weights passed, and so did rtol=1e-9. Real
    inputs are held to the loose bound (or rtol), random ones reported (see QUANT_RTOL)."""
    target = tiny_llama(vocab=32, seed=2, sharpness=4.0)
    export_models(tmp_path / "q", (target, None, "t"), quantize=QuantScheme(bits=4, block_size=16))
    other = tiny_llama(vocab=32, seed=7, sharpness=4.0)
    rep = check_export(tmp_path / "q", gamma=2, max_new_tokens=8, models={"t": other})
    assert not rep.ok and any(not c.ok for c in rep.cases), rep.format()
    rep = check_export(tmp_path / "q", gamma=1, rtol=1e-9, max_new_tokens=4, models={"t": target})
    assert rep.tolerances == {"verify": 1e-9} and not rep.ok
    from spec_plugins.exporters.parity import QUANT_RTOL

    rep = check_export(tmp_path / "q", gamma=2, max_new_tokens=8, models={"t": target})
    assert rep.ok and rep.tolerances == {"verify": QUANT_RTOL}, rep.format()
    assert 0 < rep.to_dict()["quantized_max_rel"] < QUANT_RTOL / 2  # int4 with its LM head: the loosest scheme
    assert {c.reported for c in rep.cases if "random" in c.case} == {True}
    assert {c.reported for c in rep.cases if "real" in c.case} == {False}


def test_quantize_leaves_head_graphs_float_and_the_check_passes(tmp_path):
    """Head graphs were quantized too (medusa labelled quantized with no MatMul quantized) and then
    failed `export check` at the float tolerance."""
    from spec_plugins.heads import MedusaConfig, MedusaHeads

    model = tiny_llama(vocab=32, seed=2)
    eagle = _eagle(model)
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, num_heads=2, draft_vocab_size=16), model.lm_head.weight,
                         torch.arange(0, 32, 2), zero_init=False)
    man = export_models(tmp_path / "q", (model, None, "tiny"), heads=[("eagle", eagle, "unused"),
                                                                      ("medusa", medusa, "unused")],
                        quantize=QuantScheme(bits=8, block_size=16))
    assert [(g.name, g.file, bool(g.quantization)) for g in man.graphs] == [
        ("verify", "verify.int8-b16-sym-acc4.onnx", True), ("eagle", "eagle.onnx", False),
        ("medusa", "medusa.onnx", False)]
    rep = check_export(tmp_path / "q", gamma=1, max_new_tokens=4, models={"tiny": model},
                       heads={"eagle": eagle, "medusa": medusa})
    assert rep.ok, rep.format()
    assert rep.quantized == ["verify"] and rep.tolerances["eagle"] == 1e-4


# ---- the GGUF grid ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,named", [({"bits": 8}, "bits=8"), ({"block_size": 64}, "block_size=64"),
                                          ({"symmetric": False}, "symmetric=False")])
def test_gguf_grid_refuses_bits_and_blocks_it_does_not_hold(tmp_path, fields, named):
    """int8 + gguf grid wrote the GGUF's 4-bit blocks labelled int8 (bits, block, zero points are the GGUF's)."""
    from test_onnx_export import _gguf_and_graph

    from spec_plugins.exporters.onnx_quantize import quantize_graph

    src, gguf_file, _, _ = _gguf_and_graph(tmp_path, ("layer", "lm_head"), chained=True)
    with pytest.raises(ValueError, match=f"grid 'gguf' carries the GGUF's own blocks.*takes no {named}"):
        quantize_graph(src, tmp_path / "q.onnx", QuantScheme(grid="gguf", **fields), gguf_file)
    assert not (tmp_path / "q.onnx").exists()


def test_gguf_grid_refuses_an_lm_head_of_another_type(tmp_path):
    """An F16 LM head (llama.cpp's Q4_1 files keep it Q6_K) stayed a float MatMul while the manifest
    said lm_head: true. It is refused by name, and carried as float with --fp32-lm-head."""
    from test_onnx_export import _gguf_and_graph

    from spec_plugins.exporters.onnx_quantize import quantize_graph

    src, gguf_file, _, _ = _gguf_and_graph(tmp_path, ("layer", "lm_head"), chained=True, second="F16")
    with pytest.raises(ValueError, match=r"/lm_head/MatMul \(tensors of its shape: F16\).*--fp32-lm-head"):
        quantize_graph(src, tmp_path / "q.onnx", QuantScheme(grid="gguf"), gguf_file)
    assert not (tmp_path / "q.onnx").exists()
    info = quantize_graph(src, tmp_path / "q.onnx", QuantScheme(grid="gguf", lm_head=False), gguf_file)
    assert info["lm_head"] is False and info["carried"] == 1 and info["name"] == "int4-gguf-acc4-fp32head"


# ---- export onnx flags, dtype ------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needles", [
    (["--block-size", "64"], ["--block-size", "add --quantize int4 or int8"]),
    (["--gguf-grid", "--fp32-lm-head", "--asymmetric"], ["--asymmetric, --fp32-lm-head, --gguf-grid"]),
    (["--accuracy-level", "0"], ["--accuracy-level"]),
    (["--quantize", "int8", "--gguf-grid"], ["--gguf-grid", "takes no --quantize int8"]),
    (["--quantize", "int4", "--gguf-grid", "--block-size", "64", "--asymmetric"],
     ["takes no --block-size 64, --asymmetric"]),
    (["--quantize", "int4", "--block-size", "24"], ["--block-size 24: block_size must be a power of two"]),
])
def test_export_onnx_refuses_quantization_flags_that_would_change_nothing(tmp_path, flags, needles):
    """With --quantize none these flags were ignored, and --gguf-grid ignored bits and blocks: refused
    by name before the config (a missing file here) is read, nothing written."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    res = CliRunner().invoke(app, ["export", "onnx", "--config", str(tmp_path / "missing.yaml"),
                                   "--out", str(tmp_path / "out"), *flags])
    assert res.exit_code == 2, res.output
    for needle in needles:
        assert needle in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_refused_dtype_leaves_no_directories(tmp_path):
    model = tiny_llama(vocab=32, seed=2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="loaded as bfloat16"):
        export_models(tmp_path / "a" / "b" / "out", (model, None, "tiny"))
    assert list(Path(tmp_path).iterdir()) == []


@pytest.mark.parametrize("fields,named", [
    ({"quantize": "int8", "quant_grid": "gguf"}, "it takes no quantize: int8"),
    ({"quantize": "int4", "quant_grid": "gguf", "quant_block_size": 64}, "it takes no quant_block_size: 64"),
    ({"quantize": "int4", "quant_grid": "gguf", "quant_symmetric": False}, "it takes no quant_symmetric: false"),
    ({"quant_grid": "gguf"}, "quant_grid set how weights are quantized; they do nothing with quantize: none"),
    ({"quant_block_size": 64, "quant_lm_head": False}, "quant_block_size, quant_lm_head set how weights"),
    ({"quantize": "int8", "quant_block_size": 100}, "block_size must be a power of two"),
])
def test_an_onnxruntime_target_refuses_quant_fields_it_cannot_honour_when_parsed(fields, named):
    """The CLI refused these flags, a config's target section did not: int8 on the gguf grid was
    refused only after a whole export (33 s for SmolLM2), and quant fields without quantize did
    nothing."""
    from spec_plugins.config import ConfigError, SpecConfig

    with pytest.raises(ConfigError, match=named):
        SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "smollm2-135m-instruct", **fields}})
    ok = SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "smollm2-135m-instruct", "quantize": "int4",
                                      "quant_grid": "gguf"}})
    assert ok.target.scheme()["grid"] == "gguf"
    for target in ({"backend": "onnxruntime", "model": "smollm2-135m-instruct"}, ok.target.model_dump(mode="json")):
        plain = SpecConfig.parse({"target": target})  # a dumped config (serve --ray, bench --methods) reads back
        assert SpecConfig.parse(plain.model_dump(mode="json")) == plain


# ---- what the verify graph can express: windows, positions ---------------------------------------
def _windowed(family: str, window: int | None):
    """A tiny Mistral or Phi3 whose every layer slides (``sliding_window`` set, no ``layer_types``)."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, sliding_window=window,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = T.MistralConfig(**common) if family == "mistral" else T.Phi3Config(**common)
    cfg._attn_implementation = "sdpa"
    return (T.MistralForCausalLM if family == "mistral" else T.Phi3ForCausalLM)(cfg).eval()


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_sliding_window_model_without_layer_types_is_refused(tmp_path, family):
    """Only layer_types were read: a Mistral-style window was exported as full attention and the graph
    attended to the whole past (output past the window differed from generate())."""
    from spec_plugins.exporters.onnx_verify import UnsupportedModel, check_exportable

    with pytest.raises(UnsupportedModel, match=r"sliding window \(sliding_window=6, below its context of 256\)"):
        export_models(tmp_path / "out", (_windowed(family, 6), None, "tiny"))
    assert list(Path(tmp_path).iterdir()) == []
    check_exportable(_windowed(family, None))  # no window, or one no query reaches past: full attention
    check_exportable(_windowed(family, 256))


def test_a_graph_holds_the_context_its_positions_are_exact_for(with_eagle):
    """LongRoPE picks its factors from each forward's largest position, in a traced graph too: the
    graph's context is original_max_position_embeddings (where the export traces; transformers 5.25's
    in-place frequency switch is not an ONNX op), recorded as its ``context_cap``; ONNX Runtime
    refuses a context past a graph's cap, and takes any context for a graph with none (a plain rope
    runs past max_position_embeddings as the model does)."""
    from test_runtime_hardening import ORIGINAL, tiny_longrope_phi3

    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime, create_session
    from spec_plugins.exporters.onnx_verify import graph_shape

    from spec_plugins.backends import hf_compat

    assert graph_shape(tiny_longrope_phi3()).max_context == ORIGINAL
    assert hf_compat.context_cap(tiny_longrope_phi3()) == ORIGINAL
    entry = Manifest.read(with_eagle).graph("verify")
    assert entry.context_cap is None  # a plain rope: nothing caps it
    session = create_session(with_eagle / entry.file, "cpu")
    assert OnnxRuntime(session, entry, max_context=300).max_context == 300
    assert OnnxRuntime(session, entry).max_context == 256
    capped = dataclasses.replace(entry, context_cap=200)
    with pytest.raises(ValueError, match=r"max_context 300 exceeds the 200 positions graph 'verify' is exact for"):
        OnnxRuntime(session, capped, max_context=300)
    assert OnnxRuntime(session, capped, max_context=200).max_context == 200


# ---- export onnx finds the heads where decoding does ---------------------------------------------
def test_export_finds_a_shipped_head_from_any_directory_as_the_proposers_do(tmp_path, monkeypatch):
    """docs/proposers.md's `heads: examples/heads/...` decodes from any directory (the proposers
    also look relative to the repository root); `export onnx` looked only in the current one."""
    import spec_plugins.backends.torch_runtime as runtime
    import spec_plugins.exporters.onnx_export as onnx_export
    from spec_plugins.config import SpecConfig
    from spec_plugins.heads import ParallelDrafter
    from spec_plugins.proposers.medusa import resolve_head_dir

    shipped = "examples/heads/smollm2-135m-instruct/parallel"
    target = tiny_llama(vocab=49152, hidden=576, layers=1, max_pos=64)  # the shipped head's widths, one layer
    monkeypatch.setattr(runtime, "load_hf", lambda *a, **k: (target, None))
    exported: list = []
    monkeypatch.setattr(onnx_export, "export_models", lambda *args: exported.append(args[6]))
    monkeypatch.chdir(tmp_path)

    def config(heads: str) -> SpecConfig:
        return SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "smollm2-135m-instruct"},
                                 "proposer": {"type": "parallel", "heads": heads}})

    onnx_export.export_config(config(shipped), tmp_path / "out")
    (kind, head, where), = exported[0]
    assert kind == "parallel" and isinstance(head, ParallelDrafter)
    assert Path(where) == resolve_head_dir(shipped) and Path(where).is_absolute()
    with pytest.raises(FileNotFoundError, match=r"train \{medusa,eagle,parallel\}"):
        onnx_export.export_config(config("no/such/heads"), tmp_path / "out2")
