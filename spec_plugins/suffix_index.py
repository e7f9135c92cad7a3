"""Suffix indexes for suffix decoding: depth-bounded suffix tries with occurrence counts.

A trie of depth D holds every substring of up to D tokens of the sequences added to it; a node's
``count`` is how many times its string occurs. The continuation frequencies of a matched string
are its children's counts, which is what SuffixDecoding scores candidates by.

Work per token is O(D) with D fixed (24 by default), independent of the context length:
- appending a token to a sequence extends the D open suffixes that end at it (``Cursor``);
- the longest earlier-seen suffix of a row's context is tracked the same way against any trie
  (``Cursor.follow``), so a round never re-scans the context.

``GlobalIndex`` (``suffix_global``) holds finished requests under a token cap (and optionally a node cap), evicting
the oldest first; removing a request decrements the counts along its suffixes and drops nodes
that reach zero (their ids are reused, and while a trie's free ids outnumber its live nodes each
removal gives back at most twice the slots it freed, moving nodes down from the top), so each
trie's storage follows its live nodes, never its peak, without a pass over them on the decode
thread. Nodes are ids into flat lists, not objects: the garbage collector never walks them one
by one, and an index of millions of nodes adds nothing to its passes on the decode thread. A
token adds up to ``depth`` nodes; the node cap bounds memory directly (the bytes per token are
in ``docs/proposers.md``).
"""

from __future__ import annotations

from sys import getsizeof
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

ROOT = 0  # every trie's root node id
COMPACT_FLOOR = 64  # storage slots below which a trie never gives slots back (its cost per tenant: docs/serving.md)
_NONE: Mapping[int, int] = MappingProxyType({})


