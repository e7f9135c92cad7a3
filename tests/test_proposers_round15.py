"""Round 15 of the proposer hunt: a draft model changed between plugin calls, and lookahead rows whose
guesses depended on their batch neighbours."""

from __future__ import annotations

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.proposers.lookahead import LookaheadProposer
from spec_plugins.verifiers import ExactVerifier

IDS = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 9, 3, 4]])


@pytest.mark.parametrize("change", ["resize", "dtype"])
def test_a_draft_model_changed_between_calls_gets_a_new_proposer(change):
    """The plugin keeps a draft model's proposer on it between calls; it was never checked for
    staleness, so after ``resize_token_embeddings`` (64 -> 48 rows) the kept proposer still took
    the vocabulary for 64, clamped nothing and the draft forward died in ``torch.embedding``
    (IndexError). It is rebuilt as the target's setup is (``_stale``): output is transformers' own
    greedy ``generate()`` before and after the change."""
    model, draft = tiny_llama(seed=3, vocab=64), tiny_llama(seed=4, vocab=64)

    def spec():
        return model.generate(input_ids=IDS, max_new_tokens=12, do_sample=False,
                              custom_generate=speculative_generate, draft_model=draft, pad_token_id=0)

    plain = model.generate(input_ids=IDS, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(spec(), plain)
    before = next(iter(draft.__dict__["_spec_plugins_drafts"].values()))
    kept = next(iter(before.values()))
    if change == "resize":
        draft.resize_token_embeddings(48)
    else:
        draft.to(torch.float64)
    assert torch.equal(spec(), plain)
    rebuilt = next(iter(draft.__dict__["_spec_plugins_drafts"].values()))
    assert len(rebuilt) == 1 and next(iter(rebuilt.values())) is not kept
    fresh = next(iter(rebuilt.values()))
    assert torch.equal(spec(), plain)
    assert next(iter(rebuilt.values())) is fresh  # not stale now: kept, not built again


def _lookahead(model) -> SpeculativeDecoder:
    cfg = LookaheadProposer.Config(num_draft_tokens=4, window=4)
    return SpeculativeDecoder(TorchRuntime(model), LookaheadProposer(cfg), ExactVerifier())


def test_a_lookahead_row_drafts_the_same_alone_and_beside_others():
    """A row's guess generator was seeded ``seed + i``, i its position in the batch at admission,
    so the same request accepted a different amount as row 1 than alone. Seeded from the config's
    seed and its own prompt (``row_seed``), its draft and accept counts are the same either way;
    output is plain greedy throughout."""
    model = tiny_llama(seed=3, sharpness=2.0)
    x, z = [5, 6, 7, 5, 6, 7, 8, 9, 5, 6], [3]
    alone = _lookahead(model).generate_batch([x], max_new_tokens=20)[0]
    pair = _lookahead(model).generate_batch([z, x], max_new_tokens=[9, 20])
    assert alone.token_ids == pair[1].token_ids == plain_greedy(model, x, 20)
    assert pair[0].token_ids == plain_greedy(model, z, 9)
    counts = [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in (alone, pair[1])]
    assert counts[0] == counts[1]


def test_a_lookahead_row_admitted_after_others_left_keeps_its_own_seed():
    """Admitted after a row left, a new row took the index (and so the seed) of a running one; now
    each row's generator depends on its prompt and the configured seed only."""
    a, b, c = [1, 2, 3], [4, 5, 6, 7], [8, 9]
    prop = LookaheadProposer()
    prop.admit([a, b])
    prop.select_rows([1])  # a leaves
    prop.admit([c])  # HEAD: seed 0 + 1, the seed b runs with
    alone = LookaheadProposer()
    alone.admit([c])
    running, joined, own = (st.rng.getstate() for st in (prop.rows[0], prop.rows[1], alone.rows[0]))
    assert joined == own and joined != running
    other = LookaheadProposer(LookaheadProposer.Config(seed=1))
    other.admit([c])
    assert other.rows[0].rng.getstate() != own  # the configured seed still counts
