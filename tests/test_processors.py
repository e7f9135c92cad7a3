"""``logit_bias`` and the presence/frequency penalties, exact under speculation.

Greedy output equals transformers' own ``generate()`` with independent reference processors (a
loop over each row's history, written here), chain and tree; a token that plain greedy decoding
emits never appears once biased by -100; sampling with a penalty (negative: repeats pulled up,
so the drafted history matters) passes chi-square, chain and
tree, and a penalty that forgets the drafted part of the history fails the same test."""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square_pvalue, every_proposer, exact_joint, full_logits, plain_greedy, save_random_heads

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.processors import FrequencyPresencePenalty, LogitBias
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6, 5, 6, 7, 5, 6], [9, 4]]
N = 16
PAD = 0


class RefPenalty:
    """A loop per row and token: OpenAI's rule over the tokens after ``start``, or TGI's share
    of the whole sequence (``per_length``)."""

    def __init__(self, frequency, presence, start, per_length=False):
        self.f, self.p, self.start, self.per_length = frequency, presence, start, per_length

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for r, row in enumerate(input_ids.tolist()):
            seen = row[self.start:]
            for t in set(seen):
                c = seen.count(t)
                out[r, t] -= self.f * (c / len(row) if self.per_length else c) + self.p
        return out


class RefBias:
    def __init__(self, bias):
        self.bias = bias

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for t, v in self.bias.items():
            out[:, t] += v
        return out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_llama(seed=3, sharpness=2.0)
    return model, save_random_heads(model, tmp_path_factory.mktemp("heads"))


@torch.no_grad()
def reference(model, prompts, procs):
    from transformers import LogitsProcessorList

    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N, min_new_tokens=N,
                         pad_token_id=PAD, logits_processor=LogitsProcessorList(procs))
    return out[:, width:].tolist()


def ours(rt, proposer, prompts, procs, sampling=SamplingConfig(), prefix=None, k=3):
    outs = [[] for _ in prompts]
    for step in decode(rt, proposer, ExactVerifier(), LogitsPipeline(sampling, procs), prompts, N, (), None, None,
                       FixedLength(k), processor_prefix=prefix):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs


def _pads(prompts):
    width = max(map(len, prompts))
    return [[PAD] * (width - len(p)) for p in prompts], width


CASES = {
    "openai": lambda start: ([FrequencyPresencePenalty(0.9, 0.6, start), LogitBias({4: 3.0, 7: -2.0}, 32)],
                             [RefPenalty(0.9, 0.6, start), RefBias({4: 3.0, 7: -2.0})]),
    "tgi": lambda start: ([FrequencyPresencePenalty(1.5, 0.0, 0, per_length=True)],
                          [RefPenalty(1.5, 0.0, 0, per_length=True)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["ngram", "suffix", "eagle-tree", "eagle-chain", "recycling"])
def test_greedy_with_penalties_equals_transformers_generate(target, kind, case):
    model, heads = target
    prefix, width = _pads(PROMPTS)  # transformers' processors see the left pads: ours see them too
    procs, refs = CASES[case](width)
    rt = TorchRuntime(model, matmul="native")
    got = ours(rt, every_proposer(kind, rt, heads), PROMPTS, procs, prefix=prefix)
    want = reference(model, PROMPTS, refs)
    assert got == want
    assert want != reference(model, PROMPTS, [])  # the processors change the output


@pytest.mark.parametrize("kind", ["ngram", "eagle-tree"])
def test_a_token_biased_by_minus_100_never_appears(target, kind):
    model, heads = target
    plain = plain_greedy(model, PROMPTS[0], N)
    banned = max(set(plain), key=plain.count)
    rt = TorchRuntime(model, matmul="native")
    got = ours(rt, every_proposer(kind, rt, heads), PROMPTS[:1], [LogitBias({banned: -100.0}, 32)])[0]
    assert banned in plain and banned not in got and len(got) == N


V = 16
PROMPT = [1, 5, 2, 5]
SAMPLING = SamplingConfig(temperature=1.0)


class ForgetsDrafts(FrequencyPresencePenalty):
    """Deliberately wrong: counts the committed history only, as if drafted nodes had no prefix."""

    def __call__(self, input_ids, scores):
        return super().__call__(input_ids[:, : len(PROMPT) + 1], scores)


def _samples(model, proposer, procs, n_samples=6000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outs = [[] for _ in range(n_samples)]
    for step in decode(TorchRuntime(model), proposer, ExactVerifier(), LogitsPipeline(SAMPLING, procs),
                       [PROMPT] * n_samples, 4, (), gen, None, FixedLength(2)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
        if min(len(o) for o in outs) >= 3:
            break
    return [tuple(o[:3]) for o in outs]


def _proposer(kind, model):
    from spec_plugins.proposers.draft_model import DraftModelProposer
    from spec_plugins.proposers.recycling import RecyclingProposer

    if kind == "chain":
        return DraftModelProposer(None, target=TorchRuntime(model), runtime=TorchRuntime(tiny_llama(vocab=V, seed=12)))
    prop = RecyclingProposer(RecyclingProposer.Config(paths=[[0], [1], [2], [0, 0], [0, 1], [1, 0]], candidates=3))
    for t in range(V):
        prop.update(torch.tensor([[t]]), full_logits(model, PROMPT + [t])[None, None])
    return prop


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampling_with_a_penalty_is_exact(kind):
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    procs = [FrequencyPresencePenalty(-2.0, -2.0, len(PROMPT))]
    exact = exact_joint(model, PROMPT, 3, LogitsPipeline(SAMPLING, procs))
    assert chi_square_pvalue(_samples(model, _proposer(kind, model), procs), exact) > 1e-3


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_power_a_penalty_that_forgets_drafted_tokens_fails_the_same_test(kind):
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    exact = exact_joint(model, PROMPT, 3, LogitsPipeline(SAMPLING, [FrequencyPresencePenalty(-2.0, -2.0, len(PROMPT))]))
    wrong = [ForgetsDrafts(-2.0, -2.0, len(PROMPT))]
    assert chi_square_pvalue(_samples(model, _proposer(kind, model), wrong), exact) < 1e-6


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LogitBias({40: 1.0}, 32)
    with pytest.raises(ValueError, match="between -100 and 100"):
        LogitBias({4: 101.0}, 32)
    with pytest.raises(ValueError, match="presence_penalty must be between -2 and 2"):
        FrequencyPresencePenalty(0.0, 2.5)
