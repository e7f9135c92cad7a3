"""Errors on the OpenAI routes in OpenAI's shape, as the official ``openai`` client reads them:
``{"error": {"message", "type", "param", "code"}}`` (``schemas.error_body``), before a stream and
inside one, while TGI's routes keep TGI's ``{"error", "error_type"}`` byte for byte."""

from __future__ import annotations

import httpx
import pytest
import torch
from test_connections import _busy
from test_server import LiveServer, model, tiny_tokenizer  # noqa: F401 (fixtures)

from conftest import tiny_llama

openai = pytest.importorskip("openai")

from spec_plugins.server.connections import BUSY  # noqa: E402

MSGS = [{"role": "user", "content": "w4 w5 w4"}]
NOT_FINITE = "sampling failed: the processed logits are not finite"


@pytest.fixture(scope="module")
def live(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), policy="fixed")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def broken():
    """A server whose model's LM head is NaN: every sampled row fails while generating (a 500
    before a stream, the error event inside one), a real model and no patched code."""
    m = tiny_llama(seed=3)
    with torch.no_grad():
        m.lm_head.weight.fill_(float("nan"))
    srv = LiveServer(m, tiny_tokenizer(), policy="fixed")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def _raised(exc_type: type, call) -> Exception:
    with pytest.raises(exc_type) as e:
        call()
    return e.value


def _is(err: Exception, message: str, kind: str, param: str | None, openai_type: str) -> None:
    """``err`` as the client reads OpenAI's error body: ``message`` (or, with a trailing "...", its start)."""
    body = err.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    assert body["message"] == message or message.endswith("...") and body["message"].startswith(message[:-3]), body
    assert (err.type, err.code, err.param) == (openai_type, kind, param), body


# ---- before a stream: 4xx ------------------------------------------------------------------------
def test_validation_errors_name_their_field(client):
    chat = client.chat.completions.create
    e = _raised(openai.UnprocessableEntityError, lambda: chat(model="tiny", messages=MSGS, temperature=5))
    _is(e, "`temperature` must be between 0 and 2", "validation", "temperature", "invalid_request_error")
    # a union's failed alternatives (`messages.0.content.str`, `....list[ContentPart]`) name their field
    e = _raised(openai.UnprocessableEntityError, lambda: chat(model="tiny", messages=[{"role": "user", "content": 5}]))
    _is(e, "`messages.0.content.str`: ...", "validation", "messages.0.content", "invalid_request_error")
    e = _raised(openai.UnprocessableEntityError, lambda: chat(model="tiny", messages=MSGS, extra_body={"foo": 1}))
    _is(e, "unknown field `foo`", "validation", "foo", "invalid_request_error")
    # a model validator's loc is the model's (empty here): the field its message names
    e = _raised(openai.UnprocessableEntityError, lambda: chat(model="tiny", messages=MSGS, top_logprobs=2))
    _is(e, "`top_logprobs` needs `logprobs: true`", "validation", "top_logprobs", "invalid_request_error")
    # a check of the routes themselves (not pydantic's): the field as its message starts
    e = _raised(openai.UnprocessableEntityError, lambda: chat(model="tiny", messages=MSGS, n=5))
    _is(e, "`n` must be <= 4 (--max-batch: each choice is a batch row). Given: 5", "validation", "n",
        "invalid_request_error")
    e = _raised(openai.UnprocessableEntityError,
                lambda: client.completions.create(model="tiny", prompt=[[1, "a"]], max_tokens=2))
    _is(e, "`prompt.str`: ...", "validation", "prompt", "invalid_request_error")
    # errors in two fields share none: no param, not the first alternative's label (`prompt.str`)
    e = _raised(openai.UnprocessableEntityError,
                lambda: client.completions.create(model="tiny", prompt=5, extra_body={"echo": "x"}))
    assert e.param is None and e.body["message"].startswith("`prompt.str`"), e.body


def test_a_body_that_is_not_json_and_an_unnamed_problem_have_no_param(live):
    r = httpx.post(live.url + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"].startswith("Failed to parse the request body as JSON"), r.text
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "validation")
    r = httpx.post(live.url + "/v1/completions", content=b'{"prompt": "w2", "prompt": "w3"}')
    assert r.status_code == 422 and r.json()["error"] == {
        "message": "duplicate key `prompt` in the JSON body", "type": "invalid_request_error", "param": None,
        "code": "validation"}


