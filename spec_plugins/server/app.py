"""HTTP routes of the text-generation-inference API over a continuously batched speculative decoder.

POST /generate, /generate_stream (SSE: one event per token, the last one with generated_text and
details), / (TGI's compat route: either, by ``stream``), /v1/chat/completions (OpenAI-style,
streaming or not); GET /info, /health, /metrics. Bad requests get TGI's error body and codes.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import ValidationError

from spec_plugins.loop import Batch
from spec_plugins.server.metrics import Metrics, proposer_metrics
from spec_plugins.server.requests import Prepared, _parse, encode_chat, encode_text, prepare, tenant_of
from spec_plugins.server.scheduler import Job, Scheduler
from spec_plugins.server.schemas import (
    ApiError,
    ChatRequest,
    GenerateRequest,
    validation_message,
)


log = logging.getLogger("spec_plugins.server")


@dataclass
class ServerState:
    """Everything the routes need; built by ``build_state`` (CLI) or directly in tests."""

    scheduler: Scheduler
    tokenizer: Any
    model_id: str
    max_input_tokens: int
    max_total_tokens: int
    metrics: Metrics = field(default_factory=Metrics)
    info_extra: dict[str, Any] = field(default_factory=dict)
    policy: Any = None  # the scheduler's draft-length policy (AutoDraftLength or FixedLength), None: no proposer
    max_draft_length: int = 0
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(f"max_input_tokens ({self.max_input_tokens}) must be < max_total_tokens "
                             f"({self.max_total_tokens})")
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", []) or [])

    @property
    def batch(self) -> Batch:
        return self.scheduler.batch

    def policy_view(self) -> dict[str, Any]:
        snap = self.scheduler.snapshot()
        snap["max_draft_length"] = self.max_draft_length
        if self.policy is not None:
            snap.update({k: v for k, v in self.policy.last.items() if k == "expected_tokens"})
            sizes = sorted({1, 2, 4, 8, 16, self.scheduler.max_batch} & set(range(1, self.scheduler.max_batch + 1)))
            snap["draft_length_by_batch"] = {b: self.policy.preview(b) for b in sizes}
        return snap


# ---- one request, as a stream of tokens --------------------------------------------------------
@dataclass
class TokenOut:
    id: int
    text: str
    logprob: float
    special: bool
    last: bool = False  # the request's final token (a Finished follows at once)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "logprob": self.logprob, "special": self.special}


@dataclass
class Finished:
    reason: str  # "length" | "eos_token" | "stop_sequence"
    text: str  # generated text (special tokens skipped)
    tokens: list[TokenOut]


class Detokenizer:
    """Incremental detokenization (TGI's prefix/read offsets): a token's text appears once the
    bytes it completes decode to whole characters."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, t: int) -> str:
        self.ids.append(t)
        prev = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=False)
        new = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=False)
        if len(new) > len(prev) and not new.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(prev):]
        return ""


async def run_job(state: ServerState, prep: Prepared, request: Request) -> AsyncIterator[TokenOut | Finished]:
    """Submit to the scheduler, yield tokens, then a Finished; cancels the row if abandoned."""
    import asyncio

    job = Job(prep.row, asyncio.get_running_loop())
    try:
        state.scheduler.submit(job)
    except OverflowError as exc:
        raise ApiError(429, str(exc), "overloaded") from None
    except RuntimeError as exc:
        raise ApiError(503, str(exc), "overloaded") from None
    det = Detokenizer(state.tokenizer)
    toks: list[TokenOut] = []
    out_text = ""
    stops = prep.params.stop
    done = False
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
                if await request.is_disconnected():
                    return
            if item is None:
                continue
            if item[0] == "error":
                raise ApiError(500, item[1], "generation")
            _, ids, lps, reason = item
            if reason is not None and not ids:
                done = True
                yield Finished(reason, state.tokenizer.decode([x.id for x in toks], skip_special_tokens=True), toks)
                return
            for i, (t, lp) in enumerate(zip(ids, lps)):
                text = det.add(t)
                out_text += text
                tok = TokenOut(t, text, lp, t in state.special_ids)
                toks.append(tok)
                hit = bool(stops) and any(s in out_text[-(len(s) + len(text)):] for s in stops)
                if hit or (reason is not None and i == len(ids) - 1):
                    tok.last = True
                    yield tok
                    gen = state.tokenizer.decode([x.id for x in toks], skip_special_tokens=True)
                    done = True
                    yield Finished("stop_sequence" if hit else reason, gen, toks)
                    return
                yield tok
    finally:
        if not done:
            state.metrics.request_cancelled()
        state.scheduler.cancel(job)  # no-op when finished; frees the slot otherwise


