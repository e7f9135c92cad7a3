"""One stats record per generation, observed once per round. Reports, plots and /metrics read it.

Convention: ``mean_accepted_tokens`` = tokens emitted by speculative rounds / target forwards
in those rounds, so it counts the corrected-or-bonus token (plain decoding gives 1.0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    target_forwards: int = 0  # verify forwards (rounds), prefill excluded
    verify_positions: int = 0  # positions per row over those forwards (sum of N = 1 + drafted nodes)
    prefill_forwards: int = 0
    draft_tokens: int = 0  # drafted nodes offered to the verifier
    accepted_tokens: int = 0  # drafted nodes accepted
    emitted_tokens: int = 0  # tokens emitted by rounds (accepted + corrected/bonus, after truncation)
    new_tokens: int = 0  # all generated tokens, the prefill's first token included
    accepted_by_position: list[int] = field(default_factory=list)  # accepted count per draft depth
    drafted_by_position: list[int] = field(default_factory=list)  # drafted count per draft depth
    time_prefill: float = 0.0
    time_target_forward: float = 0.0
    time_draft: float = 0.0  # proposer: propose + observe (a draft model's forwards included)
    time_draft_forward: float = 0.0  # of which: draft-model forwards
    time_verify: float = 0.0  # logits processing + accept/reject
    time_cache: float = 0.0  # KV commit / rollback / compaction of the target cache
    time_total: float = 0.0
    lossy: bool = False

    def observe_round(self, depth_drafted: list[int], accepted_depth: int, emitted: int) -> None:
        """``depth_drafted[d]`` nodes were drafted at depth d; the accepted path has length
        ``accepted_depth``; ``emitted`` tokens came out of this row's round."""
        self._grow(len(depth_drafted))
        for d, cnt in enumerate(depth_drafted):
            self.drafted_by_position[d] += cnt
        for d in range(accepted_depth):
            self.accepted_by_position[d] += 1
        self.draft_tokens += sum(depth_drafted)
        self.accepted_tokens += accepted_depth
        self.emitted_tokens += emitted

    def _grow(self, n: int) -> None:
        while len(self.drafted_by_position) < n:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)

    @property
    def mean_accepted_tokens(self) -> float:
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted nodes (for trees: accepted path nodes / all drafted nodes)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

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
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        out = DecodeStats(**{k: v for k, v in asdict(self).items()})
        for k, v in asdict(other).items():
            if k in ("accepted_by_position", "drafted_by_position"):
                continue
            if k == "lossy":
                out.lossy = out.lossy or v
            else:
                setattr(out, k, getattr(out, k) + v)
        out._grow(len(other.drafted_by_position))
        for d, (a, n) in enumerate(zip(other.accepted_by_position, other.drafted_by_position)):
            out.accepted_by_position[d] += a
            out.drafted_by_position[d] += n
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted_tokens=self.mean_accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            acceptance_by_position=self.acceptance_by_position,
            time_other=self.time_other,
            time_outside_forwards=self.time_outside_forwards,
            share_outside_forwards=self.time_outside_forwards / self.time_total if self.time_total else 0.0,
            tokens_per_second=self.tokens_per_second,
        )
        return d
