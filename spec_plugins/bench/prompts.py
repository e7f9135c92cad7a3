"""Benchmark prompts from JSONL, in the common speculative-decoding layout or a plain one.

``{"question_id": ..., "category": ..., "turns": ["first", "second", ...]}``: each later turn is
asked after the model's own answer to the previous one (multi-turn, as in MT-Bench/Spec-Bench).
``{"prompt": "...", "category": ...}`` is one turn. Bad lines fail with the file and line named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class BenchPrompt:
    question_id: str
    category: str
    turns: tuple[str, ...]


def parse_prompt(obj: object, where: str = "prompt", index: int = 0) -> BenchPrompt:
    """One JSON object -> BenchPrompt; ``where`` names the source in errors."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "turns" in obj and "prompt" in obj:
        raise ValueError(f"{where}: give either 'turns' or 'prompt', not both")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
    elif "prompt" in obj:
        turns = [obj["prompt"]]
    else:
        raise ValueError(f"{where}: missing 'turns' (list of strings) or 'prompt' (string)")
    _check_turns(turns, where)
    category = obj.get("category", "default")
    _check_category(category, where)
    qid = obj.get("question_id", index)
    return BenchPrompt(str(qid), category, tuple(turns))


def load_prompts(path: str | Path, limit: int | None = None, categories: list[str] | None = None) -> list[BenchPrompt]:
    """Read a JSONL prompt file (blank lines and ``#`` comments skipped). ``categories``: None keeps
    every category; a list keeps those it names, so an empty one is refused (it would keep none)."""
    if categories is not None and not categories:
        raise ValueError("categories=[] names no category; give None to keep every category")
    path = Path(path)
    out: list[BenchPrompt] = []
    seen: dict[str, tuple[str, bool]] = {}  # question_id -> (where, whether the line gave it)
    for n, line in enumerate(_read(path).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        p = parse_prompt(obj, where, len(out))
        given = isinstance(obj, dict) and "question_id" in obj
        if p.question_id in seen:
            raise ValueError(_duplicate(p.question_id, (where, given), seen[p.question_id]))
        seen[p.question_id] = (where, given)
        out.append(p)
    if categories is not None:
        known = sorted({p.category for p in out})
        missing = [c for c in categories if c not in known]
        if missing:
            raise ValueError(f"unknown categor{'y' if len(missing) == 1 else 'ies'} {missing}; "
                             f"{path} has: {', '.join(known)}")
        out = [p for p in out if p.category in categories]
    if limit is not None:
        out = out[:limit]
    if not out:
        raise ValueError(f"no prompts in {path}")
    return out


def _read(path: Path) -> str:
    """The prompt file's text; a missing file, a directory, one that cannot be read or is not
    UTF-8 is refused, naming the path (a bare codec error would not say which file)."""
    if path.is_dir():
        raise ValueError(f"prompt file {path} is a directory; give a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ValueError(f"prompt file {path}: cannot read it ({exc.strerror or exc})") from None


def _check_turns(turns: Sequence[object], where: str) -> None:
    """At least one turn, each a string with some text (a model is asked each in turn)."""
    if not turns:
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
    for t in turns:
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"{where}: every turn must be a non-empty string, got {t!r}")


def _check_category(category: object, where: str) -> None:
    """A non-empty string other than ``all``: ``all`` names every prompt together in the report, so
    a prompt of that category would be counted twice in that row."""
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    if category == "all":
        raise ValueError(f"{where}: category 'all' is the report's name for every prompt together; "
                         "give this prompt another category")


def _duplicate(qid: str, this: tuple[str, bool], first: tuple[str, bool], here: str = "this line") -> str:
    """A duplicate question_id, saying which side's id is a default (a prompt without one gets its
    0-based position among the prompts, which another line may give explicitly)."""
    def how(where: str, given: bool) -> str:
        return f"{where} gives it" if given else f"{where} has no question_id and gets its position as its id"

    return (f"{this[0]}: duplicate question_id {qid!r}: {how(here, this[1])}, and {how(*first)}; "
            "give each prompt its own id")


def check_prompts(prompts: Sequence[BenchPrompt]) -> None:
    """Prompts as the bench takes them (``run_bench`` and ``Bench.run`` get lists that need not come
    from ``load_prompts``), refused before anything runs or is written: none (nothing to measure),
    a prompt without turns or with an empty or non-string one, an empty category or ``all`` (the
    report's row of every prompt), or a question_id given twice (the report keys greedy mismatches
    by it), with ``load_prompts``' messages."""
    if not prompts:
        raise ValueError("no prompts to benchmark: give at least one prompt")
    seen: dict[str, tuple[str, bool]] = {}
    for i, p in enumerate(prompts):
        where = f"prompts[{i}]"
        _check_turns(p.turns, where)
        _check_category(p.category, where)
        if p.question_id in seen:
            raise ValueError(_duplicate(p.question_id, (where, True), seen[p.question_id], "this prompt"))
        seen[p.question_id] = (where, True)
