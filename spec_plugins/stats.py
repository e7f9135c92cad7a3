"""Decoding stats, an observer of the round's ``RoundRecord``. Reports, plots and /metrics read it.

Conventions (vLLM's): ``mean_accepted_tokens`` is per sequence per round = tokens emitted by
rounds / row-rounds, so it counts the corrected-or-bonus token (plain decoding gives 1.0) and
does not grow with the batch; ``tokens_per_forward`` is the batch-level figure = tokens emitted
by rounds / target forwards (B rows emit up to B x that per forward). Acceptance by position is
per row-round too: of the rows that drafted depth d, the share that accepted it. A row that fails
in a round (its processing raises, its grammar has no way on: finish reason ``error``) emits
only the tokens before its failure, as plain decoding would (counted in ``new_tokens``), and that
round is no row-round for it: it is left out of
``row_rounds``, the drafted / accepted / emitted counts and the per-depth counts (plain decoding
stays at 1.0 when rows fail); the target forward still counts. Accepted counts are the output's:
a row's accepted path is cut where its emitted tokens end (``kept_depth``: an end-of-sequence
token, its token limit, its grammar or a stop string), so accepted never exceeds emitted.
``judged_tokens`` counts the drafted depths the verifier judged in the output (the kept path, plus
the depth that rejected it when the draft went deeper and the output did not cut the path first), so
``judged_acceptance`` = accepted / judged is a chain's per-token acceptance rate; ``acceptance_rate``
(accepted / drafted) also counts the depths past a rejection, which nobody judged.

A batch's rows each get their own share (``BatchStats.rows``, what ``generate_batch`` returns per
result): a row's tokens, and the forwards it took part in (the prefill that admitted it, the
rounds it was verified in) with their whole times, which the row waited for (and the compaction
before each of its rounds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Hashable, Mapping, Sequence

BY_POSITION = ("accepted_by_position", "drafted_by_position", "rows_by_position")  # per-depth counts, merged per depth


@dataclass
class DecodeStats:
    target_forwards: int = 0  # verify forwards (rounds), prefill excluded
    row_rounds: int = 0  # rows verified over those forwards (a batch of B rows: B per forward)
    verify_positions: int = 0  # positions per row over those forwards (sum of N = 1 + drafted nodes)
    prefill_forwards: int = 0
    draft_tokens: int = 0  # drafted nodes offered to the verifier
    accepted_tokens: int = 0  # drafted nodes accepted
    judged_tokens: int = 0  # drafted depths the verifier judged in the output: the kept path + its rejecting depth
    emitted_tokens: int = 0  # tokens emitted by rounds (accepted + corrected/bonus, after truncation)
    forced_tokens: int = 0  # of the accepted: a grammar's forced tokens, drafted ahead (free)
    new_tokens: int = 0  # all generated tokens, the prefill's first token included
    accepted_by_position: list[int] = field(default_factory=list)  # accepted count per draft depth
    drafted_by_position: list[int] = field(default_factory=list)  # drafted count per draft depth
    rows_by_position: list[int] = field(default_factory=list)  # row-rounds that drafted each depth (trees: < nodes)
    time_prefill: float = 0.0
    time_target_forward: float = 0.0
    time_draft: float = 0.0  # proposer: propose + observe (a draft model's forwards included)
    time_draft_forward: float = 0.0  # of which: draft-model forwards
    time_verify: float = 0.0  # logits processing + accept/reject
    time_cache: float = 0.0  # KV commit / rollback of the target cache, compaction of the caches when rows leave
    time_total: float = 0.0
    lossy: bool = False

    def observe(self, record: Any) -> None:
        """One round (``RoundRecord``): every row's drafted nodes by depth, accepted and emitted."""
        self.observe_forward(record)
        for share in row_shares(record):
            self.observe_share(share)

    def observe_share(self, share: RowShare) -> None:
        """One row's part of a round."""
        if share.ok:
            self.row_rounds += 1
            self.observe_round(share.drafted, share.kept, share.emitted, judged=share.judged)
            self.forced_tokens += share.forced
        self.new_tokens += share.emitted  # a failing row's tokens before its failure are output too

    def observe_forward(self, record: Any) -> None:
        """A round's target forward, its positions per row and its times."""
        self.target_forwards += 1
        self.verify_positions += record.positions
        t = record.times
        self.time_draft += t.draft
        self.time_draft_forward += t.draft_forward
        self.time_target_forward += t.forward
        self.time_verify += t.verify
        self.time_cache += t.commit
        self.time_total += t.total
        self.lossy = self.lossy or record.lossy

    def observe_admit(self, rows: int, seconds: float) -> None:
        """Rows joined: one prefill forward emitted their first tokens."""
        self.prefill_forwards += 1
        self.new_tokens += rows
        self.time_prefill += seconds
        self.time_total += seconds

    def observe_compaction(self, seconds: float) -> None:
        """Rows left the batch: their caches were compacted between rounds (no round timed it)."""
        self.time_cache += seconds
        self.time_total += seconds

    def observe_round(self, depth_drafted: list[int], accepted_depth: int, emitted: int, *,
                      judged: int | None = None) -> None:
        """``depth_drafted[d]`` nodes were drafted at depth d; the accepted path has length
        ``accepted_depth``; ``emitted`` tokens came out of this row's round; ``judged`` depths were
        judged in the output (``judged_depth``; None: the path was not cut, so the depth after it
        was judged if one was drafted)."""
        if judged is None:
            judged = judged_depth(accepted_depth, accepted_depth, drafted_depths(depth_drafted))
        self._grow(len(depth_drafted))
        for d, cnt in enumerate(depth_drafted):
            self.drafted_by_position[d] += cnt
            self.rows_by_position[d] += int(cnt > 0)
        for d in range(accepted_depth):
            self.accepted_by_position[d] += 1
        self.draft_tokens += sum(depth_drafted)
        self.accepted_tokens += accepted_depth
        self.judged_tokens += judged
        self.emitted_tokens += emitted

    def _grow(self, n: int) -> None:
        while len(self.drafted_by_position) < n:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
            self.rows_by_position.append(0)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per sequence per round (bonus included)."""
        return self.emitted_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens the whole batch emitted per target forward."""
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted nodes (for trees: accepted path nodes / all drafted nodes)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def judged_acceptance(self) -> float:
        """Accepted / judged depths: a chain's per-token acceptance rate, the estimate of the i.i.d.
        alpha in S(gamma) = (1 - a^(g+1)) / ((1 - a)(1 + g c)); depths drafted past a rejection were
        never judged, so they are not counted against it as they are in ``acceptance_rate``."""
        return self.accepted_tokens / self.judged_tokens if self.judged_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per depth: of the rows that drafted it, the share whose accepted path reached it (a tree's
        sibling nodes are one row's alternatives, so nodes would understate it; a chain has one node
        per row and depth, so both agree)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_position, self.rows_by_position)]

    @property
    def time_other(self) -> float:
        spent = self.time_prefill + self.time_target_forward + self.time_draft + self.time_verify + self.time_cache
        return max(0.0, self.time_total - spent)

    @property
    def time_outside_forwards(self) -> float:
        """Wall time not spent inside a model forward (target or draft)."""
        forwards = self.time_prefill + self.time_target_forward + self.time_draft_forward
        return max(0.0, self.time_total - forwards)

    @property
    def share_outside_forwards(self) -> float:
        """The share of wall time not spent inside a model forward (0 before any time is counted)."""
        return self.time_outside_forwards / self.time_total if self.time_total else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        out = DecodeStats(**{k: v for k, v in asdict(self).items()})
        for k, v in asdict(other).items():
            if k in BY_POSITION:
                continue
            if k == "lossy":
                out.lossy = out.lossy or v
            else:
                setattr(out, k, getattr(out, k) + v)
        out._grow(len(other.drafted_by_position))
        for k in BY_POSITION:
            mine = getattr(out, k)
            for d, n in enumerate(getattr(other, k)):
                mine[d] += n
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted_tokens=self.mean_accepted_tokens,
            tokens_per_forward=self.tokens_per_forward,
            acceptance_rate=self.acceptance_rate,
            judged_acceptance=self.judged_acceptance,
            acceptance_by_position=self.acceptance_by_position,
            time_other=self.time_other,
            time_outside_forwards=self.time_outside_forwards,
            share_outside_forwards=self.share_outside_forwards,
            tokens_per_second=self.tokens_per_second,
        )
        return d


