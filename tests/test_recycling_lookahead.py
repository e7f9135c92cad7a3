"""Training-free tree drafters (token recycling, lookahead) and the lossy typical verifier.

Greedy output through a tree drafter must be token-identical to plain greedy decoding for every
tree shape, at EOS and max_new_tokens boundaries, and for batches whose rows accept different
path lengths."""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits, plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig, SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.base import ProposeContext
from spec_plugins.proposers.lookahead import LookaheadProposer, _RowState
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.registry import PROPOSERS, VERIFIERS
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.tree import chain_tree, topk_tree
from spec_plugins.verifiers import ExactVerifier, TypicalVerifier
from spec_plugins.verify import greedy_verify, typical_verify

GREEDY = LogitsPipeline(SamplingConfig(temperature=0.0))


def run(target, proposer, prompts, n, k=8, eos=(), verifier=None, pipeline=GREEDY, gen=None, policy=None):
    outs = [[] for _ in prompts]
    stats = DecodeStats()
    for step in decode(target, proposer, verifier or ExactVerifier(), pipeline, prompts, n, eos, gen, stats,
                       policy if policy is not None else FixedLength(k)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs, stats


def prompts_for(seed, count=5, vocab=32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        base = torch.randint(0, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        rep = int(torch.randint(1, 4, (1,), generator=g))
        tail = torch.randint(0, vocab, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        out.append(base * rep + tail)
    return out


RECYCLING_SHAPES = {
    "size1": dict(tree_size=1),
    "size4": dict(tree_size=4),
    "size12": dict(tree_size=12),
    "size24_depth3": dict(tree_size=24, num_draft_tokens=3),
    "chain5": dict(paths=[list(p) for p in chain_tree(5).paths]),
    "topk321": dict(paths=[list(p) for p in topk_tree((3, 2, 1)).paths], candidates=3),
}


# ---- token recycling ------------------------------------------------------------------------


def test_recycling_table_update_and_bfs_draft():
    prop = RecyclingProposer(RecyclingProposer.Config(paths=[[0], [1], [0, 0], [0, 1], [1, 0]], candidates=2))
    V = 10
    logits = torch.full((1, 3, V), -5.0)
    # token 4 -> successors (7, 2); token 7 -> (1, 3); token 2 -> (9, 8)
    for pos, (a, b) in enumerate([(7, 2), (1, 3), (9, 8)]):
        logits[0, pos, a], logits[0, pos, b] = 3.0, 2.0
    prop.update(torch.tensor([[4, 7, 2]]), logits)
    assert prop.table[4].tolist() == [7, 2] and prop.table[7].tolist() == [1, 3]
    ctx = ProposeContext([[5, 4]], [3], GREEDY, tree_ok=True)
    d = prop.propose(ctx)
    assert d.parents == (-1, -1, 0, 0, 1)
    assert d.tokens.tolist() == [[7, 2, 1, 3, 9]] and bool(d.valid.all()) and d.probs is None
    # unknown successors and the depth budget make nodes invalid (on the device: nothing is read back)
    d = prop.propose(ProposeContext([[5, 3]], [3], GREEDY, tree_ok=True))
    assert not bool(d.valid.any())  # token 3 was never scored
    d = prop.propose(ProposeContext([[5, 4]], [1], GREEDY, tree_ok=True))
    assert d.valid.tolist() == [[True, True, False, False, False]]
    # banned (-inf) logits never become candidates
    z = torch.zeros(1, 1, V)
    z[0, 0, 1:] = float("-inf")
    prop.update(torch.tensor([[4]]), z)
    assert prop.table[4].tolist() == [0, -1]


def test_recycling_observe_stores_the_verify_pass_top_k():
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = RecyclingProposer(RecyclingProposer.Config(tree_size=6, candidates=4), target=target)
    prompt = [1, 2, 3, 1, 2, 3]
    first = plain_greedy(model, prompt, 1)[0]
    run(target, prop, [prompt], 2)  # round 1: empty table, the root alone is scored
    want = full_logits(model, prompt + [first]).topk(4).indices
    assert prop.table[first].tolist() == want.tolist()
    run(target, prop, [prompt], 16)
    assert prop.rank_stats and all(acc <= reach for reach, acc in prop.rank_stats.values())


@pytest.mark.parametrize("shape", list(RECYCLING_SHAPES))
def test_recycling_greedy_identical(shape):
    model = tiny_llama(seed=5, sharpness=2.0)
    target = TorchRuntime(model)
    prop = RecyclingProposer(RecyclingProposer.Config(**RECYCLING_SHAPES[shape]), target=target)
    for prompt in prompts_for(seed=len(shape), count=4):
        ref = plain_greedy(model, prompt, 30)  # greedy is prefix-consistent: ref[:n] for every n
        for n in (1, 3, 9, 30):
            outs, _ = run(target, prop, [prompt], n)
            assert outs[0] == ref[:n], (shape, prompt, n)


def test_recycling_batch_rows_accept_different_lengths():
    model = tiny_llama(seed=5, sharpness=2.0)
    prompts = prompts_for(seed=11, count=6)
    limits = [4, 31, 17, 2, 25, 40]
    target = TorchRuntime(model)
    prop = RecyclingProposer(RecyclingProposer.Config(tree_size=10), target=target)
    run(target, prop, [[7, 7, 8]], 20)  # warm the table so the batch drafts from round 1
    seen = set()

    class Spy(ExactVerifier):
        def __call__(self, x, parents, z, q, pipeline, gen, valid=None):
            v = super().__call__(x, parents, z, q, pipeline, gen, valid)
            seen.add(tuple(len(a) for a in v.fetch(x)[0].accepted))
            return v

    outs, stats = run(target, prop, prompts, limits, verifier=Spy())
    for p, o, n in zip(prompts, outs, limits):
        assert o == plain_greedy(model, p, n)
    assert any(len(set(lens)) > 1 for lens in seen), "rows never accepted different path lengths"
    assert stats.accepted_tokens > 0


def test_recycling_eos_inside_accepted_path():
    model = tiny_llama(seed=3)
    prompt = [1, 2, 3, 1, 2, 3]
    ref = plain_greedy(model, prompt, 40)
    target = TorchRuntime(model)
    prop = RecyclingProposer(RecyclingProposer.Config(tree_size=12), target=target)
    run(target, prop, [prompt], 40)  # hot table: the next run accepts long paths
    for eos in {ref[5], ref[12], ref[20]}:
        outs, stats = run(target, prop, [prompt], 40, eos=[eos])
        assert outs[0] == ref[: ref.index(eos) + 1]
    assert stats.mean_accepted_tokens > 1.0


# ---- lookahead ------------------------------------------------------------------------------


def test_lookahead_pool_from_sequence_and_diagonals():
    st = _RowState(n=3, pool_size=2, seed=0)
    st.scan([1, 2, 3, 1, 2, 4])
    assert st.candidates(1, 5) == [(2, 4), (2, 3)]  # most recent first
    assert st.candidates(2, 5) == [(3, 1)] and st.candidates(4, 5) == []  # n-grams need N tokens
    st = _RowState(n=3, pool_size=4, seed=0)
    # iterates at absolute positions: s0 = [a0 a1 a2] at 10..12, s1 at 11..13, s2 at 12..14
    st.harvest(10, [10, 11, 12])
    st.harvest(11, [21, 22, 23])
    assert st.pool == {}  # need N iterates for an N-gram
    st.harvest(12, [32, 33, 34])
    # diagonal ending at s2[pos 12] starts at s0[pos 10]: (10, 21, 32); then (11, 22, 33), (12, 23, 34)
    assert st.candidates(10, 4) == [(21, 32)] and st.candidates(11, 4) == [(22, 33)]
    assert st.candidates(12, 4) == [(23, 34)]
    assert st.guess(13, [0]) == 33 and st.guess(12, [0]) == 32


def test_lookahead_draft_is_trie_of_window_and_candidates():
    prop = LookaheadProposer(LookaheadProposer.Config(window=3, ngram=3, candidates=2))
    seq = [5, 6, 7, 5, 6, 8, 5]
    prop.admit([seq])
    d = prop.propose(ProposeContext([seq], [8], GREEDY, tree_ok=True))
    toks, par = d.tokens[0].tolist(), d.parents
    paths = set()
    for i in range(len(par)):
        p, j = [], i
        while j >= 0:
            p.append(toks[j])
            j = par[j]
        paths.add(tuple(p[::-1]))
    assert {(6, 8), (6, 7)} <= paths  # pool candidates after the pending token 5, merged as a trie
    assert sum(1 for p in par if p == -1) <= 3
    chain = prop.propose(ProposeContext([seq], [8], GREEDY, tree_ok=False))
    assert chain.parents == (-1, 0) and chain.tokens[0].tolist() == [6, 8]


@pytest.mark.parametrize("w,n,g", [(1, 2, 0), (3, 3, 2), (5, 4, 3), (2, 5, 5)])
def test_lookahead_greedy_identical(w, n, g):
    model = tiny_llama(seed=5, sharpness=2.0)
    target = TorchRuntime(model)
    prop = LookaheadProposer(LookaheadProposer.Config(window=w, ngram=n, candidates=g))
    for prompt in prompts_for(seed=w * 10 + n, count=4):
        ref = plain_greedy(model, prompt, 30)
        for lim in (1, 2, 8, 30):
            outs, _ = run(target, prop, [prompt], lim)
            assert outs[0] == ref[:lim], (prompt, lim)


def test_lookahead_batch_eos_and_chain_runtime():
    model = tiny_llama(seed=3)
    prompts = prompts_for(seed=4, count=5)
    limits = [30, 3, 22, 14, 40]
    target = TorchRuntime(model)
    prop = LookaheadProposer(LookaheadProposer.Config(window=4, ngram=3, candidates=3))
    outs, stats = run(target, prop, prompts, limits)
    for p, o, n in zip(prompts, outs, limits):
        assert o == plain_greedy(model, p, n)
    assert stats.mean_accepted_tokens > 1.0
    ref = plain_greedy(model, prompts[0], 30)
    outs, _ = run(target, prop, [prompts[0]], 30, eos=[ref[9]])
    assert outs[0] == ref[: ref.index(ref[9]) + 1]


def test_lookahead_pool_learns_ngrams_from_the_jacobi_trajectory():
    """Some pooled n-grams come from the diagonals of the Jacobi iterates, not from the text."""
    model = tiny_llama(seed=5, sharpness=2.0)
    prompt = prompts_for(seed=3, count=1)[0]
    target = TorchRuntime(model)
    prop = LookaheadProposer(LookaheadProposer.Config(window=5, ngram=3, candidates=2, pool_size=64))
    outs, _ = run(target, prop, [prompt], 40)
    seq = prompt + outs[0]
    text_grams = {tuple(seq[i : i + 3]) for i in range(len(seq) - 2)}
    pooled = {(k,) + c for k, slot in prop.rows[0].pool.items() for c in slot}
    assert pooled - text_grams, "no n-gram came from the Jacobi trajectory"


# ---- configs, registry, runtime capability --------------------------------------------------


def test_configs_and_registry():
    for name in ("recycling", "lookahead"):
        assert name in PROPOSERS.names() and PROPOSERS.get(name).tree
    assert VERIFIERS.get("typical").lossy and not VERIFIERS.get("exact").lossy
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "x"},
                            "proposer": {"type": "recycling", "tree_size": 8, "candidates": 4},
                            "verifier": {"type": "typical", "epsilon": 0.2}})
    assert cfg.proposer.tree_size == 8 and cfg.verifier.lossy is True
    with pytest.raises(ValueError, match="rank 3"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x"},
                          "proposer": {"type": "recycling", "paths": [[0], [3]], "candidates": 2}})
    with pytest.raises(ValueError, match="lossy"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x"},
                          "verifier": {"type": "typical", "lossy": False}})


