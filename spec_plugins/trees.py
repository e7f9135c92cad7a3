"""Token-tree shapes for tree drafters: static (Medusa-style rank paths) and dynamic (EAGLE-2).

Every helper returns the topology as ``parents`` (see ``spec_plugins.tree``: -1 = child of the
pending token, node indices topological), so any tree lands in ``Draft`` unchanged.

Static trees are written the way Medusa writes them: a list of *rank paths*. The path
``(0, 2)`` is "the 3rd candidate after the 1st candidate": a drafter with a ranked candidate list
per node (Medusa heads, token recycling's adjacency table) fills node ``(0, 2)`` with the
candidate of rank 2 following the token it put at ``(0,)``.

Sizing: under the usual independence model (the candidate of rank r at depth d is the target's
choice with probability ``a[d][r]``, siblings mutually exclusive) the expected number of
accepted tokens is the sum over nodes of the product of ``a`` along the node's path. Children
never score above their parent, so the best tree of N nodes is simply the N best-scoring rank
paths (``best_static_tree``): the tree size is the one knob, and the cost model picks it.

Dynamic trees (EAGLE-2): expand the best nodes of each layer by cumulative draft log-probability,
top-k children each, up to a depth limit, then keep the best N nodes of all that were scored
(``DynamicTree``). Again ancestors score at least as high as descendants, so the kept set is a
tree. Rows of a batch get different trees; ``merge_rows`` lays them over one shared topology
(the union of their child-ordinal paths) with a per-row ``valid`` mask.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

RankPath = tuple[int, ...]


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


def static_tree(paths: Sequence[Sequence[int]]) -> StaticTree:
    """Rank paths (any order) -> a StaticTree in topological order (by length, then ranks).

    Every prefix of a path must be a path too (Medusa's convention); duplicates are refused."""
    norm = [tuple(int(r) for r in p) for p in paths]
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
        if len(p) == 1:
            parents.append(-1)
        elif p[:-1] in index:
            parents.append(index[p[:-1]])
        else:
            raise ValueError(f"rank path {p} has no parent {p[:-1]} in the tree")
    return StaticTree(tuple(order), tuple(parents))


def chain_tree(n: int) -> StaticTree:
    """A chain of n nodes: the top candidate at every depth."""
    return static_tree([(0,) * d for d in range(1, n + 1)])


def topk_tree(widths: Sequence[int]) -> StaticTree:
    """Full tree: ``widths[d]`` children for every node at depth d (e.g. (3, 2, 1) = 3 + 6 + 6)."""
    layer: list[RankPath] = [()]
    paths: list[RankPath] = []
    for w in widths:
        layer = [p + (r,) for p in layer for r in range(w)]
        paths.extend(layer)
    return static_tree(paths)


def best_static_tree(accept: Sequence[Sequence[float]] | Sequence[float], size: int, max_depth: int,
                     max_rank: int | None = None) -> StaticTree:
    """The ``size`` rank paths with the highest acceptance probability under ``accept``.

    ``accept[d][r]`` (or ``accept[r]`` for every depth) is the probability that the rank-r
    candidate at depth d is the target's token. Best-first growth from the root; a node's score
    is the product along its path, which never exceeds its parent's, so the result is the
    optimal N-node tree for this model (ties go to the shallower, lower-rank path)."""
    if size < 0 or max_depth < 0:
        raise ValueError("size and max_depth must be >= 0")
    table = [list(accept)] if accept and not isinstance(accept[0], (list, tuple)) else [list(a) for a in accept]

    def prob(d: int, r: int) -> float:
        row = table[min(d, len(table) - 1)]
        return float(row[r]) if r < len(row) else 0.0

    width = max_rank if max_rank is not None else max(len(r) for r in table)
    heap: list[tuple[float, int, RankPath]] = []
    tie = 0
    for r in range(width):
        if prob(0, r) > 0 and max_depth > 0:
            heapq.heappush(heap, (-prob(0, r), tie, (r,)))
            tie += 1
    chosen: list[RankPath] = []
    while heap and len(chosen) < size:
        neg, _, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < max_depth:
            for r in range(width):
                s = -neg * prob(len(path), r)
                if s > 0:
                    heapq.heappush(heap, (-s, tie, path + (r,)))
                    tie += 1
    return static_tree(chosen)


def expected_accepted(tree: StaticTree, accept: Sequence[Sequence[float]] | Sequence[float]) -> float:
    """Expected accepted draft tokens per round under the independence model of ``accept``."""
    table = [list(accept)] if accept and not isinstance(accept[0], (list, tuple)) else [list(a) for a in accept]
    total = 0.0
    for path in tree.paths:
        s = 1.0
        for d, r in enumerate(path):
            row = table[min(d, len(table) - 1)]
            s *= row[r] if r < len(row) else 0.0
        total += s
    return total


# ---- dynamic trees (EAGLE-2) ----------------------------------------------------------------


class DynamicTree:
    """EAGLE-2 tree growth for a batch; every row grows the same number of nodes per layer.

    Usage (``expand`` = one draft step for a set of nodes)::

        t = DynamicTree(batch=B)
        t.add_layer(parent=None, tokens=top_tok, logp=top_logp)     # [B, k] children of the root
        for _ in range(depth - 1):
            nodes = t.frontier(k)                                   # [B, k] best nodes of the last layer
            tok, lp = expand(nodes)                                 # [B, k, k] their top-k children
            t.add_layer(parent=nodes, tokens=tok, logp=lp)
        tokens, parents, valid = t.select(keep=N)                   # ready for Draft(...)

    Scores are cumulative log-probabilities (log q along the path)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.tokens = torch.empty(batch, 0, dtype=torch.long)
        self.parent = torch.empty(batch, 0, dtype=torch.long)  # node index, -1 = root
        self.score = torch.empty(batch, 0)
        self.layers: list[tuple[int, int]] = []  # (first node index, count) per layer

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def add_layer(self, parent: torch.Tensor | None, tokens: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Add children: ``tokens``/``logp`` [B, m, k] for ``parent`` node ids [B, m] (or [B, k]
        children of the root when ``parent`` is None). Returns the new nodes' ids [B, m*k]."""
        B = self.batch
        if parent is None:
            tokens, logp = tokens.reshape(B, 1, -1), logp.reshape(B, 1, -1)
            par = torch.full((B, 1), -1, dtype=torch.long)
            base = torch.zeros(B, 1)
        else:
            par = parent.long()
            base = self.score.gather(1, par)
        m, k = tokens.shape[1], tokens.shape[2]
        start = self.size
        self.tokens = torch.cat([self.tokens, tokens.reshape(B, m * k).long().cpu()], 1)
        self.parent = torch.cat([self.parent, par.cpu()[:, :, None].expand(B, m, k).reshape(B, m * k)], 1)
        self.score = torch.cat([self.score, (base.cpu()[:, :, None] + logp.float().cpu()).reshape(B, m * k)], 1)
        self.layers.append((start, m * k))
        return torch.arange(start, start + m * k).expand(B, m * k)

    def frontier(self, k: int) -> torch.Tensor:
        """The ``k`` best-scoring nodes of the last layer, per row: ids [B, min(k, layer)]."""
        start, count = self.layers[-1]
        top = self.score[:, start : start + count].topk(min(k, count), dim=1).indices
        return top + start

    def select(self, keep: int) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None]:
        """Keep each row's ``keep`` best nodes; return (tokens [B, n], parents, valid [B, n] or None)."""
        rows = []
        for b in range(self.batch):
            kept = top_nodes(self.parent[b].tolist(), self.score[b].tolist(), keep)
            old = {j: i for i, j in enumerate(kept)}
            par = tuple(old[self.parent[b, j].item()] if self.parent[b, j] >= 0 else -1 for j in kept)
            rows.append((self.tokens[b, kept].tolist(), par))
        return merge_rows(rows)


