"""Request intake under hostile input: strict JSON (huge numbers, duplicates, NaN, media types,
UTF-16), bodies under a size cap and a deadline, parsing and tokenizing off the event loop and
bounded by the token limit, sampling settings that cannot empty the distribution, and a row that
fails while generating answered with a request id the log also has."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from test_server import PROMPTS, LiveServer, model, solo, tok  # noqa: F401 (fixtures)

httpx = pytest.importorskip("httpx")

ROUTES = ["/generate", "/generate_stream", "/", "/v1/chat/completions", "/v1/completions"]
GOOD = {"/generate": {"inputs": "w2 w3", "parameters": {"max_new_tokens": 2}},
        "/generate_stream": {"inputs": "w2 w3", "parameters": {"max_new_tokens": 2}},
        "/": {"inputs": "w2 w3", "parameters": {"max_new_tokens": 2}},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "w2"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "w2 w3", "max_tokens": 2}}


@pytest.fixture(scope="module")
def live(model, tok):
    srv = LiveServer(model, tok, max_batch=4)
    srv.state.body_timeout = 1.5
    yield srv
    srv.stop()


def post(srv, route: str, body: bytes, ctype: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": ctype} if ctype else {}
    return httpx.post(srv.url + route, content=body, headers=headers, timeout=60)


def error_of(r: httpx.Response) -> tuple[str, str]:
    """(message, kind) of an error answer in its route's shape: OpenAI's on /v1 (kind: ``code``), else TGI's."""
    if r.request.url.path.startswith("/v1/"):
        return r.json()["error"]["message"], r.json()["error"]["code"]
    return r.json()["error"], r.json()["error_type"]


def with_raw_field(route: str, key: str, literal: str) -> bytes:
    """A good body for ``route`` with ``"key": <literal>`` spliced in as raw JSON text."""
    text = json.dumps(GOOD[route])
    return (text[:-1] + f', "{key}": {literal}}}').encode()


@pytest.mark.parametrize("route", ROUTES)
def test_an_integer_literal_longer_than_python_parses_is_a_422_naming_the_field(live, route):
    r = post(live, route, with_raw_field(route, "x", "1" * 4400))
    assert r.status_code == 422, r.text
    if route.startswith("/v1/"):
        assert r.json() == {"error": {"message": "`x`: a number with 4400 digits (at most 100)",
                                      "type": "invalid_request_error", "param": "x", "code": "validation"}}
    else:
        assert r.json() == {"error": "`x`: a number with 4400 digits (at most 100)", "error_type": "validation"}
    # ... nested too, by its path, and negative
    body = json.dumps({"inputs": "w2", "parameters": {"stop": ["a"]}}).replace('["a"]', "[-" + "7" * 5000 + "]")
    r = post(live, "/generate", body.encode())
    assert r.status_code == 422 and "`parameters.stop.0`: a number with 5000 digits" in r.json()["error"]


def test_json_is_strict_duplicates_nan_media_types_and_encodings(live):
    cases = [
        (b'{"inputs": "w2", "inputs": "w3"}', "application/json", 422, "duplicate key `inputs`"),
        (b'{"inputs": "w2", "parameters": {"top_k": 2, "top_k": 3}}', "application/json", 422, "duplicate key `top_k`"),
        (b'{"inputs": "w2", "parameters": {"temperature": NaN}}', "application/json", 422,
         "`parameters.temperature`: `NaN` is not JSON"),
        (b'{"inputs": "w2", "parameters": {"top_p": -Infinity}}', "application/json", 422, "`-Infinity` is not JSON"),
        (b'{"inputs": "w2"}', "text/plain", 415, "Content-Type `text/plain` is not supported"),
        (b'inputs=w2', "application/x-www-form-urlencoded", 415, "send the body as JSON"),
        (b'{"inputs": "w2"}', "application/json; charset=utf-16", 415, "must be UTF-8"),
        ('{"inputs": "w2"}'.encode("utf-16"), "application/json", 400, "it is not UTF-8"),
        ('{"inputs": "w2"}'.encode("utf-32"), None, 400, "it is not UTF-8"),
        (b'{"inputs": "w2", "\\ud800": 1}', "application/json", 422, "invalid Unicode"),
    ]
    for body, ctype, status, msg in cases:
        r = post(live, "/generate", body, ctype)
        assert r.status_code == status and msg in r.json()["error"], (body[:40], ctype, r.status_code, r.text)
    # no Content-Type header is JSON; so is a +json media type
    assert post(live, "/generate", json.dumps(GOOD["/generate"]).encode(), None).status_code == 200
    good = json.dumps(GOOD["/generate"]).encode()
    assert post(live, "/generate", good, "application/vnd.api+json").status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_a_compressed_body_is_a_415_naming_its_content_encoding(live, route):
    import gzip

    body = gzip.compress(json.dumps(GOOD[route]).encode())
    for coding in ("gzip", "br", "gzip, identity"):
        r = httpx.post(live.url + route, content=body, headers={"content-type": "application/json",
                                                                "content-encoding": coding}, timeout=60)
        assert r.status_code == 415, (coding, r.status_code, r.text)
        assert f"Content-Encoding `{coding}` is not supported" in error_of(r)[0]
    plain = json.dumps(GOOD[route]).encode()
    r = httpx.post(live.url + route, content=plain, headers={"content-type": "application/json",
                                                             "content-encoding": "identity"}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [1e-100, 5e-324])
