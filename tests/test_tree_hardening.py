"""Tree drafts at their edges: per-row trees with invalid slots under prefix processors, hybrid
children that would not rank, and estimates that rise along a path. Each test reproduces a crash
the old code had; outputs are compared with plain decoding."""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits, plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.loop import decode
from spec_plugins.policy import Costs, DraftCost, FixedLength, ForwardCost
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.proposers.eagle import EagleProposer
from spec_plugins.proposers.eagle_tree import SlotMeans
from spec_plugins.proposers.hybrid import HybridProposer
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.proposers.suffix import SuffixProposer
from spec_plugins.row_trees import RowTrees, forward_layout
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.types import Draft, Ranked, Shaped
from spec_plugins.verifiers import ExactVerifier

# Not the host: the proposer takes the path a GPU drafter takes (select -> per-row trees, shaped
# drafts priced by running means); its tensors stay on the CPU. Without it these paths run only on
# a GPU.
DEVICE_PATH = torch.device("cpu", 0)


def _device_eagle(model, **config) -> EagleProposer:
    from test_heads import eagle

    prop = EagleProposer(EagleProposer.Config(heads="x", **config), drafter=eagle(model, 0))
    prop.device = DEVICE_PATH
    return prop


@torch.no_grad()
def _greedy_under(model, pipe: LogitsPipeline, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding under ``pipe``'s processors (``plain_greedy`` applies none)."""
    seq, out = list(prompt), []
    for _ in range(n):
        t = int(pipe.process_rows(full_logits(model, seq)[None], [seq])[0].argmax())
        out.append(t)
        seq.append(t)
    return out


# ---- per-row trees under prefix processors -------------------------------------------------------
def test_prefix_processors_skip_invalid_slots_of_per_row_trees():
    """Row 1 uses only its first slot: its others are invalid with parent -1 (what EAGLE's
    ``select``, ``keep_slots`` and ``combine`` write), so walking up from its depth-2 slot passed
    the root and indexed -1 (every such row ended with 'error'). The valid nodes get exactly the
    logits their own prefix gives them."""
    draft = RowTrees(torch.tensor([[-1, 0, 1], [-1, -1, -1]]), (0, 1, 2))
    tree = forward_layout(draft)
    parents = RowTrees(tree.rows, tuple(tree.depth.tolist()))
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 8)
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    seqs = [[1, 1, 1], [2, 2, 2]]
    pipe = LogitsPipeline(SamplingConfig(temperature=0.0, repetition_penalty=1.5))
    out = pipe.process_tree(logits, seqs, tokens, parents)
    valid = {0: [0, 1, 2, 3], 1: [0, 1]}  # forward positions: root and the valid slots
    for b, nodes in valid.items():
        for j in nodes:
            prefix = seqs[b] + tokens[b, 1:j + 1].tolist()  # each row's valid nodes form one chain
            want = pipe.process_rows(logits[b, j][None], [prefix])[0]
            assert torch.equal(out[b, j], want), (b, j)


