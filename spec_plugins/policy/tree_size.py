"""Sizing best-first draft trees: the step of the round that turns a drafter's ranked candidates
(``types.Ranked``) into the ``Draft`` the target verifies.

A drafter that grows its tree best-first (EAGLE-2's reranking, suffix decoding's frequency
expansion, a static tree in prior order) gives each node an estimate of its probability of being
accepted, in descending order, and every prefix is a valid tree. The rows of a batch are verified
in one forward over the union of their trees (``merge_trees``: identical paths share a
position), so every row pays for the batch's width. Two choices, both by the one objective
(``policy.objective``) as the length policy and the sources' gate price it, with each source's
estimates scaled by its own ``Calibration`` and each node counted at most once
(``objective.node_gain``):

1. per row, which alternative to take (a hybrid offers one per child):
   argmax (1 + sum min(1, scale x p)) / (T(1, 1 + nodes) + overhead);
2. (``auto``) one cut w for the batch, each row keeping its first min(w, n_row) nodes:
   argmax (B + sum_rows sum_{i<min(w, n_row)} min(1, scale x p_i)) / (T(B, width(w) + 1) + overhead + spent),
   a draft beating no draft (w = 0) by ``min_gain``; ``overhead`` is the runtime's measured
   seconds per round outside forwards and drafting (``Costs.overhead``), ``spent`` the drafting
   already paid this round (sunk: it counts the same for every w, including w = 0, which drafts
   nothing). Within the paid width an extra node of a row is almost free. A per-row choice
   against the one-row curve over-drafts a batch: over many rows, a wider forward costs
   relatively more than it does for one row.

Whether to draft at all before paying the drafter is the draft-length policy's choice
(``draft_length``), which prices the drafter's own seconds. T is the runtime's ``Costs`` (without
measured costs, a forward is priced by its positions).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable, Sequence

from spec_plugins.policy.objective import Calibration, best_option, expected_tokens, node_gain
from spec_plugins.transfer import upload
from spec_plugins.row_trees import combine, keep_slots, node_depths, union_layout, upload_index
from spec_plugins.tree import merge_trees
from spec_plugins.types import Draft, Ranked, RankedRow, RoundRecord, Shaped


MAX_AUTO_NODES = 32  # candidates a drafter offers for an 'auto' cut (costs are measured to 33 positions)


class TreeSizer:
    """Picks and cuts ranked candidates against the cost model; calibrates each source online."""

    def __init__(self, costs: Any = None, decay: float = 0.9, prior: float = 2.0, min_gain: float = 1.0) -> None:
        """``min_gain``: the factor a cut that keeps nodes must beat no draft by (``best_option``),
        as ``AutoDraftLength``'s does."""
        if not min_gain >= 1.0:  # nan fails too
            raise ValueError(f"min_gain must be >= 1, got {min_gain}")
        self.costs, self.min_gain = costs, min_gain
        self.decay, self.prior = decay, prior
        self.calib: dict[int, Calibration] = {}
        self.picked: dict[int, int] = {}  # rows that kept a non-empty draft from each source, in all
        self._kept: list[tuple[int, float]] = []  # per row of the round being verified: (source, predicted)
        self._nodes: list[list[tuple[int, float]]] = []  # per row: (draft position, estimate) of each kept node

    def sharing(self, costs: Any, min_gain: float) -> "TreeSizer":
        """A sizer pricing with ``costs`` and holding trees to ``min_gain`` over this one's
        calibrations (``calib``, ``picked``: shared, so what one policy learns every policy over
        this sizer uses). Each policy prices with its own costs (a server's, measured for its batch
        sizes; a decoder's, for one row) and keeps its own round's bookkeeping."""
        view = TreeSizer(costs, self.decay, self.prior, min_gain)
        view.calib, view.picked = self.calib, self.picked
        return view

    def calibration(self, source: int) -> Calibration:
        c = self.calib.get(source)
        if c is None:
            c = self.calib[source] = Calibration(self.decay, self.prior)
        return c

    def seconds(self, rows: int, positions: float) -> float:
        """One forward's seconds (without costs: its positions)."""
        return float(positions) if self.costs is None else self.costs(rows, positions)

    @property
    def overhead(self) -> float:
        """Seconds per round outside forwards and drafting (``Costs.overhead``; a bare forward
        cost model, or none, has none), counted in every option as ``AutoDraftLength`` counts it."""
        return float(getattr(self.costs, "overhead", 0.0))

    def rate(self, estimates: Iterable[float], nodes: float, source: int, extra: float = 0.0) -> float:
        """One row's tokens per second verifying ``nodes`` nodes with these (uncalibrated)
        estimates (``expected_tokens``), ``extra`` seconds besides the forward (the round's
        overhead, which the caller adds; a gate's drafting seconds)."""
        tokens = expected_tokens(estimates, self.calibration(source).scale)
        return tokens / (self.seconds(1, 1 + nodes) + extra)

    # ---- the step ---------------------------------------------------------------------------------
    def size(self, ranked: Ranked, spent: float = 0.0, budgets: Sequence[int] | None = None) -> Draft | None:
        """Each row's best alternative, cut for the batch (``auto``), merged into one draft.
        ``budgets``: the round's draft depth per row (None: unbounded); a shaped draft's slots as
        deep as a row's budget or deeper are masked in that row, so the row is priced, credited
        and calibrated by its shallower slots alone (none at budget 0: it takes nothing)."""
        B = len(ranked.rows)
        if budgets is None:
            budgets = [math.inf] * B
        elif len(budgets) != B:
            raise ValueError(f"budgets: one draft depth per row, got {len(budgets)} for {B} rows")
        shaped = [_closed(sh) for sh in ranked.shaped]
        offers = {sh.source: (sh, self._cut_shaped(sh, budgets, spent) if ranked.auto
                              else list(range(len(sh.estimates)))) for sh in shaped}
        picks = [self._pick(alts, offers, k) for alts, k in zip(ranked.rows, budgets)]  # a host row, or a shaped source
        host = [p if isinstance(p, RankedRow) else RankedRow((), (), ()) for p in picks]
        idle = _unpicked(ranked.rows, picks, offers)
        if ranked.auto:
            counts = self.cut(host, spent)
            idle |= {r.source for r, n in zip(host, counts) if r.size and not n}
            host = [r.prefix(n) for r, n in zip(host, counts)]
        for source in idle:
            self.calibration(source).idle()  # offered, not taken: re-tried later (Calibration.idle)
        rows = [host[b] if isinstance(p, RankedRow) else _as_row(*offers[p], budgets[b]) for b, p in enumerate(picks)]
        self._kept = [(r.source, sum(r.estimates)) for r in rows]
        self._nodes = []
        for r in rows:
            if r.size:
                self.picked[r.source] = self.picked.get(r.source, 0) + 1
        if not any(r.size for r in rows):
            return None
        draft, at = _assemble(host, picks, offers, rows)
        self._nodes = [list(zip(pos, r.estimates)) for pos, r in zip(at, rows)]
        return draft

    def placed(self, draft: Draft | None, ahead: Sequence[int] = ()) -> None:
        """The round's draft as the runtime placed it: ``loop.capacity.fit`` keeps the first nodes
        that fit its pool and its widest forward, after ``ahead[b]`` grammar-forced tokens in row
        b, so each row is credited and calibrated by its nodes placed alone (a node cut for room
        is never verified: neither predicted nor missed), as ``budgets`` do for the depth a row
        holds. The forward stays priced at the width sized: the cut is the runtime's, known only
        once placed."""
        width = draft.size if draft is not None else 0
        shift = list(ahead) + [0] * (len(self._nodes) - len(ahead))
        if len(self._nodes) != len(self._kept) or all(
                at + s < width for nodes, s in zip(self._nodes, shift) for at, _ in nodes):
            return
        self._kept = [(source, sum(p for at, p in nodes if at + s < width))
                      for (source, _), nodes, s in zip(self._kept, self._nodes, shift)]

    def _cut_shaped(self, shaped: Shaped, budgets: Sequence[float], spent: float) -> list[int]:
        """The slots of a shaped draft worth verifying for rows with these ``budgets`` (one cut
        for every row): the best-first prefix with the most expected tokens per second, each slot
        gaining only in the rows whose budget is deeper than the slot."""
        order, scale = shaped.order(), self.calibration(shaped.source).scale
        depth, rows = node_depths(shaped.draft.parents), len(budgets)
        fixed = self.overhead + spent
        options, tokens = [(float(rows), self.seconds(rows, 1) + fixed)], float(rows)
        for w, j in enumerate(order, 1):
            if shaped.estimates[j] <= 0.0:
                break
            tokens += sum(depth[j] < k for k in budgets) * node_gain(shaped.estimates[j], scale)
            options.append((tokens, self.seconds(rows, 1 + w) + fixed))
        return sorted(order[:best_option(options, self.min_gain)])

    def _pick(self, alternatives: Sequence[RankedRow], offers: dict[int, tuple[Shaped, list[int]]],
              budget: float = math.inf) -> RankedRow | int:
        """A row's best alternative: a host row, or the source of a shaped draft priced by the
        kept slots within the row's ``budget`` (``within``)."""
        best: RankedRow | int = RankedRow((), (), ())
        best_rate, overhead = float("-inf"), self.overhead
        for r in alternatives:
            rate = self.rate(r.estimates, r.size, r.source, overhead)
            if r.size and rate > best_rate:
                best, best_rate = r, rate
        for source, (shaped, kept) in offers.items():
            slots = within(shaped, budget, kept)
            rate = self.rate([shaped.estimates[j] for j in slots], len(slots), source, overhead)
            if slots and rate > best_rate:
                best, best_rate = source, rate
        return best

    def cut(self, rows: Sequence[RankedRow], spent: float = 0.0) -> list[int]:
        """Nodes to keep per row: one cut w for the batch (module docstring)."""
        B = len(rows)
        if B == 0:
            return []
        gains = []  # per row: calibrated expected accepted nodes when keeping its first n nodes
        for r in rows:
            scale, g = self.calibration(r.source).scale, [0.0]
            for p in r.estimates:
                if p <= 0.0:
                    break
                g.append(g[-1] + node_gain(p, scale))
            gains.append(g)
        fixed = self.overhead + spent
        options = [(float(B), self.seconds(B, 1) + fixed)]  # w = 0: no draft
        union: set = set()
        for w in range(1, max(len(g) for g in gains)):
            union.update(r.paths[w - 1] for r, g in zip(rows, gains) if w < len(g))
            tokens = B + sum(g[min(w, len(g) - 1)] for g in gains)
            options.append((tokens, self.seconds(B, len(union) + 1) + fixed))
        w = best_option(options, self.min_gain)
        return [min(w, len(g) - 1) for g in gains]

    def observe(self, record: RoundRecord) -> None:
        """Each source's calibration from the rows that took its candidates last round."""
        if record.draft is None or len(self._kept) != record.rows:
            self._kept, self._nodes = [], []
            return
        by_source: dict[int, list[float]] = {}
        for (source, predicted), acc in zip(self._kept, record.accepted):
            s = by_source.setdefault(source, [0.0, 0.0])
            s[0] += len(acc)
            s[1] += predicted
        for source, (acc, pred) in by_source.items():
            self.calibration(source).observe(acc, pred)
        self._kept, self._nodes = [], []


