"""The logits transforms clients send (OpenAI's ``logit_bias`` and penalties, TGI's
``frequency_penalty``) as transformers-style processors over a row's history.

They run where user processors run (``sampling.LogitsPipeline``): at every drafted node, on the
prefix that node would have in plain decoding, so they are exact under speculation in chains and
trees. Each is vectorised over the rows of one call and never leaves the logits' device.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import torch

from spec_plugins.api_inputs import integer


def _token_id(key: Any) -> int:
    """A ``logit_bias`` key as a token id: an integer (``api_inputs.integer``) or an integer
    string (JSON keys are strings); a float, bool or other string would bias another token."""
    token = integer(key)
    if token is None and isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
        token = int(key)
    if token is None:
        raise ValueError(f"logit_bias: keys must be token ids (integers or integer strings), got {key!r} "
                         f"({type(key).__name__})")
    return token


def bias_token_ids(keys: Iterable[Any]) -> list[int]:
    """``logit_bias`` keys as token ids (``_token_id``), two keys naming one token ("5" and "05")
    refused: their biases would add up past the per-token bound, or one would be lost."""
    named: dict[int, Any] = {}  # token id -> the key that named it
    for key in keys:
        token = _token_id(key)
        if token in named:
            raise ValueError(f"logit_bias: keys {named[token]!r} and {key!r} both name token {token}; give each once")
        named[token] = key
    return list(named)


class LogitBias:
    """OpenAI ``logit_bias``: a fixed amount added to chosen tokens' logits (-100 bans a token
    in practice, +100 all but forces it)."""

    def __init__(self, bias: Mapping[int, float], vocab: int) -> None:
        ids = bias_token_ids(bias)
        for token, value in zip(ids, bias.values()):
            if not 0 <= token < vocab:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary (0..{vocab - 1})")
            if not -100.0 <= float(value) <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {token} must be between -100 and 100, got {value}")
        self.ids = torch.tensor(ids, dtype=torch.long, device="cpu")
        self.values = torch.tensor([float(v) for v in bias.values()], device="cpu")
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        dev = scores.device
        if dev not in self._on:
            self._on[dev] = (self.ids.to(dev), self.values.to(dev))
        ids, values = self._on[dev]
        return scores.index_add(-1, ids, values.to(scores.dtype).expand(scores.shape[0], -1))


class FrequencyPresencePenalty:
    """Subtract ``frequency`` x (how often a token occurred) and ``presence`` x (whether it did).

    ``start``: the history counted begins at this position (OpenAI counts the completion only:
    the prompt's length, as the processor sees it); ``per_length``: TGI's ``frequency_penalty``,
    whose count is the token's share of the whole sequence (count / length)."""

    def __init__(self, frequency: float = 0.0, presence: float = 0.0, start: int = 0, per_length: bool = False) -> None:
        for name, v in (("frequency_penalty", frequency), ("presence_penalty", presence)):
            if not -2.0 <= float(v) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {v}")
        self.frequency, self.presence, self.start, self.per_length = float(frequency), float(presence), start, per_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        seen = input_ids[:, self.start:]
        if seen.shape[1] == 0:
            return scores
        counts = torch.zeros(scores.shape, dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, seen, torch.ones(seen.shape, dtype=scores.dtype, device=scores.device))
        out = scores
        if self.frequency:
            freq = counts / input_ids.shape[1] if self.per_length else counts
            out = out - self.frequency * freq
        if self.presence:
            out = out - self.presence * (counts > 0).to(scores.dtype)
        return out
