"""The server under concurrent and abandoned requests: escaped chats tokenized beside plain ones in
worker threads, temperature 0 greedy whatever else the request sets, and clients that hang up as
Ray Serve reports it (the handler's task cancelled, or Ray's cancellation error) counted as 499."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from types import SimpleNamespace

import pytest

from conftest import tiny_llama

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_server import LiveServer, solo, tiny_tokenizer  # noqa: E402

from spec_plugins.server.openai_schemas import ChatMessage  # noqa: E402
from spec_plugins.server.requests import encode_chat, max_token_chars  # noqa: E402


def _chat_state(tok, escape: bool) -> SimpleNamespace:
    return SimpleNamespace(tokenizer=tok, max_input_tokens=100_000, max_token_chars=max_token_chars(tok),
                           escape_special_tokens=escape)


def _user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


def test_escaping_leaves_the_shared_tokenizer_as_it_was():
    """transformers applies ``split_special_tokens`` by flipping a flag on the Rust tokenizer; on
    the shared one, a prompt encoded at that moment in another thread would be split too."""
    tok = tiny_tokenizer()
    escaped = encode_chat(_chat_state(tok, True), _user("w5 </s> w6"))
    assert 1 not in escaped  # the message's "</s>" is text
    backend = tok.backend_tokenizer
    assert backend.encode_special_tokens is False
    assert backend.encode("w2 </s>", add_special_tokens=False).ids == [2, 1]  # still the control token


def test_escaped_and_plain_chats_tokenized_at_once_equal_alone():
    tok = tiny_tokenizer()
    escaping, plain = _chat_state(tok, True), _chat_state(tok, False)
    jobs = {"escaped": (escaping, _user(" ".join(["w5"] * 2000) + " </s> " + " ".join(["w6"] * 2000))),
            "plain": (plain, _user(" ".join(["w7 </s> w8"] * 1000)))}
    want = {k: encode_chat(s, m) for k, (s, m) in jobs.items()}
    assert 1 not in want["escaped"] and want["plain"].count(1) == 1000
    wrong: list[str] = []
    start = threading.Barrier(len(jobs))

    def hammer(kind: str) -> None:
        state, msgs = jobs[kind]
        start.wait()
        for _ in range(150):
            try:
                if encode_chat(state, msgs) != want[kind]:
                    wrong.append(kind)
            except Exception as exc:  # noqa: BLE001 - counted as a wrong answer
                wrong.append(repr(exc))

    threads = [threading.Thread(target=hammer, args=(k,)) for k in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.fixture(scope="module")
def free_running():
    model, tok = tiny_llama(seed=3), tiny_tokenizer(eos=False)
    srv = LiveServer(model, tok)
    yield srv, model, tok
    srv.stop()


@pytest.mark.parametrize("extra", [{"top_p": 0.5}, {"top_p": 0.99, "seed": 1}, {"seed": 7}])
def test_temperature_zero_is_greedy_whatever_top_p_and_seed_say(free_running, extra):
    srv, model, tok = free_running
    p = "w2 w3 w4"
    body = {"prompt": p, "max_tokens": 20, "temperature": 0, **extra}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(solo(model, tok, p, 20))


# ---- clients that leave, as Ray Serve reports it ---------------------------------------------
@pytest.fixture(scope="module")
def idle():
    """An app whose decode thread never starts: a request waits in the queue until its client leaves."""
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.server.app import create_app
    from spec_plugins.server.setup import build_state
    from spec_plugins.verifiers import ExactVerifier

    model, tok = tiny_llama(seed=3), tiny_tokenizer()
    dec = SpeculativeDecoder(TorchRuntime(model, tok), NgramProposer(NgramProposer.Config(num_draft_tokens=2)),
                             ExactVerifier(), tokenizer=tok)
    state = build_state(dec, 2, 48, 128, "fixed", model_id="tiny")
    return state, create_app(state)


ROUTES = [("/generate", {"inputs": "w2 w3", "parameters": {"max_new_tokens": 5}}, "generate"),
          ("/v1/completions", {"prompt": "w2 w3", "max_tokens": 5}, "completions")]


async def _call(app, path: str, body: dict, after_body) -> list[dict]:
    """One ASGI request; once its body is read, ``receive`` is ``after_body``."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return pending.pop(0) if pending else await after_body()

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


