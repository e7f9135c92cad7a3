"""HTTP routes of the text-generation-inference API over a continuously batched speculative decoder.

POST /generate, /generate_stream (SSE: one event per token, the last one with generated_text and
details), / (TGI's compat route: either, by ``stream``), /tokenize; the OpenAI routes
(``openai_routes``); GET /info, /health, /metrics. Bad requests get TGI's error body and codes
(OpenAI's body on /v1: ``schemas.error_body``).
Bodies are read under a size cap and a deadline, and parsed and tokenized in worker threads
(``body``), so the event loop only moves bytes and tokens: /health answers while clients send
4 MiB bodies.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, AsyncIterator

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from spec_plugins.loop import Batch
from spec_plugins.server.body import MAX_BODY_BYTES, offload, read_request
from spec_plugins.server.controls import compiled, tgi_controls
from spec_plugins.server.jobs import Finished, JobStream, Tally, TokenOut, follow, read_streamed, sse, submit, timed
from spec_plugins.server.metrics import Metrics, proposer_metrics
from spec_plugins.server.requests import TGI, Prepared, encode_text, max_token_chars, prepare, tenant_of, token_spans
from spec_plugins.server.scheduler import Scheduler
from spec_plugins.server.schemas import (MAX_BEST_OF, ApiError, GenerateRequest, TokenizeRequest, validation_message,
                                         validation_param)

if TYPE_CHECKING:
    from spec_plugins.server.connections import ConnectionGuard, ConnectionLimits

MAX_TOP_TOKENS = 20  # alternatives the batch reports per emitted token (OpenAI's top_logprobs limit)


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
    body_timeout: float = 30.0  # seconds a client has to send its whole body
    max_body_bytes: int = MAX_BODY_BYTES
    cpu_workers: int = 2  # threads parsing and tokenizing request bodies at once
    escape_special_tokens: bool = False  # chat message text spelling a special token stays text (requests.py)

    def __post_init__(self) -> None:
        """Refuse what would build a server that cannot answer: no body worker thread
        (``CapacityLimiter(0)``) leaves every request waiting forever behind a healthy /health."""
        if isinstance(self.cpu_workers, bool) or not isinstance(self.cpu_workers, int) or self.cpu_workers < 1:
            raise ValueError(f"cpu_workers must be an integer >= 1, got {self.cpu_workers!r}")
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(f"max_input_tokens ({self.max_input_tokens}) must be < max_total_tokens "
                             f"({self.max_total_tokens})")
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self.max_token_chars = max_token_chars(self.tokenizer)
        self.cpu_limiter = anyio.CapacityLimiter(self.cpu_workers)
        self.created = int(time.time())
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        self.scheduler.batch.top_logprobs = MAX_TOP_TOKENS

    @property
    def batch(self) -> Batch:
        return self.scheduler.batch

    @property
    def max_json_items(self) -> int:
        """JSON values a body may hold: every row's prompt as token ids, and 1024 more."""
        return self.scheduler.max_batch * self.max_input_tokens + 1024

    @property
    def vocab_size(self) -> int:
        """Token ids a client may send: the tokenizer's, within the model's logits."""
        n = len(self.tokenizer)
        model = getattr(self.batch.runtime, "vocab_size", None)
        return min(n, model) if model else n

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def policy_view(self) -> dict[str, Any]:
        snap = self.scheduler.snapshot()
        snap["max_draft_length"] = self.max_draft_length
        if self.policy is not None:
            snap.update({k: v for k, v in self.policy.last.items() if k == "expected_tokens"})
            sizes = sorted({1, 2, 4, 8, 16, self.scheduler.max_batch} & set(range(1, self.scheduler.max_batch + 1)))
            snap["draft_length_by_batch"] = {b: self.policy.preview(b) for b in sizes}
        return snap


