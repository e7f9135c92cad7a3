"""Request bodies: read under a size cap and a deadline, parsed as strict JSON off the event loop.

Every route reads its body here, so no route can be held by a client: a declared length over the
cap is refused before a byte is read, a body that keeps coming past the cap or past the deadline
(one byte a second) is cut off, and parsing runs in a worker thread (``offload``) whose
concurrency ``ServerState.cpu_workers`` bounds. JSON is RFC 8259's: UTF-8 only, no NaN/Infinity,
no duplicate keys; numbers longer than any field needs and nesting deeper than TGI's bodies are
refused with the field's path, where ``json`` would raise or recurse.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, TypeVar

import anyio
import numpy as np
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from spec_plugins.config import DuplicateKey, unique_keys
from spec_plugins.server.schemas import ApiError, validation_message, validation_param

MAX_BODY_BYTES = 4 << 20  # a prompt of a 32k-token context is ~130 KB of text
MAX_JSON_DEPTH = 32  # TGI's bodies nest 4 deep
MAX_NUMBER_DIGITS = 100  # a seed has at most 19; Python's int() refuses more than 4,300 with a ValueError
DRAIN_BYTES = 64 << 20  # an oversized body is read and dropped up to this much more, then the connection closes
CLOSE = {"connection": "close"}  # after a body we did not read to its end, the connection cannot be reused

T = TypeVar("T")


def _returning_errors(fn: Callable[..., T], args: tuple) -> tuple[bool, Any]:
    """In the worker thread: an ApiError comes back as a value, never raised across the thread.
    A raised error's traceback keeps the frames that hold the request's megabytes, and the
    future that carries it to the event loop forms a reference cycle with it, so that memory
    would wait for the garbage collector's next full pass (measured: +180 MiB after 180 refused
    4 MiB bodies, all of it back after one ``gc.collect()``)."""
    try:
        return True, fn(*args)
    except ApiError as exc:
        return False, (exc.status, exc.message, exc.error_type, exc.headers, exc.param)


async def offload(limiter: anyio.CapacityLimiter, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, at most ``limiter``'s tokens at once: parsing and
    tokenizing a 4 MiB body takes long enough to stall every other client on the event loop."""
    ok, value = await anyio.to_thread.run_sync(_returning_errors, fn, args, limiter=limiter)
    if ok:
        return value
    raise ApiError(*value)


def check_media_type(value: str | None) -> None:
    """JSON (``application/json`` or ``application/*+json``) in UTF-8; no header means JSON."""
    if value is None:
        return
    kind, *params = (p.strip() for p in value.split(";"))
    kind = kind.lower()
    if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise ApiError(415, f"Content-Type `{value}` is not supported: send the body as JSON with "
                            "`Content-Type: application/json`")
    for p in params:
        key, _, val = p.partition("=")
        if key.strip().lower() == "charset" and val.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise ApiError(415, f"Content-Type `{value}`: JSON bodies must be UTF-8")


def check_content_encoding(value: str | None) -> None:
    """Bodies come as they are (``identity``); a compressed one is refused by name, not parsed."""
    if value is None:
        return
    codings = [c.strip().lower() for c in value.split(",") if c.strip()]
    other = [c for c in codings if c != "identity"]
    if other:
        raise ApiError(415, f"Content-Encoding `{value}` is not supported: send the body uncompressed (no "
                            "Content-Encoding, or `identity`)")


def check_transfer_encoding(value: str | None) -> None:
    """A body comes with a Content-Length or chunked: any other transfer coding (``gzip, chunked``)
    is refused by name (501, RFC 9112 6.1), not read as if it were absent."""
    if value is not None and [c.strip().lower() for c in value.split(",")] != ["chunked"]:
        raise ApiError(501, f"Transfer-Encoding `{value}` is not supported: send the body with a Content-Length, "
                            "or with `Transfer-Encoding: chunked` alone")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, timeout: float = 30.0) -> bytes:
    """The body, at most ``limit`` bytes, all of it within ``timeout`` seconds (413 / 408 else).

    An oversized body is still read to its end, up to ``DRAIN_BYTES``, and thrown away as it
    comes: a server that answers and closes while the client still sends resets the connection,
    and the client never sees the 413 (nginx's lingering close does the same)."""
    check_media_type(request.headers.get("content-type"))
    check_content_encoding(request.headers.get("content-encoding"))
    codings = request.headers.getlist("transfer-encoding")
    check_transfer_encoding(", ".join(codings) if codings else None)
    declared = request.headers.get("content-length")
    declared_n = int(declared) if declared is not None and declared.isdigit() else None
    if declared_n is not None and declared_n > limit + DRAIN_BYTES:
        raise ApiError(413, f"the request body has {declared_n} bytes; at most {limit} are accepted", headers=CLOSE)
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif chunks:
                    chunks.clear()  # over the cap: the rest is only counted
                if size > limit + DRAIN_BYTES:
                    break
    except TimeoutError:
        if size > limit:
            raise ApiError(413, f"the request body has more than {limit} bytes; at most {limit} are accepted",
                           headers=CLOSE) from None
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s ({size} bytes came)",
                       "timeout", headers=CLOSE) from None
    except ClientDisconnect:
        raise ApiError(499, "client disconnected while sending the body", "cancelled") from None
    if size > limit:
        more = "more than " if size > limit + DRAIN_BYTES else ""
        raise ApiError(413, f"the request body has {more}{size} bytes; at most {limit} are accepted",
                       headers=CLOSE if more else None)
    return b"".join(chunks)


