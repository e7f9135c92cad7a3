"""ONNX export of verify/draft graphs and heads, the manifest, and the parity check."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from spec_plugins.graphs.manifest import Manifest, ManifestError  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.exporters.parity import check_export  # noqa: E402


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    target, draft = tiny_llama(vocab=32, seed=2, sharpness=4.0), tiny_llama(vocab=32, seed=3, sharpness=4.0)
    out = tmp_path_factory.mktemp("onnx") / "export"
    man = export_models(out, (target, None, "tiny-target"), (draft, "tiny-draft"))
    return out, man, target, draft


def test_manifest_and_dynamic_axes(tiny_export):
    import onnx

    out, man, target, _ = tiny_export
    read = Manifest.read(out)
    assert [g.name for g in read.graphs] == ["verify", "draft"]
    g = read.graph("verify")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.vocab_size) == (2, 2, 8, 32)
    assert g.source_model == "tiny-target" and g.dtype == "float32" and g.size_bytes > 0
    assert read.opset == 17 and read.exporter_version and "torch" in read.versions
    model = onnx.load(str(out / g.file), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["input_ids"] == ["B", "N"]
    assert dims["attention_mask"] == ["B", 1, "N", "T"]
    assert dims["past_key.0"] == ["B", 2, "P", 8]
    outs = [o.name for o in model.graph.output]
    # the target's graph also returns EAGLE-3's low/mid/high decoder-layer outputs; the draft's not
    assert outs[:4] == ["logits", "hidden", "features", "present_key.0"] and len(outs) == 3 + 2 * 2
    assert g.feature_layers == [2, 1, 1] and read.graph("draft").feature_layers == []
    spec = next(o for o in g.outputs if o["name"] == "features")
    assert spec["shape"] == ["B", "N", 3 * 32]


def test_parity_passes_for_each_graph(tiny_export):
    out, _, target, draft = tiny_export
    rep = check_export(out, gamma=3, max_new_tokens=16, models={"tiny-target": target, "tiny-draft": draft})
    assert rep.ok, rep.format()
    labels = {(c.graph, c.case) for c in rep.cases}
    for n in range(1, 5):  # N = 1..gamma+1, chain, random inputs, non-empty past
        assert ("verify", f"random B=2 N={n} P=7 chain") in labels
    assert ("verify", "random B=2 N=4 P=7 tree") in labels
    assert any("real tree" in c for _, c in labels)
    assert [g.graph for g in rep.greedy] == ["verify", "draft"] and all(g.identical for g in rep.greedy)
    assert max(c.rel for c in rep.cases) < 1e-4


def test_parity_detects_a_different_model(tiny_export):
    """Power check: the same graph compared against another model's weights must fail."""
    out, _, _, draft = tiny_export
    other = tiny_llama(vocab=32, seed=7, sharpness=4.0)
    rep = check_export(out, gamma=2, max_new_tokens=8, models={"tiny-target": other, "tiny-draft": draft})
    assert not rep.ok
    assert any(not c.ok and c.graph == "verify" for c in rep.cases)
    assert all(c.ok for c in rep.cases if c.graph == "draft")


def test_manifest_errors_name_the_problem(tmp_path, tiny_export):
    with pytest.raises(ManifestError, match="manifest.json not found"):
        Manifest.read(tmp_path)
    out, man, _, _ = tiny_export
    data = json.loads((out / "manifest.json").read_text())
    data["exporter_version"] = "0"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="exporter version '0'"):
        Manifest.read(tmp_path)
    data["exporter_version"] = man.exporter_version
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="verify.onnx, which does not exist"):
        Manifest.read(tmp_path)
    with pytest.raises(ManifestError, match="no graph 'medusa'"):
        man.graph("medusa")


