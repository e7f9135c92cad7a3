"""``spec-plugins tune``: measure this machine and write the fastest exact config (``spec_plugins.tune``)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from spec_plugins.cli import app, check_output_file, fail, write_output
from spec_plugins.training.sources import shipped_prompts
from spec_plugins.tune import BUDGET_BOUNDS

DEFAULT_PROMPTS = shipped_prompts("dev.jsonl")


@app.command("tune")
def tune_cmd(
    model: str = typer.Option("smollm2-135m-instruct", "--model", help="Built-in name, .gguf path or local dir."),
    prompts: Path = typer.Option(DEFAULT_PROMPTS, "--prompts", help="JSONL prompts like yours (bench layout)."),
    runtimes: Optional[str] = typer.Option(
        None, "--runtimes", help="Comma-separated (default: those installed that can run the model)."),
    proposers: str = typer.Option("ngram,suffix,eagle", "--proposers", help="Comma-separated proposers to try."),
    budget: str = typer.Option("10m", "--budget", help="Time budget, e.g. 5m, 90s. " + BUDGET_BOUNDS),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=8, help="Answer length while measuring."),
    limit: int = typer.Option(8, "--limit", min=1, help="Use at most this many prompts (first turns)."),
    out: Path = typer.Option(Path("tuned.yaml"), "--out", "-o",
                             help="Where to write the chosen config: YAML with the measurements as comments "
                                  "(a .json name: JSON, the config alone)."),
) -> None:
    """Measure runtimes and proposers on your prompts; write the fastest exact config."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_output_file(out)  # before anything is measured: the result must have somewhere to go
    from spec_plugins.bench.prompts import load_prompts
    from spec_plugins.tune import Budget, TuneError, parse_budget, tune
    from spec_plugins.tune_yaml import render_yaml

    try:
        seconds = parse_budget(budget)
        # None (not given): tune's default; given, even as "", it must name a runtime (tune refuses [])
        rts = [r.strip() for r in runtimes.split(",") if r.strip()] if runtimes is not None else None
        props = [p.strip() for p in proposers.split(",") if p.strip()]
        plist = load_prompts(prompts)
        if not plist:
            raise TuneError(f"{prompts} holds no prompts")
        texts = [p.turns[0] for p in plist[:limit]]
        res = tune(model, texts, rts, props, Budget(seconds), max_new_tokens,
                   log=lambda m: typer.secho(m, err=True, fg=typer.colors.CYAN),
                   names=[f"{prompts}: question_id {p.question_id!r}" for p in plist[:limit]])
    except (TuneError, ValueError, FileNotFoundError, LookupError, ImportError) as exc:
        fail(exc)
        return
    command = "spec-plugins tune " + shlex.join(sys.argv[2:])  # quoted: it reruns as recorded
    # config files are read as JSON by a .json suffix (``config.load_file``): JSON has no comments,
    # so such a file holds the config alone, without the measurements
    text = (json.dumps(res.config, indent=1) + "\n" if out.suffix.lower() == ".json"
            else render_yaml(res, command))
    write_output(out, text)
    c = res.chosen
    speed = f"{c.tokens_per_s:.1f} tok/s, {c.tokens_per_s / res.plain.tokens_per_s:.2f}x plain"
    typer.echo(f"wrote {out}: {c.label} ({speed}) in {res.seconds:.0f} s; run it with "
               f"`spec-plugins generate --config {shlex.quote(str(out))} --prompt ...`")
