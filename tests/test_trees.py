"""Tree shapes: static rank-path trees, best-N sizing, EAGLE-2 dynamic selection, batch merging."""

from __future__ import annotations

import math

import pytest
import torch

from spec_plugins.tree import layout
from spec_plugins.trees import (
    DynamicTree,
    best_static_tree,
    chain_tree,
    expected_accepted,
    merge_rows,
    merge_rows_indexed,
    static_tree,
    top_nodes,
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


def _brute_eagle2(logq, tokens, k, depth, keep):
    """Reference EAGLE-2 on an explicit table: logq[context-token][child] etc., scalar code."""
    nodes = []  # (token, parent, score)
    layer = [(t, -1, logq[0][j]) for j, t in enumerate(tokens[0][:k])]
    nodes.extend(layer)
    layer_ids = list(range(len(layer)))
    for _ in range(depth - 1):
        best = sorted(layer_ids, key=lambda i: -nodes[i][2])[:k]
        new_ids = []
        for i in best:
            tok = nodes[i][0]
            for j in range(k):
                nodes.append((tokens[tok][j], i, nodes[i][2] + logq[tok][j]))
                new_ids.append(len(nodes) - 1)
        layer_ids = new_ids
    kept = top_nodes([n[1] for n in nodes], [n[2] for n in nodes], keep)
    return {_path(nodes, i) for i in kept}


def _path(nodes, i):
    out = []
    while i >= 0:
        out.append(nodes[i][0])
        i = nodes[i][1]
    return tuple(out[::-1])


@pytest.mark.parametrize("seed,k,depth,keep", [(0, 3, 4, 10), (1, 2, 5, 7), (2, 4, 3, 20)])
def test_dynamic_tree_matches_reference_eagle2(seed, k, depth, keep):
    """A fixed "draft model": the distribution after token t is row t of a table; root = token 0."""
    g = torch.Generator().manual_seed(seed)
    V = 12
    logq = (torch.randn(V, V, generator=g) * 2).log_softmax(-1)
    top = logq.topk(k, -1)
    want = _brute_eagle2(top.values.tolist(), top.indices.tolist(), k, depth, keep)
    t = DynamicTree(batch=1)
    t.add_layer(None, top.indices[0][None], top.values[0][None])
    for _ in range(depth - 1):
        nodes = t.frontier(k)
        toks = t.tokens.gather(1, nodes)
        t.add_layer(nodes, top.indices[toks], top.values[toks])
    out_tok, parents, valid = t.select(keep)
    assert valid is None and len(parents) == len(want)
    layout(parents)
    got = set()
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(int(out_tok[0, j]))
            j = parents[j]
        got.add(tuple(path[::-1]))
    assert got == want


def test_dynamic_tree_batch_rows_get_their_own_best_nodes():
    B = 3
    t = DynamicTree(batch=B)
    tok = torch.tensor([[1, 2], [3, 4], [5, 6]])
    lp = torch.log(torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.2, 0.8]]))
    ids = t.add_layer(None, tok, lp)
    assert ids.shape == (B, 2)
    nodes = t.frontier(1)  # best child of the root per row
    assert nodes.tolist() == [[0], [0], [1]]
    t.add_layer(nodes, torch.tensor([[[7, 8]], [[9, 10]], [[11, 12]]]),
                torch.log(torch.tensor([[[0.6, 0.4]], [[0.99, 0.01]], [[0.5, 0.5]]])))
    tokens, parents, valid = t.select(3)
    # row 0 keeps 1 (0.9), 1->7 (0.54), 1->8 (0.36): a 1-2 shape; row 1: 3, 4, 3->9; row 2: 6, 6->11, 6->12
    rows = []
    for b in range(B):
        got = set()
        for i in range(len(parents)):
            if valid is None or valid[b, i]:
                path, j = [], i
                while j >= 0:
                    path.append(int(tokens[b, j]))
                    j = parents[j]
                got.add(tuple(path[::-1]))
        rows.append(got)
    assert rows[0] == {(1,), (1, 7), (1, 8)}
    assert rows[1] == {(3,), (4,), (3, 9)}
    assert rows[2] == {(6,), (6, 11), (6, 12)}


def test_top_nodes_is_ancestor_closed_even_with_bad_scores():
    parents = [-1, -1, 0, 0, 2]
    scores = [0.1, 0.5, 0.9, 0.2, 5.0]  # children outscore parents
    kept = top_nodes(parents, scores, 3)
    assert kept == [0, 1, 2]
    for i in kept:
        assert parents[i] == -1 or parents[i] in kept


def test_merge_rows_union_and_identity():
    one = ([4, 5, 6], (-1, -1, 0))
    tokens, parents, valid = merge_rows([one])
    assert parents == (-1, -1, 0) and valid is None and tokens.tolist() == [[4, 5, 6]]
    other = ([7, 8, 9], (-1, 0, 1))  # a chain
    tokens, parents, valid, index = merge_rows_indexed([one, other])
    # union of ordinal paths: (0,), (1,), (0,0), (0,0,0)
    assert parents == (-1, -1, 0, 2)
    assert valid.tolist() == [[True, True, True, False], [True, False, True, True]]
    assert tokens[0, :3].tolist() == [4, 5, 6] and tokens[1, [0, 2, 3]].tolist() == [7, 8, 9]
    assert index == [[0, 1, 2], [0, 2, 3]]
    empty = merge_rows([([], ()), ([], ())])
    assert empty[0].shape == (2, 0) and empty[1] == ()


def test_expected_accepted_chain_closed_form():
    a = 0.6
    assert expected_accepted(chain_tree(5), [a]) == pytest.approx(sum(a**d for d in range(1, 6)))
    assert math.isclose(expected_accepted(topk_tree((2,)), [0.3, 0.2]), 0.5)
