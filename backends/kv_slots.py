"""Slot bookkeeping of the hole-masked KV layout, without any model or device.

The torch runtime keeps its cache as a shared slot axis for the whole batch plus ``pos [B, S]``,
the position held by each slot (-1 = a hole: left padding, a rejected tree node, or a token
another row did not keep). Runtimes whose KV lives in engine-owned tensors (TensorRT, ...) need
the same decisions (new positions, which slots survive a commit, where to crop) but apply them
to their own buffers, so the decisions live here as plans, and ``apply`` executes a plan on any
``[B, H, S, D]`` tensor. Behaviour equals ``backends/torch_runtime.py`` step for step (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SlotPlan:
    """How to turn the KV tensors ``[B, H, S_old, D]`` into the new slot layout.

    ``gather is None``: keep the first ``slots`` slots (a crop; a no-op when nothing is cut).
    Otherwise the new layout is ``kv[:, :, :start]`` followed by ``kv[b, :, start + gather[b]]``
    (tail compaction after a commit; ``start = 0`` for a full compaction)."""

    slots: int
    start: int = 0
    gather: torch.Tensor | None = None  # [B, slots - start] long, indices relative to ``start``

    def apply(self, kv: torch.Tensor) -> torch.Tensor:
        """Execute the plan on one ``[B, H, S, D]`` tensor (keys or values of one layer)."""
        if self.gather is None:
            return kv if kv.shape[2] == self.slots else kv[:, :, : self.slots]
        B, H, _, D = kv.shape
        m = self.gather.shape[1]
        g = self.gather.to(kv.device)[:, None, :, None].expand(B, H, m, D)
        tail = kv[:, :, self.start :].gather(2, g)
        return torch.cat([kv[:, :, : self.start], tail], dim=2)


class KVSlots:
    """Positions per slot for a batch of rows; every method returns the plan to apply to the KV."""

    def __init__(self) -> None:
        self.pos = torch.empty(0, 0, dtype=torch.long)  # [B, S], -1 = hole
        self.next: list[int] = []  # per row: tokens held = next position
        self._tail: tuple[int, int] | None = None  # (slots before the last forward, its size)
        self._before: list[int] = []  # per-row lengths before the last forward

    @property
    def slots(self) -> int:
        return int(self.pos.shape[1])

    @property
    def pending_commit(self) -> bool:
        """Between ``forward`` and ``commit`` (rows cannot join or leave then)."""
        return self._tail is not None

    @property
    def holes(self) -> bool:
        return bool((self.pos < 0).any())

    # ---- the runtime contract, as bookkeeping -------------------------------------------------
    def prefill(self, lengths: Sequence[int]) -> torch.Tensor:
        """Left-padded prompt layout; returns ``pos [B, L]`` (-1 = padding) for the prompt tokens."""
        if not lengths or min(lengths) < 1:
            raise ValueError("prefill needs at least one token per row")
        L = max(lengths)
        pos = torch.full((len(lengths), L), -1, dtype=torch.long)
        for b, n in enumerate(lengths):
            pos[b, L - n :] = torch.arange(n)
        self.pos = pos
        self.next = list(lengths)
        self._tail = None
        return pos

    def forward(self, depth: torch.Tensor) -> torch.Tensor:
        """Append N nodes at ``next[b] + depth``; returns their positions ``[B, N]``."""
        new_pos = torch.tensor(self.next, dtype=torch.long)[:, None] + depth[None, :]
        self._tail = (self.slots, int(depth.numel()))
        self._before = list(self.next)
        self.pos = torch.cat([self.pos, new_pos], dim=1)
        self.next = [n + int(depth.max()) + 1 for n in self.next]
        return new_pos

    def commit(self, keep: Sequence[Sequence[int]]) -> SlotPlan:
        """Keep nodes ``keep[b]`` of the last forward: a crop when every row keeps the same
        leading nodes, otherwise a gather of the tail (the prefix is never touched)."""
        if self._tail is None:
            raise RuntimeError("commit() without a preceding forward()")
        S, N = self._tail
        self._tail = None
        counts = [len(k) for k in keep]
        m = max(counts)
        self.next = [n + c for n, c in zip(self._before, counts)]
        if all(list(k) == list(range(len(k))) for k in keep) and len(set(counts)) == 1:
            return self._crop(S + m)
        idx, tail_pos = keep_index(keep, self.pos[:, S:])
        self.pos = torch.cat([self.pos[:, :S], tail_pos], dim=1)
        return SlotPlan(S + m, S, idx)

    def rollback(self, lengths: Sequence[int]) -> SlotPlan:
        """Forget every position >= lengths[b]; crop trailing slots that no row uses."""
        self._tail = None
        lim = torch.tensor(list(lengths), dtype=torch.long)[:, None]
        self.pos = torch.where(self.pos < lim, self.pos, torch.full_like(self.pos, -1))
        self.next = [min(n, int(L)) for n, L in zip(self.next, lengths)]
        return self._crop(self._last_live())

    def select_rows(self, rows: Sequence[int]) -> tuple[torch.Tensor, SlotPlan]:
        """Keep these rows; returns the row index to apply first, then the crop plan."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        self.pos = self.pos[idx]
        self.next = [self.next[r] for r in rows]
        live = self._last_live()
        return idx, self._crop(live if live and live < self.slots else self.slots)

    def append_rows(self, other: "KVSlots") -> tuple[int, int]:
        """Append ``other``'s rows after these (continuous batching). Both sides are left-padded
        with holes to a common slot count; returns how many hole slots to prepend to this side's
        KV and to ``other``'s before concatenating them along the batch axis."""
        if self.pending_commit or other.pending_commit:
            raise RuntimeError("append_rows() between forward() and commit()")
        S = max(self.slots, other.slots)
        pads = (S - self.slots, S - other.slots)

        def pad(p: torch.Tensor, n: int) -> torch.Tensor:
            return torch.cat([torch.full((p.shape[0], n), -1, dtype=torch.long), p], dim=1)

        self.pos = torch.cat([pad(self.pos, pads[0]), pad(other.pos, pads[1])], dim=0)
        self.next = self.next + other.next
        return pads

    def compact(self) -> SlotPlan:
        """Squeeze out every hole: each row's live slots, in order, right-aligned (left padding).

        Rows that accept different counts leave holes behind; the slot axis can then outgrow
        every row's length. Engines with a bounded past length call this before they overflow."""
        live = self.pos >= 0
        S2 = int(live.sum(1).max()) if self.pos.numel() else 0
        B = self.pos.shape[0]
        idx = torch.zeros(B, S2, dtype=torch.long)
        new = torch.full((B, S2), -1, dtype=torch.long)
        for b in range(B):
            slots = live[b].nonzero().flatten()
            n = int(slots.numel())
            idx[b, S2 - n :] = slots
            new[b, S2 - n :] = self.pos[b, slots]
        self.pos = new
        self._tail = None
        return SlotPlan(S2, 0, idx)

    # ---- masks ---------------------------------------------------------------------------------
    def forward_mask(self, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, N, S+N]`` for the last forward: non-hole past + tree ancestors.

        Call after ``forward`` (the tail is then part of ``pos``)."""
        if self._tail is None:
            raise RuntimeError("forward_mask() needs a preceding forward()")
        S, N = self._tail
        B = self.pos.shape[0]
        past_ok = (self.pos[:, :S] >= 0)[:, None, None, :].expand(B, 1, N, S)
        new_ok = ancestors[None, None].expand(B, 1, N, N)
        return additive(torch.cat([past_ok, new_ok], dim=-1), dtype)

    def prefill_mask(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, n, end]`` for prompt slots ``start:end`` run as one chunk over the
        first ``start`` slots: causal over non-padding keys; a padding query attends to itself so
        its softmax stays finite (its output is never read)."""
        pos = self.pos[:, :end]
        n = end - start
        causal = torch.ones(n, end, dtype=torch.bool).tril(start)
        ok = causal[None] & (pos >= 0)[:, None, :]
        ok[:, torch.arange(n), torch.arange(start, end)] = True
        return additive(ok[:, None], dtype)

    # ---- helpers -------------------------------------------------------------------------------
    def _last_live(self) -> int:
        live = (self.pos >= 0).any(0).nonzero()
        return int(live.max()) + 1 if live.numel() else 0

    def _crop(self, slots: int) -> SlotPlan:
        self.pos = self.pos[:, :slots]
        return SlotPlan(slots)


def additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool "may attend" -> additive float mask (0 or the dtype's most negative value)."""
    return torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, torch.finfo(dtype).min)


def keep_index(keep: Sequence[Sequence[int]], tail_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather plan for a commit: ``idx [B, m]`` (the kept nodes of each row, left-aligned,
    padded with 0) and the positions of the compacted tail, -1 where a row kept fewer nodes.
    Shared by every runtime that keeps a hole-masked slot layout."""
    m = max(len(k) for k in keep)
    idx = torch.zeros(len(keep), m, dtype=torch.long)
    ok = torch.zeros(len(keep), m, dtype=torch.bool)
    for b, k in enumerate(keep):
        if k:
            idx[b, : len(k)] = torch.as_tensor(list(k))
            ok[b, : len(k)] = True
    pos = tail_pos.gather(1, idx)
    return idx, torch.where(ok, pos, torch.full_like(pos, -1))
