"""Suffix decoding: the indexes count exactly what they hold and forget what they evict, cursors
track the longest suffix incrementally, trees grow best-first by frequency, greedy output is
plain greedy in every scope, the global index makes a repeated request draft more (and keeps
tenants apart), and tree sampling from the index is exact (chi-square with a power check)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, greedy_run, plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.proposers.suffix import SuffixProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.suffix_global import GlobalIndex
from spec_plugins.suffix_index import Cursor, RequestIndex, Trie
from spec_plugins.suffix_trees import Speculation, speculate, union
from spec_plugins.tree import paths
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier


def substring_counts(seqs, depth):
    c = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return c


def trie_counts(trie):
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, c in trie.children(node).items():
            out[path + (t,)] = trie.count(c)
            stack.append((path + (t,), c))
    return out


def test_trie_counts_every_substring_and_removal_restores_it():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    t = Trie(5)
    for s in seqs:
        t.add(s)
    assert trie_counts(t) == dict(substring_counts(seqs, 5))
    assert t.nodes == len(substring_counts(seqs, 5))
    t.remove(seqs[0])
    t.remove(seqs[3])
    rest = [s for i, s in enumerate(seqs) if i not in (0, 3)]
    assert trie_counts(t) == dict(substring_counts(rest, 5)) and t.nodes == len(substring_counts(rest, 5))


def test_request_index_and_cursor_find_the_longest_earlier_suffix():
    rng = random.Random(1)
    seq = [rng.randrange(3) for _ in range(60)]
    idx = RequestIndex(6)
    other = Trie(6)
    other.add([rng.randrange(3) for _ in range(80)])
    cur = Cursor(other)
    for i, t in enumerate(seq):
        idx.extend([t])
        cur.follow(t)
        ctx = seq[: i + 1]
        # brute force: the longest suffix (<= 4) occurring earlier in ctx followed by a token
        want = 0
        for n in range(1, min(4, len(ctx) - 1) + 1):
            s = ctx[-n:]
            if any(ctx[j: j + n] == s for j in range(len(ctx) - n)):
                want = n
        assert idx.match(4)[0] == want
        got_other = cur.match(4)[0]
        longest = 0
        for n in range(1, min(4, len(ctx)) + 1):
            node = other.walk(ctx[-n:])
            if node is not None and other.has_children(node):
                longest = n
        assert got_other == longest


def test_global_index_evicts_oldest_under_its_cap():
    g = GlobalIndex(depth=4, max_tokens=30)
    for i in range(10):
        g.add("*", [i, i + 1, i + 2, i + 3, 7, 7, 7, 7, 7, 7])
    assert g.stats.tokens <= 30 and g.stats.requests == 3 and g.stats.evicted_requests == 7
    assert g.stats.nodes == len(substring_counts([[i, i + 1, i + 2, i + 3] + [7] * 6 for i in (7, 8, 9)], 4))
    assert g.tries["*"].walk([0, 1]) is None and g.tries["*"].walk([9, 10]) is not None


def _node_total(g):
    return sum(t.nodes for t in g.tries.values())


def test_a_tenant_whose_last_request_is_evicted_leaves_no_trie():
    """A key exists only while it holds requests: evicting its last one drops its trie, and
    looking a key up (every round of a new tenant's row) stores nothing."""
    g = GlobalIndex(depth=4, max_tokens=40)
    assert g.trie(("tenant", "x")).nodes == 0 and len(g.tries) == 0
    for i in range(200):
        g.add(("tenant", i), [i, i + 1, i + 2, i + 3, i + 4])
    assert len(g.tries) == 8 and g.stats.requests == 8 and g.stats.tokens == 40
    assert set(g.tries) == {("tenant", i) for i in range(192, 200)}
    assert g.stats.nodes == _node_total(g) and len(g.held) == 8
    assert len(g.fifo) <= 2 * g.stats.requests + 64


def test_tenants_over_the_bound_evict_the_least_recently_used_whole():
    g = GlobalIndex(depth=4, max_tokens=10_000, max_keys=2)
    g.add("a", [1, 2, 3])
    g.add("b", [4, 5, 6])
    g.add("a", [1, 2, 7])
    g.trie("b")  # b is now the most recently used
    g.add("c", [8, 9])  # evicts a, with both its requests
    assert set(g.tries) == {"b", "c"}
    assert g.stats.requests == 2 and g.stats.tokens == 5 and g.stats.evicted_keys == 1
    assert g.stats.evicted_requests == 2 and g.stats.nodes == _node_total(g)
    assert g.trie("a").walk([1, 2]) is None


def test_index_sizes_are_running_counts_that_match_the_tries():
    """Random adds under a token cap and a key bound: the running node, token and request counts
    equal what the tries hold (they are never summed per add)."""
    rng = random.Random(5)
    g = GlobalIndex(depth=5, max_tokens=300, max_keys=6)
    for _ in range(400):
        key = rng.randrange(12)
        g.add(key, [rng.randrange(8) for _ in range(rng.randrange(1, 30))])
        if rng.random() < 0.3:
            g.trie(rng.randrange(12))
        assert g.stats.nodes == _node_total(g)
        assert g.stats.tokens == sum(h[1] for h in g.held.values()) <= 300
        assert g.stats.requests == sum(h[0] for h in g.held.values())
        assert len(g.tries) <= 6 and all(h[0] > 0 for h in g.held.values())
    live = [toks for key, trie, toks in g.fifo if g.tries.get(key) is trie]
    for key, trie in g.tries.items():
        mine = [toks for k, t, toks in g.fifo if k == key and t is trie]
        assert trie_counts(trie) == substring_counts(mine, 5)
    assert sum(len(t) for t in live) == g.stats.tokens


def test_tenant_scope_keeps_at_most_max_tenants_through_the_proposer():
    """Finished requests of 3,000 rotating tenants through the proposer's own observe: the index
    holds at most ``max_tenants`` tenants and never an empty one."""
    from spec_plugins.types import Emission, RoundRecord

    prop = SuffixProposer(SuffixProposer.Config(scope="tenant", max_tenants=50))
    for i in range(3000):
        seq = [i % 97, (i * 7) % 97, 3, 4, 5, 6]
        record = RoundRecord(keys=[i], sequences=[seq], budgets=[0], draft_keys=None, draft=None, accepted=[[]],
                             emitted=[[6]], emissions=[Emission(i, [6], [], "length")], positions=1,
                             tenants=[f"t{i}"])
        prop.observe(record)
    assert len(prop.index.tries) == 50 and prop.index.stats.evicted_keys == 2950
    assert prop.index.stats.nodes == _node_total(prop.index)
    names = {m[0]: m[3] for m in prop.metrics()}
    assert names["spec_suffix_index_keys"] == 50 and names["spec_suffix_index_evicted_keys_total"] == 2950


def test_speculate_grows_best_first_by_frequency():
    t = Trie(6)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]):
        t.add(s)
    node = t.walk([1, 2])  # followed by 3 (3x) and 6 (1x)
    spec = speculate(t, node, 2, max_nodes=10, max_depth=4, min_prob=0.0)
    got = dict(zip(spec.tokens, spec.probs))
    assert got[3] == pytest.approx(0.75) and got[6] == pytest.approx(0.25)
    assert got[4] == pytest.approx(0.75 * 2 / 3) and got[5] == pytest.approx(0.75 / 3)
    assert list(spec.probs) == sorted(spec.probs, reverse=True)  # best-first: every prefix is a tree
    assert all(p < i for i, p in enumerate(spec.parents))
    assert speculate(t, node, 2, 10, 4, min_prob=0.3).tokens == (3, 4)
    assert speculate(t, node, 2, 10, max_depth=1, min_prob=0.0).tokens == (3, 6)



