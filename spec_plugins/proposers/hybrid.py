"""Hybrid drafting: two proposers, and per row and round the draft with the most expected
accepted tokens per unit of verify cost (SuffixDecoding's pairing with a model drafter).

Both children draft every round (a feature drafter must catch up on its cache anyway; suffix
lookups cost microseconds), each reporting per row the accepted nodes its draft expects
(``row_drafts``: best-first nodes with suffix frequencies or EAGLE path probabilities; their sum
is ``expected``). Those estimates are calibrated online per child, as accepted / predicted over
the rows that used it, and a row takes

    argmax_c (1 + scale_c x expected_c) / T(1, 1 + nodes_c)

with T the runtime's measured forward-cost curve: a long suffix match wins with a big tree, and
free text goes to the model drafter. The chosen per-row trees are then cut for the batch by the
one tree sizer (``policy/tree_size.py``: one cut per round against the forward over all rows and
the union of their trees, each node's estimate scaled by its child's calibration) and merged
into one batch draft.

Drafting is not free either: a model drafter's propose() can cost as much as a target forward on
a CPU. Children are therefore asked cheapest first (their measured propose time), and a dearer
child is skipped in a round when, for every row, the draft already in hand beats what the dearer
child has delivered on average, its own drafting time included:

    (1 + scale_c x mean expected_c) / (T(1, 1 + mean nodes_c) + draft seconds_c)

Every ``probe_every`` rounds all children draft, so a skipped child's estimates stay current.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal, Sequence

from pydantic import Field, model_validator

from spec_plugins.config import ProposerConfig
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundRecord, RowAware
from spec_plugins.registry import PROPOSERS, register_proposer
from spec_plugins.tree import RowTree, merge_trees


DEFAULT_NODES = 16  # a child's tree size inside a hybrid, where its own default is 'auto'


@register_proposer("hybrid")
class HybridProposer(Proposer):
    """Per row, the better of two proposers' drafts (module docstring)."""

    tree = True

    class Config(ProposerConfig):
        type: Literal["hybrid"] = "hybrid"
        proposers: list[dict[str, Any]] = Field(
            description="The two proposer sections, e.g. [{type: suffix, scope: global}, {type: eagle, heads: DIR}]; "
                        "each must report `row_drafts` (suffix, eagle) and use a fixed tree_nodes.")
        decay: float = Field(0.95, gt=0.0, lt=1.0, description="Memory of the per-child calibration.")
        probe_every: int = Field(16, ge=1, description="Every this many rounds all children draft (a child "
                                                         "skipped as too dear for its gain is re-measured).")

        @model_validator(mode="after")
        def _two(self) -> "HybridProposer.Config":
            if len(self.proposers) != 2:
                raise ValueError(f"hybrid takes exactly two proposers, got {len(self.proposers)}")
            for p in self.proposers:
                if p.get("type") == "hybrid":
                    raise ValueError("a hybrid cannot contain a hybrid")
                if p.get("tree_nodes") == "auto":
                    raise ValueError(f"{p.get('type')}: tree_nodes must be a number inside a hybrid "
                                     "(the hybrid sizes by choosing between the drafts)")
            return self

    def __init__(self, config: "HybridProposer.Config", target: Any = None, children: Sequence[Any] | None = None,
                 **kw: Any) -> None:
        self.config = config
        if children is None:
            children = []
            for section in config.proposers:
                cls = PROPOSERS.get(section.get("type", ""))
                sub = cls.Config.model_validate({"num_draft_tokens": config.num_draft_tokens, **section})
                if getattr(sub, "tree_nodes", None) == "auto":  # a default 'auto': the hybrid does the sizing
                    sub = sub.model_copy(update={"tree_nodes": DEFAULT_NODES})
                children.append(cls(sub, target=target, **kw))
        self.children = list(children)
        for c in self.children:
            if not hasattr(c, "row_drafts"):
                raise ValueError(f"hybrid: proposer {type(c).__name__} does not report its `row_drafts` "
                                 "(best-first nodes with acceptance estimates)")
        self.needs_hidden = any(getattr(c, "needs_hidden", False) for c in self.children)
        self.feature_layers = next((c.feature_layers for c in self.children if getattr(c, "feature_layers", ())), ())
        self.sizer = None  # prices drafts (the runtime's current cost model) and cuts the chosen trees
        if target is not None and hasattr(target, "forward"):
            from spec_plugins.policy.tree_size import TreeSizer

            self.sizer = TreeSizer.for_runtime(target, 33)  # never observes: the children's calibration scales
        self.calib = [[2.0, 2.0] for _ in self.children]  # per child [accepted, predicted]
        self.choice: list[int] = []  # per row: the child whose draft went to the verifier
        self._pred: list[float] = []
        self.used = [0] * len(self.children)  # rows drafted by each child, in all
        n = len(self.children)
        self.draft_s = [0.0] * n  # per child: smoothed seconds of one propose() (0 = not measured yet)
        self.mean_exp = [1.0] * n  # per child: smoothed expected accepted nodes of its non-empty row drafts
        self.mean_nodes = [1.0] * n  # per child: smoothed nodes of its non-empty row drafts
        self.skipped = [0] * n  # rounds in which each child was not asked to draft
        self._round = 0

    def forget(self) -> None:
        """Drop the children's cross-request memory."""
        for c in self.children:
            if hasattr(c, "forget"):
                c.forget()

    # ---- rows: every child follows the batch ---------------------------------------------------------
    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        for c in self.children:
            if isinstance(c, RowAware):
                c.admit(prompts)

    def select_rows(self, rows: Sequence[int]) -> None:
        for c in self.children:
            if isinstance(c, RowAware):
                c.select_rows(rows)

    def num_rows(self) -> int:
        return next((c.num_rows() for c in self.children if isinstance(c, RowAware)), 0)

    # ---- drafting ---------------------------------------------------------------------------------
    def _T(self, n: int) -> float:
        if self.sizer is None:
            return float(n)
        cost = self.sizer.model()
        return cost(1, min(n, cost.max_positions))

    def propose(self, ctx: ProposeContext) -> Draft | None:
        B = len(ctx.sequences)
        probe = self._round % self.config.probe_every == 0
        self._round += 1
        empty: list[RowTree] = [([], [], [])] * B
        per_child = [empty] * len(self.children)
        t_start = time.perf_counter()
        best = [-1] * B  # per row: the child whose draft is kept so far
        best_rate = [0.0] * B  # its rate, drafting cost sunk: (1 + scale x expected) / T(1 + nodes)
        for i in sorted(range(len(self.children)), key=lambda c: self.draft_s[c]):
            if not probe and best[0] >= 0 and min(best_rate) >= self._prospect(i):
                self.skipped[i] += 1
                continue
            c = self.children[i]
            t0 = time.perf_counter()
            d = c.propose(self._capped(c, ctx))
            dt = time.perf_counter() - t0
            self.draft_s[i] = dt if self.draft_s[i] == 0.0 else 0.8 * self.draft_s[i] + 0.2 * dt
            if d is not None:
                per_child[i] = list(c.row_drafts)
            for b in range(B):
                n_nodes = len(per_child[i][b][0])
                exp = sum(per_child[i][b][2])
                if n_nodes:
                    self.mean_exp[i] = 0.9 * self.mean_exp[i] + 0.1 * exp
                    self.mean_nodes[i] = 0.9 * self.mean_nodes[i] + 0.1 * n_nodes
                rate = (1.0 + self._scale(i) * exp) / self._T(1 + n_nodes)
                if rate > best_rate[b]:
                    best[b], best_rate[b] = i, rate
        self.choice = [max(i, 0) for i in best]
        chosen = [per_child[i][b] for b, i in enumerate(self.choice)]
        if self.sizer is not None:
            counts = self.sizer.counts([[p * self._scale(i) for p in probs] for i, (_, _, probs) in zip(self.choice, chosen)],
                                       time.perf_counter() - t_start, [paths for _, paths, _ in chosen])
            chosen = [(t[:n], ps[:n], pr[:n]) for (t, ps, pr), n in zip(chosen, counts)]
        self._pred = [sum(probs) for _, _, probs in chosen]
        for i, (toks, _, _) in zip(self.choice, chosen):
            self.used[i] += bool(toks)
        if not any(toks for toks, _, _ in chosen):
            return None
        merged = merge_trees([(toks, paths) for toks, paths, _ in chosen])
        return Draft(merged.tokens, merged.parents, None, merged.valid)

    def _scale(self, i: int) -> float:
        return self.calib[i][0] / self.calib[i][1]

    def _prospect(self, i: int) -> float:
        """Child ``i``'s average rate with its own drafting time counted (the skip test)."""
        return (1.0 + self._scale(i) * self.mean_exp[i]) / (self._T(1 + round(self.mean_nodes[i])) + self.draft_s[i])

    @staticmethod
    def _capped(child: Any, ctx: ProposeContext) -> ProposeContext:
        """The round's budgets within the child's own depth limit (an EAGLE drafter of depth 6
        inside a hybrid whose suffix side drafts 16 deep)."""
        cap = getattr(getattr(child, "config", None), "num_draft_tokens", None)
        if not isinstance(cap, int):
            return ctx
        return replace(ctx, budgets=[min(b, cap) for b in ctx.budgets])

    def observe(self, record: RoundRecord) -> None:
        """Each child learns from the round (suffix: finished rows enter its index); each
        child's calibration from the rows that used its draft."""
        for c in self.children:
            c.observe(record)
        if record.draft is None or len(self.choice) != record.rows:
            return
        d = self.config.decay
        for i in range(len(self.children)):
            acc = sum(len(a) for a, ch in zip(record.accepted, self.choice) if ch == i)
            pred = sum(p for p, ch in zip(self._pred, self.choice) if ch == i)
            if pred > 0:
                a, p = d * self.calib[i][0] + acc, d * self.calib[i][1] + pred
                self.calib[i] = [min(max(a, 0.05 * p), 2.0 * p), p]

    @property
    def expected(self) -> list[float]:
        return list(self._pred)
