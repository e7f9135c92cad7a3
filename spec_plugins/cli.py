"""``spec-plugins`` command line. Each subcommand lives in its own small module."""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:
    from spec_plugins.stats import DecodeStats

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Exact speculative decoding: generate, bench, train, export, serve.")


@app.callback()
def main() -> None:
    """Exact speculative decoding: generate, bench, train, export, serve."""


def load_config(path: Optional[Path]):
    from spec_plugins.config import SpecConfig, default_config

    return SpecConfig.from_file(path) if path else default_config()


def fail(msg: str | BaseException) -> None:
    """Print ``error: ...`` (an exception through ``error_message``) and exit 2."""
    typer.secho(f"error: {error_message(msg) if isinstance(msg, BaseException) else msg}", fg=typer.colors.RED,
                err=True)
    raise typer.Exit(2)


def error_message(exc: BaseException) -> str:
    """The line ``fail`` prints for a caught error: its message, or, for a LookupError that carries
    none (a KeyError's bare key such as ``None``, an empty one), its repr and the function and
    line that raised it, so the line still names something to look at."""
    if not isinstance(exc, LookupError):
        return str(exc)
    if isinstance(exc, KeyError):  # str() of a KeyError is the repr of its argument
        arg = exc.args[0] if len(exc.args) == 1 else None
        if isinstance(arg, str) and " " in arg.strip():
            return arg  # a message raised as a KeyError
    elif str(exc).strip() not in ("", "None"):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" raised in {frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"unexpected {exc!r}{where}"


def check_finite(value: float | None, flag: str) -> None:
    """A number from the command line that must be a number (typer lets nan and inf through)."""
    if value is not None and not math.isfinite(value):
        fail(f"{flag} {value}: give a finite number")


def check_output_file(path: Path, flag: str = "--out") -> None:
    """An output file from the command line, checked before any model loads or any measurement
    runs: not a directory, in an existing directory we may write to."""
    if path.is_dir():
        fail(f"{flag} {path} is a directory; give a file name")
    parent = path.absolute().parent
    if not parent.is_dir():
        fail(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"{flag} {path}: cannot write there")


def write_output(path: Path, text: str, flag: str = "--out") -> None:
    """Write an output file checked by ``check_output_file``: atomically, so a failed write (a full
    disk) leaves a previous file whole, and a failure is the CLI's ``error:`` line."""
    from spec_plugins.files import write_text_atomic

    try:
        write_text_atomic(path, text)
    except OSError as exc:
        fail(f"{flag} {path}: cannot write it ({exc.strerror or exc})")