class BatchStats(DecodeStats):
    """A batch's totals (the fields, as ``DecodeStats``) and each row's own stats (``rows``, by
    row key), split from the same rounds: the rows' token counts sum to the totals; a row's forward
    counts and times are those of the forwards it took part in (each shared by the batch's rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[Hashable, DecodeStats] = {}
        self._admit_seconds = 0.0  # the last prefill's, split by ``observe_admitted``
        self._compaction = 0.0  # compaction since the last round: the next round's rows waited for it

    def row(self, key: Hashable) -> DecodeStats:
        """Row ``key``'s stats (empty for a row that never reached the target: no tokens asked)."""
        if key not in self.rows:
            self.rows[key] = DecodeStats(lossy=self.lossy)
        return self.rows[key]

    def observe(self, record: Any) -> None:
        self.observe_forward(record)
        for share in row_shares(record):
            self.observe_share(share)
            row = self.row(share.key)
            if self._compaction:
                row.observe_compaction(self._compaction)
            row.observe_forward(record)
            row.observe_share(share)
        self._compaction = 0.0

    def observe_compaction(self, seconds: float) -> None:
        super().observe_compaction(seconds)
        self._compaction += seconds

    def observe_admit(self, rows: int, seconds: float) -> None:
        super().observe_admit(rows, seconds)
        self._admit_seconds = seconds

    def observe_admitted(self, emitted: Mapping[Hashable, Sequence[int]], failed: Collection[Hashable]) -> None:
        """The rows of the last prefill, which ``observe_admit`` counts without naming them:
        ``emitted`` every admitted request's first tokens by key, ``failed`` the rows whose first
        token failed (they took part in the forward). A row with neither asked for no tokens and
        never reached the target."""
        for key, tokens in emitted.items():
            if tokens or key in failed:
                self.row(key).observe_admit(len(tokens), self._admit_seconds)


