"""Suffix indexes for suffix decoding: depth-bounded suffix tries with occurrence counts.

A trie of depth D holds every substring of up to D tokens of the sequences added to it; a node's
``count`` is how many times its string occurs. The continuation frequencies of a matched string
are its children's counts, which is what SuffixDecoding scores candidates by.

Work per token is O(D) with D fixed (24 by default), independent of the context length:
- appending a token to a sequence extends the D open suffixes that end at it (``Cursor``);
- the longest earlier-seen suffix of a row's context is tracked the same way against any trie
  (``Cursor.follow``), so a round never re-scans the context.

``GlobalIndex`` holds finished requests under a token cap (and optionally a node cap), evicting
the oldest first; removing a request decrements the counts along its suffixes and drops nodes
that reach zero, so memory follows the caps. Memory is per trie node: about 265 bytes each
(CPython objects), and a token adds up to ``depth`` nodes (about 26 on real text at depth 32,
7 KB a token); the node cap bounds it directly.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from spec_plugins.tree import paths


class Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] | None = None

    def child(self, token: int) -> "Node | None":
        return self.children.get(token) if self.children else None


class Trie:
    """Substrings of up to ``depth`` tokens with occurrence counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()
        self.nodes = 0
        self.version = 0  # bumped on every removal: cursors re-sync (nodes they hold may be gone)

    def _step(self, node: Node, token: int) -> Node:
        if node.children is None:
            node.children = {}
        nxt = node.children.get(token)
        if nxt is None:
            nxt = node.children[token] = Node()
            self.nodes += 1
        nxt.count += 1
        return nxt

    def extend(self, open_: list[Node], token: int) -> list[Node]:
        """Add one token after the open suffixes ``open_`` (deepest first, at most depth-1 of
        them); returns the new open suffixes (deepest first)."""
        out = [self._step(n, token) for n in open_[max(0, len(open_) - self.depth + 1):]]
        out.append(self._step(self.root, token))
        return out

    def add(self, tokens: Iterable[int]) -> None:
        open_: list[Node] = []
        for t in tokens:
            open_ = self.extend(open_, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``: decrement every suffix path, drop nodes that reach zero."""
        self.version += 1
        toks = list(tokens)
        for i in range(len(toks)):
            node = self.root
            path = []
            for t in toks[i: i + self.depth]:
                nxt = node.child(t)
                if nxt is None:  # already gone (a shorter path reached zero first)
                    break
                path.append((node, t, nxt))
                node = nxt
            for parent, t, n in path:
                n.count -= 1
            for parent, t, n in reversed(path):
                if n.count <= 0 and parent.children is not None and parent.children.get(t) is n:
                    self.nodes -= _size(n)
                    del parent.children[t]

    def clear(self) -> None:
        """Forget every node: a dropped key's trie stays named by stale fifo entries and must not
        keep its nodes alive there. Cursors holding it re-sync (to nothing)."""
        self.version += 1
        self.root = Node()
        self.nodes = 0

    def walk(self, tokens: Sequence[int]) -> Node | None:
        node: Node | None = self.root
        for t in tokens:
            node = node.child(t) if node is not None else None
        return node


def _size(n: Node) -> int:
    stack, total = [n], 0
    while stack:
        x = stack.pop()
        total += 1
        if x.children:
            stack.extend(x.children.values())
    return total


class Cursor:
    """The suffixes of one row's context that a trie holds, deepest first, as (length, node).

    ``follow(token)`` advances every tracked suffix by the new token in O(depth); ``resync``
    re-walks the last ``depth`` tokens (after the trie lost nodes or gained longer paths)."""

    def __init__(self, trie: Trie) -> None:
        self.trie = trie
        self.active: list[tuple[int, Node]] = []
        self.version = trie.version

    def follow(self, token: int) -> None:
        nxt = []
        for n, node in self.active:
            c = node.child(token)
            if c is not None and n + 1 <= self.trie.depth:
                nxt.append((n + 1, c))
        c = self.trie.root.child(token)
        if c is not None:
            nxt.append((1, c))
        self.active = nxt

    def resync(self, context: Sequence[int]) -> None:
        tail = list(context[-self.trie.depth:])
        self.active = []
        for i in range(len(tail)):
            node = self.trie.walk(tail[i:])
            if node is not None and node.count > 0:
                self.active.append((len(tail) - i, node))
        self.version = self.trie.version

    def match(self, max_length: int) -> tuple[int, Node | None]:
        """The longest tracked suffix of at most ``max_length`` tokens that has been followed
        by something (nodes of evicted requests have count 0 and no longer match)."""
        for n, node in self.active:
            if n <= max_length and node.children and node.count > 0:
                return n, node
        return 0, None


class RequestIndex:
    """One row's own trie over its prompt and output, and where its context ends in it."""

    def __init__(self, depth: int) -> None:
        self.trie = Trie(depth)
        self.open: list[Node] = []
        self.length = 0

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.open = self.trie.extend(self.open, t)
        self.length += len(tokens)

    def match(self, max_length: int) -> tuple[int, Node | None]:
        """Longest suffix of the context, at most ``max_length`` tokens, seen earlier with a
        continuation: its current occurrence has no child yet, so any child is an earlier one's."""
        n = len(self.open)
        for i in range(max(0, n - max_length), n):  # deepest first
            if self.open[i].children:
                return n - i, self.open[i]
        return 0, None


@dataclass
class IndexStats:
    requests: int = 0
    tokens: int = 0
    nodes: int = 0
    evicted_requests: int = 0
    evicted_keys: int = 0  # scope keys (tenants) dropped whole as the least recently used
    lookups: int = 0
    hits: int = 0  # lookups that matched a suffix with a continuation

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class GlobalIndex:
    """Tries over finished requests, one per scope key (one key for ``global``; the tenant for
    ``tenant``), under one token cap shared by all keys, and a node cap if ``max_nodes`` is given
    (what memory follows): the oldest request goes first until both hold.

    A key's trie exists only while it holds a request: looking up a key that holds none gives an
    empty trie without storing it, and a key whose last request is evicted is dropped. At most
    ``max_keys`` keys are held; a new one evicts the least recently used (added to or looked up)
    with all its requests, so a client rotating tenant keys can neither grow the index past the
    bound nor slow an add: sizes are running counts, never sums over keys."""

    def __init__(self, depth: int, max_tokens: int, max_keys: int | None = None, max_nodes: int | None = None) -> None:
        self.depth, self.max_tokens, self.max_keys, self.max_nodes = depth, max_tokens, max_keys, max_nodes
        self.tries: OrderedDict[Hashable, Trie] = OrderedDict()  # least recently used first
        self.held: dict[Hashable, list[int]] = {}  # per key: [requests, tokens]
        self.fifo: deque[tuple[Hashable, Trie, tuple[int, ...]]] = deque()  # entries of dropped keys go stale
        self.stale_tokens = 0  # tokens of the stale fifo entries (their tries are cleared on drop)
        self.stats = IndexStats()
        self.epoch = 0  # bumped on every change: row cursors re-sync to find the new matches
        self._empty = Trie(depth)  # what a key holding nothing looks like (never added to)

    def trie(self, key: Hashable) -> Trie:
        """The key's trie (an empty one, not stored, if the key holds nothing); marks it used."""
        t = self.tries.get(key)
        if t is None:
            return self._empty
        self.tries.move_to_end(key)
        return t

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        toks = tuple(tokens)[-self.max_tokens:]
        if not toks:
            return
        t = self.tries.get(key)
        if t is None:
            t = self.tries[key] = Trie(self.depth)
            self.held[key] = [0, 0]
            while self.max_keys is not None and len(self.tries) > self.max_keys:
                self._drop(next(iter(self.tries)))
        self.tries.move_to_end(key)
        before = t.nodes
        t.add(toks)
        self.stats.nodes += t.nodes - before
        self.epoch += 1
        self.fifo.append((key, t, toks))
        self._count(key, 1, len(toks))
        while self._over():
            old_key, old_trie, old = self.fifo.popleft()
            if self.tries.get(old_key) is not old_trie:
                self.stale_tokens -= len(old)
                continue  # its key was dropped whole (``_drop``): already uncounted
            before = old_trie.nodes
            old_trie.remove(old)
            self.stats.nodes -= before - old_trie.nodes
            self.stats.evicted_requests += 1
            if self._count(old_key, -1, -len(old)) == 0:
                del self.tries[old_key], self.held[old_key]

    def _over(self) -> bool:
        """Whether the index holds more than its caps allow (a request over the node cap on its
        own is evicted whole: the index then holds none rather than break the bound)."""
        return self.stats.tokens > self.max_tokens or (self.max_nodes is not None and self.stats.nodes > self.max_nodes)

    def _count(self, key: Hashable, requests: int, tokens: int) -> int:
        """Adjust the key's and the index's running counts; the key's requests left."""
        held = self.held[key]
        held[0] += requests
        held[1] += tokens
        self.stats.requests += requests
        self.stats.tokens += tokens
        return held[0]

    def _drop(self, key: Hashable) -> None:
        """Evict a key with every request it holds (the least recently used, over ``max_keys``)."""
        t = self.tries.pop(key)
        requests, tokens = self.held.pop(key)
        self.stats.requests -= requests
        self.stats.tokens -= tokens
        self.stats.nodes -= t.nodes
        self.stats.evicted_requests += requests
        self.stats.evicted_keys += 1
        t.clear()  # its stale fifo entries keep only the emptied trie, never its nodes
        self.stale_tokens += tokens
        self.epoch += 1
        if len(self.fifo) > 2 * self.stats.requests + 64 or self.stale_tokens > self.max_tokens:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale fifo entries. Run when they outnumber the live ones (plus a slack) or
        hold more tokens than the cap, so each costs amortised O(1) per entry or token added and
        stale entries hold at most about the cap in tokens besides the live ones."""
        self.fifo = deque(e for e in self.fifo if self.tries.get(e[0]) is e[1])
        self.stale_tokens = 0


# ---- speculation trees ----------------------------------------------------------------------------
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


def speculate(node: Node | None, match_length: int, max_nodes: int, max_depth: int, min_prob: float) -> Speculation:
    """Best-first growth from ``node``: a candidate's probability is its parent's times its
    count over its siblings' total; the most probable candidate joins next, until ``max_nodes``
    nodes or no candidate reaches ``min_prob``. A child never scores above its parent, so the
    result is closed under ancestors and each prefix of it is the best tree of that size."""
    if node is None or max_nodes <= 0 or max_depth <= 0:
        return EMPTY
    heap: list[tuple[float, int, int, int, Node, int]] = []  # (-p, tie, parent index, depth, node, token)
    tie = 0

    def push(parent_node: Node, p: float, parent: int, depth: int) -> None:
        nonlocal tie
        kids = parent_node.children
        if not kids or depth >= max_depth:
            return
        total = sum(c.count for c in kids.values())
        for tok, c in kids.items():
            q = p * (c.count / total)  # never above p (p * c.count / total can round up)
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
