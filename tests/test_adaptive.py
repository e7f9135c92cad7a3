"""``num_draft_tokens: auto`` (``AutoDraftLength``): the expected-rate math, its choices under known
acceptance and cost, recovery after a collapse, per-key estimates, shadow drafts, the load-aware
behaviour over (rows, positions), and greedy equality end to end."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.policy import AutoDraftLength, Costs, DraftCost, ForwardCost
from spec_plugins.policy.sources import SourceGate
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.policy.acceptance import AcceptanceEstimate
from spec_plugins.policy.objective import best_option
from spec_plugins.types import BatchView, Draft, ProposeContext, Ranked, RankedRow, RoundRecord, RoundTimes, Shaped

FLAT = ForwardCost.from_curve([0.010] * 17)  # GPU-like: verifying 17 positions costs one forward
CPU = ForwardCost.from_curve([0.010 * (1 + 0.12 * (n - 1)) for n in range(1, 18)])  # 8 positions ~1.84x
LINEAR = ForwardCost.from_curve([0.010 * n for n in range(1, 18)])  # verification as dear as decoding
STEP = ForwardCost.from_curve([0.010] + [0.017 + 0.0003 * n for n in range(2, 18)])  # this CPU: N=2 ~1.7x N=1
STEEP = ForwardCost.from_curve([0.010 * (1 + 0.6 * (n - 1)) for n in range(1, 18)])  # llama.cpp-like


def record(budgets, drafted, accepted, keys=None, cost=None) -> RoundRecord:
    """A round as the batch reports it: each row drafted ``drafted[b]`` chain tokens and the
    verifier accepted ``accepted[b]``; the forward took what ``cost`` says (no overhead)."""
    B = len(budgets)
    draft = Draft.from_chains([[7] * d for d in drafted])
    n = 1 + max(drafted, default=0)
    fwd = cost(B, n) if cost is not None else 0.01
    return RoundRecord(list(range(B)), [[1, 2, 3]] * B, list(budgets), keys, draft,
                       [list(range(a)) for a in accepted], [[5] * (a + 1) for a in accepted], [], n,
                       times=RoundTimes(forward=fwd, total=fwd))


def drive(policy, rounds: int, accept, offered: int = 64, seed: int = 0, key: int | None = None, cost=None):
    """Play rounds like the batch does: choose -> k, draft min(k, offered) tokens, each position
    accepted while ``accept(j, rng)`` holds; returns (tokens, chosen ks, seconds modelled by
    ``cost``, default the policy's own costs)."""
    cost = cost if cost is not None else policy.costs
    rng = random.Random(seed)
    tokens, ks, seconds = 0, [], 0.0
    for _ in range(rounds):
        (k,) = policy.choose(BatchView([[1, 2, 3]], [10**6], None if key is None else [key]))
        ks.append(k)
        n = min(k, offered)
        a = 0
        while a < n and accept(a, rng):
            a += 1
        policy.observe(record([k], [n], [a], None if key is None else [key]))
        tokens += a + 1
        seconds += cost(1, 1 + n)
    return tokens, ks, seconds


def iid(alpha: float):
    return lambda j, rng: rng.random() < alpha


def test_rates_follow_expected_tokens_over_cost():
    est = AcceptanceEstimate(3, decay=1.0, prior_weight=1e-9)
    # 1000 rows reach position 0, 800 accept it; of those 400 accept position 1; 100 accept position 2
    est.update(3, 1000, [1000, 1000, 1000], [800, 400, 100])
    assert est.accept_probs() == pytest.approx([0.8, 0.5, 0.25], abs=1e-6)
    assert est.offer_probs() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    pol = AutoDraftLength(CPU, max_k=3)
    tokens = [1.0, 1.8, 2.2, 2.3]
    want = [t / CPU(1, 1 + k) for k, t in enumerate(tokens)]
    assert pol.rates(est) == pytest.approx(want, rel=1e-6)
    # a batch of 4 rows emits 4x the tokens over a forward priced for 4 rows
    rows4 = ForwardCost({(b, n): 0.01 * b * (1 + 0.1 * (n - 1)) for b in (1, 4) for n in range(1, 5)})
    pol4 = AutoDraftLength(rows4, max_k=3)
    assert pol4.rates(est, rows=4) == pytest.approx([4 * t / rows4(4, 1 + k) for k, t in enumerate(tokens)])


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
    _, ks, _ = drive(AutoDraftLength(cost, max_k=16), 300, iid(alpha))
    late = sorted(ks[-100:])
    assert lo <= late[len(late) // 2] <= hi, late


def test_shorter_drafts_when_verification_costs_more():
    _, flat_ks, _ = drive(AutoDraftLength(FLAT), 300, iid(0.8), seed=1)
    _, cpu_ks, _ = drive(AutoDraftLength(CPU), 300, iid(0.8), seed=1)
    assert sum(cpu_ks[-100:]) < sum(flat_ks[-100:])


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.85, 0.95])
def test_auto_close_to_best_fixed_length_under_iid_acceptance(alpha):
    from spec_plugins.policy import FixedLength

    def rate(policy_factory, seeds=range(3)):
        tok = sec = 0.0
        for s in seeds:
            t, _, secs = drive(policy_factory(), 400, iid(alpha), seed=s, cost=CPU)
            tok, sec = tok + t, sec + secs
        return tok / sec

    best = max(rate(lambda k=k: FixedLength(k)) for k in range(0, 17))
    assert rate(lambda: AutoDraftLength(CPU)) >= 0.93 * best


