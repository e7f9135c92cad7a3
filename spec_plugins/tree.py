"""Draft trees, in one place: topology (parents -> layout, paths, masks) and shape builders.

A draft of n nodes is given by ``parents`` (-1 = child of the pending token). Node indices are
topological (a parent always precedes its children), which every helper here relies on; a chain
is ``(-1, 0, 1, ..., n-2)``.

Shapes are written the way Medusa writes them, as *rank paths*: ``(0, 2)`` is "the 3rd
candidate after the 1st candidate". A drafter with a ranked candidate list per node (Medusa
heads, token recycling's adjacency table, EAGLE's top-k) fills node ``(0, 2)`` with the
rank-2 candidate following the token at ``(0,)``.

Sizing: if the rank-r candidate at depth d is the target's token with probability ``a[d][r]``
(siblings mutually exclusive), a node is accepted with the product of ``a`` along its path and
the expected accepted length is the sum over nodes. A child never scores above its parent, so
the best N-node tree is the N best-scoring rank paths (``best_static_tree``): the tree size is
the one knob, and the cost model picks it.

Rows of a batch may draft different trees, two ways: ``merge_trees`` lays host-built trees over
one shared topology (the union of their rank paths) with a per-row ``valid`` mask;
``row_trees.RowTrees`` keeps each row's own parents on the drafting device (EAGLE-2's dynamic
trees), so no tree crosses to the host.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

RankPath = tuple[int, ...]
RowTree = tuple[list[int], list[RankPath], list[float]]  # one row's draft, best-first: tokens, rank paths, acceptance estimates


# ---- topology ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeLayout:
    """What a runtime needs of a forward's nodes (the pending token + the draft)."""

    parents: tuple[int, ...] | None  # parent index per node, -1 = child of the last committed token (None: per row)
    depth: torch.Tensor  # [N] long on the host, 0 for children of the committed prefix (the same in every row)
    ancestors: torch.Tensor  # [N, N] bool, or [B, N, N] per row: ancestors[..., i, j] = j is i or an ancestor of i
    is_chain: bool
    rows: torch.Tensor | None = None  # [B, N] long: each row's own parents, on the drafting device (RowTrees)

    @property
    def size(self) -> int:
        return int(self.depth.numel())

    def row_parents(self, b: int) -> list[int]:
        """Row ``b``'s parents (a host read of per-row trees: for runtimes that live on the host)."""
        return list(self.parents) if self.rows is None else self.rows[b].tolist()


@lru_cache(maxsize=256)
def layout(parents: tuple[int, ...]) -> TreeLayout:
    """Build (and memoise) the layout of a draft topology."""
    n = len(parents)
    depth = [0] * n
    anc = torch.zeros(n, n, dtype=torch.bool, device="cpu")
    for i, p in enumerate(parents):
        if p >= i or p < -1:
            raise ValueError(f"tree parents must be topological (-1 <= parent < index); node {i} has parent {p}")
        anc[i, i] = True
        if p >= 0:
            depth[i] = depth[p] + 1
            anc[i] |= anc[p]
    return TreeLayout(parents, torch.tensor(depth, dtype=torch.long, device="cpu"), anc, is_chain(parents))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def with_root(parents: tuple[int, ...]) -> tuple[int, ...]:
    """Parents of [root] + draft nodes, where the root is the pending (not yet cached) token."""
    return (-1,) + tuple(p + 1 for p in parents)


def children(parents: tuple[int, ...]) -> list[list[int]]:
    """Children of every node plus, at index -1 (the last list), the children of the root."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p].append(i)
    return out


@lru_cache(maxsize=256)
def paths(parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each node's path of node indices from the top of the tree down to it, built in one pass
    (what per-node logits processors read)."""
    out: list[tuple[int, ...]] = []
    for j, p in enumerate(parents):
        out.append((out[p] if p >= 0 else ()) + (j,))
    return tuple(out)


# ---- static shapes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StaticTree:
    """A static tree: ``paths[i]`` is node i's rank path, ``parents[i]`` its parent node."""

    paths: tuple[RankPath, ...]
    parents: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Candidate rank of each node among its parent's candidates (the path's last entry)."""
        return tuple(p[-1] for p in self.paths)

    @property
    def depths(self) -> tuple[int, ...]:
        """0-based depth of each node (0 = child of the pending token)."""
        return tuple(len(p) - 1 for p in self.paths)

    def truncated(self, max_depth: int) -> "StaticTree":
        """The same tree without nodes deeper than ``max_depth`` tokens."""
        return static_tree([p for p in self.paths if len(p) <= max_depth])


def static_tree(rank_paths: Sequence[Sequence[int]]) -> StaticTree:
    """Rank paths (any order) -> a StaticTree in topological order (by length, then ranks).

    Every prefix of a path must be a path too (Medusa's convention); duplicates are refused."""
    norm = [tuple(int(r) for r in p) for p in rank_paths]
    if any(len(p) == 0 for p in norm):
        raise ValueError("a rank path must have at least one entry")
    if any(r < 0 for p in norm for r in p):
        raise ValueError("ranks must be >= 0")
    if len(set(norm)) != len(norm):
        raise ValueError("duplicate rank paths")
    order = sorted(norm, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(order)}
    parents = []
    for p in order:
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"rank path {p} has no parent {p[:-1]} in the tree")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return StaticTree(tuple(order), tuple(parents))


