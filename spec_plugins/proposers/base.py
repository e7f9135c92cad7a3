"""The proposer contract: ``propose(ctx) -> Draft | None`` and ``observe(result)``.

The loop never knows which proposer it runs. Inputs travel in one frozen dataclass so adding a
proposer (or a field a new proposer needs) never changes the loop's call sites.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

if TYPE_CHECKING:
    from spec_plugins.backends.base import Runtime
    from spec_plugins.sampling import LogitsPipeline


@dataclass(frozen=True)
class Draft:
    """One round's draft for a batch: a chain or a tree shared by all rows.

    tokens  [B, n] long
    parents tuple of n ints, -1 = child of the pending token (chain: -1, 0, 1, ...)
    probs   [B, n, V] the distribution each node's token was drawn from, or None (point mass)
    valid   [B, n] bool, rows may draft fewer nodes (None = all valid)
    """

    tokens: torch.Tensor
    parents: tuple[int, ...]
    probs: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.parents)

    def row_sizes(self) -> list[int]:
        """Nodes each row actually drafted (its valid ones)."""
        if self.valid is None:
            return [self.size] * int(self.tokens.shape[0])
        return self.valid.sum(1).tolist()

    @staticmethod
    def from_chains(chains: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> "Draft | None":
        """Pad per-row token chains of different lengths into one draft (None if all empty)."""
        n = max((len(c) for c in chains), default=0)
        if n == 0:
            return None
        toks = torch.zeros(len(chains), n, dtype=torch.long)
        valid = torch.zeros(len(chains), n, dtype=torch.bool)
        for b, c in enumerate(chains):
            if c:
                toks[b, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
                valid[b, : len(c)] = True
        return Draft(toks.to(device), tuple(range(-1, n - 1)), None, None if bool(valid.all()) else valid.to(device))


@dataclass(frozen=True)
class ProposeContext:
    """What a proposer may look at. ``sequences[b]`` is row b's prompt + output so far; its
    last token is the pending one (emitted, not yet in the target's cache)."""

    sequences: Sequence[Sequence[int]]
    budgets: Sequence[int]  # max draft nodes per row this round (draft length x rows' limits)
    pipeline: "LogitsPipeline"
    generator: torch.Generator | None = None
    tree_ok: bool = False  # the target runtime can verify a tree in one forward
    hidden: Sequence[torch.Tensor] | None = None  # per row: target hidden states not yet consumed


@dataclass(frozen=True)
class RoundResult:
    """What the verifier decided, per row, for ``observe``."""

    draft: "Draft | None"
    accepted: Sequence[Sequence[int]]  # accepted node indices per row
    emitted: Sequence[Sequence[int]]  # tokens appended to each row this round
    sequences: Sequence[Sequence[int]]  # rows after the round (last token = new pending token)
    target_logits: torch.Tensor | None = None  # [B, n+1, V] processed logits of the verify pass


class Proposer:
    """Base class with no-op hooks; subclasses implement ``propose``."""

    Config: ClassVar[Any]
    needs_hidden: ClassVar[bool] = False  # ask the target for hidden states
    tree: ClassVar[bool] = False  # drafts trees (needs a runtime with tree masks)

    def begin(self, prompts: Sequence[Sequence[int]]) -> None:
        """A new batch starts with these prompts (before the first token is emitted)."""

    def propose(self, ctx: ProposeContext) -> Draft | None:
        raise NotImplementedError

    def observe(self, result: RoundResult) -> None:
        """Learn from a round (adaptive state, rolling back a draft model's cache)."""

    def draft_keys(self, sequences: Sequence[Sequence[int]]) -> list[int] | None:
        """Optional, cheap: a small integer per row classing how promising this round's draft
        is before it is made (n-gram: the matched suffix length and its agreement). ``num_draft_tokens: auto``
        keeps one acceptance estimate per key and picks each row's draft length from it.
        None (the default): one estimate for all rounds."""
        return None

    def free_drafts(self, sequences: Sequence[Sequence[int]], k: int) -> list[list[int]] | None:
        """Optional: the point-mass chains of up to ``k`` tokens this proposer would draft for
        each row, when drafting costs nothing and changes no state (n-gram lookup). ``auto``
        scores them against the tokens the rows emit next, so a key learns its acceptance even
        in rounds where it was not worth verifying. None (the default): not offered."""
        return None

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows (others finished)."""

    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        """New rows join the running batch after the existing ones (continuous batching), before
        their first token is emitted, as ``begin`` does for a new batch. Proposers with per-row
        state must override this; the default refuses, so a server never mixes up rows."""
        raise NotImplementedError(
            f"proposer {type(self).__name__} cannot add rows to a running batch (no admit()); "
            "it can only decode fixed batches"
        )

    @property
    def draft_forward_time(self) -> float:
        """Seconds spent in draft-model forwards so far (0 for model-free proposers)."""
        return 0.0