def test_stops_drafting_when_acceptance_collapses_and_probes_back():
    pol = AutoDraftLength(CPU)
    _, ks, _ = drive(pol, 60, iid(0.95), seed=2)
    assert sum(ks[-20:]) / 20 >= 3  # good phase: real drafts
    _, ks, _ = drive(pol, 150, lambda j, rng: False)  # collapse: nothing accepted
    assert ks[-50:].count(0) >= 40  # mostly plain decoding
    _, ks, _ = drive(pol, 60, iid(0.95), seed=3)  # drafts become good again
    assert sum(ks[-20:]) / 20 >= 3  # found by probing


def test_rows_without_drafts_are_not_counted_as_rejections():
    # an n-gram drafter that only sometimes has a match, but is right when it has one
    _, ks, _ = drive(AutoDraftLength(CPU), 200, lambda j, rng: True, offered=3)
    assert sorted(ks[-50:])[25] >= 3


def test_choose_prices_each_length_once_per_round():
    """The policy's work per round is O(max_k): one cost-model evaluation per draft length."""
    calls = []

    class Counting(Costs):
        def __call__(self, b, n):
            calls.append((b, n))
            return super().__call__(b, n)

    pol = AutoDraftLength(Counting(CPU), max_k=16)
    drive(pol, 20, iid(0.8))
    calls.clear()
    pol.choose(BatchView([[1, 2, 3]] * 4, [99] * 4, [3, 3, 6, 9]))  # three distinct keys, four rows
    assert len(calls) == 17 and {b for b, _ in calls} == {4}


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
        AutoDraftLength(ForwardCost.from_curve([0.01]))
    assert AutoDraftLength(ForwardCost.from_curve([0.01, 0.011, 0.012]), max_k=16).max_k == 2  # clamped
    with pytest.raises(ValueError, match="min_gain"):
        AutoDraftLength(CPU, min_gain=0.5)


def test_auto_config_end_to_end_greedy_identical():
    model = tiny_llama(seed=3)
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "tiny-test-model"},
                            "proposer": {"type": "ngram", "num_draft_tokens": "auto", "max_ngram": 3}})
    rt = TorchRuntime(model)
    dec = SpeculativeDecoder.from_config(cfg, target=rt)
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5], [7, 3, 11, 4]):
        r = dec.generate(prompt, max_new_tokens=40)
        assert r.token_ids == plain_greedy(model, prompt, 40)
    assert dec.costs.max_positions >= 17  # measured once, at setup, and kept by the decoder
    assert r.stats.target_forwards >= 1


# ---- one estimate per draft key (n-gram: matched suffix length) ---------------------------------
def test_each_key_learns_its_own_length():
    """Key 3 rows always copy 8 tokens, key 1 rows never: under a cost curve where any draft costs
    ~1.7x, key 3 alone drafts long, key 1 alone drafts nothing, and in one batch the strong row
    carries the padded verify (every row pays for it anyway)."""
    pol = AutoDraftLength(STEP, max_k=8)
    for _ in range(40):
        for key, acc in ((3, 8), (1, 0)):
            (k,) = pol.choose(BatchView([[1]], [99], [key]))
            pol.observe(record([k], [k], [min(k, acc)], [key]))
    assert pol.choose(BatchView([[1]], [99], [3]))[0] >= 6
    assert pol.choose(BatchView([[1]], [99], [1])) == [0]
    assert min(pol.choose(BatchView([[1]] * 2, [99] * 2, [3, 1]))) >= 6
    assert pol.choose(BatchView([[1]] * 2, [99] * 2, [1, 1])) == [0, 0]


