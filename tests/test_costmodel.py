"""The forward-cost model over (rows, positions): interpolation, measurement through the Runtime
contract, the draft cost, the per-runtime cache and the online correction."""

from __future__ import annotations

import random

import pytest
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.policy import AutoDraftLength, Costs, DraftPolicy, FixedLength, ForwardCost, OnlineCost
from spec_plugins.policy.cost import DraftCost, measure, measure_draft
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.base import Proposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.types import BatchView, Draft, RoundRecord, RoundTimes


def test_one_row_curve_interpolates_and_extrapolates():
    cm = ForwardCost.from_curve([1.0, 1.5, 2.0, 3.0])
    assert cm(1, 1) == 1.0 and cm(1, 4) == 3.0
    assert cm(1, 2.5) == pytest.approx(1.75)
    assert cm(1, 6) == pytest.approx(3.0 + 2 * (2.0 / 3))  # the curve's average slope beyond it
    assert cm.relative() == [1.0, 1.5, 2.0, 3.0] and cm.max_positions == 4
    assert cm(16, 3) == cm(1, 3)  # measured for one row only: every batch priced as one row
    assert DraftCost(0.001, 0.002)(1.0) == pytest.approx(0.003)


def test_grid_interpolates_rows_and_positions():
    table = {(1, 1): 1.0, (1, 2): 2.0, (4, 1): 2.0, (4, 2): 6.0, (4, 3): 7.0}
    cm = ForwardCost(table)
    assert cm(4, 2) == 6.0 and cm(2, 1) == pytest.approx(1 + 1 / 3)
    assert cm(2.5, 2) == pytest.approx(4.0)  # halfway between rows 1 and 4 at 2 positions
    assert cm(8, 1) == pytest.approx(2.0 + 1 / 3 * 4)  # linear past the largest row count
    assert cm.max_positions == 2  # widths every row count has


def test_a_falling_curve_is_never_priced_below_its_last_point_past_its_range():
    """A noisy curve whose last width read cheaper than its first was extrapolated with that
    negative slope: wider forwards ever cheaper, then free, then negative, in widths and in rows.
    Past the measured range the cost is non-decreasing and never below the last measured value."""
    cm = ForwardCost.from_curve([0.0100] + [0.0101] * 31 + [0.0095])
    far = [cm(1, n) for n in (33, 100, 500, 1000, 2000)]
    assert all(t >= 0.0095 and t > 0 for t in far) and far == sorted(far)
    assert Costs(cm)(1, 2000) >= 0.0095
    grid = ForwardCost({(1, 1): 0.010, (1, 2): 0.011, (4, 1): 0.009, (4, 2): 0.0105})  # 4 rows read cheaper
    rows = [grid(b, 1) for b in (4, 8, 64, 200)]
    assert all(t >= 0.009 for t in rows) and rows == sorted(rows)


def test_the_tree_sizer_prices_widths_past_the_curve_as_a_curve_measured_flat_there():
    """On 8 rows, the union of the trees reaches 257 positions, far past the 33 measured: the cut
    must be the one a curve measured flat out to every such width gives (before: a 169-wide forward
    priced near free, or a ZeroDivisionError where the price reached exactly 0)."""
    from spec_plugins.policy.tree_size import TreeSizer
    from spec_plugins.types import RankedRow

    curve = [0.010] * 32 + [0.0081]  # T(8, 1..33): flat, the last sample read low
    measured = ForwardCost({(8, n + 1): t for n, t in enumerate(curve)})
    flat = ForwardCost({(8, n + 1): curve[min(n, 32)] for n in range(8 * 32 + 1)})  # the reference
    rows = [RankedRow(list(range(32)), [(b, i) for i in range(32)], [0.02] * 32) for b in range(8)]
    keep = TreeSizer(costs=Costs(measured, frozen=True), min_gain=1.05).cut(rows)
    assert keep == TreeSizer(costs=Costs(flat, frozen=True), min_gain=1.05).cut(rows)
    zero = ForwardCost({(1, 1): 0.010, (1, 2): 0.005})  # extrapolated to exactly 0 at width 3
    row = [RankedRow(list(range(4)), [(0, i) for i in range(4)], [0.5] * 4)]
    assert TreeSizer(costs=Costs(zero, frozen=True)).cut(row) == [4]  # no ZeroDivisionError


