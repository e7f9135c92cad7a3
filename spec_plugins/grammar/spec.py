"""What a request asks its output to match, compiled once into an llguidance grammar.

Why llguidance: it compiles JSON schema, regex and Lark grammars lazily (no ahead-of-time
automaton over the vocabulary, so a new schema costs milliseconds), computes a token mask in a few
microseconds, rolls back consumed tokens (a round walks its drafted tree and returns), and names
the tokens a grammar forces next (``compute_ff_tokens``), which we draft for free. It has no
dependencies beyond its own wheel, runs on any CPU, and is what llama.cpp and vLLM use for the
same job. xgrammar compiles per-tokenizer automata ahead of time and needs triton on Linux.

Every way a user names a constraint (OpenAI ``response_format``, TGI ``grammar``, the CLI's
``--json-schema``, the Python ``grammar=``) becomes one ``GrammarSpec``; ``compile`` checks it
against the limits and raises ``GrammarError`` (a clear 4xx on the routes) before any row starts.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import numpy as np

Kind = Literal["json_schema", "json_object", "regex", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark")


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid, unsupported, too large, or matching nothing."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one request's grammar may cost the server.

    ``max_chars``: the grammar's text (a schema serialised, a regex, a Lark grammar);
    ``max_compile_ms``: building the matcher (llguidance builds lazily, so this is the up-front
    part); ``max_grammar_size``: llguidance's symbol count over all productions."""

    max_chars: int = 64_000
    max_compile_ms: float = 2_000.0
    max_grammar_size: int = 200_000


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint on a row's output. ``value``: the schema (a dict, or JSON text), the regex
    or the Lark grammar; unused for ``json_object`` (any JSON object)."""

    kind: Kind
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar type {self.kind!r} is not supported; use one of {', '.join(KINDS)}")
        if self.kind != "json_object" and self.value in (None, ""):
            raise GrammarError(f"a {self.kind} grammar needs a value")

    @staticmethod
    def json_schema(schema: Any) -> "GrammarSpec":
        return GrammarSpec("json_schema", schema)

    @staticmethod
    def regex(pattern: str) -> "GrammarSpec":
        return GrammarSpec("regex", pattern)

    def text(self) -> str:
        """The llguidance grammar (JSON text) this spec compiles to."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            schema = self.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
            _check_schema(schema)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema)
            except (ValueError, TypeError) as exc:
                raise GrammarError(f"invalid JSON schema: {exc}") from None
        if not isinstance(self.value, str):
            raise GrammarError(f"a {self.kind} grammar must be a string, got {type(self.value).__name__}")
        if self.kind == "regex":
            _check_pattern(self.value, "the regex")
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        return llguidance.LLMatcher.grammar_from_lark(self.value)


INT_RANGE = (-(1 << 63), 1 << 64)  # llguidance reads a schema's integers as signed or unsigned 64-bit
ANNOTATIONS = ("default", "examples")  # keys llguidance does not read (as ``x-`` ones): infinity passes there


LITERALS = ("const", "enum")  # keys holding data, not schemas: a key named "pattern" there is no regex


def _check_schema(value: Any, path: str = "$", annotation: bool = False, literal: bool = False) -> None:
    """Refuse a schema number llguidance cannot hold, naming where it is: a bound such as
    ``1e400`` (JSON's infinity) reached it as null ("expected f64, got null"), and an integer past
    64 bits, anywhere, as "not JSON serializable", neither naming the number. Its patterns are
    checked as a regex grammar's are (``_check_pattern``), outside annotations and literal data."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value) and not annotation:
        raise GrammarError(f"invalid JSON schema: {path} is {value}: numbers in a schema must be finite")
    if isinstance(value, int) and not INT_RANGE[0] <= value < INT_RANGE[1]:
        raise GrammarError(f"invalid JSON schema: {path} is {value}, past 64 bits: integers in a schema must fit "
                           "a signed or unsigned 64-bit integer")
    if isinstance(value, dict):
        for k, v in value.items():
            key_annotation = annotation or k in ANNOTATIONS or str(k).startswith("x-")
            key_literal = literal or k in LITERALS
            if not (key_annotation or key_literal):
                if k == "pattern" and isinstance(v, str):
                    _check_pattern(v, f"invalid JSON schema: {path}.pattern")
                if k == "patternProperties" and isinstance(v, dict):
                    for pattern in v:
                        _check_pattern(pattern, f"invalid JSON schema: {path}.patternProperties key")
            _check_schema(v, f"{path}.{k}", key_annotation, key_literal)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_schema(v, f"{path}[{i}]", annotation, literal)


def _check_pattern(pattern: str, where: str) -> None:
    """Refuse a regex ending in an unpaired backslash (an escape of nothing): llguidance drops it
    and compiles the rest, so the row would run under another language than the one written."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        raise GrammarError(f"{where} {pattern!r} ends in a lone backslash (an escape of nothing); "
                           "write \\\\ for a literal backslash")


