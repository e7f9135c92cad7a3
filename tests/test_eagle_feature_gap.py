"""EAGLE keeps the target's features of rounds it did not draft (``Proposer.features_pending``):
under a policy that drafts nothing some rounds (``auto``'s k=0, a hybrid's gate skipping the
drafter) the batch holds the features until the drafter catches up, so its cache ends with every
committed position, its next draft equals one from a full catch-up, and greedy output stays
transformers' own ``generate()``."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_generate
from test_heads import GREEDY, eagle_prop

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.loop.batch import Batch
from spec_plugins.loop.round import run_round
from spec_plugins.loop.rows import Row
from spec_plugins.policy import FixedLength
from spec_plugins.policy.draft_policy import DraftPolicy
from spec_plugins.proposers.base import Proposer
from spec_plugins.proposers.hybrid import HybridProposer
from spec_plugins.proposers.suffix import SuffixProposer
from spec_plugins.training.features import target_outputs
from spec_plugins.types import Draft, ProposeContext, RowRequest
from spec_plugins.verifiers import ExactVerifier

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 3, 3, 6]]
PATTERN = (True, False, True, False, False)  # draft, skip one round, draft, skip two rounds


class Skipping(FixedLength):
    """Depth ``k`` on the rounds ``pattern`` marks, none (no ``propose``) on the others."""

    def __init__(self, k: int, pattern: tuple[bool, ...] = PATTERN) -> None:
        super().__init__(k)
        self.pattern, self.round = pattern, 0

    def choose(self, view):
        k = self.k if self.pattern[self.round % len(self.pattern)] else 0
        self.round += 1
        return [k] * view.rows


def _full_features(model, seq):
    """The target's last hidden state at every position of ``seq`` from one forward (no cache)."""
    return target_outputs(model, torch.tensor([list(seq)]), ())["hidden"]


