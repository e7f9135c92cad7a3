"""Round 13: the drafting policy prices, credits and calibrates a shaped draft (one tree for the
batch, masked per row by budget) by the slots within each row's budget; a policy over a shared
sizer prices with its own costs; a child that is called and drafts nothing fades until skipped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_llama
from helpers import plain_greedy
from spec_plugins.policy import Costs, DraftCost, DraftPolicy, FixedLength, ForwardCost
from spec_plugins.policy.objective import Calibration
from spec_plugins.policy.sources import SourceGate
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.types import Draft, ProposeContext, Ranked, RankedRow, RoundRecord, Shaped

FLAT = ForwardCost.from_curve([1.0] * 33)  # 1 s per forward whatever its width
CHAIN = (-1, 0, 1, 2)  # a shaped chain of 4 slots, slot j at depth j


class ShapedChild:
    """A device drafter's output: one chain for the batch, row b's slots valid below its budget."""

    def __init__(self, estimates: tuple[float, ...], auto: bool = False) -> None:
        self.estimates, self.auto, self.calls = estimates, auto, 0
        self.config = SimpleNamespace(num_draft_tokens=len(CHAIN))

    def propose(self, ctx: ProposeContext) -> Ranked:
        self.calls += 1
        B = len(ctx.sequences)
        valid = torch.tensor([[j < k for j in range(len(CHAIN))] for k in ctx.budgets])
        draft = Draft(torch.full((B, len(CHAIN)), 7), CHAIN, None, valid)
        return Ranked([[] for _ in range(B)], self.auto, [Shaped(draft, self.estimates)])


class HostChild:
    """A host drafter: ``offer(ctx)`` is its Ranked (or None), counted per call."""

    def __init__(self, offer) -> None:
        self.offer, self.calls = offer, 0
        self.config = SimpleNamespace(num_draft_tokens=4)

    def propose(self, ctx: ProposeContext) -> Ranked | None:
        self.calls += 1
        return self.offer(ctx)


def ctx_of(budgets: list[int]) -> ProposeContext:
    return ProposeContext([[1, 2, 3]] * len(budgets), budgets, None, None, True, None)


def record(draft: Draft | None, budgets: list[int], accepted: list[list[int]]) -> RoundRecord:
    B = len(budgets)
    return RoundRecord(list(range(B)), [[1]] * B, budgets, None, draft, accepted,
                       [[5] * (len(a) + 1) for a in accepted], [], 1 + (draft.size if draft is not None else 0))


def policy_round(policy: DraftPolicy, sources: list, budgets: list[int]) -> Draft | None:
    return policy.size(policy.draft(sources, ctx_of(budgets)), 0.0, budgets)  # as run_round passes them


# ---- 1. a shaped draft counts, per row, only the slots within the row's budget ---------------------
def test_a_shaped_draft_is_credited_and_calibrated_by_each_rows_budget():
    """Rows with budgets 0, 1 and 4 over one 4-slot chain: the budget-0 row takes nothing (no pick,
    no prediction), the budget-1 row is predicted its first slot alone."""
    est = (0.9, 0.8, 0.7, 0.6)
    policy = DraftPolicy(FixedLength(4), costs=Costs(FLAT, frozen=True))
    budgets = [0, 1, 4]
    draft = policy_round(policy, [ShapedChild(est)], budgets)
    assert draft is not None
    assert policy.sizer.picked == {0: 2}  # the budget-0 row took nothing
    policy.observe(record(draft, budgets, [[], [0], [0, 1]]))
    ref = Calibration(policy.sizer.decay, policy.sizer.prior)
    ref.observe(3.0, est[0] + sum(est))  # 3 accepted of 0.9 (one slot) + 3.0 (four) predicted
    cal = policy.sizer.calibration(0)
    assert (cal.accepted, cal.predicted) == pytest.approx((ref.accepted, ref.predicted))


def test_a_shaped_cut_gains_only_in_rows_with_room():
    """Eight rows, steep batch costs: a node pays when all eight rows can hold it, not when one row
    can and seven have budget 0 (their valid masks hold nothing); the draft is then cut whole."""
    table = {(1, n): 1.0 for n in range(1, 34)}
    table.update({(8, n): 1.0 + 0.5 * (n - 1) for n in range(1, 34)})
    costs = Costs(ForwardCost(table), frozen=True)
    child = ShapedChild((0.9, 0.9, 0.9, 0.9), auto=True)
    full = DraftPolicy(FixedLength(4), costs=costs)
    assert policy_round(full, [child], [4] * 8) is not None  # 8 x 0.9 per node pays 0.5 s
    one = DraftPolicy(FixedLength(4), costs=costs)
    assert policy_round(one, [child], [4] + [0] * 7) is None  # 0.9 per node does not
    assert one.sizer.picked == {}


def test_the_gate_prices_a_shaped_draft_by_the_rows_budget():
    """Row 0 has budget 0, row 1 budget 1: the cheap shaped child's draft is in hand for row 1 as
    its first slot only (1.8 tokens a second), below what the dearer child offers (2 tokens for
    1.05 s): the dearer child is asked, not skipped as if row 1 held the whole chain."""
    costs = Costs(FLAT, frozen=True)
    shaped = ShapedChild((0.8, 0.8, 0.8, 0.8))
    host = HostChild(lambda ctx: Ranked([[RankedRow([5], [(0,)], [1.0])] if k else [] for k in ctx.budgets], True))
    costs.set_drafter(shaped, DraftCost(1e-6))
    costs.set_drafter(host, DraftCost(0.05))
    gate = SourceGate([shaped, host], TreeSizer(costs), costs, gated=True, probe_every=16)
    for _ in range(2):  # round 0 is a probe; round 1 decides
        gate.draft(ctx_of([0, 1]))
    assert (host.calls, gate.skipped[1]) == (2, 0)
    assert gate.stats[0].nodes == pytest.approx(1.0)  # one row with room, one slot within its budget


# ---- 2. a policy over a shared sizer prices with its own costs --------------------------------------
def test_policies_sharing_a_sizer_keep_their_own_costs_and_share_calibrations():
    """A server's policy and its decoder's are built over one sizer; building the decoder's (a
    direct generation) left the server's sizing with the decoder's one-row costs."""
    server_costs = Costs(ForwardCost({(r, n): 0.01 * r * n for r in (1, 8) for n in range(1, 34)}), frozen=True)
    decoder_costs = Costs(ForwardCost({(1, n): 0.01 * n for n in range(1, 34)}), frozen=True)
    shared = TreeSizer()
    server = DraftPolicy(FixedLength(4), shared, server_costs, min_gain=1.05)
    decoder = DraftPolicy(FixedLength(4), shared, decoder_costs, min_gain=1.5)
    assert server.sizer.seconds(8, 17) == pytest.approx(server_costs(8, 17))
    assert server.sizer.min_gain == 1.05 and decoder.sizer.min_gain == 1.5
    rows = [RankedRow([7] * 4, [(0,) * (i + 1) for i in range(4)], [0.6] * 4)] * 8
    assert server.sizer.cut(rows) == TreeSizer(server_costs, min_gain=1.05).cut(rows)
    assert server.sizer.calibration(0) is decoder.sizer.calibration(0) is shared.calibration(0)
    decoder.size(Ranked([[rows[0]]], False))
    assert server.sizer.picked == shared.picked == {0: 1}  # what one learns, all use


# ---- 3. a called child that drafts nothing fades until it is skipped, and probes bring it back ------
def test_a_child_drafting_nothing_is_skipped_and_probed_back():
    costs = Costs(FLAT, frozen=True)
    cheap = HostChild(lambda ctx: None)
    good = [False]
    dear = HostChild(lambda ctx: Ranked([[RankedRow([5] * 4, [(0,) * (i + 1) for i in range(4)], [0.95] * 4)]
                                         for _ in ctx.sequences], True) if good[0] else None)
    costs.set_drafter(cheap, DraftCost(1e-6))
    costs.set_drafter(dear, DraftCost(0.5))  # half a forward per call
    gate = SourceGate([cheap, dear], TreeSizer(costs), costs, gated=True, probe_every=16)
    ctx = ctx_of([4] * 4)
    for _ in range(200):
        assert gate.draft(ctx) is None
    assert gate.skipped[1] > 150 and gate.stats[1].expected < 0.01
    assert dear.calls >= 200 // 16  # probes still ask it
    good[0] = True  # the text turns its way
    calls = []
    for _ in range(40):
        before = dear.calls
        gate.draft(ctx)
        calls.append(dear.calls - before)
    assert calls[-10:] == [1] * 10  # back, every round


def test_a_near_free_child_drafting_nothing_is_never_skipped():
    """A child drafting for a thousandth of a forward (suffix on fresh text) keeps its offer through
    rounds it finds nothing in: skipping it would save next to nothing, and it must draft the
    round the text turns its way, not at the next probe."""
    costs = Costs(FLAT, frozen=True)
    cheap = HostChild(lambda ctx: None)
    other = HostChild(lambda ctx: None)
    costs.set_drafter(cheap, DraftCost(1e-3))  # FLAT: a forward of one position costs 1 s
    costs.set_drafter(other, DraftCost(1e-6))
    gate = SourceGate([cheap, other], TreeSizer(costs), costs, gated=True, probe_every=16)
    for _ in range(200):
        gate.draft(ctx_of([4] * 2))
    assert gate.skipped == [0, 0] and (cheap.calls, other.calls) == (200, 200)


# ---- 4. end to end: the shaped (device) EAGLE path in a hybrid, greedy identical --------------------
def test_shaped_eagle_hybrid_stays_greedy_and_credits_no_budget_zero_row(monkeypatch):
    """EAGLE's device path (a shaped draft) forced on the CPU inside a suffix hybrid, one row near
    its limit: output equals plain greedy, and no row with budget 0 is predicted a node."""
    from test_heads import eagle

    import spec_plugins.proposers.eagle as eagle_module
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.config import SamplingConfig
    from spec_plugins.loop import decode
    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.hybrid import HybridProposer
    from spec_plugins.proposers.suffix import SuffixProposer
    from spec_plugins.sampling import LogitsPipeline
    from spec_plugins.stats import DecodeStats
    from spec_plugins.verifiers import ExactVerifier

    monkeypatch.setattr(eagle_module, "HOST", torch.device("cpu", 0))  # != the drafter's device: the shaped path
    model = tiny_llama(seed=7, sharpness=6.0)
    target = TorchRuntime(model)
    suffix = SuffixProposer(SuffixProposer.Config(scope="global", tree_nodes=8, min_token_prob=0.0, max_spec_factor=4))
    eag = EagleProposer(EagleProposer.Config(heads="unused", mode="tree", tree_nodes=6, top_k=2, num_draft_tokens=4),
                        drafter=eagle(model))
    hyb = HybridProposer(HybridProposer.Config(proposers=[{"type": "suffix"}, {"type": "eagle", "heads": "x"}]),
                         target=target, children=[suffix, eag])
    costs = Costs(FLAT, frozen=True)
    costs.set_drafter(suffix, DraftCost(1e-6))
    costs.set_drafter(eag, DraftCost(1e-6))
    policy = DraftPolicy(FixedLength(4), costs=costs, gated=True)
    seen: list[tuple[int, float]] = []  # (budget, predicted) per row per observed round
    observe = TreeSizer.observe

    def spy(self, rec):
        if rec.draft is not None and len(self._kept) == rec.rows:
            seen.extend((k, pred) for k, (_, pred) in zip(rec.budgets, self._kept))
        observe(self, rec)

    monkeypatch.setattr(TreeSizer, "observe", spy)
    prompts, limits = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]], [2, 30]
    outs: list[list[int]] = [[] for _ in prompts]
    for step in decode(target, hyb, ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, limits, (), None,
                       DecodeStats(), policy):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    assert outs == [plain_greedy(model, p, n) for p, n in zip(prompts, limits)]
    assert any(k == 0 for k, _ in seen)  # the case arose
    assert all(pred == 0.0 for k, pred in seen if k == 0)
