"""Medusa heads on streamed feature shards: head k at position j reads the target's last hidden
state h_j and is trained towards the target's distribution at position j+1+k (the token t+2+k;
the LM head itself gives t+1), soft labels by default, weighted 0.8^k."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from spec_plugins.heads.common import save_head, target_lm_parts
from spec_plugins.heads.medusa import MedusaConfig, MedusaHeads
from spec_plugins.training.batches import (ShardCache, Window, batches_for_steps, data_identity, epoch_steps,
                                           plan_windows, soft_labels)
from spec_plugins.training.eagle_train import draft_vocab
from spec_plugins.training.features import Shard, ShardSource
from spec_plugins.training.trainer import (IGNORE, Loop, StepHook, TrainConfig, loss_summary, map_vocab,
                                            write_report)


def positions(shard: Shard, windows: list[Window], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices j of the windows' queries and a [M, K] mask: head k's label (x_{j+2+k}) is
    an answer token inside the same conversation."""
    dev = shard.offsets.device
    idx = torch.cat([torch.arange(w.start, w.start + w.length, device=dev) for w in windows])
    conv_end = torch.bucketize(idx, shard.offsets, right=True)  # offsets[conv_end] = end of j's conversation
    end = shard.offsets[conv_end]
    lab = idx[:, None] + 2 + torch.arange(heads, device=dev)[None]
    ok = (lab < end[:, None]) & shard.trained[lab.clamp(max=shard.num_tokens - 1)]
    return idx, ok


def medusa_loss(heads: MedusaHeads, shard: Shard, windows: list[Window], cfg: TrainConfig, vmap: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, predicted full ids [M, K], target greedy ids [M, K] with -1 where not scored)."""
    K = heads.config.num_heads
    idx, ok = positions(shard, windows, K)
    logits = heads(shard.hidden[idx].float())  # [M, K, Vd]
    logq = logits.float().log_softmax(-1)
    at = (idx[:, None] + 1 + torch.arange(K, device=idx.device)[None]).clamp(max=shard.num_tokens - 1)  # x_{j+2+k}
    if cfg.loss == "soft":
        p = soft_labels(shard.hidden[at].float(), shard.lse[at], heads.lm_weight)
        ce = -(p * logq).sum(-1)
    else:
        src = shard.top1[at] if cfg.loss == "top1" else shard.tokens[(at + 1).clamp(max=shard.num_tokens - 1)]
        lab = torch.where(ok, vmap[src], torch.full_like(src, IGNORE))
        ce = -logq.gather(-1, lab.clamp_min(0)[..., None])[..., 0] * (lab != IGNORE)
    w = torch.tensor([0.8 ** k for k in range(K)], device=idx.device)
    per_head = (ce * ok).sum(0) / ok.sum(0).clamp_min(1)
    target = torch.where(ok, shard.top1[at], torch.full_like(at, -1))
    return (per_head * w).sum(), heads.vocab_ids[logits.argmax(-1)], target


@torch.no_grad()
def evaluate(heads: MedusaHeads, store: ShardSource, window: int = 512, max_windows: int | None = None) -> dict:
    """Held-out top-1 per head against the target's greedy token at that position."""
    heads.eval()
    windows = plan_windows(store, window)[:max_windows]
    cache = ShardCache(store)
    dev = heads.vocab_ids.device
    hit = torch.zeros(heads.config.num_heads, device=dev)
    n = torch.zeros(heads.config.num_heads, device=dev)
    cfg = TrainConfig()
    vmap = map_vocab(heads.vocab_ids, int(heads.vocab_ids.max()) + 1)
    for w in windows:
        _, pred, target = medusa_loss(heads, cache.get(w.shard), [w], cfg, vmap)
        hit += ((pred == target) & (target >= 0)).sum(0)
        n += (target >= 0).sum(0)
    return {"top1_by_head": [round(float(a / max(b, 1)), 4) for a, b in zip(hit, n)], "windows": len(windows)}