def top_nodes(parents: Sequence[int], scores: Sequence[float], n: int) -> list[int]:
    """Indices of the ``n`` best nodes that form a tree, in topological order.

    Best-first from the root, so a node is taken only after its parent even when scores tie or
    a child scores higher (which cannot happen with log-probabilities but is allowed here)."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    heap = [(-scores[c], c) for c in kids.get(-1, [])]
    heapq.heapify(heap)
    out: list[int] = []
    while heap and len(out) < n:
        _, i = heapq.heappop(heap)
        out.append(i)
        for c in kids.get(i, []):
            heapq.heappush(heap, (-scores[c], c))
    return sorted(out)  # input indices are topological, so sorting keeps parents first


def merge_rows(rows: Sequence[tuple[Sequence[int], Sequence[int]]]
               ) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None]:
    """Per-row trees (tokens, parents) -> one shared topology for a batched ``Draft``.

    A node is identified by its child-ordinal path (1st child of the 2nd child of ...); the shared
    tree is the union of those paths, so identical shapes cost nothing extra and one row equals
    its own tree. Returns tokens [B, n] (0 where a row has no node), parents, valid (None if all)."""
    tokens, parents, valid, _ = merge_rows_indexed(rows)
    return tokens, parents, valid


def merge_rows_indexed(rows: Sequence[tuple[Sequence[int], Sequence[int]]]
                       ) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None, list[list[int]]]:
    """``merge_rows`` plus, per row, the shared index of each of the row's own nodes."""
    ordinal_paths = [_ordinal_paths(par) for _, par in rows]
    union: set[RankPath] = set().union(*ordinal_paths) if ordinal_paths else set()
    if not union:
        return torch.zeros(len(rows), 0, dtype=torch.long), (), None, [[] for _ in rows]
    shared = static_tree(sorted(union))
    where = {p: i for i, p in enumerate(shared.paths)}
    tokens = torch.zeros(len(rows), shared.size, dtype=torch.long)
    valid = torch.zeros(len(rows), shared.size, dtype=torch.bool)
    index = []
    for b, ((toks, _), paths) in enumerate(zip(rows, ordinal_paths)):
        idx = [where[p] for p in paths]
        index.append(idx)
        if idx:
            tokens[b, idx] = torch.as_tensor(list(toks), dtype=torch.long)
            valid[b, idx] = True
    return tokens, shared.parents, None if bool(valid.all()) else valid, index


def _ordinal_paths(parents: Sequence[int]) -> list[RankPath]:
    """Each node's path of child ordinals (its rank among its parent's children, in index order)."""
    seen: dict[int, int] = {}
    out: list[RankPath] = []
    for p in parents:
        o = seen.get(p, 0)
        seen[p] = o + 1
        out.append((out[p] if p >= 0 else ()) + (o,))
    return out
