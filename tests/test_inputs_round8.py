"""Inputs to the Python API at their edges: a processor that forces a token with +inf in a greedy
row (transformers' greedy ``generate()`` is the reference), processors that are not a list of
callables, ``seeds`` / ``sampling`` that would iterate as something else, ``logit_bias`` keys that
are no token ids, and prompts with no order of their own or of the wrong shape."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import full_logits
from transformers import LogitsProcessorList

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.processors import LogitBias
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier

V = 32
N = 16
PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 7], [9, 4]]
INF = float("inf")


class ForceAfter:
    """+inf on two tokens (a tie: the first is the argmax) wherever a row's last token is a
    multiple of 3; a loop over the rows, independent of the package."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for r, row in enumerate(input_ids.tolist()):
            if row[-1] % 3 == 0:
                out[r, (row[-1] * 7 + 11) % V] = INF
                out[r, (row[-1] * 7 + 5) % V] = INF
        return out


def force7(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return scores.index_fill(1, torch.tensor([7], device=scores.device), INF)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, sharpness=2.0)


def decoder(model, proposer: str | None) -> SpeculativeDecoder:
    prop = NgramProposer(NgramProposer.Config(num_draft_tokens=3)) if proposer == "ngram" else None
    return SpeculativeDecoder(TorchRuntime(model), prop, ExactVerifier())


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int, proc) -> list[int]:
    """transformers' own greedy ``generate`` with ``proc`` (the independent reference)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0, logits_processor=LogitsProcessorList([proc]))
    return out[0, len(prompt):].tolist()


# ---- 1. +inf from a processor: greedy picks it, sampling fails clearly ---------------------------
@pytest.mark.parametrize("proposer", [None, "ngram"])
@pytest.mark.parametrize("proc", [ForceAfter(), force7], ids=["force-after", "force7"])
def test_greedy_with_a_forced_token_equals_transformers(model, proposer, proc):
    dec = decoder(model, proposer)
    for p in PROMPTS:
        want = hf_greedy(model, p, N, proc)
        got = dec.generate(p, N, processors=[proc])
        assert (got.token_ids, got.finish_reason, got.error) == (want, "length", None), p
    batch = dec.generate_batch(PROMPTS, N, processors=[proc])
    assert [r.token_ids for r in batch] == [hf_greedy(model, p, N, proc) for p in PROMPTS]
    if proposer == "ngram" and proc is force7:
        assert batch[0].stats.accepted_tokens > 0  # drafted nodes holding +inf were verified and kept


def test_the_forced_token_changes_the_output(model):
    """The reference is not plain greedy: the processor forces tokens the model would not pick."""
    dec = decoder(model, None)
    assert any(dec.generate(p, N, processors=[ForceAfter()]).token_ids != dec.generate(p, N).token_ids
               for p in PROMPTS)


@pytest.mark.parametrize("proposer", [None, "ngram"])
def test_a_sampled_row_with_inf_fails_and_a_greedy_row_beside_it_does_not(model, proposer):
    dec = decoder(model, proposer)
    alone = dec.generate(PROMPTS[0], N, processors=[force7], temperature=1.0, seed=1)
    assert alone.finish_reason == "error" and "not finite" in alone.error
    rows = dec.generate_batch(PROMPTS[:2], N, processors=[force7],
                              sampling=[SamplingConfig(), SamplingConfig(temperature=1.0, seed=1)])
    assert (rows[0].token_ids, rows[0].finish_reason) == (hf_greedy(model, PROMPTS[0], N, force7), "length")
    assert rows[1].finish_reason == "error" and "not finite" in rows[1].error


def test_a_greedy_row_with_nan_or_every_token_masked_still_fails(model):
    dec = decoder(model, None)
    for proc in (lambda i, s: s.fill_(float("nan")), lambda i, s: torch.full_like(s, -INF),
                 lambda i, s: force7(i, s).index_fill(1, torch.tensor([3]), float("nan"))):
        r = dec.generate(PROMPTS[0], 4, processors=[proc])
        assert (r.token_ids, r.finish_reason) == ([], "error") and "not finite" in r.error


def test_logprobs_of_forced_tokens_score_the_raw_logits(model):
    """Logprobs are the log-softmax of the raw logits (before processing): finite for a forced token."""
    batch = Batch(TorchRuntime(model), NgramProposer(NgramProposer.Config(num_draft_tokens=3)), ExactVerifier())
    emitted = batch.add([RowRequest(i, list(p), 8, processors=(force7,), logprobs=True) for i, p in enumerate(PROMPTS)])
    policy = DraftPolicy.of(FixedLength(3))
    while len(batch):
        record = run_round(batch, policy)
        emitted += record.emissions if record is not None else []
    for i, p in enumerate(PROMPTS):
        toks = [t for e in emitted if e.key == i for t in e.tokens]
        lps = [lp for e in emitted if e.key == i for lp in e.logprobs]
        assert toks == [7] * 8
        want = [float(full_logits(model, p + toks[:j]).log_softmax(-1)[7]) for j in range(8)]
        assert lps == pytest.approx(want, abs=1e-4)


# ---- 2. processors: a list of callables, checked before anything runs ----------------------------
class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


@pytest.mark.parametrize("bad, msg", [([None], r"processors\[1\] is None"), ([5], r"processors\[1\] is 5"),
                                      (["x"], r"processors\[1\] is 'x'")])
def test_processors_that_are_not_callable_are_refused_up_front(model, bad, msg):
    dec = decoder(model, "ngram")
    seen = Counting()
    with pytest.raises(TypeError, match=msg):
        dec.generate_batch(PROMPTS[:2], 3, processors=[seen, *bad])
    with pytest.raises(TypeError, match=msg):
        dec.generate(PROMPTS[0], 3, processors=[seen, *bad])
    with pytest.raises(TypeError, match=msg):
        next(dec.stream(PROMPTS[0], 3, processors=[seen, *bad]))
    assert seen.calls == 0


@pytest.mark.parametrize("single", [force7, Counting(), LogitBias({3: 1.0}, V)])
def test_a_single_processor_is_refused_with_a_hint_to_pass_a_list(model, single):
    with pytest.raises(TypeError, match=r"processors must be a list .* got a single .*pass \[processor\]"):
        decoder(model, None).generate_batch(PROMPTS[:2], 3, processors=single)


def test_processors_as_a_list_tuple_or_logits_processor_list_still_work(model):
    dec = decoder(model, None)
    want = dec.generate(PROMPTS[0], 6, processors=[force7]).token_ids
    assert want == [7] * 6
    assert dec.generate(PROMPTS[0], 6, processors=(force7,)).token_ids == want
    assert dec.generate(PROMPTS[0], 6, processors=LogitsProcessorList([force7])).token_ids == want


# ---- 3. seeds and sampling: one entry per prompt, never characters or keys -----------------------
@pytest.mark.parametrize("kw, msg", [
    ({"seeds": "12", "temperature": 1.0}, r"seeds must be a list .* got str"),
    ({"seeds": b"12", "temperature": 1.0}, r"seeds must be a list .* got bytes"),
    ({"seeds": {0: 1, 1: 2}, "temperature": 1.0}, r"seeds must be a list .* got dict"),
    ({"seeds": 5, "temperature": 1.0}, r"seeds must be a list .* got int"),
    ({"sampling": {"temperature": 1.0}}, r"sampling must be a list .* got dict: wrap it in a list"),
    ({"sampling": "ab"}, r"sampling must be a list .* got str"),
    ({"sampling": SamplingConfig(temperature=1.0)}, r"sampling must be a list .* got SamplingConfig"),
])
def test_seeds_and_sampling_that_are_no_list_are_refused(model, kw, msg):
    seen = Counting()
    with pytest.raises(TypeError, match=msg):
        decoder(model, None).generate_batch(PROMPTS[:2], 3, processors=[seen], **kw)
    assert seen.calls == 0


def test_seeds_as_list_tuple_or_array_agree(model):
    dec = decoder(model, None)
    want = [r.token_ids for r in dec.generate_batch(PROMPTS[:2], 6, seeds=[1, 2], temperature=1.0)]
    for seeds in ((1, 2), np.array([1, 2])):
        assert [r.token_ids for r in dec.generate_batch(PROMPTS[:2], 6, seeds=seeds, temperature=1.0)] == want
    with pytest.raises(ValueError, match=r"seeds needs one entry per prompt \(2\), got 1"):
        dec.generate_batch(PROMPTS[:2], 6, seeds=[1], temperature=1.0)


# ---- 4. logit_bias keys are token ids ------------------------------------------------------------
@pytest.mark.parametrize("key", [3.7, 3.0, True, "3.7", "x", " 3", None])
def test_logit_bias_keys_that_are_no_token_ids_are_refused(key):
    with pytest.raises(ValueError, match=r"logit_bias: keys must be token ids .*got " + re.escape(repr(key))):
        LogitBias({key: 5.0}, V)


def test_logit_bias_takes_integers_and_integer_strings():
    bias = LogitBias({"3": 5.0, 4: 1.0, np.int64(5): 2.0, torch.tensor(6): -1.0}, V)
    assert bias.ids.tolist() == [3, 4, 5, 6]
    with pytest.raises(ValueError, match=r"logit_bias: token id -1 is outside the vocabulary"):
        LogitBias({"-1": 1.0}, V)


# ---- 5. prompts: an ordered sequence of ids, 1-D where it is an array ----------------------------
@pytest.mark.parametrize("prompt", [{3, 1, 2}, frozenset([3, 1, 2]), {1: 2, 3: 4}, {1: 2, 3: 4}.keys(),
                                    {1: 2, 3: 4}.values(), torch.tensor([[1], [2], [3]]), torch.tensor(3),
                                    np.array([[1, 2, 3]])], ids=lambda p: type(p).__name__)
def test_prompts_with_no_order_or_the_wrong_shape_are_refused(model, prompt):
    dec = decoder(model, None)
    with pytest.raises(TypeError, match=r"a prompt is a str, chat messages or a list of token ids"):
        dec.generate(prompt, 3)
    with pytest.raises(TypeError, match=r"a prompt is a str, chat messages or a list of token ids"):
        dec.generate_batch([PROMPTS[0], prompt], 3)


def test_one_dimensional_tensors_arrays_and_ranges_still_work(model):
    dec = decoder(model, None)
    want = dec.generate([1, 2, 3], 4)
    for p in (torch.tensor([1, 2, 3]), np.array([1, 2, 3]), range(1, 4), (1, 2, 3), iter([1, 2, 3])):
        got = dec.generate(p, 4)
        assert (got.prompt_ids, got.token_ids) == ([1, 2, 3], want.token_ids)
