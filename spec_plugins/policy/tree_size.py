"""Sizing best-first draft trees by the cost model (``tree_nodes: auto`` of EAGLE and suffix).

A drafter that grows its tree best-first (EAGLE-2's reranking, suffix decoding's frequency
expansion) gives every node an estimate of its probability of being accepted, in descending
order, and every prefix of that order is a valid tree (a child never scores above its parent).
The count kept per row is the prefix n maximising

    (1 + scale x sum_{i<n} p_i) / (T(1, n + 1) + seconds already spent drafting this round)

where T is the runtime's measured forward-cost curve and ``scale`` the ratio of accepted to
predicted nodes over recent rounds (the drafter's estimates are rarely calibrated: EAGLE's path
probabilities are over-confident on unfamiliar text, suffix frequencies on short matches).
"""

from __future__ import annotations

from typing import Any, Sequence


class TreeSizer:
    """Per-row node counts from acceptance estimates and the cost curve, calibrated online."""

    def __init__(self, cost: Any, decay: float = 0.9, prior: float = 2.0, bounds: tuple[float, float] = (0.05, 2.0)
                 ) -> None:
        self.cost = cost
        self.decay, self.bounds = decay, bounds
        self.calib = [prior, prior]  # [accepted, predicted]: starts calibrated
        self._predicted = 0.0  # raw estimates of the nodes kept in the round being verified

    @property
    def scale(self) -> float:
        return self.calib[0] / self.calib[1]

    def counts(self, estimates: Sequence[Sequence[float]], spent: float = 0.0) -> list[int]:
        """Nodes to keep per row; ``estimates[b]`` in best-first (descending) order."""
        cost, scale = self.cost, self.scale
        out = []
        self._predicted = 0.0
        for row in estimates:
            best_n, best, total = 0, 1.0 / (cost(1, 1) + spent), 1.0
            for n, p in enumerate(row, start=1):
                if p <= 0.0:
                    break
                total += min(1.0, p * scale)
                rate = total / (cost(1, n + 1) + spent)
                if rate > best:
                    best_n, best = n, rate
            out.append(best_n)
            self._predicted += sum(row[:best_n])
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
