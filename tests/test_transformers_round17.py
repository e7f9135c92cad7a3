"""``speculative_generate`` where user stopping criteria were called once per token per row with a
one-row tensor (plain ``generate()`` calls them once per step with the whole batch: a criterion
keeping per-row state or counting its calls gave other output), where the directory form passed
``cache_implementation="paged"`` on to transformers' continuous batching (nothing speculative ran),
and where ``output_attentions`` without a dict output was refused though it changes nothing."""

from __future__ import annotations

import pytest
import torch
from test_transformers_integration import PAD, PROMPTS, Recorder, left_padded
from transformers import StoppingCriteria, StoppingCriteriaList

from conftest import tiny_llama
from spec_plugins.integrations.transformers import CUSTOM_GENERATE, speculative_generate

NEW = 30
EOS = 63  # never the first token these rows make, so the criteria end them
PROPOSERS = ["ngram", "draft_model"]


def _model():
    return tiny_llama(vocab=64, seed=3, sharpness=4.0)


def _spec_kw(model, proposer: str) -> dict:
    if proposer == "draft_model":  # the model drafting for itself: long rounds, rows far apart
        return {"custom_generate": speculative_generate, "draft_model": model}
    return {"custom_generate": speculative_generate,
            "spec_config": {"proposer": {"type": "ngram", "num_draft_tokens": 4}}}


class PerRowStop(StoppingCriteria):
    """Row b stops on its own token ``stops[b]`` (a per-request stop id, as lm-eval-harness keeps
    one stop sequence per batch row)."""

    def __init__(self, stops: list[int]) -> None:
        self.stops, self.calls = stops, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.tensor([int(input_ids[b, -1]) == self.stops[b] for b in range(input_ids.shape[0])])


class PerRowEosStop(PerRowStop):
    """The same, declaring an ``eos_token_id``: plain ``generate()`` then pads the rows it stops."""

    def __init__(self, stops: list[int]) -> None:
        super().__init__(stops)
        self.eos_token_id = stops


class StopAfterCalls(StoppingCriteria):
    """Stops every row at its ``n``-th call (a criterion counting the steps)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= self.n, dtype=torch.bool)


def _stops(model, inputs) -> list[int]:
    """Row b's token at new position 6 + b of its plain output: each row has its own stop."""
    L = inputs["input_ids"].shape[1]
    plain = model.generate(**inputs, max_new_tokens=NEW, pad_token_id=PAD)
    return [int(plain[b, L + 5 + b]) for b in range(len(PROMPTS))]


def _compare(model, inputs, proposer: str, make, **kw) -> tuple[torch.Tensor, StoppingCriteria, StoppingCriteria]:
    """Plain and speculative ``generate()`` with a fresh criterion each: the outputs and the
    streamers' puts are equal; returns plain's output and both criteria."""
    kw = {"max_new_tokens": NEW, "pad_token_id": PAD} | kw
    cp, cs, rp, rs = make(), make(), Recorder(), Recorder()
    plain = model.generate(**inputs, **kw, stopping_criteria=StoppingCriteriaList([cp]), streamer=rp)
    spec = model.generate(**inputs, **kw, stopping_criteria=StoppingCriteriaList([cs]),
                          spec_streamer=rs, **_spec_kw(model, proposer))
    assert torch.equal(spec, plain)
    assert rs.puts == rp.puts and rs.ended  # one [B] column per put: none was put and then cut
    return plain, cp, cs


@pytest.mark.parametrize("eos", [EOS, None])  # None: no EOS criterion, stopped rows decode on
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_a_criterion_keeping_per_row_state_equals_plain_generate(proposer, eos):
    """Called with one row at a time, the criterion read ``stops[0]`` for every row."""
    model = _model()
    inputs = left_padded(PROMPTS)
    stops = _stops(model, inputs)
    plain, cp, cs = _compare(model, inputs, proposer, lambda: PerRowStop(stops), eos_token_id=eos)
    assert plain.shape[1] < inputs["input_ids"].shape[1] + NEW  # the criterion ended the batch
    assert cs.calls == cp.calls == plain.shape[1] - inputs["input_ids"].shape[1]  # once per step


@pytest.mark.parametrize("eos", [EOS, None])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_a_criterion_counting_its_calls_equals_plain_generate(proposer, eos):
    """Called per token per row, a criterion stopping at its 6th call stopped the batch after 3
    new tokens or fewer."""
    model = _model()
    inputs = left_padded(PROMPTS)
    plain, cp, cs = _compare(model, inputs, proposer, lambda: StopAfterCalls(6), eos_token_id=eos)
    assert plain.shape[1] == inputs["input_ids"].shape[1] + 6
    assert cs.calls == cp.calls == 6


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_a_criterion_with_an_eos_token_id_pads_the_rows_it_stops_as_plain_generate(proposer):
    """No EOS id on the call: the criterion's own ``eos_token_id`` makes plain ``generate()`` pad
    the rows it stops, and check the padded rows at later steps."""
    model = _model()
    inputs = left_padded(PROMPTS)
    stops = _stops(model, inputs)
    plain, cp, cs = _compare(model, inputs, proposer, lambda: PerRowEosStop(stops))
    L = inputs["input_ids"].shape[1]
    assert plain.shape[1] < L + NEW and (plain[:, -1] == PAD).any()  # rows stopped early, padded
    assert cs.calls == cp.calls == plain.shape[1] - L


def test_a_paged_cache_is_refused_by_name_in_the_directory_form():
    """transformers switches to continuous batching on ``cache_implementation="paged"``: the
    directory form passed it on, and the call returned ``generate_batch``'s [1, B, L] output
    with nothing drafted."""
    model = _model()
    streamer = Recorder()
    with pytest.raises(ValueError, match="cache_implementation='paged'"):
        model.generate(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=10, cache_implementation="paged",
                       custom_generate=CUSTOM_GENERATE, trust_remote_code=True, streamer=streamer)
    assert streamer.ended


@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_output_flags_without_a_dict_output_equal_plain_generate(flag):
    """``generate()`` puts these in the model kwargs for its forwards and, without
    ``return_dict_in_generate``, drops what they return: they were refused as model inputs."""
    model = _model()
    inputs = left_padded(PROMPTS)
    kw = {"max_new_tokens": 12, "pad_token_id": PAD, flag: True}
    plain = model.generate(**inputs, **kw)
    spec = model.generate(**inputs, **kw, **_spec_kw(model, "ngram"))
    assert torch.equal(spec, plain)
    with pytest.raises(NotImplementedError, match=flag):  # with a dict output they would be returned
        model.generate(**inputs, **kw, return_dict_in_generate=True, **_spec_kw(model, "ngram"))