def _paths(spec):
    return [tuple(spec.tokens[j] for j in nodes) for nodes in paths(spec.parents)]


def test_union_keeps_both_trees_best_first_with_the_higher_estimate():
    a = Speculation((7, 8, 9), (-1, 0, 1), (0.5, 0.5, 0.25), 3)  # 7 8 9
    b = Speculation((7, 4, 8), (-1, -1, 0), (0.9, 0.1, 0.4), 2)  # 7 8, or 4
    u = union([a, b])
    got = dict(zip(_paths(u), u.probs))
    assert got == {(7,): 0.9, (7, 8): 0.5, (7, 8, 9): 0.25, (4,): 0.1}
    assert list(u.probs) == sorted(u.probs, reverse=True) and all(p < i for i, p in enumerate(u.parents))
    assert u.match_length == 3 and union([a]) is a and union([]).tokens == ()
    # a child whose estimate rounded above its parent's stays after it (a valid tree)
    c = Speculation((1, 2), (-1, 0), (0.4, 0.4000000000000001), 3)
    d = Speculation((1, 3), (-1, -1), (0.3, 0.35), 3)
    v = union([c, d])
    assert _paths(v) == [(1,), (1, 2), (3,)] and all(p < i for i, p in enumerate(v.parents))


def test_draft_holds_the_request_and_the_global_continuation():
    """The request's own text continues [5, 6] with 7; earlier requests with 8: both are drafted."""
    prop = SuffixProposer(SuffixProposer.Config(scope="global", tree_nodes=8, min_token_prob=0.0))
    for _ in range(3):
        prop.index.add("*", [1, 5, 6, 8, 8, 8])
    prop.admit([[2, 5, 6, 7, 7, 3, 5, 6]])
    from spec_plugins.types import ProposeContext

    spec = prop.speculations(ProposeContext([[2, 5, 6, 7, 7, 3, 5, 6]], [4], None))[0]
    roots = {t for t, p in zip(spec.tokens, spec.parents) if p == -1}
    assert roots == {7, 8}
    assert (8, 8) in _paths(spec) and (7, 7) in _paths(spec)