@pytest.mark.parametrize("bad", [{}, {(1, 1): 0.0}, {(0, 1): 1.0}, {(1, 1): -1.0}])
def test_cost_model_rejects_bad_timings(bad):
    with pytest.raises(ValueError, match="forward-cost model|positive seconds"):
        ForwardCost(bad)


def test_cost_model_rejects_fractional_forward_below_one():
    with pytest.raises(ValueError, match="at least 1 row and 1 position"):
        ForwardCost.from_curve([1.0, 2.0])(1, 0.5)


def test_measure_through_runtime_contract_leaves_runtime_usable():
    model = tiny_llama(seed=3)
    rt = TorchRuntime(model)
    cm = measure(rt, rows=(1, 3), widths=range(1, 7), context=16, repeats=2)
    assert cm.max_positions == 6 and cm.rows == [1, 3] and len(cm.table) == 12
    assert all(t > 0 for t in cm.table.values())
    assert cm.context == 16 and cm.runtime == "torch" and cm.to_dict()["statistic"] == "min"
    assert rt.lengths() == []  # measured, then every row released
    # the runtime decodes correctly afterwards
    dec = SpeculativeDecoder(rt, NgramProposer(NgramProposer.Config()))
    prompt = [1, 2, 3, 1, 2, 3, 1]
    assert dec.generate(prompt, max_new_tokens=12).token_ids == plain_greedy(model, prompt, 12)


def test_measure_bad_arguments_are_named():
    rt = TorchRuntime(tiny_llama(seed=3, max_pos=64))
    with pytest.raises(ValueError, match="exceeds the runtime's 64"):
        measure(rt, widths=range(1, 33), context=40)
    with pytest.raises(ValueError, match="must be >= 1"):
        measure(rt, widths=[0, 1])


def test_costs_are_measured_at_setup_and_reused_when_they_cover_the_need():
    """One explicit Costs per runtime owner: reused while it covers the rows and widths a policy
    needs, re-measured (with the union of rows) when it does not, never measured by a policy."""
    from spec_plugins.policy import build_policy, setup_costs

    rt = TorchRuntime(tiny_llama(seed=3))
    ngram = NgramProposer(NgramProposer.Config())
    small = Costs.measure(rt, max_positions=4, context=8, repeats=1)
    assert small.covers((1,), 3) and not small.covers((1,), 6) and not small.covers((1, 2), 2)
    a = setup_costs(rt, ngram, ngram.config, costs=small, context=8)
    assert a is not small and a.max_positions == 17 and a.forward.base.rows == [1]  # auto needs 17 widths
    assert setup_costs(rt, ngram, ngram.config, costs=a) is a  # covered: reused
    b = setup_costs(rt, ngram, ngram.config, rows=(1, 2), costs=a, context=8)
    assert b.forward.base.rows == [1, 2]  # more rows: re-measured with the union
    fixed = ngram.config.model_copy(update={"num_draft_tokens": 3})
    assert setup_costs(rt, ngram, fixed) is None  # a fixed length sizes nothing by cost
    with pytest.raises(ValueError, match="measured costs"):
        build_policy(ngram.config, ngram, None)  # auto without costs is refused, not measured lazily
    with pytest.raises(ValueError, match="no measured drafting cost"):
        build_policy(ngram.config, NgramProposer(NgramProposer.Config()), b)  # another drafter: not measured


