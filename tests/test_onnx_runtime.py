"""The ONNX Runtime backend: KV bookkeeping vs the torch runtime, swap by config, errors."""

from __future__ import annotations

import re
import sys

import pytest
import torch

pytest.importorskip("onnxruntime")

from conftest import tiny_llama  # noqa: E402
from helpers import plain_greedy  # noqa: E402
from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime, create_session, providers_for  # noqa: E402
from spec_plugins.backends.torch_runtime import TorchRuntime  # noqa: E402
from spec_plugins.config import SamplingConfig, SpecConfig  # noqa: E402
from spec_plugins.loop import decode
from spec_plugins.policy import DraftPolicy, FixedLength  # noqa: E402
from spec_plugins.graphs.manifest import Manifest  # noqa: E402
from spec_plugins.exporters.onnx_export import export_models  # noqa: E402
from spec_plugins.proposers.draft_model import DraftModelProposer  # noqa: E402
from spec_plugins.sampling import LogitsPipeline  # noqa: E402
from spec_plugins.tree import layout, with_root  # noqa: E402
from spec_plugins.verifiers import ExactVerifier  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    target, draft = tiny_llama(vocab=32, seed=2, sharpness=4.0), tiny_llama(vocab=32, seed=5, sharpness=4.0)
    out = tmp_path_factory.mktemp("onnxrt") / "export"
    export_models(out, (target, None, "tiny"), (draft, "tiny-draft"))
    return out, target, draft


def ort_runtime(out, graph: str = "verify", **kw) -> OnnxRuntime:
    man = Manifest.read(out)
    entry = man.graph(graph)
    return OnnxRuntime(create_session(out / entry.file, "cpu", **kw), entry)


def test_bookkeeping_matches_torch_runtime(exported):
    """Left-padded prefill, tree forward, per-row path commit, rollback, row selection, hidden."""
    out, model, _ = exported
    rt, ref = ort_runtime(out), TorchRuntime(model)
    rows = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    torch.testing.assert_close(rt.prefill(rows).logits, ref.prefill(rows).logits, atol=1e-4, rtol=1e-4)
    tree = layout(with_root((-1, -1, 0, 1, 1)))
    toks = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rt.forward(toks, tree=tree).logits, ref.forward(toks, tree=tree).logits,
                               atol=1e-4, rtol=1e-4)
    for r in (rt, ref):
        r.commit([[0, 2, 5], [0, 1], [0]])
    t = torch.tensor([[3, 4], [5, 6], [7, 8]])
    torch.testing.assert_close(rt.forward(t).logits, ref.forward(t).logits, atol=1e-4, rtol=1e-4)
    for r in (rt, ref):
        r.commit([[0], [0, 1], [0]])
        r.rollback([6, 4, 3])
        r.select_rows([0, 2])
    assert rt.lengths() == ref.lengths() == [6, 3]
    t = torch.tensor([[1, 2, 3], [4, 5, 6]])
    a, b = rt.forward(t, want_hidden=True), ref.forward(t, want_hidden=True)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)
    # after commit + rollback the ORT cache equals a fresh prefill of the same tokens
    rt.commit([[0, 1], [0]])
    fresh = ort_runtime(out)
    fresh.prefill([[1, 2, 3, 4, 5, 6, 1, 2]])
    rt.select_rows([0])
    assert rt.lengths() == [8]
    live = rt.slots.pos[0] >= 0
    for k_live, k_fresh in zip(rt.kv, fresh.kv):
        torch.testing.assert_close(k_live[0][:, live], k_fresh[0], atol=1e-4, rtol=1e-4)


