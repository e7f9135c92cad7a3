"""Parallel drafting: one drafter forward drafts a whole block (``heads/parallel.py``).

Each round: (1) the catch-up feeds last round's committed pairs into the drafter's cache, exactly
as EAGLE's does, and its last query predicts depth 0; (2) one fixed-shape forward of the K-1
block queries after it (each reading the anchor's feature), then the block layers if the drafter
has them, gives the marginals of depths 1..K-1; (3) the candidates are every path through the
per-depth top-k, scored by the product of the marginals (DDTree's best-first tree,
``eagle_tree.marginal_candidates``), laid over the shape the host chose and priced by the policy
exactly as EAGLE's tree is. So a round costs two drafter forwards whatever the depth (and the block
layers over K rows; a long joining prompt catches up in a forward of its own: ``eagle.backlog_groups``),
where EAGLE's costs one per depth; nothing is read back to the host while drafting.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from spec_plugins.fixed_steps import ROW_BUCKETS, FixedSteps, Mode
from spec_plugins.heads.parallel import ParallelDrafter
from spec_plugins.heads.runner import OrtBlockRefiner, OrtEagleLayer, head_session
from spec_plugins.proposers.eagle import EagleProposer
from spec_plugins.proposers.eagle_tree import Candidates, marginal_candidates
from spec_plugins.registry import register_proposer
from spec_plugins.slots import additive


@register_proposer("parallel")
class ParallelProposer(EagleProposer):
    drafter_class = ParallelDrafter

    class Config(EagleProposer.Config):
        type: Literal["parallel"] = "parallel"  # type: ignore[assignment]
        heads: str = Field(description="Directory of a trained parallel drafter (head.safetensors + config.json), "
                                       "from `spec-plugins train parallel`.")

    def __init__(self, config: "ParallelProposer.Config", target: Any = None, drafter: ParallelDrafter | None = None,
                 step_mode: Mode | None = None, **_: object) -> None:
        super().__init__(config, target=target, drafter=drafter, step_mode=step_mode)
        if not isinstance(self.drafter, ParallelDrafter):
            raise ValueError(f"parallel needs a parallel drafter, got {type(self.drafter).__name__}")
        self.max_depth = self.drafter.config.block_size
        self.refiner: Any = self.drafter.refiner  # the block layers, in PyTorch or ONNX Runtime (or None)
        if self.refiner is not None and isinstance(self.layer, OrtEagleLayer):
            self.refiner = OrtBlockRefiner(head_session(self.refiner, target))
        # rows in the verify step's buckets: the block forward mixes no rows and writes no cache
        self._block_step = FixedSteps(self._block_fixed, self.step_mode, row_buckets=ROW_BUCKETS)

    def _candidates(self, f: torch.Tensor, base: torch.Tensor, depth: int, top_k: int) -> Candidates:
        """Depth 0 from the anchor's output ``f`` [B, H]; depths 1..depth-1 from one block forward
        (always all K-1 block queries: one shape), conditioned on depth 0's top-1."""
        d = self.drafter
        logq = d.logits(f).float().log_softmax(-1)[:, None]  # [B, 1, Vd]
        if depth > 1:
            feat, tok, pos = d.block_query(self._anchor, d.vocab_ids[logq[:, 0].argmax(-1)], base - 1)
            feat = feat.to(self.dtype)
            f = f.to(self.dtype)
            if self.step_mode == "eager":
                out = self._block_fixed(feat, tok, pos, f, self.k, self.v, self._past, self.layer, self.refiner)
            else:
                out = self._block_step(feat, tok, pos, f, *self._padded)
            logq = torch.cat([logq, d.logits(out[:, : depth - 1]).float().log_softmax(-1)], 1)
        return marginal_candidates(logq, d.vocab_ids, top_k)

    def _block_fixed(self, feat: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, depth0: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, past: torch.Tensor, layer: Any = None, refiner: Any = None
                     ) -> torch.Tensor:
        """The block forward as a function of tensors only (what is compiled or captured): block
        queries see the live cached pairs (``past`` [B, S]) and, causally, each other; then the
        block layers over the anchor's output ``depth0`` [B, H] and theirs."""
        B, n = tok.shape
        seen = past[:, None, None, :].expand(B, 1, n, past.shape[1])
        causal = torch.ones(n, n, dtype=torch.bool, device=tok.device).tril().expand(B, 1, n, n)
        out, _, _ = (layer or self.drafter)(feat, tok, pos, k, v, additive(torch.cat([seen, causal], -1), self.dtype))
        return self.drafter.refine(depth0, out, refiner, pos[:, 0] - 1, k, v, past)
