"""What the Python API (``SpeculativeDecoder``) accepts and refuses, in one place.

Prompt token ids, stop strings, per-row sampling and seeds and token limits are checked and
normalised here before any row starts, so a bad value fails with an error naming it (never deep
inside a forward, never read as something else).
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Mapping, Sequence, Union

import torch
from pydantic import ValidationError

from spec_plugins.config import SamplingConfig

# stop strings: one string, several, or None (no stop)
Stop = Union[str, Sequence[str], None]


def token_id(t: Any, i: int) -> int:
    """A prompt's token id at position ``i``: an integer (Python, numpy, or a one-element integer
    tensor), never a float, bool or str read as one."""
    if isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool:
        raise TypeError(f"prompt token ids must be integers; position {i} holds the bool {t!r}")
    try:
        return operator.index(t)
    except TypeError:
        raise TypeError(f"prompt token ids must be integers; position {i} holds {t!r} "
                        f"({type(t).__name__})") from None


def in_vocab(ids: list[int], vocab_size: int) -> list[int]:
    """``ids``, each checked to be a row of the target's embedding (an id outside it fails
    deep inside the forward otherwise)."""
    vocab = int(vocab_size)
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise ValueError(f"prompt token id {t} (position {i}) is outside the model's vocabulary "
                             f"(0..{vocab - 1})")
    return ids


def stop_strings(stop: Stop) -> list[str]:
    """Stop strings as a list: one string is one stop, None none; every entry a string."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, Iterable):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    stops = list(stop)
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be strings; stop[{i}] is {s!r} ({type(s).__name__})")
    return stops


def token_limits(max_new_tokens: int | Sequence[int], rows: int) -> list[int]:
    """Each row's max_new_tokens: one integer for every row, or one per row; none negative."""
    many = isinstance(max_new_tokens, (list, tuple))
    limits = list(max_new_tokens) if many else [max_new_tokens] * rows
    if len(limits) != rows:
        raise ValueError(f"max_new_tokens needs one entry per prompt ({rows}), got {len(limits)}")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in limits):
        raise ValueError(f"max_new_tokens must be an integer (or one per prompt), got {max_new_tokens!r}")
    if min(limits, default=0) < 0:
        raise ValueError("max_new_tokens must be >= 0")
    return limits


def row_sampling(s: SamplingConfig | Mapping, i: int) -> SamplingConfig:
    """Row ``i``'s sampling: a ``SamplingConfig``, or its fields (checked as a config is)."""
    if isinstance(s, SamplingConfig):
        return s
    if isinstance(s, Mapping):
        return SamplingConfig.model_validate(dict(s))
    raise TypeError(f"sampling[{i}] must be a SamplingConfig or a dict of its fields, got {type(s).__name__}")


def row_seeds(seeds: Sequence[int | None] | None, sampling: Sequence[SamplingConfig] | None
              ) -> list[int | None] | None:
    """Each row's generator seed: ``seeds[i]`` (checked as ``SamplingConfig.seed`` is) where
    given, else ``sampling[i].seed`` where that entry sets one; None without either (the row draws
    from the generator the rows share, seeded from the call's ``seed``)."""
    if seeds is None:
        return [s.seed if "seed" in s.model_fields_set else None for s in sampling] if sampling is not None else None
    out = []
    for i, seed in enumerate(seeds):
        try:
            out.append(SamplingConfig(seed=seed).seed)
        except ValidationError as exc:
            raise ValueError(f"seeds[{i}] = {seed!r}: {exc.errors()[0]['msg']}") from None
    return out