def test_a_batch_teaches_a_key_the_same_in_any_row_order_as_the_unkeyed_estimate():
    """16 rows of one key, 8 accepting every drafted token and 8 none: the key's evidence fades
    once per round, then each row adds its counts, so the rows' order in the batch does not
    matter and the counts equal the unkeyed estimate's under the same parameters. (Before: each
    row faded the key's evidence again, so the rows last in the batch decided it.)"""
    same = {"decay": 0.8, "prior_accept": 0.5, "prior_weight": 1.0, "idle_decay": 0.97, "chain_weight": 3.0,
            "max_growth": None}
    good = [True] * 8 + [False] * 8
    counts = []
    for rows in (good, good[::-1], good[::2] + good[1::2]):
        keyed, plain = AutoDraftLength(CPU, max_k=8, keyed=same), AutoDraftLength(CPU, max_k=8)
        for k in (4, 4, 2, 0, 4):
            acc = [k if g else 0 for g in rows]
            keyed.observe(record([k] * 16, [k] * 16, acc, [9] * 16))
            plain.observe(record([k] * 16, [k] * 16, acc))
        est, ref = keyed.by_key[9], plain.estimate
        got = est.reach + est.hits + est.offer_trials + est.offered
        assert got == pytest.approx(ref.reach + ref.hits + ref.offer_trials + ref.offered)
        assert est.hits[0] / est.reach[0] == pytest.approx(0.5)
        counts.append(got)
    assert counts[1] == pytest.approx(counts[0]) and counts[2] == pytest.approx(counts[0])


def test_shadows_resolved_together_fade_their_key_once():
    """Shadows of one round's rows, resolved in one ``choose``, fade their key once: four rows of
    which two would have been accepted give p_0 = 1/2 whichever rows come first."""
    estimates = []
    for order in ([1, 1, 0, 0], [0, 0, 1, 1]):
        pol = AutoDraftLength(STEEP, max_k=8, shadow_horizon=1)
        seqs = [[1, 2] for _ in order]
        pol.choose(BatchView(seqs, [99] * 4, [3] * 4, lambda rows, k: [[50]] * len(rows)))
        for seq, hit in zip(seqs, order):
            seq.append(50 if hit else 51)
        pol.choose(BatchView(seqs, [99] * 4, [3] * 4))  # resolves the four shadows
        est = pol.by_key[3]
        assert (est.reach[0], est.hits[0]) == pytest.approx((4.0, 2.0))
        estimates.append(est.accept_probs())
    assert estimates[0] == pytest.approx(estimates[1])


def test_a_key_is_reprobed_after_it_stopped():
    pol = AutoDraftLength(STEP, max_k=8)
    for _ in range(10):  # key 2 fails while drafted
        (k,) = pol.choose(BatchView([[1]], [99], [2]))
        pol.observe(record([k], [k], [0], [2]))
    assert pol.choose(BatchView([[1]], [99], [2])) == [0]
    probed = False
    for _ in range(200):  # while it does not draft, its evidence fades and a probe follows
        (k,) = pol.choose(BatchView([[1]], [99], [2]))
        pol.observe(record([k], [k], [k], [2]))  # ... and the probe is accepted in full
        probed |= k > 0
    assert probed and pol.choose(BatchView([[1]], [99], [2]))[0] >= 4


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
    ks = []
    for _ in range(12):
        (k,) = pol.choose(BatchView([[1]], [99], [9]))
        ks.append(k)
        pol.observe(record([k], [k], [k], [9]))
    assert ks[0] <= 2 and all(b - a <= 2 for a, b in zip(ks, ks[1:])), ks
    assert ks[-1] == 16, ks