class _Refused:
    """What the JSON parser leaves where a value is valid JSON but not a value a request may hold
    (the walk in ``_check`` reports it with its path)."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def shape(body: bytes) -> tuple[int, int]:
    """(items, depth) of a JSON text from its bytes outside strings: items = commas + opened
    arrays and objects (at least the values a parser would build), depth = the deepest bracket.
    Vectorised (numpy, mostly without the GIL): a 4 MiB body of millions of tiny values costs
    ~50 ms here, where parsing and validating it would first build all of them."""
    a = np.frombuffer(body, dtype=np.uint8)
    real = a == 0x22  # quotes, less those escaped by an odd run of backslashes before them
    if b"\\" in body:
        idx = np.arange(a.size, dtype=np.int32)  # bodies are capped far below 2 GiB
        plain = np.maximum.accumulate(np.where(a != 0x5C, idx, -1))  # last non-backslash at or before i
        real[1:] &= (idx[1:] - 1 - plain[:-1]) % 2 == 0
    outside = (np.cumsum(real, dtype=np.int32) & 1) == 0
    outside &= ~real
    opens = outside & ((a == 0x5B) | (a == 0x7B))
    step = opens.view(np.int8) - (outside & ((a == 0x5D) | (a == 0x7D))).view(np.int8)
    depth = int(np.cumsum(step, dtype=np.int32).max()) if a.size else 0
    return int(np.count_nonzero(outside & (a == 0x2C)) + np.count_nonzero(opens)), depth


def _check(data: Any) -> None:
    """Refused values and invalid Unicode (a lone surrogate, ``"\\ud800"``, is valid JSON but not
    text), each named by its path; iterative. Run only when the parse flagged one may be there."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        where = f"`{path}`: " if path else ""
        if isinstance(value, _Refused):
            raise ApiError(422, f"{where}{value.why}")
        if isinstance(value, str):
            _utf8(value, where)
        elif isinstance(value, dict):
            for k, v in value.items():
                _utf8(k, where)
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))


def _utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(422, f"{where}the request holds invalid Unicode: {exc.reason} at character {exc.start} of "
                            "a string") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way a lone surrogate gets into parsed JSON


def parse_json(body: bytes, max_items: int = 1 << 16) -> dict[str, Any]:
    """Body bytes -> a JSON object, or an ApiError saying what is wrong and where. Nesting and
    size in values are checked on the bytes first (``shape``, only when their raw counts could
    break a limit), so a body of millions of values is refused before any is built."""
    brackets = body.count(b"[") + body.count(b"{")
    if brackets > MAX_JSON_DEPTH or brackets + body.count(b",") > max_items:
        items, depth = shape(body)
        if depth > MAX_JSON_DEPTH:
            raise ApiError(422, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
        if items > max_items:
            raise ApiError(422, f"the JSON body holds {items} values; no request needs more than {max_items} "
                                "(every batch row's prompt as token ids, and 1024 more)")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"Failed to parse the request body as JSON: it is not UTF-8 (byte 0x{body[exc.start]:02x} "
                            f"at offset {exc.start}); JSON bodies must be UTF-8") from None
    refused: list[_Refused] = []

    def number(digits: str) -> int | _Refused:
        n = len(digits.lstrip("-"))
        if n > MAX_NUMBER_DIGITS:
            refused.append(_Refused(f"a number with {n} digits (at most {MAX_NUMBER_DIGITS})"))
            return refused[-1]
        return int(digits)

    def constant(name: str) -> _Refused:
        refused.append(_Refused(f"`{name}` is not JSON (NaN and Infinity are JavaScript, not JSON numbers)"))
        return refused[-1]

    try:
        data = json.loads(text, parse_int=number, parse_constant=constant, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise ApiError(422, f"duplicate key `{exc}` in the JSON body") from None
    except RecursionError:
        raise ApiError(422, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # json.JSONDecodeError and any other conversion failure
        raise ApiError(400, f"Failed to parse the request body as JSON: {exc}") from None
    if not isinstance(data, dict):
        kind = "a refused value" if isinstance(data, _Refused) else type(data).__name__
        raise ApiError(422, f"Failed to deserialize the JSON body: expected an object, got {kind}")
    if refused or _SURROGATE_ESCAPE.search(text):
        _check(data)
    return data


def parse(model: type[T], body: bytes, max_items: int = 1 << 16) -> T:
    """Body -> a validated request model (pydantic), every failure a 4xx."""
    data = parse_json(body, max_items)
    try:
        return model.model_validate(data)  # type: ignore[attr-defined]
    except ValidationError as exc:
        raise ApiError(422, validation_message(exc), param=validation_param(exc)) from None


async def read_request(state: Any, request: Request, model: type[T]) -> T:
    """The body read under ``state``'s cap and deadline, validated as ``model`` in a worker thread."""
    body = await read_body(request, state.max_body_bytes, state.body_timeout)
    return await offload(state.cpu_limiter, parse, model, body, state.max_json_items)
