"""Tokenised conversations as compact arrays, for moving training data where it cannot be made.

The GPU script (``scripts/train_heads_gpu.py``) tokenises ShareGPT here, where the ``[train]``
extra and the tokenizer are, and carries only these arrays to a machine with a size limit per
transfer: 2 bytes per token instead of the 125 MB JSON file, and no tokenizer needed there.

A shard ``shard-00000.npz`` holds ``tokens`` (uint16 when the vocabulary fits, else int32) [N],
``trained`` (the assistant mask, 8 positions per byte) and ``offsets`` (int64, [S+1]: conversation
i spans offsets[i]:offsets[i+1]); ``meta.json`` lists the shards, the counts and the settings.
The token budget cuts conversations exactly as ``features.extract`` does, so a budget means the
same data whichever way the features are made.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from spec_plugins.models import same_model
from spec_plugins.training.features import ShardDirectory, shard_errors

FORMAT = "spec-plugins-tokens/1"
PARTIAL = ".partial"  # the subdirectory a run writes its shards into until it is complete
Example = tuple[Sequence[int], Sequence[bool]]


def token_dtype(vocab: int) -> np.dtype:
    """The smallest unsigned/signed integer type that holds every id of ``vocab``."""
    if vocab <= 0:
        raise ValueError(f"vocabulary size must be positive, got {vocab}")
    return np.dtype(np.uint16) if vocab <= 1 << 16 else np.dtype(np.int32)


@dataclass
class TokenShard:
    """Conversations flattened: row i spans offsets[i]:offsets[i+1]."""

    tokens: np.ndarray  # [N] uint16 or int32
    trained: np.ndarray  # [N] bool
    offsets: np.ndarray  # [S+1] int64

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:  # a file object: numpy would otherwise append .npz to the name
            np.savez(f, tokens=self.tokens, trained=np.packbits(self.trained), offsets=self.offsets)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "TokenShard":
        with shard_errors(path, "token shard", "write the token shards again"), \
                np.load(path, allow_pickle=False) as z:  # a truncated copy: numpy's BadZipFile, named as a ValueError
            offsets = z["offsets"].astype(np.int64)
            n = int(offsets[-1])
            tokens, trained = z["tokens"], np.unpackbits(z["trained"], count=n).astype(bool)
        if tokens.shape[0] != n or trained.shape[0] != n:
            raise ValueError(f"{path}: {tokens.shape[0]} tokens, {trained.shape[0]} mask bits, offsets end at {n}")
        return cls(tokens, trained, offsets)


def write_token_shards(examples: Iterable[Example], out: str | Path, meta: dict, vocab: int, max_tokens: int,
                       shard_tokens: int = 1_000_000, allow_empty: bool = False) -> dict:
    """Write ``examples`` ((ids, assistant mask) per conversation, in order) as token shards until
    ``max_tokens`` tokens; returns the summary also written to ``out/meta.json``. The shards are
    written into ``out/.partial`` and replace those of ``out`` only once complete, so an
    interrupted run leaves an earlier run's shards as they were. A run that keeps no
    conversation is refused (a ValueError; ``out`` as it was), since no reader takes an empty
    store; ``allow_empty`` publishes it anyway, for a caller that reports the empty run itself."""
    if max_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"max_tokens and shard_tokens must be positive, got {max_tokens} and {shard_tokens}")
    out = Path(out)
    work = out / PARTIAL
    made = next((p for p in reversed([out, *out.parents]) if not p.exists()), work)  # removed again on a refusal
    if work.exists():  # what an interrupted run left
        shutil.rmtree(work)
    work.mkdir(parents=True)
    dtype = token_dtype(vocab)
    state = {"format": FORMAT, "meta": meta, "vocab": vocab, "dtype": dtype.name, "shards": [], "tokens": 0,
             "trained_tokens": 0, "conversations": 0, "exhausted": True}
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    pending = 0

    def flush() -> None:
        nonlocal parts, pending
        if not parts:
            return
        lens = np.array([len(t) for t, _ in parts], dtype=np.int64)
        shard = TokenShard(np.concatenate([t for t, _ in parts]), np.concatenate([m for _, m in parts]),
                           np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        name = f"shard-{len(state['shards']):05d}.npz"
        shard.save(work / name)
        state["shards"].append(name)
        state["trained_tokens"] += int(shard.trained.sum())
        state["conversations"] += len(parts)
        parts, pending = [], 0

    seen = 0
    for ids, trained in examples:
        seen += 1
        if state["tokens"] >= max_tokens:
            state["exhausted"] = False
            break
        cut = state["tokens"] + len(ids) > max_tokens
        ids, trained = list(ids[: max_tokens - state["tokens"]]), list(trained[: max_tokens - state["tokens"]])
        if len(ids) < 2 or not any(trained):
            if cut:  # the budget's remainder holds no answer token: the budget is spent
                state["exhausted"] = False
                break
            continue
        arr = np.asarray(ids, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= vocab:  # tokens of another model: refused, ``out`` as it was
            shutil.rmtree(made, ignore_errors=True)
            raise ValueError(f"token id {int(arr.max()) if arr.max() >= vocab else int(arr.min())} is outside "
                             f"the vocabulary of {vocab}")
        parts.append((arr.astype(dtype), np.asarray(trained, dtype=bool)))
        state["tokens"] += len(ids)
        pending += len(ids)
        if pending >= shard_tokens:
            flush()
        if cut:
            state["exhausted"] = False
            break
    flush()
    if not state["conversations"] and not allow_empty:
        shutil.rmtree(made)
        raise ValueError(f"no conversation to write: {seen} read, none holding an answer (an assistant token, 2 "
                         f"tokens or more) within the budget of {max_tokens} tokens; {out} left as it was")
    _publish(work, out, state)
    return state


def seconds_per_million(seconds: float, tokens: int) -> float | None:
    """A rate for the reports; None without tokens (there is nothing to divide by)."""
    return round(seconds / tokens * 1e6, 1) if tokens else None


def _publish(work: Path, out: Path, state: dict) -> None:
    """Replace ``out``'s shards by the finished run's in ``work``: meta.json goes first and comes
    back last, so a reader never finds a meta.json that does not describe the shards beside it."""
    (out / "meta.json").unlink(missing_ok=True)
    for old in out.glob("shard-*.npz"):
        old.unlink()
    for name in state["shards"]:
        (work / name).replace(out / name)
    work.rmdir()
    write_meta(out, state)


def write_meta(out: Path, state: dict) -> None:
    """``out/meta.json``, written atomically (a reader sees the old file or the new one)."""
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(out / "meta.json")


class TokenStore(ShardDirectory):
    """The token shards of one directory; ``read`` gives torch tensors as ``FeatureStore.read`` does."""

    shard_type = TokenShard

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / "meta.json"
        if not path.is_file():
            raise FileNotFoundError(f"no token shards in {self.directory} (no meta.json); run the stage step first")
        self.state = json.loads(path.read_text())
        if self.state.get("format") != FORMAT:
            raise ValueError(f"{path}: format {self.state.get('format')!r}, expected {FORMAT!r}")
        self.shards = [self.directory / s for s in self.state["shards"]]
        missing = [p.name for p in self.shards if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{self.directory} lacks token shards {missing[:3]}")
        if not self.shards:
            raise ValueError(f"{self.directory} holds no token shards")

    def check_model(self, target: str, vocab: int) -> None:
        """Token ids mean something only to the tokenizer that made them: refuse shards made for
        another target than ``target``, or whose ids reach past its ``vocab`` embeddings."""
        made_for = self.meta.get("target") or self.meta.get("tokenizer")
        if made_for is None:
            raise ValueError(f"{self.directory} does not say which target's tokenizer made its tokens "
                             "(no target in meta.json), so they cannot be checked against --target")
        if not same_model(made_for, target):
            raise ValueError(f"{self.directory} holds tokens made for {made_for!r}, not {target!r}")
        if int(self.state["vocab"]) > vocab:
            raise ValueError(f"{self.directory} holds token ids of a {self.state['vocab']}-token vocabulary; "
                             f"{target} embeds {vocab} tokens")

    def read(self, i: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """``tokens``/``offsets`` as int64 and ``trained`` as bool tensors of shard i."""
        s = self.load(i)
        arrays = {"tokens": s.tokens.astype(np.int64), "trained": s.trained, "offsets": s.offsets}
        unknown = set(names) - set(arrays)
        if unknown:
            raise KeyError(f"token shards hold tokens, trained and offsets, not {sorted(unknown)}")
        return {n: torch.from_numpy(arrays[n]) for n in names}

    def fingerprint(self) -> str:
        """What the shards hold (tokens, assistant marks, conversation bounds), as a short hash: a
        resumed extraction over shards written again with other data must not continue."""
        h = hashlib.sha256()
        for i in range(len(self.shards)):
            s = self.load(i)
            for a in (s.tokens.astype(np.int64), s.trained.astype(bool), s.offsets.astype(np.int64)):
                h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def examples(self, max_seq: int) -> Iterator[tuple[list[int], list[bool]]]:
        """Every conversation, in order, cut at ``max_seq`` tokens as every source's are."""
        for i in range(len(self.shards)):
            for ids, trained in self.conversations(i):
                yield ids[:max_seq], trained[:max_seq]

    def conversations(self, i: int) -> list[tuple[list[int], list[bool]]]:
        """Shard i as (ids, assistant mask) per conversation."""
        s = self.load(i)
        o = s.offsets.tolist()
        return [(s.tokens[a:b].astype(np.int64).tolist(), s.trained[a:b].tolist()) for a, b in zip(o[:-1], o[1:])]