@dataclass(frozen=True)
class Compiled:
    """A checked grammar for one tokenizer: what each row's matcher is built from. Each row builds
    its own (copies of one matcher share its lexer, its limits' budget and a limit error once met:
    one row's heavy path would fail the others)."""

    spec: GrammarSpec
    grammar: str
    tokenizer: Any  # llguidance.LLTokenizer
    limits: Any  # llguidance.LLParserLimits
    compile_ms: float

    def matcher(self) -> Any:
        """A fresh matcher at the grammar's start, for a row."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(f"grammar rejected: {error_of(m)}")
        return m


def compile_grammar(spec: GrammarSpec, tokenizer: Any, limits: GrammarLimits = GrammarLimits()) -> Compiled:
    """``spec`` checked for ``tokenizer`` (an ``llguidance.LLTokenizer``, see
    ``grammar.tokenizer``): valid, within ``limits`` and llguidance's own complexity limits, and
    able to match at least one output. Raises ``GrammarError`` naming the problem."""
    import llguidance

    t0 = time.perf_counter()
    text = spec.text()
    if len(text) > limits.max_chars:
        raise GrammarError(f"the grammar has {len(text)} characters; the limit is {limits.max_chars}")
    ll_limits = llguidance.LLParserLimits(max_grammar_size=limits.max_grammar_size)
    message = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=ll_limits)
    if message and not message.startswith("WARNING"):
        raise GrammarError(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(message)}")
    origin = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=ll_limits)
    if origin.is_error():
        raise GrammarError(f"grammar rejected: {error_of(origin)}")
    probe = origin.deep_copy()  # masks are computed on copies (grammar.matcher.mask_of says why)
    mask = probe.compute_bitmask()
    step = None if probe.is_error() else _first_step(origin, mask, tokenizer.eos_tokens)
    ms = (time.perf_counter() - t0) * 1e3
    if ms > limits.max_compile_ms:
        raise GrammarError(f"the grammar took {ms:.0f} ms to compile; the limit is {limits.max_compile_ms:.0f} ms")
    for m in (probe, step):
        if m is not None and too_complex(m):
            raise GrammarError(f"{TOO_COMPLEX}, met on its first token ({_first_line(m.get_error())})")
    if probe.is_error() or not any(mask):
        raise GrammarError("the grammar cannot match any output: no token of this model's vocabulary can start it"
                           + (f" ({_first_line(probe.get_error())})" if probe.is_error() else ""))
    return Compiled(spec, text, tokenizer, ll_limits, ms)


def _first_step(origin: Any, mask: bytes, eos: Sequence[int]) -> Any:
    """A copy of ``origin`` that consumed one first token: the lowest id ``mask`` allows other than
    end of sequence (a probe, not every way in: another first token may still meet a limit later,
    which the row then names); None where the grammar allows only end of sequence there (it
    matches the empty output only). llguidance meets some of its lexer limits only here: the mask
    allows a token its lexer then cannot consume."""
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")
    ends = {int(e) for e in eos}
    token = next((int(t) for t in np.flatnonzero(bits) if int(t) not in ends), None)
    if token is None:
        return None
    step = origin.deep_copy()
    step.consume_token(token)
    return step


_CAUSES = {"NoExtensionBias": "no token of this model's vocabulary can continue the grammar here"}
TOO_COMPLEX = "the grammar is too complex for llguidance's limits"
# llguidance's complexity limits as its errors name them (its stop reason does not tell them apart:
# ``stop_reason()`` reads InternalError, and its error text's ``Stop:`` says ParserTooComplex for a
# plain parse error too)
_LIMIT_ERRORS = ("lexer error:", "too many items (limit", "fuel exhausted")


def too_complex(matcher: Any) -> bool:
    """Whether ``matcher`` stopped on one of llguidance's complexity limits (its lexer's or its
    parser's: a cost of the grammar, not a token the vocabulary lacks)."""
    line = _first_line(matcher.get_error()).lower() if matcher.is_error() else ""
    return any(m in line for m in _LIMIT_ERRORS)


def error_of(matcher: Any) -> str:
    """Why an llguidance matcher is in error, in one line (a terse stop reason explained)."""
    line = _first_line(matcher.get_error())
    if too_complex(matcher):
        return f"{TOO_COMPLEX} (llguidance: {line})"
    return f"{_CAUSES[line]} (llguidance: {line})" if line in _CAUSES else line


def _first_line(message: str) -> str:
    """llguidance's message without its source excerpt: the first line, and the line naming the
    error where the first only says where it is."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return message
    cause = next((ln for ln in lines[1:] if ln.startswith("error:")), None)
    head = lines[0].removesuffix(":").strip()
    return f"{head}: {cause.removeprefix('error:').strip()}" if cause else head


def from_response_format(response_format: Any) -> GrammarSpec | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
    "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
    Strict or not, the output is held to the schema: a constraint that may be broken is no help."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        hint = f" (OpenAI's shape: {json.dumps({'type': response_format})})" if isinstance(response_format, str) else ""
        raise GrammarError(f"`response_format` must be an object with a `type`, got {type(response_format).__name__}"
                           + hint)
    rf = dict(response_format)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        body = rf.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise GrammarError("`response_format.json_schema` needs an object with a `schema`")
        return GrammarSpec("json_schema", body["schema"])
    raise GrammarError(f"`response_format` type `{kind}` is not supported; use text, json_object or json_schema")


def from_tgi(grammar: Any) -> GrammarSpec | None:
    """TGI's ``grammar``: ``{"type": "json", "value": schema}`` or ``{"type": "regex", "value":
    pattern}`` (``json_schema``, TGI's newer spelling, takes ``value.schema``)."""
    if grammar is None:
        return None
    if not isinstance(grammar, dict):
        raise GrammarError("`grammar` must be an object with `type` and `value`")
    kind, value = grammar.get("type"), grammar.get("value")
    if set(grammar) - {"type", "value"}:
        raise GrammarError(f"`grammar` takes `type` and `value` only, got {sorted(grammar)}")
    if kind == "json":
        return GrammarSpec("json_schema", value)
    if kind == "regex":
        return GrammarSpec("regex", value)
    if kind == "json_schema" and isinstance(value, dict) and "schema" in value:
        return GrammarSpec("json_schema", value["schema"])
    raise GrammarError(f"`grammar` type `{kind}` is not supported; use json or regex")