def _greedy(target, draft_rt, prompts, n=24):
    prop = DraftModelProposer(None, target=target, runtime=draft_rt)
    outs = [[] for _ in prompts]
    for step in decode(target, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, n, (), None, None,
                       FixedLength(4)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs


def test_mixed_runtimes_give_the_same_greedy_tokens(exported):
    out, target, draft = exported
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9]]
    want = _greedy(TorchRuntime(target), TorchRuntime(draft), prompts)
    assert _greedy(ort_runtime(out), TorchRuntime(draft), prompts) == want  # ORT target, torch draft
    assert _greedy(TorchRuntime(target), ort_runtime(out, "draft"), prompts) == want  # torch target, ORT draft
    assert _greedy(ort_runtime(out), ort_runtime(out, "draft"), prompts) == want


def test_session_settings_and_cuda_error(exported):
    out, _, _ = exported
    with pytest.raises(ValueError, match="no CUDAExecutionProvider.*spec-plugins\\[gpu\\]"):
        providers_for("cuda", ["CPUExecutionProvider"])
    assert providers_for("auto", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert providers_for("auto", ["CUDAExecutionProvider", "CPUExecutionProvider"])[0] == "CUDAExecutionProvider"
    s = create_session(out / "verify.onnx", "cpu", graph_optimization="disable", threads=1)
    assert s.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="graph_optimization='fast'"):
        create_session(out / "verify.onnx", "cpu", graph_optimization="fast")


def test_cuda_provider_options_name_a_torch_stream():
    """A CUDA session's kernels run on the torch stream given as ``user_compute_stream`` (the
    runtime orders it after torch's current stream); the null stream is refused by name, since
    ONNX Runtime would read it as none and run on a stream nothing orders."""
    from spec_plugins.backends.onnxruntime_runtime import provider_options

    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert provider_options(cuda, 1, 1234) == [{"device_id": "1", "user_compute_stream": "1234"}, {}]
    assert provider_options(["CPUExecutionProvider"], 0, None) == [{}]
    for stream in (None, 0):
        with pytest.raises(ValueError, match="user_compute_stream"):
            provider_options(cuda, 0, stream)


def _ort_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers() and torch.cuda.is_available()


@pytest.mark.skipif(not _ort_cuda(), reason="needs onnxruntime-gpu (CUDAExecutionProvider) and a CUDA torch")
def test_cuda_session_reads_inputs_torch_wrote_on_another_stream(exported):
    import onnxruntime

    out, _, _ = exported
    entry = Manifest.read(out).graph("verify")
    session = create_session(out / entry.file, "cuda")
    assert int(session.get_provider_options()["CUDAExecutionProvider"]["user_compute_stream"]) != 0
    rt, cpu = OnnxRuntime(session, entry), ort_runtime(out)
    rows = [[1, 2, 3, 4, 5, 6], [7, 8]]
    side = torch.cuda.Stream(rt.device)
    with torch.cuda.stream(side):  # torch's current stream at run time is not the one the session was made on
        busy = torch.randn(4096, 4096, device=rt.device)
        for _ in range(8):
            busy = busy @ busy / 64  # the inputs' copies queue behind this work
        logits = rt.prefill(rows).logits
    torch.testing.assert_close(logits.cpu(), cpu.prefill(rows).logits, atol=1e-4, rtol=1e-4)
    own = onnxruntime.InferenceSession(str(out / entry.file), providers=["CUDAExecutionProvider"])
    with pytest.raises(ValueError, match="user_compute_stream"):
        OnnxRuntime(own, entry)


def test_missing_onnxruntime_gives_install_hint(monkeypatch):
    from spec_plugins.backends.onnxruntime_runtime import import_ort

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'spec-plugins\[onnx\]'"):
        import_ort()
    # configs still validate without onnxruntime
    cfg = SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "x", "threads": 2}})
    assert cfg.target.threads == 2
    with pytest.raises(ImportError, match="onnx"):
        OnnxRuntime.from_config(cfg.target)


