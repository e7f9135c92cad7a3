"""The HTTP side of a request's rows: submitted to the scheduler before the response starts (so a
full queue is a 429, not a 200 whose stream says so), followed as a stream of tokens, merged
when a request asks for several choices, and cancelled whenever the client stops listening.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from spec_plugins.server.body import offload, parse, parse_json, read_body
from spec_plugins.server.requests import Prepared
from spec_plugins.server.scheduler import Job, TooLarge
from spec_plugins.server.schemas import ApiError
from spec_plugins.text import StopFreeText

log = logging.getLogger("spec_plugins.server")
T = TypeVar("T")


@dataclass
class TokenOut:
    id: int
    text: str
    logprob: float
    special: bool
    top: Sequence[tuple[int, float]] = ()  # the most likely tokens here, (id, logprob), best first
    last: bool = False  # the request's final token (a Finished follows at once)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "logprob": self.logprob, "special": self.special}


@dataclass
class Finished:
    reason: str  # "length" | "eos_token" | "stop_sequence"
    text: str  # generated text (special tokens skipped; ``Prepared.hide_stop``: up to the stop string)
    tokens: list[TokenOut] = field(default_factory=list)
    tail: str = ""  # ``hide_stop``: text held back from the tokens' pieces, shown only now


@dataclass
class Tally:
    """One request's figures for /metrics, recorded once, under its route, when it ends: by
    ``timed`` for an answer, by its ``JobStream`` for a stream (whose status is known only then)."""

    t0: float = field(default_factory=time.perf_counter)
    tokens: int = 0  # tokens returned to the client
    first_token: float | None = None  # seconds from arrival until its first token reached the handler
    status: int = 499  # a stream's: its client left, until the stream is seen to end otherwise
    route: str | None = None  # a stream's route, once its body said `"stream": true` (``read_streamed``)

    def arrived(self) -> None:
        """A token reached the handler (``follow``); the first one's time is the request's TTFT."""
        if self.first_token is None:
            self.first_token = time.perf_counter() - self.t0

    def record(self, state: Any, route: str, status: int) -> None:
        """Counted under ``self.route`` where the body asked for a stream (also when refused before
        the stream started), else under the handler's ``route``."""
        state.metrics.request_done(self.route or route, status, time.perf_counter() - self.t0, self.tokens,
                                   self.first_token)


async def read_streamed(state: Any, request: Request, model: type[T], tally: Tally, stream_route: str) -> T:
    """``read_request`` for a route that streams on ``"stream": true``: ``tally`` is marked as the
    stream's (``stream_route``) as soon as the body says so, so a stream refused by the validation
    of the rest of its body, or later (422, 429, 503 at intake), is counted as a stream."""
    body = await read_body(request, state.max_body_bytes, state.body_timeout)
    return await offload(state.cpu_limiter, _parse_streamed, model, body, state.max_json_items, tally, stream_route)


def _parse_streamed(model: type[T], body: bytes, max_items: int, tally: Tally, stream_route: str) -> T:
    """``parse``, marking ``tally``; a refused body is read again for its flag alone (only a refused
    one: an accepted one's request has it)."""
    try:
        req = parse(model, body, max_items)
    except ApiError:
        if _asks_stream(body, max_items):
            tally.route = stream_route
        raise
    if getattr(req, "stream", False):
        tally.route = stream_route
    return req


def _asks_stream(body: bytes, max_items: int) -> bool:
    """Whether a refused body is a JSON object with `"stream": true` (the models are strict: only
    JSON's true is one); a body that is not a JSON object has no flag to read."""
    try:
        return parse_json(body, max_items).get("stream") is True
    except ApiError:
        return False


def submit(state: Any, prep: Prepared) -> Job:
    """Queue one row; 429 when the queue is full, 503 while shutting down."""
    return submit_all(state, [prep])[0]