def chain_tree(n: int) -> StaticTree:
    """A chain of n nodes: the top candidate at every depth."""
    return static_tree([(0,) * d for d in range(1, n + 1)])


def topk_tree(widths: Sequence[int]) -> StaticTree:
    """Full tree: ``widths[d]`` children for every node at depth d (e.g. (3, 2, 1) = 3 + 6 + 6)."""
    layer: list[RankPath] = [()]
    out: list[RankPath] = []
    for w in widths:
        layer = [p + (r,) for p in layer for r in range(w)]
        out.extend(layer)
    return static_tree(out)


def _table(accept: Sequence[Sequence[float]] | Sequence[float]) -> list[list[float]]:
    """``accept[d][r]``, or one row ``accept[r]`` for every depth; deeper depths reuse the last row."""
    return [list(accept)] if accept and not isinstance(accept[0], (list, tuple)) else [list(a) for a in accept]


def _prob(table: list[list[float]], d: int, r: int) -> float:
    row = table[min(d, len(table) - 1)]
    return float(row[r]) if r < len(row) else 0.0


def best_static_tree(accept: Sequence[Sequence[float]] | Sequence[float], size: int, max_depth: int,
                     max_rank: int | None = None) -> StaticTree:
    """The ``size`` rank paths with the highest acceptance probability under ``accept``.

    Best-first growth from the root; a node's score is the product along its path, which never
    exceeds its parent's, so the result is the optimal N-node tree for this model (ties go to
    the shallower, lower-rank path)."""
    if size < 0 or max_depth < 0:
        raise ValueError("size and max_depth must be >= 0")
    table = _table(accept)
    width = max_rank if max_rank is not None else max(len(r) for r in table)
    heap: list[tuple[float, int, RankPath]] = []
    tie = 0
    for r in range(width):
        if _prob(table, 0, r) > 0 and max_depth > 0:
            heapq.heappush(heap, (-_prob(table, 0, r), tie, (r,)))
            tie += 1
    chosen: list[RankPath] = []
    while heap and len(chosen) < size:
        neg, _, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < max_depth:
            for r in range(width):
                s = -neg * _prob(table, len(path), r)
                if s > 0:
                    heapq.heappush(heap, (-s, tie, path + (r,)))
                    tie += 1
    return static_tree(chosen) if chosen else StaticTree((), ())


def path_scores(tree: StaticTree, accept: Sequence[Sequence[float]] | Sequence[float]) -> list[float]:
    """Each node's probability of being accepted under the independence model of ``accept``: the
    product along its rank path."""
    table = _table(accept)
    out = []
    for path in tree.paths:
        s = 1.0
        for d, r in enumerate(path):
            s *= _prob(table, d, r)
        out.append(s)
    return out


def expected_accepted(tree: StaticTree, accept: Sequence[Sequence[float]] | Sequence[float]) -> float:
    """Expected accepted draft tokens per round under the independence model of ``accept``."""
    return sum(path_scores(tree, accept))


# ---- per-row trees over one shared topology -----------------------------------------------------
@dataclass(frozen=True)
class MergedTree:
    tokens: torch.Tensor  # [B, n] long, 0 where a row has no node
    parents: tuple[int, ...]
    valid: torch.Tensor | None  # [B, n] bool, None if every row has every node
    index: list[list[int]]  # per row: the shared index of each of the row's own nodes


def merge_trees(rows: Sequence[tuple[Sequence[int], Sequence[RankPath]]]) -> MergedTree:
    """Per-row trees (tokens, rank path of each token) -> one shared topology for a ``Draft``.

    The shared tree is the union of the rows' paths, so identical shapes cost nothing extra and
    one row equals its own tree. Rows that give (tokens, parents) pass ``ordinal_paths(parents)``."""
    union = sorted({p for _, ps in rows for p in ps}, key=lambda p: (len(p), p))
    shared = static_tree(union) if union else StaticTree((), ())
    where = {p: i for i, p in enumerate(shared.paths)}
    tokens = torch.zeros(len(rows), shared.size, dtype=torch.long, device="cpu")
    valid = torch.zeros(len(rows), shared.size, dtype=torch.bool, device="cpu")
    index = []
    for b, (toks, ps) in enumerate(rows):
        idx = [where[p] for p in ps]
        index.append(idx)
        if idx:
            tokens[b, idx] = torch.as_tensor(list(toks), dtype=torch.long, device="cpu")
            valid[b, idx] = True
    return MergedTree(tokens, shared.parents, None if bool(valid.all()) else valid, index)


def ordinal_paths(parents: Sequence[int]) -> list[RankPath]:
    """Each node's path of child ordinals (its rank among its parent's children, in index order)."""
    seen: dict[int, int] = {}
    out: list[RankPath] = []
    for p in parents:
        o = seen.get(p, 0)
        seen[p] = o + 1
        out.append((out[p] if p >= 0 else ()) + (o,))
    return out


def rank_paths(parents: Sequence[int], ranks: Sequence[int], nodes: Sequence[int]) -> list[RankPath]:
    """The rank path (rank among its parent's candidates, from the root) of each of ``nodes``:
    the key ``merge_trees`` places a node by, so rows with the same shape share positions."""
    memo: dict[int, RankPath] = {}

    def path(n: int) -> RankPath:
        if n not in memo:
            p = parents[n]
            memo[n] = (path(p) if p >= 0 else ()) + (ranks[n],)
        return memo[n]

    return [path(n) for n in nodes]
