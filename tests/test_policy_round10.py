"""Drafting-policy fixes: an unpicked source's calibration recovers, every option is priced with
each node counted at most once, a load-aware upper bound above the defaults is measured, the
gate's smoothing does not depend on the batch size, and costs from another runtime are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.policy import Costs, DraftCost, ForwardCost
from spec_plugins.policy.draft_policy import build_policy, setup_costs
from spec_plugins.policy.objective import Calibration
from spec_plugins.policy.sources import SourceGate
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.types import BatchView, Draft, ProposeContext, Ranked, RankedRow, RoundRecord

STEEP = ForwardCost.from_curve([0.010 * (1 + 0.05 * n) for n in range(40)])


def chain(n: int, source: int, p: float) -> RankedRow:
    return RankedRow([7] * n, [(0,) * (i + 1) for i in range(n)], [p] * n, source)


def one_row_record(draft: Draft | None, accepted: list[int]) -> RoundRecord:
    size = draft.size if draft is not None else 0
    return RoundRecord([0], [[1]], [4], None, draft, [accepted], [[5] * (len(accepted) + 1)], [], 1 + size)


def capped_rate(row: RankedRow, scale: float, costs: Costs) -> float:
    """The reference: (1 + sum min(1, p x scale)) / T(1, 1 + nodes), written out."""
    tokens = 1.0
    for p in row.estimates:
        tokens += min(1.0, p * scale)
    return tokens / costs(1, 1 + row.size)


class _Child:
    """A composition's child offering one node per row, row b's estimate ``ests[b % len]``."""

    def __init__(self, *ests: float) -> None:
        self.ests = ests
        self.config = SimpleNamespace(num_draft_tokens=16)

    def propose(self, ctx):
        return Ranked([[RankedRow([1], [(0,)], [self.ests[b % len(self.ests)]])] for b in range(len(ctx.sequences))],
                      True)


# ---- 1. an unpicked row-based source fades back toward its prior ------------------------------------
def test_a_source_that_loses_every_pick_recovers_its_calibration():
    sizer = TreeSizer(Costs(STEEP, frozen=True))
    for _ in range(12):  # a bad stretch: source 1 alone, promising 0.9 per node, nothing accepted
        sizer.observe(one_row_record(sizer.size(Ranked([[chain(4, 1, 0.9)]], True)), []))
    low = sizer.calibration(1)
    assert low.scale < 0.1
    ref = Calibration(sizer.decay, sizer.prior)
    ref.accepted, ref.predicted = low.accepted, low.predicted
    # source 0's honest single node wins the pick; source 1 offered and was taken by no row
    sizer.size(Ranked([[chain(1, 0, 0.5), chain(4, 1, 0.95)]], True))
    assert sizer._kept[0][0] == 0
    ref.idle()
    assert sizer.calibration(1).scale == pytest.approx(ref.scale)  # faded once, as Calibration.idle
    picked = []
    for _ in range(200):  # the text turned source 1's way: it is tried again, and then kept
        d = sizer.size(Ranked([[chain(1, 0, 0.5), chain(4, 1, 0.95)]], True))
        src = sizer._kept[0][0]
        picked.append(src)
        sizer.observe(one_row_record(d, list(range(d.size)) if src == 1 else []))
    assert picked[-50:] == [1] * 50


# ---- 2. every option counts a node at most once ------------------------------------------------------
def test_the_pick_and_the_gate_credit_no_more_tokens_than_nodes():
    costs = Costs(ForwardCost.from_curve([0.010 * (1 + 0.1 * n) for n in range(40)]), frozen=True)
    sizer = TreeSizer(costs)
    sizer.calibration(0).accepted, sizer.calibration(0).predicted = 4.0, 2.0  # under-predicts: scale 2
    a, b = chain(4, 0, 0.9), chain(8, 1, 0.95)
    assert capped_rate(b, 1.0, costs) > capped_rate(a, 2.0, costs)
    assert sizer._pick([a, b], {}).source == 1  # the capped objective's choice
    for row in (a, b):
        scale = sizer.calibration(row.source).scale
        assert sizer.rate(row.estimates, row.size, row.source) == pytest.approx(capped_rate(row, scale, costs))
    # the gate prices a child's smoothed offer the same way: 4 nodes at 0.9, scale 2 -> 5 tokens
    child = _Child(0.9)
    costs.set_drafter(child, DraftCost(0.001))
    gate = SourceGate([child, _Child(0.0)], sizer, costs, gated=True)
    gate.stats[0].offer, gate.stats[0].nodes = [0.9] * 4, 4.0
    assert gate.prospect(0, 4) == pytest.approx(5.0 / (costs(1, 5) + costs.draft_seconds(child, 4)))


# ---- 3. a load-aware upper bound above the defaults is measured, not capped ---------------------------
def test_load_measures_a_configured_upper_bound_beyond_the_defaults():
    rt = TorchRuntime(tiny_llama(vocab=64, max_pos=256), matmul="native")
    prop = NgramProposer(NgramProposer.Config(num_draft_tokens=32))
    costs = setup_costs(rt, prop, prop.config, length="load", context=16)
    assert costs.max_positions == 33
    assert build_policy(prop.config, prop, costs, length="load").length.max_k == 32
    flat = Costs(ForwardCost.from_curve([0.01] * 33), frozen=True)  # verifying is free: draft to the bound
    flat.set_drafter(prop, DraftCost())
    policy = build_policy(prop.config, prop, flat, length="load")
    for _ in range(80):
        (k,) = policy.choose(BatchView([[1, 2, 3]], [10**6]))
        draft = Draft.from_chains([[7] * k]) if k else None
        policy.observe(RoundRecord([0], [[1]], [k], None, draft, [list(range(k))], [[5] * (k + 1)], [], 1 + k))
    assert k > 16


# ---- 4. the gate's smoothing forgets by decay per round, whatever the batch ---------------------------
def _smoothed(rows: int, dear: float, *ests: float) -> float:
    """Child 1's smoothed expected after one round of ``rows`` rows (history 0.9), it costing ``dear`` s."""
    costs = Costs(ForwardCost.from_curve([0.010] * 17), frozen=True)
    a, b = _Child(0.0), _Child(*ests)
    costs.set_drafter(a, DraftCost())
    costs.set_drafter(b, DraftCost(dear))
    gate = SourceGate([a, b], TreeSizer(costs), costs, gated=True, probe_every=1000)
    gate.stats[1].expected = 0.9
    gate.draft(ProposeContext([[1, 2, 3]] * rows, [4] * rows, None))  # round 0 drafts every child
    return gate.stats[1].expected


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_the_gate_smooths_once_per_round_whatever_the_batch(rows):
    offers = (0.2, 0.6) if rows > 1 else (0.4,)  # the round's mean offer: 0.4 per row
    assert _smoothed(rows, 0.001, *offers) == pytest.approx(0.9 * 0.9 + 0.1 * 0.4)  # decay 0.9
    # a dear child the gate would skip is probed: the probe weighs 0.5, not 1 - 0.5 ** rows
    assert _smoothed(rows, 1.0, *offers) == pytest.approx(0.5 * 0.9 + 0.5 * 0.4)


# ---- 5. costs measured on another runtime are refused --------------------------------------------------
def test_costs_from_another_runtime_are_refused_naming_both():
    rt = TorchRuntime(tiny_llama(vocab=64), matmul="native")
    curve = [0.01 * (1 + 0.6 * n) for n in range(17)]
    foreign = Costs(ForwardCost.from_curve(curve, runtime="llamacpp", context=128))
    ngram = NgramProposer(NgramProposer.Config(num_draft_tokens="auto"))
    with pytest.raises(ValueError, match="'llamacpp'.*'torch'"):
        SpeculativeDecoder(rt, ngram, costs=foreign)
    with pytest.raises(ValueError, match="'llamacpp'.*'torch'"):
        setup_costs(rt, None, None, costs=foreign)  # kept by the wiring even where nothing is priced
    own = Costs(ForwardCost.from_curve(curve, runtime="torch", context=128))
    assert setup_costs(rt, ngram, ngram.config, costs=own) is own  # measured here: reused
    unnamed = Costs(ForwardCost.from_curve(curve, context=128))
    assert setup_costs(rt, ngram, ngram.config, costs=unnamed) is unnamed  # records no runtime: as given