def test_unknown_model_route_and_method(client):
    e = _raised(openai.NotFoundError, lambda: client.models.retrieve("gpt-4o"))
    _is(e, "model `gpt-4o` is not served here; this server serves `tiny`", "not_found", None, "invalid_request_error")
    e = _raised(openai.NotFoundError, lambda: client.get("/nope", cast_to=object))
    _is(e, "no route /v1/nope", "http", None, "invalid_request_error")
    e = _raised(openai.APIStatusError, lambda: client.get("/chat/completions", cast_to=object))
    assert e.status_code == 405
    _is(e, "GET is not allowed on /v1/chat/completions", "http", None, "invalid_request_error")


def test_fastapis_own_parameter_checks_answer_in_the_paths_shape(live, client):
    app = live.server.config.app  # a route with a typed path parameter, checked by FastAPI itself

    def probe(n: int) -> int:
        return n

    for path in ("/v1/probe/{n}", "/probe/{n}"):
        app.get(path)(probe)
    e = _raised(openai.UnprocessableEntityError, lambda: client.get("/probe/x", cast_to=object))
    _is(e, "`path.n`: Input should be a valid integer, unable to parse string as an integer", "validation", "path.n",
        "invalid_request_error")
    r = httpx.get(live.url + "/probe/x")
    assert r.status_code == 422 and r.json() == {
        "error": "`path.n`: Input should be a valid integer, unable to parse string as an integer",
        "error_type": "validation"}


def test_a_full_queue_is_a_429_and_an_internal_error_a_500(live, client, monkeypatch):
    monkeypatch.setattr(live.state.scheduler, "max_queue", 0)
    e = _raised(openai.RateLimitError, lambda: client.chat.completions.create(model="tiny", messages=MSGS, stream=True))
    _is(e, "...", "overloaded", None, "server_error")
    monkeypatch.undo()

    def fails(jobs):
        raise ValueError("secret internal state")

    monkeypatch.setattr(live.state.scheduler, "submit", fails)
    e = _raised(openai.InternalServerError, lambda: client.completions.create(model="tiny", prompt="w2", max_tokens=2))
    _is(e, "internal error (request id ...", "internal", None, "server_error")
    assert "secret" not in e.body["message"]


# ---- while generating: a 500 before a stream, the error event inside one ---------------------------
def test_a_row_that_fails_while_generating(broken):
    e = _raised(openai.InternalServerError, lambda: broken.chat.completions.create(
        model="tiny", messages=MSGS, temperature=0.5, max_tokens=4))
    _is(e, NOT_FINITE + "...", "generation", None, "server_error")
    streams = (lambda: broken.chat.completions.create(model="tiny", messages=MSGS, temperature=0.5, max_tokens=4,
                                                      stream=True),
               lambda: broken.completions.create(model="tiny", prompt="w2", temperature=0.5, max_tokens=4, stream=True))
    for start in streams:
        stream = start()  # a 200: the row failed after the response began
        e = _raised(openai.APIError, lambda: list(stream))
        assert e.message.startswith(NOT_FINITE) and "request id" in e.message, e.message
        _is(e, NOT_FINITE + "...", "generation", None, "server_error")


# ---- a connection past the cap -------------------------------------------------------------------
def test_past_the_connection_cap_a_503_in_each_routes_shape(model):  # noqa: F811
    from spec_plugins.server.connections import ConnectionLimits

    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=60.0, max_connections=1))
    srv.state.body_timeout = 60.0
    busy = _busy(srv, 1)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        e = _raised(openai.InternalServerError, lambda: client.chat.completions.create(model="tiny", messages=MSGS))
        assert e.status_code == 503 and e.response.headers["retry-after"] == "1"
        _is(e, BUSY, "overloaded", None, "server_error")
        r = httpx.post(srv.url + "/generate", json={"inputs": "w2"})  # TGI's bytes, as before
        assert r.status_code == 503 and r.content == b'{"error":"' + BUSY.encode() + b'","error_type":"overloaded"}'
    finally:
        for b in busy:
            b.close()
        srv.stop()


def test_tgi_routes_keep_tgis_shape(live):
    r = httpx.post(live.url + "/generate", json={"inputs": "w2", "parameters": {"temperature": -1}})
    assert r.status_code == 422 and r.content == b'{"error":"`temperature` must be strictly positive",' \
                                                 b'"error_type":"validation"}'
    r = httpx.get(live.url + "/nope")
    assert r.status_code == 404 and r.content == b'{"error":"no route /nope","error_type":"http"}'
