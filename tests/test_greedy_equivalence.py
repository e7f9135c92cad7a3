"""Greedy speculative output is token-identical to plain greedy decoding."""

from __future__ import annotations

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.verifiers import ExactVerifier

GREEDY = LogitsPipeline(SamplingConfig(temperature=0.0))


def run(target, proposer, prompts, n, k, eos=()):
    outs = [[] for _ in prompts]
    stats = DecodeStats()
    for step in decode(target, proposer, ExactVerifier(), GREEDY, prompts, n, eos, None, stats, FixedLength(k)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs, stats


def repetitive_prompts(vocab, count, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        base = torch.randint(0, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append((base * 4)[: 3 + int(torch.randint(0, 12, (1,), generator=g))])
    return out


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_greedy_identical(k):
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = NgramProposer(NgramProposer.Config(max_ngram=3))
    for prompt in repetitive_prompts(32, 6, seed=k):
        for n in (1, 2, 7, 24):
            outs, _ = run(target, prop, [prompt], n, k)
            assert outs[0] == plain_greedy(model, prompt, n), (prompt, n, k)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("same_draft", [True, False])
def test_draft_model_greedy_identical(k, same_draft):
    model = tiny_llama(seed=3)
    draft = model if same_draft else tiny_llama(seed=4)
    target = TorchRuntime(model)
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(draft))
    for prompt in repetitive_prompts(32, 4, seed=10 + k):
        outs, stats = run(target, prop, [prompt], 20, k)
        assert outs[0] == plain_greedy(model, prompt, 20)
        if same_draft:  # an identical draft is always accepted
            assert stats.accepted_tokens == stats.draft_tokens


def test_eos_inside_accepted_draft_ends_output():
    model = tiny_llama(seed=3)
    prompt = repetitive_prompts(32, 1, seed=5)[0]
    ref = plain_greedy(model, prompt, 30)
    eos = ref[7]  # a token the model emits mid-way; the first occurrence must end the output
    first = ref.index(eos)
    target = TorchRuntime(model)
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(model))  # drafts run past EOS
    outs, _ = run(target, prop, [prompt], 30, 8, eos=[eos])
    assert outs[0] == ref[: first + 1]


def test_max_new_tokens_never_exceeded_and_zero():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = DraftModelProposer(None, target=target, runtime=TorchRuntime(model))
    for n in range(0, 12):
        outs, _ = run(target, prop, [[1, 2, 3, 1, 2, 3]], n, 8)
        assert len(outs[0]) == n
        assert outs[0] == plain_greedy(model, [1, 2, 3, 1, 2, 3], n)


def test_batch_rows_identical_to_solo():
    model = tiny_llama(seed=3)
    prompts = repetitive_prompts(32, 5, seed=7)
    for prop_kind in ("ngram", "draft"):
        target = TorchRuntime(model)
        prop = (NgramProposer(NgramProposer.Config()) if prop_kind == "ngram"
                else DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(seed=4))))
        outs, _ = run(target, prop, prompts, [5, 17, 9, 30, 12], 4)
        for p, o, n in zip(prompts, outs, [5, 17, 9, 30, 12]):
            assert o == plain_greedy(model, p, n)


def test_decoder_api_token_ids_and_stats():
    model = tiny_llama(seed=3)
    dec = SpeculativeDecoder(TorchRuntime(model), NgramProposer(NgramProposer.Config()), ExactVerifier())
    r = dec.generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=16)
    assert r.token_ids == plain_greedy(model, [5, 6, 7, 5, 6, 7, 5], 16)
    s = r.stats.to_dict()
    for key in ("target_forwards", "draft_tokens", "accepted_tokens", "mean_accepted_tokens", "acceptance_rate",
                "accepted_by_position", "time_draft", "time_verify", "time_other"):
        assert key in s
    assert s["target_forwards"] >= 1 and s["mean_accepted_tokens"] >= 1.0
    # plain decoding through the same runtime
    plain = dec.without_speculation().generate([5, 6, 7, 5, 6, 7, 5], max_new_tokens=16)
    assert plain.token_ids == r.token_ids and plain.stats.mean_accepted_tokens == 1.0
