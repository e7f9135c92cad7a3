"""The ``spec-plugins bench`` subcommand (registered on the main Typer app at import)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from spec_plugins.cli import app, check_output_dir, check_output_file, fail, load_config


DEFAULT_CONFIG = "built-in default"  # meta.config of a run without --config (the replay reads it back)


def parse_gammas(text: str) -> list[int]:
    """'1-8' / '1,2,4' / '1-4,8' / '' -> sorted unique ints; bad syntax names the part, and a part
    outside 1..MAX_GAMMA is refused before a range is expanded (a typo must not build a huge set)."""
    from spec_plugins.bench.runner import MAX_GAMMA

    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
            if lo > hi:
                raise ValueError
        except ValueError:
            raise ValueError(f"--gammas: cannot read {part!r}; use e.g. '1-8' or '1,2,4'") from None
        if lo < 1 or hi > MAX_GAMMA:
            raise ValueError(f"--gammas: {part!r} reaches outside 1..{MAX_GAMMA}, the draft lengths the bench runs")
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_categories(text: Optional[str]) -> Optional[list[str]]:
    """``--categories``: None (not given) keeps every category; given, it must name one."""
    if text is None:
        return None
    cats = [c.strip() for c in text.split(",") if c.strip()]
    if not cats:
        raise ValueError(f"--categories {text!r} names no category; leave it out to run every category")
    return cats


def load_methods(path: Optional[Path], base: Any = None) -> list[tuple[str, dict]]:
    """``--methods`` file: a mapping of method label -> proposer section (read as config files
    are, ``config.load_file``: a file that cannot be read is a ``ConfigError`` naming it). Each
    section is validated as the bench will run it (``methods.method_config`` on the run's config
    ``base``; None: not validated here) before any model loads, the error naming the file and the
    label."""
    if path is None:
        return []
    from spec_plugins.bench.methods import method_config
    from spec_plugins.config import load_file

    data = load_file(path, "--methods")
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--methods {path}: expected a mapping of label -> proposer section")
    out = []
    for label, section in data.items():
        if not isinstance(section, dict) or "type" not in section:
            raise ValueError(f"--methods {path}: {label!r} must be a proposer section with a `type`")
        if base is not None:
            method_config(base, section, f"--methods {path}, method {str(label)!r}")
        out.append((str(label), section))
    return out


def load_compare_configs(paths: list[Path] | None, primary: Any) -> list[tuple[Path, Any]]:
    """Every ``--compare-config`` file, read and validated before any model loads (a typo found
    after the primary model has loaded would cost that load), an error naming the option; its
    sampling and verifier must be the ``primary`` config's (``methods.check_compare_sampling``)."""
    from spec_plugins.bench.methods import check_compare_sampling
    from spec_plugins.config import ConfigError

    out = []
    for path in paths or []:
        try:
            other = load_config(path)
        except ConfigError as exc:
            raise ConfigError(f"--compare-config: {exc}") from None
        check_compare_sampling(primary, other, f"--compare-config {path}")
        out.append((path, other))
    return out


def check_doc_title(doc: Path, name: str) -> None:
    """``--markdown``'s section title, checked before the bench runs (``docs.check_title``: another
    title with the same slug is refused); a document that cannot be read is named."""
    from spec_plugins.bench.docs import check_title

    try:
        check_title(doc, name)
    except OSError as exc:
        fail(f"--markdown {doc}: cannot read it ({exc.strerror or exc})")


