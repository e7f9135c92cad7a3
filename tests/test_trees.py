"""Tree shapes: static rank-path trees, best-N sizing, EAGLE-2 dynamic selection, batch merging."""

from __future__ import annotations

import math

import pytest

from spec_plugins.tree import (
    best_static_tree,
    chain_tree,
    expected_accepted,
    layout,
    merge_trees,
    ordinal_paths,
    paths,
    static_tree,
    topk_tree,
)


def test_static_tree_medusa_paths_to_parents():
    t = static_tree([(0, 1), (1,), (0,), (0, 0), (0, 0, 0)])
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert t.parents == (-1, -1, 0, 0, 2)
    assert t.ranks == (0, 1, 0, 1, 0)
    assert t.depths == (0, 0, 1, 1, 2) and t.depth == 3
    layout(t.parents)  # topological, accepted by the layout helper
    assert t.truncated(2).paths == ((0,), (1,), (0, 0), (0, 1))


@pytest.mark.parametrize("bad", [[(0, 1)], [(0,), (0,)], [()], [(-1,)]])
def test_static_tree_refuses_malformed(bad):
    with pytest.raises(ValueError):
        static_tree(bad)


def test_chain_and_topk_trees():
    assert chain_tree(4).parents == (-1, 0, 1, 2)
    t = topk_tree((3, 2, 1))
    assert t.size == 3 + 6 + 6
    assert sum(1 for p in t.parents if p == -1) == 3
    kids = [sum(1 for p in t.parents if p == i) for i in range(t.size)]
    assert kids[:3] == [2, 2, 2] and kids[3:9] == [1] * 6 and kids[9:] == [0] * 6


def _all_trees(width: int, depth: int, size: int):
    """Every prefix-closed set of ``size`` rank paths (grown one frontier node at a time)."""
    level = {frozenset()}
    for _ in range(size):
        nxt = set()
        for s in level:
            frontier = [(r,) for r in range(width)] + [p + (r,) for p in s if len(p) < depth for r in range(width)]
            nxt.update(s | {f} for f in frontier if f not in s)
        level = nxt
    return [static_tree(sorted(s)) for s in level]


@pytest.mark.parametrize("size", [1, 3, 5, 7])
def test_best_static_tree_is_optimal(size):
    accept = [[0.5, 0.2, 0.1], [0.7, 0.1, 0.05], [0.8, 0.1, 0.0]]
    best = best_static_tree(accept, size, max_depth=3)
    assert best.size == size
    brute = max(expected_accepted(t, accept) for t in _all_trees(3, 3, size))
    assert expected_accepted(best, accept) == pytest.approx(brute)


def test_best_static_tree_limits():
    t = best_static_tree([0.9, 0.5], 50, max_depth=2)
    assert t.depth == 2 and t.size == 2 + 4  # nothing deeper than max_depth, only ranks with p > 0
    assert best_static_tree([0.9], 0, 3).size == 0
    assert best_static_tree([0.9, 0.5], 4, 5, max_rank=1).parents == (-1, 0, 1, 2)


def test_merge_trees_union_and_identity():
    one = ([4, 5, 6], ordinal_paths((-1, -1, 0)))
    m = merge_trees([one])
    assert m.parents == (-1, -1, 0) and m.valid is None and m.tokens.tolist() == [[4, 5, 6]]
    other = ([7, 8, 9], ordinal_paths((-1, 0, 1)))  # a chain
    m = merge_trees([one, other])
    # union of ordinal paths: (0,), (1,), (0,0), (0,0,0)
    assert m.parents == (-1, -1, 0, 2)
    assert m.valid.tolist() == [[True, True, True, False], [True, False, True, True]]
    assert m.tokens[0, :3].tolist() == [4, 5, 6] and m.tokens[1, [0, 2, 3]].tolist() == [7, 8, 9]
    assert m.index == [[0, 1, 2], [0, 2, 3]]
    empty = merge_trees([([], []), ([], [])])
    assert empty.tokens.shape == (2, 0) and empty.parents == ()
    ranked = merge_trees([([1, 2], [(0,), (0, 1)]), ([3, 4], [(1,), (0,)])])  # rank paths, as EAGLE gives them
    assert ranked.parents == (-1, -1, 0) and ranked.index == [[0, 2], [1, 0]]


def test_paths_of_every_node():
    assert paths((-1, 0, 0, 2)) == ((0,), (0, 1), (0, 2), (0, 2, 3))


def test_expected_accepted_chain_closed_form():
    a = 0.6
    assert expected_accepted(chain_tree(5), [a]) == pytest.approx(sum(a**d for d in range(1, 6)))
    assert math.isclose(expected_accepted(topk_tree((2,)), [0.3, 0.2]), 0.5)