def train_medusa(store: ShardSource, target_model: Any, cfg: TrainConfig, out: str | Path, num_heads: int = 4,
                 vocab_size: int = 8192, heldout: ShardSource | None = None, progress: bool = True,
                 hook: StepHook | None = None) -> dict[str, Any]:
    """Train (or resume) Medusa heads on ``store``; returns the report written to train_report.json.
    ``hook`` runs after every step (snapshots, a deadline: ``trainer.StepHook``)."""
    out = Path(out)
    torch.manual_seed(cfg.seed)
    windows = plan_windows(store, cfg.window, cfg.max_train_tokens)
    if not windows:
        raise ValueError(f"no training windows in {store.directory}")
    lm, _ = target_lm_parts(target_model)
    vocab_ids, coverage = draft_vocab(store, windows, vocab_size, lm.shape[0])
    heads = MedusaHeads(MedusaConfig(lm.shape[1], num_heads=num_heads, draft_vocab_size=int(vocab_ids.numel())),
                        lm.float(), vocab_ids).to(lm.device)  # trained where the target is
    vmap = map_vocab(heads.vocab_ids, lm.shape[0])
    loop = Loop(heads, cfg, out, epoch_steps(windows, cfg.batch_size), "medusa", heads.config.to_dict(), progress,
                hook, data_identity(store, windows, heads.vocab_ids))
    plan = dict(batches_for_steps(windows, cfg.batch_size, cfg.seed, loop.total))
    cache = ShardCache(store)
    res = loop.run(lambda step: medusa_loss(heads, cache.get(plan[step][0].shard), plan[step], cfg, vmap)[0],
                   lambda step: sum(w.length for w in plan[step]))
    if not res.finished:
        return {"kind": "medusa", "finished": False, "steps_done": res.steps, "steps": res.scheduled,
                "checkpoint": str(out / "checkpoint.pt")}
    tokens = sum(w.length for w in windows)
    report: dict[str, Any] = {
        "kind": "medusa", "finished": True, "target": store.meta["target"], "features": store.meta,
        "train_tokens": tokens, "draft_vocab": int(vocab_ids.numel()), "draft_vocab_coverage": round(coverage, 4),
        "train_seconds": round(res.seconds, 1), "steps": res.steps, "scheduled_steps": res.scheduled,
        "resumed_from": res.resumed_from, "train": asdict(cfg),
        **loss_summary(res, out),
    }
    if heldout is not None:
        report["heldout"] = evaluate(heads, heldout, cfg.window)
    # the proposer sizes its tree from each head's rank accuracies: held out, or (no --heldout) the
    # training features, optimistic where the heads overfit; which one is recorded beside them
    calib = _rank_accuracy(heads, heldout or store, cfg.window)
    source = "heldout" if heldout is not None else "train"
    save_head(heads, {**heads.config.to_dict(), "target": store.meta["target"], "train": asdict(cfg),
                      "train_seconds": report["train_seconds"],
                      "steps": res.steps, "train_tokens": tokens, "holdout_topk_accuracy": calib,
                      "calibration_source": source}, out)
    report["holdout_topk_accuracy"], report["calibration_source"] = calib, source
    report["head_bytes"] = (out / "head.safetensors").stat().st_size
    write_report(out, report)
    return report


@torch.no_grad()
def _rank_accuracy(heads: MedusaHeads, store: ShardSource, window: int, k: int = 8, max_windows: int = 64) -> dict:
    """Per head: share of positions where the target's greedy token is the head's rank-r
    candidate, r = 0..k-1 (what ``best_static_tree`` shapes the tree from)."""
    cache = ShardCache(store)
    K = heads.config.num_heads
    hits = torch.zeros(K, k, device=heads.vocab_ids.device)
    n = torch.zeros(K, device=heads.vocab_ids.device)
    for w in plan_windows(store, window)[:max_windows]:
        shard = cache.get(w.shard)
        idx, ok = positions(shard, [w], K)
        ranks = heads.vocab_ids[heads(shard.hidden[idx].float()).topk(k, -1).indices]  # [M, K, k]
        at = (idx[:, None] + 1 + torch.arange(K, device=idx.device)[None]).clamp(max=shard.num_tokens - 1)
        eq = (ranks == shard.top1[at][..., None]) & ok[..., None]
        hits += eq.sum(0)
        n += ok.sum(0)
    return {f"head{h}": [round(float(v), 4) for v in hits[h] / max(float(n[h]), 1.0)] for h in range(K)}