@app.command("bench")
def bench(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML/JSON SpecConfig with a proposer."),
    prompts: Path = typer.Option(..., "--prompts", help="JSONL: {question_id, category, turns} or {prompt}."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1),
    runs: int = typer.Option(1, "--runs", min=1, help="Repeats per prompt and method (median taken)."),
    baselines: str = typer.Option("plain,transformers,llamacpp,llamacpp_prompt_lookup", "--baselines",
                                  help="Comma-separated registered baselines (plain is always run)."),
    gammas: str = typer.Option("1-8", "--gammas", help="Our fixed draft lengths to run, e.g. '1-8' or '2,4'."),
    auto: bool = typer.Option(True, "--auto/--no-auto", help="Also run num_draft_tokens: auto."),
    baseline_gamma: Optional[int] = typer.Option(None, "--baseline-gamma", min=1,
                                                 help="Draft length for peers (default: the config's, 5 if auto)."),
    out: Path = typer.Option(Path("bench-out"), "--out", "-o", help="Directory for report.json, summary.md, PNGs."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON report instead of the Markdown summary."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N prompts."),
    categories: Optional[str] = typer.Option(None, "--categories", help="Comma-separated categories to keep."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 if any greedy output differs from plain."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    methods: Optional[Path] = typer.Option(
        None, "--methods", help="YAML/JSON mapping label -> proposer section: more proposers measured on the "
                                "same runtime in the same run (one method each, with its own draft length)."),
    memory: str = typer.Option("independent", "--memory",
                               help="Cross-request memory (suffix's global index): independent (cleared before every "
                                    "prompt) or sequence (kept across the prompts of a run, in file order)."),
    markdown_doc: Optional[Path] = typer.Option(None, "--markdown", help="Also write this run as a section of a "
                                                                         "Markdown page (e.g. docs/benchmarks.md)."),
    title: Optional[str] = typer.Option(None, "--title", help="--markdown: the section's title (a rerun with the "
                                                              "same title replaces it)."),
    compare_config: Optional[list[Path]] = typer.Option(
        None, "--compare-config",
        help="Another config (e.g. the same one with another backend) measured in the same run: adds "
             "plain@<backend> and ours@<backend> with its draft length. Repeatable."),
) -> None:
    """Benchmark ours (fixed gammas + auto) against plain decoding and peer implementations."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spec_plugins.bench import BenchOptions, load_prompts, run_bench
    from spec_plugins.bench.methods import check_labels
    from spec_plugins.bench.plots import PlotError
    from spec_plugins.config import ConfigError
    from spec_plugins.decoder import SpeculativeDecoder

    if title is not None and markdown_doc is None:
        fail("--title names the --markdown section; give --markdown DOC too (the run's own files have no title)")
    check_output_dir(out)
    if markdown_doc is not None:
        check_output_file(markdown_doc, "--markdown")  # written after the bench: checked before it
    t0 = time.perf_counter()
    try:
        cfg = load_config(config)
        if cfg.proposer is None:
            raise ValueError("the config has no proposer section; the bench compares a proposer against plain")
        name = title or f"{Path(prompts).stem} on {cfg.target.backend}"
        if markdown_doc is not None:
            check_doc_title(markdown_doc, name)
        if not parse_gammas(gammas) and not auto and cfg.proposer.num_draft_tokens == "auto":
            raise ValueError("--gammas '' with --no-auto leaves only the config's draft length, which is auto; "
                             "give --gammas or drop --no-auto")
        plist = load_prompts(prompts, limit, parse_categories(categories))
        # every option checked (baseline names with the options, then the --methods labels against
        # the methods they build) before the first model or compare config loads
        opts = BenchOptions(max_new_tokens=max_new_tokens, runs=runs,
                            baselines=[b.strip() for b in baselines.split(",") if b.strip()],
                            gammas=parse_gammas(gammas), auto=auto, baseline_gamma=baseline_gamma,
                            chat=not raw, progress=progress, methods=load_methods(methods, cfg), memory=memory)
        check_labels([lab for lab, _ in opts.methods], opts.builtin_names())
        others = load_compare_configs(compare_config, cfg)
        dec = SpeculativeDecoder.from_config(cfg)
        compare: list[tuple[str, SpeculativeDecoder]] = []
        for path, other_cfg in others:
            quant = getattr(other_cfg.target, "quantize", "none")
            base = other_cfg.target.backend + (f"-{quant}" if quant != "none" else "")
            label = base
            taken = {lab for lab, _ in compare} | {cfg.target.backend}
            n = 2
            while label in taken:
                label, n = f"{base}-{n}", n + 1
            compare.append((label, SpeculativeDecoder.from_config(other_cfg)))
        opts.compare = compare
        load_s = time.perf_counter() - t0
        import torch
        import transformers

        # config paths absolute: the replay reads the report's config from wherever it runs
        meta = {"config": str(config.resolve()) if config else DEFAULT_CONFIG, "model": cfg.target.model,
                "backend": cfg.target.backend, "proposer": cfg.proposer.model_dump(mode="json"),
                "sampling": cfg.sampling.model_dump(mode="json"), "prompts_file": str(prompts),
                "verifier": cfg.verifier.model_dump(mode="json"),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
                "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model_load_s": load_s,
                "compare_configs": {lab: str(p.resolve()) for (lab, _), p in zip(compare, compare_config or [])},
                "methods": dict(opts.methods), "memory": memory}
        report = run_bench(dec, plist, opts, out, meta, started=t0)  # writes report.json, with the wall time
    except (ConfigError, ValueError, FileNotFoundError, LookupError, PlotError) as exc:
        fail(exc)
        return
    total = report["meta"]["wall_s_including_load"]
    if markdown_doc is not None:
        from spec_plugins.bench.docs import section, update

        command = "spec-plugins bench " + shlex.join(sys.argv[2:])
        try:
            update(markdown_doc, name, section(report, name, command, out, markdown_doc))
        except (OSError, ValueError) as exc:
            fail(f"--markdown {markdown_doc}: {exc} (the run's own files are in {out}/)")
    if as_json:
        print(json.dumps(report))
    else:
        print((out / "summary.md").read_text())
    n_bad = len(report["greedy_mismatches"])
    color = typer.colors.RED if n_bad else typer.colors.CYAN
    typer.secho(f"[bench: {total:.0f} s including model load; {n_bad} greedy mismatch(es); files in {out}/]",
                err=True, fg=color, bold=bool(n_bad))
    if strict and n_bad:
        raise typer.Exit(1)
    sys.stdout.flush()
