"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions (streaming or not) and
/v1/models, as the official ``openai`` client calls them.

``n`` choices (times the prompts of a text completion) are that many batch rows, submitted
together before the response starts; streamed chunks of different choices interleave as their
tokens come, each tagged with its ``index``. Logprobs are the target's raw log-probabilities of
the emitted tokens (``loop.batch._logprobs``), with the most likely alternatives where asked (the
legacy layout's ``top_logprobs`` always holds the emitted token too, as OpenAI's does);
special tokens (EOS) are neither text nor logprob entries; the legacy (text completion) layout
names a token that is not whole UTF-8 text by its bytes, ``bytes:\\xe3\\x81``, as OpenAI does.
A token's ``text_offset`` is where its own text starts (``TextStream.pieces``; clipped to the
text's end after a stop string), streamed or not. A SentencePiece decoder that strips the text's
leading space (``strips_start``) drops a token's own space when it is decoded alone, so there a
token is named by the text it adds where it stands: an emitted one by its piece, an alternative by
what it adds after the token before it; byte-level and ``<0xNN>`` pieces are their bytes anywhere.
``stream_options.include_usage`` adds ``"usage": null`` to every chunk and one last chunk with
the usage and no choices.
"""

from __future__ import annotations

import re
import time
import uuid
from functools import lru_cache
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from spec_plugins.server.body import offload
from spec_plugins.server.controls import compiled
from spec_plugins.server.jobs import (Finished, JobStream, Tally, TokenOut, follow, merged, read_streamed, sse,
                                      submit_all, timed)
from spec_plugins.server.openai_schemas import ChatRequest, CompletionRequest, OpenAIRequest
from spec_plugins.server.requests import Names, Prepared, check_token_ids, encode_chat, encode_text, prepare, tenant_of
from spec_plugins.server.schemas import ApiError
from spec_plugins.text import TextStream

FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


def byte_table(tokenizer: Any) -> dict[str, int] | None:
    """Byte-level BPE (GPT-2, SmolLM2, Llama 3) spells each byte as one character; this maps
    them back, so a token that ends inside a UTF-8 character reports its real bytes."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def strips_start(tokenizer: Any) -> bool:
    """Whether the decoder removes text a token owns at the start of a decode: ``Strip`` from the
    start (Llama 2, Mistral) or a ``Metaspace`` that prepends its space; a decoder that only puts
    spaces between tokens (none, WordPiece) keeps each token's own text whole."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    parts = (spec.get("decoders") or []) if spec and spec.get("type") == "Sequence" else [spec or {}]
    return any(d.get("type") == "Strip" and d.get("start", 0) > 0 or d.get("type") == "Metaspace" and
               d.get("prepend_scheme", "always" if d.get("add_prefix_space") else "never") != "never"
               for d in parts)


BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback piece of a SentencePiece vocabulary


def piece_starts(pieces: Sequence[str], base: int) -> Iterator[int]:
    """Where each token's own text starts, from ``base``: a row's ``TextStream.pieces`` (read as
    they come: the batch appends to the list) are its tokens' text before OpenAI's routes hold
    back a tail that may grow into a stop string, so a stop that never matches moves no offset."""
    pos, k = base, 0
    while True:
        yield pos
        pos += len(pieces[k])
        k += 1


def add_openai_routes(app: FastAPI, state: Any) -> None:
    """Register the /v1 routes on ``app`` over ``state`` (a ``ServerState``)."""
    table = byte_table(state.tokenizer)
    placed = table is None and strips_start(state.tokenizer)  # a token's text depends on where it stands

    @lru_cache(maxsize=1 << 16)
    def token_bytes(t: int) -> bytes:
        if table is not None and t not in state.special_ids:
            piece = state.tokenizer.convert_ids_to_tokens(t)
            if isinstance(piece, str) and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if table is None and t not in state.special_ids:  # SentencePiece's byte fallback: <0xE7> is byte e7
            piece = state.tokenizer.convert_ids_to_tokens(t)
            if isinstance(piece, str) and BYTE_PIECE.fullmatch(piece):
                return bytes([int(piece[3:5], 16)])
        return state.token_text(t).encode("utf-8")

    @lru_cache(maxsize=1 << 16)
    def anywhere(t: int) -> bool:
        """Whether ``t`` is the same text wherever it stands: always, unless the decoder strips the
        start (``placed``); there, a special token or a ``<0xNN>`` byte piece."""
        return not placed or t in state.special_ids or bool(
            BYTE_PIECE.fullmatch(str(state.tokenizer.convert_ids_to_tokens(t))))

    @lru_cache(maxsize=1 << 16)
    def after(prev: int | None, t: int) -> bytes:
        """What ``t`` adds to the text after ``prev`` (None: at the text's start, decoded alone)."""
        if prev is None:
            return state.token_text(t).encode("utf-8")
        both = state.tokenizer.decode([prev, t], skip_special_tokens=False)
        return both[len(state.token_text(prev)):].encode("utf-8")

    def bytes_at(t: int, k: int, text: TextStream) -> bytes:
        """``t`` as the ``k``-th token of the row whose text is ``text`` (the token emitted there or an
        alternative to it): ``token_bytes`` where that is the same anywhere (``anywhere``), else the
        text it adds there: the emitted token's piece, an alternative's text after the token before."""
        if anywhere(t):
            return token_bytes(t)
        if text.ids[k] == t:
            return text.pieces[k].encode("utf-8")
        prev = next((text.ids[j] for j in range(k - 1, -1, -1) if text.ids[j] not in state.special_ids), None)
        return after(prev, t)

    def token_label(b: bytes) -> str:
        """The legacy completions' name of a token of bytes ``b``: its text, or ``bytes:\\xe3\\x81``
        (every byte, as OpenAI writes it) for a token that is not whole UTF-8 text, such as part of a
        character: as U+FFFD such alternatives would share one ``top_logprobs`` key."""
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b)

    def top_by_label(x: TokenOut, top: int, k: int, text: TextStream) -> dict[str, float]:
        """The ``k``-th token ``x``'s ``top`` likeliest alternatives (best first) as {label: logprob},
        and always ``x`` itself, as OpenAI and vLLM answer (up to ``top`` + 1 entries; ``logprobs: 0``
        gives ``x`` alone). Two alternatives of one label (equal text, e.g. two special tokens) keep
        the likelier one's logprob; ``x``'s label holds ``x``'s own, as ``token_logprobs`` does."""
        out: dict[str, float] = {}
        for t, lp in x.top[:top]:
            out.setdefault(token_label(bytes_at(t, k, text)), lp)
        out[token_label(bytes_at(x.id, k, text))] = x.logprob
        return out

    def check_rows(rows: int, what: str) -> None:
        if rows > state.scheduler.max_batch:
            raise ApiError(422, f"{what} must be <= {state.scheduler.max_batch} (--max-batch: each choice is a batch "
                                f"row). Given: {rows}")

    def usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def run(request: Request, req: OpenAIRequest, preps: Sequence[Prepared], tally: Tally, route: str,
                  stream_body: Callable[[AsyncIterator[tuple[int, Any]]], AsyncIterator[bytes]],
                  reply: Callable[[list[Finished]], dict[str, Any]]) -> Response:
        """Submit every choice's row, then stream (``stream_body``, counted under ``route_stream``)
        or answer (``reply``)."""
        jobs = submit_all(state, preps)
        streams = [follow(state, j, p, request, tally) for j, p in zip(jobs, preps)]
        if req.stream:
            async def events() -> AsyncIterator[bytes]:
                ended = [0]  # choices that reached their end

                async def counting() -> AsyncIterator[tuple[int, Any]]:
                    async for i, ev in merged(streams):
                        tally.tokens += isinstance(ev, TokenOut)
                        ended[0] += isinstance(ev, Finished)
                        yield i, ev

                try:
                    async for chunk in stream_body(counting()):
                        yield chunk
                    if ended[0] == len(jobs):  # else the client left, and the rows stopped with it
                        tally.status = 200
                        yield b"data: [DONE]\n\n"
                except ApiError as exc:
                    tally.status = exc.status
                    yield sse(exc.body(request.scope))

            return JobStream(events(), state, jobs, tally, route + "_stream")
        fins: list[Finished | None] = [None] * len(jobs)
        async for i, ev in merged(streams):
            if isinstance(ev, Finished):
                fins[i] = ev
        if any(f is None for f in fins):
            raise ApiError(499, "client disconnected", "cancelled")
        done = [f for f in fins if f is not None]
        tally.tokens = sum(len(f.tokens) for f in done)
        return JSONResponse(reply(done))

    # ---- chat ----------------------------------------------------------------------------------
    def chat_logprobs(toks: Sequence[tuple[TokenOut, int]], top: int, text: TextStream) -> dict[str, Any]:
        """``toks``: each token with its index in the row whose text is ``text``."""
        def entry(t: int, lp: float, k: int) -> dict[str, Any]:
            b = bytes_at(t, k, text)
            return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

        return {"content": [{**entry(x.id, x.logprob, k), "top_logprobs": [entry(t, lp, k) for t, lp in x.top[:top]]}
                            for x, k in toks if not x.special], "refusal": None}

    @app.post("/v1/chat/completions")
    @timed(state, "chat_completions")
    async def chat(request: Request, tally: Tally) -> Response:
        req: ChatRequest = await read_streamed(state, request, ChatRequest, tally, "chat_completions_stream")
        check_rows(req.choices, "`n`")
        names = Names("messages", req.max_field)
        ids = await offload(state.cpu_limiter, encode_chat, state, req.messages, names)
        tenant = tenant_of(request)
        controls = req.controls()
        grammar = await compiled(state, controls)
        preps = [prepare(state, ids, req.parameters(req.max_new_tokens, i), state.scheduler.new_key(), tenant, names,
                         hide_stop=True, controls=controls, compiled=grammar) for i in range(req.choices)]
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), state.model_id
        top = req.top_logprobs or 0

        def chunk(i: int, delta: dict, reason: str | None, toks: Sequence[tuple[TokenOut, int]] = ()) -> dict:
            out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "system_fingerprint": "spec-plugins",
                   "choices": [{"index": i, "delta": delta, "finish_reason": reason,
                                "logprobs": chat_logprobs(toks, top, preps[i].text)
                                if req.logprobs and any(not x.special for x, _ in toks) else None}]}
            return out | ({"usage": None} if req.include_usage else {})

        async def stream_body(events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
            for i in range(req.choices):
                yield sse(chunk(i, {"role": "assistant", "content": ""}, None))
            waiting: dict[int, list[tuple[TokenOut, int]]] = {i: [] for i in range(req.choices)}  # no text yet
            seen = [0] * req.choices  # tokens of each choice so far
            completion = 0
            async for i, ev in events:
                if isinstance(ev, TokenOut):
                    waiting[i].append((ev, seen[i]))
                    seen[i] += 1
                    if ev.text and not ev.special:
                        yield sse(chunk(i, {"content": ev.text}, None, waiting[i]))
                        waiting[i] = []
                else:
                    completion += len(ev.tokens)
                    if ev.tail:
                        yield sse(chunk(i, {"content": ev.tail}, None))
                    yield sse(chunk(i, {}, FINISH[ev.reason], waiting[i]))
            if req.include_usage:
                yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": "spec-plugins", "choices": [],
                           "usage": usage(len(ids), completion)})

        def reply(fins: list[Finished]) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "system_fingerprint": "spec-plugins",
                    "choices": [{"index": i, "message": {"role": "assistant", "content": f.text, "refusal": None},
                                 "logprobs": chat_logprobs([(x, k) for k, x in enumerate(f.tokens)], top,
                                                           preps[i].text) if req.logprobs else None,
                                 "finish_reason": FINISH[f.reason]} for i, f in enumerate(fins)],
                    "usage": usage(len(ids), sum(len(f.tokens) for f in fins))}

        return await run(request, req, preps, tally, "chat_completions", stream_body, reply)

    # ---- text completions ----------------------------------------------------------------------
    def text_logprobs(toks: Sequence[tuple[TokenOut, int, int]], top: int, text: TextStream) -> dict[str, Any]:
        """OpenAI's legacy layout: parallel lists, the top alternatives and the token itself as
        {token: logprob} (``top_by_label``); ``toks`` holds each token with its index in the row
        whose text is ``text`` and its ``text_offset``."""
        shown = [(x, k, o) for x, k, o in toks if not x.special]
        return {"tokens": [token_label(bytes_at(x.id, k, text)) for x, k, _ in shown],
                "token_logprobs": [x.logprob for x, _, _ in shown],
                "top_logprobs": [top_by_label(x, top, k, text) for x, k, _ in shown],
                "text_offset": [o for _, _, o in shown]}

    def encode_prompts(prompts: Sequence[str | list[int]], names: Names) -> list[list[int]]:
        return [check_token_ids(state, p, "prompt") if isinstance(p, list) else encode_text(state, p, None, names)
                for p in prompts]

    @app.post("/v1/completions")
    @timed(state, "completions")
    async def completions(request: Request, tally: Tally) -> Response:
        req: CompletionRequest = await read_streamed(state, request, CompletionRequest, tally, "completions_stream")
        prompts = req.prompts()
        n = req.choices
        check_rows(len(prompts) * n, "`n`" if len(prompts) == 1 else f"`n` x {len(prompts)} prompts")
        names = Names("prompt", "max_tokens")
        ids = await offload(state.cpu_limiter, encode_prompts, prompts, names)
        tenant = tenant_of(request)
        controls = req.controls()
        grammar = await compiled(state, controls)
        preps = [prepare(state, p, req.parameters(req.max_tokens, j), state.scheduler.new_key(), tenant, names,
                         hide_stop=True, controls=controls, compiled=grammar) for p in ids for j in range(n)]
        echo = [(p if isinstance(p, str) else state.tokenizer.decode(p)) if req.echo else "" for p in prompts]
        cid, created, model = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), state.model_id
        top = req.logprobs or 0
        prompt_tokens = sum(len(p) for p in ids)

        def choice(i: int, text: str, reason: str | None, toks: Sequence[tuple[TokenOut, int, int]]) -> dict:
            return {"index": i, "text": text, "finish_reason": reason,
                    "logprobs": text_logprobs(toks, top, preps[i].text) if req.logprobs is not None else None}

        def body(choices: list[dict], **extra: Any) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "system_fingerprint": "spec-plugins", "choices": choices, **extra}

        async def stream_body(events: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[bytes]:
            more = {"usage": None} if req.include_usage else {}
            sent = [len(echo[i // n]) for i in range(len(preps))]  # characters of each choice's text sent
            for i in range(len(preps)):
                if echo[i // n]:
                    yield sse(body([choice(i, echo[i // n], None, ())], **more))
            starts = [piece_starts(p.text.pieces, s) for p, s in zip(preps, sent)]
            waiting: dict[int, list[tuple[TokenOut, int, int]]] = {i: [] for i in range(len(preps))}
            seen = [0] * len(preps)  # tokens of each choice so far
            completion = 0
            async for i, ev in events:
                if isinstance(ev, TokenOut):
                    waiting[i].append((ev, seen[i], next(starts[i])))
                    seen[i] += 1
                    if ev.text and not ev.special:
                        sent[i] += len(ev.text)
                        # a token goes with the chunk that sends the start of its text (so its offset
                        # is within the text, whatever a stop string still holds back)
                        k = sum(o < sent[i] for _, _, o in waiting[i])
                        yield sse(body([choice(i, ev.text, None, waiting[i][:k])], **more))
                        waiting[i] = waiting[i][k:]
                else:
                    completion += len(ev.tokens)
                    if ev.tail:
                        sent[i] += len(ev.tail)
                        yield sse(body([choice(i, ev.tail, None, ())], **more))
                    # the tokens left start in the tail or past the text's end (after a stop): clipped
                    ends = [(x, k, min(o, sent[i])) for x, k, o in waiting[i]]
                    yield sse(body([choice(i, "", FINISH[ev.reason], ends)], **more))
            if req.include_usage:
                yield sse(body([], usage=usage(prompt_tokens, completion)))

        def offsets(i: int, f: Finished) -> list[tuple[TokenOut, int, int]]:
            """Each token with its index and where its own text starts, clipped to the text's end
            (after a stop)."""
            base = len(echo[i // n])
            end = base + len(f.text)
            return [(x, k, min(o, end)) for k, (x, o) in enumerate(zip(f.tokens, piece_starts(preps[i].text.pieces,
                                                                                                base)))]

        def reply(fins: list[Finished]) -> dict[str, Any]:
            return body([choice(i, echo[i // n] + f.text, FINISH[f.reason], offsets(i, f))
                         for i, f in enumerate(fins)],
                        usage=usage(prompt_tokens, sum(len(f.tokens) for f in fins)))

        return await run(request, req, preps, tally, "completions", stream_body, reply)

    # ---- models --------------------------------------------------------------------------------
    def card() -> dict[str, Any]:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "spec-plugins"}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != state.model_id:
            raise ApiError(404, f"model `{model_id}` is not served here; this server serves `{state.model_id}`",
                           "not_found")
        return JSONResponse(card())
