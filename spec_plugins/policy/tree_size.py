"""Sizing best-first draft trees by the cost model (``tree_nodes: auto`` of EAGLE and suffix).

A drafter that grows its tree best-first (EAGLE-2's reranking, suffix decoding's frequency
expansion) gives every node an estimate of its probability of being accepted, in descending
order, and every prefix of that order is a valid tree (a child never scores above its parent).
The rows of a batch are verified in one forward over the union of their trees (``merge_trees``:
identical paths share a position), so every row pays for the batch's width. The sizer picks one
cut w, each row keeping its first min(w, n_row) nodes, maximising

    (B + scale x sum_rows sum_{i<min(w, n_row)} p_i) / (T(B, width(w) + 1) + seconds already spent drafting)

where width(w) is the size of the union of the kept rows' paths (w when paths are not given).
Within the paid width an extra node of a row is almost free. T is
the runtime's forward-cost model over (rows, positions), read when sizing (a server re-measures
it for its batch sizes after the proposers were built, and corrects it online), and ``scale``
the ratio of accepted to predicted nodes over recent rounds (the drafter's estimates are rarely
calibrated: EAGLE's path probabilities are over-confident on unfamiliar text, suffix frequencies
on short matches). With one row this is the prefix n maximising (1 + scale x sum p) / T(1, n+1).
A per-row choice against the one-row curve over-drafts a batch: measured on a 4-row server
batch, 8 drafted positions cost 3.8x one position against 1.8x for one row.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence


class TreeSizer:
    """Per-row node counts from acceptance estimates and the cost curve, calibrated online."""

    def __init__(self, cost: Any, decay: float = 0.9, prior: float = 2.0, bounds: tuple[float, float] = (0.05, 2.0)
                 ) -> None:
        """``cost``: a cost model ``(rows, positions) -> seconds``, fixed (``for_runtime``: the
        runtime's current one)."""
        self.cost = cost
        self._model: Callable[[], Any] = lambda: self.cost
        self.decay, self.bounds = decay, bounds
        self.calib = [prior, prior]  # [accepted, predicted]: starts calibrated
        self._predicted = 0.0  # raw estimates of the nodes kept in the round being verified

    @classmethod
    def for_runtime(cls, runtime: Any, max_positions: int, **kw: Any) -> "TreeSizer":
        """Sized by the runtime's cost model as it stands at each round: measured on first use,
        re-measured by whoever needs more rows (the server, for its batch sizes), corrected
        online by the forwards a draft policy observes (``policy.cost``)."""
        from spec_plugins.policy.cost import cost_for, online_for

        sizer = cls(cost_for(runtime, max_positions=max_positions), **kw)
        sizer._model = lambda: online_for(runtime, cost_for(runtime, max_positions=max_positions))
        return sizer

    def model(self) -> Any:
        """The cost model sizing this round (for callers that price drafts the same way)."""
        return self._model()

    @property
    def scale(self) -> float:
        return self.calib[0] / self.calib[1]

    def counts(self, estimates: Sequence[Sequence[float]], spent: float = 0.0,
               paths: Sequence[Sequence[Hashable]] | None = None) -> list[int]:
        """Nodes to keep per row; ``estimates[b]`` in best-first (descending) order, ``paths[b]``
        (optional) the position key of each node in the merged tree (its rank path)."""
        B = len(estimates)
        if B == 0:
            return []
        cost, scale = self.model(), self.scale
        gains = []  # per row: expected accepted nodes when keeping its first n nodes, n = 0..
        for row in estimates:
            g = [0.0]
            for p in row:
                if p <= 0.0:
                    break
                g.append(g[-1] + min(1.0, p * scale))
            gains.append(g)
        best_w, best = 0, B / (cost(B, 1) + spent)
        union: set[Hashable] = set()
        for w in range(1, max(len(g) for g in gains)):
            if paths is not None:
                union.update(ps[w - 1] for ps, g in zip(paths, gains) if w < len(g))
            width = len(union) if paths is not None else w
            rate = (B + sum(g[min(w, len(g) - 1)] for g in gains)) / (cost(B, width + 1) + spent)
            if rate > best:
                best_w, best = w, rate
        out = [min(best_w, len(g) - 1) for g in gains]
        self._predicted = sum(sum(row[:n]) for row, n in zip(estimates, out))
        return out

    def observe(self, accepted: int) -> None:
        """Accepted nodes of the round whose counts were chosen last: recalibrate."""
        if self._predicted <= 0.0:
            return
        lo, hi = self.bounds
        acc = self.decay * self.calib[0] + accepted
        pred = self.decay * self.calib[1] + self._predicted
        self.calib = [min(max(acc, lo * pred), hi * pred), pred]
        self._predicted = 0.0
