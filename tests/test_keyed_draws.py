"""A seed reproduces its output whatever drafts and whatever draft schedule the round used.

A seeded row's samples are keyed on (seed, lane, absolute position) (``spec_plugins.keyed_draws``),
not drawn from a stream whose order depends on how many positions each round verified. So plain
decoding, n-gram chains of any length, suffix trees and the ``auto`` length (picked from measured
timings) give one output per seed; rows sharing a seed take lanes and differ; and the law is the
target's (chi-square against the enumerated joint, with a power check on a broken keying)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint

from conftest import tiny_llama
from spec_plugins import SpeculativeDecoder
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.keyed_draws import KeyedDraws
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
    """The law test can fail: keyed on the lane alone, a row runs one race at every position."""
    from spec_plugins import keyed_draws

    real = keyed_draws.position_words
    monkeypatch.setattr(keyed_draws, "position_words", lambda keys, positions: real(keys, positions * 0))
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


def _draws(probs: torch.Tensor, n: int, seed: tuple[int, int] = (12345, 0), start: int = 0,
           chunk: int = 250) -> torch.Tensor:
    """The keyed tokens of one row at absolute positions start..start+n-1, all with ``probs`` [V]
    (a round of ``chunk`` positions at a time, as the verifier draws them)."""
    out = []
    for at in range(start, start + n, chunk):
        m = min(chunk, start + n - at)
        draws = KeyedDraws((seed,), (at,))
        out.append(draws.sample(probs.expand(1, m, -1), torch.arange(m))[0])
    return torch.cat(out)


def test_a_seeded_draw_ignores_the_rounding_of_a_batched_forward():
    """A batched forward moves logits by ~2e-6; the draw changes only on a near-tie of the race.
    One likely token (half the mass) before a flat tail of 49152 ids: an inverse CDF over the ids
    moved every tail boundary by the likely token's rounding and took another token at 20 of 2000
    positions (a seeded request changed beside other rows)."""
    V = 49152
    g = torch.Generator().manual_seed(0)
    logits = 0.01 * torch.randn(V, generator=g)
    logits[0] += math.log(V)
    shifted = logits + 2e-6 * torch.randn(V, generator=g)
    alone, batched = _draws(logits.softmax(-1), 2000), _draws(shifted.softmax(-1), 2000)
    assert int((alone != batched).sum()) <= 1
    assert len(set(alone.tolist())) > 900  # the tail is drawn, not only the likely token


# unnormalised masses over 600 ids: blocks of 256 (the last padded), block 1 without mass,
# zero-mass ids inside the blocks with mass
_LAW = {0: 1.0, 7: 3.0, 255: 0.5, 513: 2.0, 599: 1.5}


def _law_probs(law: dict[int, float], V: int = 600) -> torch.Tensor:
    p = torch.zeros(V)
    p[list(law)] = torch.tensor(list(law.values()))
    return p


def _exact(law: dict[int, float]) -> dict[tuple, float]:
    total = sum(law.values())
    return {(t,): m / total for t, m in law.items()}


def test_keyed_draws_follow_the_law_and_never_take_a_token_without_mass():
    """Distinct positions are independent draws: 20000 of them fit the normalised law (chi-square),
    a wrong law is rejected by the same test (power), and no zero-mass id is ever drawn."""
    samples = [(t,) for t in _draws(_law_probs(_LAW), 20000, chunk=5000).tolist()]
    assert {s[0] for s in samples} == set(_LAW)
    assert chi_square_pvalue(samples, _exact(_LAW)) > 1e-3
    wrong = {**_LAW, 7: _LAW[513], 513: _LAW[7]}  # two tokens of different blocks swap masses
    assert chi_square_pvalue(samples, _exact(wrong)) < 1e-6
    near = {**_LAW, 0: 1.15}  # a 15% error on one token's mass is seen too
    assert chi_square_pvalue(samples, _exact(near)) < 1e-3


def test_a_draw_is_a_function_of_seed_lane_position_and_distribution():
    """The same (seed, lane, absolute position, probs) gives the same token whatever the round's
    start, the rows beside it or a repeat; other lanes and seeds draw apart; a row without mass
    takes token 0 (as before: the round flags such rows itself)."""
    g = torch.Generator().manual_seed(1)
    p = torch.rand(3, 8, 1000, generator=g)  # three rows, eight positions each
    draws = KeyedDraws(((5, 0), (5, 1), (6, 0)), (10, 10, 10))
    got = draws.sample(p, torch.arange(8))
    assert torch.equal(got, draws.sample(p, torch.arange(8)))
    # row 0 alone, its round starting 3 tokens later: positions 13..17 are the same draws
    later = KeyedDraws(((5, 0),), (13,)).sample(p[:1, 3:], torch.arange(5))
    assert torch.equal(later[0], got[0, 3:])
    flat = torch.ones(1000)
    lanes = [_draws(flat, 200, seed=s, chunk=200) for s in ((5, 0), (5, 1), (6, 0), (5 + (1 << 32), 0))]
    for i in range(len(lanes)):
        for j in range(i):
            assert int((lanes[i] == lanes[j]).sum()) < 10  # ~0.2 of 200 agree by chance
    dead = torch.zeros(1, 2, 1000)
    assert KeyedDraws(((5, 0),), (0,)).sample(dead, torch.arange(2)).tolist() == [[0, 0]]
