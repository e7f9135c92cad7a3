"""``num_draft_tokens: auto``: the expected-rate math, its choices under known acceptance and
cost, recovery after a collapse, and greedy equality end to end."""

from __future__ import annotations

import random
import time

import pytest
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.adaptive import AcceptanceEstimate, AutoDraftLength
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SpecConfig
from spec_plugins.costmodel import CostModel, cost_model_for
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.stats import DecodeStats

FLAT = CostModel(tuple([0.010] * 17))  # GPU-like: verifying 17 positions costs one forward
CPU = CostModel(tuple(0.010 * (1 + 0.12 * (n - 1)) for n in range(1, 18)))  # 8 positions ~1.84x
LINEAR = CostModel(tuple(0.010 * n for n in range(1, 18)))  # verification as dear as decoding


def drive(policy, rounds: int, accept, offered: int = 64, seed: int = 0, stats: DecodeStats | None = None):
    """Play rounds like the engine does: policy -> k, draft min(k, offered) tokens, each position
    accepted while ``accept(j, rng)`` holds; returns (stats, chosen ks, modelled seconds)."""
    rng = random.Random(seed)
    stats = stats if stats is not None else DecodeStats()
    ks, seconds = [], 0.0
    for _ in range(rounds):
        k = policy(stats)
        ks.append(k)
        n = min(k, offered)
        a = 0
        while a < n and accept(a, rng):
            a += 1
        stats.target_forwards += 1
        stats.observe_round([1] * n, a, a + 1)
        stats.new_tokens += a + 1
        seconds += policy.cost.round_seconds(n, k > 0)
    return stats, ks, seconds


def iid(alpha: float):
    return lambda j, rng: rng.random() < alpha


def test_rates_follow_expected_tokens_over_cost():
    est = AcceptanceEstimate(3, decay=1.0, prior_weight=1e-9)
    # 1000 rows reach position 0, 800 accept it; of those 400 accept position 1; 100 accept position 2
    est.update(3, 1000, [1000, 1000, 1000], [800, 400, 100])
    p = est.accept_probs()
    assert p == pytest.approx([0.8, 0.5, 0.25], abs=1e-6)
    assert est.offer_probs() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    pol = AutoDraftLength(CPU, max_k=3)
    pol.estimate = est
    tokens = [1.0, 1.8, 2.2, 2.3]
    want = [t / CPU.round_seconds(float(k), k > 0) for k, t in enumerate(tokens)]
    assert pol.rates() == pytest.approx(want, rel=1e-6)


def test_offer_rate_lowers_expected_verify_cost():
    est = AcceptanceEstimate(2, decay=1.0, prior_weight=1e-9)
    est.update(2, 100, [50, 25], [50, 25])  # half the rows get a draft; when they do it is right
    assert est.offer_probs() == pytest.approx([0.5, 0.25], abs=1e-6)
    assert est.accept_probs() == pytest.approx([0.5, 0.5], abs=1e-6)


@pytest.mark.parametrize("cost, alpha, lo, hi", [
    (FLAT, 0.9, 8, 16),  # cheap verification, good drafts: draft long
    (CPU, 0.9, 3, 9),  # CPU curve: moderate
    (CPU, 0.3, 0, 1),  # poor drafts on a CPU: (almost) stop drafting
    (LINEAR, 0.9, 0, 0),  # verification as dear as decoding: never worth it
])
def test_settles_on_a_sensible_length(cost, alpha, lo, hi):
    pol = AutoDraftLength(cost, max_k=16)
    _, ks, _ = drive(pol, 300, iid(alpha))
    late = sorted(ks[-100:])
    assert lo <= late[len(late) // 2] <= hi, late


def test_shorter_drafts_when_verification_costs_more():
    _, flat_ks, _ = drive(AutoDraftLength(FLAT), 300, iid(0.8), seed=1)
    _, cpu_ks, _ = drive(AutoDraftLength(CPU), 300, iid(0.8), seed=1)
    assert sum(cpu_ks[-100:]) < sum(flat_ks[-100:])


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.85, 0.95])
def test_auto_close_to_best_fixed_length_under_iid_acceptance(alpha):
    def rate(policy_factory, seeds=range(3)):
        tok = sec = 0.0
        for s in seeds:
            st, _, secs = drive(policy_factory(), 400, iid(alpha), seed=s)
            tok += st.new_tokens
            sec += secs
        return tok / sec

    class Fixed:
        cost = CPU

        def __init__(self, k):
            self.k = k

        def __call__(self, stats):
            return self.k

    best = max(rate(lambda k=k: Fixed(k)) for k in range(0, 17))
    assert rate(lambda: AutoDraftLength(CPU)) >= 0.93 * best