def test_a_top_p_below_float32_keeps_the_top_token(live, model, tok, value):
    """A top_p that rounds to 0 in float32 leaves exactly the most likely token: the greedy output."""
    want = solo(model, tok, PROMPTS[1], 8)
    params = {"max_new_tokens": 8, "do_sample": True, "seed": 3, "top_p": value, "details": True}
    r = httpx.post(live.url + "/generate", json={"inputs": PROMPTS[1], "parameters": params}, timeout=60)
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == want
    with httpx.stream("POST", live.url + "/generate_stream", json={"inputs": PROMPTS[1], "parameters": params},
                      timeout=60) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == want and "error" not in events[-1]
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPTS[1]}],
                                                           "top_p": value, "max_tokens": 4, "seed": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_logprobs_are_the_targets_whatever_the_sampling_settings(live, model, tok):
    """Greedy, top_k 1 and temperature 1e-5 pick the same tokens; each reports the target's own
    log-probability of them (it used to be 0.0 under top_k 1)."""
    runs = []
    for extra in ({}, {"do_sample": True, "top_k": 1, "seed": 5}, {"do_sample": True, "temperature": 1e-5, "seed": 5},
                  {"do_sample": True, "top_p": 1e-30, "temperature": 0.5, "seed": 5}):
        r = httpx.post(live.url + "/generate", json={"inputs": PROMPTS[0], "parameters": {
            "max_new_tokens": 10, "details": True, **extra}}, timeout=60)
        runs.append(r.json()["details"]["tokens"])
    ids = [[t["id"] for t in run] for run in runs]
    assert all(i == ids[0] for i in ids) and ids[0] == solo(model, tok, PROMPTS[0], 10)
    for run in runs[1:]:
        assert [t["logprob"] for t in run] == pytest.approx([t["logprob"] for t in runs[0]], abs=1e-5)
    assert all(t["logprob"] < -0.5 for t in runs[1])  # the tiny model is unsure: far from log 1 = 0


def test_top_n_tokens_reports_the_most_likely_tokens(live, model, tok):
    r = httpx.post(live.url + "/generate", json={"inputs": PROMPTS[2], "parameters": {
        "max_new_tokens": 5, "details": True, "top_n_tokens": 3}}).json()["details"]
    for t, top in zip(r["tokens"], r["top_tokens"]):
        assert len(top) == 3 and top[0]["id"] == t["id"] and top[0]["logprob"] == pytest.approx(t["logprob"])
        assert [x["logprob"] for x in top] == sorted((x["logprob"] for x in top), reverse=True)
    r = httpx.post(live.url + "/generate", json={"inputs": "w2", "parameters": {"top_n_tokens": 6}})
    assert r.status_code == 422 and "`top_n_tokens` must be >= 0 and <= 5" in r.json()["error"]


