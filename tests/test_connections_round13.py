"""Connections and load reports, round 13: an upgrade offer (h2c, websocket) is ignored and its
body read as its body, never as the next request; a body of many tiny chunks is refused before
it holds the event loop; a transfer coding other than chunked is a 501 naming it; the load test's
and the hostile-body test's percentiles cover successful requests only, failures counted apart."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import queue
import re
import socket
import threading
import time

import pytest

httptools = pytest.importorskip("httptools")
httpx = pytest.importorskip("httpx")

from test_connections import _connect, _read_all  # noqa: E402
from test_server import LiveServer, model, tiny_tokenizer  # noqa: E402,F401 (fixtures)

from spec_plugins.server import body_end, hostile, loadtest  # noqa: E402
from spec_plugins.server.body_end import BodyEnd  # noqa: E402
from support import free_port, serve_in_thread  # noqa: E402

MAX_CHUNKS = getattr(body_end, "MAX_CHUNKS", 4096)  # (a run against the code before them: the values documented)
MIN_CHUNK_MEAN = getattr(body_end, "MIN_CHUNK_MEAN", 256)

GENERATE = json.dumps({"inputs": "w2 w3", "parameters": {"max_new_tokens": 3}}).encode()
HEAD = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
H2C = b"connection: upgrade, http2-settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
WEBSOCKET = b"connection: upgrade\r\nupgrade: websocket\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
HEALTH_CLOSE = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
CHUNKED = b"transfer-encoding: chunked\r\n"


@pytest.fixture(scope="module")
def srv(model):  # noqa: F811
    s = LiveServer(model, tiny_tokenizer())
    yield s
    s.stop()


def _statuses(reply: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)]


def _chunks(body: bytes, size: int) -> bytes:
    """``body`` in chunks of ``size`` bytes, and the last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


def _exchange(srv: LiveServer, *writes: bytes) -> bytes:
    """Send ``writes`` on one connection, 0.3 s apart (one read each), then a /health that closes
    it; everything the server sent."""
    s = _connect(srv)
    for i, w in enumerate(writes):
        if i:
            time.sleep(0.3)
        s.sendall(w)
    time.sleep(0.3)
    s.sendall(HEALTH_CLOSE)
    return _read_all(s)


def _plain_answer(srv: LiveServer) -> str:
    """The reference: the same body without an upgrade offer."""
    r = httpx.post(srv.url + "/generate", content=GENERATE, headers={"content-type": "application/json"})
    assert r.status_code == 200
    return r.json()["generated_text"]