def test_draft_less_as_the_batch_grows_down_to_none():
    """The load-aware behaviour is the same formula at a larger batch: where a wide forward over
    16 rows costs ~2x a narrow one, a key that pays alone stops drafting at 16 rows."""
    table = {(b, n): 0.01 * (1 + (0.02 if b == 1 else 1.5) * (n - 1)) * (1 if b == 1 else b / 4)
             for b in (1, 16) for n in range(1, 10)}
    pol = AutoDraftLength(ForwardCost(table), max_k=8)
    for _ in range(30):
        (k,) = pol.choose(BatchView([[1]], [99], [3]))
        pol.observe(record([k], [k], [min(k, 2)], [3], pol.costs))  # two of every draft accepted
    assert pol.choose(BatchView([[1]], [99], [3]))[0] >= 2
    assert pol.choose(BatchView([[1]] * 16, [99] * 16, [3] * 16)) == [0] * 16
    assert pol.preview(1) >= 2 and pol.preview(16) == 0


def test_ngram_draft_keys_are_matched_suffix_lengths_and_agreement():
    """key = 3 x matched suffix length + (0: seen once before, 1: its two previous occurrences
    went on with the same token, 2: with different ones)."""
    from spec_plugins.proposers.ngram import NgramProposer

    p = NgramProposer(NgramProposer.Config(max_ngram=3))
    seqs = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 6], [8, 9, 10],
            [7, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1],  # (2, 7, 1) twice before, both followed by 2
            [7, 1, 2, 7, 1, 3, 7, 1, 4, 7, 1]]  # (7, 1) three times before: 3, then 4
    p.admit(seqs)
    assert p.draft_keys(seqs) == [9, 3, 0, 10, 8]
    seqs[3].append(2)  # the loop goes on: still agreeing, and incremental updates see it
    seqs[4] += [5, 7, 1]
    assert p.draft_keys(seqs) == [9, 3, 0, 10, 8]


def test_shadow_drafts_teach_a_key_without_verifying():
    """A key that does not pay under the prior never drafts, so only counterfactual evidence can
    show it copies perfectly: its free drafts, scored against the emitted tokens, must turn it on."""
    pol = AutoDraftLength(STEEP, max_k=8)
    text = list(range(100, 140))
    seq = [1, 2]
    assert pol.choose(BatchView([seq], [99], [3])) == [0]  # the prior alone does not pay on this curve
    ks = []
    for i, t in enumerate(text):
        (k,) = pol.choose(BatchView([seq], [99], [3], lambda rows, k, i=i: [text[i:i + 8]]))
        ks.append(k)
        pol.observe(record([k], [k], [k], [3]))  # a real draft is accepted in full too
        seq.append(t)
    assert max(ks) >= 4, f"perfect counterfactual acceptance must make the key draft long, got {ks}"
    pol2 = AutoDraftLength(STEEP, max_k=8)  # ... and a key whose free drafts always miss stays off
    seq = [1, 2]
    for t in text:
        assert pol2.choose(BatchView([seq], [99], [1], lambda rows, k: [[7, 7, 7, 7]])) == [0]
        pol2.observe(record([0], [0], [0], [1]))
        seq.append(t)


def test_shadow_drafts_are_scored_after_the_horizon_not_the_whole_draft():
    """A matching free draft of 12 tokens is scored once the row has emitted ``shadow_horizon``
    tokens (positions beyond it are cut from every shadow alike); a miss is scored at once."""
    pol = AutoDraftLength(STEEP, max_k=16, shadow_horizon=4)
    seq = [1, 2]
    assert pol.choose(BatchView([seq], [99], [3], lambda rows, k: [list(range(100, 112))])) == [0]
    for t in range(100, 104):
        pol.choose(BatchView([seq], [99], [3]))  # resolves shadows against what the row emitted so far
        assert len(pol._shadows) == 1 and pol.by_key[3].reach[0] == 0  # still waiting
        seq.append(t)
    pol.choose(BatchView([seq], [99], [3]))
    assert pol._shadows == []
    est = pol.by_key[3]
    assert [round(h, 6) for h in est.hits[:5]] == [1, 1, 1, 1, 0] and est.reach[4] == 0
    pol._shadow([3], [seq], [[7, 7, 7]])  # the next token is not 7: scored as a miss at position 0
    seq.append(104)
    pol.choose(BatchView([seq], [99], [3]))
    assert pol._shadows == []
    with pytest.raises(ValueError, match="shadow_horizon"):
        AutoDraftLength(STEEP, shadow_horizon=0)


