"""A request whose prompt + max_new_tokens runs past the runtime's context is refused up front,
naming the numbers, before any row is admitted or any token emitted (it used to be cut at the
context without a word: fewer tokens, finish reason "length", as if the limit asked for were
reached). One that fills the context exactly runs to its limit, as transformers' generate()."""

from __future__ import annotations

import pytest

from conftest import tiny_llama
from helpers import hf_generate
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.proposers.ngram import NgramProposer
from test_llamacpp import _model_test

CONTEXT = 32
LONG = list(range(1, 29))  # 28 tokens: 4 fit after it
SHORT = [5, 6, 7, 5, 6, 7, 5, 6]
PAST = r"a prompt of 28 tokens plus max_new_tokens 10 runs past the context of 32 positions: lower max_new_tokens"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=64, sharpness=8.0, max_pos=CONTEXT)


def _decoder(model, speculate: bool = True) -> tuple[SpeculativeDecoder, list]:
    """A decoder over ``model`` and the prompts its runtime was asked to prefill (none: nothing admitted)."""
    rt = TorchRuntime(model, matmul="native")
    prefilled: list = []
    inner = rt.add_rows
    rt.add_rows = lambda prompts, *a, **k: prefilled.append(prompts) or inner(prompts, *a, **k)
    proposer = NgramProposer(NgramProposer.Config(num_draft_tokens=4)) if speculate else None
    return SpeculativeDecoder(rt, proposer), prefilled


@pytest.mark.parametrize("speculate", [True, False])
def test_generate_past_the_context_is_refused(model, speculate):
    dec, prefilled = _decoder(model, speculate)
    with pytest.raises(ValueError, match=PAST):
        dec.generate(LONG, max_new_tokens=10)
    assert prefilled == [] and dec.target.lengths() == []


def test_stream_past_the_context_is_refused_before_any_event(model):
    dec, prefilled = _decoder(model)
    events = dec.stream(LONG, max_new_tokens=10)
    with pytest.raises(ValueError, match=PAST):
        next(events)  # the first event is the refusal: nothing was emitted before it
    assert prefilled == []


@pytest.mark.parametrize("limits", [10, [4, 10]])
def test_a_batch_with_one_row_past_the_context_admits_none(model, limits):
    """The short row fits (8 + 10 <= 32); the long one does not: the whole batch is refused."""
    dec, prefilled = _decoder(model)
    with pytest.raises(ValueError, match=r"request 1: " + PAST):
        dec.generate_batch([SHORT, LONG], max_new_tokens=limits)
    assert prefilled == [] and dec.target.lengths() == []


@pytest.mark.parametrize("speculate", [True, False])
def test_a_request_filling_the_context_exactly_runs_to_its_limit(model, speculate):
    dec, _ = _decoder(model, speculate)
    want = hf_generate(model, [LONG], CONTEXT - len(LONG), pad=0)[0]
    got = dec.generate(LONG, max_new_tokens=CONTEXT - len(LONG))
    assert got.token_ids == want and got.finish_reason == "length"
    streamed = [t for ev in dec.stream(LONG, max_new_tokens=CONTEXT - len(LONG)) for t in ev.token_ids]
    assert streamed == want
    rows = dec.generate_batch([SHORT, LONG], max_new_tokens=[CONTEXT - len(SHORT), CONTEXT - len(LONG)])
    assert [r.token_ids for r in rows] == [hf_generate(model, [p], CONTEXT - len(p), pad=0)[0] for p in (SHORT, LONG)]
    assert [r.finish_reason for r in rows] == ["length", "length"]


@_model_test
def test_llamacpp_refuses_one_row_past_n_ctx_as_it_refuses_a_batch():
    """llama.cpp refused a batch over n_ctx by name but cut a single row at it."""
    from spec_plugins import SpeculativeDecoder

    dec = SpeculativeDecoder.from_config({
        "target": {"backend": "llamacpp", "model": "smollm2-135m-instruct", "threads": 1, "n_ctx": 256},
        "proposer": {"type": "ngram", "num_draft_tokens": 4}})
    prompt = dec.encode("1, 2, 3, 4, 5,", False)
    past = rf"a prompt of {len(prompt)} tokens plus max_new_tokens {257 - len(prompt)} runs past the context of 256"
    with pytest.raises(ValueError, match=past):
        dec.generate(prompt, max_new_tokens=257 - len(prompt))
    assert dec.target.lengths() == []
