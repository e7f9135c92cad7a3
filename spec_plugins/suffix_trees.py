"""Speculation trees from a suffix trie: best-first growth from a matched node by continuation
frequencies (``speculate``), and one tree from several speculations over the same context
(``union``). The tries themselves are ``suffix_index``'s."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from spec_plugins.suffix_index import Trie
from spec_plugins.tree import paths


@dataclass(frozen=True)
class Speculation:
    """A draft tree from one matched node: tokens, parents (-1 = child of the pending token) and
    each node's estimated probability of being accepted (product of continuation frequencies)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    match_length: int

    @property
    def score(self) -> float:
        """Expected accepted tokens under the frequency estimates."""
        return sum(self.probs)


EMPTY = Speculation((), (), (), 0)


def speculate(trie: Trie, node: int | None, match_length: int, max_nodes: int, max_depth: int,
              min_prob: float) -> Speculation:
    """Best-first growth from ``trie``'s ``node``: a candidate's probability is its parent's times its
    count over its siblings' total; the most probable candidate joins next, until ``max_nodes``
    nodes or no candidate reaches ``min_prob``. A child never scores above its parent, so the
    result is closed under ancestors and each prefix of it is the best tree of that size."""
    if node is None or max_nodes <= 0 or max_depth <= 0:
        return EMPTY
    heap: list[tuple[float, int, int, int, int, int]] = []  # (-p, tie, parent index, depth, node, token)
    tie = 0
    count = trie.count

    def push(parent_node: int, p: float, parent: int, depth: int) -> None:
        nonlocal tie
        kids = trie.children(parent_node)
        if not kids or depth >= max_depth:
            return
        total = sum(count(c) for c in kids.values())
        for tok, c in kids.items():
            q = p * (count(c) / total)  # never above p (p * c.count / total can round up)
            if q >= min_prob:
                heapq.heappush(heap, (-q, tie, parent, depth, c, tok))
                tie += 1

    toks: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    push(node, 1.0, -1, 0)
    while heap and len(toks) < max_nodes:
        negp, _, parent, depth, c, tok = heapq.heappop(heap)
        toks.append(tok)
        parents.append(parent)
        probs.append(-negp)
        push(c, -negp, len(toks) - 1, depth + 1)
    return Speculation(tuple(toks), tuple(parents), tuple(probs), match_length)


def union(specs: Sequence[Speculation]) -> Speculation:
    """One tree from speculations over the same context (this request's index and the global
    one): a path drafted by several keeps its highest estimate. Ordered by estimate, ties
    shallower first, so it stays best-first and closed under ancestors (under a max, a child
    still never scores above its parent) and any prefix is a valid tree for the sizer to cut.
    Replayed on the repetitive workload this beat drafting the better of the two trees alone,
    most where a request's own text and earlier requests continue a context differently."""
    specs = [s for s in specs if s.tokens]
    if len(specs) <= 1:
        return specs[0] if specs else EMPTY
    best: dict[tuple[int, ...], float] = {}  # token path -> estimate
    for s in specs:
        for nodes, p in zip(paths(s.parents), s.probs):
            path = tuple(s.tokens[j] for j in nodes)
            best[path] = max(best.get(path, 0.0), p)
    for path in sorted(best, key=len):  # rounding must not lift a child above its parent
        if len(path) > 1:
            best[path] = min(best[path], best[path[:-1]])
    order = sorted(best, key=lambda path: (-best[path], len(path)))
    index = {path: i for i, path in enumerate(order)}
    parents = tuple(index[path[:-1]] if len(path) > 1 else -1 for path in order)
    return Speculation(tuple(path[-1] for path in order), parents, tuple(best[path] for path in order),
                       max(s.match_length for s in specs))