def test_config_errors_are_named(exported):
    out, _, _ = exported
    from spec_plugins.config import ConfigError

    with pytest.raises(ConfigError, match="graph_optimization"):
        SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "tiny", "graph_optimization": "max"}})
    with pytest.raises(ConfigError, match="device"):
        SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "tiny", "device": "tpu"}})
    cfg = OnnxRuntime.Config(model="other", path=str(out))
    with pytest.raises(ValueError, match="exported from model 'tiny'"):
        OnnxRuntime.from_config(cfg)


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A tiny llama + word-level tokenizer saved as a local transformers directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path / "tiny-model"
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w31").save_pretrained(str(d))
    tiny_llama(vocab=32, seed=4, sharpness=4.0).save_pretrained(str(d))
    return d


def test_swap_by_config_export_on_first_use_and_cli(tiny_model_dir, tmp_path, monkeypatch):
    """Same config, only the backend changed: same greedy tokens; the export is cached; the CLI
    exports and checks the same model."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app
    from spec_plugins.decoder import SpeculativeDecoder

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    base = {"proposer": {"type": "ngram", "num_draft_tokens": 4}, "sampling": {"temperature": 0.0}}
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 6]
    res = {}
    for backend in ("torch", "onnxruntime"):
        cfg = SpecConfig.parse({"target": {"backend": backend, "model": str(tiny_model_dir)}, **base})
        dec = SpeculativeDecoder.from_config(cfg)
        res[backend] = dec.generate(prompt, max_new_tokens=20).token_ids
    assert res["torch"] == res["onnxruntime"] and len(res["torch"]) > 0
    cached = list((tmp_path / "cache" / "onnx").iterdir())
    assert len(cached) == 1 and (cached[0] / "manifest.json").is_file()
    stamp = (cached[0] / "manifest.json").stat().st_mtime_ns
    SpeculativeDecoder.from_config(SpecConfig.parse({"target": {"backend": "onnxruntime",
                                                                "model": str(tiny_model_dir)}}))
    assert (cached[0] / "manifest.json").stat().st_mtime_ns == stamp  # reused, not re-exported

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"target: {{backend: torch, model: '{tiny_model_dir}'}}\n")
    runner = CliRunner()
    r = runner.invoke(app, ["export", "onnx", "--config", str(cfg_file), "--out", str(tmp_path / "exp")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["export", "check", str(tmp_path / "exp"), "--gamma", "2", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and "greedy speculative" in r.output
    r = runner.invoke(app, ["export", "check", str(tmp_path / "exp"), "--graph", "nope"])
    assert r.exit_code == 2 and "no graph 'nope'" in r.output
    r = runner.invoke(app, ["export", "check", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "manifest.json not found" in r.output


def test_add_rows_matches_torch_runtime(exported):
    """Continuous batching: rows joining a running batch score like in the torch runtime."""
    out, model, _ = exported
    rt, ref = ort_runtime(out), TorchRuntime(model)
    for r in (rt, ref):
        r.prefill([[1, 2, 3]])
        r.forward(torch.tensor([[4, 5]]))
        r.commit([[0, 1]])
    torch.testing.assert_close(rt.add_rows([[6, 7, 8, 9, 10, 11], [12]]).logits,
                               ref.add_rows([[6, 7, 8, 9, 10, 11], [12]]).logits, atol=1e-4, rtol=1e-4)
    assert rt.lengths() == ref.lengths() == [5, 6, 1]
    t = torch.tensor([[1, 2], [3, 4], [5, 6]])
    torch.testing.assert_close(rt.forward(t).logits, ref.forward(t).logits, atol=1e-4, rtol=1e-4)


def test_export_config_with_medusa_heads(tiny_model_dir, tmp_path):
    """A medusa proposer's trained heads are exported next to the verify graph and checked."""
    from transformers import AutoModelForCausalLM

    from spec_plugins.exporters.onnx_export import export_config
    from spec_plugins.exporters.parity import check_export
    from spec_plugins.heads import MedusaConfig, MedusaHeads, save_head

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=32, num_heads=2, draft_vocab_size=8), model.lm_head.weight,
                        torch.arange(8), zero_init=False)
    save_head(heads, heads.config.to_dict(), tmp_path / "heads", dtype=torch.float32)
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": str(tiny_model_dir)},
                            "proposer": {"type": "medusa", "heads": str(tmp_path / "heads")}})
    man = export_config(cfg, tmp_path / "exp")
    assert [g.name for g in man.graphs] == ["verify", "medusa"]
    rep = check_export(tmp_path / "exp", gamma=1, max_new_tokens=4)
    assert rep.ok and sum(c.graph == "medusa" for c in rep.cases) == 3, rep.format()
    with pytest.raises(ValueError, match="medusa_heads graph; the onnxruntime backend runs decoder graphs"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model=str(tiny_model_dir), path=str(tmp_path / "exp"),
                                                   graph="medusa"))