def test_positions_past_a_real_draft_are_learnt_from_its_shadow_not_by_drafting_them():
    """A key whose first drafted token is always right and whose later ones never are: drafting one
    position pays on a steep (llama.cpp-like) curve, drafting three does not. Positions past the
    real draft are scored for free against what the row emits (a tail shadow), so the policy must
    learn that the second position is never accepted without paying a wide verify to find out.
    (Before: deeper positions borrowed the first one's estimate, and drafts grew to 3 positions
    and kept being retried: the math prompt on llama.cpp lost to plain decoding that way.)"""
    costs = Costs(ForwardCost.from_curve([1.0, 1.4, 1.93, 2.17, 2.72, 2.91, 3.42, 3.61, 4.28]), frozen=True)
    pol = AutoDraftLength(costs, max_k=8, min_gain=1.05)
    text = list(range(100, 400))
    seq, i, ks = [1, 2], 0, []
    while i < 250:
        free = lambda rows, k, i=i: [[text[i]] + [7] * (k - 1)]  # noqa: E731
        (k,) = pol.choose(BatchView([seq], [99], [3], free))
        ks.append(k)
        a = min(k, 1)  # only the first position is ever accepted
        pol.observe(record([k], [k], [a], [3]))
        seq += text[i: i + a + 1]  # the accepted token and the target's own next one
        i += a + 1
    wide = sum(k > 1 for k in ks)
    assert ks.count(1) > 0.8 * len(ks), f"one position pays here and must be drafted, got {ks}"
    assert wide <= 2, f"{wide} rounds drafted past the first position, never accepted: {ks}"


def test_a_steep_cost_curve_does_not_lock_auto_out_of_drafting():
    # under STEEP the prior (p = 0.5) never pays for a draft: only a probe round can show that
    # this drafter is always right; without probes auto stays at k = 0 for good
    pol = AutoDraftLength(STEEP, min_gain=1.05)
    _, ks, _ = drive(pol, 200, lambda j, rng: True)
    assert ks[:15] == [0] * 15 and pol.probes >= 1
    assert sum(k > 0 for k in ks[-50:]) >= 45  # found, then drafted every round


def test_probes_that_find_nothing_back_off():
    pol = AutoDraftLength(STEEP, min_gain=1.05)
    _, ks, _ = drive(pol, 500, lambda j, rng: False)
    assert 3 <= pol.probes <= 5  # gaps 16, 32, 64, 128, 256 (not one probe every 16 rounds: 31)
    assert sum(ks) == pol.probes  # each probe one position


def test_a_row_is_counted_up_to_its_own_budget():
    # two rows drafting every token right; row 1's budget is 2 (its room): it neither reached nor
    # rejected position 3 and on, so it must not lower their estimate
    pol = AutoDraftLength(Costs(FLAT, frozen=True), max_k=8)
    pol.observe(record([8, 2], [8, 2], [8, 2]))
    est = pol.estimate
    assert est.reach[:3] == [2.0, 2.0, 1.0] and est.hits[:3] == [2.0, 2.0, 1.0]
    assert est.offer_trials[2] == 1.0


class _Child:
    """A composition's child offering one node with acceptance estimate ``est``."""

    def __init__(self, est: float) -> None:
        self.est, self.calls = est, 0
        self.config = SimpleNamespace(num_draft_tokens=16)

    def propose(self, ctx):
        self.calls += 1
        return Ranked([[RankedRow([1], [(0,)], [self.est])] for _ in ctx.sequences], True)


def test_the_gate_counts_the_round_overhead_on_both_sides():
    # flat 10 ms forwards, 10 ms overhead a round: the free child's draft in hand is worth
    # 1.5 / 20 ms = 75 tok/s, the dear child's prospect 2 / 22 ms = 91: the dear one pays. Priced
    # without the overhead, the one in hand looks like 150 and the dear child is skipped.
    costs = Costs(ForwardCost.from_curve([0.010] * 17), frozen=True)
    costs.overhead = 0.010
    cheap, dear = _Child(0.5), _Child(1.0)
    costs.set_drafter(cheap, DraftCost(0.0, 0.0))
    costs.set_drafter(dear, DraftCost(0.002, 0.0))
    gate = SourceGate([cheap, dear], TreeSizer(costs), costs, gated=True, probe_every=1000)
    gate.stats[1].expected, gate.stats[1].nodes = 1.0, 1.0
    gate.draft(ProposeContext([[1, 2, 3]], [4], None))  # round 0: every child probed
    gate.draft(ProposeContext([[1, 2, 3]], [4], None))
    assert dear.calls == 2 and gate.skipped[1] == 0


