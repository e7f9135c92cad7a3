"""Suffix tries keep no GC-tracked object per node: building a row's index or filling the global
one must not hand the collector hundreds of thousands of objects to walk on the decode thread.
Their counts, evictions, storage and speculations stay what they were: checked against brute-force
substring counts and against the previous object-per-node trie (kept here as the reference)."""

from __future__ import annotations

import gc
import heapq
import random

from test_suffix import substring_counts, trie_counts

from spec_plugins.suffix_global import GlobalIndex
from spec_plugins.suffix_index import Cursor, RequestIndex, Trie
from spec_plugins.suffix_trees import Speculation, speculate


# ---- the reference: the object-per-node trie and speculate this storage replaced ---------------------
class RefNode:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, RefNode] = {}


class RefTrie:
    """A node object per substring, a dict of children per node, nodes dropped at count zero."""

    def __init__(self, depth: int) -> None:
        self.depth, self.root = depth, RefNode()

    def add(self, tokens: list[int]) -> None:
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i: i + self.depth]:
                node = node.children.setdefault(t, RefNode())
                node.count += 1

    def remove(self, tokens: list[int]) -> None:
        for i in range(len(tokens)):
            node, path = self.root, []
            for t in tokens[i: i + self.depth]:
                path.append((node, t))
                node = node.children[t]
            for parent, t in reversed(path):
                child = parent.children[t]
                child.count -= 1
                if child.count == 0:
                    del parent.children[t]

    def walk(self, tokens: list[int]) -> RefNode | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node


def ref_speculate(node: RefNode, match_length: int, max_nodes: int, max_depth: int, min_prob: float) -> Speculation:
    """Best-first growth by continuation frequency, as the object-per-node trie did it."""
    heap, tie = [], 0
    toks, parents, probs = [], [], []

    def push(parent_node: RefNode, p: float, parent: int, depth: int) -> None:
        nonlocal tie
        kids = parent_node.children
        if not kids or depth >= max_depth:
            return
        total = sum(c.count for c in kids.values())
        for tok, c in kids.items():
            q = p * (c.count / total)
            if q >= min_prob:
                heapq.heappush(heap, (-q, tie, parent, depth, c, tok))
                tie += 1

    push(node, 1.0, -1, 0)
    while heap and len(toks) < max_nodes:
        negp, _, parent, depth, c, tok = heapq.heappop(heap)
        toks.append(tok)
        parents.append(parent)
        probs.append(-negp)
        push(c, -negp, len(toks) - 1, depth + 1)
    return Speculation(tuple(toks), tuple(parents), tuple(probs), match_length)


def tracked_growth(build) -> int:
    """How many more GC-tracked objects exist after ``build()`` than before (what it keeps)."""
    gc.collect()
    before = len(gc.get_objects())
    kept = build()
    gc.collect()
    grown = len(gc.get_objects()) - before
    del kept
    return grown


def storage_is_exact(trie: Trie) -> None:
    """The trie's slots are its root, its live nodes (exactly the ones its root reaches) and its
    free list, nothing else."""
    live, stack = set(), [trie.root]
    while stack:
        n = stack.pop()
        live.add(n)
        stack.extend(trie.children(n).values())
    assert len(live) - 1 == trie.nodes
    assert not live & set(trie._free) and len(set(trie._free)) == len(trie._free)
    assert len(trie._count) == len(live) + len(trie._free)


# ---- 1. no GC-tracked object per node ----------------------------------------------------------------
def test_building_tries_keeps_no_gc_tracked_object_per_node():
    rng = random.Random(0)
    seqs = [[rng.randrange(1000) for _ in range(3000)] for _ in range(4)]

    def trie() -> Trie:
        t = Trie(32)
        t.add(seqs[0])
        return t

    def row() -> RequestIndex:
        idx = RequestIndex(32)
        idx.extend(seqs[1])
        return idx

    def index() -> GlobalIndex:
        g = GlobalIndex(32, max_tokens=7000)
        for s in seqs:  # the fourth evicts the first two
            g.add("*", s)
        cur = Cursor(g.trie("*"))
        cur.resync(seqs[3][:100])
        return g, cur

    for build in (trie, row, index):
        assert tracked_growth(build) < 40, build.__name__  # ~90,000 nodes each


# ---- 2. counts, storage and speculations against independent references --------------------------------
def test_random_adds_and_removals_match_substring_counts_and_the_reference_trie():
    """Small alphabets so nodes gain, lose and regain children (inline child <-> dict): after each
    step the counts equal brute-force substring counts, the storage holds exactly the live nodes,
    and speculations from every depth of random contexts equal the reference trie's."""
    rng = random.Random(9)
    for depth, vocab in ((4, 2), (6, 3), (8, 5)):
        t, ref, held = Trie(depth), RefTrie(depth), []
        for _ in range(60):
            if held and rng.random() < 0.4:
                gone = held.pop(rng.randrange(len(held)))
                t.remove(gone)
                ref.remove(gone)
            else:
                s = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
                held.append(s)
                t.add(s)
                ref.add(s)
            want = substring_counts(held, depth)
            assert trie_counts(t) == dict(want) and t.nodes == len(want)
            storage_is_exact(t)
            ctx = [rng.randrange(vocab) for _ in range(depth)]
            for n in range(1, depth):
                node, ref_node = t.walk(ctx[-n:]), ref.walk(ctx[-n:])
                assert (node is None) == (ref_node is None)
                if node is None:
                    continue
                assert t.count(node) == ref_node.count == want[tuple(ctx[-n:])]
                for max_nodes, min_prob in ((3, 0.0), (12, 0.0), (12, 0.1)):
                    assert speculate(t, node, n, max_nodes, depth - n, min_prob) == \
                        ref_speculate(ref_node, n, max_nodes, depth - n, min_prob)


def test_evictions_keep_storage_within_the_caps():
    """A global index under a token cap through many evictions: freed ids are reused, so its
    storage never grows past what the cap holds plus one request, and it counts what it holds."""
    rng = random.Random(4)
    depth, cap, size = 8, 500, 100
    g = GlobalIndex(depth, max_tokens=cap, max_nodes=3000)
    for _ in range(200):
        g.add("*", [rng.randrange(50) for _ in range(size)])
        trie = g.tries["*"]
        held = [list(toks) for _, _, toks in g.fifo]
        assert trie_counts(trie) == dict(substring_counts(held, depth)) and g.stats.nodes == trie.nodes <= 3000
        storage_is_exact(trie)
        assert len(trie._count) <= 1 + 3000 + size * depth


def test_a_cursor_holds_nothing_after_a_removal_until_it_resyncs():
    """Ids freed by a removal are reused by later adds: a cursor that has not re-synced must not
    follow or match through them."""
    t = Trie(4)
    t.add([1, 2, 3, 4])
    cur = Cursor(t)
    cur.resync([1, 2])
    assert cur.match(3) == (2, t.walk([1, 2]))
    t.remove([1, 2, 3, 4])
    t.add([7, 8, 9, 5])  # reuses the freed ids
    assert cur.match(3) == (0, None)
    cur.follow(8)
    assert cur.active == [] and cur.match(3) == (0, None)
    cur.resync([7, 8])
    assert cur.match(3) == (2, t.walk([7, 8])) and t.count(t.walk([7, 8])) == 1
