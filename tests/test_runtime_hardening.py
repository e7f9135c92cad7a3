"""Runtime hardening: model families and configurations that used to be wrong or crash.

Sliding-window models (Gemma 3: most layers see only the last ``sliding_window`` positions) are
checked against transformers' own greedy ``generate`` across the window boundary, on the growing
and the static KV cache, plain and speculative (a chain and a tree), one row and a batch."""

from __future__ import annotations

import copy

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

WINDOW = 6
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]]  # 2 to 9 tokens, 16 more: past the window
N = 16
PAD = 0
RUNTIMES = {"dynamic": lambda m: TorchRuntime(m, matmul="native"), "static": StaticTorchRuntime}


def tiny_gemma3(window: int = WINDOW, seed: int = 0):
    """A random Gemma3ForCausalLM, one sliding-window layer and one full-attention layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                           sliding_window=window, layer_types=["sliding_attention", "full_attention"],
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    m = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init is nearly uniform: scale so that context decides the argmax
        for p in m.parameters():
            p.mul_(2.0)
    return m


def generate(model, prompts) -> list[list[int]]:
    return hf_generate(model, prompts, N, PAD)


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3()


def test_the_window_changes_the_reference(gemma):
    """The same weights without a window decode differently, so the tests below see the window."""
    wide = copy.deepcopy(gemma)
    wide.config.sliding_window = 1000
    assert generate(gemma, PROMPTS) != generate(wide, PROMPTS)
    assert generate(gemma, PROMPTS) == [generate(gemma, [p])[0] for p in PROMPTS]


def _proposer(kind: str, rt):
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.proposers.suffix import SuffixProposer

    if kind == "plain":
        return None
    if kind == "ngram":
        return NgramProposer(NgramProposer.Config())
    return SuffixProposer(SuffixProposer.Config(tree_nodes=6, min_token_prob=0.0), target=rt)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kind", ["plain", "ngram", "suffix"])
def test_sliding_window_greedy_equals_transformers_generate(gemma, kind, rows, runtime):
    prompts = PROMPTS[:rows]
    rt = RUNTIMES[runtime](gemma)
    outs = [[] for _ in prompts]
    for step in decode(rt, _proposer(kind, rt), ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, N, (),
                       None, None, FixedLength(3)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    assert outs == generate(gemma, prompts), (kind, rows, runtime)


def test_a_sliding_window_cache_is_named_when_it_drops_positions(gemma):
    """A cache built from the config (sliding layers keep only the window) is named as the cause."""
    from transformers import DynamicCache

    from spec_plugins.backends import hf_compat

    cache = DynamicCache(config=gemma.config)
    ids = torch.arange(1, 13)[None]
    gemma(input_ids=ids, **{hf_compat.cache_keyword(gemma): cache}, use_cache=True)
    with pytest.raises(RuntimeError, match="sliding-window"):
        hf_compat.check_cache_grew(cache, 0, 12, gemma)


def test_layer_types_a_mask_cannot_express_are_refused():
    from spec_plugins.backends import hf_compat

    model = tiny_gemma3()
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        hf_compat.mask_layout(model)


# ---- logits after the LM head: the model's own transforms ----------------------------------------
def _scaled_model(kind: str):
    """A tiny Granite (logits / logits_scaling) or Cohere (logits * logit_scale) causal LM."""
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    torch.manual_seed(0)
    if kind == "granite":
        return GraniteForCausalLM(GraniteConfig(logits_scaling=8.0, **common)).eval()
    return CohereForCausalLM(CohereConfig(logit_scale=0.0625, **common)).eval()


@pytest.mark.parametrize("kind", ["granite", "cohere"])
@pytest.mark.parametrize("want_hidden", [False, True, (1,)])
def test_logits_with_hidden_states_are_the_model_s_own(kind, want_hidden):
    """Drafters that read hidden states (EAGLE, Medusa) must not change the target's logits: they
    are the model's forward logits, post-LM-head scaling included, prefill and forward alike."""
    model = _scaled_model(kind)
    ids = [1, 2, 3, 4, 5, 6, 7]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    rt = TorchRuntime(model, matmul="native")
    out = rt.prefill([ids[:5]], want_hidden=want_hidden)
    torch.testing.assert_close(out.logits[0, -1], ref[4])
    out = rt.forward(torch.tensor([ids[5:]]), want_hidden=want_hidden)
    torch.testing.assert_close(out.logits[0], ref[5:])
    if want_hidden:
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = states[1] if isinstance(want_hidden, tuple) else states[-1]
        torch.testing.assert_close(out.hidden[0], want[0, 5:])


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_the_onnx_verify_graph_s_logits_are_the_model_s_own(kind):
    """The graph exported for ONNX Runtime computes the model's forward logits (its parity reference)."""
    from spec_plugins.exporters.onnx_verify import VerifyGraph, dummy_inputs
    from spec_plugins.graphs.io import DecoderShape

    model = _scaled_model(kind)
    ids, pos, mask, *past = dummy_inputs(DecoderShape.of(model), 1, 3, 0)
    with torch.no_grad():
        got = VerifyGraph(model)(ids, pos, mask, *past)[0]
        ref = model(ids).logits
    torch.testing.assert_close(got, ref)