def _unpicked(rows: Sequence[Sequence[RankedRow]], picks: Sequence[Any],
              offers: dict[int, tuple[Shaped, list[int]]]) -> set[int]:
    """Sources that offered candidates this round and were picked for no row (a shaped draft cut
    to nothing included): kept by no row, they bring no evidence, so their
    calibration fades toward the prior (``Calibration.idle``); otherwise a source that lost every
    pick after one bad stretch would stay at its scale floor and lose every pick for good."""
    taken = {p.source for p in picks if isinstance(p, RankedRow) and p.size} | {p for p in picks if isinstance(p, int)}
    offered = {r.source for alts in rows for r in alts if r.size}
    shaped = {source for source, (_, slots) in offers.items() if not slots or source not in taken}
    return (offered - taken) | shaped


def _closed(shaped: Shaped) -> Shaped:
    """``shaped`` with each slot's estimate capped by its parent's where every row shares one
    topology: a node is accepted only after its parent, and the best-first cut (ties: the
    shallower first) then never keeps a slot without its parent, which one topology cannot hold.
    A drafter's estimates need not fall along a path on their own (running means: a depth no row
    reached keeps its prior). Per-row trees stay as they are: there a kept slot whose parent was
    cut is invalid in its row (``keep_slots``)."""
    parents = shaped.draft.parents
    if not isinstance(parents, tuple):
        return shaped
    est = list(shaped.estimates)
    for j, p in enumerate(parents):  # a parent comes before its children
        if p >= 0:
            est[j] = min(est[j], est[p])
    return replace(shaped, estimates=tuple(est))


