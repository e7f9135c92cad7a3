"""What a request asks of its output beyond sampling: a grammar, ``logit_bias``, penalties.

Both routes name them their own way (OpenAI: ``response_format``, ``logit_bias``,
``presence_penalty``, ``frequency_penalty`` over the completion; TGI: ``grammar`` and
``frequency_penalty`` as a share of the whole sequence); both become one ``Controls``. The grammar
is compiled in a worker thread (``compile``) and checked against the limits before any row
starts; every problem is a 422 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spec_plugins.grammar import Compiled, GrammarError, GrammarLimits, GrammarSpec, RowGrammar, compile_grammar
from spec_plugins.grammar import ll_tokenizer
from spec_plugins.grammar.spec import from_tgi
from spec_plugins.processors import FrequencyPresencePenalty, LogitBias, _token_id, bias_token_ids
from spec_plugins.server.body import offload
from spec_plugins.server.schemas import ApiError


@dataclass(frozen=True)
class Controls:
    grammar: GrammarSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence: float = 0.0
    frequency: float = 0.0
    per_length: bool = False  # TGI's frequency_penalty: the token's share of the whole sequence

    def compile(self, state: Any, limits: GrammarLimits = GrammarLimits()) -> Compiled | None:
        """The grammar checked for the served model (run it in a worker thread: up to the limit's
        milliseconds)."""
        if self.grammar is None:
            return None
        batch = state.scheduler.batch
        try:
            tok = ll_tokenizer(state.tokenizer, int(batch.runtime.vocab_size), sorted(batch.eos))
            return compile_grammar(self.grammar, tok, limits)
        except GrammarError as exc:
            raise ApiError(422, str(exc)) from None

    def row(self, state: Any, compiled: Compiled | None, prompt_len: int) -> dict[str, Any]:
        """A row's ``processors`` and ``grammar`` (``RowRequest`` fields) for a prompt of
        ``prompt_len`` tokens (OpenAI's penalties count the completion only)."""
        batch = state.scheduler.batch
        vocab = int(batch.runtime.vocab_size)
        procs: list[Any] = []
        try:
            if self.logit_bias:
                procs.append(LogitBias(dict(self.logit_bias), vocab))
            if self.presence or self.frequency:
                start = 0 if self.per_length else prompt_len
                procs.append(FrequencyPresencePenalty(self.frequency, self.presence, start, self.per_length))
        except ValueError as exc:
            raise ApiError(422, str(exc)) from None
        grammar = RowGrammar(compiled, sorted(batch.eos), vocab) if compiled is not None else None
        return {"processors": tuple(procs), "grammar": grammar}


def tgi_controls(params: Any) -> Controls:
    """TGI ``parameters``' grammar and frequency penalty (TGI's: a share of the whole text)."""
    try:
        spec = from_tgi(params.grammar)
    except GrammarError as exc:
        raise ApiError(422, str(exc)) from None
    return Controls(spec, frequency=params.frequency_penalty or 0.0, per_length=True)


async def compiled(state: Any, controls: "Controls") -> Compiled | None:
    """The request's grammar compiled in a worker thread (an unconstrained request skips it)."""
    return None if controls.grammar is None else await offload(state.cpu_limiter, controls.compile, state)


def openai_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"token id": bias}``, bias in [-100, 100], at most 300 tokens.
    A key is an ASCII decimal id, read by ``processors._token_id`` (``str.isdigit`` would also take
    "٣٠" or "²"); two keys naming one token ("5" and "05") are refused: one bias would be lost."""
    if value is None or value == {}:
        return ()
    if not isinstance(value, dict):
        raise ValueError("`logit_bias` must be an object mapping token ids to biases")
    if len(value) > 300:
        raise ValueError(f"`logit_bias` takes at most 300 tokens, got {len(value)}")
    for k, v in value.items():
        try:
            _token_id(k)
        except ValueError:
            raise ValueError(f"`logit_bias` keys must be decimal token ids (ASCII digits), got {k!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ValueError(f"`logit_bias` of token {k} must be a number between -100 and 100, got {v!r}")
    return tuple(zip(bias_token_ids(value), map(float, value.values())))


def check_penalty(name: str, v: float | None) -> float | None:
    if v is not None and not -2.0 <= v <= 2.0:  # NaN fails
        raise ValueError(f"`{name}` must be between -2 and 2")
    return v
