"""The GGUF grid keeps the LM head fp32 when asked (and names that in its scheme); tune's default
runtimes are those that can run the model, so it completes on a transformers directory."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from conftest import tiny_llama

needs_ort = pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs the [onnx] extra")


def _gguf_graph(tmp_path):
    """A GGUF with a Q4_1 layer and a Q8_0 LM head, and an fp32 graph of MatMuls over their
    dequantized weights (as an export of a GGUF model holds)."""
    import gguf
    import numpy as np
    import onnx
    from gguf.quants import dequantize, quantize
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    K, N1, N2 = 64, 64, 40
    Q = gguf.GGMLQuantizationType
    raw1 = quantize(rng.standard_normal((N1, K)).astype(np.float32), Q.Q4_1)
    raw2 = quantize(rng.standard_normal((N2, K)).astype(np.float32), Q.Q8_0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw1, raw_shape=raw1.shape, raw_dtype=Q.Q4_1)
    w.add_tensor("output.weight", raw2, raw_shape=raw2.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    W1, W2 = dequantize(raw1, Q.Q4_1), dequantize(raw2, Q.Q8_0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="/layer/MatMul"),
         helper.make_node("MatMul", ["h", "w2"], ["logits"], name="/lm_head/MatMul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, K])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, None, N2])],
        initializer=[numpy_helper.from_array(W1.T.copy(), "w1"), numpy_helper.from_array(W2.T.copy(), "w2")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "f.onnx"))
    return tmp_path / "f.onnx", tmp_path / "m.gguf"


@needs_ort
@pytest.mark.parametrize("lm_head", [False, True])
def test_gguf_grid_honours_fp32_lm_head(tmp_path, lm_head):
    import onnx

    from spec_plugins.exporters.onnx_quantize import quantize_graph
    from spec_plugins.graphs.quant import QuantScheme

    src, gguf_file = _gguf_graph(tmp_path)
    scheme = QuantScheme(bits=4, accuracy_level=4, lm_head=lm_head, grid="gguf")
    info = quantize_graph(src, tmp_path / "q.onnx", scheme, gguf_file)
    kinds = {n.name: n.op_type for n in onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph.node}
    head = [op for name, op in kinds.items() if "lm_head" in name]
    assert head == (["MatMulNBits"] if lm_head else ["MatMul"])  # the manifest's lm_head is what the graph holds
    assert info["lm_head"] is lm_head and info["carried"] == (2 if lm_head else 1)
    assert "MatMulNBits" in kinds.values()  # the other layer is carried either way


def test_gguf_scheme_names_the_fp32_head():
    """The name keys the export cache: an fp32 head must not reuse a quantized head's export."""
    from spec_plugins.graphs.quant import QuantScheme

    fields = dict(bits=4, block_size=32, symmetric=True, accuracy_level=4, grid="gguf")
    assert QuantScheme(**fields, lm_head=True).name == "int4-gguf-acc4"
    assert QuantScheme(**fields, lm_head=False).name == "int4-gguf-acc4-fp32head"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("tune") / "tiny-model"
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w31").save_pretrained(str(d))
    tiny_llama(vocab=32, seed=4, sharpness=4.0).save_pretrained(str(d))
    return d


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"question_id": "a", "category": "x", "turns": ["w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"]}\n'
                 '{"question_id": "b", "category": "x", "turns": ["w5 w6 w7 w5 w6 w7 w5"]}\n')
    return p


def test_gguf_runtimes_are_refused_for_a_transformers_dir_before_loading(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["tune", "--model", str(tiny_dir), "--prompts", str(_prompts(tmp_path)),
                                 "--runtimes", "torch,onnxruntime-int4", "--proposers", "ngram",
                                 "--max-new-tokens", "8", "--out", str(tmp_path / "t.yaml")])
    assert r.exit_code == 2 and "runtime 'onnxruntime-int4' needs a GGUF model" in r.output
    assert "[tune] torch" not in r.output  # refused before anything was measured


def test_tune_default_runtimes_complete_on_a_transformers_dir(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app
    from spec_plugins.config import SpecConfig

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "t.yaml"
    r = CliRunner().invoke(app, ["tune", "--model", str(tiny_dir), "--prompts", str(_prompts(tmp_path)),
                                 "--proposers", "ngram", "--max-new-tokens", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "runtime onnxruntime-int4 left out: it needs a GGUF model" in r.output
    text = out.read_text()
    assert "# note: runtime onnxruntime-int4 left out" in text and "onnxruntime-int4:" not in text
    SpecConfig.parse(yaml.safe_load(text))
