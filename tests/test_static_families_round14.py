"""Families the static KV cache crashed on mid-generation, or accepted and then failed.

OPT, Falcon (multi-query, multi-head, new architecture), XGLM and BioGPT call the cache's
``get_seq_length()`` on every forward; the static runtime's ``SlotCache`` had none, so each one
raised ``AttributeError`` on its first forward. DeepSeek-V2/V3 (multi-head latent attention) cache a
compressed latent, not ``[rows, kv_heads, slots, head_dim]``: the runtime built and then failed inside
``index_copy_``. Now the first decode exactly, eager and compiled, and the second are refused when
the runtime is built, naming the family and the growing cache, which decodes them exactly."""

from __future__ import annotations

import sys

import pytest
import torch
from test_families_round9 import CONTEXT, PROMPTS, V, _IDS, build, reference, speculative

from spec_plugins.backends import torch_static
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.backends.torch_static import StaticTorchRuntime


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM, OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                     num_attention_heads=4, max_position_embeddings=CONTEXT, word_embed_proj_dim=32,
                                     pad_token_id=None, **_IDS)


def _falcon(**kw):
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM, FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           alibi=False, **kw, **_IDS)


def _xglm():
    from transformers import XGLMConfig, XGLMForCausalLM

    return XGLMForCausalLM, XGLMConfig(vocab_size=V, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                       max_position_embeddings=CONTEXT, pad_token_id=None, **_IDS)


def _biogpt():
    from transformers import BioGptConfig, BioGptForCausalLM

    return BioGptForCausalLM, BioGptConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64, max_position_embeddings=CONTEXT, pad_token_id=None,
                                           **_IDS)


def _deepseek(version: int):
    import transformers

    cfg = getattr(transformers, f"DeepseekV{version}Config")(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=CONTEXT, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        moe_intermediate_size=16, n_group=1, topk_group=1, **_IDS)
    return getattr(transformers, f"DeepseekV{version}ForCausalLM"), cfg


READS_LENGTH = {
    "opt": _opt,
    "falcon_multi_query": lambda: _falcon(multi_query=True),
    "falcon_multi_head": lambda: _falcon(multi_query=False),
    "falcon_new_architecture": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "xglm": _xglm,
    "biogpt": _biogpt,
}
LATENT = {"deepseek_v2": lambda: _deepseek(2), "deepseek_v3": lambda: _deepseek(3)}


@pytest.mark.parametrize("family", list(READS_LENGTH))
def test_families_reading_the_cache_length_decode_exactly_on_the_static_cache(family):
    """A batch of rows of different lengths (holes) with an n-gram chain: transformers' tokens."""
    model = build(READS_LENGTH[family])
    assert speculative(StaticTorchRuntime(model), "ngram", PROMPTS) == reference(model), family


@pytest.mark.parametrize("family", ["opt", "falcon_new_architecture", "xglm", "biogpt"])
def test_the_cache_length_is_the_growing_caches_on_every_forward(family, monkeypatch):
    """What the model reads is the slot axis before each forward, holes included, exactly what the
    growing cache (transformers' own ``DynamicCache``) answers over the same rounds."""
    from transformers import DynamicCache

    seen: dict[str, list[int]] = {"dynamic": [], "static": []}

    def spy(cls, key):
        real = cls.get_seq_length

        def get_seq_length(self, *args, **kwargs):
            n = real(self, *args, **kwargs)
            if sys._getframe(1).f_code.co_name == "forward":  # the model's read (not transformers' mask code)
                seen[key].append(int(n))
            return n
        monkeypatch.setattr(cls, "get_seq_length", get_seq_length)

    model = build(READS_LENGTH[family])
    growing, static = TorchRuntime(model, matmul="native"), StaticTorchRuntime(model)
    spy(DynamicCache, "dynamic")
    if hasattr(torch_static.SlotCache, "get_seq_length"):
        spy(torch_static.SlotCache, "static")
    speculative(growing, "ngram", PROMPTS)
    speculative(static, "ngram", PROMPTS)
    assert seen["static"] == seen["dynamic"] and max(seen["dynamic"]) > 0, family


@pytest.mark.parametrize("family", ["opt", "xglm"])
def test_the_compiled_step_reads_the_length_as_one_graph_per_shape(family, monkeypatch):
    """``compile: on`` (``fullgraph=True``: a graph break raises) decodes transformers' tokens with
    one graph per (rows, positions, capacity) bucket: a length the graph guarded on would compile
    the step again at every new length. The shapes are recorded outside the compiled code (anything
    recorded inside would be guarded on itself)."""
    from torch._dynamo.utils import counters

    shapes: set[tuple] = set()

    class Recorded(torch_static.FixedSteps):
        def __call__(self, *args):
            shapes.add(tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
            return super().__call__(*args)
    monkeypatch.setattr(torch_static, "FixedSteps", Recorded)
    model = build(READS_LENGTH[family])
    rt = StaticTorchRuntime(model, compile=True)
    before = counters["stats"]["unique_graphs"]
    assert speculative(rt, "ngram", PROMPTS) == reference(model), family
    assert shapes and counters["stats"]["unique_graphs"] - before == len(shapes), shapes


@pytest.mark.parametrize("family", list(LATENT))
def test_latent_attention_is_refused_at_build_and_decodes_exactly_on_the_growing_cache(family):
    model = build(LATENT[family])
    named = rf"{family} \(DeepseekV{family[-1]}ForCausalLM\) caches keys \(1, 1, 1, 16\).*kv: dynamic"
    for compile_ in (False, True):
        with pytest.raises(ValueError, match=named):
            StaticTorchRuntime(model, compile=compile_)
    assert speculative(TorchRuntime(model, matmul="native"), "ngram", PROMPTS) == reference(model), family


def test_a_static_config_of_a_latent_attention_model_is_refused_by_name(tmp_path):
    """Through the backend entry: ``kv: static`` (what ``kv: auto`` picks on CUDA) is refused, ``kv:
    dynamic`` builds the growing cache."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from spec_plugins.backends import build_runtime

    d = tmp_path / "tiny-deepseek"
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0").save_pretrained(str(d))
    build(LATENT["deepseek_v3"]).save_pretrained(str(d))
    with pytest.raises(ValueError, match=r"deepseek_v3 \(DeepseekV3ForCausalLM\).*use kv: dynamic"):
        build_runtime(TorchRuntime.Config(model=str(d), device="cpu", dtype="float32", kv="static"))
    rt = build_runtime(TorchRuntime.Config(model=str(d), device="cpu", dtype="float32", kv="dynamic"))
    assert type(rt) is TorchRuntime