def test_stops_drafting_when_acceptance_collapses_and_probes_back():
    pol = AutoDraftLength(CPU)
    stats, ks, _ = drive(pol, 60, iid(0.95), seed=2)
    assert sum(ks[-20:]) / 20 >= 3  # good phase: real drafts
    stats, ks, _ = drive(pol, 150, lambda j, rng: False, stats=stats)  # collapse: nothing accepted
    assert ks[-50:].count(0) >= 40  # mostly plain decoding
    stats, ks, _ = drive(pol, 60, iid(0.95), seed=3, stats=stats)  # drafts become good again
    assert sum(ks[-20:]) / 20 >= 3  # found by probing


def test_rows_without_drafts_are_not_counted_as_rejections():
    # an n-gram drafter that only sometimes has a match, but is right when it has one
    pol = AutoDraftLength(CPU)
    _, ks, _ = drive(pol, 200, lambda j, rng: True, offered=3)
    assert sorted(ks[-50:])[25] >= 3


def test_new_generation_resets_the_round_bookkeeping():
    pol = AutoDraftLength(CPU)
    drive(pol, 20, iid(0.9))
    fresh = DecodeStats()
    k = pol(fresh)  # a new stats object: no delta against the old one is taken
    assert 0 <= k <= pol.max_k and pol._stats is fresh


def test_call_is_cheap():
    pol = AutoDraftLength(CPU, max_k=16)
    stats, _, _ = drive(pol, 50, iid(0.8))
    t0 = time.perf_counter()
    for _ in range(200):
        stats.target_forwards += 1
        stats.observe_round([1] * 4, 2, 3)
        pol(stats)
    per_call = (time.perf_counter() - t0) / 200
    assert per_call < 1e-3, per_call  # a SmolLM2 forward on CPU is ~30 ms


@pytest.mark.parametrize("kwargs, msg", [
    (dict(max_k=0), "max_k"),
    (dict(max_k=4, decay=0.0), "decay"),
    (dict(max_k=4, prior_accept=1.5), "prior_accept"),
    (dict(max_k=4, max_growth=0), "max_growth"),
])
def test_bad_estimate_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        AcceptanceEstimate(**kwargs)


def test_cost_model_too_short_for_auto():
    with pytest.raises(ValueError, match="auto needs >= 2"):
        AutoDraftLength(CostModel((0.01,)))
    assert AutoDraftLength(CostModel((0.01, 0.011, 0.012)), max_k=16).max_k == 2  # clamped to the curve


def test_auto_config_end_to_end_greedy_identical():
    model = tiny_llama(seed=3)
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "tiny-test-model"},
                            "proposer": {"type": "ngram", "num_draft_tokens": "auto", "max_ngram": 3}})
    rt = TorchRuntime(model)
    dec = SpeculativeDecoder.from_config(cfg, target=rt)
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5], [7, 3, 11, 4]):
        r = dec.generate(prompt, max_new_tokens=40)
        assert r.token_ids == plain_greedy(model, prompt, 40)
    assert cost_model_for(rt).max_positions >= 17  # measured once and cached on the runtime
    assert r.stats.target_forwards >= 1


# ---- one estimate per draft key (n-gram: matched suffix length) ---------------------------------
STEP = CostModel(tuple([0.010] + [0.017 + 0.0003 * n for n in range(2, 18)]))  # this CPU: N=2 ~1.7x N=1


def test_per_row_learns_a_length_per_key():
    """Key 3 rows always copy 8 tokens, key 1 rows never: under a cost curve where any draft costs
    ~1.7x, the policy must draft long for key 3 and nothing for key 1, in the same batch."""
    pol = AutoDraftLength(STEP, max_k=8)
    stats = DecodeStats()
    for _ in range(40):
        ks = pol.per_row(stats, [3, 1])
        acc = [min(ks[0], 8), 0]
        pol.observe_rows([3, 1], ks, ks, acc)
        stats.target_forwards += 1
    ks = pol.per_row(stats, [3, 1, 1])
    assert ks[0] >= 6 and ks[1] == 0 and ks[2] == 0
    assert pol.chosen[0] > 0 and sum(pol.chosen) == 40 * 2 + 3


def test_per_row_reprobes_a_key_after_it_stopped():
    pol = AutoDraftLength(STEP, max_k=8)
    stats = DecodeStats()
    for _ in range(10):  # key 2 fails while drafted
        (k,) = pol.per_row(stats, [2])
        pol.observe_rows([2], [k], [k], [0])
    assert pol.per_row(stats, [2]) == [0]
    probed = False
    for _ in range(200):  # while it does not draft, its evidence fades and a probe follows
        (k,) = pol.per_row(stats, [2])
        pol.observe_rows([2], [k], [k], [k])  # ... and the probe is accepted in full
        probed |= k > 0
    assert probed and pol.per_row(stats, [2])[0] >= 4


