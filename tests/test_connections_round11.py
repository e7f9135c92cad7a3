"""Connection limits, round 11: blank lines dripped between requests of a kept-alive connection
are timed like any header bytes, a request pipelined behind another in one read has its header
bytes counted (its 431 following the response in progress), and a connection let in past the cap
for /health is served once the cap has room."""

from __future__ import annotations

import json
import random
import re
import socket
import time

import pytest

httptools = pytest.importorskip("httptools")
httpx = pytest.importorskip("httpx")

from test_connections import _busy, _connect, _read_all  # noqa: E402
from test_server import LiveServer, model, tiny_tokenizer  # noqa: E402,F401 (fixtures)
from test_server_round9 import _answer  # noqa: E402

from spec_plugins.server.connections import BodyEnd, ConnectionLimits  # noqa: E402

HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
BIG_LINE = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 60000 + b"\r\n\r\n"  # one 60 KB header line
MANY_LINES = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 500) for i in range(12)) + b"\r\n"


def _statuses(reply: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", reply)]


def _post(body: bytes, chunked: bool = False) -> bytes:
    """A POST /generate of ``body``: with its Content-Length, or chunked (a chunk extension, chunks
    of 7 bytes, a trailer)."""
    if not chunked:
        return b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(body), body)
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    return (b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunks + b"0\r\nx-trailer: t\r\n\r\n")


GENERATE = json.dumps({"inputs": "w2 w3", "parameters": {"max_new_tokens": 2}}).encode()


@pytest.fixture(scope="module")
def timed(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=0.5, idle_timeout=0.5))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def capped(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=60.0, max_header_bytes=1024,
                                                                      max_headers_bytes=4096))
    yield srv
    srv.stop()


def _drip(s: socket.socket, piece: bytes, seconds: float = 10.0) -> bytes:
    """Send ``piece`` every 0.1 s until the server answers or closes; what it sent (AssertionError
    if it still held the connection after ``seconds``)."""
    s.settimeout(0.1)
    for _ in range(int(seconds / 0.1)):
        try:
            got = s.recv(65536)
            return got + _read_all(s, 10.0) if got else got
        except TimeoutError:
            pass
        except ConnectionResetError:
            return b""
        try:
            s.sendall(piece)
        except OSError:
            return _read_all(s, 10.0)
    raise AssertionError(f"dripping {piece!r}, the connection was still held after {seconds} s")


def test_blank_lines_dripped_between_requests_are_timed_like_headers(timed):
    before = timed.guard.counts["header_timeout"]
    s = _connect(timed)
    s.sendall(HEALTH)
    assert _answer(s).startswith(b"HTTP/1.1 200")
    reply = _drip(s, b"\r\n")  # 10 s of blank lines, far past the 0.5 s header and idle timeouts
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    assert timed.guard.counts["header_timeout"] == before + 1
    # a blank line between two requests is no request of its own: the next one is served
    s = _connect(timed)
    s.sendall(HEALTH)
    assert _answer(s).startswith(b"HTTP/1.1 200")
    s.sendall(b"\r\n" + HEALTH)
    assert _answer(s).startswith(b"HTTP/1.1 200")