def test_draft_cost_counts_forwards_of_a_model_drafter_and_none_of_a_model_free_one():
    """Deterministic: a draft-model proposer runs one forward per drafted token, n-gram none."""
    pipe = LogitsPipeline(SamplingConfig())
    target = TorchRuntime(tiny_llama(seed=3))
    draft_rt = TorchRuntime(tiny_llama(seed=4, layers=4))
    calls = []
    inner = draft_rt.forward
    draft_rt.forward = lambda *a, **k: calls.append(a[0].shape) or inner(*a, **k)  # type: ignore[method-assign]
    draft = DraftModelProposer(None, target=target, runtime=draft_rt)
    cost = measure_draft(draft, pipe, target, context=32, k=6)
    # per measured call: one catch-up feed plus k-1 one-token steps (the last token needs none)
    steps = [s for s in calls if s[1] == 1]
    assert len(steps) >= 5 * (6 - 1)
    # a drafted token is a draft-model forward: it costs time, and more than a lookup's whole call
    ngram = measure_draft(NgramProposer(NgramProposer.Config()), pipe, target, context=32)
    assert cost.per_token > ngram.per_call > 0
    costs = Costs.measure(target, max_positions=2, context=8, repeats=1)
    assert costs.measure_drafter(draft, target, pipe) is costs.measure_drafter(draft, target, pipe)  # once
    with pytest.raises(ValueError, match="k must be >= 2"):
        measure_draft(draft, pipe, target, k=1)


def test_online_cost_learns_per_width_and_interpolates_unseen_widths():
    oc = OnlineCost(ForwardCost.from_curve([1.0, 2.0, 3.0, 4.0, 5.0]), prior_weight=1.0, decay=1.0)
    assert [oc(1, n) for n in (1, 2, 3, 4, 5)] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])  # as measured
    for _ in range(50):
        oc.observe(1, 4, 2.0)  # width 4 costs half what the model says
    assert oc(1, 4) == pytest.approx(2.0, rel=0.03)
    assert oc.ratio(5) == pytest.approx(0.5)  # seen on one side only: that side's observed mean
    for _ in range(50):
        oc.observe(1, 1, 1.0)  # width 1 as measured
    assert oc.ratio(2) == pytest.approx(1.0 - 0.5 / 3)  # between widths 1 (ratio 1) and 4 (0.5)
    assert oc(1, 3.5) == pytest.approx(0.5 * (oc(1, 3) + oc(1, 4)))
    before = oc.ratio(1)
    oc.observe(1, 9, 1.0)  # beyond the model, and
    oc.observe(1, 1, 0.0)  # a clock glitch: ignored
    assert oc.ratio(1) == before
    with pytest.raises(ValueError, match="prior_weight"):
        OnlineCost(ForwardCost.from_curve([1.0]), prior_weight=0.0)


def test_online_ratio_is_shared_by_every_row_count():
    grid = ForwardCost({(b, n): 0.01 * b * n for b in (1, 4) for n in (1, 2, 3)})
    oc = OnlineCost(grid, decay=1.0)
    for _ in range(40):
        oc.observe(4, 2, 2 * grid(4, 2))  # 4-row forwards of width 2 take twice the grid
    assert oc(1, 2) == pytest.approx(2 * grid(1, 2), rel=0.05)  # the 1-row price follows


def test_auto_shortens_drafts_when_the_loop_measures_expensive_forwards():
    """A flat load-time curve says drafting is free; the forwards the round times say each extra
    position costs 0.9x a single one. Online, auto must come down to short drafts; offline it
    keeps drafting the maximum. (Rounds where the proposer finds nothing time width 1.)"""
    flat = ForwardCost.from_curve([0.010] * 9)

    def run(online: bool) -> list[int]:
        rng, ks = random.Random(0), []
        pol = DraftPolicy(AutoDraftLength(Costs(flat, frozen=not online), max_k=8))  # its costs learn online
        for i in range(120):
            (k,) = pol.choose(BatchView([[1, 2]], [99]))
            ks.append(k)
            d = k if i % 3 else 0  # every third round the proposer finds nothing: a 1-position forward
            acc = 0
            while acc < d and rng.random() < 0.6:
                acc += 1
            t = 0.010 * (1 + 0.9 * d)
            draft = Draft.from_chains([[7] * d])
            pol.observe(RoundRecord([0], [[1, 2]], [k], None, draft, [list(range(acc))], [[5] * (acc + 1)], [],
                                    1 + d, times=RoundTimes(forward=t, total=t)))
        return ks

    assert min(run(False)[-40:]) >= 7
    late = run(True)[-60:]
    assert max(late) <= 1, late


