"""Prompt lookup: find the latest earlier occurrence of the context's last n tokens and draft
what followed it. An incremental index makes each round O(max_ngram), not O(context)."""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import Field, model_validator

from spec_plugins.config import ProposerConfig
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer
from spec_plugins.registry import register_proposer


class NgramIndex:
    """n-gram -> end position of its latest occurrence, for n in [min_n, max_n]."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self.prev: dict[tuple[int, ...], int] = {}  # the occurrence before the latest one
        self.older: dict[tuple[int, ...], int] = {}  # ... and the one before that

    def extend(self, new: Sequence[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(t)
            end = len(toks)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(toks[end - n : end])
                if key in self.last:
                    if key in self.prev:
                        self.older[key] = self.prev[key]
                    self.prev[key] = self.last[key]
                self.last[key] = end

    def lookup(self, k: int, tail: Sequence[int] = ()) -> list[int]:
        """Up to k tokens following the longest suffix n-gram seen earlier in the sequence (the
        sequence followed by ``tail``, tokens drafted ahead and not indexed)."""
        return self.match(k, tail)[1]

    def match(self, k: int, tail: Sequence[int] = ()) -> tuple[int, list[int]]:
        """(n, tokens): the longest matching suffix length (0 = none) and up to k tokens after it."""
        toks = self.tokens
        end = len(toks)
        seq = toks[-self.max_n:] + list(tail) if tail else toks
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            key = tuple(seq[len(seq) - n :])
            pos = self.last.get(key)
            if pos == end:  # the suffix itself (nothing follows it yet): the occurrence before it
                pos = self.prev.get(key)
            if pos is not None and pos < end:
                return n, toks[pos : min(pos + k, end)]
        return 0, []

    def agreement(self, n: int) -> int:
        """For the suffix n-gram: 0 if it occurred fewer than twice before, 1 if the two latest
        earlier occurrences were followed by the same token, 2 if by different tokens. Called after
        ``extend`` (the suffix itself is then the latest occurrence)."""
        if n < 1:
            return 0
        toks = self.tokens
        key = tuple(toks[len(toks) - n :])
        a, b = self.prev.get(key), self.older.get(key)
        if a is None or b is None:
            return 0
        return 1 if toks[a] == toks[b] else 2


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Point-mass drafts copied from the prompt and the output so far (no model)."""

    class Config(ProposerConfig):
        type: Literal["ngram"] = "ngram"
        max_ngram: int = Field(3, ge=1, le=16, description="Longest suffix n-gram to match.")
        min_ngram: int = Field(1, ge=1, le=16, description="Shortest suffix n-gram to match.")

        @model_validator(mode="after")
        def _order(self) -> "NgramProposer.Config":
            if self.min_ngram > self.max_ngram:
                raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
            return self

    def __init__(self, config: "NgramProposer.Config", **_: object) -> None:
        self.config = config
        self._index: list[NgramIndex] = []

    continues_ahead = True

    def propose(self, ctx: ProposeContext) -> Draft | None:
        return Draft.from_chains(self._chains(ctx.sequences, ctx.budgets, ctx.ahead))

    def _chains(self, sequences: Sequence[Sequence[int]], budgets: Sequence[int],
                ahead: Sequence[Sequence[int]] = ()) -> list[list[int]]:
        """Per row: up to its budget of tokens after the longest matched suffix (a lookup), of
        the sequence followed by the row's tokens drafted ahead, if any."""
        chains = []
        for b, (idx, seq, k) in enumerate(zip(self._index, sequences, budgets)):
            idx.extend(seq[len(idx.tokens) :])  # catch up with tokens emitted since last round
            chains.append(idx.lookup(k, ahead[b] if ahead else ()) if k > 0 else [])
        return chains

    def draft_keys(self, sequences: Sequence[Sequence[int]]) -> list[int]:
        """Per row, 3 x the matched suffix n-gram length + its ``agreement``: a 3-gram match is
        copied far more reliably than a 1-gram one, and a match whose two previous occurrences
        went on alike (a copy or a loop) more than one seen once or followed two ways, so
        ``auto`` learns a draft length for each class (a degenerate loop does not share its
        estimate with free text)."""
        keys = []
        for idx, seq in zip(self._index, sequences):
            idx.extend(seq[len(idx.tokens) :])
            n = idx.match(1)[0]
            keys.append(3 * n + idx.agreement(n))
        return keys

    def free_drafts(self, sequences: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """What ``propose`` would draft with budget k per row (a lookup, no state change)."""
        return self._chains(sequences, [k] * len(sequences))

    def select_rows(self, rows: Sequence[int]) -> None:
        self._index = [self._index[r] for r in rows]

    def num_rows(self) -> int:
        return len(self._index)

    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        self._index += [NgramIndex(self.config.min_ngram, self.config.max_ngram) for _ in prompts]