def check_output_dir(path: Path, flag: str = "--out") -> None:
    """An output directory from the command line, checked before any model loads: not an
    existing file, under a writable directory."""
    if path.exists() and not path.is_dir():
        fail(f"{flag} {path} is an existing file; give a directory")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK)):
        fail(f"{flag} {path}: cannot create it under {parent}")


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (wrapped in the chat template if any)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML/JSON SpecConfig (default: built-in)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1,
                                       help="Tokens to generate (at least 1, as the server's max_new_tokens)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t",
                                                help="0 = greedy; below 1e-5 also greedy (the limit of sampling)."),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, max=2**63 - 1,
                                       help="Sampling seed: the same output with any proposer or draft length "
                                            "(a draft model's chain: for the same draft schedule)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: text, token_ids, stats."),
    no_speculation: bool = typer.Option(False, "--no-speculation", help="Plain decoding on the same runtime."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Hold the output to this JSON schema file."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Hold the output to this regular expression."),
    no_forced_drafts: bool = typer.Option(False, "--no-forced-drafts",
                                          help="Do not draft the tokens a grammar forces (for comparisons)."),
) -> None:
    """Generate text for one prompt and report what speculation did (exit 1 if the output ended
    in an error: what came before it is still printed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spec_plugins.config import ConfigError
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.stats import DecodeStats

    if not prompt:
        fail("--prompt cannot be empty")
    check_finite(temperature, "--temperature")  # nan too: typer's own range check would call it below 0
    if temperature is not None and temperature < 0:
        fail(f"--temperature {temperature}: give 0 (greedy) or more")
    if any(s == "" for s in stop):
        fail("--stop: stop strings must not be empty")
    grammar = _grammar(json_schema, regex)
    try:
        cfg = load_config(config)
        if no_speculation:
            cfg = cfg.model_copy(update={"proposer": None})
        dec = SpeculativeDecoder.from_config(cfg)
        chat = not raw and dec.has_chat_template
        stats = DecodeStats()
        toks: list[int] = []
        text = ""
        reason = "length"
        error = None
        for ev in dec.stream(prompt, max_new_tokens, stop, chat=chat, temperature=temperature, seed=seed, stats=stats,
                             grammar=grammar, forced_drafts=not no_forced_drafts):
            toks.extend(ev.token_ids)
            text += ev.text
            reason = ev.finish_reason or reason
            error = ev.error or error
            if not as_json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    except (ConfigError, ValueError, FileNotFoundError, LookupError) as exc:
        fail(exc)
        return
    if as_json:
        print(json.dumps({"text": text, "token_ids": toks, "finish_reason": reason, "error": error,
                          "stats": stats.to_dict()}))
    else:
        _tune_hint(config)
        s = stats
        sys.stdout.write("\n")
        typer.secho(
            f"[{len(toks)} tokens, {s.tokens_per_second:.1f} tok/s, {s.target_forwards} target forwards, "
            f"mean accepted {s.mean_accepted_tokens:.2f}, {_acceptance(s)}, finish: {reason}"
            + (f", forced {s.forced_tokens}" if grammar is not None else "")
            + (f", LOSSY verifier ({cfg.verifier.type})" if s.lossy and not cfg.sampling.greedy else "")
            + "]",
            err=True, fg=typer.colors.CYAN)
    if error is not None:  # the output ended early: say why (a grammar with no way on, a failed sampling)
        typer.secho(f"error: the generation failed: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)  # what was generated is printed; a script still sees the failure


def _grammar(json_schema: Optional[Path], regex: Optional[str]) -> Any:
    """The output constraint the options name (one at most), read and parsed here."""
    from spec_plugins.grammar import GrammarSpec

    if json_schema is not None and regex is not None:
        fail("give --json-schema or --regex, not both")
    if regex is not None:
        return GrammarSpec.regex(regex) if regex else fail("--regex cannot be empty")
    if json_schema is None:
        return None
    try:
        schema = json.loads(json_schema.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        fail(f"--json-schema {json_schema}: {exc}")
    except UnicodeDecodeError as exc:  # JSON files are UTF-8 (RFC 8259)
        fail(f"--json-schema {json_schema}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
             "JSON files must be UTF-8")
    if not isinstance(schema, dict):  # a JSON string would be read as schema text a second time
        fail(f"--json-schema {json_schema}: a JSON schema must be an object, got {type(schema).__name__}")
    return GrammarSpec.json_schema(schema)


def _acceptance(s: DecodeStats) -> str:
    """The acceptance summary line's part: a rate only where something was drafted (the policy may
    draft nothing: 0% would read as every draft rejected)."""
    if not s.draft_tokens:
        return "nothing drafted"
    return f"acceptance {s.acceptance_rate:.2%} of {s.draft_tokens} drafted"


def _tune_hint(config: Optional[Path]) -> None:
    """Once per machine (a marker in the cache directory), on stderr: where a faster setup is found."""
    from spec_plugins.models import cache_root

    marker = cache_root() / ".tune-hint-shown"
    if config is not None or marker.exists():
        return
    typer.secho("hint: `spec-plugins tune --out tuned.yaml` measures this machine and writes the fastest exact "
                "config for it; then `spec-plugins generate --config tuned.yaml`", err=True, fg=typer.colors.YELLOW)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # a read-only cache only means the hint shows again


def _register_subcommands() -> None:
    """Optional subcommand modules (bench, train, export, serve) add themselves to ``app``."""
    import importlib

    for mod in ("spec_plugins.bench.cli", "spec_plugins.training.cli", "spec_plugins.exporters.cli",
                "spec_plugins.server.cli", "spec_plugins.tune_cli"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name and mod.startswith(exc.name):
                continue  # not built yet
            raise


_register_subcommands()

if __name__ == "__main__":
    # ``python -m spec_plugins.cli`` runs this file as ``__main__``, a second copy of the module: the
    # subcommand modules import ``spec_plugins.cli`` and add themselves to that module's ``app``
    from spec_plugins.cli import app as _registered_app

    _registered_app(prog_name="spec-plugins")
