"""A batch's logits processing, where a row's user processors may raise.

The rows' pipelines run over every node at once; where that raises, each row runs alone and,
within it, each node its processing raises at gets NaN logits (``LogitsPipeline.process_tree_apart``).
Such a node is judged as the NaN policy judges any node with no distribution (``Batch._verify``):
where the row's verdict reads it (the root, or an accepted node), the row keeps the accepted
tokens before it and then fails, naming the processor's error, as plain decoding would reach it
(``loop.verdicts.failures``, ``Row.emit``); a drafted node off the accepted path fails nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spec_plugins.loop.rows import Row
from spec_plugins.row_trees import Parents, rows_of
from spec_plugins.sampling import RowPipelines, warped_dtype


@dataclass
class Raised:
    """The nodes whose processing raised in a round: {(row, node): the error to fail that row with}."""

    errors: dict[tuple[int, int], str]


def process(pipes: RowPipelines, rows: Sequence[Row], logits: torch.Tensor, seen: Sequence,
            tokens: torch.Tensor, parents: Parents) -> tuple[torch.Tensor, Raised | None]:
    """Processed logits of ``rows`` [B, N, V], and the nodes whose processing raised (None where
    none did): after a failure of the whole batch's processing, each row alone, node by node."""
    try:
        return pipes.process_tree(logits, seen, tokens, parents), None
    except Exception:  # noqa: BLE001 - find the rows and nodes it fails for
        return _apart(rows, logits, seen, tokens, parents)


def _apart(rows: Sequence[Row], logits: torch.Tensor, seen: Sequence, tokens: torch.Tensor,
           parents: Parents) -> tuple[torch.Tensor, Raised | None]:
    """``process`` for each row alone, node by node where a row's processing raises."""
    z, errors = logits.new_empty(logits.shape, dtype=warped_dtype(logits.dtype)), {}
    for b, r in enumerate(rows):
        z[b:b + 1], raised = r.pipeline.process_tree_apart(logits[b:b + 1], [seen[b]], tokens[b:b + 1],
                                                           rows_of(parents, slice(b, b + 1)))
        for (_, j), exc in raised.items():
            errors[(b, j)] = f"logits processing failed: {type(exc).__name__}: {exc}"
    return z, Raised(errors) if errors else None
