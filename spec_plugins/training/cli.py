"""``spec-plugins train {features,eagle,medusa}``: drafter training on this machine, resumable.

1. ``train features`` runs the target over training conversations once and writes 16-bit feature
   shards (``spec_plugins.training.features``): ShareGPT as written (``--responses fixed``) or
   answers the target regenerates (``--responses self``), or the shipped template prompts.
2. ``train eagle`` / ``train medusa`` stream those shards into a head (``DIR/head.safetensors``,
   fp16, + ``config.json`` + ``train_report.json``); a rerun resumes from ``DIR/checkpoint.pt``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import typer

from spec_plugins.backends.llamacpp_config import MAX_THREADS
from spec_plugins.cli import app, check_finite, check_output_dir, fail

train_app = typer.Typer(no_args_is_help=True, help="Train drafters: extract target features, then train heads.")
app.add_typer(train_app, name="train")


# options the head commands share (one declaration each)
FEATURES = typer.Option(..., "--features", help="Feature shards from `spec-plugins train features`.")
HEAD_OUT = typer.Option(..., "--out", help="Head directory (head.safetensors, config.json, checkpoint.pt).")
HELDOUT = typer.Option(None, "--heldout", help="Held-out feature shards for the report.")
FUSED = typer.Option(True, "--fused/--no-fused", help="EAGLE-3 fused low/mid/high layers, or the last hidden.")
DRAFT_VOCAB = typer.Option(8192, "--draft-vocab", min=16, help="Most frequent answer tokens drafted.")
INTERMEDIATE = typer.Option(None, "--intermediate", min=1, help="MLP width (default 2 x hidden).")
EPOCHS = typer.Option(1.0, "--epochs", min=0.0, help="Passes over the training windows (above 0; fractions allowed).")
WINDOW = typer.Option(512, "--window", min=8, help="Positions per window.")
LR = typer.Option(1e-3, "--lr")
MAX_TRAIN_TOKENS = typer.Option(None, "--max-train-tokens", min=1,
                                help="Train on the first N tokens only (data-size sweep).")
MAX_STEPS = typer.Option(None, "--max-steps", min=1)
STOP_AFTER = typer.Option(None, "--stop-after", min=1, help="Leave after N steps; rerun to resume.")
FINALIZE = typer.Option(False, "--finalize", help="Write the head from the last checkpoint now.")
THREADS = typer.Option(2, "--threads", min=1, max=MAX_THREADS)
SEED = typer.Option(0, "--seed", min=0, max=2**32 - 1)  # trainer.MAX_SEED: derived seeds stay in int64
NO_PROGRESS = typer.Option(False, "--no-progress")


@train_app.command("features")
def features_cmd(
    out: Path = typer.Option(..., "--out", help="Directory for the shards and progress.json (resumable)."),
    target: str = typer.Option("smollm2-135m-instruct", "--target", help="Target model (built-in name, .gguf, dir)."),
    source: str = typer.Option("sharegpt", "--source", help="sharegpt (the \\[train] extra), prompts (a JSONL file), "
                                                            "or tokens (token shards, e.g. from `train self-distill`)."),
    tokens: Optional[Path] = typer.Option(None, "--tokens", help="--source tokens: the token shard directory."),
    responses: str = typer.Option("fixed", "--responses",
                                  help="fixed: answers as written; self: the target regenerates them (greedy)."),
    split: str = typer.Option("train", "--split", help="ShareGPT split by conversation id: train or heldout."),
    max_tokens: int = typer.Option(1_000_000, "--max-tokens", min=1, help="Stop after this many tokens in all."),
    max_seq: Optional[int] = typer.Option(None, "--max-seq", min=16, help="Cut each conversation to this many tokens "
                                         "(at most the target's context; default 1024 within it)."),
    layers: str = typer.Option("auto", "--layers", help="Decoder layer outputs to keep: auto (low/mid/high), "
                                                        "none, or e.g. 3,15,28."),
    language: str = typer.Option("en", "--language", help="en (mostly Latin script) or any."),
    heldout_share: float = typer.Option(0.02, "--heldout-share", min=0.0, max=0.5),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="--source prompts: JSONL with a `prompt` field "
                                                                   "(default: the shipped train.jsonl, examples/prompts "
                                                                   "in the source tree)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                 help="--responses self: answer length (default 256)."),
    gen_backend: Optional[str] = typer.Option(None, "--gen-backend",
                                              help="--responses self: runtime that answers (default onnxruntime)."),
    gen_batch: Optional[int] = typer.Option(None, "--gen-batch", min=1,
                                            help="--responses self: rows per target forward (default 16)."),
    shard_tokens: int = typer.Option(32768, "--shard-tokens", min=256),
    threads: int = typer.Option(2, "--threads", min=1, max=MAX_THREADS, help="torch threads."),
    no_progress: bool = NO_PROGRESS,
) -> None:
    """Run the target once over training conversations and write feature shards."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name, val, allowed in (("--source", source, ("sharegpt", "prompts", "tokens")),
                               ("--responses", responses, ("fixed", "self")),
                               ("--split", split, ("train", "heldout")), ("--language", language, ("en", "any"))):
        if val not in allowed:
            fail(f"{name} {val!r}; allowed values: {', '.join(allowed)}")
    if source == "prompts" and responses == "fixed":
        fail("--source prompts has no written answers; use --responses self")
    if source == "tokens" and responses == "self":
        fail("--source tokens reads answers already made (e.g. by `train self-distill`); drop --responses self")
    if (source == "tokens") != (tokens is not None):
        fail("--tokens DIR goes with --source tokens (and --source tokens needs it)")
    if prompts is not None and source != "prompts":
        fail(f"--prompts goes with --source prompts (it does nothing with --source {source})")
    picked = {"--split": split != "train", "--language": language != "en", "--heldout-share": heldout_share != 0.02}
    for flag in (f for f, given in picked.items() if given and source != "sharegpt"):
        fail(f"{flag} picks ShareGPT conversations (it does nothing with --source {source})")
    gen = {"--max-new-tokens": max_new_tokens, "--gen-backend": gen_backend, "--gen-batch": gen_batch}
    for flag in (f for f, v in gen.items() if v is not None and responses != "self"):
        fail(f"{flag} goes with --responses self (it does nothing with --responses {responses})")
    check_output_dir(out)
    import torch

    from spec_plugins.backends.torch_runtime import load_hf
    from spec_plugins.heads.eagle import parse_feature_layers
    from spec_plugins.training.features import extract, recorded_path, resume_state
    from spec_plugins.training.sharegpt import DataFilter, FilterCounts
    from spec_plugins.training.target_check import FINGERPRINT, model_fingerprint

    torch.set_num_threads(threads)
    flt = DataFilter(language=language)  # type: ignore[arg-type]
    counts = FilterCounts()
    try:
        if source == "tokens":
            from spec_plugins.training.tokens import TokenStore

            store = TokenStore(tokens)  # type: ignore[arg-type]
        if source == "sharegpt":
            from spec_plugins.training.sharegpt import dataset_file

            dataset_file()  # fail fast with the install hint
        texts = None
        if source == "prompts":
            from spec_plugins.training.sources import DEFAULT_PROMPTS, load_prompts, prompts_fingerprint

            texts = load_prompts(prompts or DEFAULT_PROMPTS)
        model, tok = load_hf(target, "float32", "cpu")
        from spec_plugins.training.sources import fit_max_seq

        max_seq = fit_max_seq(max_seq, getattr(model.config, "max_position_embeddings", None))
        keep = parse_feature_layers(layers, int(model.config.num_hidden_layers))
        max_new_tokens = max_new_tokens or 256
        meta = {"target": recorded_path(target), "source": source, "responses": responses, "split": split,
                "max_seq": max_seq, "layers": list(keep), "language": language, "heldout_share": heldout_share,
                "prompts": recorded_path(str(prompts)) if prompts else None,
                "max_new_tokens": max_new_tokens if responses == "self" else None,
                FINGERPRINT: model_fingerprint(model)}  # training refuses other weights at that path
        if source == "tokens":  # the shards' content too: a rerun of self-distill may have replaced them
            store.check_model(target, int(model.get_input_embeddings().weight.shape[0]))
            meta |= {"tokens": recorded_path(str(tokens)), "token_meta": store.state.get("meta"),
                     "split": store.meta.get("split"), "token shards (fingerprint)": store.fingerprint()}
        if texts is not None:  # the shipped prompts are the training ones; a file of the user's says no split
            meta |= {"prompts (fingerprint)": prompts_fingerprint(texts), "split": None if prompts else "train"}
        done = resume_state(out, meta)  # an --out made with other settings is refused before any work
        skipped = done["consumed"] if done and responses == "self" else 0  # answered by an earlier run
        if source == "tokens":
            examples = store.examples(max_seq)
        elif responses == "fixed":
            from spec_plugins.training.sources import sharegpt_examples

            examples = sharegpt_examples(tok, split, max_seq, flt, heldout_share, counts)  # type: ignore[arg-type]
        else:
            from spec_plugins.training.sources import self_examples

            dec = _decoder(gen_backend or "onnxruntime", target)
            examples = self_examples(dec, texts, split, flt, heldout_share, max_seq,  # type: ignore[arg-type]
                                     max_new_tokens, gen_batch or 16, skipped)
        t0 = time.perf_counter()
        state = extract(model, examples, out, meta, keep, max_tokens, shard_tokens, progress=not no_progress,
                        skipped=skipped)  # refuses a target whose logits are not its LM head's (first batch)
    except (FileNotFoundError, ValueError, LookupError, OSError) as exc:
        _fail(exc, out)
        return
    state = {**state, "filter_counts_this_run": counts.as_dict(), "wall_seconds_this_run": round(time.perf_counter() - t0, 1)}
    typer.echo(json.dumps({k: v for k, v in state.items() if k != "shards"} | {"shards": len(state["shards"])}, indent=1))