def test_failed_admission_leaves_the_running_rows_as_they_were(exported):
    """Atomic admission on ONNX Runtime's bookkeeping: the graph call for the new rows fails after
    the runtime started their prefill; the running rows' cache and positions are untouched."""
    from spec_plugins.loop import Batch, run_round
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.types import RowRequest

    from helpers import plain_greedy

    out, target, _ = exported
    rt = ort_runtime(out)
    batch = Batch(rt, NgramProposer(NgramProposer.Config()), ExactVerifier())
    got = list(batch.add([RowRequest(0, [1, 2, 3, 1, 2], 20)])[0].tokens)
    got += run_round(batch, DraftPolicy.of(FixedLength(3))).emitted[0]
    pos, lengths = rt.slots.pos.clone(), rt.lengths()
    inner = rt._call

    def failing(ids, pos_, mask, want_hidden, prefill):
        if prefill:
            raise RuntimeError("graph call failed")
        return inner(ids, pos_, mask, want_hidden, prefill)

    rt._call = failing
    with pytest.raises(RuntimeError, match="graph call failed"):
        batch.add([RowRequest(1, [4, 5, 6], 5)])
    rt._call = inner
    assert rt.lengths() == lengths and torch.equal(rt.slots.pos, pos)
    batch.check()
    while (rec := run_round(batch, DraftPolicy.of(FixedLength(3)))) is not None:
        got += rec.emitted[0]
    assert got == plain_greedy(target, [1, 2, 3, 1, 2], 20)


@pytest.mark.parametrize("kind,layers", [("eagle", ()), ("eagle", (2, 1, 1)), ("parallel", (2, 1, 1)),
                                         ("parallel-deep", (2, 1, 1)), ("parallel-context", (2, 1, 1))])
