"""PyTorch runtime over transformers causal LMs (CPU here, CUDA where present).

KV layout: one transformers ``DynamicCache`` with a shared slot axis for the whole batch plus
``pos [B, S]``, the position of each slot (-1 = a hole: left padding, a rejected tree node, or a
token another row did not keep). Holes are masked out with a 4D additive attention mask, so rows
can accept different numbers of tokens without moving the cache. Fast path: one row, no holes,
a chain -> no mask at all (the model's own causal path). ``commit`` compacts only the tail
written by the last forward (O(draft) per round), ``rollback`` crops.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from spec_plugins.backends import torch_kernels
from spec_plugins.backends.kv_slots import keep_index
from spec_plugins.backends.base import RuntimeCapabilities, StepOutput
from spec_plugins.config import RuntimeConfig
from spec_plugins.registry import register_backend
from spec_plugins.tree import TreeLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    return dev


def load_hf(model: str, dtype: str = "float32", device: str = "auto") -> tuple[Any, Any]:
    """Load a transformers model + tokenizer from a built-in name, .gguf path or local dir.

    A GGUF is dequantised by transformers once (tens of seconds, mostly the tokenizer
    conversion) and then cached as a transformers directory (see ``models.converted_dir``)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_plugins.models import converted_dir, resolve_model

    src = resolve_model(model)
    path, kwargs = str(src.directory), src.hf_kwargs()
    cached = converted_dir(src) if src.gguf_file else None
    if cached is not None and (cached / "config.json").exists():
        path, kwargs = str(cached), {}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], **kwargs)
    if cached is not None and kwargs:
        _save_converted(m, tok, cached)
    m.to(pick_device(device)).eval()
    return m, tok


def _save_converted(model: Any, tok: Any, target: Any) -> None:
    """Write the dequantised model atomically (a partial directory is never left behind)."""
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent, prefix=".tmp-")
    try:
        from safetensors.torch import save_model

        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the weights are plain floats now
        import json
        from pathlib import Path

        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        os_replace(tmp, target)
    except Exception as exc:  # caching is an optimisation; never fail a load over it
        import warnings

        warnings.warn(f"could not cache the converted model in {target}: {exc}")
        shutil.rmtree(tmp, ignore_errors=True)


def os_replace(src: str, dst: Any) -> None:
    import os

    try:
        os.replace(src, dst)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(src, ignore_errors=True)


