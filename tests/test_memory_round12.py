"""Memory that must not outlive what it holds: a per-tenant suffix trie keeps storage for its live
nodes, not its peak, and recycling with ``keep_table: false`` drafts each row from its own
request's output alone, never from a table another row filled."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from helpers import greedy_run, plain_greedy
from test_suffix_index_bounds import walked

from conftest import tiny_llama
from spec_plugins import suffix_index
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.proposers.base import ProposeContext
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.suffix_global import GlobalIndex
from spec_plugins.suffix_index import COMPACT_FLOOR, Cursor, Trie
from spec_plugins.suffix_trees import speculate

GREEDY = LogitsPipeline(SamplingConfig(temperature=0.0))


# ---- 1. a tenant's trie gives back the storage of evicted requests -----------------------------------
def drafts(trie: Trie, contexts: list[list[int]]) -> list[set[tuple[tuple[int, ...], float]]]:
    """Per context, the whole speculation tree drafting reads from ``trie`` (min_prob 0, no node
    cap), as a set of (token path, estimate): independent of node ids and of the order ties pop."""
    out = []
    for ctx in contexts:
        cur = Cursor(trie)
        cur.resync(ctx)
        n, node = cur.match(trie.depth)
        spec = speculate(trie, node, n, 10**6, trie.depth, 0.0)
        paths: list[tuple[int, ...]] = []
        for tok, parent in zip(spec.tokens, spec.parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
        out.append({(p, round(q, 12)) for p, q in zip(paths, spec.probs)})
    return out


def test_a_tenant_that_once_filled_the_cap_keeps_storage_for_its_live_nodes_only():
    """The hunter's scenario shrunk: each tenant in turn fills the shared token cap, then every
    tenant so far sends one small request and keeps it. Every trie's node slots stay within twice
    its live nodes (or the compaction floor), and drafting from a compacted trie gives exactly
    what a trie built afresh from the same held requests gives."""
    rng = random.Random(0)
    depth, cap, small, big, tenants = 8, 2_000, 12, 100, 5
    g = GlobalIndex(depth, cap, max_keys=100)
    for k in range(tenants):
        for _ in range((cap - 2 * small * tenants) // big):
            g.add(("tenant", k), [rng.randrange(40) for _ in range(big)])
        for j in range(k + 1):
            g.add(("tenant", j), [rng.randrange(40) for _ in range(small)])
        for t in g.tries.values():
            assert len(t._count) == len(t._tok) == len(t._kids)
            assert len(t._count) <= max(COMPACT_FLOOR, 2 * (t.nodes + 1)), (k, len(t._count), t.nodes)
            assert walked(t) == t.nodes
    slots = sum(len(t._count) for t in g.tries.values())
    assert slots <= 2 * (g.stats.nodes + len(g.tries)) + COMPACT_FLOOR * len(g.tries)
    for key, trie in g.tries.items():
        held = [toks for k, t, toks in g.fifo if k == key and t is trie]
        fresh = Trie(depth)
        for toks in held:
            fresh.add(toks)
        assert fresh.nodes == trie.nodes
        contexts = [list(toks[:i]) for toks in held for i in range(1, len(toks), 7)]
        assert drafts(trie, contexts) == drafts(fresh, contexts)


def test_a_removal_gives_back_at_most_twice_the_slots_it_freed():
    """A tenant that filled the cap loses its requests one by one to another tenant: no single
    add renumbers its whole trie (that pass stalled the decode thread for seconds on a large
    index): each gives back at most twice the slots its removals freed, and the storage bound
    (twice the live nodes, or the floor) holds after every add all the same."""
    rng = random.Random(1)
    depth, cap, big = 8, 2_000, 100
    g = GlobalIndex(depth, cap, max_keys=10)
    for _ in range(cap // big):
        g.add("A", [rng.randrange(40) for _ in range(big)])
    a = g.tries["A"]
    assert len(a._count) > 4 * COMPACT_FLOOR
    shrunk = 0
    for _ in range(cap // big - 1):
        slots, nodes = len(a._count), a.nodes
        g.add("B", [rng.randrange(40) for _ in range(big)])
        assert slots - len(a._count) <= 2 * (nodes - a.nodes), (slots, len(a._count), nodes, a.nodes)
        assert len(a._count) <= max(COMPACT_FLOOR, 2 * (a.nodes + 1))
        assert walked(a) == a.nodes
        shrunk += slots - len(a._count)
    assert shrunk > 0


def test_a_node_that_lost_most_of_its_children_gives_back_their_dict_storage():
    """A dict never shrinks its own table: the root and token 7's node, once 400 children wide,
    keep two, and their dicts are sized for two (a fresh copy's size), not for 400."""
    trie = Trie(4)
    requests = [[7, 100 + i] for i in range(400)]
    for toks in requests:
        trie.add(toks)
    for toks in requests[2:]:
        trie.remove(toks)
    wide = [trie.root, trie.walk([7])]
    assert [len(trie.children(n)) for n in wide] == [3, 2]
    for n in wide:
        kids = trie._kids[n]
        assert type(kids) is dict and sys.getsizeof(kids) <= 2 * sys.getsizeof(dict(kids)), n
    assert drafts(trie, [[7]]) == [{((100,), 0.5), ((101,), 0.5)}]


def test_a_compacting_index_drafts_exactly_as_one_that_never_compacts(monkeypatch):
    """Two indexes fed the same stream, one giving slots back (a floor of 8), one never: after
    every add they hold the same counts and draft the same trees in the same order (moving a node
    keeps its children's order), and a cursor made before an add never returns a stale id."""
    rng = random.Random(2)
    depth = 6
    for max_nodes in (None, 900):
        moving = GlobalIndex(depth, 600, max_keys=4, max_nodes=max_nodes)
        still = GlobalIndex(depth, 600, max_keys=4, max_nodes=max_nodes)
        held: list[tuple[Cursor, list[int]]] = []
        fewer = False
        for step in range(400):
            key = rng.randrange(3)
            toks = [rng.randrange(6) for _ in range(rng.choice([3, 10, 60, 150]))]
            monkeypatch.setattr(suffix_index, "COMPACT_FLOOR", 8)
            moving.add(key, toks)
            monkeypatch.setattr(suffix_index, "COMPACT_FLOOR", 10**12)
            still.add(key, toks)
            assert moving.stats == still.stats, step
            for cur, ctx in held:
                n, node = cur.match(depth)
                assert node is None or cur.trie.walk(ctx[-n:]) == node, step
            held = []
            for k, trie in list(moving.tries.items()):
                assert walked(trie) == trie.nodes == len(trie._count) - len(trie._free) - 1
                fewer |= len(trie._count) < len(still.tries[k]._count)
                for _ in range(3):
                    ctx = [rng.randrange(6) for _ in range(rng.randint(1, 9))]
                    out = []
                    for index in (moving, still):
                        cur = Cursor(index.trie(k))
                        cur.resync(ctx)
                        n, node = cur.match(depth)
                        out.append((n, speculate(cur.trie, node, n, 50, depth - n, 0.0)))
                    assert out[0] == out[1], (step, k, ctx)
                    cur = Cursor(trie)  # on the compacting index, read after the next add
                    cur.resync(ctx)
                    held.append((cur, ctx))
        assert fewer  # slots were given back: the comparison is not between two identical layouts


# ---- 2. recycling without keep_table: a table per row -------------------------------------------------
V = 10


def _successors(a: int, b: int) -> torch.Tensor:
    """Logits [1, 1, V] whose top two are ``a`` then ``b``."""
    z = torch.full((1, 1, V), -5.0)
    z[0, 0, a], z[0, 0, b] = 3.0, 2.0
    return z


def _two_rows(keep_table: bool) -> tuple[RecyclingProposer, torch.Tensor]:
    """Two rows in one batch; only row 0's verify pass scored token 4 (successors 7, 2). The
    depth-1 drafts of both rows pending on token 4: tokens and validity [2, 2]."""
    prop = RecyclingProposer(RecyclingProposer.Config(paths=[[0], [1]], candidates=2, keep_table=keep_table))
    prop.admit([[1, 4], [3, 4]])
    tokens = torch.tensor([[4], [9]])
    logits = torch.cat([_successors(7, 2), _successors(5, 6)])  # row 1 scored token 9 only
    prop.update(tokens, logits)
    d = prop.propose(ProposeContext([[1, 4], [3, 4]], [2, 2], GREEDY, tree_ok=True))
    return prop, torch.where(d.valid, d.tokens, -1)


def test_without_keep_table_a_row_never_drafts_from_another_rows_table():
    prop, drafted = _two_rows(keep_table=False)
    assert drafted[0].tolist() == [7, 2]
    assert drafted[1].tolist() == [-1, -1]  # token 4's successors were learned from row 0 alone
    # row 0 leaves, a new row joins and takes its slab: it starts empty, not with row 0's table
    prop.select_rows([1])
    prop.admit([[8, 4]])
    d = prop.propose(ProposeContext([[3, 9], [8, 4]], [2, 2], GREEDY, tree_ok=True))
    assert torch.where(d.valid, d.tokens, -1).tolist() == [[5, 6], [-1, -1]]
    # a third row needs a slab the table lacks: it grows, and the rows in flight keep theirs
    prop.admit([[2, 9]])
    d = prop.propose(ProposeContext([[3, 9], [8, 4], [2, 9]], [2, 2, 2], GREEDY, tree_ok=True))
    assert torch.where(d.valid, d.tokens, -1).tolist() == [[5, 6], [-1, -1], [-1, -1]]
    assert prop.num_rows() == 3 and prop.table is not None and prop.table.shape[0] == 4


def test_with_keep_table_rows_still_share_one_table():
    _, drafted = _two_rows(keep_table=True)
    assert drafted.tolist() == [[7, 2], [7, 2]]


def test_per_row_tables_stay_greedy_exact_as_rows_leave():
    """keep_table: false through the decode loop: rows of different lengths (they leave at
    different rounds) give plain greedy's tokens, and the rows' own tables still draft."""
    model = tiny_llama(seed=5, sharpness=2.0)
    prompts = [[1, 2, 3, 1, 2, 3], [7, 7, 8], [4, 5, 4, 5, 4], [9, 1]]
    limits = [30, 5, 18, 11]
    target = TorchRuntime(model)
    prop = RecyclingProposer(RecyclingProposer.Config(tree_size=10, keep_table=False), target=target)
    outs, stats = greedy_run(target, prop, prompts, limits)
    for p, o, n in zip(prompts, outs, limits):
        assert o == plain_greedy(model, p, n)
    assert stats.accepted_tokens > 0


def test_token_ids_are_stored_as_int32_and_read_back_exactly():
    """The table holds token ids as int32 (half of int64's memory per row) for either setting, and
    ids past 16 bits come back as the int64 draft tokens the target scored."""
    vocab = 70_000
    for keep_table in (True, False):
        prop = RecyclingProposer(RecyclingProposer.Config(paths=[[0], [1]], candidates=2, keep_table=keep_table))
        prop.admit([[1, 4]])
        z = torch.full((1, 1, vocab), -5.0)
        z[0, 0, 69_999], z[0, 0, 65_537] = 3.0, 2.0
        prop.update(torch.tensor([[4]]), z)
        d = prop.propose(ProposeContext([[1, 4]], [2], GREEDY, tree_ok=True))
        assert prop.table is not None and prop.table.dtype == torch.int32
        assert d.tokens.dtype == torch.long and d.tokens[0].tolist() == [69_999, 65_537] and d.valid.all()


def test_the_per_row_table_shrinks_as_rows_leave_and_rows_keep_their_drafts():
    """Twelve rows, each taught its own successors of token 4; ten leave. Under a quarter of the
    slabs still in use, the table shrinks (it follows the rows running now, not their peak), and
    the two rows left draft exactly as before; a row joining after starts empty."""
    n = 12
    prop = RecyclingProposer(RecyclingProposer.Config(paths=[[0], [1]], candidates=2, keep_table=False))
    seqs = [[1, 4] for _ in range(n)]
    prop.admit(seqs)
    prop.update(torch.full((n, 1), 4), torch.cat([_successors(r % V, (r + 3) % V) for r in range(n)]))

    def drafted(rows: list[list[int]]) -> list[list[int]]:
        d = prop.propose(ProposeContext(rows, [2] * len(rows), GREEDY, tree_ok=True))
        return torch.where(d.valid, d.tokens, -1).tolist()

    before = drafted(seqs)
    assert prop.table is not None and prop.table.shape[0] == n
    prop.select_rows([7, 3])
    assert prop.table.shape[0] == 4  # room for as many rows again
    assert drafted(seqs[:2]) == [before[7], before[3]] == [[7, 0], [3, 6]]
    prop.admit([[2, 4]])
    assert drafted(seqs[:2] + [[2, 4]]) == [[7, 0], [3, 6], [-1, -1]]


def test_a_request_trie_keeps_no_parent_links_and_holds_what_a_removable_one_holds():
    """A row's own trie only grows, so the parent links removal uses would cost it memory for
    nothing; it holds the same nodes, counts and child order as a trie that keeps them."""
    from spec_plugins.suffix_index import RequestIndex

    rng = random.Random(3)
    tokens = [rng.randrange(12) for _ in range(400)]
    row, ref = RequestIndex(8), Trie(8)
    row.extend(tokens)
    ref.add(tokens)
    assert row.trie._par is None and ref._par is not None and len(ref._par) == len(ref._count)
    assert (row.trie._count, row.trie._tok) == (ref._count, ref._tok)
    assert all(dict(row.trie.children(n)) == dict(ref.children(n)) for n in range(len(ref._count)))
    with pytest.raises(TypeError, match="only grows"):
        row.trie.remove(tokens[:8])
