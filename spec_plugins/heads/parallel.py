"""Parallel drafter: the EAGLE-3 layer, drafting a whole block in one forward.

The anchor query (the last committed pair (f_j, x_{j+1}), fed by the catch-up) predicts depth 0,
as EAGLE does. Depths 1..K-1 come from one more forward over K-1 *block queries* at the next
positions, whose inputs are unknown at drafting time: each block query i reads the anchor's own
(projected) target feature plus a learned offset ``block_inputs[i]`` in place of its feature, and
a token: block query 0 reads the depth-0 draft (the drafter's own top-1), the others a fixed
``mask_token`` (its embedding is absorbed by the offset: ``fuse`` is linear in both). The anchor's
feature is the richest summary of the context there is; without it (``anchor_input`` off: the
offsets alone) one layer's attention must recover that summary from the cache (the ablation in
docs/training.md).
Block queries attend to the drafter's cache of
committed pairs and causally to each other, never to one another's drafts, so the block's output
is K-1 marginals, one per position, from one fixed-shape forward (PARD's mask tokens over EAGLE-3's
fused features). The layer is ``EagleDrafter``'s, so its ONNX graph is the same graph.

One layer sees the block's own inputs only, so a query two ahead must infer the token in between
in one attention. ``block_layers`` adds that many decoder layers over the block alone: the
anchor's output (depth 0) and the K-1 block outputs attend to each other, with no cache (so the
catch-up is unchanged and a round is still two drafter forwards). Their output projections start
at zero, so a deeper drafter starts as exactly the one-layer drafter it is trained from.

With ``block_context`` the block layers also see the context, as DFlash's layers do: each keeps
keys and values of the committed pairs, made from the drafter layer's output there (the same kind
of row the block layers refine, at its own position), and its block rows attend to them. They live
in the drafter's one cache, stacked after the layer's own heads (``cache_heads``), so the catch-up
writes them in the same forward and every cache operation (rows, holes, padding) covers them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from spec_plugins.heads.common import config_flag, config_number
from spec_plugins.heads.eagle import EagleConfig, EagleDrafter, add_decoder_weights, decoder_block, layer_kv
from spec_plugins.slots import additive


@dataclass(frozen=True)
class ParallelConfig(EagleConfig):
    block_size: int = 6  # draft positions per round: depth 0 from the anchor, 1..K-1 from the block
    mask_token: int = 0  # the token id block queries 1..K-2 read (any fixed id: see the module docstring)
    anchor_input: bool = True  # block queries read the anchor's feature plus their offset (else the offset)
    block_layers: int = 0  # decoder layers over the block (the anchor's output and the block outputs)
    block_context: bool = False  # the block layers also attend to the committed pairs (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("block_size", "block_layers", "mask_token"):  # their ranges: below
            object.__setattr__(self, name, config_number(name, getattr(self, name), True, least=None))
        for name in ("anchor_input", "block_context"):
            config_flag(name, getattr(self, name))
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (depth 0 and one block query), got {self.block_size}")
        if not 0 <= self.block_layers <= 16:
            raise ValueError(f"block_layers must be 0..16, got {self.block_layers}")
        if self.block_context and not self.block_layers:
            raise ValueError("block_context needs block layers (block_layers >= 1): they attend to the context")
        if self.mask_token < 0:
            raise ValueError(f"mask_token must be a token id (>= 0), got {self.mask_token}")

    @property
    def cache_heads(self) -> int:
        """The drafter layer's key/value heads, then each block layer's with ``block_context``."""
        return self.num_kv_heads * (1 + (self.block_layers if self.block_context else 0))

    def to_dict(self) -> dict:
        return {"kind": "parallel", **asdict(self)}


class BlockLayer(nn.Module):
    """One decoder layer over the block (``add_decoder_weights``), output projections zeroed."""

    def __init__(self, config: ParallelConfig, fk: dict) -> None:
        super().__init__()
        add_decoder_weights(self, config, fk)
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.down.weight)


class BlockRefiner(nn.Module):
    """forward(x [B, T, H]: anchors' outputs and their block outputs) -> [B, T, H]: the
    ``block_layers`` layers. Without context every row sees every other at positions 0..T-1
    (rotary attention depends only on differences, which are the block's own). With context:
    forward(x, positions [B, T], past_key / past_value [B, L*kv, S, d] (each layer's keys of the
    committed pairs, ``context``), additive mask [B, 1, T, S+T])."""

    kind = "block_refiner"

    def __init__(self, config: ParallelConfig, fk: dict) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(BlockLayer(config, fk) for _ in range(config.block_layers))

    def context(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's keys and values of committed rows x [B, T, H] at ``positions`` [B, T],
        stacked along heads: [B, L*kv, T, d] twice."""
        kvs = [layer_kv(layer, self.config, layer.in_norm(x), positions) for layer in self.layers]
        return torch.cat([k for k, _ in kvs], 1), torch.cat([v for _, v in kvs], 1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, past_k: torch.Tensor | None = None,
                past_v: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.config
        if past_k is None or past_v is None:
            positions = torch.arange(T, device=x.device).expand(B, T)
            past_k = past_v = x.new_zeros(B, c.num_kv_heads * len(self.layers), 0, c.head_dim)
        kv = c.num_kv_heads
        for i, layer in enumerate(self.layers):
            part = slice(i * kv, (i + 1) * kv)
            x = decoder_block(layer, c, x, positions, past_k[:, part], past_v[:, part], mask)[0]
        return x


class ParallelDrafter(EagleDrafter):
    """``EagleDrafter`` plus the block queries' learned inputs (module docstring)."""

    config_class = ParallelConfig
    kind = "parallel"

    def __init__(self, config: ParallelConfig, lm_weight: torch.Tensor, embed_weight: torch.Tensor,
                 vocab_ids: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        if config.mask_token >= embed_weight.shape[0]:  # block queries embed it on every draft
            raise ValueError(f"mask_token {config.mask_token} is outside this target's vocabulary of "
                             f"{embed_weight.shape[0]} tokens")
        super().__init__(config, lm_weight, embed_weight, vocab_ids, dtype)
        H = config.hidden_size
        w = torch.randn(config.block_size - 1, H, device=self.fuse.weight.device) * H ** -0.5
        self.block_inputs = nn.Parameter(w.to(self.fuse.weight.dtype))
        fk = dict(device=self.fuse.weight.device, dtype=self.fuse.weight.dtype)
        self.refiner = BlockRefiner(config, fk) if config.block_layers else None

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``EagleDrafter.forward`` over the cache's first heads; with ``block_context`` the new
        keys and values also hold each block layer's of the output rows (module docstring)."""
        if not self.config.block_context:
            return super().forward(features, tokens, positions, past_k, past_v, mask)
        kv = self.config.num_kv_heads
        out, k, v = super().forward(features, tokens, positions, past_k[:, :kv], past_v[:, :kv], mask)
        ck, cv = self.refiner.context(out, positions)
        return out, torch.cat([k, ck], 1), torch.cat([v, cv], 1)

    def refine(self, depth0: torch.Tensor, block: torch.Tensor, refiner: Any = None, base: torch.Tensor | None = None,
               keys: torch.Tensor | None = None, values: torch.Tensor | None = None, seen: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The block layers over the anchors' outputs ``depth0`` [B, (S,) H] and their blocks'
        outputs ``block`` [B, (S,) n, H] -> the blocks' refined outputs (``refiner``: where the
        layers run, default here); the block unchanged without block layers. With
        ``block_context``: the anchors' positions ``base`` [B, (S)], the drafter's cache ``keys``
        / ``values`` [B, cache_heads, P, d] and which cached pairs each anchor sees, ``seen``
        [B, (S,) P]; each anchor's rows see those and each other."""
        if self.refiner is None:
            return block
        run = refiner or self.refiner
        z = torch.cat([depth0[..., None, :].to(block.dtype), block], -2)
        if not self.config.block_context:
            lead = z.shape[:-2]
            out = run(z.reshape(-1, *z.shape[-2:]))
            return out.view(*lead, *z.shape[-2:])[..., 1:, :]
        if base is None or keys is None or values is None or seen is None:
            raise ValueError("a drafter with block_context refines with the cache: base, keys, values and seen")
        one = z.dim() == 3  # one anchor per row (drafting)
        if one:
            z, base, seen = z[:, None], base[:, None], seen[:, None]
        B, S, m, H = z.shape
        pos = (base[..., None] + torch.arange(m, device=z.device)).reshape(B, S * m)
        own = torch.eye(S, dtype=torch.bool, device=z.device).repeat_interleave(m, 0).repeat_interleave(m, 1)
        ok = torch.cat([seen[:, :, None].expand(B, S, m, seen.shape[-1]).reshape(B, S * m, -1),
                        own.expand(B, -1, -1)], -1)
        kv = self.config.num_kv_heads
        out = run(z.reshape(B, S * m, H), pos, keys[:, kv:], values[:, kv:], additive(ok[:, None], z.dtype))
        out = out.view(B, S, m, H)[..., 1:, :]
        return out[:, 0] if one else out

    @property
    def block(self) -> int:
        """Block queries per round (depths 1..K-1)."""
        return self.config.block_size - 1

    def block_query(self, anchor: torch.Tensor, first: torch.Tensor, base: torch.Tensor, count: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs of the block queries after anchor queries at positions ``base`` [...] (the last
        committed pair's; the pending token sits at base + 1) whose projected features are
        ``anchor`` [..., H]: features [..., n, H], tokens [..., n] (``first`` [...], the depth-0
        token, then the mask token) and positions [..., n] = base + 1 + i, for the first ``count``
        (default all) block queries."""
        n = self.block if count is None else count
        lead = first.shape
        offsets = self.block_inputs[:n].to(anchor.dtype)
        feat = anchor[..., None, :] + offsets if self.config.anchor_input else offsets.expand(*lead, n, -1)
        tok = torch.full((*lead, n), self.config.mask_token, dtype=torch.long, device=first.device)
        tok[..., 0] = first
        pos = base[..., None] + 1 + torch.arange(n, device=base.device)
        return feat, tok, pos