def test_eagle_drafts_on_onnxruntime_with_greedy_identity(exported, kind, layers, tmp_path, monkeypatch):
    """With an ONNX Runtime target the drafter (EAGLE's, or the parallel one's block, with block
    layers or without) runs in ONNX Runtime too (its head graphs exported on first use), reading
    the verify graph's hidden state or fused layer outputs (EAGLE-3); greedy output is identical
    to plain decoding, the drafter's features are the torch runtime's, and it accepts what the
    same drafter in PyTorch accepts."""
    from spec_plugins.heads import EagleConfig, EagleDrafter, target_lm_parts
    from spec_plugins.heads.parallel import ParallelConfig, ParallelDrafter
    from spec_plugins.heads.runner import OrtBlockRefiner, OrtEagleLayer
    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.parallel import ParallelProposer
    from spec_plugins.stats import DecodeStats

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path))
    out, target, _ = exported
    rt = ort_runtime(out)
    torch.manual_seed(0)
    lm, emb = target_lm_parts(target)
    cls, ccls, pcls = ((EagleDrafter, EagleConfig, EagleProposer) if kind == "eagle"
                       else (ParallelDrafter, ParallelConfig, ParallelProposer))
    extra = {"parallel-deep": {"block_layers": 2},
             "parallel-context": {"block_layers": 2, "block_context": True}}.get(kind, {})
    drafter = cls(ccls(32, num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=32,
                       feature_layers=layers, **extra), lm, emb, torch.arange(32))
    for layer in drafter.refiner.layers if extra else ():  # trained block layers are not the identity
        torch.nn.init.normal_(layer.o.weight, std=0.5)
        torch.nn.init.normal_(layer.down.weight, std=0.5)

    def proposer(engine):
        return pcls(pcls.Config(heads="unused", mode="tree", tree_nodes=6, top_k=2, engine=engine), target=rt,
                    drafter=drafter)

    prop = proposer("auto")
    assert isinstance(prop.layer, OrtEagleLayer) and list((tmp_path / "onnx-heads").glob("*/head.onnx"))
    if extra:
        x = torch.randn(3, 4, 32)
        context = ()  # with block_context: positions, each layer's cached keys and values, a mask
        if "block_context" in extra:
            context = (torch.arange(4).expand(3, 4) + 5, torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8),
                       torch.zeros(3, 1, 4, 9))
        assert isinstance(prop.refiner, OrtBlockRefiner)
        torch.testing.assert_close(prop.refiner(x, *context), drafter.refiner(x, *context), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(drafter.refiner(x, *context), x)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    want = rt.capabilities.feature_layers if layers else True
    ref = TorchRuntime(target)
    torch.testing.assert_close(rt.prefill(prompts, want_hidden=want).hidden,
                               ref.prefill(prompts, want_hidden=want).hidden, atol=1e-4, rtol=1e-4)
    stats = DecodeStats()
    outs = [[] for _ in prompts]
    for step in decode(rt, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, 16, (), None, stats,
                       FixedLength(3)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    for p, o in zip(prompts, outs):
        assert o == plain_greedy(target, p, 16)
    assert stats.draft_tokens > 0
    torch_stats = DecodeStats()
    for _ in decode(rt, proposer("torch"), ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, 16, (), None,
                    torch_stats, FixedLength(3)):
        pass
    assert torch_stats.accepted_by_position == stats.accepted_by_position


def test_feature_layers_the_graph_lacks_are_refused_at_pairing(exported):
    from spec_plugins.heads import EagleConfig, EagleDrafter, target_lm_parts
    from spec_plugins.proposers.base import check_pairing
    from spec_plugins.proposers.eagle import EagleProposer

    out, target, _ = exported
    rt = ort_runtime(out)
    lm, emb = target_lm_parts(target)
    drafter = EagleDrafter(EagleConfig(32, num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=32,
                                       feature_layers=(1, 2)), lm, emb, torch.arange(32))
    prop = EagleProposer(EagleProposer.Config(heads="unused", engine="torch"), target=rt, drafter=drafter)
    with pytest.raises(ValueError, match=r"reads decoder layers \[1, 2\].*returns \[2, 1, 1\].*--feature-layers 1,2"):
        check_pairing(rt, prop)


def test_quantize_in_the_config_exports_on_first_use_per_scheme(tiny_model_dir, tmp_path, monkeypatch):
    from spec_plugins.backends.onnx_cache import export_cache_dir

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path))
    cfg = OnnxRuntime.Config(model=str(tiny_model_dir), quantize="int4", quant_block_size=16, threads=1,
                             spinning=False, arena=False)
    rt = OnnxRuntime.from_config(cfg)
    assert rt.entry.quantization["name"] == "int4-b16-sym-acc4"
    where = export_cache_dir(str(tiny_model_dir), "int4-b16-sym-acc4")
    assert where.name.endswith("-int4-b16-sym-acc4") and where != export_cache_dir(str(tiny_model_dir))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    outs = {}
    from spec_plugins.proposers.ngram import NgramProposer

    for name, prop in (("plain", None), ("ngram", NgramProposer(NgramProposer.Config()))):
        toks = []
        for step in decode(rt, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), [prompt], 20, (), None, None,
                           FixedLength(4)):
            toks += step.emitted.get(0, [])
        outs[name] = toks
    assert outs["plain"] == outs["ngram"]  # exact relative to the quantized model itself
    with pytest.raises(ValueError, match="quantized as 'int4-b16-sym-acc4'.*asks for 'none'"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model=str(tiny_model_dir), path=str(where)))


