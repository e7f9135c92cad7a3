"""Model-free proposers, round 8: recycling forgets its table like suffix forgets its index (and
the bench's independent memory clears it), a fixed recycling tree_size it cannot reach is
refused, the suffix global index can be bounded by nodes, requests that finish in their prefill
enter the global index, and a hybrid of two suffix children renders each metric family once."""

from __future__ import annotations

import random

import pytest
from helpers import EVERY_PROPOSER, every_proposer, hf_generate, plain_greedy, save_random_heads
from test_suffix import substring_counts, trie_counts

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.proposers.suffix import SuffixProposer
from spec_plugins.suffix_global import GlobalIndex
from spec_plugins.suffix_index import Trie
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier


def _decoder(model, proposer: dict) -> SpeculativeDecoder:
    cfg = {"target": {"backend": "torch", "model": "x"}, "proposer": proposer, "verifier": {"type": "exact"},
           "sampling": {"temperature": 0.0, "seed": 0}}
    return SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model))


# ---- 1. recycling's cross-request table is forgotten ---------------------------------------------------
RECYCLING = {"type": "recycling", "num_draft_tokens": 6, "tree_size": 12}
KEYS = ("target_forwards", "draft_tokens", "accepted_tokens")


def test_recycling_forget_starts_the_next_request_as_a_fresh_proposer_would():
    """After another request warmed the table, ``forget()`` leaves the proposer as a fresh one:
    the same request then drafts and accepts exactly as on a new decoder (and stays greedy)."""
    model = tiny_llama(seed=0, sharpness=2.0)
    warm_up, prompt = [1, 2, 3, 4, 1, 2, 3, 4], [9, 8, 7, 6, 9, 8]
    fresh = _decoder(model, RECYCLING).generate(prompt, max_new_tokens=24)
    dec = _decoder(model, RECYCLING)
    assert ProposerTraits.of(dec.proposer).remembers
    dec.generate(warm_up, max_new_tokens=24)
    assert dec.proposer.table is not None and dec.proposer.rank_stats
    dec.proposer.forget()
    assert dec.proposer.table is None and dec.proposer.rank_stats == {}
    again = dec.generate(prompt, max_new_tokens=24)
    assert again.token_ids == fresh.token_ids == plain_greedy(model, prompt, 24)
    assert {k: again.stats.to_dict()[k] for k in KEYS} == {k: fresh.stats.to_dict()[k] for k in KEYS}
    assert fresh.stats.draft_tokens > 0  # the comparison is about drafting, not about none


def test_bench_independent_memory_clears_the_recycling_table():
    """``--memory independent``: the second of two identical prompts drafts as the first did
    (nothing carried over); ``sequence`` lets it draft from the first's table."""
    from test_bench import tiny_decoder

    from spec_plugins.bench import BenchOptions, BenchPrompt, run_bench

    dec, _ = tiny_decoder()
    same = ("w3 w9 w1 w4 w1 w5 w9 w2 w6",)
    prompts = [BenchPrompt("p1", "rep", same), BenchPrompt("p2", "rep", same)]
    stats = {}
    for memory in ("independent", "sequence"):
        opts = BenchOptions(max_new_tokens=24, runs=1, gammas=[], auto=False, progress=False, cost_positions=4,
                            baselines=[], methods=[("recycling", RECYCLING)], memory=memory)
        rep = run_bench(dec, prompts, opts, meta={"config": "test"})
        assert rep["greedy_mismatches"] == []
        stats[memory] = {p["question_id"]: {k: p["methods"]["recycling"]["stats"][k] for k in KEYS}
                         for p in rep["prompts"]}
    assert stats["independent"]["p2"] == stats["independent"]["p1"]
    assert stats["sequence"]["p2"] != stats["sequence"]["p1"]  # the table does carry over when asked to


# ---- 5. a recycling tree_size it cannot reach is refused -------------------------------------------------
@pytest.mark.parametrize("fields, most", [({"tree_size": 13, "candidates": 1}, 6),
                                          ({"tree_size": 40, "num_draft_tokens": 1}, 8),
                                          ({"tree_size": 9, "num_draft_tokens": 1, "candidates": 64}, 8),
                                          ({"tree_size": 128, "num_draft_tokens": 2}, 72),
                                          ({"tree_size": 7, "num_draft_tokens": "auto", "candidates": 1}, 6)])
