"""The runtime contract every backend implements.

A runtime owns one model and its KV cache for a batch of rows. The decode loop never touches
cache tensors: it asks for a forward over N new nodes (a chain or a tree), then says which of
those nodes survive (``commit``) or how far to roll back (``rollback``). Each runtime picks its
own mechanism (crop, gather, sequence removal, position overwrite).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from spec_plugins.tree import TreeLayout


@dataclass(frozen=True)
class RuntimeCapabilities:
    """What a runtime can do; the loop asks before it builds a draft."""

    tree_mask: bool = False  # can score a token tree in one forward (custom attention mask)
    hidden_states: bool = False  # can return last-layer hidden states (feature-level drafters)
    batch: bool = False  # can hold more than one row
    name: str = ""


@dataclass
class StepOutput:
    """Logits for every new node, and optionally the hidden states feeding the LM head."""

    logits: torch.Tensor  # [B, N, V] float32, on CPU or the runtime's device
    hidden: torch.Tensor | None = None  # [B, N, H]


@runtime_checkable
class Runtime(Protocol):
    """One model + KV cache for a batch of rows.

    Node ``j`` of a forward sits at position ``length[b] + depth[j]`` of row ``b`` and attends to
    the row's cached tokens plus its ancestors in ``tree`` (a chain when ``tree`` is None).
    """

    capabilities: RuntimeCapabilities
    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary: padding)
    max_context: int  # positions the model (or the configured context) can hold

    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        """Start a new batch: run each row's tokens; logits are for the LAST token of each row
        (shape [B, 1, V]); hidden, if asked, for every prompt token of each row, left-padded
        ([B, L, H]), since feature drafters need the whole prompt's features."""
        ...

    def forward(
        self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: bool = False
    ) -> StepOutput:
        """Score ``tokens`` [B, N] appended to each row; the cache keeps all N until commit."""
        ...

    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        """Keep only nodes ``keep[b]`` (a root-to-leaf path, ascending) of the last forward."""
        ...

    def rollback(self, lengths: Sequence[int]) -> None:
        """Forget every cached token at position >= lengths[b]."""
        ...

    def lengths(self) -> list[int]:
        """Number of tokens held per row (= next position)."""
        ...

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only these batch rows (finished rows stop costing work)."""
        ...


@runtime_checkable
class GrowableRuntime(Runtime, Protocol):
    """Optional capability (continuous batching): rows can join a running batch between rounds.

    Checked with ``can_add_rows(runtime)``; a runtime without it can only serve fixed batches."""

    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        """Prefill ``rows`` and append them after the running rows; output as ``prefill`` for the
        new rows only. Existing rows' caches and lengths are unchanged. Never between
        ``forward`` and ``commit``."""
        ...


def can_add_rows(runtime: object) -> bool:
    """Whether ``runtime`` implements the optional ``add_rows`` (continuous batching)."""
    return callable(getattr(runtime, "add_rows", None))
