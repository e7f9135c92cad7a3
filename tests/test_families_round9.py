"""Families that place tokens by their slot in the KV cache, not by ``position_ids``.

ALiBi decoders (Bloom, MPT, Falcon with ``alibi``) build their biases from the key slots' order,
and GPT-Neo's local layers cut their window by slot distance. This runtime's rows hold holes (left
padding, rejected drafts, tree nodes), so they decoded other tokens than ``generate()`` (MPT,
GPT-Neo), crashed mid-round with a bare unpacking error (Bloom, Falcon ``alibi``) or exported a
graph that failed to load. Each is refused by name when a runtime is built and at export
(``hf_compat.slot_positioned``); the families beside them still decode exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_generate

from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.backends.torch_static import StaticTorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

V = 48
CONTEXT = 256
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]]  # rows of different lengths: holes
N = 16
PAD = 0
_IDS = {"bos_token_id": None, "eos_token_id": None}


def _gpt_neo(layers: list[str], window: int):
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    return GPTNeoForCausalLM, GPTNeoConfig(vocab_size=V, hidden_size=32, num_layers=len(layers), num_heads=4,
                                           attention_types=[[layers, 1]], window_size=window,
                                           max_position_embeddings=CONTEXT, **_IDS)


def _falcon(alibi: bool):
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM, FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           alibi=alibi, **_IDS)


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM, BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4, **_IDS)


def _mpt():
    from transformers import MptConfig, MptForCausalLM

    return MptForCausalLM, MptConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=CONTEXT, **_IDS)


# family -> (builder, what the refusal names)
REFUSED = {
    "bloom": (_bloom, r"bloom \(BloomForCausalLM\) uses ALiBi biases computed from cache slot order"),
    "mpt": (_mpt, r"mpt \(MptForCausalLM\) uses ALiBi biases computed from cache slot order"),
    "falcon_alibi": (lambda: _falcon(True), r"falcon \(FalconForCausalLM, alibi=True\) uses ALiBi biases"),
    "gpt_neo_local": (lambda: _gpt_neo(["global", "local"], 6),
                      (r"gpt_neo \(GPTNeoForCausalLM\) has local attention layers \(attention_layers lists "
                       r"'local', window_size=6, below max_position_embeddings=256\)")),
}
SUPPORTED = {
    "falcon": lambda: _falcon(False),
    "gpt_neo_global": lambda: _gpt_neo(["global", "global"], 6),
    "gpt_neo_local_wide": lambda: _gpt_neo(["global", "local"], CONTEXT),  # the window hides no slot
}
NEEDS = "need positions from position_ids"


def build(make, seed: int = 0):
    """A random model of ``make()``'s (class, config), SDPA where the family has it, weights scaled
    so that context decides the argmax."""
    cls, cfg = make()
    cfg._attn_implementation = "sdpa" if cls._supports_sdpa else "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    return model


def speculative(rt, kind: str, prompts) -> list[list[int]]:
    """Greedy tokens of a batch through the decode loop with an n-gram chain or a suffix tree."""
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.proposers.suffix import SuffixProposer

    prop = (NgramProposer(NgramProposer.Config()) if kind == "ngram"
            else SuffixProposer(SuffixProposer.Config(tree_nodes=6, min_token_prob=0.0), target=rt))
    outs: list[list[int]] = [[] for _ in prompts]
    for step in decode(rt, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, N, (), None, None,
                       FixedLength(3)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs


def reference(model) -> list[list[int]]:
    """transformers' greedy ``generate`` row by row (no padding: the independent reference)."""
    return [hf_generate(model, [p], N, PAD)[0] for p in PROMPTS]


@pytest.mark.parametrize("runtime", [lambda m: TorchRuntime(m, matmul="native"), StaticTorchRuntime],
                         ids=["dynamic", "static"])
@pytest.mark.parametrize("family", list(REFUSED))
def test_a_slot_positioned_family_is_refused_by_name_when_the_runtime_is_built(family, runtime):
    make, named = REFUSED[family]
    with pytest.raises(ValueError, match=named) as err:
        runtime(build(make))
    assert NEEDS in str(err.value)


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_slot_positioned_family_is_refused_by_name_at_export_and_nothing_is_written(family, tmp_path):
    pytest.importorskip("onnx")
    from spec_plugins.exporters.onnx_export import export_models
    from spec_plugins.exporters.onnx_verify import UnsupportedModel

    make, named = REFUSED[family]
    with pytest.raises(UnsupportedModel, match=named) as err:
        export_models(tmp_path / "out", (build(make), None, "tiny"), feature_layers=())
    assert NEEDS in str(err.value)
    assert list(tmp_path.iterdir()) == []  # no output directory, no temporary one left behind


def test_the_onnxruntime_backend_refuses_one_by_name_before_its_first_use_export(tmp_path, monkeypatch):
    """The ONNX Runtime backend without ``path`` exports on first use: refused there too, by name,
    with nothing in the export cache; a torch config of the same directory is refused as well."""
    pytest.importorskip("onnxruntime")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from spec_plugins.backends import build_runtime
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime
    from spec_plugins.exporters.onnx_verify import UnsupportedModel

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "tiny-bloom"
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0").save_pretrained(str(d))
    build(_bloom).save_pretrained(str(d))
    with pytest.raises(UnsupportedModel, match=REFUSED["bloom"][1]):
        OnnxRuntime.from_config(OnnxRuntime.Config(model=str(d)))
    assert not any((tmp_path / "cache").glob("**/manifest.json"))
    with pytest.raises(ValueError, match=REFUSED["bloom"][1]):
        build_runtime(TorchRuntime.Config(model=str(d), device="cpu", dtype="float32"))


def test_gpt_neo_local_window_bites_in_the_refused_family():
    """The refused GPT-Neo's window changes its own greedy tokens (the same weights with a window
    at the table's size decode otherwise), so the refusal is about a window that matters."""
    narrow = build(REFUSED["gpt_neo_local"][0])
    wide = build(SUPPORTED["gpt_neo_local_wide"])
    assert reference(narrow) != reference(wide)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
@pytest.mark.parametrize("family", list(SUPPORTED))
def test_the_families_beside_them_decode_exactly_on_torch(family, kind):
    model = build(SUPPORTED[family])
    assert speculative(TorchRuntime(model, matmul="native"), kind, PROMPTS) == reference(model), (family, kind)


@pytest.mark.parametrize("family", ["falcon", "gpt_neo_local_wide"])
def test_the_families_beside_them_export_and_decode_exactly_on_onnxruntime(family, tmp_path):
    pytest.importorskip("onnxruntime")
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime, create_session
    from spec_plugins.exporters.onnx_export import export_models
    from spec_plugins.graphs.manifest import Manifest

    model = build(SUPPORTED[family])
    out = tmp_path / "out"
    export_models(out, (model, None, "tiny"), feature_layers=())
    entry = Manifest.read(out).graph("verify")
    rt = OnnxRuntime(create_session(str(out / entry.file), "cpu", threads=1), entry)
    assert speculative(rt, "suffix", PROMPTS) == reference(model), family
