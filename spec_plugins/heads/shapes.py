"""Tree shapes for the head proposers, in "rank paths": a node is the tuple of child ranks from
the root, e.g. (0, 2) = the 3rd candidate under the 1st candidate. A static tree is a list of
rank paths; per-row dynamic trees are merged into one shared topology (the union of their rank
paths) with a per-row validity mask, because a Draft has one ``parents`` tuple per batch.
"""

from __future__ import annotations

import heapq
from typing import Sequence

Path = tuple[int, ...]


def static_tree(accuracy: Sequence[Sequence[float]], nodes: int, max_depth: int | None = None) -> list[Path]:
    """Medusa's tree construction: best-first by expected acceptance, where the acceptance
    probability of a path is the product of the per-depth rank accuracies ``accuracy[d][r]``
    (probability that head d's rank-r token is the right one). Returns ``nodes`` paths in
    topological order (parents first)."""
    depth = min(len(accuracy), max_depth or len(accuracy))
    if depth == 0 or nodes <= 0:
        return []
    chosen: list[Path] = []
    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    while heap and len(chosen) < nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < depth:
            for r in range(len(accuracy[len(path)])):
                heapq.heappush(heap, (neg * accuracy[len(path)][r], path + (r,)))
    return order(chosen)


def default_accuracy(depth: int, top_k: int) -> list[list[float]]:
    """Uncalibrated rank accuracies (used when a head has no holdout measurements)."""
    return [[0.6 * 0.85 ** d * 0.35 ** r for r in range(top_k)] for d in range(depth)]


def order(paths: Sequence[Path]) -> list[Path]:
    """Topological order: by depth, then rank path (parents always precede children)."""
    return sorted(set(paths), key=lambda p: (len(p), p))


def parents_of(paths: Sequence[Path]) -> tuple[int, ...]:
    """Parent index of every path in an ordered list (-1 = child of the pending token)."""
    index = {p: i for i, p in enumerate(paths)}
    out = []
    for p in paths:
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"rank path {p} has no parent {p[:-1]} in the tree")
        out.append(index[p[:-1]] if len(p) > 1 else -1)
    return tuple(out)


def merge_rows(rows: Sequence[Sequence[Path]]) -> tuple[list[Path], list[list[int]]]:
    """Union of per-row rank-path sets -> (shared ordered paths, per row the indices it uses)."""
    union = order([p for r in rows for p in r])
    index = {p: i for i, p in enumerate(union)}
    return union, [[index[p] for p in r] for r in rows]
