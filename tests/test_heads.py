"""Medusa and EAGLE proposers: greedy output identical to plain greedy with random heads
(correctness never depends on head quality), batches, budgets, the drafter cache, tree shapes."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.types import Ranked
from spec_plugins.heads import EagleConfig, EagleDrafter, MedusaConfig, MedusaHeads, save_head, target_lm_parts
from spec_plugins.tree import best_static_tree, static_tree
from spec_plugins.proposers.eagle import EagleProposer
from spec_plugins.proposers.medusa import MedusaProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.training.features import target_outputs
from spec_plugins.verifiers import ExactVerifier

GREEDY = LogitsPipeline(SamplingConfig(temperature=0.0))
VOCAB_IDS = torch.arange(2, 30)  # a draft vocabulary smaller than the target's (32)


def run(target, proposer, prompts, n, k):
    outs = [[] for _ in prompts]
    stats = DecodeStats()
    for step in decode(target, proposer, ExactVerifier(), GREEDY, prompts, n, (), None, stats, FixedLength(k)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs, stats


def prompts(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def medusa(model, num_heads=3, seed=0):
    torch.manual_seed(seed)
    lm, _ = target_lm_parts(model)
    return MedusaHeads(MedusaConfig(lm.shape[1], num_heads=num_heads, draft_vocab_size=len(VOCAB_IDS)), lm,
                       VOCAB_IDS, zero_init=False)


def eagle(model, seed=0, layers=()):
    torch.manual_seed(seed)
    lm, emb = target_lm_parts(model)
    cfg = EagleConfig(lm.shape[1], num_heads=4, num_kv_heads=2, intermediate_size=64, draft_vocab_size=len(VOCAB_IDS),
                      feature_layers=layers)
    return EagleDrafter(cfg, lm, emb, VOCAB_IDS)


def medusa_prop(model, mode, nodes=10, top_k=3, **kw):
    cfg = MedusaProposer.Config(heads="unused", mode=mode, tree_nodes=nodes, top_k=top_k)
    return MedusaProposer(cfg, heads=medusa(model, **kw))


def eagle_prop(model, mode, nodes=10, top_k=3, seed=0, layers=()):
    cfg = EagleProposer.Config(heads="unused", mode=mode, tree_nodes=nodes, top_k=top_k)
    return EagleProposer(cfg, drafter=eagle(model, seed, layers))


MAKERS = {
    "medusa-tree": lambda m: medusa_prop(m, "tree"),
    "medusa-chain": lambda m: medusa_prop(m, "chain"),
    "eagle-chain": lambda m: eagle_prop(m, "chain"),
    "eagle3-tree": lambda m: eagle_prop(m, "tree", layers=(1, 2)),
    "eagle-tree": lambda m: eagle_prop(m, "tree"),
}


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_identical_single_row(kind, k):
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = MAKERS[kind](model)
    for prompt in prompts(3, seed=k):
        for n in (1, 6, 19):
            outs, stats = run(target, prop, [prompt], n, k)
            assert outs[0] == plain_greedy(model, prompt, n), (kind, prompt, n, k)


@pytest.mark.parametrize("kind", list(MAKERS))
def test_greedy_identical_batch(kind):
    model = tiny_llama(seed=5)
    target = TorchRuntime(model)
    prop = MAKERS[kind](model)
    ps = prompts(4, seed=11)
    limits = [3, 17, 9, 25]
    outs, stats = run(target, prop, ps, limits, 4)
    for p, o, n in zip(ps, outs, limits):
        assert o == plain_greedy(model, p, n), kind
    assert stats.draft_tokens > 0


@pytest.mark.parametrize("mode,layers", [("chain", ()), ("tree", ()), ("tree", (1, 2))])
def test_eagle_cache_matches_full_recompute(mode, layers):
    """After decoding, the drafter's cached keys equal the drafter run on the full committed
    sequence with the target's true features (the last hidden state, or the fused outputs of
    decoder layers 1 and 2: EAGLE-3): the catch-up feeds exactly the right pairs."""
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = eagle_prop(model, mode, layers=layers)
    ps = [[1, 2, 3, 4, 5], [7, 8]]
    outs, _ = run(target, prop, ps, [20, 14], 3)
    d = prop.drafter
    for b, (p, o) in enumerate(zip(ps, outs)):
        if b >= prop.slots.rows:
            break  # finished rows leave the cache
        seq = p + o
        fed = prop.fed[b]
        outs_t = target_outputs(model, torch.tensor([seq]), layers)
        feats = d.project(outs_t["layers"].flatten(1) if layers else outs_t["hidden"])[:fed]
        T = fed
        mask = torch.zeros(1, 1, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        k0, v0 = d.empty_past(1)
        _, k_ref, _ = d(feats[None], torch.tensor([seq[1: fed + 1]]), torch.arange(T)[None], k0, v0, mask)
        live = prop.slots.pos[b] >= 0
        assert sorted(prop.slots.pos[b][live].tolist()) == list(range(fed))
        order = prop.slots.pos[b][live].argsort()
        torch.testing.assert_close(prop.k[b][:, live][:, order], k_ref[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_tree_draft_shapes_and_budgets(kind):
    """Trees respect tree_nodes and each row's depth budget, and are point masses with distinct
    sibling tokens: the condition under which the verifier's point-mass tree rule is exact."""
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    prop = eagle_prop(model, "tree", nodes=7, top_k=2) if kind == "eagle" else medusa_prop(model, "tree", 7, 2)
    seen = []
    orig = prop.propose

    def spy(ctx):
        d = orig(ctx)
        # EAGLE ranks its candidates; the draft the target verifies is their merge (nothing cut at a fixed size)
        seen.append((list(ctx.budgets), TreeSizer().size(d) if isinstance(d, Ranked) else d))
        return d

    prop.propose = spy
    run(target, prop, [[1, 2, 3], [4, 5, 6, 7]], [12, 5], 4)
    trees = 0
    for budgets, d in seen:
        if d is None:
            continue
        valid = d.valid if d.valid is not None else torch.ones(d.tokens.shape, dtype=torch.bool)
        assert d.probs is None
        for b, bud in enumerate(budgets):
            parents = list(d.parents) if isinstance(d.parents, tuple) else d.parents.parents[b].tolist()
            depth = torch.zeros(d.size, dtype=torch.long)
            for i, p in enumerate(parents):  # each row's own tree (EAGLE-2's are per row)
                assert p < i
                depth[i] = depth[p] + 1 if p >= 0 else 0
                assert not valid[b, i] or p < 0 or valid[b, p], "a valid node under an invalid parent"
            assert int(valid[b].sum()) <= 7
            assert bool((depth[valid[b]] < bud).all())
            for parent in set(parents):
                sib = [int(d.tokens[b, i]) for i, p in enumerate(parents) if p == parent and valid[b, i]]
                assert len(sib) == len(set(sib)), (kind, sib)
            trees += any(p != i - 1 for i, p in enumerate(parents))
    assert trees