class _Tree(Proposer):
    """A tree drafter offering the same 16 candidates every round, best-first (the policy's input)."""

    tree = True
    ranks = True

    def __init__(self, config):
        self.config, self.calls = config, 0

    def propose(self, ctx):
        from spec_plugins.types import Ranked, RankedRow

        self.calls += 1
        est = [0.9 ** (i + 1) for i in range(16)]
        return Ranked([[RankedRow(list(range(16)), [(0,) * (i + 1) for i in range(16)], est)]], auto=True)


def _rounds(policy, prop, n):
    from spec_plugins.proposers.base import ProposerTraits
    from spec_plugins.types import ProposeContext

    ctx = ProposeContext([[1, 2, 3]], [16], None)
    for _ in range(n):
        proposed = policy.draft(ProposerTraits.of(prop).sources, ctx)
        policy.size(proposed)


def test_a_single_source_over_a_cost_cut_tree_drafts_every_round_and_is_cut():
    """suffix/EAGLE with a fixed num_draft_tokens and tree_nodes: auto: the configured depth is
    drafted every round, whatever the drafter costs, and the tree sizer cuts it to what pays (no
    gate: a single source's skip evidence would be what the cut kept, which a stale calibration
    keeps small; gated, EAGLE tree auto sat out the math prompts after the qa ones)."""
    from spec_plugins.policy import build_policy
    from spec_plugins.policy.cost import DraftCost
    from spec_plugins.proposers.suffix import SuffixProposer

    config = SuffixProposer.Config(num_draft_tokens=16, tree_nodes="auto")
    view = BatchView([[1, 2, 3]], [99])
    flat = [0.01] * 33
    steep = [0.01 * (1 + 0.1 * n) for n in range(33)]
    for curve, draft in ((flat, DraftCost(per_call=0.001)), (flat, DraftCost(per_call=0.1)),
                         (steep, DraftCost(per_call=0.001))):
        prop = _Tree(config)
        costs = Costs(ForwardCost.from_curve(curve), frozen=True)
        costs.set_drafter(prop, draft)
        policy = build_policy(config, prop, costs)
        assert isinstance(policy.length, FixedLength) and policy.choose(view) == [16] and not policy.gated
        _rounds(policy, prop, 32)
        assert prop.calls == 32, (curve[:2], draft)


def test_a_hybrid_is_a_composition_whose_children_the_policy_prices():
    """A hybrid keeps its configured depth; the policy's gate prices each child, cheapest first,
    so a dear child drafts on probe rounds only while the cheap one drafts every round (gating
    the depth on the children's summed cost drafted nothing at all on the dev prompts: hybrid
    0.98x plain, 1.00 accepted per forward)."""
    from spec_plugins.policy import build_policy
    from spec_plugins.policy.cost import DraftCost
    from spec_plugins.proposers.hybrid import HybridProposer

    from spec_plugins.proposers.suffix import SuffixProposer

    cheap, dear = (_Tree(SuffixProposer.Config(num_draft_tokens=16, tree_nodes=8)) for _ in range(2))
    hyb = HybridProposer(HybridProposer.Config(num_draft_tokens=16, proposers=[
        {"type": "suffix", "tree_nodes": 8}, {"type": "suffix", "scope": "global", "tree_nodes": 8}]),
        children=[cheap, dear])
    costs = Costs(ForwardCost.from_curve([0.01] * 33), frozen=True)
    costs.set_drafter(hyb, DraftCost(per_call=0.1))  # dear in sum: ten forwards a round
    costs.set_drafter(cheap, DraftCost(per_call=0.0001))
    costs.set_drafter(dear, DraftCost(per_call=0.1))
    policy = build_policy(hyb.config, hyb, costs)
    assert policy.choose(BatchView([[1, 2, 3]], [99])) == [16] and policy.gated
    _rounds(policy, hyb, 32)
    assert cheap.calls == 32 and dear.calls == 2


