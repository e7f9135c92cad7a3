"""The torch runtime with a static KV cache and a compiled, fixed-shape verify step.

Eager PyTorch on a GPU is launch-bound: a small model's forward spends most of its time launching
kernels, which a replayed CUDA graph does not. A graph needs fixed shapes and fixed addresses, so:

- **KV buffers** ``[rows, kv_heads, capacity, head_dim]`` per layer are allocated once on the
  device (capacity and rows grown in powers of two, so a few graphs cover every length) and written by
  slot: a forward over N nodes writes slots ``write_at .. write_at + N`` (``write_at`` is a device
  scalar, so a compiled step reads it instead of baking it in). Attention always reads the whole
  capacity, the mask hiding what is not a row's past. The slot bookkeeping is the shared slot
  layer's (``spec_plugins/slots.py``): commit, rollback, row selection and compaction are its
  plans, applied in place on the buffers (a crop costs nothing; a tail gather or a compaction is
  one device gather per tensor).
- **masks** are boolean and built on the device: the host sends each row's live-slot flags (one
  byte per slot), not a float mask.
- **the verify step** is compiled once per bucket (rows 1/2/4/8/..., positions 1/2/4/.../64, the
  buffers' capacity) with ``torch.compile(fullgraph=True)``; on CUDA in ``reduce-overhead`` mode
  (CUDA graphs). Padding rows and positions attend to their own slot only (finite, never read).
  Prefill stays eager.

``compile: auto`` compiles on CUDA only: on a CPU the compiled step is faster per forward, but
compiling every bucket is a cold start a generation does not pay back (docs/runtimes/torch.md).
A model whose forward cannot be one graph (a dynamic-NTK rope, ``graph_blocker``) runs the step
eager under ``auto`` and is refused when the runtime is built under ``compile: on`` or ``graphs``.
The cost model measures whichever path runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from spec_plugins.backends import hf_compat
from spec_plugins.backends.base import StepOutput, Want
from spec_plugins.backends.torch_runtime import TorchRuntime, load_for, pick_device, selects_static
from spec_plugins.fixed_steps import ROW_BUCKETS, FixedSteps, Mode, bucket
from spec_plugins.transfer import upload

MIN_CAPACITY = 64  # slots; capacity doubles as rows grow (one graph per capacity, log2 of them)
# rows run in ``fixed_steps.ROW_BUCKETS``, the drafters' steps over this runtime too
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
HEADROOM = WIDTH_BUCKETS[-1]  # slots the widest fixed-shape forward adds past the live ones


def graph_blocker(model: Any) -> str | None:
    """The rope type that keeps ``model``'s forward from being one fixed-shape graph, or None. A
    dynamic-NTK rope (transformers' ``dynamic_rope_update``) branches on each forward's largest
    position and re-registers its frequencies: a graph break under ``torch.compile(fullgraph=True)``,
    a host read inside a CUDA graph capture."""
    kinds = (str(d.get("rope_type", d.get("type", ""))) for d in hf_compat._rope_dicts(hf_compat.text_config(model)))
    return next((k for k in kinds if "dynamic" in k), None)


class SlotCache:
    """The per-layer KV buffers the model's attention writes and reads (duck-typed as a
    transformers cache: ``update`` is all a decoder layer calls when it is given a 4D mask, and some
    decoders read ``get_seq_length``). Every layer keeps every slot, sliding-window layers too: their
    mask cuts them to the window."""

    def __init__(self, layers: int, rows: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, static_addresses: bool = False) -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.write_at = torch.zeros((), dtype=torch.long, device=device)  # first slot the next forward writes
        self.written = 0  # write_at's value, kept on the host (``get_seq_length`` outside a compiled step)
        self.updates = 0  # layer writes seen (eager calls): the cache-was-used guard
        if static_addresses:  # CUDA graphs replay on these very buffers
            for t in (*self.keys, *self.values, self.write_at):
                torch._dynamo.mark_static_address(t)

    @property
    def rows(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    def seek(self, slot: int) -> None:
        """Point the next forward's writes at ``slot`` (the device scalar and its host copy)."""
        self.write_at.fill_(slot)
        self.written = slot

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Slots before this forward's: the slot axis every row shares, holes included (a row's
        positions come from ``position_ids``), as the growing cache's length is. OPT, Falcon, XGLM
        and BioGPT read it on every forward. Inside a compiled step it is the device scalar, as in
        transformers' StaticCache: a Python int there is guarded on (a graph per length); elsewhere
        the host copy, since reading the scalar would sync (and cannot inside a CUDA graph capture)."""
        return self.write_at if torch.compiler.is_compiling() else self.written

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        B, n = key_states.shape[0], key_states.shape[-2]
        idx = torch.arange(n, device=key_states.device) + self.write_at
        keys, values = self.keys[layer_idx][:B], self.values[layer_idx][:B]
        keys.index_copy_(2, idx, key_states)
        values.index_copy_(2, idx, value_states)
        if not torch.compiler.is_compiling():  # a Python counter in a graph would be a guard (recompiles)
            self.updates += 1
        return keys, values


@dataclass(frozen=True)
class _Mask:
    """What the step's boolean mask is built from (on the device, at the step's padded shape)."""

    past: torch.Tensor  # [B, S] bool: live slots of each row before this forward's nodes
    ancestors: torch.Tensor  # [n, n] bool: node i may see node j (causal for a chain or a prompt chunk)
    past_pos: torch.Tensor | None = None  # [B, S] long: those slots' positions (sliding-window models only)


class StaticTorchRuntime(TorchRuntime):
    """``TorchRuntime`` over a ``SlotCache``, with a compiled fixed-shape step (module docstring)."""

    always_mask = True  # attention reads the whole capacity: a mask always says which slots are past

    @classmethod
    def from_config(cls, config: "TorchRuntime.Config") -> "StaticTorchRuntime":
        """Compiled where asked, or with ``compile: auto`` on CUDA (a CPU's compile time is not paid back)."""
        if not selects_static(config):
            raise ValueError(f"this torch config selects the growing cache (kv: {config.kv}): build it with "
                             "spec_plugins.backends.build_runtime")
        cuda = pick_device(config.device).type == "cuda"
        if config.compile == "graphs" and not cuda:
            raise ValueError(f"compile: graphs captures CUDA graphs: it needs a CUDA device, got {config.device!r} "
                             f"({pick_device(config.device)}); use compile: on or off there")
        compile_: bool | Literal["auto"] = "auto" if config.compile == "auto" else config.compile == "on"
        model, tok = load_for(config)
        return cls(model, tok, max_context=config.max_context, compile=compile_, graphs=config.compile == "graphs")

    def __init__(self, model: Any, tokenizer: Any = None, max_context: int | None = None,
                 compile: bool | Literal["auto"] = False, graphs: bool = False) -> None:
        """``compile``: ``True`` compiles the verify step, ``"auto"`` on CUDA only and only for a model
        whose forward is one graph (``graph_blocker``); ``graphs``: captured as CUDA graphs instead."""
        # the measured few-row matmul kernels patch calls at run time: not inside a compiled graph
        super().__init__(model, tokenizer, max_context, matmul="native")
        cfg = hf_compat.text_config(model)
        self._layers = int(cfg.num_hidden_layers)
        self._kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self._head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self._check_kv_shape()
        if graphs and (compile or self.device.type != "cuda"):
            raise ValueError(f"graphs: CUDA graphs of the eager step, on a CUDA device and instead of compiling "
                             f"(device {self.device}, compile={compile})")
        compile = self._compiles(compile, graphs)
        self.compile, self.graphs = compile, graphs
        self.fixed_shapes = compile or graphs  # verify steps padded to buckets (compiled or captured)
        self.step_mode: Mode = "graphs" if graphs else "compile" if compile else "eager"  # drafters over it follow
        self._steps: dict[Want, FixedSteps] = {}  # per output kind: one graph per (rows, positions, capacity)
        self.cache: SlotCache | None = None
        self._live = (0, 0)  # rows and slots the buffers hold (what ``kv`` views)
        # SDPA takes a boolean mask; the eager implementation adds it to the scores
        self._additive = self.attention == "eager"

    def _check_kv_shape(self) -> None:
        """Refuse, at build, a model whose layers cache other tensors than the buffers' ``[rows,
        kv_heads, slots, head_dim]`` read from its config (multi-head latent attention, DeepSeek-V2/V3,
        caches a compressed latent and a shared rope key): the first forward would fail inside
        ``index_copy_``. Read from what a one-token forward of the decoder (no LM head: no logits are
        needed) puts in a growing cache, whatever the family."""
        probe, decoder = hf_compat.full_cache(), self.model.base_model
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            decoder(input_ids=one, position_ids=one, use_cache=True, **{hf_compat.cache_keyword(decoder): probe})
        want = (1, self._kv_heads, 1, self._head_dim)
        for i, lay in enumerate(probe.layers):
            got = (tuple(lay.keys.shape), tuple(lay.values.shape))
            if got != (want, want):
                cfg = hf_compat.text_config(self.model)
                raise ValueError(
                    f"{getattr(cfg, 'model_type', '?')} ({type(self.model).__name__}) caches keys {got[0]} and "
                    f"values {got[1]} for one token in layer {i}, not the {want} ({self._kv_heads} KV heads of "
                    f"{self._head_dim}) its config gives the static cache's buffers (multi-head latent attention "
                    "caches a compressed latent): use kv: dynamic (the growing cache, which holds whatever the "
                    "model caches)")

    def _compiles(self, compile: bool | Literal["auto"], graphs: bool) -> bool:
        """Whether the verify step compiles; a fixed-shape step asked for over a model whose forward is
        no one graph is refused here, at build time, not by the compiler on the first verify (mid-round)."""
        blocker = graph_blocker(self.model)
        if blocker is not None and (compile is True or graphs):
            raise ValueError(f"{type(self.model).__name__}'s rope (rope_type {blocker!r}) recomputes its frequencies "
                             f"from each forward's largest position, a branch a {'captured' if graphs else 'compiled'} "
                             "step cannot hold: use compile: off (the static cache, eager) or kv: dynamic (the "
                             "growing cache)")
        return compile is True or (compile == "auto" and self.device.type == "cuda" and blocker is None)

    # ---- the buffers, seen as the slot layer's KV tensors -------------------------------------------
    def _capacity(self, slots: int) -> int:
        """The buffers' capacity for ``slots``: a power of two (few graphs, little waste), capped at
        the longest slot axis a compiled forward can need. Before a forward the axis holds at most
        ``max_context / (1 - compact_holes)`` slots (no row holds more than ``max_context``
        positions, and commit and row selection compact once holes pass that share), and a compiled
        forward adds at most ``WIDTH_BUCKETS[-1]``: so the buffers grow at most
        ``log2(cap / MIN_CAPACITY) + 1`` times for their slots over a generation. Past the cap (an
        eager forward wider than the last bucket) capacities stay powers of two."""
        cap = max(MIN_CAPACITY, 1 << (max(slots, 1) - 1).bit_length())
        if self.compact_holes >= 1:  # holes never compacted: no bound on the axis
            return cap
        bound = math.ceil(self.max_context / (1 - self.compact_holes)) + WIDTH_BUCKETS[-1]
        return min(cap, bound) if slots <= bound else cap

    def _ensure(self, rows: int, slots: int) -> None:
        """Buffers for ``rows`` x ``slots`` (grown in steps, ``_capacity``, the live content carried over).
        A reallocation copies the KV and drops every compiled step, so it never shrinks the capacity
        the buffers have."""
        c = self.cache
        if c is not None and c.rows >= rows and c.capacity >= slots:
            return
        cap = self._capacity(slots)
        if c is not None:
            cap = max(cap, c.capacity)
        live = self.kv
        self.cache = SlotCache(self._layers, bucket(rows, ROW_BUCKETS), cap, self._kv_heads, self._head_dim,
                               self.dtype, self.device,
                               static_addresses=self.fixed_shapes and self.device.type == "cuda")
        for step in self._steps.values():  # new buffers: a graph captured on the old ones would write there,
            step.clear()  # and Dynamo keeps a dropped step's compiled graphs alive unless its cache is emptied
        self._steps.clear()
        if live:
            self.kv = live

    @property
    def kv(self) -> list[torch.Tensor]:
        """Views of the buffers over the rows and slots they hold now (the slot layer's plans apply
        to these, before or after its own bookkeeping moved on)."""
        c = self.cache
        B, S = self._live
        if c is None or not B:
            return []
        return [t[:B, :, :S] for lay in zip(c.keys, c.values) for t in lay]

    @kv.setter
    def kv(self, tensors: list[torch.Tensor]) -> None:
        """Write KV tensors back into the buffers (a no-op for views of them: crops and the slot
        layer's in-place gathers)."""
        if not tensors:
            self._live = (0, 0)
            return
        B, S = int(tensors[0].shape[0]), int(tensors[0].shape[2])
        self._ensure(B, S)
        self._live = (B, S)
        bufs = [t for lay in zip(self.cache.keys, self.cache.values) for t in lay]
        for buf, t in zip(bufs, tensors):
            if t.data_ptr() != buf.data_ptr() or t.stride() != buf.stride():
                buf[:B, :, :S].copy_(t)

    def _reset_kv(self, rows: int) -> None:
        self._live = (0, 0)
        self._ensure(rows, self.slots.slots + HEADROOM)

    def _kept_kv(self) -> list[torch.Tensor]:
        """The running rows' KV held apart while new rows prefill into the same buffers."""
        return [t.clone() for t in self.kv]

    # ---- masks: the live-slot flags go to the device, not a float mask ------------------------------
    def _forward_mask(self, ancestors: torch.Tensor) -> _Mask:
        past, anc = self.slots.forward_visibility(upload(ancestors, self.device))  # [n, n], or [B, n, n]
        past_pos = self.slots.pos[:, : past.shape[1]]
        return _Mask(past, anc, upload(past_pos, self.device) if self.layout.window else None)

    def _prefill_mask(self, start: int, end: int) -> torch.Tensor:
        """A prompt chunk's mask (left padding as holes): the slot layer's, as booleans, on the
        device (once per request)."""
        return upload(self.slots.prefill_mask(start, end, torch.float32) == 0, self.device)

    def _key_positions(self, mask: Any, pos: torch.Tensor, S: int) -> torch.Tensor | None:
        """Each slot's position [Bb, capacity] (-1: never a key) for a sliding-window layout: the past's,
        then this forward's nodes' (``pos``, padded; a prefill's padding holds 0 there, masked)."""
        if not self.layout.window:
            return None
        Bb, Nb = pos.shape
        out = torch.full((Bb, self.cache.capacity), -1, dtype=torch.long, device=self.device)
        if isinstance(mask, _Mask) and mask.past_pos is not None:
            out[: mask.past_pos.shape[0], :S] = mask.past_pos
        out[:, S:S + Nb] = pos
        return out

    def _build(self, mask: Any, B: int, n: int, S: int, Bb: int, Nb: int) -> torch.Tensor:
        """The step's boolean mask [Bb, 1, Nb, capacity]: past slots, then the new nodes' own
        visibility; padding queries see their own slot only. Full attention's: the step cuts the
        sliding layers' to their window (``hf_compat.MaskLayout``)."""
        cap = self.cache.capacity
        out = torch.zeros(Bb, 1, Nb, cap, dtype=torch.bool, device=self.device)
        if isinstance(mask, _Mask):
            out[:B, 0, :n, :S] = mask.past[:, None, :]
            out[:B, 0, :n, S:S + n] = mask.ancestors
        else:  # a full prefill mask [B, 1, n, S + n]
            out[:B, :, :n, : mask.shape[-1]] = mask
        if Bb > B or Nb > n:
            own = torch.arange(Nb, device=self.device)
            pad = torch.ones(Bb, Nb, dtype=torch.bool, device=self.device)
            pad[:B, :n] = False
            out[:, 0, own, S + own] |= pad
        if self._additive:
            return torch.zeros(out.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~out, torch.finfo(self.dtype).min)
        return out

    # ---- the engine call ------------------------------------------------------------------------------
    def _call(self, ids: torch.Tensor, pos: torch.Tensor, mask: Any, want_hidden: Want, prefill: bool) -> StepOutput:
        B, n = ids.shape
        S = self.slots.slots - n if not prefill else 0
        compiled = self.fixed_shapes and not prefill and n <= WIDTH_BUCKETS[-1]
        Bb, Nb = (bucket(B, ROW_BUCKETS), bucket(n, WIDTH_BUCKETS)) if compiled else (B, n)
        self._ensure(Bb, S + Nb)
        self.cache.seek(S)
        m = self._build(mask, B, n, S, Bb, Nb)
        # always new tensors made here (inference tensors: a graph guards on that too), padded to the bucket
        ids = torch.nn.functional.pad(upload(ids, self.device), (0, Nb - n, 0, Bb - B))
        pos = torch.nn.functional.pad(upload(pos, self.device), (0, Nb - n, 0, Bb - B))
        k_pos = self._key_positions(mask, pos, S)
        before = self.cache.updates
        if compiled:
            if want_hidden not in self._steps:
                self._steps[want_hidden] = FixedSteps(
                    lambda i, p, mm, kp, w=want_hidden: self._eager(i, p, mm, kp, w),
                    self.step_mode, len(ROW_BUCKETS) * len(WIDTH_BUCKETS) * 4)
            logits, feats = self._steps[want_hidden](ids, pos, m, k_pos)
        else:  # a prefill asks for its last position's logits only (hidden states stay per position)
            logits, feats = self._eager(ids, pos, m, k_pos, want_hidden, last_only=prefill)
        if not compiled and self.cache.updates != before + self._layers:
            raise RuntimeError(f"{type(self.model).__name__} did not write into the static KV cache it was given "
                               f"({self.cache.updates - before} of {self._layers} layers): this transformers "
                               "version takes the cache under a keyword this runtime does not pass")
        self._live = (B, S + n)
        return StepOutput(logits[:B, -1:] if prefill else logits[:B, :n], feats[:B, :n] if feats is not None else None)

    def _eager(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, k_pos: torch.Tensor | None,
               want_hidden: Want, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward over the buffers (``last_only``: logits of the last position, a prefill's)."""
        kwargs: dict[str, Any] = dict(input_ids=ids, position_ids=pos, use_cache=True,
                                      attention_mask=self.layout.masks(mask, pos, k_pos))
        return self._model_call(kwargs, self.cache, want_hidden, last_only)