def test_decoder_builds_tree_proposers_and_refuses_chain_runtimes():
    model = tiny_llama(seed=3)
    for prop in ({"type": "recycling", "tree_size": 6}, {"type": "lookahead", "window": 3}):
        cfg = {"target": {"backend": "torch", "model": "x"}, "proposer": prop}
        dec = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model))
        r = dec.generate([4, 5, 6, 4, 5], max_new_tokens=20)
        assert r.token_ids == plain_greedy(model, [4, 5, 6, 4, 5], 20)
        chain_rt = TorchRuntime(model)
        chain_rt.capabilities = type(chain_rt.capabilities)(tree_mask=False, name="chain-only")
        with pytest.raises(ValueError, match="token trees"):
            SpeculativeDecoder.from_config(cfg, target=chain_rt)


# ---- typical acceptance (lossy) ---------------------------------------------------------------


def test_typical_rule_matches_medusa_threshold():
    V = 6
    p = torch.zeros(1, 4, V)
    p[0, 0] = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0, 0.0])
    p[0, 1] = torch.tensor([0.05, 0.05, 0.05, 0.05, 0.4, 0.4])
    p[0, 2] = torch.full((V,), 1.0 / V)
    p[0, 3] = p[0, 0]
    eps, delta = 0.2, 0.3
    H = [-(r[r > 0] * r[r > 0].log()).sum() for r in p[0]]
    th = [min(eps, delta * float(torch.exp(-h))) for h in H]
    x = torch.tensor([[1, 4]])  # chain: p0(1)=0.3 > th0, p1(4)=0.4 > th1
    v = typical_verify(x, (-1, 0), p[:, :3], eps, delta, torch.Generator().manual_seed(0)).fetch(x)[0]
    assert p[0, 0, 1] > th[0] and p[0, 1, 4] > th[1]
    assert v.accepted == [[0, 1]]
    assert th[0] == pytest.approx(0.0934, abs=1e-3)
    x = torch.tensor([[2, 4]])  # p0(2) = 0.1 just passes the entropy threshold
    assert typical_verify(x, (-1, 0), p[:, :3], eps, delta, None).fetch(x)[0].accepted == [[0, 1]]
    x = torch.tensor([[4, 4]])  # p0(4) = 0: nothing accepted
    assert typical_verify(x, (-1, 0), p[:, :3], eps, delta, None).fetch(x)[0].accepted == [[]]
    # tree: the longest passing path wins; the next token only from tokens passing the test
    x = torch.tensor([[3, 0, 4]])
    v = typical_verify(x, (-1, -1, 1), p, eps, delta, torch.Generator().manual_seed(0)).fetch(x)[0]
    assert v.accepted == [[1, 2]]
    for s in range(50):
        x5 = torch.tensor([[5]])
        v = typical_verify(x5, (-1,), p[:, :2], eps, delta, torch.Generator().manual_seed(s)).fetch(x5)[0]
        assert v.accepted == [[]] and p[0, 0, v.next_tokens[0]] > th[0]


