"""Which drafters draft this round: the policy's step that runs a proposer's sources.

A proposer is one drafting source, or a composition of several (a hybrid's children). A single
source drafts every round it is asked to: the sizer cuts its tree to what pays (to nothing where no
node does), and its length policy prices a chain's depth. Drafting is not free (a model drafter's
call can cost as much as a target forward on a CPU), so for every child of a composition the
policy decides each round whether it pays, by the one objective (``policy.objective``): children
are asked cheapest first, and one is skipped when, for every row with room (a budget above 0),
the rate already in hand (no draft, or a cheaper child's draft, a shaped one by its slots within
the row's budget) beats what this child has offered on average with its own drafting seconds
counted:

    (1 + sum_j min(1, scale_s x offer_s[j])) / (T(1, 1 + nodes_s) + draft seconds_s)

``offer_s`` (the estimate at each best-first rank) and ``nodes_s`` are what the child offered,
averaged over the drafts it offered that round (a row it drafted nothing for does not count: its
drafting is paid per round, not per row; a round a dear child drafted nothing at all counts as
one empty offer, so it fades until it is skipped: ``SourceGate._dear``) and smoothed over rounds
(``SourceStats``), ``scale_s`` its calibration (each node counted at most once, as the sizer
counts it: ``objective.expected_tokens``), T the runtime's forward costs, the drafting seconds
the costs' online estimate (``Costs.draft_seconds``) and the per-round overhead counted on both
sides. No margin: the sizer already cuts a draft that does not pay, so a drafter that costs
nothing is never skipped. Every ``probe_every`` rounds every child drafts, and such a probe weighs more, so a
child skipped through one kind of text comes back when the text turns its way.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from spec_plugins.policy.tree_size import within
from spec_plugins.types import Draft, ProposeContext, Ranked, RankedRow

DEAR_SHARE = 0.05  # of a one-position forward: a child drafting dearer than this fades when it offers nothing


class SourceStats:
    """Smoothed (uncalibrated) estimates a composition's child offers per row when it drafts,
    before any cut: the mean estimate at each best-first rank (``offer``) and the mean node count.
    Updated once per round with the round's offers averaged, so the smoothing forgets by
    ``decay`` per round whatever the batch size. Text changes (free prose followed by
    arithmetic), so a probe of a skipped child weighs ``probe_weight``: one that finds it paying
    brings it back, one that finds it poor keeps it skipped."""

    def __init__(self, decay: float = 0.9, probe_weight: float = 0.5) -> None:
        self.decay, self.probe_weight = decay, probe_weight
        self.offer: list[float] = [1.0]  # prior: one node, surely accepted
        self.nodes = 1.0
        self.probing = False  # this round's draft is a probe of a skipped child

    @property
    def expected(self) -> float:
        """Expected accepted nodes per row, uncalibrated: the offer's sum."""
        return sum(self.offer)

    @expected.setter
    def expected(self, value: float) -> None:
        """A known smoothed offer (a replay's, a test's): the offer's sum set, its shape kept."""
        total = self.expected
        self.offer = [p * value / total for p in self.offer] if total > 0 else [value]

    def update(self, offers: Sequence[Sequence[float]]) -> None:
        """One round's offers (each row's, each shaped draft's estimates), averaged rank by rank
        (an offer without a rank counts 0 there), then smoothed into the history."""
        if not offers:
            return
        ranked = [sorted(o, reverse=True) for o in offers]
        depth = max(len(self.offer), max(len(o) for o in ranked))
        mean = [sum(o[j] for o in ranked if j < len(o)) / len(ranked) for j in range(depth)]
        old = self.offer + [0.0] * (depth - len(self.offer))
        w = self.probe_weight if self.probing else 1 - self.decay
        self.offer = [(1 - w) * a + w * b for a, b in zip(old, mean)]
        while self.offer and self.offer[-1] <= 0.0:
            self.offer.pop()  # ranks no recent offer reached
        self.nodes = (1 - w) * self.nodes + w * sum(len(o) for o in ranked) / len(ranked)


