"""Round 15: the tree sizer learns from the draft the runtime placed, not the one it sized. A
runtime with a shared pool (llama.cpp's sequence ids and cells) or a widest forward (a TensorRT
engine's ``max_draft_nodes``) cuts each round's draft (``loop.capacity.fit``); the nodes cut away
are never verified, so they must count neither predicted nor missed in a drafter's calibration."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import tiny_llama
from helpers import plain_greedy
from spec_plugins.backends.base import SharedPool
from spec_plugins.config import ProposerConfig, SamplingConfig
from spec_plugins.loop.capacity import fit
from spec_plugins.policy import Costs, DraftPolicy, FixedLength, ForwardCost
from spec_plugins.proposers.base import Proposer
from spec_plugins.row_trees import combine
from spec_plugins.types import Draft, Ranked, RankedRow, RoundRecord, Shaped

COSTS = {(1, n): 0.01 * (1 + 0.02 * n) for n in range(1, 34)}  # a forward's seconds by its positions


class _Oracle(Proposer):
    """A tree drafter that knows the target's greedy text: right at every node of its best path,
    wrong at the root's second child (``wide``: both and the best path's second node; else the
    best path's first node alone). Records the width of every draft the round verified."""

    Config = ProposerConfig
    tree = True
    ranks = True

    def __init__(self, text: list[int], vocab: int, wide: bool) -> None:
        self.config = ProposerConfig(type="oracle", num_draft_tokens=3)
        self.text, self.vocab, self.wide = text, vocab, wide
        self.verified: list[int] = []

    def propose(self, ctx: Any) -> Ranked | None:
        (seq,), (k,) = ctx.sequences, ctx.budgets
        a, b = self.text[len(seq)], self.text[len(seq) + 1]
        nodes = ([(a, (0,), 0.9), ((a + 1) % self.vocab, (1,), 0.5), (b, (0, 0), 0.45)] if self.wide
                 else [(a, (0,), 0.9)])
        nodes = [n for n in nodes if len(n[1]) <= k]  # within the row's budget
        if not nodes:
            return None
        tokens, paths, est = zip(*nodes)
        return Ranked([[RankedRow(list(tokens), list(paths), list(est))]], auto=True)

    def observe(self, record: RoundRecord) -> None:
        if record.draft is not None:
            self.verified.append(record.draft.size)


def _scale(room: str | None, wide: bool) -> tuple[float, list[int]]:
    """The oracle's calibration after a greedy generation on a runtime cut by ``room`` (None: no
    cut), and the widths the rounds verified."""
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.loop.round import decode
    from spec_plugins.sampling import LogitsPipeline
    from spec_plugins.stats import DecodeStats
    from spec_plugins.verifiers import ExactVerifier

    model = tiny_llama(seed=3, sharpness=6.0)
    target = TorchRuntime(model)
    if room == "pool":
        target.pool = SharedPool(cells=4096, sequences=1)  # one sequence id: a chain only
    elif room == "max_nodes":
        target.max_draft_nodes = 1  # an engine whose widest step scores one drafted node
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 24
    text = prompt + plain_greedy(model, prompt, n + 4)
    oracle = _Oracle(text, model.config.vocab_size, wide)
    policy = DraftPolicy(FixedLength(3), costs=Costs(ForwardCost(COSTS), frozen=True))
    out: list[int] = []
    for step in decode(target, oracle, ExactVerifier(), LogitsPipeline(SamplingConfig()), [prompt], n, (), None,
                       DecodeStats(), policy):
        out.extend(step.emitted.get(0, []))
    assert out == text[len(prompt):len(prompt) + n]  # the cut changes what is verified, never the output
    return policy.sizer.calibration(0).scale, oracle.verified


@pytest.mark.parametrize("room", ["pool", "max_nodes"])
def test_a_drafter_right_on_every_placed_node_keeps_its_trust_when_the_runtime_cuts_its_tree(room):
    """The wide oracle's tree is cut to its first node by the runtime's room; that node is always
    accepted, so it must calibrate exactly as the same node verified uncut. Before: the two cut
    nodes counted as predicted and missed, and the oracle lost trust every round."""
    cut, widths = _scale(room, wide=True)
    assert widths and set(widths) == {1}  # the case arose: every round verified one node of three
    uncut, _ = _scale(None, wide=False)
    full, _ = _scale(None, wide=True)
    assert uncut > 1.0 and full > 1.0  # right on every verified node: trusted (accepted >= predicted)
    assert cut == pytest.approx(uncut, rel=1e-12)


