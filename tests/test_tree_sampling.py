"""Tree sampling is exact through the whole engine: chi-square of the first 3 tokens against the
enumerated target law, with draft trees of several point-mass siblings per node (every tree
drafter here drafts point masses: top-k of a head, lookups), shared and per-row topologies
(``tree.RowTrees``), under temperature / top-k / top-p; a deliberately wrong tree rule must fail
the very same test (power check). A tree of sampled nodes is refused by name.

Each sample row generates 4 tokens: the first comes from the prefill, the next round drafts a
depth-2 tree (budget = 4 - 1 - 1 = 2), so tokens 2 and 3 are decided by the tree rule."""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, full_logits

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.loop import decode
from spec_plugins.policy import FixedLength
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer
from spec_plugins.proposers.recycling import RecyclingProposer
from spec_plugins.sampling import LogitsPipeline, sample
from spec_plugins.row_trees import RowTrees, node_depths
from spec_plugins.tree import children
from spec_plugins.verifiers import ExactVerifier
from spec_plugins.verify import Verdict

V = 16
N_SAMPLES = 10000
PROMPT = [1, 5, 2, 5]
ALPHA = 1e-3

# root -> 3 children; child 0 -> 2 children, child 1 -> 1 child
TREE = (-1, -1, -1, 0, 0, 1)
POINT = ("point",) * 6
# node 3 hangs under the first child in even rows and under the second in odd rows (per-row trees)
ROW_TREES = ((-1, -1, -1, 0, 0, 1), (-1, -1, -1, 1, 0, 1))


class TreeSampler(Proposer):
    """Test drafter: a tiny draft model scores each parent; its children are the parent's top draft
    tokens in rank order ("point" nodes: point masses). With ``rows`` (two parent tuples of one
    layered shape), rows alternate between them as ``RowTrees``."""

    tree = True

    def __init__(self, draft_model, kinds=POINT, parents=TREE, rows=None) -> None:
        self.model, self.kinds, self.parents, self.rows = draft_model, kinds, parents, rows

    @torch.no_grad()
    def propose(self, ctx: ProposeContext) -> Draft | None:
        if max(ctx.budgets) < 2:
            return None
        B, n = len(ctx.sequences), len(self.parents)
        toks = torch.zeros(B, n, dtype=torch.long)
        per_row = [self.rows[b % 2] if self.rows else self.parents for b in range(B)]
        for b, parents in enumerate(per_row):
            kids = children(parents)
            prefix = {-1: list(ctx.sequences[b])}
            for parent in [-1] + list(range(n)):
                if not kids[parent]:
                    continue
                seq = prefix[parent]
                logits = self.model(torch.tensor([seq])).logits[:, -1].float()
                ranked = ctx.pipeline.process_rows(logits, [seq]).argsort(-1, descending=True)[0]
                for used, c in enumerate(kids[parent]):
                    toks[b, c] = ranked[used]
                    prefix[c] = seq + [int(toks[b, c])]
        valid = torch.tensor([[True] * n if b >= 2 else [False] * n for b in ctx.budgets])
        parents = RowTrees(torch.tensor(per_row), node_depths(self.parents)) if self.rows else self.parents
        return Draft(toks, parents, None, None if bool(valid.all()) else valid)


class NoResidualTree(ExactVerifier):
    """Deliberately wrong: tests every sibling against p itself (no residual update) and falls
    back to p, i.e. forgets that earlier siblings were rejected."""

    def __call__(self, x, parents, target_logits, q, pipeline, generator, valid=None):
        p = target_logits.float().softmax(-1)
        accepted, nxt = [], []
        for b in range(x.shape[0]):
            kids = children(parents if isinstance(parents, tuple) else tuple(parents.parents[b].tolist()))
            path, node = [], -1
            while True:
                chosen = None
                for c in kids[node]:
                    t = int(x[b, c])
                    qc = q[b, c, t] if q is not None else 1.0
                    if torch.rand((), generator=generator) * qc < p[b, node + 1, t]:
                        chosen = c
                        break
                if chosen is None:
                    nxt.append(int(sample(p[b, node + 1][None], generator)[0]))
                    break
                path.append(chosen)
                node = chosen
            accepted.append(path)
        return Verdict(accepted, nxt)


SETTINGS = {
    "t1": SamplingConfig(temperature=1.0),
    "t0.7_topk5": SamplingConfig(temperature=0.7, top_k=5),
    "t1.3_topp0.8": SamplingConfig(temperature=1.3, top_p=0.8),
}