@pytest.mark.parametrize("offer", [H2C, WEBSOCKET], ids=["h2c", "websocket"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
@pytest.mark.parametrize("writes", ["one write", "split"])
def test_an_upgrade_offer_is_ignored_and_its_body_read_as_its_body(srv, offer, framing, writes):
    """``curl --http2 -d ...`` offers h2c with its body: the request is served as plain HTTP on its
    body (the same answer as without the offer), whether the body comes with the headers or in a
    later read, and the connection goes on (the /health behind it is answered)."""
    if framing == "length":
        request = HEAD + offer + b"content-length: %d\r\n\r\n" % len(GENERATE) + GENERATE
    else:
        request = HEAD + offer + CHUNKED + b"\r\n" + _chunks(GENERATE, 9)
    cut = len(request) - 20
    reply = _exchange(srv, *([request] if writes == "one write" else [request[:cut], request[cut:]]))
    assert _statuses(reply) == [200, 200], reply
    first = reply.split(b"HTTP/1.1 ")[1]
    assert json.loads(first.partition(b"\r\n\r\n")[2])["generated_text"] == _plain_answer(srv)


def test_a_request_hidden_in_an_upgrade_offers_body_is_not_answered(srv):
    """A body that ends with a request, sent in a later read: it is the body (a 400 for not being
    JSON), never a request of its own (before, /info answered: a proxy that saw one request got
    two answers)."""
    hidden = b"GET /info HTTP/1.1\r\nhost: x\r\n\r\n"
    head = HEAD + H2C + b"content-length: %d\r\n\r\n" % (len(GENERATE) + len(hidden))
    reply = _exchange(srv, head + GENERATE, hidden)
    assert _statuses(reply) == [400, 200], reply
    assert b"Failed to parse the request body as JSON" in reply and b"model_id" not in reply


def test_a_request_pipelined_behind_an_upgrade_offers_body_is_answered(srv):
    """Bytes that follow the whole body are the next request, as on any connection."""
    request = HEAD + H2C + b"content-length: %d\r\n\r\n" % len(GENERATE) + GENERATE
    s = _connect(srv)
    s.sendall(request + HEALTH_CLOSE)
    assert _statuses(_read_all(s)) == [200, 200]


def test_connect_is_refused_and_the_connection_closed(srv):
    """CONNECT asks for a tunnel: what follows its head is no request; a 501, then the close."""
    s = _connect(srv)
    s.sendall(b"CONNECT /health HTTP/1.1\r\nhost: x\r\n\r\n" + HEALTH_CLOSE)
    reply = _read_all(s)
    assert _statuses(reply) == [501] and b"CONNECT" in reply, reply


def test_a_body_of_many_tiny_chunks_is_refused_before_it_ends(srv):
    """One-byte chunks cost Python work per chunk on the event loop: past ``MAX_CHUNKS`` chunks
    averaging under ``MIN_CHUNK_MEAN`` bytes, a 400 naming why and a close, without waiting for
    the body's end (never sent here: the body timeout would answer 408 much later)."""
    s = _connect(srv)
    s.sendall(HEAD + CHUNKED + b"\r\n" + b"1\r\n \r\n" * (MAX_CHUNKS + 100))
    reply = _read_all(s, timeout=20)
    assert _statuses(reply) == [400], reply
    assert b"chunks" in reply and b"connection: close" in reply
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_body_of_as_many_small_chunks_as_allowed_is_served(srv):
    """``MAX_CHUNKS`` one-byte chunks (a client streaming tiny pieces): served, exactly as sent."""
    body = GENERATE + b" " * (MAX_CHUNKS - len(GENERATE))
    s = _connect(srv)
    s.sendall(HEAD + CHUNKED + b"connection: close\r\n\r\n" + _chunks(body, 1))
    reply = _read_all(s, timeout=30)
    assert _statuses(reply) == [200], reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["generated_text"] == _plain_answer(srv)


def test_body_end_refuses_tiny_chunks_past_the_cap_and_not_large_ones():
    tiny = BodyEnd([(b"transfer-encoding", b"chunked")])
    data = b"1\r\nx\r\n" * (MAX_CHUNKS + 1)
    n = tiny.cut(data)
    assert tiny.refused and not tiny.lost and n == len(data) - 3  # cut at the size line that passed the cap
    large = BodyEnd([(b"transfer-encoding", b"chunked")])
    piece = b"%x\r\n%s\r\n" % (MIN_CHUNK_MEAN, b"x" * MIN_CHUNK_MEAN)
    assert large.cut(piece * (MAX_CHUNKS + 50) + b"0\r\n\r\n") == len(piece) * (MAX_CHUNKS + 50) + 5
    assert large.refused is None and large.phase == "done"


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"x-custom , chunked"])
@pytest.mark.parametrize("content", ["gzip", "plain"])
def test_a_transfer_coding_other_than_chunked_is_a_501_naming_it(srv, coding, content):
    """Gzip data under ``gzip, chunked`` used to be parsed as JSON (a 400 saying it is not UTF-8),
    and plain JSON under it was served: either way the coding is now refused by name."""
    body = gzip.compress(GENERATE) if content == "gzip" else GENERATE
    s = _connect(srv)
    s.sendall(HEAD + b"transfer-encoding: " + coding + b"\r\nconnection: close\r\n\r\n" + _chunks(body, 16))
    reply = _read_all(s)
    assert _statuses(reply) == [501], reply
    assert b"Transfer-Encoding `" + coding + b"`" in reply


def test_load_test_percentiles_cover_successful_requests_only(srv):
    """Half the prompts are over the input limit (a fast 422): the latency percentiles are those of
    the successful requests (numpy's ``nearest`` method as the reference), failures are counted
    apart, by status."""
    np = pytest.importorskip("numpy")
    res = asyncio.run(loadtest._level(srv.url, ["w2 w3", "w2 " * 60], 10, 2, 3))
    ok = [r["latency"] for r in res["results"] if r["ok"]]
    assert res["completed"] == len(ok) == 5 and res["failed"] == 5 and res["failed_statuses"] == {422: 5}
    assert res["p50_s"] == np.percentile(ok, 50, method="nearest")
    assert res["p95_s"] == np.percentile(ok, 95, method="nearest")
    assert min(ok) <= res["p50_s"] <= max(ok)


