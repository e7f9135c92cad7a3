"""Training loops for the heads on cached features: deterministic batch order (so a resumed run
sees the same batches), checkpoints every ``save_every`` steps, a tqdm progress bar, and the
final head written as fp16 safetensors + JSON config with the recipe and measured numbers.

Medusa: head k at position t is trained with cross-entropy on the target's greedy token t+2+k.
EAGLE: regression to the next feature (smooth L1) + cross-entropy through the frozen LM head,
unrolled ``unroll`` steps where step s reads the features the drafter itself predicted at step
s-1 and attends exactly as it will when drafting (real keys up to t, then its own draft keys),
so deep drafts are trained on their own inputs ("training-time test").
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from spec_plugins.heads.common import save_head
from spec_plugins.heads.eagle import EagleConfig, EagleDrafter
from spec_plugins.heads.medusa import MedusaConfig, MedusaHeads
from spec_plugins.training.data import FeatureSet

IGNORE = -100


@dataclass
class TrainConfig:
    epochs: float = 3.0
    batch_size: int = 256  # positions (medusa) or sequences (eagle) per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_steps: int | None = None  # shorten the schedule (also used by the smoke test)
    stop_after: int | None = None  # leave after this many steps in this process (resume later)
    finalize: bool = False  # write the head from the last checkpoint, no further steps
    save_every: int = 50
    seed: int = 0
    holdout: float = 0.05  # share of sequences kept for the accuracy report
    # eagle
    unroll: int = 3
    reg_weight: float = 1.0
    ce_weight: float = 1.0  # EAGLE's paper uses 0.1; 1.0 (with lr 1e-3) gave 30.8 % vs 27.1 % top-1 at 150 steps here
    noise: float = 0.05  # gaussian noise on input features, relative to their std


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # per step (this process only)
    seconds: float = 0.0
    resumed_from: int = 0
    accuracy: dict[str, list[float]] = field(default_factory=dict)
    finished: bool = True
    scheduled: int = 0  # steps in the schedule (> steps when finalized early)


def _split(fs: FeatureSet, holdout: float) -> tuple[list[int], list[int]]:
    n = len(fs)
    k = int(round(n * holdout)) if n > 10 else 0
    return list(range(n - k)), list(range(n - k, n))


def _map_vocab(vocab_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """full id -> draft index, -100 for tokens outside the draft vocabulary."""
    m = torch.full((vocab,), IGNORE, dtype=torch.long)
    m[vocab_ids] = torch.arange(vocab_ids.numel())
    return m


# ---------------------------------------------------------------------------------------------
class _Loop:
    """Step schedule, optimizer, checkpointing and progress shared by both heads."""

    def __init__(self, module: nn.Module, cfg: TrainConfig, out: Path, steps_per_epoch: int, kind: str,
                 head_config: dict, progress: bool) -> None:
        self.module, self.cfg, self.out, self.kind = module, cfg, out, kind
        self.steps_per_epoch = max(1, steps_per_epoch)
        total = math.ceil(cfg.epochs * self.steps_per_epoch)
        self.total = min(total, cfg.max_steps) if cfg.max_steps else total
        params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warm = max(1, self.total // 20)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, self.total) / self.total)))
        self.head_config = head_config
        self.step = 0
        self.seconds = 0.0
        self.progress = progress
        self.ckpt = out / "checkpoint.pt"

    def order(self, n: int, epoch: int) -> torch.Tensor:
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch))

    def resume(self) -> int:
        if not self.ckpt.is_file():
            return 0
        st = torch.load(self.ckpt, weights_only=False)
        if st["head_config"] != self.head_config or st["total"] != self.total:
            raise ValueError(f"checkpoint {self.ckpt} was made with a different head config or schedule; "
                             "use a new --out directory or delete the checkpoint")
        self.module.load_state_dict(st["module"], strict=False)
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step, self.seconds = st["step"], st["seconds"]
        return self.step

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save({"module": self.module.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "step": self.step, "seconds": self.seconds,
                    "head_config": self.head_config, "total": self.total}, tmp)
        tmp.replace(self.ckpt)

    def run(self, loss_at: Callable[[int, int], torch.Tensor]) -> TrainResult:
        """loss_at(epoch, index within epoch) -> scalar loss of that batch."""
        from tqdm.auto import tqdm

        start = self.resume()
        res = TrainResult(self.total, resumed_from=start)
        bar = tqdm(total=self.total, initial=start, desc=f"train {self.kind}", disable=not self.progress,
                   dynamic_ncols=True)
        self.module.train()
        while self.step < self.total and not self.cfg.finalize:
            t0 = time.perf_counter()
            epoch, i = divmod(self.step, self.steps_per_epoch)
            loss = loss_at(epoch, i)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.step += 1
            self.seconds += time.perf_counter() - t0
            res.losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{res.losses[-1]:.3f}")
            bar.update(1)
            stopping = self.cfg.stop_after is not None and self.step - start >= self.cfg.stop_after
            if self.step % self.cfg.save_every == 0 or self.step == self.total or stopping:
                self.save()
            if stopping:
                break
        bar.close()
        self.module.eval()
        res.seconds = self.seconds
        res.finished = self.step >= self.total or self.cfg.finalize
        res.steps, res.scheduled = self.step, self.total
        return res


# ---------------------------------------------------------------------------------------------
def medusa_examples(fs: FeatureSet, seqs: list[int], num_heads: int, vmap: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [M, H] float16, labels [M, K] draft indices) for every response-predicting position."""
    hs, labels = [], []
    for i in seqs:
        toks, hid, p = fs.seq(i)
        L = toks.numel()
        t = torch.arange(max(p - 1, 0), L - 2)  # h_t; the LM head predicts t+1 (known), head k t+2+k
        if t.numel() == 0:
            continue
        idx = t[:, None] + 2 + torch.arange(num_heads)[None]
        lab = torch.where(idx < L, vmap[toks[idx.clamp(max=L - 1)]], torch.full_like(idx, IGNORE))
        hs.append(hid[t])
        labels.append(lab)
    return torch.cat(hs), torch.cat(labels)


