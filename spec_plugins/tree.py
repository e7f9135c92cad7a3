"""Draft topology: parents -> depths, ancestor mask, paths. Computed once per shape, cached.

A chain of n nodes is ``parents = (-1, 0, 1, ..., n-2)``. Node indices are topological
(a parent always precedes its children), which every helper here relies on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class TreeLayout:
    parents: tuple[int, ...]  # parent index per node, -1 = child of the last committed token
    depth: torch.Tensor  # [N] long, 0 for children of the committed prefix
    ancestors: torch.Tensor  # [N, N] bool, ancestors[i, j] = j is i or an ancestor of i
    is_chain: bool

    @property
    def size(self) -> int:
        return len(self.parents)


@lru_cache(maxsize=256)
def layout(parents: tuple[int, ...]) -> TreeLayout:
    """Build (and memoise) the layout of a draft topology."""
    n = len(parents)
    depth = [0] * n
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= i or p < -1:
            raise ValueError(f"tree parents must be topological (-1 <= parent < index); node {i} has parent {p}")
        anc[i, i] = True
        if p >= 0:
            depth[i] = depth[p] + 1
            anc[i] |= anc[p]
    is_chain = all(p == i - 1 for i, p in enumerate(parents))
    return TreeLayout(parents, torch.tensor(depth, dtype=torch.long), anc, is_chain)


def chain(n: int) -> TreeLayout:
    return layout(tuple(range(-1, n - 1)))


def with_root(parents: tuple[int, ...]) -> tuple[int, ...]:
    """Parents of [root] + draft nodes, where the root is the pending (not yet cached) token."""
    return (-1,) + tuple(p + 1 for p in parents)


def children(parents: tuple[int, ...]) -> list[list[int]]:
    """Children of every node plus, at index -1 (the last list), the children of the root."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p].append(i)
    return out


def path_to(parents: tuple[int, ...], node: int) -> list[int]:
    """Node indices from the top of the tree down to ``node`` inclusive."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
