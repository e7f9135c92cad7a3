"""Request/response models with text-generation-inference's names, and the error shapes.

TGI answers a bad request with ``{"error": "...", "error_type": "validation"}`` (422; 400 when
the body is not JSON) and the official clients turn ``error_type`` into their exception types,
so the messages below follow TGI's wording. On the OpenAI routes (``/v1/...``) the same error is
OpenAI's ``{"error": {"message", "type", "param", "code"}}``, the body the ``openai`` client
reads (``error_body`` decides by the request's path). Parameters TGI knows but this server does
not implement are accepted at their neutral value (clients send them as null) and refused
otherwise; a value TGI itself refuses (``best_of: 0``) gets TGI's range error first.
"""

from __future__ import annotations

import math
import re
from os.path import commonprefix
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.responses import JSONResponse

from spec_plugins.config import MAX_SEED, REPETITION_PENALTY_RANGE

MAX_STOP_SEQUENCES = 4
# a stop sequence's length: real ones are a few characters ("\n\n", "</s>", "Human:"); each is kept
# and searched per token, so a bound keeps a request's stop strings cheap (docs/serving.md)
MAX_STOP_CHARS = 1024
MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
MAX_BEST_OF = 1  # sequences per request (/info's max_best_of): best_of > 1 is not implemented


# our error kinds as OpenAI names them (``type``); a kind OpenAI has no name for is its own type
OPENAI_TYPES = {"validation": "invalid_request_error", "http": "invalid_request_error",
                "not_found": "invalid_request_error", "overloaded": "server_error", "generation": "server_error",
                "internal": "server_error"}
_NAMED = re.compile(r"`([A-Za-z_][\w.]*)`")  # a field as the messages here quote it: `messages.0.content`


def param_of(message: str) -> str | None:
    """The field a message names at its start (`` `temperature` must be ...``), else None."""
    named = _NAMED.match(message)
    return named.group(1) if named else None


