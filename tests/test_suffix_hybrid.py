"""The hybrid of suffix decoding and a trained head: it picks a child per row, keeps greedy output
plain greedy, skips a child whose drafting costs more than it gains, and cuts the chosen trees for
the batch."""

from __future__ import annotations

import pytest
from helpers import greedy_run, plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.policy import Costs
from spec_plugins.policy.cost import DraftCost, ForwardCost
from spec_plugins.proposers.suffix import SuffixProposer


def test_hybrid_picks_per_row_and_keeps_greedy_identity():
    """Suffix + EAGLE (a random drafter): outputs equal plain greedy; on repeated requests the
    suffix drafts win rows, on fresh text EAGLE's do; each child's calibration is its own."""
    from test_heads import eagle

    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.hybrid import HybridProposer

    model = tiny_llama(seed=7, sharpness=6.0)
    target = TorchRuntime(model)
    suffix = SuffixProposer(SuffixProposer.Config(scope="global", tree_nodes=8, min_token_prob=0.0,
                                                  max_spec_factor=4))
    eag = EagleProposer(EagleProposer.Config(heads="unused", mode="tree", tree_nodes=6, top_k=2), drafter=eagle(model))
    # A fixed, flat verify cost of 1 s per forward: the choice then rests on the drafts alone, not
    # on how this machine times a tiny model (a measured curve made EAGLE lose every row on CI).
    hyb = HybridProposer(HybridProposer.Config(proposers=[{"type": "suffix"}, {"type": "eagle", "heads": "x"}]),
                         target=target, children=[suffix, eag])
    policy = DraftPolicy(FixedLength(6), costs=Costs(ForwardCost.from_curve([1.0] * 33), frozen=True))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    first, _ = greedy_run(target, hyb, prompts, 24, policy=policy)
    for p, o in zip(prompts, first):
        assert o == plain_greedy(model, p, 24)
    used = policy.sizer.picked  # rows whose kept draft came from each child, in all
    assert used.get(1, 0) > 0  # fresh text: the model drafter had rows
    before = dict(used)
    again, _ = greedy_run(target, hyb, prompts, 24, policy=policy)
    assert again == first
    assert used[0] - before.get(0, 0) > used.get(1, 0) - before.get(1, 0)  # repeated text: mostly suffix
    with pytest.raises(ValueError, match="exactly two"):
        HybridProposer.Config(proposers=[{"type": "suffix"}])
    with pytest.raises(ValueError, match="tree_nodes must be a number"):
        HybridProposer.Config(proposers=[{"type": "suffix", "tree_nodes": "auto"}, {"type": "ngram"}])


def test_hybrid_skips_a_child_whose_drafting_costs_more_than_it_gains():
    """The policy's gate asks a child measured as dear (here: 100 s per propose) only on probe
    rounds; the rounds it sits out leave gaps in its drafter cache, and output still equals plain
    greedy."""
    from test_heads import eagle

    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.hybrid import HybridProposer

    model = tiny_llama(seed=7, sharpness=6.0)
    target = TorchRuntime(model)
    suffix = SuffixProposer(SuffixProposer.Config(scope="global", tree_nodes=8, min_token_prob=0.0,
                                                  max_spec_factor=4))
    eag = EagleProposer(EagleProposer.Config(heads="unused", mode="tree", tree_nodes=6, top_k=2), drafter=eagle(model))
    calls: list[int] = []
    propose = eag.propose
    eag.propose = lambda ctx: (calls.append(1), propose(ctx))[1]  # type: ignore[method-assign]
    flat = Costs(ForwardCost.from_curve([1.0] * 33), frozen=True)  # flat: the sizer keeps every node, whatever the machine
    flat.set_drafter(suffix, DraftCost(per_call=1e-6))
    flat.set_drafter(eag, DraftCost(per_call=100.0))
    hyb = HybridProposer(HybridProposer.Config(proposers=[{"type": "suffix"}, {"type": "eagle", "heads": "x"}]),
                         target=target, children=[suffix, eag])
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    policy = DraftPolicy(FixedLength(6), costs=flat, gated=True, probe_every=8)
    out, _ = greedy_run(target, hyb, prompts, 24, policy=policy)
    for p, o in zip(prompts, out):
        assert o == plain_greedy(model, p, 24)
    gate = policy.gate
    assert 1 <= len(calls) <= -(-gate._round // 8) and gate.skipped[1] == gate._round - len(calls)
    assert gate.skipped[0] == 0  # the cheap child drafts every round


def test_hybrid_cuts_the_chosen_trees_for_the_batch():
    """The chosen trees go through the one tree sizer: where two rows verifying together pay two
    forwards per drafted position (even a certain node of both rows does not pay), no two-row
    round drafts; one row on a flat curve keeps its tree.
    Output equals plain greedy either way."""
    from test_heads import eagle

    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.hybrid import HybridProposer

    model = tiny_llama(seed=7, sharpness=6.0)
    target = TorchRuntime(model)
    # in hours: the drafting seconds a round has already spent (sunk, priced by the sizer) stay
    # negligible on a loaded machine too
    table = {(1, n): 3600.0 for n in range(1, 34)}
    table.update({(2, n): 3600.0 * (2.0 * n - 1.0) for n in range(1, 34)})
    suffix = SuffixProposer(SuffixProposer.Config(scope="global", tree_nodes=8, min_token_prob=0.0, max_spec_factor=4))
    eag = EagleProposer(EagleProposer.Config(heads="unused", mode="tree", tree_nodes=6, top_k=2), drafter=eagle(model))
    hyb = HybridProposer(HybridProposer.Config(proposers=[{"type": "suffix"}, {"type": "eagle", "heads": "x"}]),
                         target=target, children=[suffix, eag])
    policy = DraftPolicy(FixedLength(6), costs=Costs(ForwardCost(table), frozen=True))
    widths: list[tuple[int, int]] = []  # (rows, drafted positions) per round, as sized by the policy
    size = policy.size

    def spy(ranked, spent=0.0, budgets=None):
        d = size(ranked, spent, budgets)
        if ranked is not None:
            widths.append((len(ranked.rows), 0 if d is None else d.tokens.shape[1]))
        return d

    policy.size = spy  # type: ignore[method-assign]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    for _ in range(2):  # the second pass repeats text: long suffix matches
        out, _ = greedy_run(target, hyb, prompts, 24, policy=policy)
        assert out == [plain_greedy(model, p, 24) for p in prompts]
    two = [w for r, w in widths if r == 2]
    assert two and max(two) == 0
    out, _ = greedy_run(target, hyb, prompts[:1], 24, policy=policy)
    assert out[0] == plain_greedy(model, prompts[0], 24)
    assert max(w for r, w in widths if r == 1) > 0