def _objective_keeps(costs: Costs, expected: float, positions: int, min_gain: float = 1.0) -> bool:
    """The reference: one row, no draft vs a draft of ``positions`` nodes, by the one objective
    with the round's overhead on both sides (as ``AutoDraftLength._best`` prices them)."""
    options = [(1.0, costs(1, 1) + costs.overhead), (1.0 + expected, costs(1, 1 + positions) + costs.overhead)]
    return best_option(options, min_gain) == 1


def test_the_sizer_counts_the_round_overhead_and_the_policy_margin():
    """10 ms one position, 15 ms two, 10 ms overhead a round: one node accepted with p = 0.45 is
    worth 1.45 / 25 ms = 58 tok/s against plain's 1 / 20 ms = 50, so it is kept, by the batch cut,
    by a shaped draft's cut and by the length policy alike; without the overhead (1 / 10 ms = 100
    against 1.45 / 15 ms = 97) it looked a loss. A draft that gains 2 % is cut under a 5 % margin."""
    costs = Costs(ForwardCost.from_curve([0.010, 0.015, 0.016]), frozen=True)
    costs.overhead = 0.010
    assert _objective_keeps(costs, 0.45, 1)
    sizer = TreeSizer(costs)
    assert sizer.cut([RankedRow([7], [(0,)], [0.45])]) == [1]
    chain = Draft.from_chains([[7]])
    assert sizer.size(Ranked([[]], True, [Shaped(chain, (0.45,))])) is not None  # the shaped draft's slot kept
    length = AutoDraftLength(costs, max_k=2, prior_accept=0.45)
    assert length.choose(BatchView([[1]], [99]))[0] > 0  # the length policy agrees
    margin = Costs(ForwardCost.from_curve([0.010, 0.0102, 0.011]), frozen=True)  # one node gains 2 %
    row = RankedRow([7], [(0,)], [0.04])
    assert _objective_keeps(margin, 0.04, 1) and not _objective_keeps(margin, 0.04, 1, 1.05)
    assert TreeSizer(margin).cut([row]) == [1]
    assert TreeSizer(margin, min_gain=1.05).cut([row]) == [0]
    assert TreeSizer(margin, min_gain=1.05).size(Ranked([[]], True, [Shaped(chain, (0.04,))])) is None
    with pytest.raises(ValueError, match="min_gain"):
        TreeSizer(margin, min_gain=0.9)
    # the policy a decoder builds holds its trees to the same margin as its lengths (DEFAULTS)
    from spec_plugins.policy.cost import DraftCost
    from spec_plugins.policy.draft_policy import DEFAULTS, build_policy
    from spec_plugins.proposers.suffix import SuffixProposer

    suffix = SuffixProposer(SuffixProposer.Config(num_draft_tokens="auto", tree_nodes="auto"))
    margin.set_drafter(suffix, DraftCost())  # drafting free: only the margin decides
    policy = build_policy(suffix.config, suffix, margin, TreeSizer())
    assert policy.sizer.min_gain == DEFAULTS.min_gain > 1.0
    assert policy.size(Ranked([[row]], True)) is None


def test_the_sizer_picks_a_rows_alternative_with_the_round_overhead():
    """Two drafters' alternatives for one row: 1 node worth 0.3 (1.3 / 12 ms = 108 tok/s) or 4 nodes
    worth 1.1 (2.1 / 20 ms = 105). The round's 10 ms overhead makes the wider one pay better
    (2.1 / 30 ms = 70 against 1.3 / 22 ms = 59), as the sources' gate prices it."""
    curve = ForwardCost.from_curve([0.010, 0.012, 0.014, 0.017, 0.020])
    alternatives = [RankedRow([7], [(0,)], [0.3], 0), RankedRow([7] * 4, [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
                                                                [0.5, 0.3, 0.2, 0.1], 1)]
    picked = []
    for overhead in (0.0, 0.010):
        costs = Costs(curve, frozen=True)
        costs.overhead = overhead
        sizer = TreeSizer(costs)
        sizer.size(Ranked([alternatives], auto=False))
        picked.append(sizer.picked)
    assert picked == [{0: 1}, {1: 1}]