def test_recycling_refuses_a_tree_size_it_cannot_reach(fields, most):
    """The reachable maximum: min(candidates, 8) ranks per node over num_draft_tokens levels (ranks
    from 8 on have no prior), counted here independently of the tree builder."""
    depth = fields.get("num_draft_tokens", 6)
    depth = 6 if depth == "auto" else depth
    width = min(fields.get("candidates", 8), 8)
    assert sum(width ** d for d in range(1, depth + 1)) == most
    with pytest.raises(ValueError, match=rf"tree_size={fields['tree_size']} cannot be reached.*at most {most} nodes"):
        RecyclingProposer.Config(**fields)
    ok = RecyclingProposer(RecyclingProposer.Config(**{**fields, "tree_size": most}))
    assert ok.shape.size == most  # the maximum itself is accepted and drafted whole


def test_recycling_tree_sizes_within_reach_and_other_shapes_stay_accepted():
    for fields in ({}, {"tree_size": 128}, {"tree_size": 24, "num_draft_tokens": 3}, {"tree_size": "auto",
                   "candidates": 1}, {"paths": [[0], [0, 0]], "candidates": 1, "tree_size": 12},
                   {"tree_size": 12, "num_draft_tokens": 0}):
        RecyclingProposer.Config(**fields)


@pytest.mark.parametrize("fields,most", [({"num_draft_tokens": 1}, 8), ({"candidates": 1}, 6),
                                         ({"num_draft_tokens": 2, "candidates": 2}, 6)])
def test_the_default_tree_size_is_a_cap_not_a_demand(fields, most):
    """A config that sets only depth or width (the default tree_size, 12, out of its reach) loads,
    as it always did, and drafts the whole reachable tree."""
    assert RecyclingProposer(RecyclingProposer.Config(**fields)).shape.size == most


# ---- 2. the suffix global index under a node cap -------------------------------------------------------
def _nodes(requests, depth):
    return len(substring_counts(requests, depth))


def test_global_index_node_cap_evicts_the_oldest_until_it_holds():
    """Each add evicts the oldest requests until the nodes are within ``max_nodes``: the index holds
    the newest run of requests a reference count of distinct substrings allows, and exactly their
    substrings with their counts."""
    rng = random.Random(3)
    depth, cap = 6, 120
    requests = [[rng.randrange(5) for _ in range(rng.randrange(3, 30))] for _ in range(25)]
    index = GlobalIndex(depth, 10**9, max_nodes=cap)
    start = 0
    for t, req in enumerate(requests):
        index.add("*", req)
        while _nodes(requests[start:t + 1], depth) > cap:  # the reference: oldest first
            start += 1
        held = requests[start:t + 1]
        assert [list(e[2]) for e in index.fifo] == held
        assert index.stats.nodes == _nodes(held, depth) <= cap
        trie = index.tries.get("*", Trie(depth))
        assert trie_counts(trie) == dict(substring_counts(held, depth))
    assert index.stats.evicted_requests > 0 and index.stats.requests == len(held)


def test_a_request_over_the_node_cap_alone_leaves_the_index_empty():
    index = GlobalIndex(4, 10**9, max_nodes=5)
    index.add("*", [1, 2, 3, 4, 5, 6])
    assert index.stats.nodes == 0 and index.stats.requests == 0 and not index.tries


def test_suffix_config_passes_the_node_cap_to_its_index():
    prop = SuffixProposer(SuffixProposer.Config(scope="global", global_max_nodes=1000))
    assert prop.index.max_nodes == 1000
    prop.forget()
    assert prop.index.max_nodes == 1000
    assert SuffixProposer().index.max_nodes is None  # default: the token cap alone
    with pytest.raises(ValueError):
        SuffixProposer.Config(global_max_nodes=0)


# ---- 3. requests that finish in their prefill enter the global index -----------------------------------
def test_requests_finishing_in_their_prefill_enter_the_global_index():
    """A 1-token request joining a running batch, and a request whose first token is EOS, are
    finished requests like any other: the global index holds their prompt and token (an
    independent substring count), and the running row goes on as plain greedy decoding."""
    from spec_plugins.loop.batch import Batch
    from spec_plugins.loop.round import run_round
    from spec_plugins.policy import DraftPolicy, FixedLength

    model = tiny_llama(seed=7, sharpness=6.0)
    target = TorchRuntime(model)
    prop = SuffixProposer(SuffixProposer.Config(scope="global", tree_nodes=8, min_token_prob=0.0))
    policy = DraftPolicy.of(FixedLength(4))
    long_p, one_p, eos_p = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1]

    batch = Batch(target, prop, ExactVerifier())
    batch.add([RowRequest("long", long_p, 16)])
    long_row = batch.rows[0]  # the batch drops it once finished
    assert run_round(batch, policy) is not None  # the long row is in flight
    (one,) = batch.add([RowRequest("one", one_p, 1)])
    assert one.finish_reason == "length" and one.tokens == plain_greedy(model, one_p, 1)
    assert [list(e[2]) for e in prop.index.fifo] == [one_p + one.tokens]
    while run_round(batch, policy) is not None:
        pass
    long_out = plain_greedy(model, long_p, 16)
    assert long_row.tokens == long_p + long_out

    eos = plain_greedy(model, eos_p, 1)[0]
    batch = Batch(target, prop, ExactVerifier(), eos_ids=[eos])
    (first,) = batch.add([RowRequest("eos", eos_p, 20)])
    assert first.finish_reason == "eos_token" and first.tokens == [eos]
    held = [one_p + one.tokens, long_p + long_out, eos_p + [eos]]
    assert [list(e[2]) for e in prop.index.fifo] == held
    assert trie_counts(prop.index.tries["*"]) == dict(substring_counts(held, prop.config.depth))


