"""The device side of ``scripts/train_heads_gpu.py``: one process that loads the target, computes
its features in big prefills and trains the heads on them, within a wall-clock deadline.

A lent GPU gives a few minutes per call and only what the call leaves under ``$OUT`` comes back,
so the run (1) snapshots each head (fp16 ``head.safetensors`` + ``config.json`` +
``train_report.json``) and ``run.json`` into ``out`` at intervals, so a run cut off by the call's
limit still returns a head; (2) stops training at ``until - reserve`` and writes the head from
its last weights (the trainers' ``--finalize`` path), held-out numbers included; (3) trains the
Medusa heads from the same token shards only with the time left. The training itself is
``train_eagle`` / ``train_medusa`` over ``live.LiveFeatures``: the trainer of the CPU runs.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from spec_plugins.backends.torch_runtime import pick_device
from spec_plugins.files import write_text_atomic

HEAD_FILES = ("head.safetensors", "config.json", "train_report.json")
HEADS = ("eagle", "parallel")  # what ``heads`` may list (medusa: the ``medusa`` switch)


@dataclass(frozen=True)
class RunOptions:
    device: str = "auto"  # auto: cuda when there is one
    dtype: str = "bfloat16"  # the target's weights and activations
    batch_size: int = 8  # EAGLE windows per step
    window: int = 512
    epochs: float = 1.0
    lr: float = 1e-3
    unroll: int = 3
    draft_vocab: int = 8192
    max_steps: int | None = None
    prefill_tokens: int = 65536  # padded positions per target forward
    medusa: bool = True
    medusa_batch: int = 8
    medusa_min_s: float = 60.0  # start the Medusa heads only with this much time left
    until: float = math.inf  # wall clock (time.time()) by which every head is written
    reserve_s: float = 30.0  # kept for finalising a head (held-out features, evaluation, writing)
    snapshot_s: float = 60.0  # head snapshots into out at least this often...
    snapshot_steps: int = 0  # ... and every N steps (0: by time only)
    save_every: int = 500  # optimizer checkpoints (work dir, resumable) every N steps
    tf32: bool = True  # TF32 float32 matmuls: the soft labels' logsumexp and their rebuild alike (~1e-3 relative)
    seed: int = 0
    heads: tuple[str, ...] = ("eagle",)  # trained in this order: eagle, parallel (medusa: the ``medusa`` switch)
    block_size: int = 8  # the parallel drafter's draft positions per forward
    anchors: int = 64  # blocks trained per window per step
    block_layers: int = 2  # the parallel drafter's decoder layers over each block
    block_context: bool = False  # ... and whether they attend to the committed pairs too
    distill_s: float = 0.0  # seconds of self-distillation before training (0: train on the bundle's answers)
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)  # self-distillation: greedy once, the others sampled
    samples: int = 1  # draws per sampled temperature
    gen_rows: int = 128  # batch rows per target forward while answering
    gen_max_new: int = 512  # longest answer per turn
    gen_max_seq: int = 2048  # regenerated conversations cut here

    def __post_init__(self) -> None:
        """Refuse options no head could be trained with, by name, before ``run`` loads the target
        or self-distils (minutes on a lent GPU): the checks the trainers and the regeneration
        would make only then."""
        from spec_plugins.heads.common import config_number
        from spec_plugins.training.eagle_train import check_parallel
        from spec_plugins.training.self_distill import variants

        unknown = [h for h in self.heads if h not in HEADS]
        if unknown or not self.heads:
            raise ValueError(f"heads {list(self.heads)}: expected one or more of {list(HEADS)}")
        for name in ("anchors", "gen_rows", "gen_max_new", "gen_max_seq"):
            config_number(name, getattr(self, name), integer=True)
        variants(self.temperatures, self.samples)
        if "parallel" in self.heads:
            check_parallel(self.block_size, self.window, self.block_layers, self.block_context)


class Watch:
    """The trainer's step hook for one head: step times without feature time, positions seen,
    snapshots into ``out`` and the deadline."""

    def __init__(self, kind: str, features: Any, out: Path, opts: RunOptions, write_run: Callable[[], None]) -> None:
        self.kind, self.features, self.out, self.opts, self.write_run = kind, features, out, opts, write_run
        self.step_seconds: list[float] = []
        self.positions = 0
        self.steps = 0
        self.snapshots: list[dict] = []
        self.stopped_early = False
        self._feature_start = (features.seconds, features.extracted)
        self._feature_seconds = features.seconds
        self._t0 = self._last = time.time()

    def __call__(self, module: nn.Module, step: int, seconds: float, positions: int) -> bool:
        feat = self.features.seconds - self._feature_seconds  # a step that loaded a shard paid for its features
        self._feature_seconds = self.features.seconds
        self.step_seconds.append(max(0.0, seconds - feat))
        self.positions += positions
        self.steps = step
        now = time.time()
        every = self.opts.snapshot_steps
        if (every and step % every == 0) or now - self._last >= self.opts.snapshot_s:
            self.snapshot(module, step)
        self.stopped_early = now >= self.opts.until - self.opts.reserve_s
        return self.stopped_early

    def snapshot(self, module: nn.Module, step: int) -> None:
        from spec_plugins.heads.common import save_head

        info = {"snapshot": True, "steps": step, "tokens_seen": self.positions}
        save_head(module, {**module.config.to_dict(), **info}, self.out)  # type: ignore[operator]
        report = {"kind": self.kind, "finished": False, **info, "features": self.features.meta,
                  "head_bytes": (self.out / "head.safetensors").stat().st_size}
        write_text_atomic(self.out / "train_report.json", json.dumps(report, indent=2) + "\n")
        self._last = time.time()
        self.snapshots.append({"step": step, "seconds": round(self._last - self._t0, 1)})
        self.write_run()

    def summary(self) -> dict[str, Any]:
        s = self.step_seconds
        q = statistics.quantiles(s, n=10) if len(s) >= 2 else s
        secs, toks = self._feature_start
        # tokens_seen: the positions (window queries) the head was trained on in this run
        return {"steps_this_run": len(s), "tokens_seen": self.positions, "stopped_by_deadline": self.stopped_early,
                "step_seconds": {"mean": round(statistics.fmean(s), 5) if s else None,
                                 "median": round(statistics.median(s), 5) if s else None,
                                 "p90": round(q[-1], 5) if s else None, "sum": round(sum(s), 2)},
                "feature_seconds": round(self.features.seconds - secs, 2), "feature_tokens": self.features.extracted - toks,
                "snapshots": self.snapshots}


def load_target(bundle: Path, entry: dict, dtype: str, device: torch.device) -> Any:
    """The bundle's target: a GGUF (dequantised by transformers, as ``load_hf`` does) or a
    transformers directory; no tokenizer (the tokens were made where the data is)."""
    from spec_plugins.backends.torch_runtime import load_weights

    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    path = bundle / entry["path"]
    if entry["format"] == "gguf":
        return load_weights(str(path.parent), dt, device, gguf_file=path.name)
    if entry["format"] == "transformers":
        return load_weights(str(path), dt, device)
    raise ValueError(f"bundle model format {entry['format']!r}: expected gguf or transformers")


def run(bundle: str | Path, out: str | Path, work: str | Path, opts: RunOptions) -> dict[str, Any]:
    """Train the heads from an unpacked bundle; returns the report also written to out/run.json."""
    from spec_plugins.heads.eagle import default_feature_layers
    from spec_plugins.training.eagle_train import train_eagle
    from spec_plugins.training.live import LiveFeatures
    from spec_plugins.training.medusa_train import train_medusa
    from spec_plugins.training.tokens import TokenStore, seconds_per_million
    from spec_plugins.training.trainer import TrainConfig

    bundle, out, work = Path(bundle), Path(out), Path(work)
    t_start = time.time()
    man = json.loads((bundle / "manifest.json").read_text())
    dev = pick_device(opts.device)
    torch.manual_seed(opts.seed)
    report: dict[str, Any] = {"options": {k: (None if v == math.inf else v) for k, v in asdict(opts).items()},
                              "bundle": {k: man[k] for k in ("created", "model", "tokens", "smoke") if k in man},
                              "device": _device_info(dev), "phases": {}, "heads": {}}
    out.mkdir(parents=True, exist_ok=True)
    running: dict[str, Watch] = {}

    def write() -> None:  # run.json as it stands: a run cut off by the call's limit still reports itself
        for k, w in running.items():
            report["heads"][k] = {"running": True, **w.summary()}
        write_text_atomic(out / "run.json", json.dumps(report, indent=2) + "\n")

    t0 = time.time()
    model = load_target(bundle, man["model"], opts.dtype, dev)
    report["phases"]["load_target_s"] = round(time.time() - t0, 2)
    if opts.tf32:
        torch.set_float32_matmul_precision("high")
    layers = default_feature_layers(int(model.config.num_hidden_layers))
    name = man["model"]["name"]
    tokens = TokenStore(bundle / "tokens" / "train")
    if opts.distill_s > 0:  # the target's own answers first, then features over them
        t0 = time.time()
        made = distill(model, tokens, work / "self-tokens", opts, min(opts.until, t0 + opts.distill_s), dev)
        report["self_distill"] = {k: made[k] for k in ("tokens", "trained_tokens", "conversations", "exhausted")}
        took = time.time() - t0
        report["self_distill"] |= {"seconds": round(took, 1),
                                   "seconds_per_million_tokens": seconds_per_million(took, made["tokens"])}
        if made["conversations"]:
            tokens = TokenStore(work / "self-tokens")
        else:  # no answer came back: the written ones, recorded and said on stderr
            report["self_distill"]["fallback"] = _fallback(made)
            print(f"self-distillation: {report['self_distill']['fallback']}", file=sys.stderr, flush=True)
        write()
    train = LiveFeatures(tokens, model, layers, name, opts.prefill_tokens)
    held = LiveFeatures(TokenStore(bundle / "tokens" / "heldout"), model, layers, name, opts.prefill_tokens)
    base = TrainConfig(epochs=opts.epochs, batch_size=opts.batch_size, window=opts.window, lr=opts.lr,
                       max_steps=opts.max_steps, save_every=opts.save_every, seed=opts.seed, loss="soft",
                       unroll=opts.unroll)

    def eagle(cfg: TrainConfig, hook: Any) -> dict:
        return train_eagle(train, model, cfg, work / "eagle", True, opts.draft_vocab, None, held, False, hook)

    def parallel(cfg: TrainConfig, hook: Any) -> dict:
        return train_eagle(train, model, cfg, work / "parallel", True, opts.draft_vocab, None, held, False, hook,
                           block_size=opts.block_size, anchors=opts.anchors, block_layers=opts.block_layers,
                           block_context=opts.block_context)

    def medusa(cfg: TrainConfig, hook: Any) -> dict:
        return train_medusa(train, model, cfg, work / "medusa", 4, opts.draft_vocab, held, False, hook)

    known = {"eagle": eagle, "parallel": parallel}  # HEADS, checked by RunOptions
    plans: list[tuple[str, TrainConfig, Callable[[TrainConfig, Any], dict]]] = [(h, base, known[h]) for h in opts.heads]
    if opts.medusa:
        plans.append(("medusa", replace(base, batch_size=opts.medusa_batch), medusa))
    for n, (kind, cfg, train_head) in enumerate(plans):
        left = opts.until - time.time()
        if n and left < opts.medusa_min_s + opts.reserve_s:
            report["heads"][kind] = {"skipped": f"{left:.0f} s left, fewer than {opts.medusa_min_s + opts.reserve_s:.0f}"}
            continue
        watch = running[kind] = Watch(kind, train, out / kind, opts, write)
        t0 = time.time()
        rep = train_head(cfg, watch)
        if not rep["finished"]:  # the deadline: the head from the last weights, evaluated
            rep = train_head(replace(cfg, finalize=True), None)
        (out / kind).mkdir(parents=True, exist_ok=True)  # no snapshot yet when the run was short
        for f in HEAD_FILES:
            shutil.copyfile(work / kind / f, out / kind / f)
        _stamp(out / kind / "train_report.json", report["device"])
        del running[kind]
        report["heads"][kind] = {**watch.summary(), "wall_s": round(time.time() - t0, 1), "steps": rep["steps"],
                                 "scheduled_steps": rep["scheduled_steps"], "train_tokens_per_epoch": rep["train_tokens"],
                                 "heldout": rep.get("heldout"), "head_bytes": rep["head_bytes"]}
        write()
    report["phases"]["total_s"] = round(time.time() - t_start, 1)
    report["phases"]["heldout_feature_s"] = round(held.seconds, 2)
    if dev.type == "cuda":
        report["device"]["max_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    write()
    return report


def distill(model: Any, prompts: Any, out: Path, opts: RunOptions, deadline: float,
            dev: torch.device) -> dict[str, Any]:
    """The target's own answers to every turn of the bundle's conversations (``self_distill``),
    on the static cache (CUDA graphs on a GPU), until ``deadline``: every answer made by then is
    kept (``exhausted`` false when the deadline left work). Returns the token shards' state
    (``out/meta.json``); ``conversations`` 0 when the deadline came before the first answers."""
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.backends.torch_static import StaticTorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.training.self_distill import regenerate, variants
    from spec_plugins.training.sources import fit_max_seq
    from spec_plugins.training.tokens import write_meta, write_token_shards

    cuda = dev.type == "cuda"
    runtime = StaticTorchRuntime(model, graphs=True) if cuda else TorchRuntime(model)
    fit_max_seq(opts.gen_max_seq, runtime.max_context, "gen_max_seq")
    ways = variants(opts.temperatures, opts.samples)
    convs = (c for i in range(len(prompts.shards)) for c in prompts.conversations(i))
    stopped = False

    def due() -> bool:  # regenerate asks only while work is left: True here means the deadline cut it
        nonlocal stopped
        stopped = stopped or time.time() >= deadline
        return stopped

    meta = {**prompts.state.get("meta", {}), "responses": "self", "variants": [asdict(w) for w in ways],
            "max_new_tokens": opts.gen_max_new, "rows": opts.gen_rows}
    rows = regenerate(SpeculativeDecoder(runtime), convs, ways, opts.gen_max_new, opts.gen_max_seq, opts.gen_rows, due)
    state = write_token_shards(rows, out, meta, prompts.state["vocab"], 1 << 40, 1_000_000, allow_empty=True)
    if stopped:
        state["exhausted"] = False
        write_meta(out, state)
    return state


def _fallback(state: dict[str, Any]) -> str:
    """Why the run trains on the bundle's written answers although self-distillation was asked for."""
    why = "no conversation had a turn to answer" if state["exhausted"] else \
        "the deadline (--distill-s) came before the first answers"
    return f"{why}; training on the bundle's written answers instead"


def _stamp(path: Path, device: dict[str, Any]) -> None:
    """Name the machine a head was trained on in its report (the data curve's "machine" column)."""
    rep = json.loads(path.read_text())
    rep["trained_on"] = f"{device.get('name', device['type'])} (torch {device['torch']}, transformers {device['transformers']})"
    write_text_atomic(path, json.dumps(rep, indent=2) + "\n")


def _device_info(dev: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {"type": dev.type, "torch": torch.__version__, "transformers": transformers.__version__}
    if dev.type == "cuda":
        info["name"] = torch.cuda.get_device_name(dev)
    return info