class Trie:
    """Substrings of up to ``depth`` tokens with occurrence counts.

    Nodes are int ids (the root is ``ROOT``) into flat per-trie lists, so the garbage collector
    sees a handful of lists per trie, never a node: ``_count[n]``, ``_tok[n]`` (the token on the
    edge into n), ``_par[n]`` (n's parent) and ``_kids[n]``: None (a leaf), an int (the only
    child, stored inline) or a dict token -> child id (a dict of ints is never GC-tracked). Freed
    ids are reused (``_free``, a stack; a free slot has count 0 and its place in that stack as
    ``_par``), and a removal that leaves more free ids than live ones gives back slots from the
    top (``_shrink``): a trie that once held many nodes does not keep that storage."""

    def __init__(self, depth: int, removable: bool = True) -> None:
        """``removable=False``: a trie that only grows (a request's own): it keeps no parent links,
        which only removal uses (about an eighth of a node's memory)."""
        self.depth = depth
        self.root = ROOT
        self.removable = removable
        self.version = 0  # bumped on every removal: cursors re-sync (ids they hold may be reused)
        self._reset()

    # ---- reading ----------------------------------------------------------------------------------
    def count(self, n: int) -> int:
        """How many times node n's string occurs."""
        return self._count[n]

    def child(self, n: int, token: int) -> int | None:
        """Node n's child on ``token``, or None."""
        k = self._kids[n]
        if k is None:
            return None
        if type(k) is int:
            return k if self._tok[k] == token else None
        return k.get(token)

    def children(self, n: int) -> Mapping[int, int]:
        """Node n's children, token -> child id, in the order they were added (read-only)."""
        k = self._kids[n]
        if k is None:
            return _NONE
        return {self._tok[k]: k} if type(k) is int else k

    def has_children(self, n: int) -> bool:
        return self._kids[n] is not None

    def walk(self, tokens: Sequence[int]) -> int | None:
        node: int | None = ROOT
        for t in tokens:
            node = self.child(node, t) if node is not None else None
        return node

    # ---- writing ----------------------------------------------------------------------------------
    def _step(self, n: int, token: int) -> int:
        """Count one more occurrence of n's string followed by ``token``; the child's id."""
        k = self._kids[n]
        if k is None:
            c = self._kids[n] = self._new(token, n)
        elif type(k) is int:
            if self._tok[k] == token:
                c = k
            else:
                c = self._new(token, n)
                self._kids[n] = {self._tok[k]: k, token: c}
        else:
            c = k.get(token)
            if c is None:
                c = k[token] = self._new(token, n)
        self._count[c] += 1
        return c

    def _new(self, token: int, parent: int) -> int:
        """A fresh node under ``parent`` (count 0): a free slot, else a new one."""
        self.nodes += 1
        if self._free:
            n = self._free.pop()
            self._tok[n], self._par[n] = token, parent
            return n
        self._count.append(0)
        self._tok.append(token)
        self._kids.append(None)
        if self._par is not None:
            self._par.append(parent)
        return len(self._count) - 1

    def extend(self, open_: list[int], token: int) -> list[int]:
        """Add one token after the open suffixes ``open_`` (deepest first, at most depth-1 of
        them); returns the new open suffixes (deepest first)."""
        step = self._step
        out = [step(n, token) for n in open_[max(0, len(open_) - self.depth + 1):]]
        out.append(step(ROOT, token))
        return out

    def add(self, tokens: Iterable[int]) -> None:
        open_: list[int] = []
        for t in tokens:
            open_ = self.extend(open_, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``: decrement every suffix path, free nodes that reach zero."""
        if not self.removable:
            raise TypeError("this trie only grows (removable=False): it keeps no parent links to remove by")
        self.version += 1
        toks, count, before = list(tokens), self._count, self.nodes
        for i in range(len(toks)):
            node, path = ROOT, []
            for t in toks[i: i + self.depth]:
                nxt = self.child(node, t)
                if nxt is None:  # already gone (a shorter path reached zero first)
                    break
                path.append((node, t, nxt))
                node = nxt
            for _, _, n in path:
                count[n] -= 1
            for parent, t, n in reversed(path):
                if count[n] <= 0 and self.child(parent, t) == n:
                    self._unlink(parent, t)
                    self._free_subtree(n)
        self._shrink(2 * (before - self.nodes))

    def _shrink(self, budget: int) -> None:
        """Give back storage slots while free ones outnumber live ones (above ``COMPACT_FLOOR``):
        each step drops the top slot, first moving its node, if live, into a free slot.
        A step frees one slot, so ``budget`` steps (twice the nodes the removal freed) restore
        the bound the removal broke (it held before: a trie only passes the floor by appending,
        with no free slot), and no removal pays for more than its own frees: never a pass over
        the live nodes, which stalled the decode thread for seconds on a large trie."""
        free, count, tok, kids, par = self._free, self._count, self._tok, self._kids, self._par
        while budget > 0 and len(count) > COMPACT_FLOOR and 2 * len(free) > len(count):
            budget -= 1
            top = len(count) - 1
            if count[top] == 0:  # free (the root is never on top here): out of the stack
                last = free.pop()
                if last != top:
                    free[par[top]], par[last] = last, par[top]
            else:  # live: it moves down into a free slot
                self._move(top, free.pop())
            count.pop(), tok.pop(), kids.pop(), par.pop()

    def _move(self, src: int, dst: int) -> None:
        """Move live node ``src`` to free slot ``dst``: its parent's link and its children's parent
        links follow. Counts, tokens and the order of each node's children are kept (a dict keeps
        a key's place when its value changes), so drafts read from the trie are unchanged. Only
        ``remove`` moves nodes, and it bumps ``version``: cursors drop the old ids."""
        count, tok, kids, par = self._count, self._tok, self._kids, self._par
        count[dst], tok[dst], kids[dst], par[dst] = count[src], tok[src], kids[src], par[src]
        k = kids[par[src]]
        if type(k) is int:
            kids[par[src]] = dst
        else:
            k[tok[src]] = dst
        k = kids[src]
        if k is not None:
            for c in (k,) if type(k) is int else k.values():
                par[c] = dst

    def _unlink(self, parent: int, token: int) -> None:
        """Drop parent's child on ``token``; one child left goes back inline, none to None. A dict
        never shrinks its table on deletions: one left over 128 bytes an entry (about 2.5 times a
        fresh copy's worst, about 50) is copied, so a node that once had many children does not
        keep their storage; the copy costs less than the deletions since the last one."""
        k = self._kids[parent]
        if type(k) is dict:
            del k[token]
            if len(k) > 1:
                if getsizeof(k) > 128 * (len(k) + 1):
                    self._kids[parent] = dict(k)  # sized for its entries, in the same order
                return
            k = next(iter(k.values())) if k else None
            self._kids[parent] = k
        else:
            self._kids[parent] = None

    def _free_subtree(self, n: int) -> None:
        """Free n and its descendants: count 0 marks a free slot, ``_par`` its place in ``_free``."""
        free = self._free
        if self._kids[n] is None:  # a leaf, the usual case: deeper nodes went first
            self._count[n], self._tok[n], self._par[n] = 0, 0, len(free)
            free.append(n)
            self.nodes -= 1
            return
        count, tok, kids, par = self._count, self._tok, self._kids, self._par
        stack = [n]
        while stack:
            x = stack.pop()
            k = kids[x]
            if k is not None:
                stack.extend((k,) if type(k) is int else k.values())
            count[x], tok[x], kids[x], par[x] = 0, 0, None, len(free)
            free.append(x)
        self.nodes -= len(free) - par[n]

    def clear(self) -> None:
        """Forget every node: a dropped key's trie stays named by stale fifo entries and must not
        keep its nodes alive there. Cursors holding it re-sync (to nothing)."""
        self.version += 1
        self._reset()

    def _reset(self) -> None:
        """Storage holding the root alone."""
        self._count: list[int] = [0]
        self._tok: list[int] = [0]
        self._kids: list[int | dict[int, int] | None] = [None]
        self._par: list[int] | None = [ROOT] if self.removable else None
        self._free: list[int] = []
        self.nodes = 0


class Cursor:
    """The suffixes of one row's context that a trie holds, deepest first, as (length, node id).

    ``follow(token)`` advances every tracked suffix by the new token in O(depth); ``resync``
    re-walks the last ``depth`` tokens (after the trie lost nodes or gained longer paths). After
    a removal, until it re-syncs, a cursor holds nothing: the ids it held may have been reused."""

    def __init__(self, trie: Trie) -> None:
        self.trie = trie
        self.active: list[tuple[int, int]] = []
        self.version = trie.version

    def follow(self, token: int) -> None:
        trie = self.trie
        if self.version != trie.version:
            self.active = []
            return
        nxt = []
        for n, node in self.active:
            c = trie.child(node, token)
            if c is not None and n + 1 <= trie.depth:
                nxt.append((n + 1, c))
        c = trie.child(ROOT, token)
        if c is not None:
            nxt.append((1, c))
        self.active = nxt

    def resync(self, context: Sequence[int]) -> None:
        tail = list(context[-self.trie.depth:])
        self.active = []
        for i in range(len(tail)):
            node = self.trie.walk(tail[i:])
            if node is not None and self.trie.count(node) > 0:
                self.active.append((len(tail) - i, node))
        self.version = self.trie.version

    def match(self, max_length: int) -> tuple[int, int | None]:
        """The longest tracked suffix of at most ``max_length`` tokens that has been followed
        by something (nodes of evicted requests have count 0 and no longer match)."""
        trie = self.trie
        if self.version != trie.version:
            return 0, None
        for n, node in self.active:
            if n <= max_length and trie.has_children(node) and trie.count(node) > 0:
                return n, node
        return 0, None


class RequestIndex:
    """One row's own trie over its prompt and output, and where its context ends in it."""

    def __init__(self, depth: int) -> None:
        self.trie = Trie(depth, removable=False)
        self.open: list[int] = []
        self.length = 0

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.open = self.trie.extend(self.open, t)
        self.length += len(tokens)

    def match(self, max_length: int) -> tuple[int, int | None]:
        """Longest suffix of the context, at most ``max_length`` tokens, seen earlier with a
        continuation: its current occurrence has no child yet, so any child is an earlier one's."""
        n = len(self.open)
        for i in range(max(0, n - max_length), n):  # deepest first
            if self.trie.has_children(self.open[i]):
                return n - i, self.open[i]
        return 0, None