# ---- the app ---------------------------------------------------------------------------------
def create_app(state: ServerState) -> FastAPI:
    from contextlib import asynccontextmanager

    from spec_plugins.server.openai_routes import add_openai_routes

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
        return exc.response(request.scope)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405 ... in the path's error shape (``error_body``), not FastAPI's ``{"detail": ...}``."""
        text = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return ApiError(exc.status_code, text.get(exc.status_code, str(exc.detail)), "http",
                        getattr(exc, "headers", None)).response(request.scope)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own checks of a route's parameters, a 422 in the path's error shape."""
        return ApiError(422, validation_message(exc), param=validation_param(exc)).response(request.scope)

    def top_tokens(tok: TokenOut, n: int) -> list[dict[str, Any]]:
        return [{"id": t, "text": state.token_text(t), "logprob": lp, "special": t in state.special_ids}
                for t, lp in tok.top[:n]]

    def details_of(fin: Finished, prep: Prepared) -> dict[str, Any]:
        n = prep.params.top_n_tokens or 0
        return {"finish_reason": fin.reason, "generated_tokens": len(fin.tokens), "seed": prep.seed, "prefill": [],
                "tokens": [t.to_json() for t in fin.tokens],
                "top_tokens": [top_tokens(t, n) for t in fin.tokens] if n else None, "best_of_sequences": None}

    async def prepared(request: Request, req: GenerateRequest) -> Prepared:
        ids = await offload(state.cpu_limiter, encode_text, state, req.inputs, req.parameters.truncate)
        controls = tgi_controls(req.parameters)
        grammar = await compiled(state, controls)
        return prepare(state, ids, req.parameters, state.scheduler.new_key(), tenant_of(request), controls=controls,
                       compiled=grammar)

    async def generate_body(request: Request, req: GenerateRequest, tally: Tally) -> dict[str, Any]:
        prep = await prepared(request, req)
        job = submit(state, prep)
        fin: Finished | None = None
        async for ev in follow(state, job, prep, request, tally):
            if isinstance(ev, Finished):
                fin = ev
        if fin is None:
            raise ApiError(499, "client disconnected", "cancelled")
        text = (req.inputs + fin.text) if req.parameters.return_full_text else fin.text
        out: dict[str, Any] = {"generated_text": text}
        if req.parameters.details:
            out["details"] = details_of(fin, prep)
        tally.tokens = len(fin.tokens)
        return out

    async def stream_tgi(request: Request, req: GenerateRequest, tally: Tally, route: str) -> Response:
        prep = await prepared(request, req)
        job = submit(state, prep)
        n_top = req.parameters.top_n_tokens or 0

        async def events() -> AsyncIterator[bytes]:
            n = 0
            held: dict[str, Any] | None = None  # the newest token's event, sent at once unless last
            try:
                async for ev in follow(state, job, prep, request, tally):
                    if isinstance(ev, TokenOut):
                        n += 1
                        tally.tokens = n
                        if held is not None:
                            yield sse(held)
                        held = {"index": n, "token": ev.to_json(), "top_tokens": top_tokens(ev, n_top) if n_top
                                else None, "generated_text": None, "details": None}
                        if not ev.last:
                            yield sse(held)
                            held = None
                    else:  # the row's end: the last token's event carries generated_text + details
                        tally.status = 200
                        if held is not None:
                            text = (req.inputs + ev.text) if req.parameters.return_full_text else ev.text
                            held["generated_text"] = text
                            held["details"] = {"finish_reason": ev.reason, "generated_tokens": len(ev.tokens),
                                               "seed": prep.seed}
                            yield sse(held)
            except ApiError as exc:
                tally.status = exc.status
                yield sse(exc.body(request.scope))

        return JobStream(events(), state, [job], tally, route)

    @app.post("/generate")
    @timed(state, "generate")
    async def generate(request: Request, tally: Tally) -> Response:
        req = await read_request(state, request, GenerateRequest)
        return JSONResponse(await generate_body(request, req, tally))

    @app.post("/generate_stream")
    @timed(state, "generate_stream")
    async def generate_stream(request: Request, tally: Tally) -> Response:
        req = await read_request(state, request, GenerateRequest)
        return await stream_tgi(request, req, tally, "generate_stream")

    @app.post("/")
    @timed(state, "compat")
    async def compat(request: Request, tally: Tally) -> Response:
        req = await read_streamed(state, request, GenerateRequest, tally, "compat_stream")
        if req.stream:
            return await stream_tgi(request, req, tally, "compat_stream")
        return JSONResponse([await generate_body(request, req, tally)])

    @app.post("/tokenize")
    @timed(state, "tokenize")
    async def tokenize(request: Request, tally: Tally) -> Response:
        """TGI's: the input's tokens with their offsets, as /generate would read it (limits, truncate)."""
        req = await read_request(state, request, TokenizeRequest)
        return JSONResponse(await offload(state.cpu_limiter, token_spans, state, req.inputs, req.parameters.truncate,
                                          TGI, req.add_special_tokens))

    add_openai_routes(app, state)

    @app.get("/info")
    async def info() -> JSONResponse:
        from spec_plugins import __version__

        return JSONResponse({
            "model_id": state.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
            "model_dtype": str(getattr(state.batch.runtime, "dtype", "")).replace("torch.", ""),
            "model_device_type": str(getattr(state.batch.runtime, "device", "cpu")),
            "max_concurrent_requests": state.scheduler.max_queue + state.scheduler.max_batch,
            "max_best_of": MAX_BEST_OF, "max_stop_sequences": 4,
            "max_input_tokens": state.max_input_tokens, "max_input_length": state.max_input_tokens,
            "max_total_tokens": state.max_total_tokens, "max_batch_size": state.scheduler.max_batch,
            "max_batch_total_tokens": state.max_total_tokens * state.scheduler.max_batch,
            "waiting_served_ratio": 0.0, "max_waiting_tokens": 0, "validation_workers": state.cpu_workers,
            "max_client_batch_size": state.scheduler.max_batch, "router": "spec-plugins", "version": __version__,
            "sha": None, "docker_label": None, **state.info_extra,
        })

    @app.get("/health")
    async def health(request: Request) -> Response:
        problem = state.scheduler.unhealthy
        if problem is None:
            return JSONResponse({})
        return ApiError(503, problem, "unhealthy").response(request.scope)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(state.batch.stats, state.policy_view(), proposer_metrics(state.batch.proposer))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


