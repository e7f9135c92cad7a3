"""The global suffix index's memory follows its bound under rotating tenant keys: a tenant dropped
whole leaves no trie nodes reachable from the index (its stale fifo entries name only an emptied
trie), and the stale entries hold at most about the token cap besides the live requests."""

from __future__ import annotations

import gc
import random

from spec_plugins.suffix_global import GlobalIndex
from spec_plugins.suffix_index import Trie


def walked(trie: Trie) -> int:
    """Nodes reachable from the trie's root through its children (the root not counted)."""
    stack, total = [trie.root], -1
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(trie.children(n).values())
    return total


def reachable(root: object) -> tuple[int, int]:
    """(node slots held in use, Trie objects) reachable from ``root`` through gc referents: what
    the index keeps alive, found without trusting its running counts. A trie's storage holds its
    root, its live nodes and its free list, and its live nodes must be exactly the ones its root
    reaches. Types and modules are not followed."""
    seen: set[int] = set()
    stack, nodes, tries = [root], 0, 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, type) or type(o).__name__ == "module":
            continue
        seen.add(id(o))
        if type(o) is Trie:
            tries += 1
            used = len(o._count) - len(o._free)
            assert len(o._tok) == len(o._kids) == len(o._count) and used - 1 == walked(o)
            nodes += used
        stack.extend(gc.get_referents(o))
    return nodes, tries


def fifo_tokens(g: GlobalIndex) -> tuple[int, int]:
    """(tokens of live fifo entries, tokens of stale ones: entries of keys dropped whole)."""
    live = sum(len(toks) for key, trie, toks in g.fifo if g.tries.get(key) is trie)
    return live, sum(len(toks) for _, _, toks in g.fifo) - live


def test_rotating_tenants_keep_no_dropped_trie_alive():
    """The hunter's case, scaled down: each tenant adds one request and is dropped by the next
    but one; every trie node the index keeps alive is one the stats report (plus one root per trie)."""
    rng = random.Random(0)
    g = GlobalIndex(depth=16, max_tokens=100_000, max_keys=2)
    for t in range(66):
        g.add(("tenant", t), [rng.randrange(50_000) for _ in range(200)])
    assert len(g.tries) == 2 and g.stats.evicted_keys == 64 and len(g.fifo) == 66  # stale entries remain
    nodes, tries = reachable(g)
    assert nodes - tries == g.stats.nodes == sum(t.nodes for t in g.tries.values())


def test_stale_entries_hold_at_most_the_token_cap():
    """Tenants whose requests fill the cap, dropped one after another: the fifo's stale entries
    never hold more than the cap in tokens, however few entries they are."""
    rng = random.Random(1)
    g = GlobalIndex(depth=4, max_tokens=1_000, max_keys=2)
    for t in range(66):
        g.add(t, [rng.randrange(100) for _ in range(400)])
        live, stale = fifo_tokens(g)
        assert live == g.stats.tokens <= 1_000
        assert stale <= 1_000


def test_random_traffic_keeps_reachable_nodes_and_stale_tokens_exact():
    """Mixed adds, lookups, request evictions and key drops: every 25 steps the nodes the index
    keeps alive are exactly the counted ones; after every step the stale token count is exact and bounded."""
    rng = random.Random(7)
    g = GlobalIndex(depth=5, max_tokens=300, max_keys=4)
    stales: list[tuple[int, int]] = []  # (stale tokens counted from the fifo, the index's running count)
    for step in range(600):
        g.add(rng.randrange(30), [rng.randrange(10) for _ in range(rng.randrange(1, 120))])
        if rng.random() < 0.3:
            g.trie(rng.randrange(30))
        if step % 25 == 0:
            nodes, tries = reachable(g)
            assert nodes - tries == g.stats.nodes == sum(t.nodes for t in g.tries.values())
        live, stale = fifo_tokens(g)
        assert live == g.stats.tokens <= 300 and stale <= 300
        assert len(g.fifo) <= 2 * g.stats.requests + 64
        stales.append((stale, g.stale_tokens))
    assert all(got == want for want, got in stales)
