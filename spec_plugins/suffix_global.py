"""The shared suffix index of finished requests (``GlobalIndex``): tries per scope key under one
token cap (and a node cap), evicting the oldest request first (``suffix_index`` has the tries)."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable, Sequence

from spec_plugins.suffix_index import Trie


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
