"""The runtime contract every backend implements, checked when a backend class registers.

A runtime owns one model and its KV cache for a batch of rows that join (``add_rows``) and
leave (``select_rows``) between rounds. The round never touches cache tensors: it asks for a
forward over N new nodes (a chain or a tree), then says which of those nodes survive
(``commit``) or how far to roll back (``rollback``). Each runtime picks its own mechanism (the
slot layer's crop or tail gather, llama.cpp's sequence removal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, Tuple, Union, runtime_checkable

import torch

from spec_plugins.tree import TreeLayout

# what a forward returns besides logits: nothing (False), the last hidden state after the final
# norm (True), or the outputs of these decoder layers (1-based) concatenated on the last axis
Want = Union[bool, Tuple[int, ...]]


@dataclass(frozen=True)
class RuntimeCapabilities:
    """What a runtime can do; the batch checks it against its proposer once, when it is built."""

    tree_mask: bool = False  # can score a token tree in one forward (custom attention mask)
    hidden_states: bool = False  # can return last-layer hidden states (feature-level drafters)
    # decoder-layer outputs it can return instead (EAGLE-3's fused features): None = any layer,
    # () = none, else exactly this tuple (an exported graph returns the layers it was exported with)
    feature_layers: tuple[int, ...] | None = ()
    num_layers: int | None = None  # decoder layers, so "any layer" still means one of 1..num_layers
    # a position's logits do not depend on how many positions the forward holds; speculation
    # needs it (verify forwards hold many, plain decoding one), or its output leaves plain's
    batch_invariant: bool = True
    name: str = ""

    def serves(self, want: "Want") -> bool:
        """Whether ``forward(..., want_hidden=want)`` is possible."""
        if want is False:
            return True
        if want is True:
            return self.hidden_states
        if self.feature_layers is None:
            return self.num_layers is None or all(1 <= layer <= self.num_layers for layer in want)
        return tuple(want) == self.feature_layers



@dataclass(frozen=True)
class SharedPool:
    """A cache every row and tree leaf draws from (llama.cpp's unified KV cache): ``cells`` KV
    positions in all, and ``sequences`` ids, one per row and one per tree leaf beyond a row's first.
    A runtime without one (``Runtime.pool`` None) holds ``max_context`` positions for each row."""

    cells: int
    sequences: int


@dataclass
class StepOutput:
    """Logits for every new node, and optionally the hidden states feeding the LM head."""

    logits: torch.Tensor  # [B, N, V] float32, on the runtime's ``device``
    hidden: torch.Tensor | None = None  # [B, N, H], or [B, N, L*H] for L feature layers


@runtime_checkable
class Runtime(Protocol):
    """One model + KV cache for a batch of rows.

    Node ``j`` of a forward sits at position ``length[b] + depth[j]`` of row ``b`` and attends to
    the row's cached tokens plus its ancestors in ``tree`` (a chain when ``tree`` is None).
    """

    capabilities: RuntimeCapabilities
    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary: padding)
    max_context: int  # positions the model (or the configured context) can hold
    device: torch.device  # where logits come out: the round's tensors live there
    # optional ``pool: SharedPool | None``: rows share one cache (``loop.capacity`` fits rows and drafts in it)

    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: Want = False) -> StepOutput:
        """Start a new batch: run each row's tokens; logits are for the LAST token of each row
        (shape [B, 1, V]); hidden, if asked, for every prompt token of each row, left-padded
        ([B, L, H]), since feature drafters need the whole prompt's features."""
        ...

    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: Want = False) -> StepOutput:
        """Prefill ``rows`` and append them after the running rows (``prefill`` when there are
        none); output as ``prefill`` for the new rows only. Running rows are unchanged, also when
        it fails. Never between ``forward`` and ``commit``."""
        ...

    def forward(
        self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: Want = False
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
        """Keep only these batch rows, in this order (finished rows stop costing work)."""
        ...


_METHODS = ("prefill", "add_rows", "forward", "commit", "rollback", "lengths", "select_rows")


def check_runtime_class(cls: type) -> None:
    """Refuse a backend class that lacks part of the contract (or a ``from_config`` to build it)."""
    missing = [m for m in (*_METHODS, "from_config") if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"runtime {cls.__name__} does not implement the Runtime contract: missing "
                        f"{', '.join(missing)}")
