"""Draft-length policies: ``choose(view) -> per-row lengths`` before a round, ``observe(record)`` after.

``FixedLength`` drafts the configured length. ``AutoDraftLength`` (``num_draft_tokens: auto``
and the server) picks the length with the most expected tokens per second:

    rate(k) = sum_rows E_row(k) / (T(B, 1 + max_rows D_row(k)) + draft(D) + overhead)

E(k) = 1 + sum_{j<k} prod_{i<=j} p_i is a row's expected emitted tokens, D(k) = sum_{j<k} q_j its
expected drafted nodes (p, q: ``AcceptanceEstimate``), T the forward-cost model over (rows,
positions) corrected online (``policy.cost``), and overhead the measured seconds per round
outside forwards and drafting. Every row pays for the batch's padded verify, so one strong row
(a 3-gram copy) can carry the batch; as the batch grows T(B, n) grows with n, and the length
shrinks, down to 0 (plain decoding) when verifying stops being cheap: the load-aware behaviour
is the same formula at a larger B. With one row it is argmax_k E(k) / cost(k).

With a ``Keyed`` proposer (n-gram: the matched suffix length and agreement) each row's E and D
come from the estimate of its own key; rows that did not draft learn from free shadow drafts.
Defaults are tuned by replaying recorded greedy outputs (exact acceptance for any policy) against
measured cost curves (``spec_plugins.bench.replay``). Each call is O(max_k x distinct keys).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Protocol, Sequence

from spec_plugins.policy.acceptance import AcceptanceEstimate
from spec_plugins.policy.cost import DraftCost, ForwardCost, OnlineCost
from spec_plugins.policy.costs import Costs
from spec_plugins.policy.objective import best_option
from spec_plugins.types import BatchView, RoundRecord


class LengthPolicy(Protocol):
    """How deep each row drafts; part of a ``DraftPolicy`` (``policy.draft_policy``)."""

    def choose(self, view: BatchView) -> list[int]:
        """Draft length per row for the coming round (0 = no draft)."""
        ...

    def observe(self, record: RoundRecord) -> None:
        """Learn from the round just run."""
        ...


class FixedLength:
    """The same draft length every round."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"a draft length must be >= 0, got {k}")
        self.k = k
        self.last: dict[str, float] = {"draft_length": k}

    def choose(self, view: BatchView) -> list[int]:
        return [self.k] * view.rows

    def observe(self, record: RoundRecord) -> None:
        pass

    def preview(self, rows: int) -> int:
        return self.k