@register_backend("torch")
class TorchRuntime:
    """A transformers model with its own batched, hole-masked KV cache."""

    class Config(RuntimeConfig):
        backend: Literal["torch"] = "torch"
        dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights/activations dtype.")
        device: str = Field("auto", description="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1' ...")
        threads: int | None = Field(None, ge=1, description="torch intra-op threads (None = torch default).")
        max_context: int | None = Field(None, ge=1, description="Override the model's context length.")
        matmul: Literal["auto", "auto_transposed", "native"] = Field(
            "auto", description="'auto': on CPU, time F.linear against weight@x.T per row count (1-16) at "
            "load and use the faster inside this runtime (see backends/torch_kernels.py); 'auto_transposed': "
            "also try x@W.T on a transposed copy of each weight for one row (2x weight memory); 'native': F.linear.")

    @classmethod
    def from_config(cls, config: "TorchRuntime.Config") -> "TorchRuntime":
        if config.threads:
            torch.set_num_threads(config.threads)
        model, tok = load_hf(config.model, config.dtype, config.device)
        return cls(model, tok, max_context=config.max_context, matmul=config.matmul)

    def __init__(self, model: Any, tokenizer: Any = None, max_context: int | None = None,
                 matmul: Literal["auto", "auto_transposed", "native"] = "auto") -> None:
        self.model = model
        # measured few-row kernel choice, active only inside _run (None: stock F.linear)
        self.kernels = (torch_kernels.tune(model, transposed=matmul == "auto_transposed")
                        if matmul != "native" else None)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        cfg = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(max_context or getattr(cfg, "max_position_embeddings", 2048))
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=True, batch=True, name="torch")
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self.cache: Any = None
        self.pos = torch.empty(0, 0, dtype=torch.long)
        self._next: list[int] = []
        self._holes = False
        self._tail: tuple[int, int] | None = None  # (slots before last forward, its size)
        self._before: list[int] = []  # per-row lengths before the last forward

    # ---- model call ----------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
             want_hidden: bool, last_only: bool = False) -> StepOutput:
        from transformers import DynamicCache

        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        ids = ids.to(self.device)
        kwargs: dict[str, Any] = dict(input_ids=ids, position_ids=pos.to(self.device), cache=self.cache, use_cache=True)
        if mask is not None:
            kwargs["attention_mask"] = mask
        with torch_kernels.active() if self.kernels is not None else contextlib.nullcontext():
            if not want_hidden:
                if last_only:
                    kwargs["logits_to_keep"] = 1
                out = self.model(**kwargs)
                return StepOutput(out.logits.float())
            base = self.model.get_decoder()
            h = base(**kwargs).last_hidden_state
            logits = self.model.get_output_embeddings()(h[:, -1:] if last_only else h).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return StepOutput(logits, h)

    def _mask(self, new_pos: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
        """Additive mask [B, 1, N, S+N]: past slots that are not holes + ancestors in the tree."""
        B, N = new_pos.shape
        past_ok = (self.pos >= 0)[:, None, None, :].expand(B, 1, N, self.pos.shape[1])
        new_ok = anc[None, None].expand(B, 1, N, N).to(past_ok.device)
        ok = torch.cat([past_ok, new_ok], dim=-1)
        neg = torch.finfo(self.dtype).min
        return torch.zeros(ok.shape, dtype=self.dtype).masked_fill_(~ok, neg).to(self.device)

    # ---- Runtime contract -----------------------------------------------------------------
    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prefill needs at least one token per row")
        longest = max(len(r) for r in rows)
        if longest > self.max_context:
            raise ValueError(f"prompt of {longest} tokens exceeds the context of {self.max_context}")
        self.cache = None
        B = len(rows)
        ids = torch.zeros(B, longest, dtype=torch.long)
        pos = torch.full((B, longest), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            off = longest - len(r)  # left padding
            ids[b, off:] = torch.as_tensor(list(r), dtype=torch.long)
            pos[b, off:] = torch.arange(len(r))
        self.pos = torch.empty(B, 0, dtype=torch.long)
        self._holes = bool((pos < 0).any())
        mask = None
        if self._holes:
            anc = torch.ones(longest, longest, dtype=torch.bool).tril()
            # a padding query attends to itself only, keeping softmax finite
            m_ok = anc[None].expand(B, longest, longest) & (pos >= 0)[:, None, :]
            m_ok = m_ok | torch.eye(longest, dtype=torch.bool)[None]
            neg = torch.finfo(self.dtype).min
            mask = torch.zeros(B, 1, longest, longest, dtype=self.dtype).masked_fill_(~m_ok[:, None], neg)
            mask = mask.to(self.device)
        out = self._run(ids, pos.clamp_min(0), mask, want_hidden, last_only=True)
        self.pos = pos
        self._next = [len(r) for r in rows]
        self._tail = None
        return out

    def forward(self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: bool = False) -> StepOutput:
        B, N = tokens.shape
        depth = tree.depth if tree is not None else torch.arange(N)
        new_pos = torch.tensor(self._next, dtype=torch.long)[:, None] + depth[None, :]
        if int(new_pos.max()) >= self.max_context:
            raise ValueError(f"position {int(new_pos.max())} exceeds the context of {self.max_context}")
        chain = tree is None or tree.is_chain
        mask = None
        if self._holes or not chain:
            anc = tree.ancestors if tree is not None else torch.ones(N, N, dtype=torch.bool).tril()
            mask = self._mask(new_pos, anc)
        S = self.pos.shape[1]
        out = self._run(tokens, new_pos, mask, want_hidden)
        self.pos = torch.cat([self.pos, new_pos], dim=1)
        self._tail = (S, N)
        self._before = list(self._next)
        self._next = [n + int(depth.max()) + 1 for n in self._next]
        return out

    @torch.inference_mode()
    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        if self._tail is None:
            raise RuntimeError("commit() without a preceding forward()")
        S, N = self._tail
        self._tail = None
        counts = [len(k) for k in keep]
        m = max(counts)
        # Fast path: every row keeps the same leading nodes -> plain crop.
        self._next = [n + c for n, c in zip(self._before, counts)]
        if all(list(k) == list(range(len(k))) for k in keep) and len(set(counts)) == 1:
            self._crop(S + m)
            return
        idx, tail_pos = keep_index(keep, self.pos[:, S:])
        gidx = idx.to(self.device)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                g = gidx[:, None, :, None].expand(t.shape[0], t.shape[1], m, t.shape[3])
                tail = t[:, :, S:].gather(2, g)
                t = t[:, :, : S + m]
                t[:, :, S:] = tail
                setattr(layer, name, t)
        self.pos = torch.cat([self.pos[:, :S], tail_pos], dim=1)
        self._holes = bool((self.pos < 0).any())

    def _crop(self, slots: int) -> None:
        if self.cache is not None:
            remove = self.pos.shape[1] - slots
            if remove > 0:
                self.cache.crop(-remove)
        self.pos = self.pos[:, :slots]
        self._holes = bool((self.pos < 0).any())

    @torch.inference_mode()
    def rollback(self, lengths: Sequence[int]) -> None:
        self._tail = None
        lim = torch.tensor(list(lengths), dtype=torch.long)[:, None]
        self.pos = torch.where(self.pos < lim, self.pos, torch.full_like(self.pos, -1))
        live = (self.pos >= 0).any(0).nonzero()
        keep_slots = int(live.max()) + 1 if live.numel() else 0
        self._crop(keep_slots)
        self._next = [min(n, int(L)) for n, L in zip(self._next, lengths)]

    def lengths(self) -> list[int]:
        return list(self._next)

    @torch.inference_mode()
    def select_rows(self, rows: Sequence[int]) -> None:
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        if self.cache is not None:
            dev_idx = idx.to(self.device)
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.numel():
                    layer.keys = layer.keys[dev_idx]
                    layer.values = layer.values[dev_idx]
        self.pos = self.pos[idx]
        self._next = [self._next[r] for r in rows]
        self._holes = bool((self.pos < 0).any())
        live = (self.pos >= 0).any(0).nonzero()
        if live.numel() and int(live.max()) + 1 < self.pos.shape[1]:
            self._crop(int(live.max()) + 1)

    @torch.inference_mode()
    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        """Prefill ``rows`` into the running batch (continuous batching); they become the last rows.

        The new rows are prefilled in a cache of their own, then both caches are left-padded with
        holes (pos = -1) to the same slot count and concatenated along the batch axis. Output as
        ``prefill``, for the new rows only. With no running rows this is ``prefill``."""
        if self.cache is None or not self._next:
            return self.prefill(rows, want_hidden)
        if self._tail is not None:
            raise RuntimeError("add_rows() between forward() and commit()")
        old_cache, old_pos, old_next = self.cache, self.pos, self._next
        out = self.prefill(rows, want_hidden)
        new_cache, new_pos = self.cache, self.pos
        S = max(old_pos.shape[1], new_pos.shape[1])

        def pad(t: torch.Tensor, s: int) -> torch.Tensor:  # left-pad the slot axis (dim 2) with zeros
            if t.shape[2] == s:
                return t
            z = t.new_zeros(t.shape[0], t.shape[1], s - t.shape[2], t.shape[3])
            return torch.cat([z, t], dim=2)

        for lo, ln in zip(old_cache.layers, new_cache.layers):
            lo.keys = torch.cat([pad(lo.keys, S), pad(ln.keys, S)], dim=0)
            lo.values = torch.cat([pad(lo.values, S), pad(ln.values, S)], dim=0)

        def pad_pos(p: torch.Tensor) -> torch.Tensor:
            return torch.cat([torch.full((p.shape[0], S - p.shape[1]), -1, dtype=torch.long), p], dim=1)

        self.cache = old_cache
        self.pos = torch.cat([pad_pos(old_pos), pad_pos(new_pos)], dim=0)
        self._next = list(old_next) + list(self._next)
        self._holes = bool((self.pos < 0).any())
        self._tail = None
        return out