def test_heads_export_and_parity(tmp_path):
    from spec_plugins.exporters.onnx_heads import check_head
    from spec_plugins.heads import EagleConfig, EagleDrafter, MedusaConfig, MedusaHeads

    model = tiny_llama(vocab=32, seed=2)
    lm, emb = model.lm_head.weight, model.model.embed_tokens.weight
    vocab_ids = torch.arange(0, 32, 2)
    torch.manual_seed(0)
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, num_heads=3, draft_vocab_size=16), lm, vocab_ids,
                         zero_init=False)
    eagle = EagleDrafter(EagleConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                     draft_vocab_size=16), lm, emb, vocab_ids)
    out = tmp_path / "export"
    man = export_models(out, (model, None, "tiny"), heads=[("medusa", medusa, "unused"), ("eagle", eagle, "unused")])
    assert [(g.name, g.kind, g.vocab_size) for g in man.graphs[1:]] == [("medusa", "medusa_heads", 16),
                                                                         ("eagle", "eagle_layer", 16)]
    rep = check_export(out, gamma=1, max_new_tokens=4, models={"tiny": model},
                       heads={"medusa": medusa, "eagle": eagle})
    assert rep.ok, rep.format()
    assert sum(c.graph == "medusa" for c in rep.cases) == 3 and sum(c.graph == "eagle" for c in rep.cases) == 9
    for name, head in (("medusa", medusa), ("eagle", eagle)):
        entry = man.graph(name)
        # power check: a perturbed module no longer matches the graph
        with torch.no_grad():
            next(p for p in head.parameters() if p.dim() == 2).add_(0.5)
        assert not all(c.ok for c in check_head(out, entry, None, 1e-4, module=head))


@pytest.mark.parametrize("bits,lm_head", [(4, True), (8, False)])
def test_quantized_export_is_exact_to_itself_and_reports_its_error(tmp_path, bits, lm_head):
    """--quantize: the graph's MatMuls become MatMulNBits (the LM head too unless kept fp32), the
    manifest records the scheme, the check holds the logit error against fp32 to its loose bound
    (reported; its power: tests/test_export_hardening.py) and requires the
    quantized graph's speculative greedy output to equal its own plain greedy output."""
    import onnx

    from spec_plugins.graphs.quant import QuantScheme

    target = tiny_llama(vocab=32, seed=2, sharpness=4.0)
    scheme = QuantScheme(bits=bits, block_size=16, lm_head=lm_head)
    man = export_models(tmp_path / "q", (target, None, "tiny-target"), quantize=scheme)
    g = man.graph("verify")
    assert g.quantization["name"] == scheme.name and g.file == f"verify.{scheme.name}.onnx"
    assert not (tmp_path / "q" / "verify.onnx").exists()
    kinds = [n.op_type for n in onnx.load(str(tmp_path / "q" / g.file)).graph.node]
    assert kinds.count("MatMulNBits") == 2 * 7 + int(lm_head)  # q k v o gate up down per layer (+ LM head)
    rep = check_export(tmp_path / "q", gamma=3, max_new_tokens=16, models={"tiny-target": target})
    assert rep.ok, rep.format()
    assert rep.quantized == ["verify"] and rep.to_dict()["quantized_max_rel"] > 0
    assert rep.greedy and rep.greedy[0].identical
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        QuantScheme(bits=3)


def _gguf_and_graph(tmp_path, names, chained, permute=False, second="Q8_0"):
    """A GGUF with a Q4_1 tensor and a ``second`` (Q8_0 or F16) tensor (``names``), and an fp32 graph of MatMuls over
    their dequantized weights named ``/<name>/MatMul``, as an export of a GGUF model holds them:
    ``chained`` (the second reads the first's output, as an LM head does) or both reading x;
    ``permute``: the first's rows permuted, as a loader may do. Returns (graph, GGUF, K, rng)."""
    import gguf
    import numpy as np
    import onnx
    from gguf.quants import dequantize, quantize
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    K, N1, N2 = 64, 48, 40
    Q = gguf.GGMLQuantizationType
    raw1 = quantize(rng.standard_normal((N1, K)).astype(np.float32), Q.Q4_1)
    w2 = rng.standard_normal((N2, K)).astype(np.float32)
    raw2 = quantize(w2, Q.Q8_0) if second == "Q8_0" else w2.astype(np.float16)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor(f"{names[0]}.weight", raw1, raw_shape=raw1.shape, raw_dtype=Q.Q4_1)
    w.add_tensor(f"{names[1]}.weight", raw2, raw_shape=raw2.shape, raw_dtype=Q[second])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    W1 = dequantize(raw1, Q.Q4_1)
    W1 = W1[rng.permutation(N1)] if permute else W1
    W2 = dequantize(raw2, Q[second]).astype(np.float32)
    a, b = (f"/{n}/MatMul" for n in names)
    second = "h" if chained else "x"
    outs = [("y2", N2)] if chained else [("h", N1), ("y2", N2)]
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name=a),
         helper.make_node("MatMul", [second, "w2"], ["y2"], name=b)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, K])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, None, d]) for n, d in outs],
        initializer=[numpy_helper.from_array(W1.T.copy(), "w1"), numpy_helper.from_array(W2.T.copy(), "w2")])
    # IR 8 (opset 17): an explicit IR version every onnxruntime in the supported range loads
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "f.onnx"))
    return tmp_path / "f.onnx", tmp_path / "m.gguf", K, rng


