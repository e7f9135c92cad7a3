"""The llama.cpp runtime, round 14: the forward/commit contract (add_rows refused while a forward is
pending, commit all-or-nothing, keeps past the forward refused, a forward over no rows named), and
that rows after rejected drafts attend to nothing but their own kept tokens."""

from __future__ import annotations

import pytest
import torch
from test_llamacpp import _cfg, _ids, _model_test

from spec_plugins.config import SpecConfig

P = [[1, 504, 2798, 6330, 314], [1, 788, 451, 1183]]


def _build(**target):
    from spec_plugins.backends import build_runtime

    return build_runtime(SpecConfig.parse(_cfg(**target)).target)


@pytest.fixture(scope="module")
def rt():
    r = _build(n_ctx=512, max_sequences=4)
    yield r
    r.close()


def _cells(rt) -> list[tuple[int, int]]:
    """(min, max) position llama.cpp holds per sequence id: what the runtime's lengths must describe."""
    L = rt._L
    return [(L.llama_memory_seq_pos_min(rt._mem, s), L.llama_memory_seq_pos_max(rt._mem, s))
            for s in range(rt.config.max_sequences)]


@_model_test
def test_add_rows_is_refused_while_a_chain_forward_is_pending(rt):
    rt.prefill(P)
    rt.forward(torch.tensor([[28, 29, 30], [28, 29, 30]]))
    with pytest.raises(RuntimeError, match=r"add_rows\(\) between forward\(\) and commit\(\)"):
        rt.add_rows([[1, 260, 8715]])
    rt.commit([[0, 1], [0]])  # the pending forward is still whole: two rows, as forwarded
    assert rt.lengths() == [7, 5]
    assert _cells(rt)[:3] == [(0, 6), (0, 4), (-1, -1)]


@_model_test
def test_a_bad_keep_in_any_row_commits_nothing(rt):
    def next_logits(first_keep):
        rt.prefill(P)
        rt.forward(torch.tensor([[28, 29, 30], [28, 29, 30]]))
        if first_keep is not None:
            with pytest.raises(ValueError, match="row 1: a chain keeps a prefix"):
                rt.commit(first_keep)
            assert rt.lengths() == [8, 7]  # row 0 was not committed either
        rt.commit([[0, 1], [0]])
        assert rt.lengths() == [7, 5] and _cells(rt)[:2] == [(0, 6), (0, 4)]
        return rt.forward(torch.tensor([[5], [5]])).logits

    want = next_logits(None)
    assert torch.equal(next_logits([[0, 1], [1]]), want)  # the refused commit left no trace


@_model_test
def test_keeping_nodes_the_forward_did_not_have_is_refused(rt):
    from spec_plugins.tree import layout, with_root

    rt.prefill(P)
    rt.forward(torch.tensor([[28, 29], [28, 29]]))
    with pytest.raises(ValueError, match=r"row 0: kept nodes \[0, 1, 2, 3\] are not all among the forward's 2 nodes"):
        rt.commit([[0, 1, 2, 3], [0]])
    assert rt.lengths() == [7, 6]
    rt.prefill(P)
    rt.forward(torch.tensor([[28, 29, 30]] * 2), tree=layout(with_root((-1, -1))))
    with pytest.raises(ValueError, match="row 1: kept nodes \\[0, 3\\] are not all among the forward's 3 nodes"):
        rt.commit([[0, 2], [0, 3]])
    rt.commit([[0, 2], [0, 1]])
    assert rt.lengths() == [7, 6] and _cells(rt) == [(0, 6), (0, 5), (-1, -1), (-1, -1)]


@_model_test
def test_a_forward_over_no_rows_is_named(rt):
    rt.prefill(P)
    rt.select_rows([])
    with pytest.raises(ValueError, match="at least one row"):
        rt.forward(torch.zeros(0, 1, dtype=torch.long))
    rt.prefill(P)
    with pytest.raises(ValueError, match="one node per row"):
        rt.forward(torch.zeros(2, 0, dtype=torch.long))


@_model_test
def test_rows_after_rejected_drafts_see_only_their_own_kept_tokens(report):
    """Rejected drafts leave holes that later tokens fill, so a row's cells are no longer in position
    order and its logits drift from its solo run (llama.cpp's arithmetic). They must still not depend
    on what the rejected drafts were, nor on a neighbour's tokens: that would be attention to cells
    the row must not see."""
    rt, solo = _build(n_ctx=256, max_sequences=4), _build(n_ctx=256, max_sequences=4)
    prompts = [_ids(rt, s) for s in ("Count: 1, 2, 3, 4, 5,", "Once upon a time", "The quick brown fox")]
    real = [_ids(rt, s)[:4] for s in (" 6, 7, 8", " there was a little", " jumps over the lazy")]

    def run(r, rows, drafts, nxt):
        r.prefill(rows)
        r.forward(torch.tensor(drafts))
        r.commit([[0]] * len(rows))  # drafted nodes 1.. rejected: holes between the rows' cells
        out = []
        for k in range(len(nxt[0])):
            out.append(r.forward(torch.tensor([[t[k]] for t in nxt])).logits[:, 0])
            r.commit([[0]] * len(rows))
        return torch.stack(out, 1)

    nxt = [t[1:] for t in real]
    base = run(rt, prompts, real, nxt)
    garbage = run(rt, prompts, [[t[0], 9000, 12000, 15000] for t in real], nxt)
    assert torch.equal(base, garbage)  # the rejected tokens left nothing a row attends to
    shifted = [[t + 1 for t in prompts[0]]] + prompts[1:]
    other = run(rt, shifted, [[t + 1 for t in real[0]]] + real[1:], [[t + 1 for t in nxt[0]]] + nxt[1:])
    assert torch.equal(base[1:], other[1:])  # nor does row 0's text
    drift = [float((base[b] - run(solo, [prompts[b]], [real[b]], [nxt[b]])[0]).abs().max()) for b in range(3)]
    report(f"llama.cpp rows after rejected drafts vs the same steps alone, max |logit diff| per row: "
           f"{[round(x, 3) for x in drift]}")
    rt.close()
    solo.close()


@pytest.mark.parametrize("field", ["threads", "threads_batch"])
def test_thread_counts_past_any_cpu_are_refused_at_parse_time(field):
    """llama.cpp aborts the whole process (std::bad_alloc) at the first decode with 100000 threads."""
    from spec_plugins.config import ConfigError

    with pytest.raises(ConfigError, match=rf"{field}.*less than or equal to 1024"):
        SpecConfig.parse(_cfg(**{field: 100_000}))
    assert getattr(SpecConfig.parse(_cfg(**{field: 1024})).target, field) == 1024


@_model_test
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_trained_head_on_llamacpp_is_refused_naming_the_hidden_states(rt, kind):
    """llama.cpp returns no hidden states: a trained head is refused saying so (it was refused
    for having no source model, a fix that would not help)."""
    from pathlib import Path

    from spec_plugins import SpeculativeDecoder

    heads = Path(__file__).resolve().parents[1] / "examples" / "heads" / "smollm2-135m-instruct" / kind
    cfg = SpecConfig.parse({**_cfg(), "proposer": {"type": kind, "heads": str(heads)}})
    with pytest.raises(ValueError, match="hidden states, which the llamacpp runtime does not return"):
        SpeculativeDecoder.from_config(cfg, target=rt)