def submit_all(state: Any, preps: Sequence[Prepared]) -> list[Job]:
    """Queue every row of a request at once, or none: 422 when it could never run here (more rows
    than the batch, or more than the runtime's shared cache holds alone), 429 when the queue has
    no room for all, 503 while shutting down."""
    loop = asyncio.get_running_loop()
    jobs = [Job(p.row, loop) for p in preps]
    try:
        state.scheduler.submit(jobs)
    except OverflowError as exc:
        raise ApiError(429, str(exc), "overloaded") from None
    except TooLarge as exc:
        raise ApiError(422, str(exc)) from None
    except RuntimeError as exc:
        raise ApiError(503, str(exc), "overloaded") from None
    return jobs


def _generation_error(message: str) -> ApiError:
    """A row that failed while generating: its own request id, in the body and in the log."""
    if "request id" not in message:  # the scheduler names one where it logged the failure itself
        rid = uuid.uuid4().hex[:12]
        log.error("generation failed (request id %s): %s", rid, message)
        message = f"{message} (request id {rid})"
    return ApiError(500, message, "generation")


async def follow(state: Any, job: Job, prep: Prepared, request: Request,
                 tally: Tally) -> AsyncIterator[TokenOut | Finished]:
    """Yield a submitted row's tokens, then a Finished; cancels the row if abandoned. Each token's
    text is the row's text stream's (``spec_plugins/text.py``), fed in the batch, where a stop
    sequence already finished the row; the stream is flushed here once the row has finished (the
    batch no longer feeds it then)."""
    pieces = prep.text.pieces
    shown = StopFreeText(prep.text.stops) if prep.hide_stop else None
    toks: list[TokenOut] = []
    checked = time.perf_counter()
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                item = None
            # a client that hung up (also on a non-streaming route, where nothing else notices)
            # leaves the batch within a round: at most every 0.1 s a cheap receive() check
            if item is None or time.perf_counter() - checked > 0.1:
                checked = time.perf_counter()
                if await _disconnected(request):
                    return
            if item is None:
                continue
            if item[0] == "error":
                raise _generation_error(item[1])
            _, ids, lps, reason = item
            if reason is not None and not ids:
                yield _finished(state, prep, toks, reason, shown)
                return
            for i, (t, lp) in enumerate(zip(ids, lps)):
                last = reason is not None and i == len(ids) - 1
                piece = pieces[len(toks)]
                if last and shown is None:  # TGI's routes: the last token's text ends the row's text,
                    piece += prep.text.flush(past_stop=True)  # the bytes held past a stop string included
                if shown is not None:
                    piece = shown.push(piece, prep.text.stop_at, last)
                special, released = t in state.special_ids, ""
                if last and special and shown is not None:  # text held back for a stop string, let go by
                    released, piece = piece, ""  # the row's EOS: the row's tail, not the EOS token's text
                tok = TokenOut(t, piece, float(lp), special, getattr(lp, "top", ()))
                toks.append(tok)
                tally.arrived()
                if last:
                    tok.last = True
                    yield tok
                    yield _finished(state, prep, toks, reason, shown, released)
                    return
                yield tok
    finally:
        state.scheduler.cancel(job)  # no-op when finished; frees the slot otherwise


def ray_cancelled(exc: BaseException) -> bool:
    """Ray's error for a request whose client left (``TaskCancelledError`` or a subclass, such as
    Serve's ``RequestCancelledError``): a replica's calls to the proxy for that request raise it.
    Matched by class name, so the single-machine server never imports ray."""
    return any(c.__name__ == "TaskCancelledError" and c.__module__.startswith("ray.") for c in type(exc).__mro__)


async def _disconnected(request: Request) -> bool:
    """Whether the client hung up; under Ray Serve asking can raise Ray's cancellation error,
    which says the same."""
    try:
        return await request.is_disconnected()
    except Exception as exc:
        if ray_cancelled(exc):
            return True
        raise


def _finished(state: Any, prep: Prepared, toks: list[TokenOut], reason: str,
              shown: StopFreeText | None, released: str = "") -> Finished:
    """The row's end. ``shown`` (OpenAI's routes): the ``tail`` is what is still held back
    (``released``: what a special last token let go of), the text stream's flushed end included (a
    character the row's tokens never completed, as U+FFFD), so the streamed text equals the
    non-streamed one even when the last token is special."""
    tail = released + shown.push(prep.text.flush(), prep.text.stop_at, True) if shown is not None else ""
    return Finished(_reason(reason), _final_text(state, prep, toks), toks, tail)


