"""A runtime whose rows share one cache (llama.cpp's unified KV cells and sequence ids): rows are
admitted against their reservations, and each round's draft is cut to what is left, so no round
fails for room (``loop.capacity``). The cut is checked on drafts here; the real GGUF runs it."""

from __future__ import annotations

import threading

import pytest
import torch

from spec_plugins.backends.base import SharedPool
from spec_plugins.loop.capacity import fit, shortfall
from spec_plugins.row_trees import LeafPaths, RowTrees, forward_layout
from spec_plugins.types import Draft
from test_llamacpp import _model_test
from support import free_port, serve_in_thread

def _leaves(draft: Draft) -> int:
    """Sequence ids a forward over ``draft`` needs on llama.cpp: the leaves of every row's tree."""
    tree = forward_layout(draft.parents)
    return sum(len(LeafPaths.of(tree, b).leaves) for b in range(int(draft.tokens.shape[0])))


# ---- the cut, on drafts ----------------------------------------------------------------------
def test_a_wide_tree_is_cut_to_the_leaves_the_sequence_ids_hold():
    parents = (-1, -1, -1, 0, 0, 1, 3)  # leaves after each node: 1 2 3 3 4 4 4
    draft = Draft(torch.arange(14).view(2, 7), parents, valid=torch.ones(2, 7, dtype=torch.bool))
    assert fit(draft, SharedPool(cells=1000, sequences=16), [5, 5]) is draft  # 8 ids are enough
    cut = fit(draft, SharedPool(cells=1000, sequences=7), [5, 5])
    assert cut.parents == (-1, -1, -1, 0) and cut.tokens.tolist() == [[0, 1, 2, 3], [7, 8, 9, 10]]
    assert cut.valid.shape == (2, 4) and _leaves(cut) <= 7
    assert fit(draft, SharedPool(cells=1000, sequences=2), [5, 5]).parents == (-1,)  # a row's own id: a chain


def test_a_draft_is_cut_to_the_cells_left_after_the_rows_caches():
    chain = Draft(torch.arange(16).view(2, 8), tuple(range(-1, 7)))
    # 100 cells - 80 cached - 2 pending leave 18: 9 nodes per row would fit, 8 are drafted
    assert fit(chain, SharedPool(cells=100, sequences=2), [40, 40]) is chain
    assert fit(chain, SharedPool(cells=100, sequences=2), [45, 41]).size == 6  # 12 cells left: 6 per row
    assert fit(chain, SharedPool(cells=100, sequences=2), [49, 49]) is None  # room for the pending tokens only
    assert fit(chain, None, [10**6]) is chain  # a runtime with a context per row: nothing to cut


def test_per_row_trees_count_each_row_s_own_leaves():
    parents = torch.tensor([[-1, 0, 1, 2], [-1, -1, -1, -1]])  # a chain (1 leaf) and a fan (4 leaves)
    draft = Draft(torch.zeros(2, 4, dtype=torch.long), RowTrees(parents, (0, 1, 2, 3)),
                  probs=torch.full((2, 4, 5), 0.2))
    assert _leaves(draft) == 5
    cut = fit(draft, SharedPool(cells=1000, sequences=4), [3, 3])
    assert cut.size == 3 and cut.probs.shape == (2, 3, 5) and _leaves(cut) == 4
    assert cut.parents.parents.tolist() == [[-1, 0, 1], [-1, -1, -1]] and cut.parents.depth == (0, 1, 2)


def test_admission_counts_prompt_and_limit_of_every_row():
    pool = SharedPool(cells=256, sequences=4)
    assert shortfall(pool, [100], [150]) is None
    assert "reserve 260 KV cells" in shortfall(pool, [100], [160]) and "n_ctx" in shortfall(pool, [100], [160])
    assert "max_sequences" in shortfall(pool, [10, 10, 10], [10, 10])
    assert shortfall(None, [10**6], [10**6]) is None