def within(shaped: Shaped, budget: float, slots: Iterable[int] | None = None) -> list[int]:
    """The slots (of ``slots``, else all) a row holds with draft depth ``budget``: those shallower
    than it; the drafter masks the others in the row (its valid mask, on the device: depths are
    host data, so this reads nothing back)."""
    depth = node_depths(shaped.draft.parents)
    return [j for j in (range(len(shaped.estimates)) if slots is None else slots) if depth[j] < budget]


def _as_row(shaped: Shaped, slots: list[int], budget: float) -> RankedRow:
    """What a row with draft depth ``budget`` takes from a shaped draft cut to ``slots``, as the
    sizer's bookkeeping sees a candidate row (its prediction and pick counted from it)."""
    slots = within(shaped, budget, slots)
    return RankedRow([0] * len(slots), [(j,) for j in slots], [shaped.estimates[j] for j in slots], shaped.source)


def _assemble(host: Sequence[RankedRow], picks: Sequence[Any], offers: dict[int, tuple[Shaped, list[int]]],
              rows: Sequence[RankedRow]) -> tuple[Draft, list[list[int]]]:
    """The draft the target verifies: the host rows merged over one topology, the shaped drafts
    cut to their kept slots, one of them per row (combined on the device when rows differ); and
    per row, the draft position of each of its nodes (``rows``: what each row took, as ``size``
    counts it), host data for ``TreeSizer.placed``."""
    parts, owner = [], [-1] * len(picks)
    local: list[list[int]] = [[] for _ in picks]  # per row: its nodes' positions in its part
    if any(r.size for r in host):
        merged = merge_trees([(r.tokens, r.paths) for r in host])
        parts.append((merged.tokens, merged.parents, merged.valid))
        owner = [0 if r.size else -1 for r in host]
        local = [list(idx) for idx in merged.index]
    for source, (shaped, slots) in offers.items():
        if source in picks:
            d = shaped.draft
            parents, valid = keep_slots(d.parents, slots, d.valid, d.tokens.device)
            parts.append((d.tokens[:, upload_index(slots, d.tokens.device)], parents, valid))
            owner = [len(parts) - 1 if p == source else o for p, o in zip(picks, owner)]
            at = {j: k for k, j in enumerate(slots)}
            local = [[at[path[0]] for path in r.paths] if p == source else loc for p, r, loc in zip(picks, rows, local)]
    if len(parts) == 1:
        tokens, parents, valid = parts[0]
        if any(o < 0 for o in owner):
            mask = upload_index([o >= 0 for o in owner], tokens.device).bool()[:, None]
            valid = mask if valid is None else valid & mask.to(valid.device)
        return Draft(tokens, parents, None, valid), local
    device = parts[-1][0].device  # the shaped drafts' (host parts are moved there)
    moved = [(upload(t, device), p, upload(v, device) if v is not None else None) for t, p, v in parts]
    tokens, parents, valid = combine(moved, owner, device)
    slot = union_layout([p for _, p, _ in parts])[0]
    return Draft(tokens, parents, None, valid), [[slot[o][k] for k in loc] if o >= 0 else []
                                                 for o, loc in zip(owner, local)]
