"""What a row reports with each emitted token when it asks: the target's log-probability of it
(and, optionally, the best alternatives), by one documented rule."""

from __future__ import annotations

import math
from typing import Sequence

import torch


class TokenLogprob(float):
    """An emitted token's log-probability; ``top``: the most likely tokens at its position,
    ``(id, logprob)`` best first (``Batch.top_logprobs`` of them, none by default)."""

    top: tuple[tuple[int, float], ...] = ()


def _finite(x: float) -> float:
    # a finite float for JSON: the floor only guards the serialisation
    return x if math.isfinite(x) else -1e30


def logprobs(logits_row: torch.Tensor, at: Sequence[int], toks: Sequence[int], top: int = 0) -> list[float]:
    """The target's log p(token) at the position it was emitted from: log-softmax of the raw
    logits (``logits_row`` [N, V]), before repetition penalty, temperature, top-k and top-p, so
    every sampling setting that emits a token reports the same number for it."""
    n = min(len(at), len(toks))
    if n == 0:
        return []
    lp = logits_row[list(at[:n])].float().log_softmax(-1)
    idx = torch.tensor(list(toks[:n]), device=lp.device)[:, None]
    out = [TokenLogprob(_finite(x)) for x in lp.gather(-1, idx).squeeze(-1).tolist()]
    if top > 0:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        for o, vs, ts in zip(out, vals.tolist(), ids.tolist()):
            o.top = tuple((t, _finite(v)) for t, v in zip(ts, vs))
    return out
