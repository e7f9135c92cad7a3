"""The PyTorch runtime's KV bookkeeping: rollback, tree masks, compaction, holes."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.tree import layout, with_root
from spec_plugins.verifiers import ExactVerifier


def _live_kv(rt: TorchRuntime, row: int):
    """Keys/values of the row's non-hole slots, in position order, per layer."""
    ok = rt.slots.pos[row] >= 0
    order = rt.slots.pos[row][ok].argsort()
    return [(l.keys[row][:, ok][:, order], l.values[row][:, ok][:, order]) for l in rt.cache.layers]


def test_cache_after_many_rounds_equals_fresh_prefill():
    model = tiny_llama(vocab=32, seed=2, sharpness=3.0)
    target = TorchRuntime(model)
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(vocab=32, seed=9, sharpness=3.0)))
    pipe = LogitsPipeline(SamplingConfig(temperature=1.0))
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 9, 9, 1]]
    outs = [list(p) for p in prompts]
    for step in decode(target, prop, ExactVerifier(), pipe, prompts, 40, (), gen, None, FixedLength(4)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
        if len(outs[0]) > 25:
            break
    # every row's cache holds its sequence minus the pending token
    for b, seq in enumerate(outs):
        cached = seq[:-1]
        assert target.lengths()[b] == len(cached)
        fresh = TorchRuntime(model)
        fresh.prefill([cached])
        for (k1, v1), (k2, v2) in zip(_live_kv(target, b), _live_kv(fresh, 0)):
            torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)


def test_tree_forward_matches_chains_and_compacts():
    model = tiny_llama(vocab=32, seed=2)
    prompt = [3, 1, 4, 1, 5]
    # root + tree: 0 -> {1, 2}; 1 -> {3}; 2 -> {4, 5}
    parents = with_root((-1, -1, 0, 1, 1))
    tokens = torch.tensor([[9, 10, 11, 12, 13, 14]])
    rt = TorchRuntime(model)
    rt.prefill([prompt])
    tree_logits = rt.forward(tokens, tree=layout(parents)).logits[0]
    for node in range(6):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = parents[j]
        path = path[::-1]
        ref = TorchRuntime(model)
        ref.prefill([prompt])
        chain_logits = ref.forward(tokens[:, path]).logits[0, -1]
        torch.testing.assert_close(tree_logits[node], chain_logits, atol=1e-4, rtol=1e-4)
    # keep path 0 -> 2 -> 5 and continue: equals a chain run over those tokens
    rt.commit([[0, 2, 5]])
    nxt = rt.forward(torch.tensor([[7]])).logits[0, -1]
    ref = TorchRuntime(model)
    ref.prefill([prompt])
    want = ref.forward(torch.tensor([[9, 11, 14, 7]])).logits[0, -1]
    torch.testing.assert_close(nxt, want, atol=1e-4, rtol=1e-4)
    assert rt.lengths() == [len(prompt) + 4]


