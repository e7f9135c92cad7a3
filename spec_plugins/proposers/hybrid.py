"""Hybrid drafting: two proposers, and per row and round the draft with the most expected
accepted tokens per unit of verify cost (SuffixDecoding's pairing with a model drafter).

Each child offers per row its ranked candidates (best-first nodes with suffix frequencies or
EAGLE path probabilities; ``types.Ranked``), tagged with the child's index as their source. The
draft policy's tree sizer (``policy/tree_size.py``) then does the sizing in one place: each row
takes the alternative with the most

    (1 + scale_c x expected_c) / T(1, 1 + nodes_c)

(``scale_c``: the child's own calibration, accepted / predicted over the rows that took its
drafts; T: the runtime's forward costs), so a long suffix match wins with a big tree and free
text goes to the model drafter; the chosen trees are cut for the batch and merged.

Drafting is not free: a model drafter's propose() can cost as much as a target forward on a CPU.
Children are therefore asked cheapest first (their measured propose time), and a dearer child is
skipped in a round when, for every row, the draft already in hand beats what the dearer child has
delivered on average, its own drafting time included (priced by the same sizer):

    (1 + scale_c x mean expected_c) / (T(1, 1 + mean nodes_c) + draft seconds_c)

Every ``probe_every`` rounds all children draft, so a skipped child's estimates stay current.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal, Sequence

from pydantic import Field, model_validator

from spec_plugins.config import ProposerConfig
from spec_plugins.proposers.base import Metric, ProposeContext, Proposer, ProposerTraits, RoundRecord, RowAware
from spec_plugins.registry import PROPOSERS, register_proposer
from spec_plugins.types import Ranked, RankedRow


DEFAULT_NODES = 16  # a child's tree size inside a hybrid, where its own default is 'auto'


@register_proposer("hybrid")
class HybridProposer(Proposer):
    """Per row, the better of two proposers' drafts (module docstring)."""

    tree = True
    ranks = True
    prices_drafting = True  # each child is skipped in a round where its drafting does not pay

    class Config(ProposerConfig):
        type: Literal["hybrid"] = "hybrid"
        proposers: list[dict[str, Any]] = Field(
            description="The two proposer sections, e.g. [{type: suffix, scope: global}, {type: eagle, heads: DIR}]; "
                        "each must rank its candidates (suffix, eagle) and use a fixed tree_nodes.")
        tree_nodes: Literal["auto"] = Field("auto", description="Always 'auto': the draft policy picks each row's "
                                                                 "child and cuts the trees by the measured costs.")
        probe_every: int = Field(16, ge=1, description="Every this many rounds all children draft (a child "
                                                         "skipped as too dear for its gain is re-measured).")

        @property
        def auto_tree(self) -> bool:
            return True

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
            if not ProposerTraits.of(c).ranks:
                raise ValueError(f"hybrid: proposer {type(c).__name__} does not rank its candidates (best-first "
                                 "nodes with acceptance estimates); use suffix or eagle")
        traits = [ProposerTraits.of(c) for c in self.children]
        self.needs_hidden = any(t.needs_hidden for t in traits)
        self.feature_layers = next((t.feature_layers for t in traits if t.feature_layers), ())
        n = len(self.children)
        self._sizer: Any = None  # the sizer of the last round (its picks per child)
        self.draft_s = [0.0] * n  # per child: smoothed seconds of one propose() (0 = not measured yet)
        self.mean_exp = [1.0] * n  # per child: smoothed expected accepted nodes of its non-empty row drafts
        self.mean_nodes = [1.0] * n  # per child: smoothed nodes of its non-empty row drafts
        self.skipped = [0] * n  # rounds in which each child was not asked to draft
        self._round = 0

    def forget(self) -> None:
        """Drop the children's cross-request memory."""
        for c in self.children:
            if ProposerTraits.of(c).remembers:
                c.forget()

    def metrics(self) -> list[Metric]:
        """Every child's own metrics (suffix decoding's index inside a suffix + EAGLE hybrid)."""
        return [m for c in self.children if ProposerTraits.of(c).reports for m in c.metrics()]

    @property
    def used(self) -> list[int]:
        """Rows whose kept draft came from each child, in all (the sizer's picks)."""
        picked = self._sizer.picked if self._sizer is not None else {}
        return [picked.get(i, 0) for i in range(len(self.children))]

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
    def propose(self, ctx: ProposeContext) -> Ranked | None:
        """Every (not skipped) child's candidates per row, tagged with the child as their source."""
        B = len(ctx.sequences)
        self._sizer = ctx.sizing
        probe = self._round % self.config.probe_every == 0 or ctx.sizing is None
        self._round += 1
        alts: list[list[RankedRow]] = [[] for _ in range(B)]
        best_rate: list[float] | None = None  # per row: the best rate in hand (nothing: plain's), drafting sunk
        for i in sorted(range(len(self.children)), key=lambda c: self.draft_s[c]):
            if not probe and best_rate is not None and min(best_rate) >= self._prospect(ctx.sizing, i):
                self.skipped[i] += 1
                continue
            if ctx.sizing is not None and best_rate is None:
                best_rate = [ctx.sizing.rate(0.0, 0, i)] * B
            c = self.children[i]
            t0 = time.perf_counter()
            ranked = c.propose(self._capped(c, ctx))
            dt = time.perf_counter() - t0
            self.draft_s[i] = dt if self.draft_s[i] == 0.0 else 0.8 * self.draft_s[i] + 0.2 * dt
            if ranked is None:
                continue
            for b, row_alts in enumerate(ranked.rows):
                for r in row_alts:
                    if not r.size:
                        continue
                    r = RankedRow(r.tokens, r.paths, r.estimates, i)
                    alts[b].append(r)
                    exp = sum(r.estimates)
                    self.mean_exp[i] = 0.9 * self.mean_exp[i] + 0.1 * exp
                    self.mean_nodes[i] = 0.9 * self.mean_nodes[i] + 0.1 * r.size
                    if best_rate is not None:
                        best_rate[b] = max(best_rate[b], ctx.sizing.rate(exp, r.size, i))
        if not any(alts):
            return None
        return Ranked(alts, auto=True)

    def _prospect(self, sizing: Any, i: int) -> float:
        """Child ``i``'s average rate with its own drafting time counted (the skip test)."""
        return sizing.rate(self.mean_exp[i], round(self.mean_nodes[i]), i, extra=self.draft_s[i])

    @staticmethod
    def _capped(child: Any, ctx: ProposeContext) -> ProposeContext:
        """The round's budgets within the child's own depth limit (an EAGLE drafter of depth 6
        inside a hybrid whose suffix side drafts 16 deep)."""
        cap = child.config.num_draft_tokens
        if not isinstance(cap, int):
            return ctx
        return replace(ctx, budgets=[min(b, cap) for b in ctx.budgets])

    def observe(self, record: RoundRecord) -> None:
        """Each child learns from the round (suffix: finished rows enter its index)."""
        for c in self.children:
            c.observe(record)