def test_typical_greedy_is_exact_and_stats_say_lossy():
    model = tiny_llama(seed=3)
    prompt = [1, 2, 3, 1, 2, 3]
    target = TorchRuntime(model)
    prop = RecyclingProposer(RecyclingProposer.Config(tree_size=8), target=target)
    outs, stats = run(target, prop, [prompt], 20, verifier=TypicalVerifier())
    assert outs[0] == plain_greedy(model, prompt, 20) and stats.lossy
    _, exact_stats = run(target, prop, [prompt], 20)
    assert not exact_stats.lossy
    pipe = LogitsPipeline(SamplingConfig(temperature=1.0))
    outs, stats = run(target, prop, [prompt] * 4, 20, verifier=TypicalVerifier(), pipeline=pipe,
                      gen=torch.Generator().manual_seed(0))
    assert stats.lossy and stats.to_dict()["lossy"] and all(len(o) == 20 for o in outs)
    # greedy_verify and typical at temperature 0 are the same function
    x = torch.tensor([[1, 2]])
    z = torch.randn(1, 3, 8)
    assert TypicalVerifier()(x, (-1, 0), z, None, GREEDY, None).fetch(x) == greedy_verify(x, (-1, 0), z).fetch(x)


def test_typical_accepts_more_than_exact_at_high_temperature():
    """Typical acceptance is lossy on purpose: it accepts plausible tokens the exact rule rejects."""
    g = torch.Generator().manual_seed(0)
    V = 8
    p = torch.tensor([0.45, 0.35, 0.1, 0.05, 0.05, 0.0, 0.0, 0.0]).expand(2000, 2, V).contiguous()
    x = torch.ones(2000, 1, dtype=torch.long)  # token 1 drafted as a point mass
    typ = typical_verify(x, (-1,), p, 0.09, 0.3, g).fetch(x)[0]
    from spec_plugins.verify import rejection_verify

    ex = rejection_verify(x, (-1,), p, None, g).fetch(x)[0]
    n_typ = sum(len(a) for a in typ.accepted)
    n_ex = sum(len(a) for a in ex.accepted)
    assert n_typ == 2000 and abs(n_ex / 2000 - 0.35) < 0.05