def test_static_tree_best_first_and_closed():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    tree = best_static_tree(acc, 6, max_depth=3)
    # products: (0,) .6, (0,0) .24, (1,) .2, (0,1) .12, (2,) .1, (1,0) .08 > (0,0,0) .072
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))
    assert best_static_tree(acc, 7, max_depth=3).paths[-1] == (0, 0, 0)
    assert all(p < i for i, p in enumerate(tree.parents))
    with pytest.raises(ValueError, match="no parent"):
        static_tree([(0, 1)])


def test_head_save_load_roundtrip(tmp_path):
    model = tiny_llama(seed=3)
    h = medusa(model)
    save_head(h, h.config.to_dict(), tmp_path / "m")
    h2 = MedusaHeads.from_pretrained(str(tmp_path / "m"), model)
    x = torch.randn(3, 32)
    torch.testing.assert_close(h2(x), h(x), atol=2e-2, rtol=2e-2)  # fp16 on disk
    e = eagle(model)
    save_head(e, e.config.to_dict(), tmp_path / "e")
    e2 = EagleDrafter.from_pretrained(str(tmp_path / "e"), model)
    assert torch.equal(e2.vocab_ids, VOCAB_IDS)
    for name, p in e.state_dict().items():
        torch.testing.assert_close(e2.state_dict()[name], p.to(torch.float16).float() if p.is_floating_point() else p)
    with pytest.raises(FileNotFoundError, match="spec-plugins train"):
        MedusaHeads.from_pretrained(str(tmp_path / "missing"), model)