def test_load_test_percentiles_are_none_when_nothing_succeeded(srv):
    res = asyncio.run(loadtest._level(srv.url, ["w2 " * 60], 3, 1, 3))
    assert res["completed"] == 0 and res["failed"] == 3 and res["p50_s"] is None and res["p95_s"] is None


def _poll(url: str, seconds: float) -> list[float]:
    """hostile's poller in a thread (it runs in a process of its own there) for ``seconds``."""
    go, stop, out = threading.Event(), threading.Event(), queue.Queue()
    t = threading.Thread(target=hostile._poll, args=(url, go, stop, out), daemon=True)
    t.start()
    go.set()
    time.sleep(seconds)
    stop.set()
    t.join(timeout=60)
    return out.get(timeout=5)


def test_the_hostile_poller_survives_transport_errors_and_counts_them():
    """A /health the poller cannot reach is a failed sample, not the poller's end (which lost the
    whole report); the summary counts failures and keeps JSON's numbers finite."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    lat = _poll(f"http://127.0.0.1:{port}", 0.5)
    assert lat and all(x == math.inf for x in lat)
    summary = hostile.health_summary(lat)
    assert summary["samples"] == len(lat) and summary["failed"] == len(lat) and summary["p50_ms"] is None
    json.dumps(summary, allow_nan=False)


def test_the_hostile_summary_keeps_failures_out_of_its_percentiles(srv):
    lat = _poll(srv.url, 0.5) + [math.inf, math.inf]
    ok = [x for x in lat if x != math.inf]
    summary = hostile.health_summary(lat)
    assert summary["failed"] == 2 and summary["samples"] == len(lat)
    assert summary["max_ms"] == round(max(ok) * 1e3, 1) and summary["p50_ms"] <= summary["max_ms"]
    json.dumps(summary, allow_nan=False)


# ---- round 13, second pass: refusals behind a response, trailers, answered bodies, transport errors ----


class _Toy:
    """uvicorn with the guarded protocol around a small app that records each handler it starts:
    ``/slow`` answers after a pause, ``/noread`` at once without reading its body, any other path
    after its whole body (its length and its scope's header count)."""

    def __init__(self, limits=None) -> None:
        import uvicorn

        from spec_plugins.server.connections import ConnectionLimits, uvicorn_config

        self.started: list[str] = []
        self.port = free_port()
        config, self.guard = uvicorn_config(self.app, "127.0.0.1", self.port, limits or ConnectionLimits(),
                                            log_level="warning", lifespan="off", interface="asgi3")
        self.server = uvicorn.Server(config)
        self.thread = serve_in_thread(self.server)

    async def app(self, scope, receive, send) -> None:
        self.started.append(scope["path"])
        if scope["path"] == "/slow":
            await asyncio.sleep(0.5)
        n = 0
        while scope["path"] != "/noread":
            m = await receive()
            if m["type"] == "http.disconnect":
                return
            n += len(m.get("body", b""))
            if not m.get("more_body"):
                break
        out = json.dumps({"len": n, "headers": len(scope["headers"])}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def toy():
    t = _Toy()
    yield t
    t.stop()


TINY_FLOOD = b"POST /flood HTTP/1.1\r\nhost: x\r\n" + CHUNKED + b"\r\n" + b"1\r\nx\r\n" * (MAX_CHUNKS + 100)


def _one_answer(s: socket.socket) -> bytes:
    """One response (``content-length`` framed) off ``s``, read to its end."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(65536)
    head, _, rest = got.partition(b"\r\n\r\n")
    size = int(re.search(rb"content-length: (\d+)", head).group(1))
    while len(rest) < size:
        rest += s.recv(65536)
    return head + b"\r\n\r\n" + rest


def test_a_tiny_chunk_flood_pipelined_behind_a_response_is_refused_after_it(toy):
    """A flood queued behind a response in progress, in the same read: before, uvicorn started its
    handler when that response ended, with its body cut short and the rest dropped (a 200, then
    nothing: the connection held). Now the refused request leaves the pipeline: the first answer,
    then the 400, then the close, and no handler for the refused request."""
    s = toy.connect()
    s.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n" + TINY_FLOOD)
    reply = _read_all(s, timeout=10)
    assert _statuses(reply) == [200, 400], reply[-300:]
    first, _, second = reply.partition(b"HTTP/1.1 400 ")
    assert json.loads(first.partition(b"\r\n\r\n")[2]) == {"len": 0, "headers": 1}
    assert b"chunks" in second and b"connection: close" in second
    assert toy.started == ["/slow"]


@pytest.mark.parametrize("rest", [b"1\r\nx\r\n" * (MAX_CHUNKS + 100), b"zz\r\n"], ids=["tiny chunks", "bad size"])
def test_a_body_refused_after_its_request_was_answered_closes_without_a_second_answer(toy, rest):
    """The body of a request answered before reading it (a 415: ``/noread`` here) is read and
    dropped; a flood of tiny chunks or a chunk size that cannot be read in it now closes the
    connection, where before an unsolicited 400 followed the answer to the same request."""
    s = toy.connect()
    s.sendall(b"POST /noread HTTP/1.1\r\nhost: x\r\n" + CHUNKED + b"\r\n")
    assert _statuses(_one_answer(s)) == [200]
    s.sendall(rest)
    assert _read_all(s, timeout=10) == b""
    assert toy.started == ["/noread"]


def _trailed(trailers: bytes) -> bytes:
    return b"POST /t HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + CHUNKED + b"\r\n5\r\nhello\r\n0\r\n" + trailers


def test_a_trailer_flood_is_refused_before_it_ends():
    """Each trailer line was a header of the scope, uncounted: megabytes of ``a:b`` trailers made
    millions of headers. Now trailers are capped as headers are: a 431 naming them and a close,
    without the blank line that would end them (never sent here)."""
    from spec_plugins.server.connections import ConnectionLimits

    t = _Toy(ConnectionLimits(max_header_bytes=512, max_headers_bytes=1024))
    try:
        s = t.connect()
        s.sendall(_trailed(b"a:b\r\n" * 400))
        reply = _read_all(s, timeout=10)
        assert _statuses(reply) == [431] and b"trailers over 1024 bytes" in reply, reply
        assert t.guard.counts["header_too_large"] == 1
    finally:
        t.stop()


def test_a_small_trailer_is_still_served(toy):
    s = toy.connect()
    s.sendall(_trailed(b"x-checksum: abc\r\n\r\n"))
    reply = _read_all(s)
    assert _statuses(reply) == [200], reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2]) == {"len": 5, "headers": 4}  # 3 headers, 1 trailer


def test_body_end_counts_trailer_bytes_up_to_the_cap():
    head = b"a:b\r\n" * 10 + b"\r\n"  # 52 bytes of trailers, the blank line too
    at = BodyEnd([(b"transfer-encoding", b"chunked")], 52)
    assert at.cut(b"0\r\n" + head + b"GET") == 3 + 52 and at.refused is None and at.phase == "done"
    over = BodyEnd([(b"transfer-encoding", b"chunked")], 51)
    over.cut(b"0\r\n" + head)
    assert over.refused is not None and over.refused[0] == 431 and "trailers" in over.refused[1]


class _Resetter:
    """A listener that resets every connection once it has read the request's first bytes."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import struct

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()


@pytest.mark.parametrize("server", ["dead port", "reset"])
def test_load_test_counts_transport_errors_as_failures_and_keeps_its_report(server):
    """A read timeout or a reset used to raise out of ``_level`` and lose the whole report."""
    if server == "reset":
        resetter = _Resetter()
        url = resetter.url
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    res = asyncio.run(loadtest._level(url, ["w2 w3"], 4, 2, 3))
    assert res["completed"] == 0 and res["failed"] == 4 and res["p50_s"] is None and res["p95_s"] is None
    assert sum(res["failed_statuses"].values()) == 4
    assert all(str(k).startswith("transport: ") for k in res["failed_statuses"]), res["failed_statuses"]
    assert all(not r["ok"] and r["status"].startswith("transport: ") for r in res["results"])
    json.dumps({k: v for k, v in res.items() if k != "results"})
    if server == "reset":
        resetter.sock.close()


def test_attacks_summarise_health_with_hostiles_summary():
    """One summary of /health samples (``hostile.health_summary``), not a copy in ``attacks``."""
    from spec_plugins.server import attacks

    assert attacks.health_summary is hostile.health_summary and not hasattr(hostile, "_pct")
    assert attacks._summary([(1.0, "408"), (3.0, "408"), (2.0, "closed")])["held_s"] == {"p50": 2.0, "max": 3.0}