def test_growth_cap_bounds_the_jump_after_short_accepted_drafts():
    """One fully accepted 3-token draft must not license a 16-token one: with evidence up to
    position 3, positions past 3 + max_growth are priced as never accepted, so the draft grows
    by at most max_growth per round, and still reaches max_k while drafts keep being accepted."""
    est = AcceptanceEstimate(16, decay=0.9, prior_accept=0.6, chain_weight=3.0, max_growth=2)
    est.update(3, 1, [1, 1, 1], [1, 1, 1])
    p = est.accept_probs()
    assert all(x > 0.7 for x in p[:5]) and p[5:] == [0.0] * 11
    uncapped = AcceptanceEstimate(16, decay=0.9, prior_accept=0.6, chain_weight=3.0)
    uncapped.update(3, 1, [1, 1, 1], [1, 1, 1])
    assert min(uncapped.accept_probs()) > 0.7  # what the cap guards against: p borrowed to depth 16
    pol = AutoDraftLength(FLAT, max_k=16)  # verification free: only the cap holds drafts back
    stats = DecodeStats()
    ks = []
    for _ in range(12):
        (k,) = pol.per_row(stats, [9])
        ks.append(k)
        pol.observe_rows([9], [k], [k], [k])
    assert ks[0] <= 2 and all(b - a <= 2 for a, b in zip(ks, ks[1:])), ks
    assert ks[-1] == 16, ks


def test_ngram_draft_keys_are_matched_suffix_lengths_and_agreement():
    """key = 3 x matched suffix length + (0: seen once before, 1: its two previous occurrences
    went on with the same token, 2: with different ones)."""
    from spec_plugins.proposers.ngram import NgramProposer

    p = NgramProposer(NgramProposer.Config(max_ngram=3))
    seqs = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 6], [8, 9, 10],
            [7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1],  # (2, 7, 1) twice before, both followed by 2
            [7, 1, 2, 7, 1, 3, 7, 1, 4, 7, 1]]  # (7, 1) three times before: 3, then 4
    p.begin(seqs)
    assert p.draft_keys(seqs) == [9, 3, 0, 10, 8]
    seqs[3].append(2)  # the loop goes on: still agreeing, and incremental updates see it
    seqs[4] += [5, 7, 1]
    assert p.draft_keys(seqs) == [9, 3, 0, 10, 8]


def test_shadow_drafts_teach_a_key_without_verifying():
    """A key that does not pay under the prior never drafts, so only counterfactual evidence can
    show it copies perfectly: its free drafts, scored against the emitted tokens, must turn it on."""
    steep = CostModel(tuple(0.010 * (1 + 0.6 * (n - 1)) for n in range(1, 18)))  # llama.cpp-like curve
    pol = AutoDraftLength(steep, max_k=8)
    stats = DecodeStats()
    text = list(range(100, 140))
    seq = [1, 2]
    assert pol.per_row(stats, [3]) == [0]  # the prior alone does not pay on this curve
    ks = []
    for i, t in enumerate(text):
        (k,) = pol.per_row(stats, [3])
        ks.append(k)
        if k == 0:
            pol.shadow([3], [seq], [text[i:i + 8]])  # the free draft matches what follows
        pol.observe_rows([3], [k], [k], [k])  # a real draft is accepted in full too
        seq.append(t)
        stats.target_forwards += 1
    assert max(ks) >= 4, f"perfect counterfactual acceptance must make the key draft long, got {ks}"
    # ... and a key whose free drafts always miss stays off
    pol2 = AutoDraftLength(steep, max_k=8)
    seq = [1, 2]
    for t in text:
        assert pol2.per_row(stats, [1]) == [0]
        pol2.shadow([1], [seq], [[7, 7, 7, 7]])
        seq.append(t)


def test_shadow_drafts_are_scored_after_the_horizon_not_the_whole_draft():
    """A matching free draft of 12 tokens is scored once the row has emitted ``shadow_horizon``
    tokens (positions beyond it are cut from every shadow alike); a miss is scored at once."""
    steep = CostModel(tuple(0.010 * (1 + 0.6 * (n - 1)) for n in range(1, 18)))
    pol = AutoDraftLength(steep, max_k=16, shadow_horizon=4)
    stats = DecodeStats()
    seq = [1, 2]
    pol.per_row(stats, [3])
    pol.shadow([3], [seq], [list(range(100, 112))])
    for t in range(100, 104):
        pol.per_row(stats, [3])  # resolves shadows against what the row emitted so far
        assert len(pol._shadows) == 1 and pol.by_key[3].reach[0] == 0  # still waiting
        seq.append(t)
    pol.per_row(stats, [3])
    assert pol._shadows == []
    est = pol.by_key[3]
    assert [round(h, 6) for h in est.hits[:5]] == [1, 1, 1, 1, 0] and est.reach[4] == 0
    pol.shadow([3], [seq], [[7, 7, 7]])  # the next token is not 7: scored as a miss at position 0
    seq.append(104)
    pol.per_row(stats, [3])
    assert pol._shadows == []
    with pytest.raises(ValueError, match="shadow_horizon"):
        AutoDraftLength(steep, shadow_horizon=0)