def train_medusa(fs: FeatureSet, lm_weight: torch.Tensor, vocab_ids: torch.Tensor, hcfg: MedusaConfig,
                 cfg: TrainConfig, out: str | Path, progress: bool = True) -> tuple[MedusaHeads, TrainResult]:
    out = Path(out)
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(hcfg, lm_weight.float(), vocab_ids)
    vmap = _map_vocab(vocab_ids, lm_weight.shape[0])
    train_ids, held = _split(fs, cfg.holdout)
    X, Y = medusa_examples(fs, train_ids, hcfg.num_heads, vmap)
    head_weights = torch.tensor([0.8 ** k for k in range(hcfg.num_heads)])
    loop = _Loop(heads, cfg, out, math.ceil(X.shape[0] / cfg.batch_size), "medusa", hcfg.to_dict(), progress)

    def loss_at(epoch: int, i: int) -> torch.Tensor:
        idx = loop.order(X.shape[0], epoch)[i * cfg.batch_size: (i + 1) * cfg.batch_size]
        logits = heads(X[idx].float())  # [b, K, Vd]
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), Y[idx].flatten(), ignore_index=IGNORE,
                                         reduction="none").view(len(idx), -1)
        valid = (Y[idx] != IGNORE).float()
        per_head = (ce * valid).sum(0) / valid.sum(0).clamp_min(1)
        return (per_head * head_weights).sum()

    res = loop.run(loss_at)
    if not res.finished:
        return heads, res
    if held:
        Xh, Yh = medusa_examples(fs, held, hcfg.num_heads, vmap)
        res.accuracy = topk_accuracy(heads(Xh.float()).detach(), Yh)
    meta = {**hcfg.to_dict(), "train": asdict(cfg), "train_seconds": round(res.seconds, 1), "steps": res.steps,
            "scheduled_steps": res.scheduled, "examples": int(X.shape[0]), "holdout_topk_accuracy": res.accuracy}
    save_head(heads, meta, out)
    return heads, res


@torch.no_grad()
def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int = 8) -> dict[str, list[float]]:
    """Per head: share of labels at rank 0..k-1 (rank-wise, not cumulative), among valid labels."""
    out = {}
    ranks = logits.topk(k, -1).indices  # [M, K, k]
    for h in range(labels.shape[1]):
        ok = labels[:, h] != IGNORE
        hit = ranks[ok, h] == labels[ok, h][:, None]
        out[f"head{h}"] = [round(float(v), 4) for v in hit.float().mean(0)]
    return out


