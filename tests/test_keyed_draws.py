"""A seed reproduces its output whatever drafts and whatever draft schedule the round used.

A seeded row's samples are keyed on (seed, lane, absolute position) (``spec_plugins.keyed_draws``),
not drawn from a stream whose order depends on how many positions each round verified. So plain
decoding, n-gram chains of any length, suffix trees and the ``auto`` length (picked from measured
timings) give one output per seed; rows sharing a seed take lanes and differ; and the law is the
target's (chi-square against the enumerated joint, with a power check on a broken keying)."""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint

from conftest import tiny_llama
from spec_plugins import SpeculativeDecoder
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.proposers.suffix import SuffixProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verifiers import ExactVerifier

PROMPT = [1, 5, 2, 5, 1, 5, 2, 5, 1, 5]


def _proposers():
    return {
        "plain": None,
        "ngram2": NgramProposer(NgramProposer.Config(num_draft_tokens=2, max_ngram=2)),
        "ngram5": NgramProposer(NgramProposer.Config(num_draft_tokens=5, max_ngram=2)),
        "ngram_auto": NgramProposer(NgramProposer.Config(num_draft_tokens="auto", max_ngram=2)),
        "suffix_tree": SuffixProposer(SuffixProposer.Config(num_draft_tokens=4, tree_nodes=6)),
    }


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=16, seed=11, sharpness=4.0)


def test_a_seed_gives_one_output_whatever_the_drafts(model):
    """generate(seed=) and stream(seed=): one output per seed over plain decoding, chains of 2 and
    5, the auto length and a suffix tree (before: each schedule drew its own stream order)."""
    outs, accepted = {}, {}
    for name, proposer in _proposers().items():
        dec = SpeculativeDecoder(TorchRuntime(model, matmul="native"), proposer, ExactVerifier())
        for seed in (3, 4):
            r = dec.generate(PROMPT, 24, temperature=0.9, seed=seed)
            outs[name, seed] = r.token_ids
            accepted[name] = accepted.get(name, 0) + r.stats.accepted_tokens
            streamed = [t for e in dec.stream(PROMPT, 24, temperature=0.9, seed=seed) for t in e.token_ids]
            assert streamed == r.token_ids, name
    for seed in (3, 4):
        assert {tuple(outs[name, seed]) for name in _proposers()} == {tuple(outs["plain", seed])}, outs
    assert outs["plain", 3] != outs["plain", 4]
    assert all(accepted[name] > 0 for name in _proposers() if name != "plain"), accepted  # drafts were taken


def test_rows_sharing_a_seed_take_lanes(model):
    """generate_batch(seed=): row i draws in lane i, so equal prompts sample apart, row 0 equals
    generate(seed=), and no row depends on the drafts or on the rows beside it."""
    plain = SpeculativeDecoder(TorchRuntime(model, matmul="native"))
    spec = SpeculativeDecoder(TorchRuntime(model, matmul="native"),
                              NgramProposer(NgramProposer.Config(num_draft_tokens=4, max_ngram=2)))
    rows = [r.token_ids for r in plain.generate_batch([PROMPT] * 3, 20, temperature=1.2, seed=7)]
    assert len({tuple(r) for r in rows}) == 3  # lanes apart
    assert rows[0] == plain.generate(PROMPT, 20, temperature=1.2, seed=7).token_ids
    assert [r.token_ids for r in spec.generate_batch([PROMPT] * 3, 20, temperature=1.2, seed=7)] == rows
    alone = [r.token_ids for r in spec.generate_batch([PROMPT] * 2, 20, temperature=1.2, seed=7)]
    assert alone == rows[:2]  # the third row's presence changed nothing


V, N_SAMPLES, LAW_PROMPT = 16, 12000, [1, 5, 2, 5]


def _keyed_samples(model, proposer):
    pipe = LogitsPipeline(SamplingConfig(temperature=1.0))
    outs = [[] for _ in range(N_SAMPLES)]
    for step in decode(TorchRuntime(model, matmul="native"), proposer, ExactVerifier(), pipe,
                       [LAW_PROMPT] * N_SAMPLES, 3, (), None, None, FixedLength(2), seed=5):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return [tuple(o) for o in outs], pipe


@pytest.mark.parametrize("drafts", [False, True])
def test_keyed_samples_follow_the_target_law(model, drafts):
    proposer = NgramProposer(NgramProposer.Config(max_ngram=2)) if drafts else None
    samples, pipe = _keyed_samples(model, proposer)
    assert chi_square_pvalue(samples, exact_joint(model, LAW_PROMPT, 3, pipe)) > 1e-3


def test_power_a_keying_that_ignores_the_position_fails_the_same_test(model, monkeypatch):
    """The law test can fail: keyed on the lane alone, a row draws one uniform for every position."""
    from spec_plugins import keyed_draws

    real = keyed_draws.uniforms
    monkeypatch.setattr(keyed_draws, "uniforms", lambda keys, positions: real(keys, positions * 0))
    samples, pipe = _keyed_samples(model, None)
    assert chi_square_pvalue(samples, exact_joint(model, LAW_PROMPT, 3, pipe)) < 1e-6


def test_seeds_are_64_bits_and_a_subclassed_verifier_keeps_its_stream(model):
    """Two seeds equal in their low 32 bits sample apart (the key holds both halves); a verifier
    subclassing ExactVerifier that draws from ``generator`` itself still gets a torch.Generator (the
    keyed draws are ExactVerifier's own promise, not inherited)."""
    from spec_plugins.verify import follow

    dec = SpeculativeDecoder(TorchRuntime(model, matmul="native"))
    low = dec.generate(PROMPT, 12, temperature=1.2, seed=0).token_ids
    assert dec.generate(PROMPT, 12, temperature=1.2, seed=6403054999995154433).token_ids != low
    assert dec.generate(PROMPT, 12, temperature=1.2, seed=1 << 32).token_ids != low

    class OwnDraws(ExactVerifier):
        def sample(self, x, parents, p, q, generator, valid):
            assert generator is None or isinstance(generator, torch.Generator), type(generator)
            B, n = x.shape
            y = torch.multinomial(p.reshape(B * (n + 1), -1), 1, generator=generator).view(B, n + 1)
            return follow(x, parents, y, valid)

    own = SpeculativeDecoder(TorchRuntime(model, matmul="native"),
                             NgramProposer(NgramProposer.Config(num_draft_tokens=3, max_ngram=2)), OwnDraws())
    assert len(own.generate(PROMPT, 8, temperature=0.9, seed=3).token_ids) == 8