def _check_cache(prop, model, seqs):
    """Each row's cache holds positions 0..fed-1 exactly, each key the drafter's own on the full
    sequence with the target's true features (one forward, no cache)."""
    d = prop.drafter
    for b, seq in enumerate(seqs):
        fed = prop.fed[b]
        live = prop.slots.pos[b] >= 0
        assert sorted(prop.slots.pos[b][live].tolist()) == list(range(fed)), f"row {b}: positions missing"
        with torch.no_grad():
            feats = d.project(_full_features(model, seq))[:fed]
            mask = torch.zeros(1, 1, fed, fed).masked_fill(~torch.ones(fed, fed, dtype=torch.bool).tril(),
                                                           float("-inf"))
            _, k_ref, _ = d(feats[None], torch.tensor([seq[1: fed + 1]]), torch.arange(fed)[None], *d.empty_past(1),
                            mask)
        order = prop.slots.pos[b][live].argsort()
        torch.testing.assert_close(prop.k[b][:, live][:, order], k_ref[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_skipped_rounds_leave_no_gap_in_the_drafter_cache(mode):
    """Rounds that draft nothing between drafting ones: the drafter's cache holds every committed
    position it was fed, as a full recompute does, and the output is transformers' greedy
    ``generate()``."""
    model = tiny_llama(seed=3)
    prop = eagle_prop(model, mode)
    n = 30
    batch = Batch(TorchRuntime(model), prop, ExactVerifier())
    outs = {e.key: list(e.tokens) for e in batch.add([RowRequest(i, p, n) for i, p in enumerate(PROMPTS)])}
    policy = DraftPolicy.of(Skipping(3))
    for _ in range(len(PATTERN) + 1):  # two gaps, then a draft that catches up on the second
        for e in run_round(batch, policy).emissions:
            outs[e.key] += e.tokens
    assert not any(r.done for r in batch.rows) and prop.fed == [len(r.tokens) - 1 - len(r.hidden) for r in batch.rows]
    _check_cache(prop, model, [r.tokens for r in batch.rows])
    while (record := run_round(batch, policy)) is not None:
        for e in record.emissions:
            outs[e.key] += e.tokens
    assert [outs[i] for i in range(len(PROMPTS))] == hf_generate(model, PROMPTS, n, pad=0)


def test_the_draft_after_skipped_rounds_equals_a_full_catch_up():
    """Rows that went two rounds without a draft: the drafter's next draft equals that of a fresh
    drafter (same weights) fed every committed pair from one full forward of the target."""
    model = tiny_llama(seed=3)
    prop = eagle_prop(model, "tree")
    batch = Batch(TorchRuntime(model), prop, ExactVerifier())
    batch.add([RowRequest(i, p, 40) for i, p in enumerate(PROMPTS)])
    policy = DraftPolicy.of(Skipping(3))
    for _ in range(len(PATTERN)):  # ends on two rounds without a draft
        run_round(batch, policy)
    assert not any(r.done for r in batch.rows)
    seqs = [list(r.tokens) for r in batch.rows]
    _, got = batch.draft(batch.view(), [3] * len(seqs), policy)

    ref = eagle_prop(model, "tree")
    ref.admit(PROMPTS)
    hidden = [_full_features(model, s[:-1]) for s in seqs]
    want = ref.propose(ProposeContext(seqs, [3] * len(seqs), GREEDY, None, True, hidden))
    assert prop.fed == ref.fed == [len(s) - 1 for s in seqs]
    for g, w in zip(got.rows, want.rows):
        assert [r.tokens for r in g] == [r.tokens for r in w]
        for rg, rw in zip(g, w):
            assert rg.estimates == pytest.approx(rw.estimates, abs=1e-4)


def test_a_hybrid_keeps_what_its_most_behind_child_needs():
    """The suffix child needs no features, EAGLE every position it has not fed."""
    model = tiny_llama(seed=3)
    eagle = eagle_prop(model, "tree", nodes=6, top_k=2)
    suffix = SuffixProposer(SuffixProposer.Config(tree_nodes=6, min_token_prob=0.0))
    cfg = HybridProposer.Config(proposers=[{"type": "suffix", "tree_nodes": 6},
                                           {"type": "eagle", "heads": "unused", "tree_nodes": 6}])
    hybrid = HybridProposer(cfg, children=[suffix, eagle])
    hybrid.admit([[1, 2, 3], [4, 5]])
    assert suffix.features_pending([[1, 2, 3, 4], [4, 5, 6]]) == [None, None]  # the last round's
    assert hybrid.features_pending([[1, 2, 3, 4], [4, 5, 6]]) == [3, 2]


def test_a_row_keeps_only_the_features_still_needed():
    """None needed: empty; the steady state: a view of this round's (no device op); after a round
    without a draft: the pending ones before this round's."""
    row = Row("r", [1, 2], 2, 8, None, None)
    new = torch.arange(6.0).reshape(3, 2)
    row.keep_features(new, 0)
    assert row.hidden.shape == (0, 2)
    row.keep_features(new, 1)
    assert row.hidden.tolist() == [[4.0, 5.0]] and row.hidden.data_ptr() == new[2].data_ptr()
    row.keep_features(new, 3)
    assert row.hidden.data_ptr() == new.data_ptr()
    row.keep_features(new + 10, 5)
    assert row.hidden.tolist() == [[2.0, 3.0], [4.0, 5.0], [10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]


def test_rounds_without_a_draft_hold_chunks_joined_once_when_read():
    """A gap holds each round's features as a view (no copy a round); reading joins them once."""
    row = Row("r", [1, 2], 2, 8, None, None)
    rounds = [torch.full((2, 2), float(i)) for i in range(4)]
    for i, new in enumerate(rounds):
        row.keep_features(new, 2 * (i + 1))
    assert len(row.features) == 4 and all(c.data_ptr() == n.data_ptr() for c, n in zip(row.features, rounds))
    assert row.hidden.tolist() == [[float(i)] * 2 for i in range(4) for _ in range(2)] and len(row.features) == 1


class LastRoundReader(Proposer):
    """A third-party feature drafter: drafts the reference continuation, logs what it was passed."""

    needs_hidden = True

    def __init__(self, ref):
        self.ref, self.seen = ref, []

    def propose(self, ctx):
        self.seen.append([h.shape[0] for h in ctx.hidden])
        k = max(ctx.budgets)
        toks = [[self.ref[min(len(s) + j, len(self.ref) - 1)] for j in range(k)] for s in ctx.sequences]
        return Draft(torch.tensor(toks), tuple(range(-1, k - 1)), None, None)


def test_a_proposer_that_counts_nothing_gets_the_last_rounds_features():
    """The contract before ``features_pending``: the root and accepted nodes of the last round."""
    model = tiny_llama(seed=3)
    prompt = [1, 2, 3, 4, 5]
    ref = prompt + hf_generate(model, [prompt], 40, pad=0)[0]
    prop = LastRoundReader(ref)
    batch = Batch(TorchRuntime(model), prop, ExactVerifier())
    batch.add([RowRequest(0, prompt, 40)])
    for _ in range(4):
        rec = run_round(batch, DraftPolicy.of(FixedLength(4)))
        assert rec.accepted == [[0, 1, 2, 3]]
    assert prop.seen == [[5], [5], [5], [5]] and batch.rows[0].tokens == ref[: len(prompt) + 21]  # prefill emits one
