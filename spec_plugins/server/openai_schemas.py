"""OpenAI chat and text completions as the official ``openai`` client sends them.

Field names, ranges and defaults are OpenAI's, and every error names the field the client sent
(``max_completion_tokens``, not the TGI name it maps to). A field sent as null is one left out,
as at OpenAI: it takes its default (``max_tokens`` 16 on /v1/completions, ``stream`` and ``echo``
false). Fields this server does not implement are accepted at their neutral value (clients send
them as null) and refused otherwise. Errors answer in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``, built by ``schemas.error_body``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spec_plugins.api_inputs import CHAT_ROLES, check_content, template_role
from spec_plugins.config import MAX_SEED
from spec_plugins.server.controls import Controls, check_penalty, openai_logit_bias
from spec_plugins.server.schemas import (GenerateParameters, _neutral, check_repetition_penalty, check_seed,
                                         check_stops)

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5
MAX_COMPLETION_LOGPROBS = 5
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = Field(None, description="Send a last chunk with the usage and no choices.")
    include_obfuscation: bool | None = None

    @model_validator(mode="after")
    def _obfuscation(self) -> "StreamOptions":
        _neutral("stream_options.include_obfuscation", self.include_obfuscation, (None, False))
        return self


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = Field(None, description="Held to the schema either way: the output always matches it.")


class ResponseFormat(BaseModel):
    """``text`` (OpenAI's default), ``json_object`` or ``json_schema``: the output is constrained
    at every drafted node (``spec_plugins.grammar``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("`response_format.json_schema` is required with type `json_schema`, and only there")
        return self

    def spec(self) -> Any:
        from spec_plugins.grammar.spec import from_response_format

        body = {"type": self.type}
        if self.json_schema is not None:
            body["json_schema"] = {"schema": self.json_schema.schema_}
        return from_response_format(body)


class OpenAIRequest(BaseModel):
    """What chat and text completions share: sampling, choices, streaming."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="Accepted and echoed as the served model (one model per server).")
    temperature: float | None = Field(None, description="0 = greedy; OpenAI's default 1 samples.")
    top_p: float | None = None
    n: int | None = Field(None, description="Choices, each decoded as its own batch row.")
    seed: int | None = Field(None, description="Choice i samples with seed + i.")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    repetition_penalty: float | None = Field(None, description="TGI's extension (CTRL penalty).")
    user: str | None = None
    frequency_penalty: float | None = Field(None, description="Minus penalty x the token's count in the completion.")
    presence_penalty: float | None = Field(None, description="Minus penalty if the token is in the completion.")
    logit_bias: Any = Field(None, description='{"token id": bias in [-100, 100]}.')

    @field_validator("temperature")
    @classmethod
    def _temp(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 <= v <= 2.0):  # NaN fails
            raise ValueError("`temperature` must be between 0 and 2")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 < v <= 1.0):
            raise ValueError("`top_p` must be > 0 and <= 1")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("`n` must be at least 1")
        return v

    _seed = field_validator("seed")(classmethod(lambda cls, v: check_seed(v)))
    _stop = field_validator("stop")(classmethod(lambda cls, v: check_stops(v)))
    _rep = field_validator("repetition_penalty")(classmethod(lambda cls, v: check_repetition_penalty(v)))
    _freq = field_validator("frequency_penalty")(classmethod(lambda cls, v: check_penalty("frequency_penalty", v)))
    _pres = field_validator("presence_penalty")(classmethod(lambda cls, v: check_penalty("presence_penalty", v)))
    _bias = field_validator("logit_bias")(classmethod(lambda cls, v: openai_logit_bias(v)))

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI reads an optional field sent as null as one left out (clients send their unset
        fields so), so it gets the field's default rather than a type error or, where the default
        is not null, another meaning. Null stays an error for required fields and unknown ones."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}

    @model_validator(mode="after")
    def _shared(self) -> "OpenAIRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed with `stream: true`")
        return self

    def controls(self) -> Controls:
        """Penalties and bias (OpenAI's: over the completion), and the response format's grammar."""
        rf = getattr(self, "response_format", None)
        return Controls(rf.spec() if rf is not None else None, self.logit_bias or (), self.presence_penalty or 0.0,
                        self.frequency_penalty or 0.0)

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def parameters(self, max_new_tokens: int | None, choice: int = 0) -> GenerateParameters:
        """TGI's mapping: temperature 0 = greedy, otherwise sample (OpenAI's default is 1);
        choice ``i`` of a seeded request samples with ``seed + i``. Greedy takes no ``top_p`` or
        seed: TGI's rule samples whenever a warper is set, which would sample at temperature 1."""
        greedy = self.temperature == 0.0
        seed = None if self.seed is None or greedy else (self.seed + choice) % (MAX_SEED + 1)
        top_p = None if greedy or self.top_p in (None, 1.0) else self.top_p
        return GenerateParameters(
            max_new_tokens=max_new_tokens, do_sample=not greedy, temperature=None if greedy else self.temperature,
            top_p=top_p, seed=seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            repetition_penalty=self.repetition_penalty)


def _positive(name: str, v: int | None) -> int | None:
    if v is not None and v <= 0:
        raise ValueError(f"`{name}` must be strictly positive")
    return v


class ContentPart(BaseModel):
    """An OpenAI content part; this text-only server takes ``{"type": "text", "text": str}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; its roles and their mapping for the template are the Python API's
    (``api_inputs.CHAT_ROLES``, ``template_role``), so both render a message alike."""

    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... travel with the history

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[ContentPart] | None = None  # None: an assistant turn holding tool calls (``_contents``)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_role(self) -> str:
        """``developer`` is OpenAI's newer name for ``system``; chat templates know ``system``."""
        return template_role(self.role)


class ChatRequest(OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = Field(None, description="Takes precedence over max_tokens.")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # accepted at their neutral values only (or, for bookkeeping fields, as given)
    tools: Any = None
    tool_choice: Any = None
    tool_prompt: str | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _contents(cls, data: Any) -> Any:
        """Each message that gives no content is refused by name (``api_inputs.check_content``,
        the Python API's check), before it could render as an empty turn; other faults of a
        message (its shape, role, parts) are the fields' own errors."""
        msgs = data.get("messages") if isinstance(data, dict) else None
        for i, m in enumerate(msgs if isinstance(msgs, list) else ()):
            if isinstance(m, dict) and m.get("role") in CHAT_ROLES:
                check_content(m, i)
        return data

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("`messages` cannot be empty")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        return _positive("max_tokens", v)

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion(cls, v: int | None) -> int | None:
        return _positive("max_completion_tokens", v)

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v: int | None) -> int | None:
        if v is not None and not (0 <= v <= MAX_TOP_LOGPROBS):
            raise ValueError(f"`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}")
        return v

    @model_validator(mode="after")
    def _chat(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        _neutral("tools", self.tools, (None, []))
        _neutral("tool_choice", self.tool_choice, (None, "none", "auto"))
        _neutral("store", self.store, (None, False))
        _neutral("service_tier", self.service_tier, (None, "auto", "default"))
        _neutral("modalities", self.modalities, (None, ["text"]))
        return self

    @property
    def max_field(self) -> str:
        """The name of the length field the client used (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions (OpenAI's legacy text completions)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = Field(None, description="Report the logprobs of this many most likely tokens too.")
    echo: bool = Field(False, description="Prepend the prompt to the text.")
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, (str, list)) and not p for p in v)):
            raise ValueError("`prompt` cannot be empty")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        return _positive("max_tokens", v)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not (0 <= v <= MAX_COMPLETION_LOGPROBS):
            raise ValueError(f"`logprobs` must be between 0 and {MAX_COMPLETION_LOGPROBS}")
        return v

    @model_validator(mode="after")
    def _completion(self) -> "CompletionRequest":
        _neutral("suffix", self.suffix)
        if self.best_of is not None and self.best_of != self.choices:
            raise ValueError("`best_of` is not supported by this server (spec-plugins); leave it unset or equal "
                             "to `n`")
        if self.echo and self.logprobs is not None:
            raise ValueError("`echo` with `logprobs` is not supported by this server (prompt logprobs); drop one")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

