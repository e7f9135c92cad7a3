"""EAGLE drafter training on streamed feature shards, with the EAGLE-3 elements as switches so
each one's effect can be measured (the README's ablation table):

- training-time test (``unroll`` > 1): step s reads the features the drafter itself predicted at
  step s-1 and attends exactly as when drafting (real keys up to j-s, then its own draft path);
- fused low/mid/high target layers as input (``EagleConfig.feature_layers``) instead of the last
  hidden state;
- a draft vocabulary of the most frequent assistant tokens (``draft_vocab``), with id maps;
- the loss on the target's own next-token distribution (``loss: soft``), rebuilt from the stored
  last hidden state and logsumexp, instead of its greedy token or the data's token.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spec_plugins.heads.common import save_head
from spec_plugins.heads.eagle import EagleDrafter
from spec_plugins.training.batches import (EagleBatch, ShardCache, Window, batches_for_steps, data_identity,
                                           eagle_batch, epoch_batches, epoch_steps, plan_windows, soft_labels,
                                           step_mask, token_counts, unroll_masks)
from spec_plugins.training.features import ShardSource
from spec_plugins.training.trainer import (IGNORE, Loop, StepHook, TrainConfig, TrainResult, loss_summary, map_vocab,
                                            write_report)


def unrolled(model: EagleDrafter, b: EagleBatch, steps: int, noise: float = 0.0) -> list[torch.Tensor]:
    """The drafter's output features [B, T, H] at each unroll step. Step s at query j continues
    the draft that started from the real feature at j - s."""
    B, T, _ = b.feat.shape
    x0 = model.project(b.feat)
    x = x0 + noise * x0.detach().std() * torch.randn_like(x0) if noise else x0
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs = []
    for s, mask in enumerate(unroll_masks(b.valid, steps)):
        k0 = torch.cat(ks, 2) if ks else x.new_zeros(B, model.config.num_kv_heads, 0, model.config.head_dim)
        v0 = torch.cat(vs, 2) if vs else k0
        out, k, v = model(x, b.tok, b.pos, k0, v0, mask)
        ks.append(k)
        vs.append(v)
        outs.append(out)
        x = torch.cat([x0[:, :1], out[:, :-1]], 1)  # next step's input at j: this step's output at j-1
    return outs


def eagle_loss(model: EagleDrafter, b: EagleBatch, cfg: TrainConfig, vmap: torch.Tensor) -> torch.Tensor:
    outs = unrolled(model, b, cfg.unroll, cfg.noise)
    p = soft_labels(b.next_hidden, b.next_lse, model.lm_weight) if cfg.loss == "soft" else None
    hard = vmap[b.top1 if cfg.loss == "top1" else b.data_next]
    total = b.feat.new_zeros(())
    for s, out in enumerate(outs):
        ok = step_mask(b, s)
        n = ok.sum().clamp_min(1)
        logq = model.logits(out).float().log_softmax(-1)
        if p is not None:
            ce = -(p * logq).sum(-1)
        else:
            lab = torch.where(ok, hard, torch.full_like(hard, IGNORE))
            ce = nn.functional.nll_loss(logq.flatten(0, 1), lab.flatten(), ignore_index=IGNORE,
                                        reduction="none").view_as(lab)
        loss = (ce * ok).sum() / n
        if cfg.reg_weight:
            reg = nn.functional.smooth_l1_loss(out, b.next_hidden, reduction="none").mean(-1)
            loss = loss + cfg.reg_weight * (reg * ok).sum() / n
        total = total + cfg.step_decay ** s * loss
    return total


@torch.no_grad()
def evaluate(model: EagleDrafter, store: ShardSource, window: int = 512, steps: int = 5, batch: int = 4,
             max_windows: int | None = None) -> dict[str, Any]:
    """Held-out top-1 (the drafter's token == the target's greedy token) per unroll step, and
    the chain length the drafter would get accepted along the held-out text: 1 + sum over depth
    d of P(steps 0..d all right), a draft from position i being right at depth s when the
    step-s prediction at query i + s is."""
    model.eval()
    fused = bool(model.config.feature_layers)
    windows = plan_windows(store, window)[:max_windows]
    cache = ShardCache(store)
    hit = [[0, 0] for _ in range(steps)]
    chain = [0] * steps
    starts = 0
    for bw in epoch_batches(windows, batch, seed=0, epoch=0):
        b = eagle_batch(cache.get(bw[0].shard), bw, fused)
        right = []
        for s, out in enumerate(unrolled(model, b, steps)):
            ok = step_mask(b, s)
            pred = model.vocab_ids[model.logits(out).argmax(-1)]
            r = (pred == b.top1) & ok
            hit[s][0] += int(r.sum())
            hit[s][1] += int(ok.sum())
            right.append(r)
        start_ok = step_mask(b, 0)
        starts += int(start_ok.sum())
        chain = [a + c for a, c in zip(chain, chain_lengths(right, start_ok))]
    top1 = [round(a / max(n, 1), 4) for a, n in hit]
    return {"top1_by_step": top1, "accepted_along_text": round(1 + sum(c / max(starts, 1) for c in chain), 3),
            "positions": starts, "windows": len(windows)}


def chain_lengths(right: list[torch.Tensor], start: torch.Tensor) -> list[int]:
    """Per depth s: how many drafts (one per starting query i in ``start``) are right at every
    depth up to s, where depth s of the draft from i is the step-s prediction at query i + s."""
    alive = start.clone()
    out = []
    for s, r in enumerate(right):
        shifted = torch.zeros_like(r)  # a depth past the window's last query: no draft reaches it
        n = max(0, r.shape[1] - s)
        shifted[:, :n] = r[:, s: s + n]
        alive &= shifted
        out.append(int(alive.sum()))
    return out


def build_drafter(target_model: Any, vocab_ids: torch.Tensor, feature_layers: tuple[int, ...],
                  intermediate: int | None = None, cls: type[EagleDrafter] = EagleDrafter, **extra: Any) -> EagleDrafter:
    """A fresh drafter of class ``cls`` sized from the target's config (``extra``: the fields
    its config class adds)."""
    from spec_plugins.heads.common import target_lm_parts

    mc = target_model.config
    lm, emb = target_lm_parts(target_model)
    heads = int(getattr(mc, "num_attention_heads", 4))
    kv = int(getattr(mc, "num_key_value_heads", heads) or heads)
    rope = (getattr(mc, "rope_parameters", None) or {}).get("rope_theta") or getattr(mc, "rope_theta", 1e4)
    H = lm.shape[1]
    hcfg = cls.config_class(H, num_heads=heads, num_kv_heads=kv, intermediate_size=intermediate or 2 * H,
                            rope_theta=float(rope), draft_vocab_size=int(vocab_ids.numel()),
                            feature_layers=feature_layers, **extra)
    return cls(hcfg, lm.float(), emb.float(), vocab_ids).to(lm.device)  # trained where the target is


def draft_vocab(store: ShardSource, windows: list[Window], size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent assistant tokens of the training data (ascending ids), and the
    share of assistant tokens they cover."""
    from spec_plugins.heads.common import draft_vocab as pick

    counts = token_counts(store, vocab, windows)
    ids = pick(counts, size)
    return ids, float(counts[ids].sum()) / max(1, int(counts.sum()))


