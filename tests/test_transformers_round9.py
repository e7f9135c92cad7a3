"""``speculative_generate`` where a ``synced_gpus`` it documents as refused was dropped by
transformers without a word, where ``torch.manual_seed`` did not reproduce a sampled call (its
draws followed the draft schedule), where a refused call left its streamer's reader waiting,
where ``spec_stats`` counted tokens the call cut, and where an all-zero mask row got an engine
error about an empty prompt."""

from __future__ import annotations

import pytest
import torch
from test_transformers_integration import PAD, PROMPTS, Recorder, left_padded
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from conftest import tiny_llama
from spec_plugins.integrations.transformers import CUSTOM_GENERATE, speculative_generate
from spec_plugins.stats import DecodeStats

CALLABLE = {"custom_generate": speculative_generate}
DIRECTORY = {"custom_generate": CUSTOM_GENERATE, "trust_remote_code": True}


def _ngram(k: int) -> dict:
    return {"spec_config": {"proposer": {"type": "ngram", "num_draft_tokens": k, "max_ngram": 2}}}


# ---- synced_gpus --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", [CALLABLE, DIRECTORY], ids=["callable", "directory"])
def test_synced_gpus_is_refused_though_transformers_drops_it(how):
    """transformers hands a callable only the keywords ``_sample`` lacks; ``synced_gpus`` is one
    of ``_sample``'s, so it never arrived and the documented refusal never fired."""
    model = tiny_llama(seed=3)
    with pytest.raises(ValueError, match="does not support synced_gpus"):
        model.generate(**left_padded(PROMPTS), max_new_tokens=4, pad_token_id=PAD, synced_gpus=True, **how)


def test_synced_gpus_is_resolved_as_generate_resolves_it(monkeypatch):
    """Left unset, ``generate()`` turns it on under ZeRO-3 (or FSDP) with more than one process:
    refused then; an explicit ``synced_gpus=False`` is what ``generate()`` runs with, and runs."""
    import torch.distributed as dist
    from transformers.generation import utils as gen_utils

    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    monkeypatch.setattr(gen_utils, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    with pytest.raises(ValueError, match="does not support synced_gpus"):
        model.generate(**inputs, max_new_tokens=4, pad_token_id=PAD, **CALLABLE)
    out = model.generate(**inputs, max_new_tokens=4, pad_token_id=PAD, synced_gpus=False, **CALLABLE)
    assert out.shape == (len(PROMPTS), inputs["input_ids"].shape[1] + 4)


# ---- seeds --------------------------------------------------------------------------------------
def _sampled(model, seed: int, **kw) -> tuple[torch.Tensor, float]:
    """A sampled call after ``torch.manual_seed(seed)``, and torch's next global draw after it."""
    torch.manual_seed(seed)
    out = model.generate(**left_padded(PROMPTS), max_new_tokens=24, do_sample=True, pad_token_id=PAD,
                         **CALLABLE, **kw)
    return out, torch.rand(1).item()


def test_manual_seed_reproduces_sampling_whatever_the_draft_schedule():
    """The draws came from torch's global stream, so their order followed how many tokens each
    round drafted (timed costs, the tree sizer's state): one seed gave different outputs from
    call to call. Now each row samples keyed on a seed drawn from that stream."""
    model = tiny_llama(seed=3)
    first, after = _sampled(model, 0)  # the default (auto) proposer: this call measures the costs
    runs = [_sampled(model, 0), _sampled(tiny_llama(seed=3), 0)]  # kept state; a fresh model's state
    runs += [_sampled(model, 0, **_ngram(k)) for k in (1, 3, 6)]  # fixed draft lengths
    for out, nxt in runs:
        assert torch.equal(out, first)
        assert nxt == after  # every sampled call takes the same draws from torch's stream
    other, _ = _sampled(model, 1)
    assert not torch.equal(other, first)  # the seed decides the output


# ---- streamers end when the call raises ---------------------------------------------------------
class _Raises(LogitsProcessor):
    """Fails once the sequences reach ``at`` tokens (mid-decode)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.at:
            raise RuntimeError("boom from the user's processor")
        return scores


_ALL_ZERO_ROW = {"attention_mask": torch.tensor([[1] * 7, [0] * 7])}
_BAD = {
    "output_scores": (dict(return_dict_in_generate=True, output_scores=True), NotImplementedError),
    "past_context": (dict(max_new_tokens=300), ValueError),
    "all_zero_row": (_ALL_ZERO_ROW, ValueError),
    "synced_gpus": (dict(synced_gpus=True), ValueError),
    "mid_decode": (dict(logits_processor=LogitsProcessorList([_Raises(10)])), RuntimeError),
}


@pytest.mark.parametrize("form", ["callable", "directory"])
@pytest.mark.parametrize("bad", list(_BAD))
def test_a_call_that_raises_ends_its_streamer(form, bad):
    """A refusal raised before anything was streamed and nothing called ``end()``: a thread
    reading a ``TextIteratorStreamer`` waited forever. Every raising call now ends it."""
    model = tiny_llama(seed=3)
    kw, err = _BAD[bad]
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])
    streamer = Recorder()
    how = {**CALLABLE, "spec_streamer": streamer} if form == "callable" else {**DIRECTORY, "streamer": streamer}
    with pytest.raises(err):
        model.generate(input_ids=ids, **({"max_new_tokens": 8, "pad_token_id": PAD} | kw), **how)
    assert streamer.ended


# ---- spec_stats counts the tokens returned ------------------------------------------------------
def test_stats_count_only_the_tokens_returned_when_a_criterion_ends_the_batch():
    """Without an EOS id, rows that met a stopping criterion decode on until every row has, and
    then all are cut to the last stop: the tokens emitted past it were counted in ``new_tokens``
    (39 counted for 24 returned) and so in ``tokens_per_second``."""
    model = tiny_llama(seed=3)
    inputs = left_padded(PROMPTS)
    L = inputs["input_ids"].shape[1]

    class StopAt(StoppingCriteria):  # a row stops once its new tokens hold token 14
        def __call__(self, ids, scores, **kw):
            return (ids[:, L:] == 14).any(1)

    kw = dict(max_new_tokens=20, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAt()]))
    plain = model.generate(**inputs, **kw)
    stats = DecodeStats()
    spec = model.generate(**inputs, **kw, **CALLABLE, **_ngram(4), spec_stats=stats)
    assert torch.equal(spec, plain)
    assert spec.shape[1] - L < 20  # the criterion ended the batch
    assert stats.new_tokens == spec[:, L:].numel()  # no pads: every row ends at the last stop


# ---- an all-zero mask row -----------------------------------------------------------------------
def test_an_all_zero_attention_mask_row_is_refused_by_name():
    """It reached the engine as an empty prompt: ``request 1: prompt is empty``."""
    model = tiny_llama(seed=3)
    inputs = left_padded([[5, 6, 7], [9]])
    inputs["attention_mask"][1] = 0
    with pytest.raises(ValueError, match=r"row 1 of attention_mask is all zeros"):
        model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=PAD, **CALLABLE)
