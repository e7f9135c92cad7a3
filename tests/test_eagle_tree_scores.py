"""A feature drafter's tree ranking (``eagle_tree.ranked_rows``, the host path of EAGLE and the
parallel drafter) with scores a broken drafter gives: NaN or +inf scores draft nothing, and the
nodes kept still form a tree (every kept node's parent kept), as the device path's ``> NEG`` does."""

from __future__ import annotations

import math

import pytest
import torch

from spec_plugins.proposers.eagle_tree import Candidates, ranked_rows


def _candidates(bad: float) -> Candidates:
    """Two depth-0 candidates (a: -0.1, b: -5.0), two children each; b's first child scores ``bad``."""
    logp = torch.tensor([[-0.1, -5.0, -0.2, -0.3, bad, -6.0]])
    return Candidates(tokens=torch.tensor([[10, 11, 12, 13, 14, 15]]), logp=logp,
                      parent=torch.tensor([[-1, -1, 0, 0, 1, 1]]), depth=(0, 0, 1, 1, 1, 1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_unusable_scores_draft_nothing_and_the_rest_stays_a_tree(bad):
    ranked = ranked_rows(_candidates(bad), nodes=3, budgets=[2], auto=False)
    (row,) = ranked.rows[0]
    assert row.tokens == [10, 12, 13]  # a and its two children: b's broken child is left out
    assert all(0.0 <= p <= 1.0 and not math.isnan(p) for p in row.estimates)


def test_finite_scores_rank_as_before():
    ranked = ranked_rows(_candidates(-5.5), nodes=5, budgets=[2], auto=False)
    (row,) = ranked.rows[0]
    assert row.tokens == [10, 12, 13, 11, 14]  # best-first by cumulative score
    assert row.estimates == pytest.approx([math.exp(v) for v in (-0.1, -0.2, -0.3, -5.0, -5.5)])


@pytest.mark.parametrize("budget,want", [(0, []), (1, [10, 11]), (2, [10, 12, 13, 11, 14])])
def test_each_row_keeps_within_its_depth_budget(budget, want):
    """A row's depth budget (its room left) masks deeper candidates: none of them is drafted,
    however the masked scores tie."""
    (row,) = ranked_rows(_candidates(-5.5), nodes=5, budgets=[budget], auto=False).rows[0]
    assert row.tokens == want