def check_parallel(block_size: int, window: int, block_layers: int = 0, block_context: bool = False) -> None:
    """Refuse a parallel drafter's options before a target loads or a step runs: the drafter
    config's own checks (on a stand-in width) and the window's (``check_block_size``)."""
    from spec_plugins.heads.parallel import ParallelConfig
    from spec_plugins.training import parallel_train as par

    ParallelConfig(1, block_size=block_size, block_layers=block_layers, block_context=block_context)
    par.check_block_size(block_size, window)


def train_eagle(store: ShardSource, target_model: Any, cfg: TrainConfig, out: str | Path, fused: bool = True,
                vocab_size: int = 8192, intermediate: int | None = None, heldout: ShardSource | None = None,
                progress: bool = True, hook: StepHook | None = None, block_size: int | None = None,
                anchors: int = 32, init: str | Path | None = None, anchor_input: bool = True,
                block_layers: int = 0, block_context: bool = False) -> dict[str, Any]:
    """Train (or resume) a drafter on ``store``; returns the report written to train_report.json.
    ``hook`` runs after every step (snapshots, a deadline: ``trainer.StepHook``). With
    ``block_size`` the drafter is a parallel one (``parallel_train``: ``anchors`` blocks per window,
    ``block_layers`` layers over each block, seeing the context with ``block_context``).
    ``init``: a trained EAGLE or parallel head to start from (its layer, draft vocabulary in
    place of ``vocab_size``, and width: an ``intermediate`` other than the head's is refused; a
    parallel drafter's block inputs and block layers start fresh where the head has none; a
    tensor it holds in another shape, e.g. another block size or width, is refused by name)."""
    from spec_plugins.training import parallel_train as par

    parallel = block_size is not None  # 0 and 1 included: refused by name, not trained as an EAGLE head
    if block_size is not None:
        check_parallel(block_size, cfg.window, block_layers, block_context)
    out = Path(out)
    torch.manual_seed(cfg.seed)
    layers = tuple(store.meta["layers"]) if fused else ()
    if fused and not layers:
        raise ValueError(f"{store.directory} holds no layer outputs (extracted with --layers none); use --no-fused")
    windows = plan_windows(store, cfg.window, cfg.max_train_tokens)
    if not windows:
        raise ValueError(f"no training windows in {store.directory}")
    V = target_model.get_output_embeddings().weight.shape[0]
    start = _start_from(init, layers, V, intermediate) if init is not None else None
    if start is not None:
        vocab_ids, intermediate = start[1]["vocab_ids"], int(start[0]["intermediate_size"])
        counts = token_counts(store, V, windows)
        coverage = float(counts[vocab_ids].sum()) / max(1, int(counts.sum()))
    else:
        vocab_ids, coverage = draft_vocab(store, windows, vocab_size, V)
    if parallel:
        model = build_drafter(target_model, vocab_ids, layers, intermediate, par.ParallelDrafter, block_size=block_size,
                              anchor_input=anchor_input, block_layers=block_layers, block_context=block_context)
    else:
        model = build_drafter(target_model, vocab_ids, layers, intermediate)
    if start is not None:
        _check_shapes(init, start[1], model)  # type: ignore[arg-type]
        _check_target(init, *start, target_model)  # type: ignore[arg-type]
        missing, unexpected = model.load_state_dict(start[1], strict=False)
        if unexpected or [k for k in missing if k != "block_inputs" and not k.startswith("refiner.")]:
            raise ValueError(f"{init} does not hold weights this drafter can start from "
                             f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})")
    vmap = map_vocab(model.vocab_ids, V)
    recipe = {"init": str(init) if init is not None else None, "anchors": anchors if parallel else None,
              "anchor_input": anchor_input if parallel else None,
              "block_layers": block_layers if parallel else None,
              "block_context": block_context if parallel else None}
    loop = Loop(model, cfg, out, epoch_steps(windows, cfg.batch_size), model.kind, model.config.to_dict(), progress,
                hook, data_identity(store, windows, model.vocab_ids) | recipe)
    plan = dict(batches_for_steps(windows, cfg.batch_size, cfg.seed, loop.total))
    cache = ShardCache(store)

    def loss_at(step: int) -> torch.Tensor:
        bw = plan[step]
        torch.manual_seed(cfg.seed * 7919 + step)  # noise and anchors reproducible across resume
        b = eagle_batch(cache.get(bw[0].shard), bw, fused)
        if parallel:
            return par.parallel_loss(model, b, cfg, anchors)  # type: ignore[arg-type]
        return eagle_loss(model, b, cfg, vmap)

    res = loop.run(loss_at, lambda step: sum(w.length for w in plan[step]))
    return _finish(model, res, cfg, out, store, windows, coverage, heldout, recipe)


