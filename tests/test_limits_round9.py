"""Context edges found in hardening round 9: a prompt that fills the context exactly asks nothing
of the runtime when it wants no new token (it was refused with "prompt has 24 tokens; the context
holds 24"), and an auto draft length on a context too short to measure names the context (it failed
inside the cost model: "rows, widths, context and repeats must be >= 1")."""

from __future__ import annotations

import pytest

from conftest import tiny_llama
from helpers import plain_greedy
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.proposers.ngram import NgramProposer

CONTEXT = 24


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=64, sharpness=8.0, max_pos=CONTEXT)


def test_full_prompt_with_no_new_token_finishes_at_its_length(model):
    dec = SpeculativeDecoder(TorchRuntime(model, matmul="native"))
    out = dec.generate(list(range(1, CONTEXT + 1)), max_new_tokens=0)
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.stats.target_forwards == 0


def test_full_prompt_asking_a_token_names_the_context(model):
    dec = SpeculativeDecoder(TorchRuntime(model, matmul="native"))
    with pytest.raises(ValueError, match=f"a prompt of {CONTEXT} tokens plus max_new_tokens 1 runs past"):
        dec.generate(list(range(1, CONTEXT + 1)), max_new_tokens=1)
    with pytest.raises(ValueError, match=f"prompt has {CONTEXT + 1} tokens; the context holds {CONTEXT}"):
        dec.generate(list(range(1, CONTEXT + 2)), max_new_tokens=0)


@pytest.mark.parametrize("context", [1, 2, 3])
def test_auto_length_on_a_tiny_context_names_it(model, context):
    rt = TorchRuntime(model, max_context=context, matmul="native")
    with pytest.raises(ValueError, match=f"context holds {context} positions: set a fixed num_draft_tokens"):
        SpeculativeDecoder(rt, NgramProposer(NgramProposer.Config(num_draft_tokens="auto")))


def test_auto_length_on_the_shortest_measurable_context_is_exact(model):
    rt = TorchRuntime(model, max_context=4, matmul="native")
    dec = SpeculativeDecoder(rt, NgramProposer(NgramProposer.Config(num_draft_tokens="auto")))
    assert dec.generate([3, 3], max_new_tokens=2).token_ids == plain_greedy(model, [3, 3], 2)


def test_stats_carry_the_share_outside_forwards_the_docs_name(model):
    """docs/bench.md names ``result.stats.share_outside_forwards``; it was only a key of ``to_dict()``."""
    out = SpeculativeDecoder(TorchRuntime(model, matmul="native")).generate([3, 4, 5], max_new_tokens=4)
    share = out.stats.share_outside_forwards
    assert 0.0 <= share <= 1.0
    assert share == out.stats.to_dict()["share_outside_forwards"]
    assert share == out.stats.time_outside_forwards / out.stats.time_total
