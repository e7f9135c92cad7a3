"""Per-position acceptance estimates with forgetting: what ``auto`` knows about a class of rounds.

p_j = P(draft position j is accepted | positions < j were) and q_j = P(the proposer offers a
token at position j), learnt with exponential forgetting (acceptance comes in bursts: copying
phases) and a prior that extends each position's estimate to the next unseen one, so long drafts
are tried when short ones are always accepted, at most ``max_growth`` positions past the deepest
one with evidence (drafts grow step by step instead of jumping to max_k on one lucky round).
Rounds without drafts fade the evidence slowly (``idle_decay``) back to the prior; where the prior
alone does not pay, the length policy's probe rounds bring new evidence (``AutoDraftLength``).
"""

from __future__ import annotations


class AcceptanceEstimate:
    """Exponentially forgotten per-position counts of reach/accept (p) and offer (q)."""

    def __init__(self, max_k: int, decay: float = 0.8, prior_accept: float = 0.5, prior_weight: float = 1.0,
                 idle_decay: float = 0.97, chain_weight: float | None = None, max_growth: int | None = None) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if not 0.0 < decay <= 1.0 or not 0.0 < idle_decay <= 1.0:
            raise ValueError(f"decay and idle_decay must be in (0, 1], got {decay}, {idle_decay}")
        if not 0.0 <= prior_accept <= 1.0 or prior_weight <= 0 or (chain_weight is not None and chain_weight <= 0):
            raise ValueError(f"prior_accept must be in [0, 1] and prior weights > 0, got {prior_accept}, "
                             f"{prior_weight}, {chain_weight}")
        if max_growth is not None and max_growth < 1:
            raise ValueError(f"max_growth must be >= 1 (or None: no cap), got {max_growth}")
        self.max_k, self.decay, self.idle_decay, self.max_growth = max_k, decay, idle_decay, max_growth
        # the first position's prior stays weak (a collapse must be able to stop drafting); deeper
        # positions lean harder on the previous one (so drafts grow while they keep being accepted)
        self.prior_accept, self.prior_weight = prior_accept, prior_weight
        self.chain_weight = chain_weight if chain_weight is not None else prior_weight
        self.reach = [0.0] * max_k  # rows that had positions < j accepted and a budget > j
        self.hits = [0.0] * max_k  # ... of which position j was drafted and accepted
        self.offer_trials = [0.0] * max_k  # rows with a budget > j
        self.offered = [0.0] * max_k  # ... of which the proposer drafted position j

    def update(self, k: int, rows: int, drafted: list[int], accepted: list[int], start: int = 0,
               fade: bool = True) -> None:
        """One round: draft length ``k`` over ``rows`` rows; ``drafted[j]`` / ``accepted[j]``
        rows drafted / accepted position j (the DecodeStats by-position deltas). Evidence fades
        by ``decay`` per drafting round and, slower, by ``idle_decay`` per round without drafts.
        ``start``: evidence for positions from ``start`` on only, all ``rows`` having reached it
        (a shadow past a real draft; ``fade=False``: the round already faded the evidence)."""
        if fade:
            self.fade(k > 0)
        reach = float(rows)
        for j in range(start, min(k, self.max_k)):
            d = drafted[j] if j < len(drafted) else 0
            a = accepted[j] if j < len(accepted) else 0
            self.offer_trials[j] += rows
            self.offered[j] += d
            if reach <= 0:
                continue
            self.reach[j] += reach
            self.hits[j] += a
            reach = a  # rows that go on to position j + 1

    def fade(self, drafted: bool) -> None:
        """Forget: by ``decay`` after a round that drafted, by ``idle_decay`` after one that did not."""
        lam = self.decay if drafted else self.idle_decay
        for j in range(self.max_k):
            self.reach[j] *= lam
            self.hits[j] *= lam
            self.offer_trials[j] *= lam
            self.offered[j] *= lam

    def accept_probs(self) -> list[float]:
        """p_j, each unseen position borrowing the previous position's estimate as its prior, and
        0 beyond ``max_growth`` positions past the deepest one with evidence (half a row or more).

        Why the cap: after a few fully accepted short drafts the borrowed prior alone would let
        the policy jump to a long draft on one lucky key, and where a wide forward costs several
        single ones such a jump wastes most of a round. Growing by at most ``max_growth`` per
        round of evidence (like TCP's slow start) bounds what one wrong guess costs, while a key
        that keeps being accepted still reaches max_k in a few rounds. (Shrinking the borrowed
        prior with depth instead stalls: on a steep cost curve the next position never looks
        worth one try, so it is never learnt.)"""
        out, prior, w = [], self.prior_accept, self.prior_weight
        limit = self.max_k
        if self.max_growth is not None:
            deepest = max((j + 1 for j in range(self.max_k) if self.reach[j] >= 0.5), default=0)
            limit = min(limit, deepest + self.max_growth)
        for j in range(self.max_k):
            p = (self.hits[j] + w * prior) / (self.reach[j] + w) if j < limit else 0.0
            out.append(p)
            prior, w = p, self.chain_weight
        return out

    def offer_probs(self) -> list[float]:
        """q_j, nonincreasing, unseen positions assumed offered as often as the previous one."""
        out, prior, w = [], 1.0, self.prior_weight
        for j in range(self.max_k):
            q = min(prior, (self.offered[j] + w * prior) / (self.offer_trials[j] + w))
            out.append(q)
            prior = q
        return out