def test_a_request_begun_while_another_is_answered_is_timed_from_that_answer(timed, monkeypatch):
    """The header deadline of a request pipelined behind one in progress starts when that one is
    answered: its 408 follows the whole answer, never cuts into it."""
    rt = timed.state.batch.runtime
    forward = rt.forward

    def slow(*args, **kwargs):  # a generation far longer than the 0.5 s header timeout
        time.sleep(0.1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(rt, "forward", slow)
    body = json.dumps({"inputs": "w2 w3", "parameters": {"max_new_tokens": 20}}).encode()
    s = _connect(timed)
    s.sendall(_post(body) + b"GET /health HTTP/1.1\r\nho")
    reply = _read_all(s, 60.0)
    assert _statuses(reply) == [200, 408], reply[:200]
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert rest[int(re.search(rb"content-length: (\d+)", head).group(1)):].startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("ahead", ["get", "content-length", "chunked"])
@pytest.mark.parametrize("behind", ["line", "headers"])
def test_a_request_pipelined_in_one_read_has_its_header_bytes_counted(capped, ahead, behind):
    first = {"get": HEALTH, "content-length": _post(GENERATE), "chunked": _post(GENERATE, chunked=True)}[ahead]
    before = capped.guard.counts["header_too_large"]
    s = _connect(capped)
    s.sendall(first + (BIG_LINE if behind == "line" else MANY_LINES))
    reply = _read_all(s)
    assert _statuses(reply) == [200, 431], reply[-300:]
    assert (b"a header line over 1024 bytes" if behind == "line" else b"headers over 4096 bytes") in reply
    assert capped.guard.counts["header_too_large"] == before + 1
    # the 431 follows the whole first response (HTTP answers in order), not inside it
    head, _, rest = reply.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head).group(1))
    assert rest[length:].startswith(b"HTTP/1.1 431"), rest[:200]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_with_long_lines_ahead_of_a_pipelined_request_is_not_counted_as_its_headers(capped, chunked):
    body = json.dumps({"inputs": "w2 " * 5, "parameters": {"max_new_tokens": 2}, "pad": "p" * 5000}).encode()
    s = _connect(capped)
    s.sendall(_post(body, chunked) + HEALTH + HEALTH.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n"))
    statuses = _statuses(_read_all(s))
    assert len(statuses) == 3 and statuses[1:] == [200, 200] and 431 not in statuses, statuses


def _reference_ends(request: bytes, reads: list[bytes]) -> list[int]:
    """Where httptools's parser completes ``request`` when fed the slices ``BodyEnd.cut`` makes of
    ``reads`` (its headers first): the end of each slice fed, and -1 for a slice it completed in
    before that slice's end."""
    ends, done = [], []

    class Proto:
        def on_message_complete(self) -> None:
            done.append(True)

    parser = httptools.HttpRequestParser(Proto())
    head, _, _ = request.partition(b"\r\n\r\n")
    parser.feed_data(head + b"\r\n\r\n")
    if done:  # no body
        return [len(head) + 4]
    cut, fed = BodyEnd([tuple(line.lower().split(b": ", 1)) for line in head.split(b"\r\n")[1:]]), len(head) + 4
    for data in reads:
        while data and not done:
            n = cut.cut(data)
            for i in range(n):  # byte by byte: where exactly the parser completes the request
                parser.feed_data(data[i:i + 1])
                if done:
                    ends.append(fed + i + 1 if i == n - 1 else -1)
                    break
            fed, data = fed + n, data[n:]
    return ends


@pytest.mark.parametrize("seed", range(6))
def test_body_end_cuts_where_the_parser_completes_the_request(seed):
    rng = random.Random(seed)
    body = bytes(rng.choice(b"ab\r\n;0") for _ in range(rng.randrange(0, 400)))
    request = _post(body, chunked=seed % 2 == 1)
    tail = request[request.index(b"\r\n\r\n") + 4:] + HEALTH  # the body, then a pipelined request
    cuts = sorted(rng.sample(range(1, len(tail)), min(5, len(tail) - 1)))
    reads = [tail[a:b] for a, b in zip([0] + cuts, cuts + [len(tail)])]
    assert _reference_ends(request, reads) == [len(request)]


def _wait_open(srv: LiveServer, n: int) -> None:
    """Wait until the server holds ``n`` open connections (the closes it has to see are on their way)."""
    deadline = time.time() + 30
    while len(srv.guard.open) != n:
        assert time.time() < deadline, f"{len(srv.guard.open)} connections open, not {n}"
        time.sleep(0.05)


def test_a_connection_let_in_past_the_cap_is_served_once_the_cap_has_room(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=60.0, max_connections=1))
    srv.state.body_timeout = 60.0
    try:
        busy = _busy(srv, 1)
        with httpx.Client() as refused:  # while the cap is full, past it only /health and /metrics answer
            assert refused.get(srv.url + "/health").status_code == 200
            r = refused.post(srv.url + "/generate", json=json.loads(GENERATE))
            assert r.status_code == 503 and "maximum of connections" in r.text, r.text
        assert srv.guard.counts["over_capacity"] == 1
        _wait_open(srv, 1)
        with httpx.Client() as client:  # one kept-alive connection, let in past the cap for /health
            assert client.get(srv.url + "/health").status_code == 200
            assert srv.guard.over == 1
            busy[0].close()
            _wait_open(srv, 1)
            r = client.post(srv.url + "/generate", json=json.loads(GENERATE))
            assert r.status_code == 200, r.text
            assert srv.guard.over == 0 and srv.guard.counts["over_capacity"] == 1
        _wait_open(srv, 0)
        assert srv.guard.over == 0  # counted once, not taken off twice
    finally:
        srv.stop()
