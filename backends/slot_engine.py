"""The runtime contract over a compiled verify-graph engine whose KV lives in caller-owned tensors.

An engine of the ``exporters/onnx_verify.py`` layout maps (ids, positions, additive mask, past)
to (logits, hidden, present = past + new). Everything around that call is the same for every
such engine: the hole-masked slot bookkeeping (:class:`KVSlots`), masks, chunked prefill,
choosing the optimisation profile and exact binding shapes (``tensorrt_profiles.bindings``),
handing each call's presents to the next call as its past, and applying commit / rollback /
row-selection / compaction plans to those tensors. It lives here once; a subclass supplies only
``_run_engine`` (TensorRT: ``set_input_shape`` / ``set_tensor_address`` / ``execute_async_v3``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from spec_plugins.backends.base import RuntimeCapabilities, StepOutput
from spec_plugins.backends.kv_slots import KVSlots, SlotPlan
from spec_plugins.exporters.tensorrt_profiles import Limits, Profile, bindings
from spec_plugins.tree import TreeLayout


class SlotEngineRuntime:
    """Runtime contract for verify-graph engines; subclasses implement ``_run_engine``."""

    def _init_slots(self, inputs: list[dict], outputs: list[dict], profiles: list[Profile], limits: Limits,
                    model: dict, dtypes: dict[str, torch.dtype], device: torch.device, name: str,
                    max_context: int | None = None) -> None:
        self.inputs, self.outputs, self.profiles, self.limits = inputs, outputs, profiles, limits
        self._dtypes, self.device = dtypes, device
        self.num_layers = int(model["num_layers"])
        self.vocab_size = int(model["vocab_size"])
        self.max_context = min(limits.max_context, int(model["max_context"]), max_context or limits.max_context)
        has_hidden = any(t["name"] == "hidden" for t in outputs)
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=has_hidden, batch=limits.max_batch > 1,
                                                name=name)
        self._past_names = [t["name"] for t in inputs if t["name"].startswith("past_")]
        self._present_names = [n.replace("past_", "present_", 1) for n in self._past_names]  # past i -> present i
        kv = next(t["shape"] for t in inputs if t["name"].startswith("past_"))
        self._kv_heads, self._head_dim = int(kv[1]), int(kv[3])
        self.slots = KVSlots()
        self.kv: list[torch.Tensor] = []  # per layer key, value: [B, H_kv, S, D], dense, on ``device``

    def _run_engine(self, profile: int, feeds: dict[str, torch.Tensor],
                    out_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Run the engine with optimisation profile ``profile``; return every output by name."""
        raise NotImplementedError

    # ---- one call ----------------------------------------------------------------------------------
    def _execute(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 prefer: str) -> dict[str, torch.Tensor]:
        B, N = ids.shape
        P = int(self.kv[0].shape[2])
        bd = bindings(self.inputs, self.outputs, self.profiles, B, N, P, prefer)
        dev, dt = self.device, self._dtypes
        feeds = {"input_ids": ids.to(dev, dt["input_ids"]).contiguous(),
                 "position_ids": pos.to(dev, dt["position_ids"]).contiguous(),
                 "attention_mask": mask.to(dev, dt["attention_mask"]).contiguous(),
                 **dict(zip(self._past_names, self.kv))}
        for name, t in feeds.items():
            if tuple(t.shape) != bd.inputs[name]:
                raise RuntimeError(f"internal: input {name} has shape {tuple(t.shape)}, bindings say {bd.inputs[name]}")
        outs = self._run_engine(bd.profile, feeds, bd.outputs)
        self.kv = [outs[n] for n in self._present_names]  # present = past + new: the next call's past
        return outs

    def _apply(self, plan: SlotPlan) -> None:
        self.kv = [plan.apply(t).contiguous() for t in self.kv]  # engine inputs must be dense

    # ---- Runtime contract -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prefill needs at least one token per row")
        longest = max(len(r) for r in rows)
        if longest > self.max_context:
            raise ValueError(f"prompt of {longest} tokens exceeds the context of {self.max_context}")
        B = len(rows)
        pos = self.slots.prefill([len(r) for r in rows])
        ids = torch.zeros(B, longest, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, longest - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
        kv_dtype = self._dtypes[self._past_names[0]]
        self.kv = [torch.empty(B, self._kv_heads, 0, self._head_dim, dtype=kv_dtype, device=self.device)
                   for _ in self._past_names]
        chunk = max(p.ranges["N"][2] for p in self.profiles)
        hidden = []
        for start in range(0, longest, chunk):
            end = min(longest, start + chunk)
            mask = self.slots.prefill_mask(start, end, self._dtypes["attention_mask"])
            out = self._execute(ids[:, start:end], pos[:, start:end].clamp_min(0), mask, prefer="prefill")
            if want_hidden:
                hidden.append(out["hidden"])
        return StepOutput(out["logits"][:, -1:].float(), torch.cat(hidden, 1) if want_hidden else None)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: bool = False) -> StepOutput:
        B, N = tokens.shape
        depth = tree.depth if tree is not None else torch.arange(N)
        top = max(self.slots.next) + int(depth.max())
        if top >= self.max_context:
            raise ValueError(f"position {top} exceeds the context of {self.max_context}")
        if self.slots.slots > self.limits.max_context:  # holes grew the slot axis past the engine's P
            self._apply(self.slots.compact())
        new_pos = self.slots.forward(depth)
        anc = tree.ancestors if tree is not None else torch.ones(N, N, dtype=torch.bool).tril()
        mask = self.slots.forward_mask(anc, self._dtypes["attention_mask"])
        out = self._execute(tokens, new_pos, mask, prefer="decode")
        return StepOutput(out["logits"].float(), out["hidden"] if want_hidden else None)

    @torch.inference_mode()
    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        self._apply(self.slots.commit(keep))

    @torch.inference_mode()
    def rollback(self, lengths: Sequence[int]) -> None:
        self._apply(self.slots.rollback(lengths))

    def lengths(self) -> list[int]:
        return list(self.slots.next)

    @torch.inference_mode()
    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        """Prefill ``rows`` and append them after the running rows (continuous batching); output
        as ``prefill`` for the new rows only. Running rows' caches and lengths are unchanged."""
        if not self.kv or not self.slots.next:
            return self.prefill(rows, want_hidden)
        old_slots, old_kv = self.slots, self.kv
        if old_slots.pending_commit:
            raise RuntimeError("add_rows() between forward() and commit()")
        if len(old_slots.next) + len(rows) > self.limits.max_batch:
            raise ValueError(f"{len(old_slots.next)} running + {len(rows)} new rows exceed the engine's max batch "
                             f"{self.limits.max_batch} (rebuild with a larger --max-batch)")
        self.slots = KVSlots()
        try:
            out = self.prefill(rows, want_hidden)
        except BaseException:
            self.slots, self.kv = old_slots, old_kv
            raise
        new_kv = self.kv
        pad_old, pad_new = old_slots.append_rows(self.slots)
        self.slots = old_slots

        def pad(t: torch.Tensor, n: int) -> torch.Tensor:  # hole slots in front of the slot axis
            return t if n == 0 else torch.cat([t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3]), t], dim=2)

        self.kv = [torch.cat([pad(a, pad_old), pad(b, pad_new)], dim=0) for a, b in zip(old_kv, new_kv)]
        return out

    @torch.inference_mode()
    def select_rows(self, rows: Sequence[int]) -> None:
        idx, plan = self.slots.select_rows(rows)
        idx = idx.to(self.device)
        self.kv = [plan.apply(t[idx]).contiguous() for t in self.kv]
