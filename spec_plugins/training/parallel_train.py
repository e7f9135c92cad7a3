"""Parallel drafter training on the same feature shards as EAGLE's (``batches.EagleBatch``).

One step: (1) the real queries (f_j, x_{j+1}) of a window run causally, as the catch-up runs them
when drafting; query j's output is scored on the target's distribution at j + 1 (depth 0); (2) a
few anchors a per window are drawn, and each anchor's K-1 block queries run in one forward, exactly
as the proposer runs them: block query i sits at position a + 1 + i, reads ``block_inputs[i]`` and
token x_{a+2} (i = 0) or the mask token, and sees the real keys up to a and the earlier block
queries of its own anchor; it is scored on the target's distribution at a + 2 + i (depth i + 1).
No training-time test unroll is needed: the block queries' inputs are the same when drafting.
With block layers, each anchor's output (depth 0) and its block outputs then run through them
together, as ``ParallelDrafter.refine`` does when drafting (with ``block_context``, seeing the
real pairs up to the anchor too, from the same cache the real queries wrote).
"""

from __future__ import annotations

from typing import Any

import torch

from spec_plugins.heads.parallel import ParallelConfig, ParallelDrafter
from spec_plugins.training.batches import (EagleBatch, ShardCache, eagle_batch, epoch_batches, plan_windows,
                                           soft_labels, step_mask, unroll_masks)
from spec_plugins.training.features import ShardSource
from spec_plugins.training.trainer import TrainConfig

NEG = float("-inf")


def real_pass(model: ParallelDrafter, b: EagleBatch, noise: float = 0.0) -> tuple[torch.Tensor, ...]:
    """The window's real queries, causally: outputs [B, T, H], their keys and values, and their
    projected input features [B, T, H] (each block reads its anchor's)."""
    x = model.project(b.feat)
    if noise:
        x = x + noise * x.detach().std() * torch.randn_like(x)
    B = x.shape[0]
    empty = x.new_zeros(B, model.config.cache_heads, 0, model.config.head_dim)
    return (*model(x, b.tok, b.pos, empty, empty, unroll_masks(b.valid, 1)[0]), x)


