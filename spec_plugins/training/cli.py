"""``spec-plugins train {medusa,eagle} --target MODEL --out DIR``: self-distillation on this CPU.

Recipe: (1) the target greedily answers the shipped prompts (examples/prompts/train.jsonl)
and its features for every position are cached (shared by both heads); (2) the head trains on
those features with a progress bar; (3) ``DIR/head.safetensors`` (fp16) + ``DIR/config.json``
are written. Rerunning the same command resumes from ``DIR/checkpoint.pt``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import typer

from spec_plugins.cli import app, check_output_dir, fail

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "train.jsonl"


def prepare_features(model: Any, prompt_ids: Sequence[Sequence[int]], target_name: str, max_new_tokens: int,
                     eos: Sequence[int], features: Optional[Path], gen_batch: int, progress: bool):
    """Load or build the cached self-distillation features; returns (FeatureSet, path, seconds, cached)."""
    from spec_plugins.models import cache_root
    from spec_plugins.training.data import build_features, cache_key, cached_features

    key = cache_key(target_name, prompt_ids, max_new_tokens)
    path = features or cache_root() / "features" / f"{Path(target_name).name}-{key}.safetensors"
    t0 = time.perf_counter()
    bar = None
    if progress and not path.is_file():
        from tqdm.auto import tqdm

        bar = tqdm(total=1, desc="greedy responses (decode steps)", dynamic_ncols=True)

    def tick(done: int, total: int) -> None:
        if bar is not None:
            bar.total, bar.n = total, done
            bar.refresh()

    fs, cached = cached_features(
        path, lambda: build_features(model, prompt_ids, max_new_tokens, eos, gen_batch, tick),
        {"target": target_name, "prompts": len(prompt_ids), "max_new_tokens": max_new_tokens})
    if bar is not None:
        bar.close()
    return fs, path, time.perf_counter() - t0, cached


def train_head(kind: str, model: Any, prompt_ids: Sequence[Sequence[int]], out: Path, target_name: str,
               max_new_tokens: int = 128, eos: Sequence[int] = (), features: Optional[Path] = None,
               gen_batch: int = 32, draft_vocab: int = 4096, num_heads: int = 4, train_cfg: Any = None,
               progress: bool = True) -> dict:
    """Features (cached) -> trained head in ``out``; returns the report written to train_report.json."""
    from spec_plugins.heads.common import draft_vocab as pick_vocab
    from spec_plugins.heads.common import target_lm_parts
    from spec_plugins.heads.eagle import EagleConfig
    from spec_plugins.heads.medusa import MedusaConfig
    from spec_plugins.training.trainer import TrainConfig, train_eagle, train_medusa, write_report

    cfg = train_cfg or TrainConfig()
    fs, fpath, f_secs, cached = prepare_features(model, prompt_ids, target_name, max_new_tokens, eos, features,
                                                 gen_batch, progress)
    lm, emb = target_lm_parts(model)
    vocab_ids = pick_vocab(fs.token_counts(lm.shape[0]), draft_vocab)
    H = lm.shape[1]
    mcfg = model.config
    if kind == "medusa":
        hcfg = MedusaConfig(H, num_heads=num_heads, draft_vocab_size=int(vocab_ids.numel()))
        _, res = train_medusa(fs, lm, vocab_ids, hcfg, cfg, out, progress)
    else:
        heads = getattr(mcfg, "num_attention_heads", 4)
        kv = getattr(mcfg, "num_key_value_heads", heads) or heads
        rope = (getattr(mcfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(mcfg, "rope_theta", 1e4)
        hcfg = EagleConfig(H, num_heads=heads, num_kv_heads=kv, intermediate_size=2 * H, rope_theta=float(rope),
                           draft_vocab_size=int(vocab_ids.numel()))
        _, res = train_eagle(fs, lm, emb, vocab_ids, hcfg, cfg, out, progress)
    if not res.finished:
        return {"kind": kind, "finished": False, "steps_done": res.steps, "steps": res.scheduled,
                "checkpoint": str(out / "checkpoint.pt")}
    report = {
        "kind": kind, "finished": True, "target": target_name, "features": str(fpath), "features_cached": cached,
        "feature_seconds": round(f_secs, 1), "sequences": len(fs), "tokens": int(fs.tokens.numel()),
        "response_tokens": fs.response_tokens, "feature_bytes": int(fs.hidden.numel() * 2),
        "train_seconds": round(res.seconds, 1), "steps": res.steps, "scheduled_steps": res.scheduled,
        "resumed_from": res.resumed_from,
        "first_losses": res.losses[:5], "last_losses": res.losses[-5:], "accuracy": res.accuracy,
        "head_bytes": (out / "head.safetensors").stat().st_size, "draft_vocab": int(vocab_ids.numel()),
    }
    write_report(out, report)
    return report


@app.command()
def train(
    kind: str = typer.Argument(..., help="Which head: medusa or eagle."),
    target: str = typer.Option("smollm2-135m-instruct", "--target", help="Target model (built-in name, .gguf, dir)."),
    out: Path = typer.Option(..., "--out", help="Output directory (head.safetensors, config.json, checkpoint)."),
    prompts: Path = typer.Option(DEFAULT_PROMPTS, "--prompts", help="JSONL file with a 'prompt' field per line."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", min=1, help="Use only the first N prompts."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Length of each greedy response."),
    features: Optional[Path] = typer.Option(None, "--features", help="Feature cache file (default: in the cache dir)."),
    epochs: float = typer.Option(3.0, "--epochs", min=0.0),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Positions (medusa, 256) or sequences (eagle, 8)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Learning rate (1e-3 for both heads)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Shorten the schedule to N steps."),
    stop_after: Optional[int] = typer.Option(None, "--stop-after", min=1,
                                             help="Leave after N steps (checkpointed); rerun to resume."),
    num_heads: int = typer.Option(4, "--num-heads", min=1, help="Medusa heads."),
    unroll: int = typer.Option(3, "--unroll", min=1, help="EAGLE training-time unroll steps."),
    ce_weight: float = typer.Option(1.0, "--ce-weight", min=0.0,
                                    help="EAGLE: weight of the token cross-entropy next to the feature regression."),
    draft_vocab: int = typer.Option(4096, "--draft-vocab", min=16,
                                    help="Draft vocabulary size (tokens seen in the responses, then the lowest ids)."),
    threads: int = typer.Option(2, "--threads", min=1, help="torch threads."),
    gen_batch: int = typer.Option(32, "--gen-batch", min=1, help="Rows per batch when generating responses."),
    seed: int = typer.Option(0, "--seed"),
    finalize: bool = typer.Option(False, "--finalize", help="Write the head from the last checkpoint now "
                                                            "(same options as the run), skipping the remaining steps."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide progress bars."),
) -> None:
    """Train a Medusa or EAGLE head on the target's own greedy responses (resumable)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if kind not in ("medusa", "eagle"):
        fail(f"unknown head {kind!r}; allowed values: medusa, eagle")
    check_output_dir(out)
    import json

    import torch

    from spec_plugins.backends.torch_runtime import load_hf
    from spec_plugins.training.data import encode_chat, load_prompts
    from spec_plugins.training.trainer import TrainConfig

    torch.set_num_threads(threads)
    try:
        texts = load_prompts(prompts)[:max_prompts]  # before the model loads: a bad file fails fast
        model, tok = load_hf(target, "float32", "cpu")
        prompt_ids = encode_chat(tok, texts)
    except (FileNotFoundError, ValueError, LookupError) as exc:
        fail(str(exc))
        return
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    cfg = TrainConfig(epochs=epochs, batch_size=batch_size or (256 if kind == "medusa" else 8),
                      lr=lr or 1e-3, max_steps=max_steps, stop_after=stop_after, finalize=finalize,
                      unroll=unroll, ce_weight=ce_weight, seed=seed)
    report = train_head(kind, model, prompt_ids, out, target, max_new_tokens, eos, features, gen_batch,
                        draft_vocab, num_heads, cfg, not no_progress)
    typer.echo(json.dumps(report, indent=2))