def test_left_padded_batch_prefill_matches_solo():
    model = tiny_llama(vocab=32, seed=2)
    rows = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    rt = TorchRuntime(model)
    out = rt.prefill(rows).logits[:, -1]
    step = rt.forward(torch.tensor([[1], [2], [3]])).logits[:, -1]
    for b, r in enumerate(rows):
        solo = TorchRuntime(model)
        torch.testing.assert_close(out[b], solo.prefill([r]).logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step[b], solo.forward(torch.tensor([[b + 1]])).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_rollback_then_continue():
    model = tiny_llama(vocab=32, seed=2)
    rt = TorchRuntime(model)
    rt.prefill([[1, 2, 3]])
    rt.forward(torch.tensor([[4, 5, 6, 7]]))
    rt.rollback([5])
    assert rt.lengths() == [5]
    got = rt.forward(torch.tensor([[8]])).logits[0, -1]
    ref = TorchRuntime(model)
    ref.prefill([[1, 2, 3, 4, 5, 8]])
    torch.testing.assert_close(got, ref.prefill([[1, 2, 3, 4, 5, 8]]).logits[0, -1], atol=1e-4, rtol=1e-4)


# ---- the cache keyword across transformers versions ----------------------------------------------
def test_cache_keyword_is_the_one_this_transformers_version_reads():
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; the runtime reads the keyword
    from the model's forward signature, so both ends of the supported range get a working cache."""
    import inspect

    import transformers

    from spec_plugins.backends import hf_compat

    model = tiny_llama(seed=1)
    rt = TorchRuntime(model, matmul="native")
    kw = rt._cache_kw
    assert kw in inspect.signature(type(model).forward).parameters
    other = [k for k in hf_compat.CACHE_KEYWORDS if k != kw]
    assert not any(k in inspect.signature(type(model).forward).parameters for k in other), transformers.__version__
    rt.prefill([[1, 2, 3, 4]])
    rt.forward(torch.tensor([[5, 6]]))
    assert hf_compat.cached_length(rt.cache) == 6  # the guard's view: prompt + both new positions


def test_a_cache_the_model_ignores_is_an_error_not_wrong_tokens():
    """The failure transformers 5.17 showed: handed the cache under a keyword it does not know,
    a model takes it into **kwargs and runs without its past (wrong tokens, no error). After every
    forward the runtime checks that the cache grew by the positions fed."""
    import pytest

    from spec_plugins.backends import hf_compat

    for want in (False, True):
        rt = TorchRuntime(tiny_llama(seed=1), matmul="native")
        rt._cache_kw = "kv_cache"  # a keyword the model does not know: what a future rename looks like
        with pytest.raises(RuntimeError, match="did not use the KV cache"):
            rt.prefill([[1, 2, 3, 4]], want_hidden=want)
    with pytest.raises(TypeError, match="takes none of"):
        hf_compat.cache_keyword(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2"])
def test_attention_that_misreads_our_masks_is_refused_by_name(impl):
    """transformers' flex attention adds a 4D mask to the scores (a boolean one hides nothing) and
    its flash attention reads a 2D padding mask only: both caches refuse them when built, naming the
    implementation and the one to load, and so does ``generate()`` through the plugin."""
    from spec_plugins.backends.torch_static import StaticTorchRuntime
    from spec_plugins.integrations.transformers import speculative_generate

    model = tiny_llama(seed=3)
    model.config._attn_implementation = impl
    refusal = rf"attn_implementation='{impl}'.*load the model with attn_implementation=\"sdpa\""
    for make in (TorchRuntime, StaticTorchRuntime):
        with pytest.raises(ValueError, match=refusal):
            make(model)
    with pytest.raises(ValueError, match=refusal):
        model.generate(torch.tensor([[1, 2, 3]]), custom_generate=speculative_generate, max_new_tokens=4,
                       pad_token_id=0)


def test_the_plugin_checks_the_attention_again_when_the_model_switches_it():
    """The plugin keeps its runtime on the model between calls: a model switched to an attention
    implementation that misreads our masks after a first call is refused at the next one."""
    from spec_plugins.integrations.transformers import speculative_generate

    model = tiny_llama(seed=3)
    ids = torch.tensor([[1, 2, 3]])
    model.generate(ids, custom_generate=speculative_generate, max_new_tokens=4, pad_token_id=0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        model.generate(ids, custom_generate=speculative_generate, max_new_tokens=4, pad_token_id=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_sdpa_and_eager_attention_decode_trees_over_holes_exactly(impl, tmp_path):
    """The implementations that apply a 4D mask as given: EAGLE trees over a batch with holes give
    plain greedy decoding's tokens on both caches (the static one hands eager an additive mask)."""
    from helpers import every_proposer, plain_greedy, save_random_heads

    from spec_plugins.backends.torch_static import StaticTorchRuntime

    model = tiny_llama(seed=3, sharpness=2.0)
    model.set_attn_implementation(impl)
    heads = save_random_heads(model, tmp_path)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]]
    greedy = LogitsPipeline(SamplingConfig())
    for rt in (TorchRuntime(model, matmul="native"), StaticTorchRuntime(model)):
        assert rt.attention == impl
        outs = [[] for _ in prompts]
        proposer = every_proposer("eagle-tree", rt, heads)
        for step in decode(rt, proposer, ExactVerifier(), greedy, prompts, 12, (), None, None, FixedLength(3)):
            for i, t in step.emitted.items():
                outs[i].extend(t)
        assert outs == [plain_greedy(model, p, 12) for p in prompts], (impl, type(rt).__name__)
