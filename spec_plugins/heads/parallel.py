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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from spec_plugins.heads.eagle import EagleConfig, EagleDrafter


@dataclass(frozen=True)
class ParallelConfig(EagleConfig):
    block_size: int = 6  # draft positions per round: depth 0 from the anchor, 1..K-1 from the block
    mask_token: int = 0  # the token id block queries 1..K-2 read (any fixed id: see the module docstring)
    anchor_input: bool = True  # block queries read the anchor's feature plus their offset (else the offset)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (depth 0 and one block query), got {self.block_size}")

    def to_dict(self) -> dict:
        return {"kind": "parallel", **asdict(self)}


class ParallelDrafter(EagleDrafter):
    """``EagleDrafter`` plus the block queries' learned inputs (module docstring)."""

    config_class = ParallelConfig
    kind = "parallel"

    def __init__(self, config: ParallelConfig, lm_weight: torch.Tensor, embed_weight: torch.Tensor,
                 vocab_ids: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, lm_weight, embed_weight, vocab_ids, dtype)
        H = config.hidden_size
        w = torch.randn(config.block_size - 1, H, device=self.fuse.weight.device) * H ** -0.5
        self.block_inputs = nn.Parameter(w.to(self.fuse.weight.dtype))

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