def test_a_row_that_fails_while_generating_has_a_request_id_in_body_and_log(live, monkeypatch, caplog):
    from spec_plugins.sampling import LogitsPipeline

    real = LogitsPipeline.warp

    def broken(self, logits):  # only the marked request's rows: every token masked
        out = real(self, logits)
        return out.fill_(float("-inf")) if self.sampling.temperature == 0.777 else out

    monkeypatch.setattr(LogitsPipeline, "warp", broken)
    for route in ("/generate", "/v1/chat/completions"):
        body = ({"inputs": "w2 w3", "parameters": {"temperature": 0.777, "max_new_tokens": 4}} if route == "/generate"
                else {"messages": [{"role": "user", "content": "w2"}], "temperature": 0.777, "max_tokens": 4})
        r = httpx.post(live.url + route, json=body, timeout=60)
        message, kind = error_of(r)
        assert r.status_code == 500 and kind == "generation" and "not finite" in message, r.text
        rid = message.split("request id ")[1].split(")")[0]
        assert len(rid) == 12 and any(rid in rec.getMessage() for rec in caplog.records), rid
    assert httpx.post(live.url + "/generate", json=GOOD["/generate"]).status_code == 200


def _reference_shape(v) -> tuple[int, int]:
    """(commas + containers, depth) of ``json.dumps(v)``, from the value itself."""
    if isinstance(v, (list, dict)):
        kids = list(v.values()) if isinstance(v, dict) else v
        inner = [_reference_shape(k) for k in kids]
        return 1 + max(len(kids) - 1, 0) + sum(i for i, _ in inner), 1 + max((d for _, d in inner), default=0)
    return 0, 0


def test_shape_counts_values_and_depth_outside_strings():
    """The byte-level pre-check agrees with the parsed value on random JSON whose strings are
    full of quotes, backslash runs, brackets and commas."""
    import random

    from spec_plugins.server.body import shape

    rng = random.Random(7)
    alphabet = ['"', "\\", "\\\\", "[", "]", "{", "}", ",", ":", "a", " ", "é", "\\u00e9"]

    def value(depth: int):
        kind = rng.random()
        if depth > 5 or kind < 0.3:
            return rng.choice([1, -2.5, None, True, "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))])
        if kind < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))): value(depth + 1)
                for _ in range(rng.randint(0, 4))}

    for _ in range(500):
        v = {"inputs": value(0)}
        for text in (json.dumps(v), json.dumps(v, ensure_ascii=False)):
            assert shape(text.encode()) == _reference_shape(v), text


def test_a_body_of_more_values_than_any_request_needs_is_refused_before_parsing(live, monkeypatch):
    import types

    import spec_plugins.server.body as body_mod

    def no_parse(*a, **kw):
        raise AssertionError("parsed")

    cap = 4 * 48 + 1024  # max batch x max input tokens + 1024
    r = post(live, "/generate", b'{"inputs": "w2", "x": [' + b"1," * 5000 + b"1]}")
    assert r.status_code == 422 and r.json()["error"].startswith(f"the JSON body holds 5003 values; no request needs "
                                                                 f"more than {cap}"), r.text
    monkeypatch.setattr(body_mod, "json", types.SimpleNamespace(loads=no_parse))  # the server's parser only
    r = post(live, "/v1/completions", json.dumps({"prompt": ["w2"] * 100_000}).encode())
    assert r.status_code == 422 and "holds 100001 values" in error_of(r)[0], r.text
    monkeypatch.undo()
    # a prompt of token ids up to the input limit is within the cap, and answered
    r = post(live, "/v1/completions", json.dumps({"prompt": [5] * 40, "max_tokens": 2}).encode())
    assert r.status_code == 200, r.text


