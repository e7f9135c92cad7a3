"""Training examples for drafters: (token ids, which ids the assistant wrote) per conversation.

Two ways to get the assistant's text, compared on held-out acceptance in the README:
- ``fixed``: the conversations as written (ShareGPT), every turn kept; features and soft labels
  then come from one target forward over each whole conversation (prefill speed).
- ``self``: the target regenerates the answers (self-distillation), batched greedy decoding on
  the project's fastest runtime; only the first user turn is kept, since later user turns were
  written in reply to another model's answers.

Sources: ``sharegpt`` (the ``[train]`` extra) or the shipped template prompts
(``examples/prompts/train.jsonl``, prompts without answers, so ``self`` only).
"""

from __future__ import annotations

import hashlib
import json
from importlib.resources import files
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Sequence, Union

from spec_plugins.training.sharegpt import DataFilter, FilterCounts, conversations, dataset_file, encode_conversation

Example = tuple[list[int], list[bool]]
Prompt = Union[str, Sequence[dict[str, str]], Sequence[int]]  # text, chat messages or token ids


def shipped_prompts(name: str) -> Path:
    """A prompt file of ``examples/prompts``, found through the ``spec_plugins.prompts`` package it
    is installed as (pyproject's package-dir), so a wheel install has it as the source tree does."""
    return Path(str(files("spec_plugins.prompts").joinpath(name)))


DEFAULT_PROMPTS = shipped_prompts("train.jsonl")


def load_prompts(path: str | Path) -> list[str]:
    """One JSON object per line with a ``prompt`` field, in UTF-8 (a file that is not names the
    line of its first bad byte)."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path} line {bad}: not UTF-8 text "
                         f"(byte 0x{data[exc.start]:02x}); save the file as UTF-8") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path} line {n}: expected an object with a non-empty string `prompt`, got {line[:80]!r}")
        out.append(row["prompt"])
    if not out:
        raise ValueError(f"no prompts in {path}")
    return out


def sharegpt_examples(tokenizer: Any, split: Literal["train", "heldout"], max_seq: int,
                      flt: DataFilter = DataFilter(), heldout_share: float = 0.02,
                      counts: FilterCounts | None = None) -> Iterator[Example]:
    """ShareGPT conversations as written, in the chat template, cut at ``max_seq`` tokens."""
    for _, msgs in conversations(dataset_file(), flt, split, heldout_share, counts):
        enc = encode_conversation(tokenizer, msgs, max_seq)
        if enc is not None:
            yield enc.ids, enc.assistant


def first_turns(split: Literal["train", "heldout"], flt: DataFilter = DataFilter(), heldout_share: float = 0.02
                ) -> Iterator[list[dict[str, str]]]:
    """The opening user turn (with any system message) of each kept ShareGPT conversation."""
    for _, msgs in conversations(dataset_file(), flt, split, heldout_share):
        head = msgs[: 2 if msgs[0]["role"] == "system" else 1]
        yield head


def answerable(decoder: Any, prompts: Iterable[Prompt], max_prompt: int | None = None) -> Iterator[list[int]]:
    """The prompts as token ids (text in the chat template; token ids as they are), lazily, those
    longer than ``max_prompt`` tokens left out: a batch of long prompts prefills all their
    positions at once, and one very long question can exhaust the host's memory."""
    for p in prompts:
        ids = decoder.encode([{"role": "user", "content": p}] if isinstance(p, str) else list(p))
        if max_prompt is None or len(ids) <= max_prompt:
            yield ids


def self_distilled(decoder: Any, prompts: Sequence[Prompt], max_new_tokens: int,
                   batch: int = 16, progress: bool = True, max_prompt: int | None = None) -> Iterator[Example]:
    """The target's own greedy answers (plain decoding, ``batch`` rows per target forward), one
    example per prompt ``answerable`` keeps; an answer has at most the room the context leaves."""
    from tqdm.auto import tqdm

    plain = decoder.without_speculation()
    bar = tqdm(total=len(prompts), desc="self-distillation (answers)", disable=not progress, dynamic_ncols=True)
    encoded = list(answerable(plain, prompts, max_prompt))
    for s in range(0, len(encoded), batch):
        ids = encoded[s: s + batch]
        room = [min(max_new_tokens, plain.target.max_context - len(p)) for p in ids]
        results = plain.generate_batch(ids, max_new_tokens=room)
        for p, r in zip(ids, results):
            yield list(p) + list(r.token_ids), [False] * len(p) + [True] * len(r.token_ids)
        bar.update(len(ids))
    bar.close()


def self_examples(decoder: Any, texts: Sequence[Prompt] | None, split: Literal["train", "heldout"],
                  flt: DataFilter, heldout_share: float, max_seq: int, max_new_tokens: int, batch: int,
                  skip: int = 0) -> Iterator[Example]:
    """The (ids, trained) stream of the target's own answers to ``texts`` (None: ShareGPT's first
    turns), lazily and in chunks, so a token budget never waits for the whole corpus to be
    answered. ``skip``: the first answerable prompts a resumed extraction already consumed (one
    example each), left out before they are answered."""
    import itertools

    heads = texts if texts is not None else first_turns(split, flt, heldout_share)
    todo = itertools.islice(answerable(decoder, heads, max(16, max_seq - max_new_tokens)), skip, None)
    while chunk := list(itertools.islice(todo, batch * 4)):
        for ids, trained in self_distilled(decoder, chunk, max_new_tokens, batch, progress=False):
            yield ids[:max_seq], trained[:max_seq]


def prompts_fingerprint(texts: Sequence[str]) -> str:
    """What a prompts file holds, as a short hash: a resumed extraction must answer the same prompts."""
    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()[:16]



DEFAULT_MAX_SEQ = 1024


def fit_max_seq(max_seq: int | None, context: int | None, flag: str = "--max-seq") -> int:
    """Where conversations are cut: ``max_seq``, or unset DEFAULT_MAX_SEQ within the target's
    context. Past the context its features (and the answers it would have to write) are
    positions the target never serves, so an explicit ``max_seq`` there is refused."""
    if max_seq is None:
        return min(DEFAULT_MAX_SEQ, context) if context is not None else DEFAULT_MAX_SEQ
    if context is not None and max_seq > context:
        raise ValueError(f"{flag} {max_seq} exceeds the target's context of {context} positions; "
                         f"set {flag} to at most {context}")
    return max_seq