@dataclass(frozen=True)
class RowShare:
    """One row's part of a round: ``drafted`` nodes per depth, ``kept`` accepted path length in
    the output, ``judged`` depths judged in the output (``judged_depth``), ``emitted`` tokens,
    ``forced`` of the kept a grammar forced, ``ok``: it did not fail."""

    key: Hashable
    drafted: list[int]
    kept: int
    judged: int
    emitted: int
    forced: int
    ok: bool


def row_shares(record: Any) -> list[RowShare]:
    """Each row's part of a round (``RoundRecord``), in batch order."""
    failed = {e.key for e in record.emissions if e.error is not None}  # rows failing this round
    ahead = list(record.ahead) + [0] * (len(record.keys) - len(record.ahead))  # none recorded: nothing forced
    out = []
    for key, drafted, acc, em, f in zip(record.keys, record.drafted_by_depth(), record.accepted, record.emitted, ahead):
        kept = kept_depth(acc, em)
        judged = judged_depth(len(acc), kept, drafted_depths(drafted))
        out.append(RowShare(key, drafted, kept, judged, len(em), min(f, kept), key not in failed))
    return out


def kept_depth(accepted: list[int], emitted: list[int]) -> int:
    """How many of a row's accepted drafted nodes are in its output: the verifier's path, cut
    where the row's emitted tokens end (an end-of-sequence token, the row's token limit, its
    grammar or a stop string cut it there; the emitted tokens are the path's, then one more)."""
    return min(len(accepted), len(emitted))


def drafted_depths(depth_drafted: Sequence[int]) -> int:
    """How deep a row drafted: its depths holding a node (a node's parent is one depth up, so they
    come first; a batch's padded depths count none)."""
    return sum(1 for cnt in depth_drafted if cnt > 0)


def judged_depth(accepted: int, kept: int, depths: int) -> int:
    """Drafted depths the verifier judged in a row's output, of ``depths`` drafted: the ``kept``
    part of its ``accepted`` path, plus the depth after it, which rejected the path, when the
    output holds the whole path and the draft went deeper. An output that cut the path (``kept <
    accepted``: an end-of-sequence token, the token limit, a grammar, a stop string) holds no
    rejection, so the depths it cut count as neither accepted nor judged. Exact for chains; a tree
    is seen by its depth counts only, so its depth after the path counts as judged whenever any
    branch reached it, even below an accepted leaf (an upper bound: the bench's theory takes chain
    runs only)."""
    return kept if kept < accepted else min(kept + 1, depths)
