"""The training loop shared by the heads: a deterministic step schedule (a resumed run sees the
same batches), AdamW with warm-up and cosine decay, checkpoints every ``save_every`` steps, a
tqdm progress bar, and the time spent. The heads' losses live in ``eagle_train`` and
``medusa_train``; batches stream from feature shards (``batches``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn

from spec_plugins.files import write_atomic

IGNORE = -100
MAX_SEED = 2**32 - 1  # seeds derived from it (seed * 1000 + epoch, seed * 7919 + step) stay in int64


@dataclass
class TrainConfig:
    epochs: float = 1.0
    batch_size: int = 4  # windows (eagle) or positions (medusa) per step
    window: int = 512  # eagle: queries per window (a conversation is cut into windows)
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_steps: int | None = None  # shorten the schedule
    stop_after: int | None = None  # leave after this many steps in this process (resume later)
    finalize: bool = False  # write the head from the last checkpoint, no further steps
    save_every: int = 50
    seed: int = 0
    max_train_tokens: int | None = None  # train on the first N tokens of the features (data-size sweep)
    loss: Literal["soft", "top1", "data"] = "soft"  # target distribution, target greedy token, or the data's token
    # eagle
    unroll: int = 3  # training-time test steps (1 = none)
    reg_weight: float = 0.0  # smooth-L1 regression to the next target feature (EAGLE-1: 1.0; EAGLE-3: none)
    noise: float = 0.05  # gaussian noise on input features, relative to their std
    step_decay: float = 0.8  # weight of unroll step s: step_decay ** s

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"epochs must be a positive number, got {self.epochs}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..{MAX_SEED}, got {self.seed}")


# what a resumed run may change: how long it runs and how often it saves, not what it learns (the
# schedule's length is checked on its own, as ``Loop.total``)
RESUMABLE = frozenset({"epochs", "max_steps", "stop_after", "finalize", "save_every"})


def run_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings that define what a run learns: a checkpoint resumes only under the same ones."""
    return {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE}


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``name saved (now new)`` for every setting that differs between a checkpoint and this run."""
    return [f"{k} {saved.get(k)!r} (now {now.get(k)!r})" for k in sorted(saved.keys() | now.keys())
            if saved.get(k) != now.get(k)]


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # per step (this process only)
    seconds: float = 0.0
    resumed_from: int = 0
    finished: bool = True
    scheduled: int = 0  # steps in the schedule (> steps when finalized early)
    positions: int = 0  # training positions (queries) in the steps of this process


# after_step(module, step, seconds, positions) -> True to leave now (a checkpoint is written first): how a
# driver adds snapshots or a wall-clock deadline (scripts/train_heads_gpu.py) without another loop
StepHook = Callable[[nn.Module, int, float, int], bool]


def map_vocab(vocab_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """full id -> draft index, IGNORE for tokens outside the draft vocabulary."""
    m = torch.full((vocab,), IGNORE, dtype=torch.long, device=vocab_ids.device)
    m[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
    return m


# ---------------------------------------------------------------------------------------------
class Loop:
    """Step schedule, optimizer, checkpointing and progress shared by both heads."""

    def __init__(self, module: nn.Module, cfg: TrainConfig, out: Path, steps_per_epoch: int, kind: str,
                 head_config: dict, progress: bool, hook: Optional[StepHook] = None,
                 identity: Optional[dict[str, Any]] = None) -> None:
        """``steps_per_epoch``: the batches of one epoch (``batches.epoch_steps``); ``identity``: what
        else defines the run beside ``cfg`` (the data, the draft vocabulary, the recipe), which a
        checkpoint must match to be resumed."""
        self.module, self.cfg, self.out, self.kind, self.hook = module, cfg, out, kind, hook
        self.settings = run_settings(cfg) | (identity or {})
        total = math.ceil(cfg.epochs * max(1, steps_per_epoch))
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

    def resume(self) -> int:
        if not self.ckpt.is_file():
            if self.cfg.finalize:  # a head with no training step is not a trained head
                raise ValueError(f"nothing to finalize: {self.ckpt} does not exist; train first (without finalize)")
            return 0
        st = torch.load(self.ckpt, weights_only=False, map_location=next(self.module.parameters()).device)
        if "settings" not in st:
            raise ValueError(f"checkpoint {self.ckpt} does not record its training settings (made by an earlier "
                             "version), so resuming it could mix settings; use a new --out directory or delete it")
        diff = differences(self._identity(st["head_config"], st["total"], st["settings"]),
                           self._identity(self.head_config, self.total, self.settings))
        if diff:
            raise ValueError(f"checkpoint {self.ckpt} was made with other settings: {'; '.join(diff)}; "
                             "use a new --out directory or delete the checkpoint")
        self.module.load_state_dict(st["module"], strict=False)
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step, self.seconds = st["step"], st["seconds"]
        return self.step

    @staticmethod
    def _identity(head_config: dict, total: int, settings: dict[str, Any]) -> dict[str, Any]:
        """Everything a checkpoint must match, flat, so a refusal names each differing setting."""
        return {f"head {k}": v for k, v in head_config.items()} | {"scheduled steps": total} | settings

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state = {"module": self.module.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                 "step": self.step, "seconds": self.seconds, "head_config": self.head_config, "total": self.total,
                 "settings": self.settings}
        write_atomic(self.ckpt, lambda tmp: torch.save(state, tmp))

    def run(self, loss_at: Callable[[int], torch.Tensor], positions_at: Callable[[int], int] = lambda step: 0
            ) -> TrainResult:
        """loss_at(step) -> scalar loss of that step's batch (the same batch on every run);
        positions_at(step) -> its training positions (counted into the result and the hook)."""
        from tqdm.auto import tqdm

        start = self.resume()
        res = TrainResult(self.total, resumed_from=start)
        bar = tqdm(total=self.total, initial=start, desc=f"train {self.kind}", disable=not self.progress,
                   dynamic_ncols=True)
        self.module.train()
        while self.step < self.total and not self.cfg.finalize:
            t0 = time.perf_counter()
            loss = loss_at(self.step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.step += 1
            res.losses.append(float(loss.detach()))  # waits for the device: the step's time is its own
            if not math.isfinite(res.losses[-1]):
                bar.close()
                raise ValueError(non_finite_loss(self.step, res.losses[-1], self.out))
            took = time.perf_counter() - t0
            self.seconds += took
            n = positions_at(self.step - 1)
            res.positions += n
            bar.set_postfix(loss=f"{res.losses[-1]:.3f}")
            bar.update(1)
            stopping = self.cfg.stop_after is not None and self.step - start >= self.cfg.stop_after
            if self.hook is not None and self.hook(self.module, self.step, took, n):
                stopping = True
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


def non_finite_loss(step: int, loss: float, out: Path) -> str:
    """Why a run stopped at a loss that is not finite: its step's update is not checkpointed, so no
    head of NaN weights is written (an earlier checkpoint of finite steps stays)."""
    return (f"the loss of step {step} is {loss} (not finite); training stopped without writing a head to {out}: "
            "features with inf or NaN (fp16 shards of a target whose outputs pass fp16's range: extract them "
            "again) or settings that overflow (--lr, --reg-weight)")


def loss_summary(res: TrainResult, out: Path) -> dict[str, list[float]]:
    """A report's first and last losses; a rerun of a finished run trains no step, so it keeps
    those of the run's earlier ``train_report.json`` instead of writing empty lists over them."""
    earlier = out / "train_report.json"
    if not res.losses and earlier.is_file():
        old = json.loads(earlier.read_text())
        return {k: old[k] for k in ("first_losses", "last_losses") if k in old}
    return {"first_losses": [round(x, 4) for x in res.losses[:5]],
            "last_losses": [round(x, 4) for x in res.losses[-5:]]}


def write_report(out: Path, info: dict[str, Any]) -> None:
    """``out/train_report.json``, written whole or not at all (``files.write_atomic``): a failed
    write keeps the earlier report and raises ``WriteError`` naming the file."""
    text = json.dumps(info, indent=2) + "\n"
    write_atomic(out / "train_report.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
