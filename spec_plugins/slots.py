"""The hole-masked KV slot layer: positions per slot, plans for the KV tensors, attention masks.

Core bookkeeping, not an engine: runtimes (``backends/``) and the EAGLE drafter's cache import it.

Every runtime whose KV lives in tensors we hold (torch, ONNX Runtime, TensorRT) and the EAGLE
drafter's own cache keep the same layout: one slot axis shared by the batch plus ``pos [B, S]``,
the position held by each slot (-1 = a hole: left padding, a rejected tree node, or a token
another row did not keep). Holes are masked out, so rows can accept different numbers of
tokens without moving the cache. The decisions (new positions, which slots survive a commit,
where to crop) live here once, as :class:`SlotPlan` s; ``SlotPlan.apply`` executes one on any
``[B, H, S, D]`` tensor, on any device. ``pos`` stays on the host (bookkeeping only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from spec_plugins.transfer import HOST, upload  # HOST: where slot bookkeeping lives; KV tensors live with the engine


@dataclass(frozen=True)
class SlotPlan:
    """How to turn KV tensors ``[B, H, S_old, D]`` into the new slot layout.

    ``gather is None``: keep the first ``slots`` slots (a crop; a no-op when nothing is cut).
    Otherwise ``kv[:, :, :start]`` stays and is followed by ``kv[b, :, start + gather[b]]``
    (tail compaction after a commit, O(tail); ``start = 0`` for a full compaction)."""

    slots: int
    start: int = 0
    gather: torch.Tensor | None = None  # [B, slots - start] long, indices relative to ``start``

    def to(self, device: torch.device) -> "SlotPlan":
        """The same plan with its gather index on ``device`` (copied once for every KV tensor)."""
        if self.gather is None or self.gather.device == device:
            return self
        return SlotPlan(self.slots, self.start, upload(self.gather, device))

    @torch.inference_mode()
    def apply(self, kv: torch.Tensor) -> torch.Tensor:
        """Execute the plan on one ``[B, H, S, D]`` tensor (keys or values of one layer); the
        tail is written in place where it fits (runtime caches are inference tensors)."""
        if self.gather is None:
            return kv if kv.shape[2] == self.slots else kv[:, :, : self.slots]
        B, H, _, D = kv.shape
        m = self.gather.shape[1]
        g = self.gather.to(kv.device)[:, None, :, None].expand(B, H, m, D)
        tail = kv[:, :, self.start :].gather(2, g)  # a copy, so writing it back in place is safe
        if self.start + m <= kv.shape[2]:
            out = kv[:, :, : self.start + m]
            out[:, :, self.start :] = tail
            return out
        return torch.cat([kv[:, :, : self.start], tail], dim=2)


class KVSlots:
    """Positions per slot for a batch of rows; every method returns the plan to apply to the KV."""

    def __init__(self) -> None:
        self.pos = torch.empty(0, 0, dtype=torch.long, device=HOST)  # [B, S], -1 = hole
        self.next: list[int] = []  # per row: tokens held = next position
        self._tail: tuple[int, int] | None = None  # (slots before the last forward, its size)
        self._before: list[int] = []  # per-row lengths before the last forward

    @classmethod
    def empty(cls, rows: int) -> "KVSlots":
        """``rows`` rows holding nothing yet (a drafter cache before its first catch-up)."""
        out = cls()
        out.pos = torch.empty(rows, 0, dtype=torch.long, device=HOST)
        out.next = [0] * rows
        return out

    @property
    def rows(self) -> int:
        return len(self.next)

    @property
    def slots(self) -> int:
        return int(self.pos.shape[1])

    @property
    def pending_commit(self) -> bool:
        """Between ``forward`` and ``commit`` (rows cannot join or leave then)."""
        return self._tail is not None

    @property
    def holes(self) -> bool:
        """Any hole in the layout: then every forward needs a mask (the torch runtime skips it otherwise)."""
        return bool((self.pos < 0).any())

    # ---- the runtime contract, as bookkeeping -------------------------------------------------
    def prefill(self, lengths: Sequence[int]) -> torch.Tensor:
        """Left-padded prompt layout; returns ``pos [B, L]`` (-1 = padding) for the prompt tokens."""
        if not lengths or min(lengths) < 1:
            raise ValueError("prefill needs at least one token per row")
        L = max(lengths)
        pos = torch.full((len(lengths), L), -1, dtype=torch.long, device=HOST)
        for b, n in enumerate(lengths):
            pos[b, L - n :] = torch.arange(n, device=HOST)
        self.pos = pos
        self.next = list(lengths)
        self._tail = None
        return pos

    def append(self, pos: torch.Tensor) -> None:
        """Append slots holding ``pos [B, N]`` (-1 = hole), e.g. a drafter's right-aligned catch-up."""
        self.pos = torch.cat([self.pos, pos], dim=1) if self.pos.numel() else pos.clone()

    def forward(self, depth: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """Append N nodes at ``next[b] + depth``, clamped to position ``last`` (the context's end:
        only a batch's padding reaches past a row's end, and it is never kept); returns their
        positions ``[B, N]``."""
        new_pos = torch.tensor(self.next, dtype=torch.long, device=HOST)[:, None] + depth[None, :]
        if last is not None:
            new_pos = new_pos.clamp_max(last)
        self._tail = (self.slots, int(depth.numel()))
        self._before = list(self.next)
        self.append(new_pos)
        self.next = [n + int(depth.max()) + 1 for n in self.next]
        return new_pos

    def commit(self, keep: Sequence[Sequence[int]]) -> SlotPlan:
        """Keep nodes ``keep[b]`` of the last forward: a crop when every row keeps the same
        leading nodes, otherwise a gather of the tail (the prefix is never touched)."""
        if self._tail is None:
            raise RuntimeError("commit() without a preceding forward()")
        S, _ = self._tail
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
        lim = torch.tensor(list(lengths), dtype=torch.long, device=HOST)[:, None]
        self.pos = torch.where(self.pos < lim, self.pos, torch.full_like(self.pos, -1))
        self.next = [min(n, int(L)) for n, L in zip(self.next, lengths)]
        return self._crop(self._last_live())

    def select_rows(self, rows: Sequence[int]) -> tuple[torch.Tensor, SlotPlan]:
        """Keep these rows; returns the row index to apply first, then the crop plan. Nodes of an
        uncommitted forward stay cached (as after a forward without commit: a drafter's own cache)."""
        self._tail = None
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=HOST)
        self.pos = self.pos[idx]
        self.next = [self.next[r] for r in rows]
        return idx, self._crop(self._last_live())

    def append_rows(self, other: "KVSlots") -> tuple[int, int]:
        """Append ``other``'s rows after these (continuous batching). Both sides are left-padded
        with holes to a common slot count; returns how many hole slots to prepend to this side's
        KV and to ``other``'s before concatenating them along the batch axis."""
        if self.pending_commit or other.pending_commit:
            raise RuntimeError("append_rows() between forward() and commit()")
        S = max(self.slots, other.slots)
        pads = (S - self.slots, S - other.slots)

        def pad(p: torch.Tensor, n: int) -> torch.Tensor:
            return torch.cat([torch.full((p.shape[0], n), -1, dtype=torch.long, device=HOST), p], dim=1)

        self.pos = torch.cat([pad(self.pos, pads[0]), pad(other.pos, pads[1])], dim=0)
        self.next = self.next + other.next
        return pads

    def compact(self) -> SlotPlan:
        """Squeeze out every hole: each row's live slots, in order, right-aligned (left padding).

        Rows that accept different counts leave holes behind; the slot axis can then outgrow
        every row's length. Engines with a bounded past length and caches that are mostly holes
        call this."""
        live = self.pos >= 0
        S2 = int(live.sum(1).max()) if self.pos.numel() else 0
        B = self.pos.shape[0]
        idx = torch.zeros(B, S2, dtype=torch.long, device=HOST)
        new = torch.full((B, S2), -1, dtype=torch.long, device=HOST)
        for b in range(B):
            slots = live[b].nonzero().flatten()
            n = int(slots.numel())
            idx[b, S2 - n :] = slots
            new[b, S2 - n :] = self.pos[b, slots]
        self.pos = new
        self._tail = None
        return SlotPlan(S2, 0, idx)

    def hole_share(self) -> float:
        """The share of the slot axis that even the fullest row leaves as holes: attention pays for
        every slot, so this is the work a forward spends on nothing."""
        if self.slots == 0 or self.pos.shape[0] == 0:
            return 0.0
        return 1.0 - int((self.pos >= 0).sum(1).max()) / self.slots

    def mostly_holes(self) -> bool:
        """More than half of the slot axis is holes for every row (time to ``compact``)."""
        return self.hole_share() >= 0.5

    # ---- masks ---------------------------------------------------------------------------------
    def past_ok(self, queries: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """``[B, 1, queries, end - start]`` bool: which cached slots each new query may attend to."""
        pos = self.pos[:, start:end]
        return (pos >= 0)[:, None, None, :].expand(pos.shape[0], 1, queries, pos.shape[1])

    def forward_visibility(self, ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the last forward's N nodes may see, on the device of ``ancestors`` (``[N, N]``, or
        ``[B, N, N]`` per row): each row's non-hole past slots ``[B, S]`` bool (the host's flags
        uploaded without a sync) and the ancestors themselves, so a tree drafted on a device is
        never read back. Call after ``forward`` (the tail is then part of ``pos``)."""
        if self._tail is None:
            raise RuntimeError("a forward mask needs a preceding forward()")
        S, _ = self._tail
        return upload(self.pos[:, :S] >= 0, ancestors.device), ancestors

    def forward_mask(self, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, N, S+N]`` for the last forward, built where ``ancestors`` are:
        non-hole past + tree ancestors (``forward_visibility``)."""
        past, anc = self.forward_visibility(ancestors)
        (B, S), N = past.shape, int(anc.shape[-1])
        new_ok = (anc[None] if anc.dim() == 2 else anc).expand(B, N, N)
        return additive(torch.cat([past[:, None, :].expand(B, N, S), new_ok], dim=-1)[:, None], dtype)

    def prefill_mask(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, n, end]`` for prompt slots ``start:end`` run as one chunk over the
        first ``start`` slots: causal over non-padding keys; a padding query attends to itself so
        its softmax stays finite (its output is never read)."""
        pos = self.pos[:, :end]
        n = end - start
        causal = torch.ones(n, end, dtype=torch.bool, device=HOST).tril(start)
        ok = causal[None] & (pos >= 0)[:, None, :]
        ok[:, torch.arange(n, device=HOST), torch.arange(start, end, device=HOST)] = True
        return additive(ok[:, None], dtype)

    # ---- helpers -------------------------------------------------------------------------------
    def _last_live(self) -> int:
        live = (self.pos >= 0).any(0).nonzero()
        return int(live.max()) + 1 if live.numel() else 0

    def _crop(self, slots: int) -> SlotPlan:
        self.pos = self.pos[:, :slots]
        return SlotPlan(slots)


def pad_slots(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` hole slots (zeros) in front of the slot axis of a ``[B, H, S, D]`` cache tensor, as
    ``KVSlots.append_rows`` asks before two batches are concatenated."""
    return t if n == 0 else torch.cat([t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3]), t], dim=2)


def additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool "may attend" -> additive float mask (0 or the dtype's most negative value)."""
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, torch.finfo(dtype).min)


def keep_index(keep: Sequence[Sequence[int]], tail_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather plan for a commit: ``idx [B, m]`` (the kept nodes of each row, left-aligned,
    padded with 0) and the positions of the compacted tail, -1 where a row kept fewer nodes."""
    m = max(len(k) for k in keep)
    idx = torch.zeros(len(keep), m, dtype=torch.long, device=HOST)
    ok = torch.zeros(len(keep), m, dtype=torch.bool, device=HOST)
    for b, k in enumerate(keep):
        if k:
            idx[b, : len(k)] = torch.as_tensor(list(k), device=HOST)
            ok[b, : len(k)] = True
    pos = tail_pos.gather(1, idx)
    return idx, torch.where(ok, pos, torch.full_like(pos, -1))
