"""Training batches streamed from feature shards: windows of conversations, a deterministic
order (so a resumed run sees the same batches), one shard in memory at a time, and the target's
soft labels rebuilt over the draft vocabulary from the stored last hidden state and logsumexp.

Indexing convention (EAGLE's): the drafter's query j reads feature f_j and token x_{j+1} and
predicts the target's distribution at position j+1, i.e. over x_{j+2}. That label counts only
where x_{j+2} was written by the assistant (``trained``).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import astuple, dataclass
from typing import Any, Iterator, Sequence

import torch

from spec_plugins.training.features import Shard, ShardSource

IGNORE = -100


@dataclass(frozen=True)
class Window:
    shard: int
    start: int  # flat token index of query 0 in the shard
    length: int  # queries (positions j with f_j, x_{j+1} and a label at j+1 inside the conversation)
    position: int  # position of query 0 within its conversation (RoPE)


def _read(store: ShardSource, i: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Some arrays of shard i (on the CPU) without its features; any store with ``read`` works
    (``live.LiveFeatures`` reads token shards and computes features on demand)."""
    return store.read(i, names)


def plan_windows(store: ShardSource, window: int, max_tokens: int | None = None) -> list[Window]:
    """Windows of up to ``window`` queries over every conversation, skipping windows with no
    trained label; with ``max_tokens``, only the first conversations up to that many tokens (a
    data-size sweep trains on prefixes of one extraction)."""
    out: list[Window] = []
    used = 0
    for i in range(len(store.shards)):
        t = _read(store, i, ("offsets", "trained"))
        offs, trained = t["offsets"].tolist(), t["trained"].bool()
        for a, b in zip(offs[:-1], offs[1:]):
            if max_tokens is not None and used >= max_tokens:
                return out
            used += b - a
            queries = b - a - 2  # j + 2 must stay inside the conversation
            for w0 in range(0, max(queries, 0), window):
                n = min(window, queries - w0)
                if bool(trained[a + w0 + 2: a + w0 + 2 + n].any()):
                    out.append(Window(i, a + w0, n, w0))
    return out


def token_counts(store: ShardSource, vocab: int, windows: Sequence[Window] | None = None) -> torch.Tensor:
    """How often each token is an assistant token in the training data: with ``windows``, only
    their labels (x_{j+2} of every query j; the windows of a conversation label disjoint
    positions), so the draft vocabulary comes from the data a run trains on, not from the rest of
    the shards its windows touch (a ``--max-train-tokens`` prefix); without, every shard."""
    counts = torch.zeros(vocab, dtype=torch.long)
    by_shard: dict[int, list[Window]] = {}
    for w in windows or ():
        by_shard.setdefault(w.shard, []).append(w)
    for i in sorted(by_shard) if windows is not None else range(len(store.shards)):
        t = _read(store, i, ("tokens", "trained"))
        keep = t["trained"].bool()
        if windows is not None:
            labels = torch.zeros_like(keep)
            for w in by_shard[i]:
                labels[w.start + 2: w.start + 2 + w.length] = True
            keep = keep & labels
        counts += torch.bincount(t["tokens"][keep].long(), minlength=vocab)[:vocab]
    return counts