class AutoDraftLength:
    """The length with the most expected tokens per second (module docstring)."""

    # per-key estimates: a key already separates copy phases from free text, so its evidence is
    # kept longer, and a key that stopped drafting is re-probed sooner; the growth cap keeps one
    # lucky key from jumping to a long draft (``AcceptanceEstimate.accept_probs``)
    KEYED = {"decay": 0.9, "prior_accept": 0.6, "prior_weight": 1.0, "idle_decay": 0.9, "chain_weight": 3.0,
             "max_growth": 2}

    def __init__(self, costs: Costs | ForwardCost | OnlineCost, draft: DraftCost = DraftCost(), max_k: int = 16,
                 decay: float = 0.8, prior_accept: float = 0.5, prior_weight: float = 1.0, idle_decay: float = 0.97,
                 chain_weight: float | None = 3.0, keyed: dict[str, Any] | None = None,
                 shadow_horizon: int = 4, min_gain: float = 1.0, probe_gap: int = 16,
                 max_probe_gap: int = 256) -> None:
        """``costs``: the runtime's (a bare cost model is wrapped: its overhead starts at 0);
        ``draft``: the drafter's measured cost (``Costs.drafter``); ``probe_gap``: rounds without
        drafts before a probe round (``_probe``), doubled after each probe that finds nothing, up to
        ``max_probe_gap``."""
        costs = costs if isinstance(costs, Costs) else Costs(costs)
        max_k = min(max_k, costs.max_positions - 1)  # never extrapolate the cost model silently
        if max_k < 1:
            raise ValueError(f"the cost model covers {costs.max_positions} position(s); auto needs >= 2")
        if shadow_horizon < 1 or min_gain < 1.0:
            raise ValueError(f"shadow_horizon must be >= 1 and min_gain >= 1, got {shadow_horizon}, {min_gain}")
        if not 1 <= probe_gap <= max_probe_gap:
            raise ValueError(f"need 1 <= probe_gap <= max_probe_gap, got {probe_gap}, {max_probe_gap}")
        self.costs, self.draft, self.max_k = costs, draft, max_k
        self.shadow_horizon, self.min_gain = shadow_horizon, min_gain
        self.estimate = AcceptanceEstimate(max_k, decay, prior_accept, prior_weight, idle_decay, chain_weight)
        kp = {**self.KEYED, **(keyed or {})}
        self._keyed_args = tuple(kp[n] for n in ("decay", "prior_accept", "prior_weight", "idle_decay",
                                                 "chain_weight", "max_growth"))
        self.by_key: dict[int, AcceptanceEstimate] = {}
        self._shadows: list[tuple[int, list[int], int, list[int], int]] = []  # (key, row tokens, start, draft, drafted)
        self._shadowing = False
        self._recent: deque[int] = deque(maxlen=256)  # recent row keys (``preview``)
        self.probe_gap, self.max_probe_gap = probe_gap, max_probe_gap
        self._gap, self._idle, self._probing = probe_gap, 0, False
        self.probes = 0  # probe rounds run
        self.chosen = [0] * (max_k + 1)  # rounds per chosen length
        self.last: dict[str, float] = {}

    # ---- choose -------------------------------------------------------------------------------
    def choose(self, view: BatchView) -> list[int]:
        if view.keys is not None:
            self._resolve_shadows()
            self._recent.extend(view.keys)
            mix = Counter(view.keys)
            ests = {key: self._keyed(key) for key in mix}
        else:
            mix, ests = Counter({None: view.rows}), {None: self.estimate}
        k, rates = self._best(view.rows, mix, ests)
        shadowed = view.keys is not None and view.free_drafts is not None
        k = self._probe(k, shadowed)
        if shadowed and k < self.shadow_horizon:
            rows = list(range(view.rows))
            self._shadow(view.keys, view.sequences, view.free_drafts(rows, self.shadow_horizon), drafted=k)
        self.chosen[k] += 1
        self.last = {"batch": view.rows, "draft_length": k, "expected_tokens": rates[k][0] / view.rows}
        return [k] * view.rows

    def _probe(self, k: int, shadowed: bool) -> int:
        """``k``, or 1 in a probe round. Why: a round without drafts brings no evidence, so where
        the prior alone does not pay (a steep cost curve, a dear drafter) an unkeyed estimate that
        chose 0 would fade back to that same prior and choose 0 for good, however well the text
        now suits the drafter. After ``_gap`` rounds without drafts one row-wide draft of one
        position is verified; the gap doubles while probes find nothing, so their cost stays a
        small share of the rounds. Keyed rows learn from free shadow drafts instead."""
        self._probing = False
        if k > 0 or shadowed:
            self._idle = 0
            return k
        self._idle += 1
        if self._idle < self._gap:
            return 0
        self._idle, self._probing = 0, True
        self.probes += 1
        return 1

    def preview(self, rows: int) -> int:
        """The length ``choose`` would pick now for ``rows`` rows of the recent key mix (/metrics)."""
        if self._recent:
            counts = Counter(self._recent)
            total = sum(counts.values())
            mix = Counter({key: c * rows / total for key, c in counts.items()})
            return self._best(rows, mix, {key: self._keyed(key) for key in counts})[0]
        return self._best(rows, Counter({None: rows}), {None: self.estimate})[0]

    def _best(self, rows: int, mix: Counter, ests: dict[Any, AcceptanceEstimate]
              ) -> tuple[int, list[tuple[float, float]]]:
        """argmax_k of tokens(k) / seconds(k); a draft must beat no draft by ``min_gain``.
        Returns k and (expected tokens, seconds) per k."""
        curves = {key: _curves(est) for key, est in ests.items()}  # E(k), D(k) per key
        out = []
        for k in range(self.max_k + 1):
            tokens = sum(c * curves[key][0][k] for key, c in mix.items())
            drafted = max(curves[key][1][k] for key in mix)
            out.append((tokens, self.costs(rows, 1.0 + drafted) + self.costs.overhead
                        + (self.draft(drafted) if k else 0.0)))
        return best_option(out, self.min_gain), out

    def rates(self, estimate: AcceptanceEstimate | None = None, rows: int = 1) -> list[float]:
        """Expected tokens per second for k = 0..max_k of ``rows`` rows under one estimate."""
        _, out = self._best(rows, Counter({None: rows}), {None: estimate or self.estimate})
        return [t / s for t, s in out]

    # ---- observe ------------------------------------------------------------------------------
    def observe(self, record: RoundRecord) -> None:
        """Acceptance by key or by position (the costs learn from the round in ``Costs.observe``)."""
        drafted, accepted = record.drafted(), [len(a) for a in record.accepted]
        ahead = record.ahead or [0] * record.rows  # a grammar's forced tokens: not this drafter's evidence
        self._observe_probe(any(a > f for a, f in zip(accepted, ahead)))
        if record.draft_keys is not None:
            rows = [(key, k, d, a, f)
                    for key, k, d, a, f in zip(record.draft_keys, record.budgets, drafted, accepted, ahead)
                    if not (k == 0 and self._shadowing) and a >= f]  # a shadow brings its evidence; no idle fading
            self._fade_keys([(key, k > 0) for key, k, *_ in rows])
            for key, k, d, a, f in rows:
                self._keyed(key).update(k, 1, [1] * (d - f), [1] * (a - f), fade=False)
            return
        self.estimate.fade(max(record.budgets, default=0) > 0)
        for row, k, a, f in zip(record.drafted_by_depth(), record.budgets, accepted, ahead):
            if a >= f:  # else a forced token was declined (another tokenization): the draft after it went unseen
                self.estimate.update(k, 1, row[f:], [1] * (a - f), fade=False)  # each row up to its own budget

    def _observe_probe(self, found: bool) -> None:
        """The probe gap: back to ``probe_gap`` once a drafted token is accepted, doubled after a
        probe round that found nothing."""
        if found:
            self._gap = self.probe_gap
        elif self._probing:
            self._gap = min(2 * self._gap, self.max_probe_gap)
        self._probing = False

    # ---- shadow drafts ------------------------------------------------------------------------
    def _shadow(self, keys: Sequence[int], sequences: Sequence[list[int]], drafts: Sequence[Sequence[int]],
                drafted: int = 0) -> None:
        """Counterfactual evidence: remember the free point-mass draft each row would have made;
        it is scored against the tokens the row emits next. Under greedy decoding that is exactly
        what verification would have accepted; under sampling, token t is emitted with probability
        p(t), its acceptance probability min(1, p(t)/1), so the estimate stays unbiased. The row's
        token list is held by reference (the batch extends it).

        ``drafted`` > 0: the rows draft that many positions for real (the round's ``observe``
        scores them); the shadow scores only the positions past them, and only where the real
        ones were all accepted (it is then evidence of exactly those positions' acceptance). Why:
        otherwise deeper positions are learnt only by drafting them, priced on a prior borrowed
        from the position before, and where verifying more positions is dear the policy keeps
        drafting positions that are rarely accepted, which can lose to plain decoding."""
        self._shadowing = self._shadowing or drafted == 0
        for key, seq, d in zip(keys, sequences, drafts):
            if len(d) > drafted:
                self._shadows.append((key, seq, len(seq), list(d), drafted))

    def _resolve_shadows(self) -> None:
        """Score each shadow on its first ``shadow_horizon`` positions once the row has emitted
        that many tokens (or missed earlier). Waiting for the whole draft would keep a row that
        stopped drafting blind for up to max_k rounds, exactly when its drafts start to match.
        Every shadow is cut at the same horizon, so positions < horizon stay unbiased."""
        keep, scored = [], []
        for key, seq, start, d, drafted in self._shadows:
            d = d[: self.shadow_horizon]
            seen = seq[start: start + len(d)]
            a = 0
            while a < len(seen) and seen[a] == d[a]:
                a += 1
            if a < len(seen) or len(seen) == len(d):  # a mismatch decided it, or all of it matched
                if a >= drafted:  # the real draft was accepted whole (else it says nothing more)
                    scored.append((key, d, a, drafted))
            else:
                keep.append((key, seq, start, d, drafted))
        self._shadows = keep[-256:]
        # a shadow past a real draft: that round's ``observe`` faded its key already
        self._fade_keys([(key, True) for key, _, _, drafted in scored if not drafted])
        for key, d, a, drafted in scored:
            self._keyed(key).update(len(d), 1, [1] * len(d), [1] * a, start=drafted, fade=False)

    def _fade_keys(self, seen: Sequence[tuple[int, bool]]) -> None:
        """Fade each key's evidence once for the rows of one round (``seen``: (key, drafted) per
        row), by ``decay`` if any of its rows drafted. Why: the rows' updates then only add counts,
        so a batch teaches a key the same whatever its rows' order, as the unkeyed estimate does."""
        drafting: dict[int, bool] = {}
        for key, d in seen:
            drafting[key] = drafting.get(key, False) or d
        for key, d in drafting.items():
            self._keyed(key).fade(d)

    def _keyed(self, key: int) -> AcceptanceEstimate:
        est = self.by_key.get(key)
        if est is None:
            est = self.by_key[key] = AcceptanceEstimate(self.max_k, *self._keyed_args)
        return est


def _curves(est: AcceptanceEstimate) -> tuple[list[float], list[float]]:
    """E(k) and D(k) for k = 0..max_k: expected emitted tokens and drafted nodes of one row."""
    p, q = est.accept_probs(), est.offer_probs()
    tokens, drafted = [1.0], [0.0]
    run = 1.0
    for pj, qj in zip(p, q):
        run *= pj
        tokens.append(tokens[-1] + run)
        drafted.append(drafted[-1] + qj)
    return tokens, drafted