def test_quantized_graphs_pad_lone_positions_so_speculation_stays_exact(tiny_model_dir, tmp_path, monkeypatch):
    """int8 activations: ONNX Runtime's one-row kernel computes a position differently from wider
    forwards, so one-position forwards run as two (pad_single: auto); a position's logits are
    then the same whatever the forward's width, and without the padding speculation is refused."""
    from spec_plugins.proposers.base import check_pairing
    from spec_plugins.proposers.ngram import NgramProposer

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path))
    base = dict(model=str(tiny_model_dir), quantize="int8", quant_block_size=16, threads=1)
    rt = OnnxRuntime.from_config(OnnxRuntime.Config(**base))
    assert rt.pad_single and rt.capabilities.batch_invariant
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    rt.prefill([ids[:-4]])
    wide = rt.forward(torch.tensor([ids[-4:]])).logits[0]
    rt.rollback([len(ids) - 4])
    one = []
    for t in ids[-4:]:
        one.append(rt.forward(torch.tensor([[t]])).logits[0, 0])
        rt.commit([[0]])
    torch.testing.assert_close(torch.stack(one), wide, atol=0, rtol=0)
    assert rt.lengths() == [len(ids)]  # the padding position left no KV behind
    raw = OnnxRuntime.from_config(OnnxRuntime.Config(**base, pad_single=False))
    assert not raw.capabilities.batch_invariant
    with pytest.raises(ValueError, match="pad_single"):
        check_pairing(raw, NgramProposer(NgramProposer.Config()))


def test_export_cache_follows_the_weights_not_only_the_config(tiny_model_dir, tmp_path, monkeypatch):
    """New weights under the same config.json (a fine-tuned copy) get a new export on first use,
    not the old model's cached graph."""
    import shutil

    from spec_plugins.backends.onnx_cache import export_cache_dir

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    cfg = OnnxRuntime.Config(model=str(tiny_model_dir), device="cpu")
    before = export_cache_dir(str(tiny_model_dir))
    OnnxRuntime.from_config(cfg)
    tuned = tiny_llama(vocab=32, seed=9, sharpness=4.0)
    tuned.save_pretrained(str(tmp_path / "tuned"))
    shutil.copy(tmp_path / "tuned" / "model.safetensors", tiny_model_dir / "model.safetensors")
    assert export_cache_dir(str(tiny_model_dir)) != before
    rows = [[1, 2, 3, 4, 5]]
    got = OnnxRuntime.from_config(cfg).prefill(rows).logits
    torch.testing.assert_close(got, TorchRuntime(tuned).prefill(rows).logits, atol=1e-4, rtol=1e-4)


def test_dtype_swaps_with_the_backend(tiny_model_dir, tmp_path, monkeypatch):
    """A torch config's `dtype` carries over when only the backend changes: float32/float16 are
    exported as such on first use; an export of another dtype, or bfloat16, is refused by name."""
    from pathlib import Path

    import yaml

    from spec_plugins.backends.onnx_cache import export_cache_dir
    from spec_plugins.config import ConfigError

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path))
    example = Path(__file__).parents[1] / "examples" / "configs" / "smollm2-ngram.yaml"
    data = yaml.safe_load(example.read_text())
    data["target"]["backend"] = "onnxruntime"
    assert SpecConfig.parse(data).target.dtype == "float32"
    rt = OnnxRuntime.from_config(OnnxRuntime.Config(model=str(tiny_model_dir), dtype="float16", threads=1))
    assert rt.entry.dtype == "float16" and rt.dtype == torch.float16
    assert rt.prefill([[1, 2, 3]]).logits.dtype == torch.float32
    assert OnnxRuntime.from_config(OnnxRuntime.Config(model=str(tiny_model_dir))).entry.dtype == "float32"  # auto
    fp32 = export_cache_dir(str(tiny_model_dir))
    assert fp32 != export_cache_dir(str(tiny_model_dir), dtype="float16")
    with pytest.raises(ValueError, match="holds graph 'verify' in float32.*asks for dtype: float16"):
        OnnxRuntime.from_config(OnnxRuntime.Config(model=str(tiny_model_dir), path=str(fp32), dtype="float16"))
    with pytest.raises(ConfigError, match="dtype"):
        SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "x", "dtype": "bfloat16"}})