@pytest.mark.parametrize("scope", ["request", "global"])
def test_greedy_identity_and_cross_request_memory(scope):
    model = tiny_llama(seed=7, sharpness=6.0)
    target = TorchRuntime(model)
    prop = SuffixProposer(SuffixProposer.Config(scope=scope, tree_nodes=8, min_token_prob=0.0, max_spec_factor=4))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    first, s1 = greedy_run(target, prop, prompts, 24)
    for p, o in zip(prompts, first):
        assert o == plain_greedy(model, p, 24)
    again, s2 = greedy_run(target, prop, prompts, 24)  # the same requests once more
    assert again == first
    if scope == "global":
        assert prop.index.stats.requests == 4 and prop.index.stats.hits > 0
        assert s2.mean_accepted_tokens > s1.mean_accepted_tokens + 1.0, (s1.mean_accepted_tokens,
                                                                         s2.mean_accepted_tokens)
    else:
        assert prop.index.stats.requests == 0


def test_tenants_do_not_see_each_others_requests():
    from spec_plugins.loop.batch import Batch
    from spec_plugins.loop.round import run_round

    model = tiny_llama(seed=7, sharpness=6.0)
    target = TorchRuntime(model)
    prop = SuffixProposer(SuffixProposer.Config(scope="tenant", tree_nodes=8, min_token_prob=0.0))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def serve(tenant):
        batch = Batch(target, prop, ExactVerifier())
        batch.add([RowRequest("r", prompt, 20, tenant=tenant)])
        stats = DecodeStats()
        while (rec := run_round(batch, DraftPolicy.of(FixedLength(6)))) is not None:
            stats.observe(rec)
        return stats

    serve("a")
    other = serve("b")  # nothing of tenant a's request may help tenant b
    same = serve("a")
    assert set(prop.index.tries) == {("tenant", "a"), ("tenant", "b")}
    assert same.mean_accepted_tokens > other.mean_accepted_tokens + 1.0


# ---- exactness of sampling ---------------------------------------------------------------------------
V = 16
PROMPT = [1, 5, 2, 5]


def _sampled(model, prop, verifier, n):
    from test_tree_sampling import tree_samples

    return tree_samples(model, prop, LogitsPipeline(SamplingConfig(temperature=1.0)), verifier, n_samples=n)


def _warm(prop, model):
    """Earlier 'requests' that continue the prompt several ways, so the drafts are trees with
    siblings at both depths."""
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        prop.index.add("*", PROMPT + torch.randint(0, V, (3,), generator=g).tolist())


def test_suffix_tree_sampling_is_exact_and_a_wrong_rule_fails():
    from test_tree_sampling import NoResidualTree

    model = tiny_llama(vocab=V, seed=11, sharpness=6.0)
    pipe = LogitsPipeline(SamplingConfig(temperature=1.0))
    exact = exact_joint(model, PROMPT, 3, pipe)
    cfg = SuffixProposer.Config(scope="global", tree_nodes=6, min_token_prob=0.0, max_spec_factor=8)
    prop = SuffixProposer(cfg)
    _warm(prop, model)
    seen = []

    class Spy(ExactVerifier):
        def __call__(self, *a, **kw):
            v = super().__call__(*a, **kw)
            seen.extend(v.fetch(a[0])[0].accepted)
            return v

    samples = _sampled(model, prop, Spy(), 10000)
    assert chi_square_pvalue(samples, exact) > 1e-3
    assert any(len(a) == 2 for a in seen) and len({a[0] for a in seen if a}) > 1  # trees with siblings
    wrong = SuffixProposer(cfg)
    _warm(wrong, model)
    assert chi_square_pvalue(_sampled(model, wrong, NoResidualTree(), 6000), exact) < 1e-6
