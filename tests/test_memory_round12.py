"""Memory that must not outlive what it holds: a per-tenant suffix trie keeps storage for its live
nodes, not its peak, and recycling with ``keep_table: false`` drafts each row from its own
request's output alone, never from a table another row filled."""

from __future__ import annotations

import random

import torch
from helpers import greedy_run, plain_greedy
from test_suffix_index_bounds import walked

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.proposers.base import ProposeContext
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.suffix_index import COMPACT_FLOOR, Cursor, GlobalIndex, Trie
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