@pytest.mark.parametrize("field,value", [("vocab_size", 64), ("num_layers", 3), ("num_kv_heads", 4),
                                         ("dtype", "float16"), ("hidden_size", 64), ("feature_layers", [1, 2])])
def test_manifest_fields_are_held_to_the_graph(exported, tmp_path, field, value):
    """A manifest edited by hand fails when the runtime is built, naming the field, instead of
    as an ONNX Runtime error in the middle of a run."""
    import json
    import shutil

    from spec_plugins.graphs.manifest import ManifestError

    out, _, _ = exported
    d = tmp_path / "edited"
    shutil.copytree(out, d)
    data = json.loads((d / "manifest.json").read_text())
    data["graphs"][0][field] = value
    (d / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=f"the manifest's {field} .* but verify.onnx has"):
        ort_runtime(d)


def test_export_cli_refusals_are_one_line_errors(tiny_model_dir, tmp_path, monkeypatch):
    """`export onnx --out .` keeps the directory's files; an unsupported opset or a bfloat16
    target is an `error:` line and exit status 2, not a traceback."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    runner = CliRunner()
    cfg = tmp_path / "c.yaml"
    for dtype, args, message in ((None, ["--out", "."], "is the current directory"),
                                 (None, ["--out", str(tmp_path / "o"), "--opset", "30"], r"opsets 14\.\.20"),
                                 ("bfloat16", ["--out", str(tmp_path / "o")], "loaded as bfloat16")):
        extra = f", dtype: {dtype}" if dtype else ""
        cfg.write_text(f"target: {{backend: torch, model: '{tiny_model_dir}'{extra}}}\n")
        r = runner.invoke(app, ["export", "onnx", "--config", str(cfg), *args])
        assert r.exit_code == 2, r.output  # an uncaught exception exits 1
        assert re.search(rf"^error: .*{message}", r.output, re.M), r.output
    assert [p.name for p in work.iterdir()] == ["notes.txt"] and not (tmp_path / "o").exists()


def test_head_sessions_take_the_target_s_threads_and_spinning(exported, tmp_path, monkeypatch):
    """A head runs in ONNX Runtime beside an ONNX Runtime target, on the same cores: its session
    gets the target session's intra-op threads and spinning (EAGLE, parallel block layers, Medusa)."""
    from test_heads import medusa

    from spec_plugins.heads import EagleConfig, EagleDrafter, target_lm_parts
    from spec_plugins.heads.parallel import ParallelConfig, ParallelDrafter
    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.medusa import MedusaProposer
    from spec_plugins.proposers.parallel import ParallelProposer

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path))
    out, target, _ = exported
    lm, emb = target_lm_parts(target)
    shape = dict(num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=32)
    for threads, spinning in ((1, True), (2, False)):
        rt = ort_runtime(out, threads=threads, spinning=spinning)
        eagle = EagleProposer(EagleProposer.Config(heads="unused", mode="chain"), target=rt,
                              drafter=EagleDrafter(EagleConfig(32, **shape), lm, emb, torch.arange(32)))
        parallel = ParallelProposer(ParallelProposer.Config(heads="unused", mode="chain"), target=rt,
                                    drafter=ParallelDrafter(ParallelConfig(32, block_layers=1, **shape), lm, emb,
                                                            torch.arange(32)))
        med = MedusaProposer(MedusaProposer.Config(heads="unused"), target=rt, heads=medusa(target))
        for session in (eagle.layer.session, parallel.layer.session, parallel.refiner.session, med.run_heads.session):
            options = session.get_session_options()
            assert options.intra_op_num_threads == threads
            assert options.get_session_config_entry("session.intra_op.allow_spinning") == str(int(spinning))
