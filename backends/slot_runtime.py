"""The runtime contract over the hole-masked slot layer, written once for every engine whose KV
lives in tensors we hold (torch, ONNX Runtime, TensorRT).

Everything around the engine call is the same for those engines: positions and masks from
:class:`~spec_plugins.slots.KVSlots`, (chunked) prefill, rows joining a running batch
(prefill them alone, left-pad both sides with holes, concatenate), and commit / rollback /
row selection / compaction as slot plans applied to the KV tensors. A runtime is an adapter
that supplies ``_call`` (one engine call; the presents replace ``self.kv``), ``kv`` (its KV
tensors, ``[B, H_kv, S, D]`` per layer key and value) and ``_reset_kv``.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from spec_plugins.backends.base import StepOutput, Want
from spec_plugins.slots import HOST, KVSlots, SlotPlan, pad_slots
from spec_plugins.transfer import upload
from spec_plugins.tree import TreeLayout


class SlotRuntime:
    """Base of slot-layout runtimes; subclasses implement the three engine hooks below."""

    always_mask: ClassVar[bool] = True  # False: no mask when nothing is masked (the model's causal path)
    prefill_chunk: int | None = None  # longest prompt slice one engine call takes (None: any)
    max_slots: int | None = None  # engines with a bounded past compact holes before exceeding it
    # compact the slot axis once holes are this share of it: rows of a batch accept different
    # counts, and every forward attends over every slot, holes included, so uncompacted holes make
    # every forward dearer
    compact_holes: float = 0.25
    mask_dtype: torch.dtype = torch.float32
    max_context: int
    slots: KVSlots

    # ---- engine hooks ----------------------------------------------------------------------------
    kv: list[torch.Tensor]

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, want_hidden: Want,
              prefill: bool) -> StepOutput:
        """One engine call over ``ids`` [B, n] at ``pos`` [B, n] (mask [B, 1, n, S+n] additive or
        None); replaces ``self.kv`` with the presents. ``prefill``: a prompt chunk, of whose
        logits only the last position's is read."""
        raise NotImplementedError

    def _reset_kv(self, rows: int) -> None:
        """An empty past for ``rows`` rows (before a prefill)."""
        raise NotImplementedError

    def _kept_kv(self) -> list[torch.Tensor]:
        """The running rows' KV while new rows prefill (an engine whose prefill writes into the
        same buffers keeps a copy)."""
        return self.kv

    def _forward_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """The engine's mask for the forward just laid out (default: the slot layer's additive one,
        built where the ancestors are: a device tree is not read back)."""
        return self.slots.forward_mask(ancestors, self.mask_dtype)

    def _prefill_mask(self, start: int, end: int) -> torch.Tensor:
        return self.slots.prefill_mask(start, end, self.mask_dtype)

    # ---- plans -----------------------------------------------------------------------------------
    def _apply(self, plan: SlotPlan) -> None:
        if self.kv:
            plan = plan.to(self.kv[0].device)
        self.kv = [plan.apply(t) for t in self.kv]

    # ---- Runtime contract --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: Want = False) -> StepOutput:
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prefill needs at least one token per row")
        longest = max(len(r) for r in rows)
        if longest > self.max_context:
            raise ValueError(f"prompt of {longest} tokens exceeds the context of {self.max_context}")
        self.slots = KVSlots()
        pos = self.slots.prefill([len(r) for r in rows])
        ids = torch.zeros(len(rows), longest, dtype=torch.long, device=HOST)
        for b, r in enumerate(rows):
            ids[b, longest - len(r):] = torch.as_tensor(list(r), dtype=torch.long, device=HOST)
        self._reset_kv(len(rows))
        chunk = self.prefill_chunk or longest
        hidden = []
        for start in range(0, longest, chunk):
            end = min(longest, start + chunk)
            masked = self.always_mask or self.slots.holes or start > 0
            mask = self._prefill_mask(start, end) if masked else None
            out = self._call(ids[:, start:end], pos[:, start:end].clamp_min(0), mask, want_hidden, prefill=True)
            if want_hidden:
                hidden.append(out.hidden)
        return StepOutput(out.logits[:, -1:], torch.cat(hidden, 1) if want_hidden else None)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: Want = False) -> StepOutput:
        B, N = tokens.shape
        depth = tree.depth if tree is not None else torch.arange(N, device=HOST)
        top = max(self.slots.next)  # the pending token's: a node past the context is never valid (the loop
        if top >= self.max_context:  # cuts each row's draft to its room), only a longer row's padding is there
            raise ValueError(f"position {top} exceeds the context of {self.max_context}")
        if self.max_slots is not None and self.slots.slots > self.max_slots:
            self._apply(self.slots.compact())  # holes grew the slot axis past the engine's bound
        masked = self.always_mask or self.slots.holes or not (tree is None or tree.is_chain)
        new_pos = self.slots.forward(depth, self.max_context - 1)
        mask = None
        if masked:
            anc = tree.ancestors if tree is not None else torch.ones(N, N, dtype=torch.bool, device=HOST).tril()
            mask = self._forward_mask(anc)
        return self._call(tokens, new_pos, mask, want_hidden, prefill=False)

    @torch.inference_mode()
    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        self._apply(self.slots.commit(keep))
        if self.slots.hole_share() > self.compact_holes:
            self._apply(self.slots.compact())

    @torch.inference_mode()
    def rollback(self, lengths: Sequence[int]) -> None:
        self._apply(self.slots.rollback(lengths))

    def lengths(self) -> list[int]:
        return list(self.slots.next)

    @torch.inference_mode()
    def select_rows(self, rows: Sequence[int]) -> None:
        idx, plan = self.slots.select_rows(rows)
        if self.kv:
            dev_idx, plan = upload(idx, self.kv[0].device), plan.to(self.kv[0].device)
            self.kv = [plan.apply(t[dev_idx]) for t in self.kv]
            if self.slots.hole_share() > self.compact_holes:  # the longest row may have left
                self._apply(self.slots.compact())

    @torch.inference_mode()
    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: Want = False) -> StepOutput:
        """Prefill ``rows`` and append them after the running rows; output as ``prefill`` for the
        new rows only. Running rows' caches and lengths are unchanged; on an error nothing is."""
        if not self.slots.rows:
            return self.prefill(rows, want_hidden)
        if self.slots.pending_commit:
            raise RuntimeError("add_rows() between forward() and commit()")
        old_slots, old_kv = self.slots, self._kept_kv()
        try:
            out = self.prefill(rows, want_hidden)
        except BaseException:
            self.slots, self.kv = old_slots, old_kv
            raise
        new_kv = self.kv
        pad_old, pad_new = old_slots.append_rows(self.slots)
        self.slots = old_slots
        self.kv = [torch.cat([pad_slots(a, pad_old), pad_slots(b, pad_new)], dim=0) for a, b in zip(old_kv, new_kv)]
        return out