def check_init(init: str | Path, vocab_size: int | None = None, intermediate: int | None = None
               ) -> tuple[dict, dict[str, torch.Tensor]]:
    """The (config, weights) of the head ``init`` names, refused when it cannot start this
    training: its kind first (another kind's config has none of the fields the rest reads), then
    a draft vocabulary or MLP width asked for (None: the head's) that the head's would override."""
    from spec_plugins.heads.common import load_head

    cfg, state = load_head(init)
    kind = cfg.get("kind", "eagle")  # a head saved before configs named their kind is an EAGLE one
    if kind not in ("eagle", "parallel"):
        raise ValueError(f"{init} holds a {kind} head; --init starts from an eagle or parallel head")
    asked = {"--draft-vocab": (vocab_size, "draft_vocab_size"), "--intermediate": (intermediate, "intermediate_size")}
    for flag, (value, field) in asked.items():
        if value is not None and value != cfg.get(field):
            raise ValueError(f"{flag} {value}, but {init} was trained with {field} {cfg.get(field)} and --init "
                             f"keeps it: leave {flag} out or start fresh (no --init)")
    return cfg, state


def _start_from(init: str | Path, layers: tuple[int, ...], vocab: int, intermediate: int | None = None
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A trained head's (config, weights) to start from (``check_init``), checked against the
    features and the target's vocabulary of ``vocab`` tokens."""
    cfg, state = check_init(init, None, intermediate)
    if tuple(cfg.get("feature_layers", ())) != layers:
        raise ValueError(f"{init} reads feature layers {cfg.get('feature_layers')}, these features hold {list(layers)}")
    top = int(state["vocab_ids"].max()) if "vocab_ids" in state and state["vocab_ids"].numel() else -1
    if top >= vocab:
        raise ValueError(f"{init} drafts token id {top}, outside this target's vocabulary of {vocab}")
    return cfg, state


def _check_shapes(init: str | Path, state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Every tensor the head holds must fit the drafter as it is: one in another shape (another
    block size, hidden or MLP width) would be trained weights dropped, not a part that starts fresh."""
    own = model.state_dict()
    bad = [f"{k} {list(v.shape)} (this drafter: {list(own[k].shape)})" for k, v in state.items()
           if k in own and v.shape != own[k].shape]
    if bad:
        raise ValueError(f"{init} does not fit this drafter: {'; '.join(bad)}; start it fresh (no --init) or "
                         "give the settings the head was trained with")


def _check_target(init: str | Path, cfg: dict, state: dict[str, torch.Tensor], target_model: Any) -> None:
    """The head must have been trained for ``target_model``, as loading it to draft requires
    (``check_target_fit``): one trained for another target of the same shapes would start this
    training from that target's draft vocabulary and weights, and be saved as trained for this one.
    A head that records no fingerprint is checked on shapes only, as at load time."""
    from spec_plugins.heads.common import check_target_fit, target_lm_parts

    lm, emb = target_lm_parts(target_model)
    try:
        check_target_fit(int(cfg["hidden_size"]), state["vocab_ids"], lm, emb, cfg, target_model)
    except ValueError as exc:
        raise ValueError(f"{init} cannot start training on this target: {exc}") from None


def _finish(model: EagleDrafter, res: TrainResult, cfg: TrainConfig, out: Path, store: ShardSource,
            windows: list[Window], coverage: float, heldout: ShardSource | None,
            recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    if not res.finished:
        return {"kind": model.kind, "finished": False, "steps_done": res.steps, "steps": res.scheduled,
                "checkpoint": str(out / "checkpoint.pt")}
    tokens = sum(w.length for w in windows)
    report: dict[str, Any] = {
        "kind": model.kind, "finished": True, "target": store.meta["target"], "features": store.meta,
        "train_tokens": tokens, "train_windows": len(windows), "draft_vocab": int(model.vocab_ids.numel()),
        "draft_vocab_coverage": round(coverage, 4), "train_seconds": round(res.seconds, 1), "steps": res.steps,
        "scheduled_steps": res.scheduled, "resumed_from": res.resumed_from, "train": asdict(cfg) | (recipe or {}),
        **loss_summary(res, out),
    }
    if heldout is not None:
        from spec_plugins.training.parallel_train import ParallelDrafter, evaluate_parallel

        score = evaluate_parallel if isinstance(model, ParallelDrafter) else evaluate
        report["heldout"] = score(model, heldout, cfg.window)
    save_head(model, {**model.config.to_dict(), "target": store.meta["target"], "train": asdict(cfg),  # named if refused
                      "train_seconds": report["train_seconds"], "steps": res.steps, "train_tokens": tokens,
                      "heldout": report.get("heldout")}, out)
    report["head_bytes"] = (out / "head.safetensors").stat().st_size
    write_report(out, report)
    return report