# ---------------------------------------------------------------------------------------------
def eagle_batch(fs: FeatureSet, seqs: list[int], vmap: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pad sequences: features f_j, tokens x_{j+1}, targets f_{j+1} and draft index of x_{j+2}."""
    T = max(fs.seq(i)[0].numel() for i in seqs) - 1
    B, H = len(seqs), fs.hidden.shape[1]
    feat = torch.zeros(B, T, H)
    tok = torch.zeros(B, T, dtype=torch.long)
    tgt = torch.zeros(B, T, H)
    lab = torch.full((B, T), IGNORE, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(seqs):
        toks, hid, p = fs.seq(i)
        L = toks.numel()
        feat[b, : L - 1] = hid[: L - 1].float()
        tok[b, : L - 1] = toks[1:]
        tgt[b, : L - 1] = hid[1:].float()
        lab[b, : L - 2] = vmap[toks[2:]]
        lab[b, : max(p - 2, 0)] = IGNORE  # CE only where x_{j+2} is a response token
        valid[b, : L - 1] = True
    return {"feat": feat, "tok": tok, "tgt": tgt, "lab": lab, "valid": valid}


def unroll_masks(valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Additive masks for unroll step s over keys [step0 | step1 | ... | step s], each T long:
    query j sees step-0 keys i <= j-s and the step-r key at exactly i = j-s+r (its draft path)."""
    B, T = valid.shape
    j = torch.arange(T)[:, None]
    i = torch.arange(T)[None, :]
    out = []
    for s in range(steps):
        parts = [(i <= j - s)] + [(i == j - s + r) for r in range(1, s + 1)]
        ok = torch.cat(parts, 1)[None] & valid.repeat(1, s + 1)[:, None, :]
        ok = ok | torch.cat([torch.zeros(T, T * s, dtype=torch.bool), torch.eye(T, dtype=torch.bool)], 1)[None]
        out.append(torch.zeros(B, 1, T, T * (s + 1)).masked_fill(~ok[:, None], float("-inf")))
    return out


def eagle_loss(model: EagleDrafter, batch: dict[str, torch.Tensor], cfg: TrainConfig, noise_std: float = 0.0,
               acc: list[list[float]] | None = None) -> torch.Tensor:
    feat, tok, tgt, lab, valid = (batch[k] for k in ("feat", "tok", "tgt", "lab", "valid"))
    B, T, _ = feat.shape
    pos = torch.arange(T)[None].expand(B, T)
    masks = unroll_masks(valid, cfg.unroll)
    x = feat + noise_std * torch.randn_like(feat) if noise_std else feat
    ks, vs = [], []
    total = feat.new_zeros(())
    for s in range(cfg.unroll):
        k0 = torch.cat(ks, 2) if ks else feat.new_zeros(B, model.config.num_kv_heads, 0, model.config.head_dim)
        v0 = torch.cat(vs, 2) if vs else k0
        out, k, v = model(x, tok, pos, k0, v0, masks[s])
        ks.append(k)
        vs.append(v)
        ok = valid.clone()
        ok[:, :s] = False  # step s needs s earlier predictions
        w = ok.float()
        reg = nn.functional.smooth_l1_loss(out, tgt, reduction="none").mean(-1)
        lab_s = torch.where(ok, lab, torch.full_like(lab, IGNORE))
        logits = model.logits(out)
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), lab_s.flatten(), ignore_index=IGNORE, reduction="sum")
        n_ce = (lab_s != IGNORE).sum().clamp_min(1)
        total = total + (0.8 ** s) * (cfg.reg_weight * (reg * w).sum() / w.sum().clamp_min(1)
                                       + cfg.ce_weight * ce / n_ce)
        if acc is not None:
            m = lab_s != IGNORE
            acc[s][0] += float((logits.argmax(-1)[m] == lab_s[m]).sum())
            acc[s][1] += float(m.sum())
        # next step's input at j is this step's prediction made at j-1
        x = torch.cat([feat[:, :1], out[:, :-1]], 1)
    return total


def train_eagle(fs: FeatureSet, lm_weight: torch.Tensor, embed_weight: torch.Tensor, vocab_ids: torch.Tensor,
                hcfg: EagleConfig, cfg: TrainConfig, out: str | Path, progress: bool = True
                ) -> tuple[EagleDrafter, TrainResult]:
    out = Path(out)
    torch.manual_seed(cfg.seed)
    model = EagleDrafter(hcfg, lm_weight.float(), embed_weight.float(), vocab_ids)
    vmap = _map_vocab(vocab_ids, lm_weight.shape[0])
    train_ids, held = _split(fs, cfg.holdout)
    noise_std = cfg.noise * float(fs.hidden[:4096].float().std())
    loop = _Loop(model, cfg, out, math.ceil(len(train_ids) / cfg.batch_size), "eagle", hcfg.to_dict(), progress)

    def loss_at(epoch: int, i: int) -> torch.Tensor:
        order = loop.order(len(train_ids), epoch)[i * cfg.batch_size: (i + 1) * cfg.batch_size]
        torch.manual_seed(cfg.seed * 7919 + loop.step)  # noise reproducible across resume
        return eagle_loss(model, eagle_batch(fs, [train_ids[j] for j in order], vmap), cfg, noise_std)

    res = loop.run(loss_at)
    if not res.finished:
        return model, res
    if held:
        acc = [[0.0, 0.0] for _ in range(cfg.unroll)]
        with torch.no_grad():
            for s in range(0, len(held), 8):
                eagle_loss(model, eagle_batch(fs, held[s: s + 8], vmap), cfg, 0.0, acc)
        res.accuracy = {"top1_by_unroll_step": [round(a / max(n, 1), 4) for a, n in acc]}
    meta = {**hcfg.to_dict(), "train": asdict(cfg), "train_seconds": round(res.seconds, 1), "steps": res.steps,
            "scheduled_steps": res.scheduled, "sequences": len(train_ids), "holdout_accuracy": res.accuracy}
    save_head(model, meta, out)
    return model, res


def write_report(out: Path, info: dict[str, Any]) -> None:
    (out / "train_report.json").write_text(json.dumps(info, indent=2) + "\n")
