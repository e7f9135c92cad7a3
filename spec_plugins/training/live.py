"""Target features computed when the trainer asks for a shard, instead of read from disk.

On a GPU the target's prefill is far cheaper than storing its features: SmolLM2-135M's fused
layers are 4.6 KB per token in fp16, 90 GB for 20M tokens, while the forward runs at hundreds of
thousands of tokens per second. ``LiveFeatures`` is a ``features.ShardSource`` over token shards
(``tokens.TokenStore``): plans, draft vocabularies and batches read the token arrays; ``load(i)``
runs the target over shard i in big right-padded batches (``features.batch_outputs``) and returns
a ``features.Shard`` on the target's device, so ``train_eagle`` / ``train_medusa`` stream it
exactly as they stream shards from disk, one in memory at a time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

from spec_plugins.training.features import Shard, batch_outputs, compact
from spec_plugins.training.tokens import TokenStore


def length_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Conversation indices grouped for right-padded prefill: longest first, each batch at most
    ``max_tokens`` padded positions (a single longer conversation goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class LiveFeatures:
    """A ``ShardSource`` whose features are the target's outputs, computed per shard on demand."""

    def __init__(self, tokens: TokenStore, model: Any, layers: Sequence[int], target: str,
                 prefill_tokens: int = 65536) -> None:
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be positive, got {prefill_tokens}")
        self.source, self.model, self.layers = tokens, model, tuple(layers)
        self.prefill_tokens = prefill_tokens
        self.directory: Path = tokens.directory
        self.shards: list[Path] = tokens.shards
        dtype = next(model.parameters()).dtype
        self.meta: dict = {**tokens.meta, "target": target, "layers": list(self.layers), "features": "live",
                           "dtype": str(dtype).removeprefix("torch.")}
        self.seconds = 0.0  # spent computing features, synchronised with the device
        self.extracted = 0  # tokens the target ran over (a shard loaded twice counts twice)
        self.loads = 0

    @property
    def tokens(self) -> int:
        return self.source.tokens

    def read(self, i: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.source.read(i, names)

    def load(self, i: int) -> Shard:
        """Shard i with the target's features, on the target's device."""
        dev = next(self.model.parameters()).device
        t0 = time.perf_counter()
        arrays = self.source.read(i, ("tokens", "trained", "offsets"))
        tokens, offsets = arrays["tokens"], arrays["offsets"]
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        n = int(offsets[-1])
        H = int(self.model.config.hidden_size)
        # stored as feature shards on disk are (features.compact): a bf16 target's outputs as they
        # are, others in fp16 until a batch passes its range
        hdt = torch.bfloat16 if next(self.model.parameters()).dtype == torch.bfloat16 else torch.float16
        hidden = torch.empty(n, H, dtype=hdt, device=dev)
        layers = torch.empty(n, len(self.layers), H, dtype=hdt, device=dev)
        lse = torch.empty(n, dtype=torch.float32, device=dev)
        top1 = torch.empty(n, dtype=torch.long, device=dev)
        for rows in length_batches(lengths, self.prefill_tokens):
            T = lengths[rows[0]]
            ids = torch.zeros(len(rows), T, dtype=torch.long)
            flat = []
            for r, c in enumerate(rows):
                a, b = int(offsets[c]), int(offsets[c + 1])
                ids[r, : b - a] = tokens[a:b]
                flat.append(torch.arange(a, b))
            idx = torch.cat(flat).to(dev)
            out = batch_outputs(self.model, ids.to(dev), [lengths[c] for c in rows], self.layers)
            hidden = _put(hidden, idx, out["hidden"])
            layers = _put(layers, idx, out["layers"])
            lse[idx] = out["lse"]
            top1[idx] = out["top1"]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.seconds += time.perf_counter() - t0
        self.extracted += n
        self.loads += 1
        return Shard(tokens.to(dev), arrays["trained"].to(dev), offsets.to(dev), hidden, layers, lse, top1)


def _put(buf: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``buf`` with rows ``idx`` set to ``values`` in the dtype that holds them (``compact``): an
    fp16 buffer is widened to bf16 once values pass fp16's range, instead of storing inf."""
    values = values if buf.dtype == torch.bfloat16 else compact(values)  # rounded once
    if values.dtype == torch.bfloat16 and buf.dtype == torch.float16:
        buf = buf.to(torch.bfloat16)
    buf[idx] = values.to(buf.dtype)
    return buf