# ---- the real GGUF -----------------------------------------------------------------------------
def _decoder(proposer: dict, **target):
    from spec_plugins import SpeculativeDecoder

    return SpeculativeDecoder.from_config({
        "target": {"backend": "llamacpp", "model": "smollm2-135m-instruct", "threads": 1, **target},
        "proposer": proposer})


def _watch(decoder) -> list[tuple[int, int]]:
    """Record (cells held + cells the forward adds, sequence ids it needs) of every verify forward."""
    seen: list[tuple[int, int]] = []
    rt, inner = decoder.target, decoder.target.forward

    def forward(tokens, tree=None, want_hidden=False):
        B, N = tokens.shape
        ids = B if tree is None or tree.is_chain else sum(len(LeafPaths.of(tree, b).leaves) for b in range(B))
        seen.append((sum(rt.lengths()) + B * N, ids))
        return inner(tokens, tree, want_hidden)

    rt.forward = forward
    return seen


@_model_test
def test_a_row_filling_n_ctx_runs_to_its_limit_under_a_tree():
    """A prompt + max_new_tokens of exactly n_ctx is a request llama.cpp holds, but a recycling tree
    of 13 positions near its end did not fit ("KV cache is full" aborted the row 10 tokens short):
    the last rounds' trees are cut to the cells left."""
    dec = _decoder({"type": "recycling", "num_draft_tokens": 4}, n_ctx=256)
    seen = _watch(dec)
    prompt = dec.encode("1, 2, 3, 4, 5, 6, 7, 8,", False)
    out = dec.generate_batch([prompt], max_new_tokens=256 - len(prompt), chat=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 256 - len(prompt)
    assert max(cells for cells, _ in seen) <= 256 and max(n for n, _ in seen) > 256 - 20  # it ran up to the end
    assert out.stats.draft_tokens > 0


@_model_test
def test_trees_over_a_batch_fit_the_sequence_ids():
    """Three rows of recycling trees (6 leaves each) with 4 sequence ids: 18 ids were asked and the
    round failed; the trees are cut to the ids there are, and the rows still speculate."""
    dec = _decoder({"type": "recycling", "num_draft_tokens": 4}, max_sequences=4, n_batch=64)
    seen = _watch(dec)
    outs = dec.generate_batch(["1, 2, 3, 4, 5,", "the quick brown fox jumps over the lazy dog. the quick",
                               "Once upon a time"], max_new_tokens=24, chat=False)
    assert [len(o.token_ids) for o in outs] == [24, 24, 24] and max(ids for _, ids in seen) <= 4
    assert outs[0].stats.draft_tokens > 0


@_model_test
def test_a_batch_reserving_more_than_n_ctx_is_refused_before_any_forward():
    """Rows whose prompts + limits exceed n_ctx are refused at admission, naming n_ctx, before a
    token is decoded (they used to run until the cache was full, then fail every row)."""
    dec = _decoder({"type": "ngram", "num_draft_tokens": 4}, n_ctx=256)
    seen = _watch(dec)
    prompts = [dec.encode(p, False) for p in ("1, 2, 3, 4, 5,", "Once upon a time")]
    with pytest.raises(ValueError, match=r"reserve \d+ KV cells .* holds 256 \(n_ctx\)"):
        dec.generate_batch(prompts, max_new_tokens=120, chat=False)
    assert seen == [] and dec.target.lengths() == []
    ok = dec.generate_batch(prompts, max_new_tokens=100, chat=False)
    assert [len(o.token_ids) for o in ok] == [100, 100]


@_model_test
def test_the_server_queues_a_request_until_the_cells_it_reserves_are_free():
    """Two requests reserving 160 of 256 cells each: the second waits for the first to finish
    (both used to run until the cache was full, then both failed), and each answer is its solo
    output. A request that could not fit alone is refused (422) naming n_ctx."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from spec_plugins.server.app import http_server
    from spec_plugins.server.connections import ConnectionLimits
    from spec_plugins.server.setup import build_state

    dec = _decoder({"type": "ngram", "num_draft_tokens": 4}, n_ctx=256)
    state = build_state(dec, max_batch=4, max_input_tokens=32, max_total_tokens=200, draft_policy="fixed")
    port = free_port()
    server, _ = http_server(state, "127.0.0.1", port, ConnectionLimits(), log_level="warning")
    thread = serve_in_thread(server)
    url, texts = f"http://127.0.0.1:{port}", ["1, 2, 3, 4, 5,", "10, 20, 30, 40,"]
    answers: dict[int, httpx.Response] = {}
    try:
        posts = [threading.Thread(target=lambda i=i: answers.setdefault(i, httpx.post(
            url + "/generate", json={"inputs": texts[i], "parameters": {"max_new_tokens": 150}}, timeout=300)))
            for i in range(2)]
        for t in posts:
            t.start()
        for t in posts:
            t.join(timeout=300)
        too_big = httpx.post(url + "/v1/completions", json={"prompt": texts[0], "max_tokens": 150, "n": 2},
                             timeout=60)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert [answers[i].status_code for i in range(2)] == [200, 200], [answers[i].text for i in range(2)]
    for i in range(2):
        solo = dec.generate(texts[i], max_new_tokens=150, chat=False)
        assert answers[i].json()["generated_text"] == solo.text
    assert too_big.status_code == 422 and "n_ctx" in too_big.json()["error"]["message"]


@_model_test
def test_a_llama_cpp_draft_model_s_cache_is_reserved_too():
    """A llama.cpp draft model caches the same sequences in a pool of its own: rows that fit the
    target's 1,024 cells but not the draft's 256 ran until the draft's cache was full, then every
    row failed. They are refused at admission, naming the draft model's n_ctx; rows that fit it run
    to their limit with plain decoding's tokens."""
    from spec_plugins import SpeculativeDecoder

    dec = SpeculativeDecoder.from_config({
        "target": {"backend": "llamacpp", "model": "smollm2-135m-instruct", "threads": 1, "n_ctx": 1024},
        "proposer": {"type": "draft_model", "num_draft_tokens": 3,
                     "model": {"backend": "llamacpp", "model": "smollm2-135m-instruct", "threads": 1, "n_ctx": 256}}})
    prompt = dec.encode("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,", False)
    with pytest.raises(ValueError, match=r"the draft model's cache holds 256 \(n_ctx\)"):
        dec.generate_batch([prompt] * 3, max_new_tokens=60, chat=False)
    n = (256 - 2 * len(prompt)) // 2
    outs = dec.generate_batch([prompt] * 2, max_new_tokens=n, chat=False)
    plain = dec.without_speculation().generate_batch([prompt] * 2, max_new_tokens=n, chat=False)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain] and outs[0].stats.draft_tokens > 0


@_model_test
@pytest.mark.parametrize("max_batch,cache", [(8, {"n_ctx": 256}), (8, {"max_sequences": 4})])
def test_the_load_policy_measures_only_batches_the_shared_cache_holds(max_batch, cache):
    """``serve``'s load policy times forwards of every batch size up to ``--max-batch``; on
    llama.cpp those rows share one cache, and 8 rows of context did not fit 256 cells (or 4
    sequence ids): the server failed at startup. It measures the sizes that fit and extrapolates."""
    from spec_plugins.server.setup import build_state

    dec = _decoder({"type": "ngram", "num_draft_tokens": 4}, **cache)
    state = build_state(dec, max_batch=max_batch, max_total_tokens=128, draft_policy="load")
    base, pool = state.policy.costs.forward.base, dec.target.pool
    assert max(base.rows) <= pool.sequences and max(base.rows) * (base.context + base.max_positions) <= pool.cells
    assert dec.target.lengths() == []
    assert base(max_batch, 4) >= base(max(base.rows), 4) > 0  # priced beyond what was measured
