"""Medusa: K trained heads read the target's hidden state at the last committed token and
propose the tokens 2..K+1 ahead (the pending token is the target's own next token). Tree mode
verifies a static tree of top-k candidates per head (chosen from the heads' holdout rank
accuracies, Medusa's construction); chain mode drafts each head's top-1.

Drafts are deterministic (top-k), so they are point masses (``probs=None``): the verifier's
point-mass rules keep sampling exact, and sibling tokens (distinct ranks of one head) are distinct.
"""

from __future__ import annotations

import math
from importlib.resources import files
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from spec_plugins.config import ProposerConfig
from spec_plugins.fixed_steps import ROW_BUCKETS, FixedSteps
from spec_plugins.heads.medusa import MedusaHeads
from spec_plugins.heads.runner import OrtMedusaHeads, head_session, pick_engine
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer
from spec_plugins.registry import register_proposer
from spec_plugins.tree import best_static_tree


SHIPPED_HEADS = "examples/heads/"


def resolve_head_dir(path: str) -> Path:
    """A head directory as given, or, for ``examples/heads/...`` not found from the working
    directory, the shipped head of that name (the ``spec_plugins.shipped_heads`` package, which
    is ``examples/heads`` in the source tree and in a wheel install alike)."""
    p = Path(path).expanduser()
    if not p.exists() and p.as_posix().startswith(SHIPPED_HEADS):
        alt = Path(str(files("spec_plugins.shipped_heads").joinpath(p.as_posix()[len(SHIPPED_HEADS):])))
        if alt.exists():
            return alt
    return p


@register_proposer("medusa")
class MedusaProposer(Proposer):
    needs_hidden = True

    class Config(ProposerConfig):
        type: Literal["medusa"] = "medusa"
        heads: str = Field(description="Directory of a trained head (head.safetensors + config.json), "
                                       "from `spec-plugins train medusa`.")
        mode: Literal["tree", "chain"] = Field("tree", description="Static top-k tree, or each head's top-1 chain.")
        tree_nodes: int = Field(16, ge=1, le=256, description="Tree mode: draft nodes per round.")
        top_k: int = Field(4, ge=1, le=32, description="Tree mode: candidates considered per head.")
        engine: Literal["auto", "torch", "onnxruntime"] = Field(
            "auto", description="Where the heads run; auto = ONNX Runtime when the target runs there, else PyTorch.")

    def __init__(self, config: "MedusaProposer.Config", target: Any = None, heads: MedusaHeads | None = None,
                 **_: object) -> None:
        self.config = config
        if heads is None:
            if target is None:
                raise ValueError("medusa needs the target (its LM head is shared with the heads)")
            heads = MedusaHeads.from_pretrained(str(resolve_head_dir(config.heads)), target)
        self.heads = heads.eval()
        vocab = self.heads.vocab_ids.numel()
        if config.mode == "tree" and config.top_k > vocab:
            raise ValueError(f"medusa: top_k={config.top_k} candidates per head, but the heads' draft vocabulary "
                             f"has {vocab} tokens; set top_k to at most {vocab}")
        self.run_heads: Any = self.heads  # the heads' forward, in PyTorch or ONNX Runtime
        if pick_engine(config.engine, target) == "onnxruntime":
            self.run_heads = OrtMedusaHeads(head_session(self.heads, target))
        else:  # compiled or captured where the target's verify step is, rows in its buckets (``fixed_steps``)
            self.run_heads = FixedSteps(self.heads, getattr(target, "step_mode", "eager"), row_buckets=ROW_BUCKETS)
        self.tree = config.mode == "tree"  # the decoder checks this against the runtime's tree support
        K = heads.config.num_heads
        acc = rank_accuracy(heads.calibration, K, config.top_k)
        self._tree = best_static_tree(acc, config.tree_nodes, max_depth=K)
        self.device = heads.lm_weight.device  # the target's: the heads were built there
        # the head that drafts each node (host: budgets are compared there) and its rank, for indexing logits
        self._depth_host = torch.tensor(self._tree.depths, dtype=torch.long, device="cpu")
        self._depth = self._depth_host.to(self.device)
        self._rank = torch.tensor(self._tree.ranks, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> Draft | None:
        if ctx.hidden is None:
            raise RuntimeError("medusa needs target hidden states (needs_hidden) but the loop passed none")
        budgets = torch.tensor(list(ctx.budgets), dtype=torch.long, device="cpu")  # host: decided there
        h = torch.stack([hb[-1] for hb in ctx.hidden]).to(self.heads.lm_weight)  # [B, H] at the last committed token
        logits = self.run_heads(h).to(self.device)  # [B, K, Vd]
        if not (self.tree and ctx.tree_ok):
            k = min(int(budgets.max()), logits.shape[1])
            if k <= 0:
                return None
            toks = self.heads.vocab_ids[logits[:, :k].argmax(-1)]  # [B, k]
            valid = torch.arange(k, device="cpu")[None, :] < budgets[:, None]
            return Draft(toks, tuple(range(-1, k - 1)), None, None if bool(valid.all()) else valid)  # host valid
        top = logits.topk(self.config.top_k, -1).indices  # [B, K, k]
        toks = self.heads.vocab_ids[top[:, self._depth, self._rank]]  # [B, n]
        valid = self._depth_host[None, :] < budgets[:, None]
        if not bool(valid.any()):
            return None
        return Draft(toks, self._tree.parents, None, None if bool(valid.all()) else valid)  # host valid


DEFAULT_RANK_RATIO = 0.35  # the prior's accuracy ratio between consecutive ranks of one head


def default_accuracy(depth: int, top_k: int) -> list[list[float]]:
    """Uncalibrated rank accuracies (used when a head has no holdout measurements)."""
    return [[0.6 * 0.85 ** d * DEFAULT_RANK_RATIO ** r for r in range(top_k)] for d in range(depth)]


def rank_accuracy(calibration: Mapping[str, Sequence[float]], K: int, top_k: int) -> list[list[float]]:
    """``accept[d][r]`` for ``best_static_tree``: head d's accuracy at ranks 0..top_k-1, per head.

    ``calibration["head{d}"]`` is head d's measured share of positions where the target's greedy
    token is its rank-r candidate (training's ``_rank_accuracy``, 8 ranks). Those values are kept
    as measured; a head without them takes ``default_accuracy``'s prior for its depth, and the
    other heads keep theirs. Ranks past the last measured one continue geometrically from it, at
    the ratio of the head's last two measured ranks clamped to [0, DEFAULT_RANK_RATIO] (one measured
    rank: DEFAULT_RANK_RATIO). The clamp gives a rank nobody measured no more credit than the
    uncalibrated prior's decay would: the extension is non-increasing, stays below the last measured
    value (the tree prefers measured candidates) and its whole tail sums to at most 0.54 of it,
    where a flat measured tail (ratio near 1) would credit every unmeasured rank almost as much."""
    rows = []
    for d in range(K):
        measured = list(calibration.get(f"head{d}") or [])
        if not all(isinstance(a, (int, float)) and math.isfinite(a) and 0.0 <= a <= 1.0 for a in measured):
            raise ValueError(f"medusa: calibration head{d} holds {measured}; rank accuracies must be in [0, 1]")
        if not measured:
            rows.append(default_accuracy(d + 1, top_k)[d])
            continue
        row = measured[:top_k]
        ratio = measured[-1] / measured[-2] if len(measured) > 1 and measured[-2] > 0 else DEFAULT_RANK_RATIO
        ratio = min(ratio, DEFAULT_RANK_RATIO)
        while len(row) < top_k:
            row.append(row[-1] * ratio)
        rows.append(row)
    return rows
