"""The llama.cpp runtime on per-row trees with padding slots, and the errors llama_decode gives.

``row_trees.combine`` (a hybrid's rows taking different drafters) fills the slots a row's draft
does not use with parent -1 at their layered depth, which may be > 0. Such a slot's leaf sequence
must still hold continuous positions (its own parent chain), or llama.cpp rejects the whole batch.
"""

from __future__ import annotations

import pytest
import torch
from test_llamacpp import _cfg, _ids, _kl, _model_test
from test_llamacpp_state import _cached_ends

from spec_plugins.config import SpecConfig
from spec_plugins.row_trees import combine, forward_layout
from spec_plugins.tree import layout, with_root

CHAIN = (-1, 0, 1)  # part 0: three nodes deep
FORK = (-1, -1, 0)  # part 1: two siblings and a child of the first: two deep
# their union: slots [d0, d0, d1, d2]; a FORK row leaves slot 3 (depth 2) as padding, a CHAIN row slot 1


def _build(**target):
    from spec_plugins.backends import build_runtime

    return build_runtime(SpecConfig.parse(_cfg(**target)).target)


@pytest.fixture(scope="module")
def pair():
    """The runtime under test and a reference runtime of the same config."""
    rts = (_build(max_sequences=8), _build(max_sequences=8))
    yield rts
    for r in rts:
        r.close()


def _parts(toks: list[list[int]]) -> list[tuple[torch.Tensor, tuple[int, ...], None]]:
    """CHAIN over toks[0] and FORK over toks[1], the same tokens for both rows."""
    return [(torch.tensor([toks[0]] * 2), CHAIN, None), (torch.tensor([toks[1]] * 2), FORK, None)]


@_model_test
def test_a_padding_slot_below_depth_0_decodes_and_valid_nodes_match_their_unpadded_tree(pair):
    rt, ref = pair
    prompts = [_ids(rt, "My favourite fruit is the banana. My favourite city is"), _ids(rt, "One, two, three,")]
    words = [[_ids(rt, w)[0] for w in ws] for ws in ((" Paris", ",", " the"), (" four", " five", ","))]
    tokens, parents, valid = combine(_parts(words), [0, 1], torch.device("cpu"))
    assert parents.parents[1, 3].item() == -1 and parents.depth[3] == 2 and not valid[1, 3]  # the padding slot
    roots = torch.tensor([[p[-1]] for p in prompts])
    rt.prefill([p[:-1] for p in prompts])
    out = rt.forward(torch.cat([roots, tokens], 1), forward_layout(parents)).logits
    assert torch.isfinite(out).all()
    for b, (part, slots) in enumerate(((CHAIN, [0, 2, 3]), (FORK, [0, 1, 2]))):
        ref.prefill([prompts[b][:-1]])
        want = ref.forward(torch.tensor([[prompts[b][-1], *words[b]]]), layout(with_root(part))).logits[0]
        for node, slot in enumerate([-1, *slots]):  # -1: the root
            got = out[b, slot + 1]
            assert _kl(got, want[node]) < 1e-3, (b, slot)  # cells sit elsewhere in the cache: a tolerance
    # row 1 keeps root -> ' four' -> ',' (slot 2): a path on a temporary leaf; no cell or id leaks
    rt.commit([[0, 1, 3, 4], [0, 1, 3]])
    lens = [len(prompts[0]) + 3, len(prompts[1]) + 2]
    assert rt.lengths() == lens
    assert _cached_ends(rt, range(8)) == [n - 1 for n in lens] + [-1] * 6


@_model_test
def test_an_invalid_batch_names_its_cause(pair):
    rt, _ = pair
    rt.prefill([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="positions not continuous.*draft layout"):
        rt._decode([(4, 3, (0,), True), (5, 5, (0,), True)])  # position 4 skipped


def _oracle(texts: list[list[int]]):
    """A tree drafter that knows each row's plain greedy text (prompt + output): every round, rows take
    CHAIN (the next three tokens) or FORK (a wrong token beside the next one, the one after under it)
    in turns, combined per row as a hybrid combines its children's drafts, so a FORK row carries a
    padding slot at depth 2 and its accepted path ends on a temporary leaf."""
    from spec_plugins.config import ProposerConfig
    from spec_plugins.proposers.base import Proposer
    from spec_plugins.types import Draft

    class Oracle(Proposer):
        Config = ProposerConfig
        tree = True

        def __init__(self) -> None:
            self.config, self.rounds = ProposerConfig(type="oracle", num_draft_tokens=3), 0

        def propose(self, ctx):
            if min(ctx.budgets) < 3:
                return None
            nxt = []
            for seq in ctx.sequences:
                full = next(t for t in texts if t[:len(seq)] == list(seq))
                nxt.append((full[len(seq):] + [0, 0, 0])[:3])
            chain = torch.tensor(nxt)
            fork = torch.tensor([[n[0], (n[0] + 1) % 1000, n[1]] for n in nxt])
            owner = [(b + self.rounds) % 2 for b in range(len(nxt))]
            self.rounds += 1
            tokens, parents, valid = combine([(chain, CHAIN, None), (fork, FORK, None)], owner, torch.device("cpu"))
            return Draft(tokens, parents, None, valid)

    return Oracle()


@_model_test
def test_rows_drafting_trees_of_different_depths_equal_plain_greedy(pair):
    from spec_plugins import SpeculativeDecoder

    rt, _ = pair
    prompts = [_ids(rt, "Count: 1, 2, 3, 4, 5,"), _ids(rt, "The quick brown fox jumps over the lazy dog. The")]
    plain = SpeculativeDecoder(rt)
    refs = [plain.generate(p, max_new_tokens=20, chat=False).token_ids for p in prompts]
    texts = [p + r for p, r in zip(prompts, refs)]
    spec = SpeculativeDecoder(rt, _oracle(texts)).generate_batch(prompts, max_new_tokens=20, chat=False)
    assert [o.token_ids for o in spec] == refs
    assert sum(o.stats.accepted_tokens for o in spec) >= 10  # the trees were verified and accepted