# ---- the app ---------------------------------------------------------------------------------
def create_app(state: ServerState) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.scheduler.alive:
            state.scheduler.start()
        yield
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, state.scheduler.stop, state.shutdown_timeout)

    app = FastAPI(title="spec-plugins TGI-compatible server", lifespan=lifespan)
    app.state.spec = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405 ... in TGI's error shape, not FastAPI's ``{"detail": ...}``."""
        text = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse({"error": text.get(exc.status_code, str(exc.detail)), "error_type": "http"},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def timed(route: str) -> Callable:
        """Count the request and its latency in /metrics, errors included."""

        def deco(fn: Callable) -> Callable:
            async def wrapper(request: Request) -> Response:
                t0 = time.perf_counter()
                try:
                    resp = await fn(request, t0)
                except ApiError as exc:
                    state.metrics.request_done(route, exc.status)
                    return JSONResponse(exc.body(), status_code=exc.status)
                except Exception:  # noqa: BLE001 - the details go to the log, never to the client
                    rid = uuid.uuid4().hex[:12]
                    log.exception("request failed (request id %s)", rid)
                    state.metrics.request_done(route, 500)
                    return JSONResponse({"error": f"internal error (request id {rid}); the server log has the details",
                                         "error_type": "internal"}, status_code=500)
                if not isinstance(resp, StreamingResponse):
                    state.metrics.request_done(route, resp.status_code, time.perf_counter() - t0)
                return resp

            wrapper.__name__ = fn.__name__
            return wrapper

        return deco

    def details_of(fin: Finished, prep: Prepared) -> dict[str, Any]:
        return {"finish_reason": fin.reason, "generated_tokens": len(fin.tokens), "seed": prep.seed, "prefill": [],
                "tokens": [t.to_json() for t in fin.tokens], "top_tokens": None, "best_of_sequences": None}

    async def generate_body(request: Request, req: GenerateRequest, t0: float, route: str) -> dict[str, Any]:
        prep = prepare(state, encode_text(state, req.inputs), req.parameters, state.scheduler.new_key(),
                       tenant_of(request))
        fin: Finished | None = None
        first = None
        async for ev in run_job(state, prep, request):
            if first is None:
                first = time.perf_counter() - t0
            if isinstance(ev, Finished):
                fin = ev
        if fin is None:
            raise ApiError(499, "client disconnected", "cancelled")
        text = (req.inputs + fin.text) if req.parameters.return_full_text else fin.text
        out: dict[str, Any] = {"generated_text": text}
        if req.parameters.details:
            out["details"] = details_of(fin, prep)
        state.metrics.request_done(route + ":tokens", "ok", None, len(fin.tokens), first)
        return out

    def sse(data: Any) -> bytes:
        return f"data:{json.dumps(data)}\n\n".encode()

    def stream_tgi(request: Request, req: GenerateRequest, t0: float, route: str) -> StreamingResponse:
        prep = prepare(state, encode_text(state, req.inputs), req.parameters, state.scheduler.new_key(),
                       tenant_of(request))

        async def events() -> AsyncIterator[bytes]:
            status, n, first = "200", 0, None
            held: dict[str, Any] | None = None  # the newest token's event, sent at once unless last
            try:
                async for ev in run_job(state, prep, request):
                    if isinstance(ev, TokenOut):
                        n += 1
                        first = first if first is not None else time.perf_counter() - t0
                        if held is not None:
                            yield sse(held)
                        held = {"index": n, "token": ev.to_json(), "top_tokens": None, "generated_text": None,
                                "details": None}
                        if not ev.last:
                            yield sse(held)
                            held = None
                    elif held is not None:  # the last token's event carries generated_text + details
                        held["generated_text"] = (req.inputs + ev.text) if req.parameters.return_full_text else ev.text
                        held["details"] = {"finish_reason": ev.reason, "generated_tokens": len(ev.tokens),
                                           "seed": prep.seed}
                        yield sse(held)
            except ApiError as exc:
                status = str(exc.status)
                yield sse(exc.body())
            finally:
                state.metrics.request_done(route, status, time.perf_counter() - t0, n, first)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/generate")
    @timed("generate")
    async def generate(request: Request, t0: float) -> Response:
        req = _parse(GenerateRequest, await request.body())
        return JSONResponse(await generate_body(request, req, t0, "generate"))

    @app.post("/generate_stream")
    @timed("generate_stream")
    async def generate_stream(request: Request, t0: float) -> Response:
        req = _parse(GenerateRequest, await request.body())
        return stream_tgi(request, req, t0, "generate_stream")

    @app.post("/")
    @timed("compat")
    async def compat(request: Request, t0: float) -> Response:
        req = _parse(GenerateRequest, await request.body())
        if req.stream:
            return stream_tgi(request, req, t0, "compat_stream")
        return JSONResponse([await generate_body(request, req, t0, "compat")])

    @app.post("/v1/chat/completions")
    @timed("chat_completions")
    async def chat(request: Request, t0: float) -> Response:
        req = _parse(ChatRequest, await request.body())
        try:
            params = req.to_parameters()
        except ValidationError as exc:
            raise ApiError(422, validation_message(exc)) from None
        prep = prepare(state, encode_chat(state, req), params, state.scheduler.new_key(), tenant_of(request))
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        model = state.model_id
        finish = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}

        def chunk(delta: dict, reason: str | None) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": "spec-plugins",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            async def events() -> AsyncIterator[bytes]:
                status, n = "200", 0
                try:
                    async for ev in run_job(state, prep, request):
                        if isinstance(ev, TokenOut):
                            n += 1
                            if ev.text and not ev.special:
                                yield sse(chunk({"role": "assistant", "content": ev.text}, None))
                        else:
                            yield sse(chunk({"role": "assistant", "content": ""}, finish[ev.reason]))
                    yield b"data: [DONE]\n\n"
                except ApiError as exc:
                    status = str(exc.status)
                    yield sse(exc.body())
                finally:
                    state.metrics.request_done("chat_completions_stream", status, time.perf_counter() - t0, n)

            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        fin: Finished | None = None
        async for ev in run_job(state, prep, request):
            if isinstance(ev, Finished):
                fin = ev
        if fin is None:
            raise ApiError(499, "client disconnected", "cancelled")
        state.metrics.request_done("chat_completions:tokens", "ok", None, len(fin.tokens))
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": "spec-plugins",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": fin.text}, "logprobs": None,
                         "finish_reason": finish[fin.reason]}],
            "usage": {"prompt_tokens": len(prep.ids), "completion_tokens": len(fin.tokens),
                      "total_tokens": len(prep.ids) + len(fin.tokens)},
        })

    @app.get("/info")
    async def info() -> JSONResponse:
        from spec_plugins import __version__

        return JSONResponse({
            "model_id": state.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
            "model_dtype": str(getattr(state.batch.runtime, "dtype", "")).replace("torch.", ""),
            "model_device_type": str(getattr(state.batch.runtime, "device", "cpu")),
            "max_concurrent_requests": state.scheduler.max_queue + state.scheduler.max_batch,
            "max_best_of": 1, "max_stop_sequences": 4,
            "max_input_tokens": state.max_input_tokens, "max_input_length": state.max_input_tokens,
            "max_total_tokens": state.max_total_tokens, "max_batch_size": state.scheduler.max_batch,
            "max_batch_total_tokens": state.max_total_tokens * state.scheduler.max_batch,
            "waiting_served_ratio": 0.0, "max_waiting_tokens": 0, "validation_workers": 1,
            "max_client_batch_size": 1, "router": "spec-plugins", "version": __version__, "sha": None,
            "docker_label": None, **state.info_extra,
        })

    @app.get("/health")
    async def health() -> Response:
        if state.scheduler.alive:
            return JSONResponse({})
        return JSONResponse({"error": "decode thread is not running", "error_type": "unhealthy"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(state.batch.stats, state.policy_view(), proposer_metrics(state.batch.proposer))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