def eagle_auto(model, target, seed=0):
    cfg = EagleProposer.Config(heads="unused", mode="tree", tree_nodes="auto", top_k=3)
    return EagleProposer(cfg, target=target, drafter=eagle(model, seed))


def test_eagle_auto_tree_greedy_identical_batch():
    """EAGLE with tree_nodes: auto through the policy the factory builds (measured costs, the
    tree cut every round, whether to draft priced with the drafter's cost): greedy identical, and
    the sizer's calibration of EAGLE's estimates moved by what was observed."""
    from spec_plugins.policy import Costs, DraftCost, ForwardCost, build_policy, setup_costs

    model = tiny_llama(seed=5)
    target = TorchRuntime(model)
    prop = eagle_auto(model, target)
    costs = setup_costs(target, prop, prop.config)
    d = costs.drafter(prop)
    assert d.per_call + d.per_token > 0  # measured at setup, with the forward costs
    # on this machine a tiny target makes drafting dearer than it saves (auto would not draft):
    # price a GPU-like flat curve and a free drafter so the tree is sized every round
    costs = Costs(ForwardCost.from_curve([1.0] * 33), frozen=True)
    costs.set_drafter(prop, DraftCost())
    policy = build_policy(prop.config, prop, costs)
    ps = prompts(3, seed=4)
    limits = [9, 21, 14]
    outs = [[] for _ in ps]
    for step in decode(target, prop, ExactVerifier(), GREEDY, ps, limits, (), None, DecodeStats(), policy):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    for p, o, n in zip(ps, outs, limits):
        assert o == plain_greedy(model, p, n)
    assert policy.sizer.calibration(0).predicted != 2.0  # rounds were sized and observed


def _rows(estimates, paths=None):
    """Ranked rows of these estimates; without paths, every row's nodes are one shared chain."""
    from spec_plugins.types import RankedRow

    out = []
    for b, est in enumerate(estimates):
        ps = paths[b] if paths is not None else [(0,) * (i + 1) for i in range(len(est))]
        out.append(RankedRow(list(range(len(est))), ps, est))
    return out


def _record(accepted):
    """A round record with a draft and these accepted nodes per row (what observe reads)."""
    from spec_plugins.types import Draft, RoundRecord

    B = len(accepted)
    draft = Draft(torch.zeros(B, 1, dtype=torch.long), (-1,))
    return RoundRecord(keys=list(range(B)), sequences=[[0]] * B, budgets=[1] * B, draft_keys=None, draft=draft,
                       accepted=accepted, emitted=[[0]] * B, emissions=[], positions=2)


def test_auto_tree_size_follows_the_cost_curve_and_calibration():
    """Flat cost curve (GPU-like): keep every candidate with probability mass; steep curve (each
    position costs a full forward): keep none unless a node is near-certain. Calibration that
    says the drafter over-predicts shrinks the tree; observed rounds move the calibration."""
    from spec_plugins.policy import Costs, ForwardCost
    from spec_plugins.types import Ranked

    probs = [torch.tensor([-0.1, -0.3, -0.7, -1.2, -2.0, -3.0, float("-inf")]).exp().tolist()]
    assert TreeSizer(Costs(ForwardCost.from_curve([0.01] * 40))).cut(_rows(probs)) == [6]
    assert TreeSizer(Costs(ForwardCost.from_curve([0.01 * n for n in range(1, 41)]))).cut(_rows(probs)) == [0]
    sizer = TreeSizer(Costs(ForwardCost.from_curve([0.01 * (1 + 0.2 * (n - 1)) for n in range(1, 41)])))
    mid = sizer.cut(_rows(probs))[0]
    cal = sizer.calibration(0)
    cal.accepted, cal.predicted = 0.5, 2.0  # only a quarter of the predicted nodes were accepted
    assert 0 < mid and sizer.cut(_rows(probs))[0] < mid
    before = cal.scale
    sizer.size(Ranked([[r] for r in _rows(probs)], auto=True))
    sizer.observe(_record([[]]))  # the round just sized accepted nothing
    assert cal.scale < before
    with pytest.raises(ValueError, match="tree_nodes"):
        EagleProposer.Config(heads="unused", tree_nodes=0)


