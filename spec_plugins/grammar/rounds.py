"""What a round does for rows with a grammar: forced tokens drafted ahead, every node masked.

1. ``forced``: before drafting, each constrained row's forced tokens (the grammar allows one
   continuation) within its room, where the proposer ``continues_ahead`` (n-gram) or there is
   none: it drafts on from the sequence plus them, and ``splice`` puts them ahead of its chain;
   the target under the grammar accepts them with probability 1, so they are free tokens, not
   guesses. Any other proposer (suffix, a draft model, EAGLE, a tree drafter) gets no forced
   tokens drafted ahead: its rows are still masked exactly.
2. ``round_masks``: the bitmask of every node of the round (root and drafted), built on the host
   where the drafted tokens are (a device-drafted tree is read once for it: the grammar runs on
   the CPU), and copied to the logits' device without a sync.
3. ``apply_masks``: disallowed tokens to -inf on the device, before the user processors and the
   sampling warpers, so the target law is the masked, renormalised distribution.
Rows without a grammar get the all-allowed mask; a round with no constrained row does none of this.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from spec_plugins.grammar.matcher import ALL
from spec_plugins.transfer import HOST, fetch, upload
from spec_plugins.types import Draft

MAX_FORCED = 16  # forced tokens drafted per round at most (a verify forward's width stays bounded)


def constrained(rows: Sequence[Any]) -> bool:
    return any(r.grammar is not None for r in rows)


def forced(rows: Sequence[Any], room: Sequence[int]) -> list[list[int]]:
    """Per row, the forced tokens it drafts this round (none for rows without a grammar)."""
    return [r.grammar.forced(min(MAX_FORCED, k)) if r.grammar is not None and r.grammar.draft_forced else []
            for r, k in zip(rows, room)]


def splice(draft: Draft | None, ahead: Sequence[Sequence[int]]) -> Draft | None:
    """Each row's forced tokens followed by its drafted chain (``draft``: a chain drafted from the
    sequences extended by them, on the host)."""
    if not any(ahead):
        return draft
    if draft is None:
        return Draft.from_chains(ahead)
    if not isinstance(draft.parents, tuple) or draft.parents != tuple(range(-1, draft.size - 1)) or draft.probs is not None:
        raise ValueError("forced tokens are spliced ahead of a chain of point drafts only")
    toks = draft.tokens.tolist()
    valid = draft.valid.tolist() if draft.valid is not None else [[True] * draft.size] * len(toks)
    return Draft.from_chains([list(f) + [t for t, v in zip(row, ok) if v] for f, row, ok in zip(ahead, toks, valid)])


def round_masks(rows: Sequence[Any], draft: Draft | None, device: torch.device) -> torch.Tensor | None:
    """[B, 1 + n, words] int32 on ``device``: each node's allowed tokens (module docstring)."""
    if not constrained(rows):
        return None
    words = next(r.grammar.words for r in rows if r.grammar is not None)
    n = draft.size if draft is not None else 0
    out = np.full((len(rows), 1 + n, words), ALL, dtype=np.int32)
    tokens, parents, valid = _host_draft(draft) if draft is not None else ([[]] * len(rows), None, None)
    for b, r in enumerate(rows):
        if r.grammar is not None and r.error is None:
            par = parents if parents is None or isinstance(parents, tuple) else parents[b]
            out[b] = r.grammar.masks(tokens[b], par or (), None if valid is None else valid[b])
    return upload(torch.from_numpy(out), device)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [B, N, V] with the tokens ``masks`` [B, N, words] disallows at -inf."""
    if masks is None:
        return logits
    B, N, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    allowed = ((masks[..., None] >> shifts) & 1).bool().reshape(B, N, -1)[..., :V]
    return logits.masked_fill(~allowed, float("-inf"))


def _host_draft(draft: Draft) -> tuple[list[list[int]], Any, list[list[bool]] | None]:
    """The draft's tokens, per-row parents and valid mask as host lists: read once where a
    drafter left them on a device."""
    parts = {"tokens": draft.tokens}
    if not isinstance(draft.parents, tuple):
        parts["parents"] = draft.parents.parents
    valid = draft.valid_on_host()
    if valid is not None:
        parts["valid"] = valid
    on_host = all(t.device == HOST for t in parts.values())
    host = {k: v.numpy() for k, v in parts.items()} if on_host else fetch(parts)
    parents = draft.parents if isinstance(draft.parents, tuple) else host["parents"].tolist()
    return host["tokens"].tolist(), parents, host["valid"].tolist() if "valid" in host else None