def test_eagle_tree_on_the_device_path_with_a_repetition_penalty_matches_plain_decoding():
    """A batch of rows with different budgets, EAGLE's per-row trees, a repetition penalty: every
    row runs to its length (before: the short row ended with 'error') and equals plain greedy
    decoding under the same penalty."""
    model = tiny_llama(vocab=32, seed=3)
    pipe = LogitsPipeline(SamplingConfig(temperature=0.0, repetition_penalty=1.5))
    prop = _device_eagle(model, mode="tree", tree_nodes=8, top_k=3)
    prompts, limits = [[13, 1, 16, 17, 12, 10, 19, 18, 23], [21]], [21, 12]
    outs, finished, errors = [[] for _ in prompts], {}, {}
    for step in decode(TorchRuntime(model), prop, ExactVerifier(), pipe, prompts, limits, (), None, DecodeStats(),
                       FixedLength(4)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
        finished.update(step.finished)
        errors.update(step.errors)
    assert not errors and finished == {0: "length", 1: "length"}
    assert outs == [_greedy_under(model, pipe, p, n) for p, n in zip(prompts, limits)]


# ---- a hybrid's children must rank as configured -------------------------------------------------
@pytest.mark.parametrize("section", [{"type": "recycling"}, {"type": "recycling", "tree_size": "auto",
                                                             "paths": [[0], [0, 0]]}])
def test_a_hybrid_refuses_a_recycling_child_that_drafts_a_fixed_tree(section):
    """A fixed recycling tree (a size, or ``paths``) is a plain Draft, which the hybrid's policy
    cannot choose by: refused when the config validates (before: accepted, then the first round
    failed on ``Draft.tagged``), and so is such a child handed over built."""
    with pytest.raises(ValueError, match="recycling with tree_size: auto"):
        HybridProposer.Config(proposers=[{"type": "suffix"}, section])
    fixed = RecyclingProposer(RecyclingProposer.Config())
    assert not ProposerTraits.of(fixed).ranks
    config = HybridProposer.Config(proposers=[{"type": "suffix"}, {"type": "recycling", "tree_size": "auto"}])
    with pytest.raises(ValueError, match="RecyclingProposer does not rank"):
        HybridProposer(config, children=[SuffixProposer(SuffixProposer.Config(tree_nodes=8)), fixed])
    with pytest.raises(ValueError, match="type='nope' is not a known proposer"):
        HybridProposer.Config(proposers=[{"type": "suffix"}, {"type": "nope"}])


def test_a_hybrid_with_an_auto_recycling_child_matches_plain_greedy():
    """What the refusal points to works: suffix + recycling with ``tree_size: auto``, built from
    the config, drafts and equals plain greedy."""
    model = tiny_llama(seed=3)
    target = TorchRuntime(model)
    hyb = HybridProposer(HybridProposer.Config(proposers=[{"type": "suffix", "tree_nodes": 8},
                                                          {"type": "recycling", "tree_size": "auto"}]), target=target)
    assert ProposerTraits.of(hyb.children[1]).ranks
    costs = Costs(ForwardCost.from_curve([1.0] * 40), frozen=True)
    for s in [*hyb.sources(), hyb]:
        costs.set_drafter(s, DraftCost())
    dec = SpeculativeDecoder(target, hyb, costs=costs)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    out = dec.generate(prompt, max_new_tokens=20)
    assert out.token_ids == plain_greedy(model, prompt, 20)
    assert out.stats.draft_tokens > 0


# ---- estimates that rise along a path ------------------------------------------------------------
def test_the_cut_of_a_shared_topology_keeps_every_kept_slots_parent():
    """A chain whose depth-1 estimate exceeds depth 0's (running means learnt from different rows):
    the best-first cut kept slot 1 without slot 0, which the shared topology cannot express
    (KeyError). Each slot now counts at most its parent's estimate, so the cut is a prefix."""
    chain = Draft(torch.arange(4)[None], (-1, 0, 1, 2), None, torch.ones(1, 4, dtype=torch.bool))
    ranked = Ranked([[]], True, [Shaped(chain, (0.4, 0.9, 0.05, 0.05))])
    sizer = TreeSizer(lambda rows, positions: 1.0 + 0.3 * (positions - 1))  # each position costs 30 %
    draft = sizer.size(ranked)
    assert draft is not None and draft.parents == (-1, 0)
    assert draft.tokens.tolist() == [[0, 1]]


def test_slot_means_never_rise_along_a_path():
    """Only depth 0 observed (every request had a budget of one), and low: the deeper slots' priors
    stayed above it. A slot's estimate is now at most its better-ranked siblings' and the best
    slot's a depth up."""
    chain = SlotMeans(1)
    for _ in range(30):
        chain.observe(torch.tensor([[0.05]]).numpy(), (1,))
    est = chain.estimates((1, 1, 1, 1))
    assert all(a >= b for a, b in zip(est, est[1:])), est
    tree = SlotMeans(2)
    tree.means.update({(0, 0): 0.1, (0, 1): 0.3, (1, 0): 0.6, (1, 1): 0.05})
    assert tree.estimates((2, 2)) == (0.1, 0.1, 0.1, 0.05)


def test_a_hybrid_with_an_eagle_chain_on_the_device_path_matches_plain_greedy():
    """Short requests (budget 1) teach only the chain's depth-0 mean, which falls below the untouched
    depth-1 prior; the next longer request's cut then crashed the round (KeyError in
    ``keep_slots``). Now it decodes and equals plain greedy."""
    model = tiny_llama(vocab=32, seed=3)
    target = TorchRuntime(model)
    suffix = SuffixProposer(SuffixProposer.Config(tree_nodes=4))
    chain = _device_eagle(model, mode="chain", num_draft_tokens=4)
    hyb = HybridProposer(HybridProposer.Config(num_draft_tokens=4, proposers=[{"type": "suffix"},
                                                                              {"type": "eagle", "heads": "x"}]),
                         children=[suffix, chain])
    costs = Costs(ForwardCost.from_curve([1.0 + 0.2 * i for i in range(40)]), frozen=True)
    for s in [*hyb.sources(), hyb]:
        costs.set_drafter(s, DraftCost())
    dec = SpeculativeDecoder(target, hyb, costs=costs)
    for i in range(30):
        dec.generate([3 + i % 20, 7, 1 + i % 5], max_new_tokens=3)
    learnt = chain.means.means  # depth 0's mean fell below depth 1's untouched prior: the rise to survive
    assert (1, 0) not in learnt and learnt[(0, 0)] < chain.means.prior * 0.5
    prompt = [5, 9, 2, 7]
    assert dec.generate(prompt, max_new_tokens=20).token_ids == plain_greedy(model, prompt, 20)
