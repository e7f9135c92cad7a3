"""The one objective every sizing decision maximises, and the one rule that calibrates a drafter's
estimates.

Every choice of how much to draft (the draft length, the tree width, which of two drafters a row
takes, whether to draft at all) compares options by

    expected emitted tokens / expected seconds

where option 0 is "no draft" (one token per row for one forward); a draft must beat it by
``min_gain`` (a margin for what the estimates miss). A drafter's own acceptance estimates (EAGLE's
path probabilities, suffix frequencies, a static tree's prior) are rarely calibrated, so each
source's estimates are scaled by ``Calibration``: accepted / predicted nodes over recent rounds.
"""

from __future__ import annotations

from typing import Iterable


def best_option(options: Iterable[tuple[float, float]], min_gain: float = 1.0) -> int:
    """Index of the (expected tokens, seconds) option with the most tokens per second; the first
    option is "no draft", which another must beat by ``min_gain``."""
    best, best_rate = 0, float("-inf")
    for i, (tokens, seconds) in enumerate(options):
        rate = tokens / seconds
        if rate > best_rate * (min_gain if best == 0 and i > 0 else 1.0):
            best, best_rate = i, rate
    return best


class Calibration:
    """Accepted / predicted nodes of one estimate source over recent rounds, as a scale.

    Starts calibrated (``prior`` nodes each side); forgets by ``decay`` per observed round; the
    scale stays within ``bounds`` so one unlucky round cannot switch a source off for good."""

    def __init__(self, decay: float = 0.9, prior: float = 2.0, bounds: tuple[float, float] = (0.05, 2.0)) -> None:
        if not 0.0 < decay <= 1.0 or prior <= 0 or not 0.0 < bounds[0] <= bounds[1]:
            raise ValueError(f"decay in (0, 1], prior > 0 and 0 < low <= high, got {decay}, {prior}, {bounds}")
        self.decay, self.bounds, self.prior = decay, bounds, prior
        self.accepted, self.predicted = prior, prior

    @property
    def scale(self) -> float:
        return self.accepted / self.predicted

    def observe(self, accepted: float, predicted: float) -> None:
        """Nodes accepted in a round whose kept nodes this source predicted ``predicted`` of."""
        if predicted <= 0.0:
            return
        lo, hi = self.bounds
        acc = self.decay * self.accepted + accepted
        pred = self.decay * self.predicted + predicted
        self.accepted, self.predicted = min(max(acc, lo * pred), hi * pred), pred

    def idle(self) -> None:
        """A round in which this source offered candidates and none were kept: its evidence fades
        toward the prior by ``decay``, so a source switched off by one stretch it could not predict
        is tried again some rounds later instead of never."""
        keep = self.decay
        self.accepted = keep * self.accepted + (1.0 - keep) * self.prior
        self.predicted = keep * self.predicted + (1.0 - keep) * self.prior


def node_gain(estimate: float, scale: float) -> float:
    """A node's calibrated expected acceptance: its estimate times its source's scale, at most 1
    (a node is accepted once however much its source under-predicts), none for no estimate."""
    return min(1.0, max(0.0, estimate) * scale)


def expected_tokens(estimates: Iterable[float], scale: float) -> float:
    """A row's expected emitted tokens with these nodes verified: the target's own token plus
    each node's ``node_gain``; every option of every sizing choice is priced by it."""
    return 1.0 + sum(node_gain(p, scale) for p in estimates)