def test_gguf_grid_carries_q4_1_and_q8_0_blocks_exactly(tmp_path):
    """grid: gguf turns MatMuls over dequantized GGUF tensors into MatMulNBits over the same
    blocks (rows matched even when permuted): with fp32 compute the graph equals the original."""
    import numpy as np
    import onnxruntime as ort

    from spec_plugins.exporters.onnx_quantize import carry_gguf_grid

    src, gguf_file, K, rng = _gguf_and_graph(tmp_path, ("a", "b"), chained=False, permute=True)
    info = carry_gguf_grid(src, tmp_path / "q.onnx", gguf_file, accuracy_level=1)
    assert info["carried"] == 2 and info["quantized_matmuls"] == 2
    x = rng.standard_normal((1, 5, K)).astype(np.float32)
    want = ort.InferenceSession(str(src)).run(None, {"x": x})
    got = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lm_head", [False, True])
def test_gguf_grid_honours_fp32_lm_head(tmp_path, lm_head):
    """``--fp32-lm-head`` with the GGUF grid: the LM head stays a float MatMul (it was carried as
    MatMulNBits while the manifest said float), the other layer is carried either way."""
    import onnx

    from spec_plugins.exporters.onnx_quantize import quantize_graph
    from spec_plugins.graphs.quant import QuantScheme

    src, gguf_file, _, _ = _gguf_and_graph(tmp_path, ("layer", "lm_head"), chained=True)
    scheme = QuantScheme(bits=4, accuracy_level=4, lm_head=lm_head, grid="gguf")
    info = quantize_graph(src, tmp_path / "q.onnx", scheme, gguf_file)
    kinds = {n.name: n.op_type for n in onnx.load(str(tmp_path / "q.onnx"), load_external_data=False).graph.node}
    head = [op for name, op in kinds.items() if "lm_head" in name]
    assert head == (["MatMulNBits"] if lm_head else ["MatMul"])  # the manifest's lm_head is what the graph holds
    assert info["lm_head"] is lm_head and info["carried"] == (2 if lm_head else 1)
    assert "MatMulNBits" in kinds.values()