def openai_path(scope: Mapping[str, Any]) -> bool:
    """Whether the request (an ASGI scope) is on the OpenAI routes: its path under the app's root
    path (a proxy's prefix) is /v1 or below it."""
    path, root = scope.get("path", ""), scope.get("root_path", "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return path == "/v1" or path.startswith("/v1/")


def error_body(scope: Mapping[str, Any], message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
    """The one place an error's body is built: OpenAI's shape on /v1 (``type`` OpenAI's name for
    the kind, ``code`` the kind itself, ``param`` the field named, given or as the message starts),
    TGI's ``{"error", "error_type"}`` on every other route."""
    if not openai_path(scope):
        return {"error": message, "error_type": error_type}
    return {"error": {"message": message, "type": OPENAI_TYPES.get(error_type, error_type),
                      "param": (param if param is not None else param_of(message)) or None, "code": error_type}}


class ApiError(Exception):
    """An error answered with a status code and ``error_body``'s body for the request's path."""

    def __init__(self, status: int, message: str, error_type: str = "validation",
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        # client text quoted in a message may hold a lone surrogate, which UTF-8 cannot encode
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers
        self.param = param

    def body(self, scope: Mapping[str, Any]) -> dict[str, Any]:
        return error_body(scope, self.message, self.error_type, self.param)

    def response(self, scope: Mapping[str, Any]) -> JSONResponse:
        """The JSON response (an ASGI app) for a request whose scope is ``scope``."""
        return JSONResponse(self.body(scope), status_code=self.status, headers=self.headers)


def error_bytes(status_line: bytes, error: ApiError, scope: Mapping[str, Any]) -> bytes:
    """``error``'s response as bytes for the socket, for an answer outside any request cycle (a
    connection's refusal, ``connections``): JSON in its path's shape, as clients parse every
    error (``text_generation`` reads the body as JSON before it looks at the status)."""
    resp = error.response(scope)
    return b"".join([status_line, *(k + b": " + v + b"\r\n" for k, v in resp.raw_headers), b"\r\n", resp.body])


def request_line_path(head: bytes) -> str:
    """The path in a request line (``POST /v1/chat/completions HTTP/1.1``) as uvicorn's scope has
    it (percent-decoded, less the root path), from the line's first bytes, so that a refusal before
    the request is parsed has its path's error shape; "" (TGI's shape) while they do not hold the
    path whole."""
    parts = head.lstrip(b"\r\n").split(b" ", 2)
    if len(parts) < 2 or (len(parts) == 2 and b"?" not in parts[1]):
        return ""
    try:
        return unquote(urlsplit(parts[1].decode("ascii", "replace")).path)
    except ValueError:  # an absolute target it cannot read ("http://[::1/v1"): not known
        return ""


def _neutral(name: str, value: Any, neutral: tuple = (None,)) -> Any:
    if value not in neutral:
        raise ValueError(f"`{name}` is not supported by this server (spec-plugins); leave it unset")
    return value


# ---- checks shared by the TGI and the OpenAI request schemas -------------------------------------
def check_repetition_penalty(v: float | None) -> float | None:
    lo, hi = REPETITION_PENALTY_RANGE
    if v is not None and not (lo <= v <= hi):
        raise ValueError(f"`repetition_penalty` must be between {lo:g} and {hi:g}")
    return v


# each API's seed range: TGI's seed is a u64, OpenAI's an int64 (negative seeds included)
TGI_SEEDS = (0, 2**64 - 1)
OPENAI_SEEDS = (-(2**63), 2**63 - 1)


def check_seed(v: int | None, bounds: tuple[int, int] = OPENAI_SEEDS) -> int | None:
    """A seed in its API's 64-bit range (OpenAI's by default), as the sampler's seed: its low 63
    bits (``SamplingConfig.seed`` is 0..MAX_SEED). Every seed in 0..MAX_SEED is itself; two seeds
    differing only in the 64th bit (TGI's s and s + 2**63, OpenAI's s and s - 2**63, e.g. -1 and
    MAX_SEED) sample alike: 2**64 values cannot map one-to-one onto 2**63. The same 64-bit
    pattern samples alike on both APIs (TGI's 2**64 - 1 as OpenAI's -1)."""
    lo, hi = bounds
    if v is None:
        return None
    if not lo <= v <= hi:
        raise ValueError(f"`seed` must be between {lo} and {hi}. Given: {v}")
    return v & MAX_SEED


def check_stops(v: Any) -> Any:
    """A stop sequence or a list of them (as either API sends it): at most 4, none empty, none
    longer than ``MAX_STOP_CHARS``."""
    stops = [v] if isinstance(v, str) else list(v or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("`stop` sequences must not be empty")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"`stop` sequences must be at most {MAX_STOP_CHARS} characters long. Given: one of {longest}")
    return v


class GenerateParameters(BaseModel):
    """TGI ``parameters``; unknown names are refused, types are strict (``"3"`` is not an integer,
    ``"yes"`` not a boolean), as TGI's deserializer has them; ranges are ``SamplingConfig``'s."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(None, description="Tokens to generate (default: what fits, capped).")
    do_sample: bool = Field(False, description="Sample instead of greedy (also implied by temperature/top_k/top_p).")
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    details: bool = False
    return_full_text: bool | None = False
    truncate: int | None = Field(None, description="Keep the input's last tokens: 1..--max-input-tokens "
                                                   "(requests.check_truncate, which knows the limit).")
    top_n_tokens: int | None = Field(None, description="Most likely tokens reported per position (details).")
    # known to TGI, neutral values only
    frequency_penalty: float | None = Field(None, description="TGI's: minus penalty x the token's share of the text.")
    grammar: Any = Field(None, description='{"type": "json" | "regex", "value": schema or pattern}.')
    best_of: int | None = None
    decoder_input_details: bool = False
    typical_p: float | None = None
    watermark: bool = False
    adapter_id: str | None = None

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("`max_new_tokens` must be strictly positive")
        return v

    @field_validator("temperature")
    @classmethod
    def _temp(cls, v: float | None) -> float | None:
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError("`temperature` must be strictly positive")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("`top_k` must be strictly positive")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 < v < 1.0):  # NaN fails both comparisons
            raise ValueError("`top_p` must be > 0.0 and < 1.0")
        return v

    _rep = field_validator("repetition_penalty")(classmethod(lambda cls, v: check_repetition_penalty(v)))
    _seed = field_validator("seed")(classmethod(lambda cls, v: check_seed(v, TGI_SEEDS)))
    _stop = field_validator("stop")(classmethod(lambda cls, v: check_stops(v)))

    @field_validator("top_n_tokens")
    @classmethod
    def _top_n(cls, v: int | None) -> int | None:
        if v is not None and not (0 <= v <= MAX_TOP_N_TOKENS):
            raise ValueError(f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {v}")
        return v

    @field_validator("frequency_penalty")
    @classmethod
    def _frequency(cls, v: float | None) -> float | None:
        if v is not None and not -2.0 <= v <= 2.0:  # NaN fails
            raise ValueError("`frequency_penalty` must be >= -2.0 and <= 2.0")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "GenerateParameters":
        # a value no server takes is an error in TGI's words, before the rule for valid values this
        # server does not implement (`best_of: 0` was "not supported", as if 0 were meaningful)
        if self.best_of is not None and self.best_of <= 0:
            raise ValueError(f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {self.best_of}")
        if self.typical_p not in (None, 1.0) and not 0.0 < self.typical_p < 1.0:  # NaN fails
            raise ValueError("`typical_p` must be > 0.0 and < 1.0")
        _neutral("best_of", self.best_of, (None, 1))
        _neutral("decoder_input_details", self.decoder_input_details, (False,))
        _neutral("typical_p", self.typical_p, (None, 1.0))
        _neutral("watermark", self.watermark, (False,))
        _neutral("adapter_id", self.adapter_id)
        return self

    @property
    def sampling(self) -> bool:
        """TGI's rule: sample if asked to, or if any warper is set."""
        return bool(self.do_sample or self.temperature not in (None, 1.0) or self.top_k is not None
                    or self.top_p is not None)


class _TgiInputs(BaseModel):
    """TGI's ``{inputs, parameters}`` body, shared by the generate routes and /tokenize."""

    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, v: str) -> str:
        if not v:
            raise ValueError("`inputs` cannot be empty")
        return v

    @field_validator("parameters", mode="before")
    @classmethod
    def _params_none(cls, v: Any) -> Any:
        return {} if v is None else v


class GenerateRequest(_TgiInputs):
    stream: bool = False  # only read by the compat route POST /


class TokenizeRequest(_TgiInputs):
    add_special_tokens: bool = True  # TGI's switch: false tokenizes without the BOS the model adds


def validation_message(exc: Any) -> str:
    """A pydantic ValidationError as one TGI-style line (field path only where it helps)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p != "__root__")
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field `{loc.split('.')[-1]}`" + (f" in `{loc.rsplit('.', 1)[0]}`" if "." in loc else "")
        elif not msg.startswith("`"):
            msg = f"`{loc}`: {msg}" if loc else msg
        parts.append(msg)
    return "; ".join(parts)


def _error_path(err: Mapping[str, Any]) -> list[str]:
    """One pydantic error's field path; a validator's own message may name a field deeper than
    its ``loc`` (a model validator's loc is its model's): that one where it extends the loc."""
    loc = [str(p) for p in err["loc"] if p != "__root__"]
    named = param_of(str(err["msg"]).removeprefix("Value error, ")) if err["type"] == "value_error" else None
    if named and named.split(".")[:len(loc)] == loc:
        return named.split(".")
    return loc


def validation_param(exc: Any) -> str:
    """The field a pydantic ValidationError is about (OpenAI's ``param``): the path its errors
    share, so the failed alternatives of a union (``prompt.str``, ``prompt.list[int].0``) name
    their field (``prompt``); "" when they share none (no field: the message's first is only one
    of several)."""
    return ".".join(commonprefix([_error_path(e) for e in exc.errors()]))
