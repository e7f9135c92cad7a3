"""What a bench report holds for a replay: its turns re-encoded as the bench encoded them, its
config and limits, its per-round overhead, and whether its run can be replayed at all (a greedy run
of a proposer whose drafts read the sequence alone). ``bench.replay`` decodes them again."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spec_plugins.bench.prompts import BenchPrompt

SEQUENCE_ONLY = ("ngram", "suffix")  # proposers whose drafts read only the sequence: replayed exactly


def check_replayable(kind: str) -> None:
    """Refuse a proposer type the replay cannot reproduce: point-mass logits stand in for the
    model, so a drafter reading the target's logits or features (recycling, lookahead, EAGLE, a
    draft model) would draft other tokens than it did with the model."""
    if kind not in SEQUENCE_ONLY:
        raise ValueError(f"proposer {kind!r}: the replay reproduces only proposers whose drafts read the sequence "
                         f"alone ({', '.join(SEQUENCE_ONLY)})")


REPORT_KEYS = ("meta", "prompts", "methods", "summary", "cost_model")  # what the replay reads of a report


def read_report(path: str) -> dict:
    """A bench's report.json; a file that is missing, unreadable, not JSON or not a bench report
    is refused naming the reason (ValueError), before any model loads."""
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"not a JSON file ({exc})") from None
    missing = [k for k in REPORT_KEYS if k not in report] if isinstance(report, dict) else list(REPORT_KEYS)
    if missing:
        raise ValueError(f"not a bench report.json (it lacks {', '.join(missing)})")
    return report


def turns_from_report(report: dict, prompts_file: str, decoder: Any) -> list[tuple[str, list[int], list[int]]]:
    """(category, prompt ids, plain output) per turn, re-encoding multi-turn histories as the bench
    did (``runner.encode_history``, with the report's ``meta.chat``: False for a ``--raw`` run). A
    report from before ``meta.chat`` was recorded is read as the bench's default (the chat template
    where the tokenizer has one), which is what every run without ``--raw`` did."""
    from spec_plugins.bench.runner import encode_history

    chat = bool(report.get("meta", {}).get("chat", True))
    out = []
    for p, entry in recorded_prompts(report, prompts_file):
        history: list[dict] = []
        for turn, toks in zip(p.turns, entry["methods"]["plain"]["token_ids"]):
            history.append({"role": "user", "content": turn})
            ids = encode_history(decoder, history, chat)
            out.append((p.category, ids, list(toks)))
            history.append({"role": "assistant", "content": decoder.tokenizer.decode(toks, skip_special_tokens=True)})
    return out


def recorded_prompts(report: dict, prompts_file: str) -> list[tuple[BenchPrompt, dict]]:
    """Each of the report's prompt entries with its prompt from ``prompts_file``, which must hold
    every recorded question_id with the turns recorded for it: checked before any model loads
    (``load_prompts``' errors name the file; ValueError)."""
    from spec_plugins.bench.prompts import load_prompts

    by_id = {p.question_id: p for p in load_prompts(prompts_file)}
    out = []
    for entry in report["prompts"]:
        qid, recorded = entry["question_id"], len(entry["methods"]["plain"]["token_ids"])
        p = by_id.get(qid)
        if p is None:
            raise ValueError(f"{prompts_file} lacks question_id {qid!r} recorded in the report (give the prompts "
                             "file the bench ran)")
        if len(p.turns) != recorded:
            raise ValueError(f"{prompts_file}: question_id {qid!r} has {len(p.turns)} turns, the report recorded "
                             f"{recorded} (give the prompts file the bench ran)")
        out.append((p, entry))
    return out


def memory_spans(report: dict) -> list[int]:
    """Turns per span of the run's cross-request memory (suffix's global index), in the order
    ``turns_from_report`` lists them: ``meta.memory: sequence`` kept it over every prompt of a run;
    ``independent`` (the bench's default, also read for a report that records none) cleared it
    before each prompt, whose turns shared it. ``replay_report`` builds one proposer per span."""
    turns = [len(e["methods"]["plain"]["token_ids"]) for e in report["prompts"]]
    return [sum(turns)] if report.get("meta", {}).get("memory") == "sequence" else turns


def round_overhead(report: dict) -> float:
    """Seconds per round outside target forwards and drafting, pooled over our runs on the primary runtime."""
    spent = rounds = 0.0
    for m in report["methods"]:
        if m["kind"] != "ours":
            continue
        s = report["summary"][m["name"]]["all"]
        st = s["stats"]
        share = st["time_share"]
        spent += (share["verify"] + share["cache"] + share["other"]) * sum(s["seconds_runs"])  # stats pool the runs
        rounds += st["target_forwards"]
    return spent / rounds if rounds else 0.0


def not_replayable(meta: dict) -> str | None:
    """Why a report's run cannot be replayed (None: it can): the replay re-decodes greedy outputs
    with the report's ``max_new_tokens`` (a sampling run's tokens differ per method and run), its
    cross-request memory as the bench kept it (``memory_spans``)."""
    if meta.get("greedy") is not True:
        return f"meta.greedy is {meta.get('greedy')!r} (a sampling run): the replay reproduces greedy runs only"
    if meta.get("memory", "independent") not in ("independent", "sequence"):
        return (f"meta.memory is {meta['memory']!r}: the replay knows the bench's cross-request memory as "
                "independent or sequence (memory_spans)")
    limit = isinstance(meta.get("max_new_tokens"), int)
    return None if limit else "the report records no meta.max_new_tokens, the limit its turns were decoded with"


def report_limits(report: dict, dec: Any) -> dict[str, Any]:
    """``max_new``/``eos_ids`` as the report's turns were decoded (``recorded_limit``), for
    ``replay_report``/``replay_sequence``; ``dec`` re-encodes the turns with the bench's tokenizer."""
    return {"max_new": report["meta"]["max_new_tokens"], "eos_ids": list(dec.eos_ids())}


def report_config(report: dict, path: str | None = None) -> Any:
    """The config to replay with: ``path`` if given, else the report's ``meta.config`` (a file, or
    the built-in default that a bench run without ``--config`` records as ``DEFAULT_CONFIG``)."""
    from spec_plugins.bench.cli import DEFAULT_CONFIG
    from spec_plugins.config import ConfigError, SpecConfig, default_config

    path = path or report.get("meta", {}).get("config")
    if not path:
        raise ConfigError("the report's meta names no config")
    return default_config() if path == DEFAULT_CONFIG else SpecConfig.from_file(path)
