"""Sampling is exact: the speculative output law IS the target's, checked by chi-square against
the enumerated joint distribution of the first 3 tokens, with a power check (a wrong verifier
must fail the very same test)."""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier
from spec_plugins.verify import Verdict

V = 16
N_SAMPLES = 24000
PROMPT = [1, 5, 2, 5]
ALPHA = 1e-3  # exact verifier must pass at this level


class BanToken:
    """A user LogitsProcessor (transformers signature) that forbids one token."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores):
        return scores.masked_fill(torch.arange(scores.shape[-1]) == self.token, float("-inf"))


class AlwaysAccept(ExactVerifier):
    """Deliberately wrong: accepts every draft token, then samples the bonus from p."""

    def __call__(self, x, parents, target_logits, q, pipeline, generator, valid=None):
        p = target_logits.float().softmax(-1)
        n = x.shape[1]
        nxt = torch.multinomial(p[:, n], 1, generator=generator).squeeze(-1)
        return Verdict([list(range(n)) for _ in range(x.shape[0])], nxt.tolist())


class AcceptByRatioNoResidual(ExactVerifier):
    """Deliberately wrong: correct accept test but resamples from p (not the residual)."""

    def __call__(self, x, parents, target_logits, q, pipeline, generator, valid=None):
        from spec_plugins.verify import rejection_verify

        p = target_logits.float().softmax(-1)
        v = rejection_verify(x, parents, p, q, generator, valid).fetch(x)[0]
        rows = torch.arange(x.shape[0])
        a = torch.tensor([len(acc) for acc in v.accepted])
        fresh = torch.multinomial(p[rows, a], 1, generator=generator).squeeze(-1)
        return Verdict(v.accepted, fresh.tolist())


def speculative_samples(target_model, proposer_factory, pipeline, verifier, k, seed=0, runtime=TorchRuntime):
    target = runtime(target_model)
    proposer = proposer_factory(target)
    gen = torch.Generator().manual_seed(seed)
    outs = [[] for _ in range(N_SAMPLES)]
    prompts = [PROMPT] * N_SAMPLES
    for step in decode(target, proposer, verifier, pipeline, prompts, 3, (), gen, None, FixedLength(k)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return [tuple(o) for o in outs]


SETTINGS = {
    "t1": SamplingConfig(temperature=1.0),
    "t0.7_topk5": SamplingConfig(temperature=0.7, top_k=5),
    "t1.3_topp0.8": SamplingConfig(temperature=1.3, top_p=0.8),
    "t1_reppen_ban": SamplingConfig(temperature=1.0, repetition_penalty=1.8),
}


def _pipeline(name):
    procs = [BanToken(3)] if name == "t1_reppen_ban" else []
    return LogitsPipeline(SETTINGS[name], procs)


def _draft(target):
    return DraftModelProposer(None, target=target, runtime=TorchRuntime(tiny_llama(vocab=V, seed=12, sharpness=6.0)))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_draft_model_sampling_is_exact(name):
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    pipe = _pipeline(name)
    exact = exact_joint(model, PROMPT, 3, pipe)
    samples = speculative_samples(model, _draft, pipe, ExactVerifier(), k=2)
    assert chi_square_pvalue(samples, exact) > ALPHA


def test_ngram_point_mass_sampling_is_exact():
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    pipe = _pipeline("t1")
    exact = exact_joint(model, PROMPT, 3, pipe)
    samples = speculative_samples(model, lambda t: NgramProposer(NgramProposer.Config(max_ngram=2)), pipe,
                                  ExactVerifier(), k=2)
    assert chi_square_pvalue(samples, exact) > ALPHA


@pytest.mark.parametrize("wrong", [AlwaysAccept, AcceptByRatioNoResidual])
def test_power_wrong_verifier_fails_same_test(wrong):
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    pipe = _pipeline("t1")
    exact = exact_joint(model, PROMPT, 3, pipe)
    samples = speculative_samples(model, _draft, pipe, wrong(), k=2)
    assert chi_square_pvalue(samples, exact) < 1e-6


def test_draft_disagrees_with_target():
    """The exactness test is meaningful only if the draft's law differs from the target's."""
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    draft = tiny_llama(vocab=V, seed=12, sharpness=6.0)
    pipe = _pipeline("t1")
    p = exact_joint(model, PROMPT, 1, pipe)
    q = exact_joint(draft, PROMPT, 1, pipe)
    tv = 0.5 * sum(abs(p.get(c, 0) - q.get(c, 0)) for c in set(p) | set(q))
    assert tv > 0.3


def test_seeded_runs_reproducible():
    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    pipe = _pipeline("t1")
    a = speculative_samples(model, _draft, pipe, ExactVerifier(), k=2, seed=5)[:300]
    b = speculative_samples(model, _draft, pipe, ExactVerifier(), k=2, seed=5)[:300]
    assert a == b


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 0.5), (0.7, 5, 0.8), (1.3, None, 0.3),
                                                    (1.0, 3, 0.999), (2.0, None, 1e-9)])
def test_warpers_keep_what_transformers_keeps_at_ties(temperature, top_k, top_p):
    """The target's law under temperature / top-k / top-p is transformers' own: the same tokens
    survive, also where logits tie exactly at the nucleus edge (rounded logits, a processor that
    sets them) — there the later index stays, as in transformers' ascending sort."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    rounded = (torch.randn(64, 12, generator=g) * 2).round() / 2  # many exact ties
    edge = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, 0.0] + [-9.0] * 6])  # ties straddle top_p = 0.5
    logits = torch.cat([rounded, edge])
    ours = LogitsPipeline(SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)).warp(logits.clone())
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        ref = TopKLogitsWarper(top_k)(None, ref)
    ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    assert torch.allclose(ours.softmax(-1), ref.softmax(-1))