def _reason(reason: str) -> str:
    return "stop_sequence" if reason == "stop" else reason


def _final_text(state: Any, prep: Prepared, toks: Sequence[TokenOut]) -> str:
    """The row's generated text without special tokens. ``hide_stop`` (OpenAI's routes): its text
    stream's, ending before its stop string (flushed: the row is finished, so it no longer
    changes), the very text a stream of the row sends, so a streamed and a non-streamed answer
    agree (a fresh ``decode`` can differ: ``spec_plugins/text.py``). TGI's routes: ``decode``
    skipping special tokens, which the stream (spelling them) does not; their streams send this
    text too, as the last event's ``generated_text``."""
    if prep.hide_stop:
        return prep.text.visible
    return state.tokenizer.decode([x.id for x in toks], skip_special_tokens=True)


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(i, event)`` from several streams as they come (a request's choices); the first error
    ends all of them, and closing this closes every stream (their rows are cancelled)."""
    if len(streams) == 1:
        async for ev in streams[0]:
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for ev in stream:
                await queue.put((i, ev, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, None, exc))
        await queue.put((i, end, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, ev, exc = await queue.get()
            if exc is not None:
                raise exc
            if ev is end:
                left -= 1
                continue
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class JobStream(StreamingResponse):
    """A streaming response whose rows are cancelled, and whose request is counted (``tally``,
    under ``route``), however it ends, even when the client left before the first chunk was asked
    for (an unstarted generator never runs its ``finally``). ``content`` sets ``tally.status``
    where the stream ends with its last event or an error event; else its client left (499)."""

    def __init__(self, content: AsyncIterator[bytes], state: Any, jobs: Sequence[Job], tally: Tally,
                 route: str) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._state, self._jobs, self._tally, self._route = state, list(jobs), tally, route

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # its client left (ASGI 2.4 servers): the 499 it is counted as
            raise
        except Exception as exc:
            if ray_cancelled(exc):  # its client left (Ray Serve): a 499, and no one to tell
                return
            self._tally.status = 500  # the stream broke off (the error is the server's to log)
            raise
        finally:
            for j in self._jobs:
                self._state.scheduler.cancel(j)
            self._tally.record(self._state, self._route, self._tally.status)


def sse(data: Any) -> bytes:
    return f"data:{json.dumps(data)}\n\n".encode()


def timed(state: Any, route: str) -> Callable:
    """Count the request once in /metrics, with its latency, tokens and time to first token
    (``fn`` fills its ``Tally``), errors included; a stream is counted by its ``JobStream`` when
    it ends. Errors in the path's shape (``error_body``), an internal one with a request id whose
    details only the log has. A client that left is a 499 and no error: Ray Serve cancels the
    handler's task (the cancellation goes on) or raises its own cancellation error
    (``ray_cancelled``)."""

    def deco(fn: Callable) -> Callable:
        async def wrapper(request: Request) -> Response:
            tally = Tally()
            try:
                resp = await fn(request, tally)
            except asyncio.CancelledError:
                tally.record(state, route, 499)
                raise
            except Exception as exc:  # noqa: BLE001 - an internal one's details go to the log, never to the client
                # no local holds the error: its traceback holds this frame, whose locals hold the body
                resp = _answered(exc).response(request.scope)
                tally.record(state, route, resp.status_code)
                return resp
            if not isinstance(resp, JobStream):
                tally.record(state, route, resp.status_code)
            return resp

        wrapper.__name__ = fn.__name__  # not functools.wraps: FastAPI would read fn's (request, tally) signature
        return wrapper

    return deco


def _answered(exc: Exception) -> ApiError:
    """The error a handler's exception is answered with: an ApiError as it is, Ray's cancellation
    a 499, anything else a 500 with a request id, the details logged under it."""
    if isinstance(exc, ApiError):
        return exc
    if ray_cancelled(exc):
        return ApiError(499, "client disconnected", "cancelled")
    rid = uuid.uuid4().hex[:12]
    log.error("request failed (request id %s)", rid, exc_info=exc)
    return ApiError(500, f"internal error (request id {rid}); the server log has the details", "internal")