def test_a_one_token_generate_enters_the_index_of_a_global_scope_only():
    """The decoder's own path: a 1-token generate enters the index; ``scope: request`` keeps none."""
    model = tiny_llama(seed=0, sharpness=2.0)
    for scope, held in (("global", 1), ("request", 0)):
        dec = _decoder(model, {"type": "suffix", "scope": scope, "num_draft_tokens": 8, "tree_nodes": 8})
        out = dec.generate([1, 2, 3, 4, 5, 6], max_new_tokens=1)
        assert out.token_ids == plain_greedy(model, [1, 2, 3, 4, 5, 6], 1)
        assert dec.proposer.index.stats.requests == held
        assert out.stats.target_forwards == 0  # the prefill record feeds the proposer only, not the stats


@pytest.fixture(scope="module")
def heads_target(tmp_path_factory):
    model = tiny_llama(seed=3, sharpness=2.0)
    return model, save_random_heads(model, tmp_path_factory.mktemp("heads"))


@pytest.mark.parametrize("kind", EVERY_PROPOSER)
def test_every_proposer_decodes_on_when_a_joining_row_finishes_in_its_prefill(heads_target, kind):
    """The proposer sees the prefill finish (a record with no draft and no logits); the running
    row's output stays transformers' own greedy ``generate`` (an independent reference)."""
    from spec_plugins.loop.batch import Batch
    from spec_plugins.loop.round import run_round
    from spec_plugins.policy import DraftPolicy, FixedLength

    model, heads = heads_target
    rt = TorchRuntime(model)
    batch = Batch(rt, every_proposer(kind, rt, heads, draft=lambda: TorchRuntime(model)), ExactVerifier())
    policy = DraftPolicy.of(FixedLength(3))
    long_p, n = [1, 2, 3, 1, 2, 3, 1], 12
    batch.add([RowRequest("long", long_p, n)])
    long_row = batch.rows[0]  # the batch drops it once finished
    run_round(batch, policy)
    (one,) = batch.add([RowRequest("one", [5, 6, 5, 6], 1)])
    assert one.finish_reason == "length"
    while run_round(batch, policy) is not None:
        pass
    assert long_row.tokens[len(long_p):] == hf_generate(model, [long_p], n, 0)[0]


# ---- 4. a hybrid of two suffix children on /metrics ------------------------------------------------------
def test_hybrid_of_two_suffix_children_renders_each_family_once():
    """Prometheus' own parser reads the text: no family twice, each child's samples under its own
    name, equal to that child's own metrics."""
    from collections import Counter

    from prometheus_client.parser import text_string_to_metric_families

    from spec_plugins.server.metrics import Metrics, proposer_metrics

    model = tiny_llama(seed=0, sharpness=2.0)
    dec = _decoder(model, {"type": "hybrid", "proposers": [{"type": "suffix", "scope": "global"},
                                                           {"type": "suffix", "max_spec_factor": 4}]})
    dec.generate_batch([[1, 2, 3, 1, 2, 3], [4, 5, 4, 5]], max_new_tokens=10)
    text = Metrics().render(proposer=proposer_metrics(dec.proposer))
    helps = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# HELP "))
    types = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))
    assert max(helps.values()) == 1 and max(types.values()) == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for i, child in enumerate(dec.proposer.children):
        for name, _, _, value in child.metrics():
            fam = families[f"spec_child{i}_{name.removeprefix('spec_')}".removesuffix("_total")]
            assert [s.value for s in fam.samples] == [pytest.approx(value)]
    assert families["spec_child0_suffix_index_requests"].samples[0].value == 2  # the global child indexed both
    assert families["spec_child1_suffix_index_requests"].samples[0].value == 0


def test_a_hybrid_keeps_plain_names_where_one_child_reports():
    """Suffix + recycling: only suffix reports, so its metrics keep their own names."""
    prop = _decoder(tiny_llama(seed=0), {"type": "hybrid", "proposers": [
        {"type": "suffix", "scope": "global"}, {"type": "recycling", "tree_size": "auto"}]}).proposer
    assert [m[0] for m in prop.metrics()] == [m[0] for m in prop.children[0].metrics()]