def tree_samples(model, proposer, pipeline, verifier, seed=0, n_samples=N_SAMPLES):
    target = TorchRuntime(model)
    gen = torch.Generator().manual_seed(seed)
    outs = [[] for _ in range(n_samples)]
    for step in decode(target, proposer, verifier, pipeline, [PROMPT] * n_samples, 4, (), gen, None, FixedLength(2)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
        if min(len(o) for o in outs) >= 3:  # the 4th token is not tested; skip its round
            break
    return [tuple(o[:3]) for o in outs]


def _models():
    return tiny_llama(vocab=V, seed=11, sharpness=6.0), tiny_llama(vocab=V, seed=12, sharpness=6.0)


@pytest.mark.parametrize("name,rows", [("t1", None), ("t0.7_topk5", ROW_TREES), ("t1.3_topp0.8", ROW_TREES)])
def test_tree_sampling_is_exact(name, rows):
    model, draft = _models()
    pipe = LogitsPipeline(SETTINGS[name])
    exact = exact_joint(model, PROMPT, 3, pipe)
    samples = tree_samples(model, TreeSampler(draft, rows=rows), pipe, ExactVerifier())
    assert chi_square_pvalue(samples, exact) > ALPHA


def test_a_tree_of_sampled_nodes_is_refused_by_name():
    from spec_plugins.verify import rejection_verify

    p = torch.full((1, 3, V), 1.0 / V)
    with pytest.raises(ValueError, match="verified as chains"):
        rejection_verify(torch.zeros(1, 2, dtype=torch.long), (-1, -1), p, p[:, :2], None)


def test_recycling_point_mass_tree_sampling_is_exact():
    """Point-mass siblings from the recycled table (q is None), table warmed on this prompt."""
    model, _ = _models()
    pipe = LogitsPipeline(SETTINGS["t1"])
    prop = RecyclingProposer(RecyclingProposer.Config(paths=[[0], [1], [2], [0, 0], [0, 1], [1, 0]], candidates=3))
    # seed the table with the target's own top-3 after every token (as recycling would learn)
    for t in range(V):
        prop.update(torch.tensor([[t]]), full_logits(model, PROMPT + [t])[None, None])
    exact = exact_joint(model, PROMPT, 3, pipe)
    samples = tree_samples(model, prop, pipe, ExactVerifier())
    assert chi_square_pvalue(samples, exact) > ALPHA


@pytest.mark.parametrize("rows", [None, ROW_TREES])
def test_power_wrong_tree_rule_fails_same_test(rows):
    model, draft = _models()
    pipe = LogitsPipeline(SETTINGS["t1"])
    exact = exact_joint(model, PROMPT, 3, pipe)
    # 6000 samples: the wrong rule scored p ~ 1e-28 (point masses) at 10000
    samples = tree_samples(model, TreeSampler(draft, rows=rows), pipe, NoResidualTree(), n_samples=6000)
    assert chi_square_pvalue(samples, exact) < 1e-6


def test_tree_draft_differs_from_target_and_uses_depth_two():
    """The test is meaningful: the draft law differs from the target's, and the tree round accepts
    depth-2 paths through several siblings."""
    model, draft = _models()
    pipe = LogitsPipeline(SETTINGS["t1"])
    p = exact_joint(model, PROMPT, 1, pipe)
    q = exact_joint(draft, PROMPT, 1, pipe)
    assert 0.5 * sum(abs(p.get(c, 0) - q.get(c, 0)) for c in set(p) | set(q)) > 0.3
    seen = []

    class Spy(ExactVerifier):
        def __call__(self, x, parents, z, q, pipeline, gen, valid=None):
            v = super().__call__(x, parents, z, q, pipeline, gen, valid)
            seen.extend(acc for acc in v.fetch(x)[0].accepted)
            return v

    target = TorchRuntime(model)
    for _ in decode(target, TreeSampler(draft, rows=ROW_TREES), Spy(), pipe, [PROMPT] * 2000, 4, (),
                    torch.Generator().manual_seed(0), None, FixedLength(2)):
        pass
    firsts = {acc[0] for acc in seen if acc}
    assert {0, 1} <= firsts, firsts  # a later sibling is accepted after an earlier one was rejected
    assert any(len(acc) == 2 for acc in seen)