def test_each_row_is_credited_with_its_own_nodes_the_widest_forward_keeps():
    """Host rows (merged by path) beside a shaped draft (combined level by level, per row): a cut
    to the first ``most`` nodes keeps each row's nodes at those positions; the sizer's prediction
    per source is checked against the placed draft's valid tokens, read back independently."""
    est = {}  # token -> (source, estimate); every token unique
    host = [[(100, (0,), 0.9), (101, (1,), 0.6), (102, (0, 0), 0.5), (103, (0, 0, 0), 0.3)], [],
            [(120, (0,), 0.8), (121, (0, 0), 0.7), (122, (0, 1), 0.2)]]
    rows = []
    for nodes in host:
        for t, _, p in nodes:
            est[t] = (0, p)
        rows.append([RankedRow([t for t, _, _ in nodes], [q for _, q, _ in nodes], [p for _, _, p in nodes])]
                    if nodes else [])
    parents, slot_est = (-1, -1, 0, 2, 3), (0.4, 0.35, 0.3, 0.2, 0.1)  # shaped: per slot, every row
    tokens = torch.tensor([[200 + 10 * b + j for j in range(len(parents))] for b in range(3)])
    for b in range(3):
        for j, p in enumerate(slot_est):
            est[200 + 10 * b + j] = (1, p)
    ranked = Ranked(rows, False, [Shaped(Draft(tokens, parents), slot_est, source=1)])
    for most in range(1, 7):
        policy = DraftPolicy(FixedLength(4))
        sized = policy.size(ranked)
        assert sized.size == 6  # levels as wide as the widest part: host 2/2/1, shaped 2/1/1/1
        placed = fit(sized, None, [10, 10, 10], most)
        policy.placed(placed)
        want = {0: 0.0, 1: 0.0}
        valid = placed.valid.tolist()
        for b, row in enumerate(placed.tokens.tolist()):
            for t, ok in zip(row, valid[b]):
                if ok:
                    source, p = est[t]
                    want[source] += p
        prior = {s: policy.sizer.calibration(s).predicted for s in (0, 1)}
        policy.observe(RoundRecord([0, 1, 2], [[1]] * 3, [4] * 3, None, placed, [[], [], []], [[5]] * 3, [], 1 + most))
        for s in (0, 1):
            got = policy.sizer.calibration(s).predicted - policy.sizer.decay * prior[s]
            assert got == pytest.approx(want[s]), (most, s)


def test_the_sizer_s_positions_are_those_combine_lays_out():
    """``union_layout`` (the sizer's map of each part's nodes) against ``row_trees.combine`` itself."""
    from spec_plugins.row_trees import union_layout

    parts_parents = [(-1, -1, 0, 2), (-1, 0, 1, 0, -1, 4)]
    parts = [(torch.tensor([[1000 * (p + 1) + j for j in range(len(par))]] * 2), par, None)
             for p, par in enumerate(parts_parents)]
    tokens, _, valid = combine(parts, [0, 1], torch.device("cpu"))
    slots = union_layout(parts_parents)[0]
    for b in range(2):
        for j, u in enumerate(slots[b]):
            assert bool(valid[b, u]) and int(tokens[b, u]) == 1000 * (b + 1) + j


def test_grammar_forced_tokens_ahead_of_the_draft_count_against_the_cut():
    """``Batch.place`` puts a row's forced tokens ahead of its sized chain before the runtime's cut:
    a node pushed past the cut by them is not credited (only the first of three placed here)."""
    from spec_plugins.grammar.rounds import splice

    policy = DraftPolicy(FixedLength(3))
    ranked = Ranked([[RankedRow([10, 11, 12], [(0,), (0, 0), (0, 0, 0)], [0.9, 0.8, 0.7])]], False)
    sized = policy.size(ranked)
    forced = [[5, 6]]
    placed = fit(splice(sized, forced), None, [10], 3)  # Batch.place: forced tokens ahead, then the cut
    assert placed.tokens.tolist() == [[5, 6, 10]]
    policy.placed(placed, [len(f) for f in forced])
    (source, predicted), = policy.sizer._kept
    assert predicted == pytest.approx(0.9)
