"""``num_draft_tokens: auto``: pick the draft length each round for the most tokens per second.

Per round with draft length k the loop emits E(k) = 1 + sum_{j<k} prod_{i<=j} p_i tokens, where
p_j = P(draft position j is accepted | positions < j were), and pays
T(1 + D(k)) + draft costs + overhead, where D(k) = sum_{j<k} q_j is the expected number of
drafted nodes (q_j = P(the proposer offers a token at position j); an n-gram drafter often offers
fewer than k) and T is the measured cost curve (``costmodel``: its per-N minima, not the
monotone fit, since some widths are cheaper than narrower ones, corrected online by the forwards
the loop runs, ``OnlineCost``). The policy returns argmax_k E(k) / cost(k) over k = 0..max_k;
k = 0 (plain decoding) wins when acceptance collapses.

p and q are learnt online from the DecodeStats deltas of the previous round, with exponential
forgetting (acceptance comes in bursts: copying phases) and a prior that extends each position's
estimate to the next unseen one, so long drafts are tried when short ones are always accepted
(per key: at most ``max_growth`` positions past the deepest one with evidence, so drafts grow
step by step instead of jumping to max_k on one lucky round).
Forgetting also re-opens drafting after a collapse: rounds without drafts fade the evidence
slowly (``idle_decay``), the estimate drifts back to the prior and one cheap probe round follows.
With a proposer that classes its rounds before drafting (``Proposer.draft_keys``; n-gram: the
matched suffix length and whether its earlier continuations agree), the loop asks ``per_row``
instead: one estimate per key, one draft length per row. On a CPU where verifying 2 positions
already costs ~1.7x one, that is what separates "draft 8 after a 3-gram match from the prompt"
from "draft nothing after a 1-gram one".
Defaults were chosen by replaying greedy SmolLM2 outputs on the dev prompts (exact acceptance for
any policy) against CPU-like cost curves. Each call is O(max_k).
"""

from __future__ import annotations

from typing import Any, Sequence

from spec_plugins.costmodel import CostModel, OnlineCost, cost_model_for, online_cost_for
from spec_plugins.stats import DecodeStats


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

    def update(self, k: int, rows: int, drafted: list[int], accepted: list[int]) -> None:
        """One round: draft length ``k`` over ``rows`` rows; ``drafted[j]`` / ``accepted[j]``
        rows drafted / accepted position j (the DecodeStats by-position deltas). Evidence fades
        by ``decay`` per drafting round and, slower, by ``idle_decay`` per round without drafts."""
        lam = self.decay if k > 0 else self.idle_decay
        for j in range(self.max_k):
            self.reach[j] *= lam
            self.hits[j] *= lam
            self.offer_trials[j] *= lam
            self.offered[j] *= lam
        reach = float(rows)
        for j in range(min(k, self.max_k)):
            d = drafted[j] if j < len(drafted) else 0
            a = accepted[j] if j < len(accepted) else 0
            self.offer_trials[j] += rows
            self.offered[j] += d
            if reach <= 0:
                continue
            self.reach[j] += reach
            self.hits[j] += a
            reach = a  # rows that go on to position j + 1

    def accept_probs(self) -> list[float]:
        """p_j, each unseen position borrowing the previous position's estimate as its prior, and
        0 beyond ``max_growth`` positions past the deepest one with evidence (half a row or more).

        Why the cap: after a few fully accepted short drafts the borrowed prior made the policy
        jump from 3 to 15 tokens on one lucky key; on a CPU a 16-position forward costs 2-3.7x a
        single one, and a repetitive translation lost 10 % to such jumps (replays of recorded
        bench outputs). Growing by at most ``max_growth`` per round of evidence (like TCP's slow
        start) bounds what one wrong guess costs, while a key that keeps being accepted still
        reaches max_k in a few rounds. (Shrinking the borrowed prior with depth instead stalls:
        on a steep cost curve the next position never looks worth one try, so it is never
        learnt.)"""
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