def test_a_gguf_with_no_block_the_grid_carries_is_refused_not_labelled_int4(tmp_path):
    """A GGUF of other block types (Q4_K_M models) carried nothing: the graph stayed float while its
    manifest said int4. The export and tune's default runtimes refuse it, naming what it holds."""
    import gguf
    import numpy as np

    from spec_plugins.exporters.onnx_quantize import quantize_graph
    from spec_plugins.graphs.quant import QuantScheme
    from spec_plugins.tune import unavailable

    src, carriable, _, _ = _gguf_and_graph(tmp_path, ("layer", "lm_head"), chained=True)
    w = gguf.GGUFWriter(str(tmp_path / "f32.gguf"), "llama")
    w.add_tensor("layer.weight", np.ones((48, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="carries Q4_1 and Q8_0 blocks; f32.gguf holds F32"):
        quantize_graph(src, tmp_path / "q.onnx", QuantScheme(bits=4, grid="gguf"), tmp_path / "f32.gguf")
    assert not (tmp_path / "q.onnx").exists()
    assert "holds none" in unavailable("onnxruntime-int4", str(tmp_path / "f32.gguf"))
    assert unavailable("onnxruntime-int4", str(carriable)) is None


def test_gguf_scheme_names_the_fp32_head():
    """The name keys the export cache: an fp32 head must not reuse a quantized head's export."""
    from spec_plugins.graphs.quant import QuantScheme

    fields = dict(bits=4, block_size=32, symmetric=True, accuracy_level=4, grid="gguf")
    assert QuantScheme(**fields, lm_head=True).name == "int4-gguf-acc4"
    assert QuantScheme(**fields, lm_head=False).name == "int4-gguf-acc4-fp32head"


def test_export_replaces_only_a_previous_export(tmp_path, monkeypatch):
    """The output directory is replaced only when it is new, empty or a previous export: a
    directory of other files, the working directory and its parents are refused untouched."""
    model = tiny_llama(vocab=32, seed=2)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", work, tmp_path):
        with pytest.raises(ValueError, match="current directory or one above it"):
            export_models(out, (model, None, "tiny"), feature_layers=())
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(ValueError, match=f"{work} is not empty and holds no ONNX export"):
        export_models(tmp_path / "work", (model, None, "tiny"), feature_layers=())
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # no temporary directory left
    empty = tmp_path / "empty"
    empty.mkdir()
    export_models(empty, (model, None, "tiny"), feature_layers=())
    (empty / "stale.onnx").write_text("left by an older export")
    export_models(empty, (model, None, "tiny"), feature_layers=())  # a previous export: replaced whole
    assert not (empty / "stale.onnx").exists() and Manifest.read(empty).graph("verify")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "work"]


def test_unsupported_dtype_and_opset_are_refused_before_tracing(tmp_path):
    model = tiny_llama(vocab=32, seed=2)
    with pytest.raises(ValueError, match=r"opset 30 is not supported.*opsets 14\.\.20"):
        export_models(tmp_path / "a", (model, None, "tiny"), opset=30)
    with pytest.raises(ValueError, match="tiny is loaded as bfloat16.*float32 or float16"):
        export_models(tmp_path / "b", (model.to(torch.bfloat16), None, "tiny"))
    assert not list(tmp_path.iterdir())


def test_float16_export_is_held_to_the_float16_tolerance(tmp_path):
    """A float16 graph differs from float16 PyTorch by float16 rounding (~1e-3 relative), far
    above float32's 1e-4: the check's default tolerance follows the graph's dtype."""
    model = tiny_llama(vocab=32, seed=4, sharpness=4.0).half()
    export_models(tmp_path / "h", (model, None, "tiny"), feature_layers=())
    rep = check_export(tmp_path / "h", gamma=3, max_new_tokens=8, models={"tiny": model})
    assert rep.ok, rep.format()
    from spec_plugins.exporters.parity import RTOL

    assert rep.tolerances == {"verify": RTOL["float16"]} and max(c.rel for c in rep.cases) > RTOL["float32"]
    assert not check_export(tmp_path / "h", gamma=1, rtol=1e-6, max_new_tokens=4, models={"tiny": model}).ok
    other = tiny_llama(vocab=32, seed=7, sharpness=4.0).half()  # power: another model fails at this tolerance
    rep = check_export(tmp_path / "h", gamma=1, max_new_tokens=4, models={"tiny": other})
    assert any(not c.ok for c in rep.cases), rep.format()


def _edited(tmp_path, src, name, edit):
    """A copy of export ``src`` whose manifest ``edit(manifest, verify graph entry)`` changed."""
    import shutil

    d = tmp_path / name
    shutil.copytree(src, d)
    data = json.loads((d / "manifest.json").read_text())
    edit(data, data["graphs"][0])
    (d / "manifest.json").write_text(json.dumps(data))
    return d


@pytest.mark.parametrize("name,edit,message", [
    ("file_null", lambda m, g: g.update(file=None), r"graphs\[0\] \('verify'\) field file: .*valid string"),
    ("quant_str", lambda m, g: g.update(quantization="int8"), "field quantization: .*valid dictionary"),
    ("eos_str", lambda m, g: m.update(eos_token_ids="abc"), "field eos_token_ids: .*valid list"),
    ("layers_bool", lambda m, g: g.update(num_layers=True), "field num_layers: .*valid integer"),
    ("unknown", lambda m, g: g.update(colour="red"), "unknown field.*colour"),
    ("missing", lambda m, g: g.pop("dtype"), "lacks field.*dtype"),
    ("graphs_dict", lambda m, g: m.update(graphs={"verify": g}), "graphs must be a list"),
    ("max_context", lambda m, g: g.update(max_context=0), "max_context is 0"),
    ("dtype", lambda m, g: g.update(dtype="bfloat16"), "dtype 'bfloat16'; decoder graphs are float32 or float16"),
    ("features", lambda m, g: g.update(feature_layers=[0, 5]), r"feature_layers \[5\] are outside 0..num_layers"),
    ("tokenizer", lambda m, g: m.update(tokenizer="nope"), "tokenizer 'nope' names a directory that does not"),
])
def test_hand_edited_manifests_fail_on_read_naming_the_field(tmp_path, tiny_export, name, edit, message):
    out, _, _, _ = tiny_export
    with pytest.raises(ManifestError, match=message):
        Manifest.read(_edited(tmp_path, out, name, edit))


def test_missing_external_weights_file_is_named(tmp_path):
    from spec_plugins.graphs.quant import QuantScheme

    out = tmp_path / "q"
    export_models(out, (tiny_llama(vocab=32, seed=2), None, "tiny"), feature_layers=(),
                  quantize=QuantScheme(bits=8, block_size=16))
    g = Manifest.read(out).graph("verify")
    (out / (g.file + ".data")).unlink()
    with pytest.raises(ManifestError, match=rf"keeps its weights in {g.file}\.data, which does not exist"):
        Manifest.read(out)