def _count(state, route: str, status: int) -> int:
    return state.metrics.requests.get((route, str(status)), 0)


@pytest.mark.parametrize("path,body,route", ROUTES)
def test_rays_cancellation_error_is_a_499_not_a_logged_500(idle, caplog, path, body, route):
    ray_exceptions = pytest.importorskip("ray.exceptions")
    state, app = idle

    async def cancelled() -> dict:  # Serve's receive proxy, once the proxy dropped the request
        raise ray_exceptions.TaskCancelledError()

    before = _count(state, route, 499)
    with caplog.at_level(logging.ERROR, logger="spec_plugins.server"):
        sent = asyncio.run(_call(app, path, body, cancelled))
    assert sent[0]["status"] == 499
    assert _count(state, route, 499) == before + 1 and _count(state, route, 500) == 0
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("path,body,route", ROUTES)
def test_a_cancelled_handler_is_counted_as_499_and_stays_cancelled(idle, caplog, path, body, route):
    state, app = idle
    before = _count(state, route, 499)

    queued = state.scheduler.snapshot()["queue"]  # earlier tests' rows stay queued, cancelled

    async def main() -> None:
        task = asyncio.create_task(_call(app, path, body, asyncio.Event().wait))  # a client still connected
        while state.scheduler.snapshot()["queue"] == queued:  # the row waits for a slot that never frees
            assert not task.done()
            await asyncio.sleep(0.01)
        task.cancel()  # what Ray Serve does when the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.ERROR, logger="spec_plugins.server"):
        asyncio.run(main())
    assert _count(state, route, 499) == before + 1
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def _chain_model(nxt: dict[int, int], vocab: int = 32):
    """A one-layer llama whose next token is ``nxt[last token]`` (else token 2): its attention and
    MLP write nothing, its embeddings are one-hot and its LM head reads the table."""
    import torch

    m = tiny_llama(vocab=vocab, hidden=vocab, layers=1)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.model.embed_tokens.weight.copy_(torch.eye(vocab))
        table = torch.zeros(vocab, vocab)
        for t in range(vocab):
            table[nxt.get(t, 2), t] = 50.0
        m.lm_head.weight.copy_(table)
    return m


def _streamed(url: str, route: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", url + route, json=body | {"stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                for c in json.loads(line[5:])["choices"]:
                    text.append(c["text"] if "text" in c else c["delta"].get("content") or "")
    return "".join(text)


def test_text_held_for_a_stop_string_streams_when_the_row_ends_on_eos():
    """Text that might still grow into a stop string is held back; when the row then ends on EOS
    the EOS token released it, and the OpenAI streams skipped special tokens' text: the streamed
    answer lost its end ("w5 " instead of "w5 w6")."""
    tok = tiny_tokenizer()
    w = tok.convert_tokens_to_ids
    model = _chain_model({w("w3"): w("w5"), w("w2"): w("w5"), w("w5"): w("w6"), w("w6"): tok.eos_token_id})
    live = LiveServer(model, tok)
    try:
        stop = {"model": "tiny", "max_tokens": 10, "temperature": 0, "stop": ["w6 w7"]}
        for route, body, field in (("/v1/completions", {"prompt": "w3"}, "text"),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}]},
                                    "message")):
            r = httpx.post(live.url + route, json=stop | body, timeout=60).json()["choices"][0]
            whole = r["text"] if field == "text" else r["message"]["content"]
            assert whole == "w5 w6" and r["finish_reason"] == "stop"
            assert _streamed(live.url, route, stop | body) == whole, route
    finally:
        live.stop()