def block_pass(model: ParallelDrafter, b: EagleBatch, keys: torch.Tensor, values: torch.Tensor,
               inputs: torch.Tensor, out0: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The block queries of ``anchors`` [B, S] (query indices) in one forward, reading the anchors'
    projected features from ``inputs`` [B, T, H], then the block layers with the anchors' outputs
    from ``out0`` [B, T, H]: outputs [B, S, K-1, H] (module docstring)."""
    B, T = b.valid.shape
    S, n = anchors.shape[1], model.block
    first = b.data_next.gather(1, anchors)  # x_{a+2}: the depth-0 token
    anchor = inputs.gather(1, anchors[..., None].expand(-1, -1, inputs.shape[-1]))
    feat, tok, pos = model.block_query(anchor, first, b.pos.gather(1, anchors))
    j = torch.arange(T, device=anchors.device)
    real = (j[None, None] <= anchors[..., None]) & b.valid[:, None]  # [B, S, T]
    own = torch.ones(n, n, dtype=torch.bool, device=anchors.device).tril()
    blocks = torch.eye(S, dtype=torch.bool, device=anchors.device)[:, None, :, None] & own[None, :, None, :]
    ok = torch.cat([real[:, :, None].expand(B, S, n, T).reshape(B, S * n, T),
                    blocks.reshape(S * n, S * n).expand(B, -1, -1)], -1)
    mask = torch.zeros(ok.shape, device=keys.device).masked_fill(~ok, NEG)[:, None]
    out, _, _ = model(feat.reshape(B, S * n, -1).to(keys.dtype), tok.reshape(B, S * n), pos.reshape(B, S * n),
                      keys, values, mask)
    depth0 = out0.gather(1, anchors[..., None].expand(-1, -1, out0.shape[-1]))
    return model.refine(depth0, out.view(B, S, n, -1), None, b.pos.gather(1, anchors), keys, values, real)


def draw_anchors(b: EagleBatch, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` anchors per window among the queries whose depth 0 is trained; returns
    (anchors [B, S], which are real [B, S])."""
    ok = step_mask(b, 0)
    r = torch.rand(ok.shape, device=ok.device)  # the global generator: the trainer seeds it per step
    top = r.masked_fill(~ok, -1.0).topk(min(count, ok.shape[1]), -1)
    return top.indices, top.values >= 0


def check_block_size(block_size: int, window: int) -> None:
    """Block depth d (1..block_size - 1) is scored at query a + d of a window, anchors a >= 0: past
    ``window`` queries no depth is ever scored, in training or held out, yet the head would draft
    it. Refused before anything is written."""
    if block_size > window:
        raise ValueError(f"--block-size {block_size} drafts depths up to {block_size - 1}, but a --window of {window} "
                         f"queries scores depths up to {window - 1} only: set --block-size at most {window} "
                         "or a larger --window")


def block_labels(b: EagleBatch, anchors: torch.Tensor, real: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query index a + 1 + i of each block query [B, S, n] (its label is that query's) and
    whether it is scored (inside the window, an assistant token, a real anchor)."""
    T = b.valid.shape[1]
    at = anchors[..., None] + 1 + torch.arange(n, device=anchors.device)
    inside = at < T
    at = at.clamp_max(T - 1)
    ok = step_mask(b, 0)
    scored = inside & real[..., None] & ok.gather(1, at.flatten(1)).view_as(at)
    return at, scored


def parallel_loss(model: ParallelDrafter, b: EagleBatch, cfg: TrainConfig, anchors: int) -> torch.Tensor:
    """Depth 0 plus each block depth, weighted ``step_decay ** depth``, on the target's own
    distribution (soft labels over the draft vocabulary)."""
    out0, keys, values, inputs = real_pass(model, b, cfg.noise)
    p = soft_labels(b.next_hidden, b.next_lse, model.lm_weight)  # [B, T, Vd]: the label of query j
    ok0 = step_mask(b, 0)
    total = _soft_ce(model.logits(out0), p, ok0)
    a, real = draw_anchors(b, anchors)
    out = block_pass(model, b, keys, values, inputs, out0, a)
    at, scored = block_labels(b, a, real, model.block)
    pb = p.gather(1, at.flatten(1)[..., None].expand(-1, -1, p.shape[-1])).view(*at.shape, -1)
    logits = model.logits(out)
    for i in range(model.block):
        total = total + cfg.step_decay ** (i + 1) * _soft_ce(logits[:, :, i], pb[:, :, i], scored[..., i])
    return total


def _soft_ce(logits: torch.Tensor, p: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    ce = -(p * logits.float().log_softmax(-1)).sum(-1)
    return (ce * ok).sum() / ok.sum().clamp_min(1)


@torch.no_grad()
def evaluate_parallel(model: ParallelDrafter, store: ShardSource, window: int = 512, batch: int = 1,
                      chunk: int = 64, max_windows: int | None = None) -> dict[str, Any]:
    """Held-out top-1 per depth (the drafter's token == the target's greedy token), with every
    query of every window as an anchor, and the chain length it would get accepted along the
    held-out text: 1 + sum over d of P(depths 0..d all right). A depth no held-out position
    scores (conversations shorter than the block) has top-1 None: not measured, not 0."""
    model.eval()
    fused = bool(model.config.feature_layers)
    windows = plan_windows(store, window)[:max_windows]
    cache = ShardCache(store)
    K = model.config.block_size
    hit, seen, chain, starts = [0] * K, [0] * K, [0] * K, 0
    for bw in epoch_batches(windows, batch, seed=0, epoch=0):
        b = eagle_batch(cache.get(bw[0].shard), bw, fused)
        out0, keys, values, inputs = real_pass(model, b)
        right0 = model.vocab_ids[model.logits(out0).argmax(-1)] == b.top1
        ok0 = step_mask(b, 0)
        T = ok0.shape[1]
        for s in range(0, T, chunk):
            a = torch.arange(s, min(s + chunk, T), device=ok0.device).expand(ok0.shape[0], -1)
            real = ok0.gather(1, a)
            at, scored = block_labels(b, a, real, model.block)
            pred = model.vocab_ids[model.logits(block_pass(model, b, keys, values, inputs, out0, a)).argmax(-1)]
            right = [right0.gather(1, a)] + [pred[..., i] == b.top1.gather(1, at[..., i]) for i in range(model.block)]
            oks = [real] + [scored[..., i] for i in range(model.block)]
            alive = real.clone()
            for d, (r, o) in enumerate(zip(right, oks)):
                hit[d] += int((r & o).sum())
                seen[d] += int(o.sum())
                alive &= r & o
                chain[d] += int(alive.sum())
            starts += int(real.sum())
    top1 = [round(h / n, 4) if n else None for h, n in zip(hit, seen)]
    return {"top1_by_step": top1, "accepted_along_text": round(1 + sum(c / max(starts, 1) for c in chain), 3),
            "positions": starts, "windows": len(windows)}


__all__ = ["ParallelConfig", "ParallelDrafter", "block_pass", "check_block_size", "draw_anchors", "evaluate_parallel",
           "parallel_loss", "real_pass"]