def epoch_batches(windows: Sequence[Window], batch: int, seed: int, epoch: int) -> list[list[Window]]:
    """One epoch: shards in a seeded order, windows shuffled within each shard, batches of
    ``batch`` windows that never span two shards (one shard in memory at a time)."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    by_shard: dict[int, list[Window]] = {}
    for w in windows:
        by_shard.setdefault(w.shard, []).append(w)
    order = [sorted(by_shard)[i] for i in torch.randperm(len(by_shard), generator=g).tolist()]
    out = []
    for s in order:
        ws = [by_shard[s][i] for i in torch.randperm(len(by_shard[s]), generator=g).tolist()]
        out += [ws[i: i + batch] for i in range(0, len(ws), batch)]
    return out


def epoch_steps(windows: Sequence[Window], batch: int) -> int:
    """Batches in one epoch, counted by making them: a shard's last batch may be partial, so an
    epoch can have more than ceil(windows / batch). Every epoch has as many."""
    return len(epoch_batches(windows, batch, seed=0, epoch=0))


def data_identity(store: ShardSource, windows: Sequence[Window], vocab_ids: torch.Tensor) -> dict[str, Any]:
    """What a checkpoint's training data was: the target, a fingerprint of the windows and the tokens
    of their shards, and one of the draft vocabulary (a resume on other data is refused)."""
    data = hashlib.sha256(repr([astuple(w) for w in windows]).encode())
    for i in sorted({w.shard for w in windows}):
        t = _read(store, i, ("tokens", "trained"))
        data.update(t["tokens"].long().numpy().tobytes())
        data.update(t["trained"].bool().numpy().tobytes())
    vocab = hashlib.sha256(vocab_ids.detach().long().cpu().numpy().tobytes())
    return {"target": store.meta["target"], "training data (fingerprint)": data.hexdigest()[:16],
            "draft vocabulary (fingerprint)": vocab.hexdigest()[:16]}


class ShardCache:
    """The one shard in memory."""

    def __init__(self, store: ShardSource) -> None:
        self.store, self.index, self.shard = store, -1, None

    def get(self, i: int) -> Shard:
        if i != self.index:
            self.shard, self.index = self.store.load(i), i
        return self.shard  # type: ignore[return-value]


@dataclass
class EagleBatch:
    feat: torch.Tensor  # [B, T, F] target features of query j (last hidden, or the fused layers)
    tok: torch.Tensor  # [B, T] x_{j+1}
    pos: torch.Tensor  # [B, T] position of query j
    valid: torch.Tensor  # [B, T] query exists
    label_ok: torch.Tensor  # [B, T] x_{j+2} is an assistant token
    next_hidden: torch.Tensor  # [B, T, H] f_{j+1}: regression target and soft-label source
    next_lse: torch.Tensor  # [B, T] logsumexp of the target's logits at j+1
    top1: torch.Tensor  # [B, T] the target's greedy token at j+1 (full vocabulary id)
    data_next: torch.Tensor  # [B, T] x_{j+2} as written


def eagle_batch(shard: Shard, windows: Sequence[Window], fused: bool) -> EagleBatch:
    """Pad windows into one batch (right padding, ``valid`` marks real queries)."""
    B, T = len(windows), max(w.length for w in windows)
    H = shard.hidden.shape[1]
    F = shard.layers.shape[1] * H if fused else H
    if fused and shard.layers.shape[1] == 0:
        raise ValueError("these features hold no layer outputs (extracted with --layers none); "
                         "train without fused features or extract again")
    dev = shard.hidden.device  # the batch is built where the features are (a GPU run keeps them there)
    f32, i64, b8 = dict(device=dev), dict(dtype=torch.long, device=dev), dict(dtype=torch.bool, device=dev)
    b = EagleBatch(torch.zeros(B, T, F, **f32), torch.zeros(B, T, **i64), torch.zeros(B, T, **i64),
                   torch.zeros(B, T, **b8), torch.zeros(B, T, **b8), torch.zeros(B, T, H, **f32),
                   torch.zeros(B, T, **f32), torch.zeros(B, T, **i64), torch.zeros(B, T, **i64))
    for r, w in enumerate(windows):
        j = slice(w.start, w.start + w.length)
        j1 = slice(w.start + 1, w.start + 1 + w.length)
        j2 = slice(w.start + 2, w.start + 2 + w.length)
        n = w.length
        b.feat[r, :n] = (shard.layers[j].flatten(1) if fused else shard.hidden[j]).float()
        b.tok[r, :n] = shard.tokens[j1]
        b.pos[r, :n] = torch.arange(w.position, w.position + n, device=dev)
        b.valid[r, :n] = True
        b.label_ok[r, :n] = shard.trained[j2]
        b.next_hidden[r, :n] = shard.hidden[j1].float()
        b.next_lse[r, :n] = shard.lse[j1]
        b.top1[r, :n] = shard.top1[j1]
        b.data_next[r, :n] = shard.tokens[j2]
    return b


def soft_labels(next_hidden: torch.Tensor, next_lse: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
    """The target's probabilities of the draft-vocabulary tokens [B, T, Vd] (not renormalised:
    mass outside the draft vocabulary is mass no draft can win)."""
    return torch.exp(next_hidden @ lm_rows.T.float() - next_lse[..., None])


def batches_for_steps(windows: Sequence[Window], batch: int, seed: int, steps: int) -> Iterator[tuple[int, list[Window]]]:
    """(step, windows) for ``steps`` steps, cycling epochs."""
    step = 0
    for epoch in itertools.count():
        if step >= steps or not windows:
            return
        for bw in epoch_batches(windows, batch, seed, epoch):
            if step >= steps:
                return
            yield step, bw
            step += 1


def unroll_masks(valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Additive masks for unroll step s over keys [step0 | step1 | ... | step s], each T long:
    query j sees step-0 keys i <= j-s and the step-r key at exactly i = j-s+r (its draft path)."""
    B, T = valid.shape
    dev = valid.device
    j = torch.arange(T, device=dev)[:, None]
    i = torch.arange(T, device=dev)[None, :]
    out = []
    for s in range(steps):
        parts = [(i <= j - s)] + [(i == j - s + r) for r in range(1, s + 1)]
        ok = torch.cat(parts, 1)[None] & valid.repeat(1, s + 1)[:, None, :]
        ok = ok | torch.cat([torch.zeros(T, T * s, dtype=torch.bool, device=dev),
                             torch.eye(T, dtype=torch.bool, device=dev)], 1)[None]
        out.append(torch.zeros(B, 1, T, T * (s + 1), device=dev).masked_fill(~ok[:, None], float("-inf")))
    return out


def step_mask(b: EagleBatch, s: int) -> torch.Tensor:
    """Queries whose step-s prediction is scored: real, with s earlier queries, answer token."""
    ok = b.valid & b.label_ok
    ok[:, :s] = False
    return ok