def _fail(exc: BaseException, out: Path) -> None:
    """``fail``; a write that failed (``files.WriteError``: a full disk, a read-only --out) says ``out`` was not written."""
    from spec_plugins.files import WriteError

    fail(f"cannot write {out}: {exc}" if isinstance(exc, WriteError) else exc)


def _decoder(backend: str, target: str) -> Any:
    """Plain decoding of ``target`` on ``backend``, built before any work so a bad backend fails first."""
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder

    return SpeculativeDecoder.from_config(SpecConfig.parse({"target": {"backend": backend, "model": target},
                                                            "proposer": None}))


@train_app.command("self-distill")
def self_distill_cmd(
    out: Path = typer.Option(..., "--out", help="Directory for the token shards (meta.json, shard-*.npz)."),
    target: str = typer.Option("smollm2-135m-instruct", "--target", help="Target model (built-in name, .gguf, dir)."),
    split: str = typer.Option("train", "--split", help="ShareGPT split by conversation id: train or heldout."),
    max_tokens: int = typer.Option(1_000_000, "--max-tokens", min=1, help="Stop after this many tokens in all."),
    max_seq: Optional[int] = typer.Option(None, "--max-seq", min=16, help="Cut each conversation to this many tokens "
                                         "(at most the target's context; default 1024 within it)."),
    temperatures: str = typer.Option("0,0.7,1.0", "--temperatures",
                                     help="Comma-separated; 0 = greedy (once), others sampled --samples times each."),
    samples: int = typer.Option(1, "--samples", min=1, help="Draws per sampled temperature."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", min=1, help="Longest answer per turn."),
    backend: str = typer.Option("onnxruntime", "--backend", help="Runtime that answers (torch, onnxruntime, ...)."),
    rows: int = typer.Option(16, "--rows", min=1, help="Batch rows per target forward."),
    language: str = typer.Option("en", "--language", help="en (mostly Latin script) or any."),
    heldout_share: float = typer.Option(0.02, "--heldout-share", min=0.0, max=0.5),
    shard_tokens: int = typer.Option(1_000_000, "--shard-tokens", min=256),
) -> None:
    """The target's own answers to every turn of ShareGPT's conversations, greedy and sampled, as
    token shards (`train features --source tokens` reads them)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if split not in ("train", "heldout") or language not in ("en", "any"):
        fail(f"--split {split!r} / --language {language!r}; allowed: train|heldout, en|any")
    check_output_dir(out)
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.training.features import recorded_path
    from spec_plugins.training.self_distill import parse_temperatures, regenerate, variants
    from spec_plugins.training.sharegpt import DataFilter
    from spec_plugins.training.sources import fit_max_seq, sharegpt_examples
    from spec_plugins.training.tokens import seconds_per_million, write_meta, write_token_shards

    try:
        ways = variants(parse_temperatures(temperatures), samples)
        from spec_plugins.training.sharegpt import dataset_file

        dataset_file()
        dec = SpeculativeDecoder.from_config(SpecConfig.parse({"target": {"backend": backend, "model": target},
                                                               "proposer": None}))
        max_seq = fit_max_seq(max_seq, dec.target.max_context)
    except (FileNotFoundError, ValueError, LookupError) as exc:
        fail(exc)
        return
    convs = sharegpt_examples(dec.tokenizer, split, max_seq, DataFilter(language=language), heldout_share)  # type: ignore[arg-type]
    meta = {"target": recorded_path(target), "source": "sharegpt", "responses": "self", "split": split, "max_seq": max_seq,
            "language": language, "heldout_share": heldout_share, "variants": [vars(w) for w in ways],
            "max_new_tokens": max_new_tokens, "backend": backend, "rows": rows}
    t0 = time.perf_counter()
    try:
        state = write_token_shards(regenerate(dec, convs, ways, max_new_tokens, max_seq, rows), out, meta,
                                   len(dec.tokenizer), max_tokens, shard_tokens)
    except (ValueError, OSError) as exc:  # no conversation kept (an empty split, a --max-seq that cuts every answer)
        _fail(exc, out)
        return
    took = time.perf_counter() - t0
    state |= {"wall_seconds": round(took, 1), "seconds_per_million_tokens": seconds_per_million(took, state["tokens"])}
    write_meta(out, state)
    typer.echo(json.dumps({k: v for k, v in state.items() if k != "shards"} | {"shards": len(state["shards"])}, indent=1))


@train_app.command("eagle")
def eagle_cmd(
    features: Path = FEATURES,
    out: Path = HEAD_OUT,
    heldout: Optional[Path] = HELDOUT,
    fused: bool = FUSED,
    unroll: int = typer.Option(3, "--unroll", min=1, help="Training-time test steps (1 = none)."),
    loss: str = typer.Option("soft", "--loss", help="soft (target distribution), top1 (target greedy), data."),
    reg_weight: float = typer.Option(0.0, "--reg-weight", min=0.0, help="Feature regression (EAGLE-1: 1.0)."),
    draft_vocab: int = DRAFT_VOCAB,
    intermediate: Optional[int] = INTERMEDIATE,
    epochs: float = EPOCHS,
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="Windows per step."),
    window: int = WINDOW,
    lr: float = LR,
    max_train_tokens: Optional[int] = MAX_TRAIN_TOKENS,
    max_steps: Optional[int] = MAX_STEPS,
    stop_after: Optional[int] = STOP_AFTER,
    finalize: bool = FINALIZE,
    threads: int = THREADS,
    seed: int = SEED,
    no_progress: bool = NO_PROGRESS,
) -> None:
    """Train an EAGLE drafter (EAGLE-3 elements switchable) on feature shards; resumable."""
    cfg = dict(epochs=epochs, batch_size=batch_size, window=window, lr=lr, max_steps=max_steps, stop_after=stop_after,
               finalize=finalize, seed=seed, max_train_tokens=max_train_tokens, loss=loss, unroll=unroll,
               reg_weight=reg_weight)

    def go(store, model, tcfg, held):
        from spec_plugins.training.eagle_train import train_eagle

        return train_eagle(store, model, tcfg, out, fused, draft_vocab, intermediate, held, not no_progress)

    _run_training(features, heldout, out, threads, cfg, go, layers=fused)


@train_app.command("parallel")
def parallel_cmd(
    features: Path = FEATURES,
    out: Path = HEAD_OUT,
    heldout: Optional[Path] = HELDOUT,
    block_size: int = typer.Option(6, "--block-size", min=2, max=32,
                                   help="Draft positions per drafter forward: depth 0 plus block_size - 1 block queries."),
    anchors: int = typer.Option(32, "--anchors", min=1, help="Blocks trained per window per step."),
    fused: bool = FUSED,
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=16,
                                              help="Most frequent answer tokens drafted (default 8192; --init: the head's)."),
    intermediate: Optional[int] = INTERMEDIATE,
    step_decay: float = typer.Option(0.8, "--depth-decay", min=0.0, max=1.0, help="Loss weight of depth d: decay ** d."),
    anchor_input: bool = typer.Option(True, "--anchor-input/--no-anchor-input",
                                      help="Block queries read the anchor's feature plus a learned offset (else the offset)."),
    block_layers: int = typer.Option(0, "--block-layers", min=0, max=16,
                                     help="Decoder layers over each block, after the drafter's layer."),
    block_context: bool = typer.Option(False, "--block-context/--no-block-context",
                                       help="The block layers also attend to the committed pairs (each caches "
                                            "their keys and values, as DFlash's layers see the context)."),
    init: Optional[Path] = typer.Option(None, "--init", help="Start from a trained EAGLE (or parallel) head: its layer, "
                                                            "draft vocabulary and width; what it lacks starts fresh, "
                                                            "a tensor it holds in another shape is refused."),
    epochs: float = EPOCHS,
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="Windows per step."),
    window: int = WINDOW,
    lr: float = LR,
    max_train_tokens: Optional[int] = MAX_TRAIN_TOKENS,
    max_steps: Optional[int] = MAX_STEPS,
    stop_after: Optional[int] = STOP_AFTER,
    finalize: bool = FINALIZE,
    threads: int = THREADS,
    seed: int = SEED,
    no_progress: bool = NO_PROGRESS,
) -> None:
    """Train a parallel drafter (a whole block per drafter forward) on feature shards; resumable."""
    cfg = dict(epochs=epochs, batch_size=batch_size, window=window, lr=lr, max_steps=max_steps, stop_after=stop_after,
               finalize=finalize, seed=seed, max_train_tokens=max_train_tokens, loss="soft", step_decay=step_decay)

    def go(store, model, tcfg, held):
        from spec_plugins.training.eagle_train import check_init, train_eagle

        if init is not None:  # the head's vocabulary and width win: an explicit other one is refused
            check_init(init, draft_vocab, intermediate)
        return train_eagle(store, model, tcfg, out, fused, draft_vocab or 8192, intermediate, held, not no_progress,
                           block_size=block_size, anchors=anchors, init=init, anchor_input=anchor_input,
                           block_layers=block_layers, block_context=block_context)

    _run_training(features, heldout, out, threads, cfg, go, layers=fused)


@train_app.command("medusa")
def medusa_cmd(
    features: Path = FEATURES,
    out: Path = HEAD_OUT,
    heldout: Optional[Path] = HELDOUT,
    num_heads: int = typer.Option(4, "--num-heads", min=1),
    loss: str = typer.Option("soft", "--loss", help="soft (target distribution), top1 (target greedy), data."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", min=16),
    epochs: float = EPOCHS,
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Windows per step."),
    window: int = typer.Option(512, "--window", min=8),
    lr: float = LR,
    max_train_tokens: Optional[int] = typer.Option(None, "--max-train-tokens", min=1),
    max_steps: Optional[int] = MAX_STEPS,
    stop_after: Optional[int] = typer.Option(None, "--stop-after", min=1),
    finalize: bool = typer.Option(False, "--finalize"),
    threads: int = THREADS,
    seed: int = SEED,
    no_progress: bool = NO_PROGRESS,
) -> None:
    """Train Medusa heads on feature shards; resumable."""
    cfg = dict(epochs=epochs, batch_size=batch_size, window=window, lr=lr, max_steps=max_steps, stop_after=stop_after,
               finalize=finalize, seed=seed, max_train_tokens=max_train_tokens, loss=loss)

    def go(store, model, tcfg, held):
        from spec_plugins.training.medusa_train import train_medusa

        return train_medusa(store, model, tcfg, out, num_heads, draft_vocab, held, not no_progress)

    _run_training(features, heldout, out, threads, cfg, go, layers=False)  # Medusa reads the last hidden state


def _run_training(features: Path, heldout: Optional[Path], out: Path, threads: int, cfg: dict, go: Any,
                  layers: bool) -> None:
    """The part every head command shares: validate, load the shards and the target, train, report.
    ``layers``: the head reads the features' layer outputs (held-out ones must hold the same)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cfg["loss"] not in ("soft", "top1", "data"):
        fail(f"--loss {cfg['loss']!r}; allowed values: soft, top1, data")
    for key, flag in (("lr", "--lr"), ("reg_weight", "--reg-weight")):
        check_finite(cfg.get(key), flag)
    check_output_dir(out)
    import torch
    from safetensors import SafetensorError

    from spec_plugins.training.trainer import TrainConfig

    torch.set_num_threads(threads)
    try:
        tcfg = TrainConfig(**{k: v for k, v in cfg.items() if v is not None})  # checks its values before anything loads
        from spec_plugins.training.inputs import load_for_training

        store, held, model = load_for_training(features, heldout, layers)
        report = go(store, model, tcfg, held)
    except (FileNotFoundError, ValueError, OSError, SafetensorError) as exc:  # save_head's safetensors error
        _fail(exc, out)
        return
    typer.echo(json.dumps(report, indent=2))