# ---- the HTTP server -------------------------------------------------------------------------
SHUTDOWN_GRACE = 2.0  # seconds uvicorn waits past --shutdown-timeout, for the last error events to go out


class DrainingServer(uvicorn.Server):
    """uvicorn's server, stopping the scheduler as its shutdown begins. uvicorn runs the lifespan's
    shutdown only after its own deadline has cancelled the handlers still running, which cuts their
    streams with no error event; here the scheduler gives in-flight requests ``shutdown_timeout``
    seconds, then ends the rest with an error event, and uvicorn's deadline, ``SHUTDOWN_GRACE``
    later (``http_server``), leaves the handlers the time to send it."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # a daemon thread: a second Ctrl-C (uvicorn's force exit) does not wait for the drain
        threading.Thread(target=self.state.scheduler.stop, args=(self.state.shutdown_timeout,),
                         name="spec-shutdown", daemon=True).start()
        await super().shutdown(sockets)


def http_server(state: ServerState, host: str, port: int, limits: ConnectionLimits,
                **kwargs: Any) -> tuple[DrainingServer, ConnectionGuard]:
    """``state``'s app under uvicorn with connection ``limits`` (``spec-plugins serve`` and the tests)."""
    from spec_plugins.server.connections import uvicorn_config

    deadline = math.ceil(state.shutdown_timeout + SHUTDOWN_GRACE)  # whole seconds, as uvicorn types it
    config, guard = uvicorn_config(create_app(state), host, port, limits, timeout_graceful_shutdown=deadline,
                                   **kwargs)
    return DrainingServer(config, state), guard