class AutoDraftLength:
    """``policy(stats) -> k`` for the decode loop; one instance per generation. ``online``: an
    ``OnlineCost`` to price forwards with (shared across generations by ``for_decoder``), True
    for a fresh one, False to price on ``cost`` as measured."""

    # per-key estimates (``per_row``): a key already separates copy phases from free text, so its
    # evidence is kept longer (decay), and a key that stopped drafting is re-probed sooner (idle
    # decay). Chosen by replaying SmolLM2's greedy dev-set outputs against the measured CPU cost
    # curve (``spec_plugins.bench.replay``), then checked with the bench.
    # The growth cap and the shorter memory (decay 0.95 -> 0.9) came from replays of 8 bench runs
    # (recorded outputs and cost curves): the worst run's auto / best fixed gamma went from 0.90
    # to 0.97 (translation), 0.96 to 1.00 (RAG), math stayed 0.98; with forwards of 6+ positions
    # priced 1.25x above the load-time curve, as the loop measured them: translation 0.90 to
    # 0.93, RAG 0.90 to 1.03, math 0.96 to 0.98, code 1.02 to 0.99.
    KEYED = {"decay": 0.9, "prior_accept": 0.6, "prior_weight": 1.0, "idle_decay": 0.9, "chain_weight": 3.0,
             "max_growth": 2}

    def __init__(self, cost: CostModel, max_k: int = 16, decay: float = 0.8, prior_accept: float = 0.5,
                 prior_weight: float = 1.0, idle_decay: float = 0.97, chain_weight: float | None = 3.0,
                 overhead_decay: float = 0.9, keyed: dict[str, Any] | None = None,
                 shadow_horizon: int = 4, online: OnlineCost | bool = True) -> None:
        if max_k + 1 > cost.max_positions:
            max_k = cost.max_positions - 1  # never extrapolate the cost curve silently
        if max_k < 1:
            raise ValueError(f"the cost model covers {cost.max_positions} position(s); auto needs >= 2")
        self.cost = cost
        # forward times as this generation measures them (None: the load-time curve as is)
        self.online = (OnlineCost(cost) if online is True else online) or None
        self.max_k = max_k
        self._estimate_args = (decay, prior_accept, prior_weight, idle_decay, chain_weight)
        self.estimate = AcceptanceEstimate(max_k, *self._estimate_args)
        self.by_key: dict[int, AcceptanceEstimate] = {}  # per-row mode: one estimate per draft key
        self._shadows: list[tuple[int, list[int], int, list[int]]] = []  # (key, row tokens, start, draft)
        self._shadowing = False
        if shadow_horizon < 1:
            raise ValueError(f"shadow_horizon must be >= 1, got {shadow_horizon}")
        self.shadow_horizon = shadow_horizon
        kp = {**self.KEYED, **(keyed or {})}
        self._keyed_args = (kp["decay"], kp["prior_accept"], kp["prior_weight"], kp["idle_decay"], kp["chain_weight"],
                            kp["max_growth"])
        self.overhead = 0.0  # seconds per round outside forwards and drafting (verify, commit, Python)
        self._overhead_decay = overhead_decay
        self.chosen = [0] * (max_k + 1)  # how often each k was picked
        self._stats: DecodeStats | None = None
        self._snap: tuple = ()
        self._last_k: int | None = None

    @classmethod
    def for_decoder(cls, decoder: Any, **kwargs: Any) -> "AutoDraftLength":
        """Measure (once per runtime, cached) the decoder's cost curve and draft cost; the
        unsmoothed curve, corrected by the forwards of every generation on that runtime."""
        from spec_plugins.sampling import LogitsPipeline

        pipeline = LogitsPipeline(decoder._sampling(None, None))
        max_k = int(kwargs.get("max_k", 16))
        cost = cost_model_for(decoder.target, decoder.proposer, pipeline, max_positions=max_k + 1).unsmoothed()
        kwargs.setdefault("online", online_cost_for(decoder.target, cost))
        return cls(cost, **kwargs)

    # ---- the per-round call ------------------------------------------------------------------
    def __call__(self, stats: DecodeStats) -> int:
        """One draft length for every row, learnt from the stats' by-position deltas."""
        delta = self._advance(stats)
        if delta is not None:
            drafted, accepted, rows = delta
            self.estimate.update(self._last_k, rows, drafted, accepted)
        k = self.best_k()
        self._last_k = k
        self.chosen[k] += 1
        return k

    # ---- per-row calls for proposers that class their rounds (``Proposer.draft_keys``) --------
    def per_row(self, stats: DecodeStats, keys: Sequence[int]) -> list[int]:
        """A draft length per row from the estimate kept for that row's key (e.g. the n-gram
        match length: 3-gram matches may earn 8 tokens while 1-gram matches earn none)."""
        self._advance(stats)
        if self._shadows:
            self._resolve_shadows()
        ks = [self.best_k(self._keyed(key)) for key in keys]
        self._last_k = max(ks, default=0)
        for k in ks:
            self.chosen[k] += 1
        return ks

    def shadow(self, keys: Sequence[int], sequences: Sequence[list[int]], drafts: Sequence[Sequence[int]]) -> None:
        """Counterfactual evidence for rows that did not draft this round: remember the free
        point-mass draft each would have made; it is scored (``_resolve_shadows``) against the
        tokens the row emits next. Under greedy decoding that is exactly what verification
        would have accepted; under sampling, token t is emitted with probability p(t), the same
        as its acceptance probability min(1, p(t)/1), so the estimate stays unbiased. The row's
        token list is held by reference; the engine extends it in place."""
        self._shadowing = True
        for key, seq, d in zip(keys, sequences, drafts):
            if d:
                self._shadows.append((key, seq, len(seq), list(d)))

    def _resolve_shadows(self) -> None:
        """Score each shadow draft on its first ``shadow_horizon`` positions, as soon as the row
        has emitted that many tokens (or missed earlier). Waiting for the whole draft would keep a
        row that stopped drafting blind for up to max_k one-token rounds exactly when its drafts
        have started to match (measured in replays: a repetitive translation sat 12 rounds at k=0
        with every shadow matching). Every shadow is cut at the same horizon, so the estimate of
        positions < horizon stays unbiased; deeper positions learn from real drafts only."""
        keep = []
        for key, seq, start, d in self._shadows:
            d = d[: self.shadow_horizon]
            seen = seq[start : start + len(d)]
            a = 0
            while a < len(seen) and seen[a] == d[a]:
                a += 1
            if a < len(seen) or len(seen) == len(d):  # a mismatch decided it, or all of it matched
                # all len(d) tokens were offered; positions after the first miss are never reached
                self._keyed(key).update(len(d), 1, [1] * len(d), [1] * a)
            else:
                keep.append((key, seq, start, d))
        self._shadows = keep[-256:]

    def observe_rows(self, keys: Sequence[int], budgets: Sequence[int], drafted: Sequence[int],
                     accepted: Sequence[int]) -> None:
        """Per row of the round just verified: its key, the draft budget it was given, how many
        chain tokens the proposer drafted and how many the verifier accepted."""
        for key, k, d, a in zip(keys, budgets, drafted, accepted):
            if k == 0 and self._shadowing:
                continue  # its shadow draft brings real evidence; no idle fading
            self._keyed(key).update(k, 1, [1] * d, [1] * a)

    def _keyed(self, key: int) -> AcceptanceEstimate:
        est = self.by_key.get(key)
        if est is None:
            est = self.by_key[key] = AcceptanceEstimate(self.max_k, *self._keyed_args)
        return est

    def _advance(self, stats: DecodeStats) -> tuple[list[int], list[int], int] | None:
        """Track the per-round overhead; return (drafted, accepted, rows) deltas of the round that
        ran since the last call, or None."""
        if stats is not self._stats:  # a new generation
            self._stats, self._snap, self._last_k = stats, _snapshot(DecodeStats()), None
            self._shadows = []
        snap = _snapshot(stats)
        prev, self._snap = self._snap, snap
        if not (snap[0] > prev[0] and self._last_k is not None):
            return None
        spent = snap[3] - prev[3]
        if self.online is not None and snap[0] == prev[0] + 1:  # exactly one forward since
            self.online.observe(snap[6] - prev[6], snap[7] - prev[7])
        lam = self._overhead_decay
        self.overhead = spent if self.overhead == 0.0 else lam * self.overhead + (1 - lam) * spent
        drafted = [a - b for a, b in zip(snap[4], _pad(prev[4], len(snap[4])))]
        accepted = [a - b for a, b in zip(snap[5], _pad(prev[5], len(snap[5])))]
        rows = max(1, (snap[1] - prev[1]) - (snap[2] - prev[2]))  # each row emits accepted + 1
        return drafted, accepted, rows

    def rates(self, estimate: AcceptanceEstimate | None = None) -> list[float]:
        """Expected tokens per second for k = 0..max_k under the current estimates."""
        est = estimate or self.estimate
        p, q = est.accept_probs(), est.offer_probs()
        out = [1.0 / (self.round_seconds(0.0, False) + self.overhead)]
        tokens, run, drafted = 1.0, 1.0, 0.0
        for j in range(self.max_k):
            run *= p[j]
            tokens += run
            drafted += q[j]
            out.append(tokens / (self.round_seconds(drafted, True) + self.overhead))
        return out

    def round_seconds(self, expected_drafted: float, drafts: bool) -> float:
        """The cost model's round, its forward corrected online when ``online`` is on."""
        return self.cost.round_seconds(expected_drafted, drafts, self.online.target if self.online else None)

    def best_k(self, estimate: AcceptanceEstimate | None = None) -> int:
        r = self.rates(estimate)
        return max(range(len(r)), key=r.__getitem__)


def _snapshot(s: DecodeStats) -> tuple:
    # forwards, emitted, accepted, seconds outside forwards/drafting, by-position lists,
    # verified positions, seconds in verify forwards
    outside = s.time_total - s.time_prefill - s.time_target_forward - s.time_draft
    return (s.target_forwards, s.emitted_tokens, s.accepted_tokens, outside,
            list(s.drafted_by_position), list(s.accepted_by_position), s.verify_positions, s.time_target_forward)


def _pad(xs: list[int], n: int) -> list[int]:
    return xs + [0] * (n - len(xs)) if len(xs) < n else xs