# ---- the event loop: size, deadline, and work in threads -----------------------------------------
def _raw(srv, head: bytes, timeout: float = 20.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
    s.sendall(head)
    return s


def _status(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, "connection closed without an answer"
        data += chunk
    return int(data.split(b" ")[1])


def test_a_body_sent_one_byte_at_a_time_is_cut_off(live):
    """Body timeout: a client dripping its body gets 408 after ``body_timeout`` (1.5 s here), and
    other clients are served meanwhile."""
    s = _raw(live, b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: 400\r\n\r\n")
    answered = []

    def drip() -> None:
        try:
            for b in b'{"inputs": "' + b"w2 " * 100:
                s.sendall(bytes([b]))
                time.sleep(0.05)
        except OSError:
            answered.append("closed")  # the server hung up on us, as it should

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    assert httpx.post(live.url + "/generate", json=GOOD["/generate"], timeout=30).status_code == 200
    assert _status(s) == 408
    s.close()


def test_a_declared_body_over_the_cap_is_refused_unread(live):
    s = _raw(live, b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: 1000000000\r\n\r\n{")
    assert _status(s) == 413
    s.close()


def test_parsing_and_tokenizing_run_off_the_event_loop_on_bounded_text(live, model, tok, monkeypatch):
    """A 3 MB prompt is refused on the count of its first characters (the tokenizer never sees
    more than a few thousand), and neither the parser nor the tokenizer runs on the loop's thread."""
    from spec_plugins.server.schemas import GenerateRequest

    seen: list[tuple[int, int]] = []  # (thread id, characters)
    tok_cls = type(live.state.tokenizer)
    real_call, real_validate = tok_cls.__call__, GenerateRequest.model_validate

    def call(self, text, *a, **kw):
        seen.append((threading.get_ident(), len(text)))
        return real_call(self, text, *a, **kw)

    def validate(data, *a, **kw):
        seen.append((threading.get_ident(), -1))
        return real_validate(data, *a, **kw)

    monkeypatch.setattr(tok_cls, "__call__", call)
    monkeypatch.setattr(GenerateRequest, "model_validate", validate)
    r = httpx.post(live.url + "/generate", json={"inputs": "w3 " * 1_000_000}, timeout=60)
    assert r.status_code == 422 and "`inputs` tokens must be <= 48" in r.json()["error"], r.text
    assert seen and max(n for _, n in seen) < 10_000
    assert live.thread.ident not in {t for t, _ in seen}  # uvicorn's event loop runs in live.thread
    # truncate keeps the last tokens of a long input, tokenizing only its tail
    seen.clear()
    r = httpx.post(live.url + "/generate", json={"inputs": "w9 " * 200_000 + "w2 w3 w4", "parameters": {
        "truncate": 5, "max_new_tokens": 2, "details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == solo(model, tok, "w9 w9 w2 w3 w4", 2)
    assert max(n for _, n in seen) < 10_000


def test_a_refused_body_is_freed_at_once_not_left_in_a_cycle(live):
    """A refused request's memory is returned when it is answered: no frame of the server's
    request handling (whose locals hold the body) is left in a reference cycle for the garbage
    collector (an error raised across the worker thread's future made one per request)."""
    import gc
    import types

    bodies = [json.dumps({"inputs": "w3 " * 1_000_000}).encode(), b'{"inputs": ' + b"[" * 3_000_000 + b"}",
              with_raw_field("/generate", "seed", "9" * 5000), b'{"inputs": "w2", "inputs": "w3"}']
    gc.collect()
    gc.disable()
    try:
        for body in bodies:
            assert 400 <= post(live, "/generate", body).status_code < 500
        time.sleep(0.2)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = sorted({o.f_code.co_name for o in gc.garbage if isinstance(o, types.FrameType)
                       and "spec_plugins" in o.f_code.co_filename})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [], left


# ---- rows: all of a request's choices queued at once, all cancelled when its client leaves --------
def test_a_full_queue_is_a_429_before_a_stream_starts(live, monkeypatch):
    # (queue room, route, body): no room for its one row; room for one of its two choices
    for room, route, body in ((0, "/generate_stream", GOOD["/generate_stream"]),
                              (1, "/v1/chat/completions", {**GOOD["/v1/chat/completions"], "n": 2, "stream": True})):
        monkeypatch.setattr(live.state.scheduler, "max_queue", room)
        r = httpx.post(live.url + route, json=body, timeout=30)
        assert r.status_code == 429 and error_of(r)[1] == "overloaded", (route, r.status_code, r.text[:200])
    monkeypatch.setattr(live.state.scheduler, "max_queue", 1024)
    assert httpx.post(live.url + "/generate", json=GOOD["/generate"]).status_code == 200


def test_choices_of_a_stream_leave_the_batch_when_the_client_hangs_up():
    from conftest import tiny_llama
    from test_server import tiny_tokenizer

    big = LiveServer(tiny_llama(seed=3, max_pos=4096), tiny_tokenizer(eos=False), max_total=4000, max_input=32,
                     policy="fixed")
    try:
        body = {"prompt": "w2 w3", "max_tokens": 3900, "n": 3, "stream": True, "temperature": 0}
        with httpx.Client(timeout=30) as c, c.stream("POST", big.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen: set[int] = set()
            for line in r.iter_lines():
                if line.startswith("data:") and '"index"' in line:
                    seen.add(json.loads(line[5:])["choices"][0]["index"])
                if len(seen) == 3:
                    break  # hang up with all three rows decoding
        deadline = time.time() + 20
        while big.metric("spec_batch_size") != 0 or big.metric("spec_requests_cancelled_total") < 1:
            assert time.time() < deadline, "the abandoned choices were not cancelled"
            time.sleep(0.05)
        # one request cancelled, however many choices it had
        assert big.metric("spec_requests_cancelled_total") == 1 and big.metric("spec_decoded_tokens_total") < 3 * 3900
    finally:
        big.stop()


def _samples(srv, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of metric ``name`` on /metrics, by its labels."""
    import re

    out = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        m = re.fullmatch(re.escape(name) + r"(?:\{(.*)\})? (\S+)", line)
        if m:
            out[tuple(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))] = float(m.group(2))
    return out


def test_metrics_count_each_request_once_under_its_route_and_status(monkeypatch):
    """Each request is counted once, under its own route and status, with its latency and time to
    first token under that route too (no `generate:tokens` series); a client that leaves is a 499,
    streaming or not, and the one count of a cancelled request, however many choices it had; a row
    that fails while generating is a 500, not a cancellation."""
    from conftest import tiny_llama
    from test_server import tiny_tokenizer

    from spec_plugins.sampling import LogitsPipeline

    real = LogitsPipeline.warp

    def broken(self, logits):  # only the marked request's rows: every token masked
        out = real(self, logits)
        return out.fill_(float("-inf")) if self.sampling.temperature == 0.777 else out

    monkeypatch.setattr(LogitsPipeline, "warp", broken)
    big = LiveServer(tiny_llama(seed=3, max_pos=4096), tiny_tokenizer(eos=False), max_total=4000, max_input=32,
                     policy="fixed")
    long = {"prompt": "w2 w3", "max_tokens": 3900, "n": 3, "temperature": 0}

    def hang_up_once_decoding(rows: int) -> None:
        deadline = time.time() + 20
        while big.metric("spec_batch_size") < rows:
            assert time.time() < deadline
            time.sleep(0.02)

    try:
        ok = httpx.post(big.url + "/generate", json={"inputs": "w2 w3", "parameters": {"max_new_tokens": 4}})
        failed = httpx.post(big.url + "/generate", json={"inputs": "w2 w3", "parameters": {
            "temperature": 0.777, "max_new_tokens": 4}})
        assert (ok.status_code, failed.status_code) == (200, 500)
        body = json.dumps(long).encode()  # a non-streamed n=3 request whose client leaves
        s = socket.create_connection(("127.0.0.1", big.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)
        hang_up_once_decoding(3)
        s.close()
        with httpx.Client(timeout=30) as c:  # a TGI stream and an n=3 OpenAI stream whose clients leave
            for route, req in (("/generate_stream", {"inputs": "w2 w3", "parameters": {"max_new_tokens": 3900}}),
                               ("/v1/completions", long | {"stream": True})):
                with c.stream("POST", big.url + route, json=req) as r:
                    assert r.status_code == 200
                    lines = r.iter_lines()
                    while not next(lines).startswith("data:"):
                        pass
        want = {(("route", "generate"), ("status", "200")): 1, (("route", "generate"), ("status", "500")): 1,
                (("route", "completions"), ("status", "499")): 1,
                (("route", "generate_stream"), ("status", "499")): 1,
                (("route", "completions_stream"), ("status", "499")): 1}
        deadline = time.time() + 20
        while _samples(big, "spec_requests_total") != want:
            assert time.time() < deadline, _samples(big, "spec_requests_total")
            time.sleep(0.05)
        assert big.metric("spec_requests_cancelled_total") == 3
        routes = {dict(k)["route"]: n for k, n in _samples(big, "spec_request_duration_seconds_count").items()}
        assert routes == {"generate": 2, "completions": 1, "generate_stream": 1, "completions_stream": 1}
        ttft = {dict(k)["route"] for k in _samples(big, "spec_time_to_first_token_seconds_count")}
        assert "generate" in ttft and ttft <= set(routes), ttft
    finally:
        big.stop()
