"""transformers API differences across the supported range, decided once per model class.

transformers renamed the KV-cache keyword of every model's ``forward`` from ``past_key_values``
to ``cache`` in 5.24. A model called with the other spelling takes it into ``**kwargs``, ignores
it and runs with no past at all: wrong tokens in one row, shape errors in batched or tree rounds,
and no error saying why. So the keyword is read from the model's own forward signature, and
every forward that feeds a cache is followed by a metadata-only check that the cache grew by the
positions fed (a future rename is then an error, not wrong text).
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

CACHE_KEYWORDS = ("cache", "past_key_values")  # newest spelling first


@lru_cache(maxsize=64)
def _keyword_of(forward: Any) -> str:
    params = inspect.signature(forward).parameters
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    raise TypeError(f"{getattr(forward, '__qualname__', forward)} takes none of {', '.join(CACHE_KEYWORDS)}: "
                    "this transformers model API is not supported (see pyproject.toml for the tested range)")


def cache_keyword(module: Any) -> str:
    """The keyword ``module.forward`` takes its KV cache under (a transformers model or decoder)."""
    return _keyword_of(type(module).forward)


def cached_length(cache: Any) -> int:
    """Positions a transformers cache holds (layer 0's slot axis; shape metadata, no device sync)."""
    if cache is None or not cache.layers:
        return 0
    lay = cache.layers[0]
    return int(lay.keys.shape[-2]) if getattr(lay, "is_initialized", False) and lay.keys.dim() == 4 else 0


def check_cache_grew(cache: Any, before: int, fed: int, model: Any) -> None:
    """Raise if a forward that was handed ``cache`` did not append its ``fed`` positions to it."""
    after = cached_length(cache)
    if after != before + fed:
        raise RuntimeError(
            f"{type(model).__name__} did not use the KV cache it was given (it held {before} positions, fed "
            f"{fed}, now {after}): this transformers version ({_version()}) takes the cache under a keyword "
            f"this runtime does not pass; decoding without the past would give wrong tokens")


def _version() -> str:
    import transformers

    return transformers.__version__