class SourceGate:
    """Runs a proposer's sources cheapest first and skips those that do not pay (module docstring)."""

    def __init__(self, sources: Sequence[Any], sizer: Any, costs: Any, gated: bool, probe_every: int = 16,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``gated``: whether a source may be skipped (a configured-depth tree drafter, or a
        composition); ``sizer``: the policy's tree sizer (prices and calibrates drafts)."""
        self.sources, self.sizer, self.costs, self.gated = list(sources), sizer, costs, gated
        self.probe_every, self.clock = probe_every, clock
        self.stats = [SourceStats() for _ in self.sources]
        self.skipped = [0] * len(self.sources)
        self._round = 0

    def order(self) -> list[int]:
        """Source indices, cheapest drafting first."""
        return sorted(range(len(self.sources)), key=lambda i: self._draft_seconds(i, 1))

    def _dear(self, i: int, depth: int) -> bool:
        """Whether source ``i``'s drafting costs at least ``DEAR_SHARE`` of a one-position forward:
        only such a child's empty rounds count against it. A near-free one (suffix, n-gram) keeps
        its last offer through text it finds nothing in, so it drafts the round the text turns its
        way instead of waiting for a probe; skipping it would save next to nothing."""
        return self._draft_seconds(i, depth) >= DEAR_SHARE * self.sizer.seconds(1, 1)

    def _draft_seconds(self, i: int, depth: int) -> float:
        return self.costs.draft_seconds(self.sources[i], depth) if self.costs is not None else 0.0

    @property
    def _overhead(self) -> float:
        return self.costs.overhead if self.costs is not None else 0.0

    def _rate(self, estimates: Sequence[float], nodes: float, i: int) -> float:
        """One row's rate with a draft of source ``i`` in hand (its drafting already paid), the
        per-round overhead counted as in ``plain`` and ``prospect``."""
        return self.sizer.rate(estimates, nodes, i, extra=self._overhead)

    @property
    def plain(self) -> float:
        """One row's tokens per second without a draft."""
        return 1.0 / (self.sizer.seconds(1, 1) + self._overhead)

    def prospect(self, i: int, depth: int) -> float:
        """Source ``i``'s average rate for one row, its drafting seconds included."""
        st = self.stats[i]
        return self.sizer.rate(st.offer, round(st.nodes), i, extra=self._overhead + self._draft_seconds(i, depth))

    def draft(self, ctx: ProposeContext) -> Draft | Ranked | None:
        """The round's drafting: one source as it drafts, or every paying source's candidates as
        alternatives per row, each tagged with its source index."""
        probe = not self.gated or self._round % self.probe_every == 0
        self._round += 1
        depth = max(ctx.budgets)
        if len(self.sources) == 1:  # drafts whenever asked: the sizer cuts it to what pays
            return self._propose(0, ctx)
        B = len(ctx.sequences)
        alts: list[list[RankedRow]] = [[] for _ in range(B)]
        shaped = []
        in_hand = [self.plain] * B  # per row: the best rate in hand (nothing: plain's)
        room = [b for b in range(B) if ctx.budgets[b] > 0]  # the rows a draft can serve
        for i in self.order():
            skip = min((in_hand[b] for b in room), default=float("inf")) >= self.prospect(i, depth)
            if skip and not probe:
                self.skipped[i] += 1
                continue
            self.stats[i].probing = skip and self.gated
            ranked = self._propose(i, ctx)
            offers: list[Sequence[float]] = []  # what it offers this round (any row may take it)
            tagged = ranked.tagged(i) if ranked else Ranked([[] for _ in range(B)])
            for b, row in enumerate(tagged.rows):
                alts[b] += row
                for r in row:
                    offers.append(r.estimates)
                    in_hand[b] = max(in_hand[b], self._rate(r.estimates, r.size, i))
            for sh in tagged.shaped:  # one shape for every row, masked below each row's budget
                for b in room:
                    ests = [sh.estimates[j] for j in within(sh, ctx.budgets[b])]
                    if ests:
                        offers.append(ests)
                        in_hand[b] = max(in_hand[b], self._rate(ests, len(ests), i))
            if offers or self._dear(i, depth):  # a dear child offering nothing fades toward none
                self.stats[i].update(offers or [[]])
            shaped += tagged.shaped
        out = Ranked(alts, True, shaped)
        return out if out else None

    def _propose(self, i: int, ctx: ProposeContext) -> Draft | Ranked | None:
        source = self.sources[i]
        if len(self.sources) > 1:  # a child's own depth limit (EAGLE 6 deep inside a hybrid of 16)
            cap = source.config.num_draft_tokens
            if isinstance(cap, int):
                ctx = replace(ctx, budgets=[min(b, cap) for b in ctx.budgets])
        t0 = self.clock()
        out = source.propose(ctx)
        if self.costs is not None:
            self.costs.observe_drafter(source, self.clock() - t0)
        return out