# ---- config errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cuda:abc", "tpu"])
def test_a_bad_torch_device_is_a_config_error_naming_the_field(device):
    from spec_plugins.config import ConfigError, SpecConfig

    with pytest.raises(ConfigError, match=rf"device.*{device!r} is not a torch device"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "smollm2-135m-instruct", "device": device}})
    assert SpecConfig.parse({"target": {"backend": "torch", "model": "smollm2-135m-instruct",
                                        "device": "cuda:1"}}).target.device == "cuda:1"


# ---- the context a runtime holds: where positions stop being exact -------------------------------
ORIGINAL = 24  # the longrope model's original_max_position_embeddings


def tiny_longrope_phi3(seed: int = 2):
    """A random Phi3ForCausalLM with LongRoPE (Phi-3-*-128k's rope): long factors past ORIGINAL positions."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    half = 4  # head_dim 8
    cfg = Phi3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                                      "long_factor": [40.0] * half, "original_max_position_embeddings": ORIGINAL},
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    m = Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    return m


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_a_longrope_model_s_context_is_capped_where_its_frequencies_are_fixed(runtime):
    """LongRoPE switches to its long factors once a forward's largest position passes
    original_max_position_embeddings: a verify forward's draft nodes would switch them early."""
    model = tiny_longrope_phi3()
    assert RUNTIMES[runtime](model).max_context == ORIGINAL
    with pytest.raises(ValueError, match=rf"max_context 128 exceeds {ORIGINAL} positions: .*longrope rope "
                                         rf"\(original_max_position_embeddings={ORIGINAL}\)"):
        TorchRuntime(model, max_context=128, matmul="native") if runtime == "dynamic" else \
            StaticTorchRuntime(model, max_context=128)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_longrope_greedy_within_the_cap_equals_transformers_generate(runtime, kind):
    model = tiny_longrope_phi3()
    prompt = [[1, 2, 3] * 4]  # 12 tokens: 12 more fill the context
    rt = RUNTIMES[runtime](model)
    out: list[int] = []
    for step in decode(rt, _proposer(kind, rt), ExactVerifier(), LogitsPipeline(SamplingConfig()), prompt,
                       ORIGINAL - 12, (), None, None, FixedLength(4)):
        out.extend(step.emitted.get(0, []))
    assert out == hf_generate(model, prompt, ORIGINAL - 12, PAD)[0]


def test_a_dynamic_ntk_rope_refuses_a_context_past_max_position_embeddings():
    """Dynamic NTK rope raises its base once a forward's largest position passes max_position_embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    assert TorchRuntime(model, matmul="native").max_context == 64
    with pytest.raises(ValueError, match=r"max_context 65 exceeds 64 positions: .*dynamic rope "
                                         r"\(max_position_embeddings=64\)"):
        TorchRuntime(model, max_context=65, matmul="native")


def test_a_context_past_a_learned_position_table_is_refused_naming_the_field():
    """GPT-2 learns one embedding per position (n_positions): past it the embedding lookup fails."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       bos_token_id=None, eos_token_id=None)).eval()
    assert TorchRuntime(model, matmul="native").max_context == 64
    assert TorchRuntime(model, max_context=40, matmul="native").max_context == 40
    with pytest.raises(ValueError, match=r"max_context 100 exceeds 64 positions: .*position table \(n_positions=64\)"):
        TorchRuntime(model, max_context=100, matmul="native")