def test_auto_tree_size_follows_the_cost_curve():
    """tree_size: auto offers the 32-node tree, built on the table's device, with each node's
    prior (host data: nothing is read back); the draft policy's sizer keeps what pays: all of it
    on a flat curve (GPU-like), nothing where every position costs a full forward, something in
    between on a CPU-like curve, always an ancestor-closed subtree."""
    from spec_plugins.policy import Costs, ForwardCost
    from spec_plugins.policy.tree_size import TreeSizer
    from spec_plugins.types import ProposeContext

    prop = RecyclingProposer(RecyclingProposer.Config(tree_size="auto"))
    V = 40
    prop.update(torch.arange(V)[None], torch.randn(1, V, V, generator=torch.Generator().manual_seed(0)))
    ranked = prop.propose(ProposeContext([[1, 2, 3]], [6], None, None, True))
    (shaped,) = ranked.shaped
    assert ranked.auto and len(shaped.estimates) == 32 and bool(shaped.draft.valid.all())
    flat = ForwardCost.from_curve([0.05] * 40)
    steep = ForwardCost.from_curve([0.05 * n for n in range(1, 41)])
    curved = ForwardCost.from_curve([0.05 * (1 + 0.12 * (n - 1)) for n in range(1, 41)])
    sizes = {}
    for name, m in (("flat", flat), ("steep", steep), ("curved", curved)):
        d = TreeSizer(Costs(m, frozen=True)).size(ranked)
        sizes[name] = 0 if d is None else d.size
        if d is not None:
            assert all(p < i for i, p in enumerate(d.parents))  # a tree: every kept node's parent kept before it
    assert sizes["flat"] == 32 and sizes["steep"] == 0 and 0 < sizes["curved"] < 32, sizes


def test_auto_tree_size_on_a_real_runtime_measures_and_stays_exact():
    """Through the policy the factory builds (costs measured at setup): exact, and the offered
    32-node tree is cut once the estimates have seen rounds. The first rounds may keep the whole
    tree (uncalibrated estimates, and a measured curve flatter under load), so only the cut is
    asserted, not its round: a policy that never sizes keeps 32 nodes every round and fails."""
    from spec_plugins.policy import build_policy, setup_costs

    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = RecyclingProposer(RecyclingProposer.Config(tree_size="auto"), target=target)
    assert prop.shape.size == 32
    policy = build_policy(prop.config, prop, setup_costs(target, prop, prop.config))
    widths = []
    size = policy.size
    policy.size = lambda r, spent=0.0, budgets=None: (d := size(r, spent, budgets), widths.append(0 if d is None else d.size))[0]
    outs, _ = run(target, prop, [[1, 2, 3, 1, 2, 3]], 20, policy=policy)
    assert outs[0] == plain_greedy(model, [1, 2, 3, 1, 2, 3], 20)
    assert widths and max(widths) <= 32 and any(0 < w < 32 for w in widths), widths