def test_a_source_cut_to_nothing_is_tried_again():
    """A stretch the drafter cannot predict drives its calibration to the floor and the cut to zero;
    rounds where it offers candidates and none are kept fade that evidence toward the prior, so it
    drafts again later (before: never again, for every later prompt of a decoder or server)."""
    from spec_plugins.policy import Costs, ForwardCost
    from spec_plugins.types import Ranked

    probs = [[0.9, 0.8, 0.7, 0.6]]
    sizer = TreeSizer(Costs(ForwardCost.from_curve([0.01 * (1 + 0.2 * (n - 1)) for n in range(1, 41)])))
    assert sizer.cut(_rows(probs))[0] > 0
    cal = sizer.calibration(0)
    cal.accepted, cal.predicted = 0.05 * 20.0, 20.0  # a long stretch with nothing accepted: the floor
    assert sizer.cut(_rows(probs)) == [0]
    idle = 0
    while sizer.size(Ranked([_rows(probs)], auto=True)) is None:
        idle += 1
        assert idle < 60, "a source cut to nothing was never tried again"
    assert idle > 3  # ... but not at once: the evidence fades, it is not dropped


def test_auto_tree_size_prices_the_batch_padded_width():
    """Rows of a batch share one forward padded to the widest tree, so the sizer picks one width
    against T(B, w+1): on a curve where 4 rows pay steeply per position (as a CPU server batch
    does) the 4-row width is narrower than each row's one-row choice; a row with fewer nodes
    keeps its own; the costs a sizer is given (a server's, measured for its batch sizes) are
    what the next round reads."""
    from spec_plugins.policy import Costs, ForwardCost

    probs = [0.9, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    table = {(1, n): 0.030 + 0.002 * (n - 1) for n in range(1, 34)}
    table.update({(4, n): 0.040 + 0.014 * (n - 1) for n in range(1, 34)})
    sizer = TreeSizer(Costs(ForwardCost(table)))
    one = sizer.cut(_rows([probs]))[0]
    four = sizer.cut(_rows([probs] * 4))
    assert (one, four) == (6, [3] * 4)  # one row: 8 positions cost 1.5x one; four rows: 4.2x
    assert sizer.cut(_rows([probs] * 3 + [probs[:1]])) == [2, 2, 2, 1]  # a short row keeps its one node
    assert sizer.cut(_rows([probs[:1]] * 3 + [probs])) == [1] * 4  # one long row does not carry three short
    # the verify width is the union of the rows' paths: four identical chains share 3 positions,
    # four disjoint branches would need 4 x w positions: not worth one
    apart = [[(r,) + (0,) * i for i in range(len(probs))] for r in range(4)]
    assert sizer.cut(_rows([probs] * 4, paths=apart)) == [0] * 4
    sizer.costs = Costs(ForwardCost({k: v for k, v in table.items() if k[0] == 1}))
    assert sizer.cut(_rows([probs] * 4)) == [6] * 4  # a one-row model prices every batch as one row


def test_head_cache_key_covers_the_target_parts_baked_into_the_graph():
    """One trained head attached to two targets: the LM head and embeddings it takes from each
    are non-persistent buffers (not in state_dict) but constants of its ONNX graph, so the
    export cache key must differ, or the second target would run the first one's graph."""
    from spec_plugins.heads.runner import weights_key

    a, b = tiny_llama(seed=3), tiny_llama(seed=4)
    for make in (eagle, medusa):
        head_a, head_b = make(a), make(b)
        head_b.load_state_dict(head_a.state_dict())  # the same trained weights
        assert weights_key(head_a) != weights_key(head_b), make.__name__
        assert weights_key(head_a) == weights_key(make(a)), make.__name__  # same target, same key