@pytest.mark.parametrize("k,length", [("auto", "config"), (16, "load")])
def test_a_hybrids_depth_is_priced_at_its_cheapest_child_and_the_gate_owns_the_rest(k, length):
    """With the depth chosen by cost (``num_draft_tokens: auto``, the default; a server's ``load``
    policy), the length policy prices drafting at the cheapest child: the gate decides whether
    the dear one pays. Priced at the children's sum, the depth was 0 every round and the cheap
    child, which pays alone, was asked on probes only (2.7x its own target forwards)."""
    from spec_plugins.policy import build_policy
    from spec_plugins.policy.cost import DraftCost
    from spec_plugins.proposers.hybrid import HybridProposer
    from spec_plugins.proposers.suffix import SuffixProposer

    cheap, dear = (_Tree(SuffixProposer.Config(num_draft_tokens=k, tree_nodes=8)) for _ in range(2))
    hyb = HybridProposer(HybridProposer.Config(num_draft_tokens=k, proposers=[
        {"type": "suffix", "tree_nodes": 8}, {"type": "suffix", "scope": "global", "tree_nodes": 8}]),
        children=[cheap, dear])
    costs = Costs(ForwardCost.from_curve([0.01] * 33), frozen=True)  # a flat verify curve: drafting pays
    costs.set_drafter(cheap, DraftCost(per_call=0.0001))
    costs.set_drafter(dear, DraftCost(per_call=0.1))
    policy = build_policy(hyb.config, hyb, costs, length=length)
    depths = []
    for _ in range(32):
        depths.append(policy.choose(BatchView([[1, 2, 3]], [99]))[0])
        _rounds(policy, hyb, 1)
    assert min(depths) > 0, depths
    assert cheap.calls == 32 and dear.calls == 2


def test_setup_measures_each_child_of_a_composition(monkeypatch):
    """``setup_costs`` times the children the gate and the length policy price, not only the
    composition as a whole (whose cost is both children's)."""
    from types import SimpleNamespace

    import spec_plugins.policy.costs as costs_module
    from spec_plugins.policy.cost import DraftCost
    from spec_plugins.policy.draft_policy import setup_costs
    from spec_plugins.proposers.hybrid import HybridProposer
    from spec_plugins.proposers.suffix import SuffixProposer

    cheap, dear = (_Tree(SuffixProposer.Config(num_draft_tokens="auto", tree_nodes=8)) for _ in range(2))
    hyb = HybridProposer(HybridProposer.Config(num_draft_tokens="auto", proposers=[
        {"type": "suffix", "tree_nodes": 8}, {"type": "suffix", "scope": "global", "tree_nodes": 8}]),
        children=[cheap, dear])
    timed = []
    monkeypatch.setattr(costs_module, "measure_draft", lambda p, *a, **kw: timed.append(p) or DraftCost(per_call=0.001))
    costs = Costs(ForwardCost.from_curve([0.01] * 33), frozen=True)
    runtime = SimpleNamespace(max_context=4096)  # the curve above covers every width: nothing re-measured
    assert setup_costs(runtime, hyb, hyb.config, costs=costs) is costs
    assert timed == [cheap, dear]
    assert costs.drafter(cheap).per_call == costs.drafter(dear).per_call == 0.001


def test_online_costs_read_the_measured_curve_once_per_row_count():
    """The policy prices ~17 widths every round and the costs learn from every round, so each
    observation must only rescale the measured curve, not interpolate it again (that rebuild was
    half of auto's Python per round: 144 -> 74 us on the replayed dev prompts)."""
    base = ForwardCost.from_curve([0.010, 0.014, 0.019, 0.022])
    calls = []
    original = base._row
    base._row = lambda b, n: calls.append((b, n)) or original(b, n)  # type: ignore[method-assign]
    online = OnlineCost(base)
    first = [online(1, n) for n in range(1, 5)]
    read = len(calls)
    assert read == 4  # the measured curve, once
    for _ in range(20):
        online.observe(1, 2, 0.028)  # width 2 runs at twice its measured cost
        assert online(1, 2) > online(1, 1)
    assert len(calls) == read, "an observation made the measured curve be read again"
    assert online(1, 2) > 1.9 * first[1]  # the correction itself still applies
