"""Connection limits, round 11: blank lines dripped between requests of a kept-alive connection
are timed like any header bytes, a request pipelined behind another in one read has its header
bytes counted (its 431 following the response in progress), and a connection let in past the cap
for /health is served once the cap has room."""

from __future__ import annotations

import json
import random
import re
import socket
import sys
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


# ---- round 11, review: BodyEnd's chunk sizes, a pipelined body, websocket upgrades, stray CRLFs --------

CHUNKED = [(b"transfer-encoding", b"chunked")]
FRAMING = b"0123456789abcdefABCDEF-+ xX;=\r\n\t:"  # bytes that matter to chunked framing


def _bounded(fn, *args, steps: int):
    """``fn(*args)``, or an AssertionError once it has run ``steps`` lines of Python: a loop that
    never ends fails the test instead of hanging it (a count of steps, not a time)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += 1
        if count > steps:
            raise AssertionError(f"{fn.__qualname__} still running after {steps} steps: it does not end")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn(*args)
    finally:
        sys.settrace(previous)


def _chunked_body(rng: random.Random) -> bytes:
    """A chunked body llhttp reads whole: sizes in either case after up to 100 leading zeros (past
    any fixed window on the size line), chunk extensions, trailers."""
    out = []
    for _ in range(rng.randrange(0, 4)):
        data = bytes(rng.choice(b"ab\r\n;0") for _ in range(rng.randrange(1, 64)))
        size = b"%x" % len(data)
        size = b"0" * rng.choice([0, 1, 63, 100]) + (size.upper() if rng.random() < 0.5 else size)
        out.append(size + rng.choice([b"", b";ext=1", b';a="x;y"', b";a;b=c"]) + b"\r\n" + data + b"\r\n")
    out.append(b"0" * rng.choice([1, 2, 70]) + rng.choice([b"", b";z"]) + b"\r\n"
               + rng.choice([b"", b"x-t: 1\r\n", b"x-t: 1\r\nx-u: 2\r\n"]) + b"\r\n")
    return b"".join(out)


def _mutated(rng: random.Random, body: bytes) -> bytes:
    """``body`` with 1 to 3 bytes replaced, inserted or deleted, among bytes that matter to chunked
    framing (a sign, a space, ``x``, CR, LF...)."""
    b = bytearray(body)
    for _ in range(rng.randrange(1, 4)):
        i, op, c = rng.randrange(len(b) + 1), rng.randrange(3), rng.choice(FRAMING)
        if op == 1:
            b.insert(i, c)
        elif i < len(b):
            b[i:i + 1] = bytes([c]) if op == 0 else b""
    return bytes(b)


def _parser_outcome(tail: bytes) -> tuple[str, int]:
    """What httptools's parser does with ``tail`` after chunked headers, byte by byte: ("done", k)
    when it completes the request with ``tail[:k]``, ("error", i) when it rejects ``tail[i]``,
    ("open", len) when it wants more."""
    done: list[bool] = []

    class Proto:
        def on_message_complete(self) -> None:
            done.append(True)

    parser = httptools.HttpRequestParser(Proto())
    parser.feed_data(b"POST /generate HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
    for i in range(len(tail)):
        try:
            parser.feed_data(tail[i:i + 1])
        except httptools.HttpParserError:
            return "error", i
        if done:
            return "done", i + 1
    return "open", len(tail)


def _body_end_outcome(reads: list[bytes]) -> tuple[str, int]:
    """What ``BodyEnd`` makes of ``reads`` (each cut bounded): ("end", k) where it ends the body,
    ("lost", k) when it gives the framing up with ``k`` bytes fed, ("open", len) when it wants more."""
    end, fed = BodyEnd(CHUNKED), 0
    for data in reads:
        n = _bounded(end.cut, data, steps=200 + 50 * len(data))
        assert 0 <= n <= len(data), n
        if end.lost:
            return "lost", fed + n
        if n < len(data):
            return "end", fed + n
        fed += n
    return "open", fed


@pytest.mark.parametrize("seed", range(300))
def test_body_end_is_bounded_and_never_cuts_where_the_parser_does_not(seed):
    """On any bytes (chunked bodies llhttp reads, the same with bytes changed, garbage): each cut returns,
    where the parser completes the request BodyEnd ends it at that very byte, and where BodyEnd
    ends it or gives up otherwise, the parser has rejected a byte before: it never feeds the
    parser past a request's end, whose next request's header bytes would go uncounted."""
    rng = random.Random(seed)
    kind = ("valid", "changed", "garbage")[seed % 3]
    body = _chunked_body(rng) if kind != "garbage" else bytes(rng.choice(FRAMING) for _ in range(rng.randrange(60)))
    body = _mutated(rng, body) if kind == "changed" else body
    tail = body + HEALTH
    parser, at = _parser_outcome(tail)
    cuts = sorted(rng.sample([c for c in range(1, len(tail)) if parser != "done" or c != at], 4))
    got, cut_at = _body_end_outcome([tail[a:b] for a, b in zip([0] + cuts, cuts + [len(tail)])])
    if parser == "done":
        assert (got, cut_at) == ("end", at), (body, got, cut_at)
    elif got != "open":
        assert parser == "error" and at < cut_at, (body, parser, at, got, cut_at)
    if kind == "valid":  # a body llhttp reads whole
        assert parser == "done" and at == len(body), (body, parser, at)


@pytest.mark.parametrize("line", [b"-0009\r\nX", b"5\r\nhello\r\n-0009\r\n0\r\n\r\n", b"+5\r\nhello", b" 5\r\n",
                                  b"0x5\r\n", b";x\r\n", b"1" + b"0" * 16 + b"\r\n"])
def test_body_end_gives_a_chunk_size_up_at_the_bytes_the_parser_rejects(line):
    """A sign (Python's int() takes one, llhttp does not), a space, ``0x``, no digit, more than 64
    bits: the framing is lost, the cut stops past the bytes at fault, and the parser rejects them."""
    got, cut_at = _body_end_outcome([line])
    parser, at = _parser_outcome(line)
    assert got == "lost" and parser == "error" and at < cut_at <= len(line), (got, cut_at, parser, at)


@pytest.mark.parametrize("seed", range(30))
def test_body_end_cuts_where_the_parser_completes_long_and_uppercase_chunk_sizes(seed):
    """The existing comparison with httptools, over chunk sizes with leading zeros past 64 bytes, in
    either case, with extensions and trailers."""
    rng = random.Random(seed)
    body = _chunked_body(rng)
    request = (b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
               + body)
    tail = body + HEALTH
    cuts = sorted(rng.sample(range(1, len(tail)), 4))
    reads = [tail[a:b] for a, b in zip([0] + cuts, cuts + [len(tail)])]
    assert _reference_ends(request, reads) == [len(request)]


def test_a_chunk_size_the_parser_rejects_is_a_400_and_the_server_goes_on(capped):
    s = _connect(capped)
    s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
              b"-0009\r\nX")
    assert _read_all(s).startswith(b"HTTP/1.1 400"), "the connection was not refused"
    assert httpx.get(capped.url + "/health", timeout=10).status_code == 200  # the event loop still runs


def test_a_chunk_size_with_leading_zeros_keeps_the_request_behind_it_counted(capped):
    """A chunk size of 63 zeros and then its digits (llhttp reads them all, not the first 64 bytes)
    ends the body where the parser does, so the 60 KB header line of the request pipelined behind
    it is a 431."""
    before = capped.guard.counts["header_too_large"]
    first = (b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
             + b"0" * 63 + b"%x\r\n%s\r\n0\r\n\r\n" % (len(GENERATE), GENERATE))
    s = _connect(capped)
    s.sendall(first + BIG_LINE)
    reply = _read_all(s)
    assert _statuses(reply) == [200, 431], reply[-300:]
    assert capped.guard.counts["header_too_large"] == before + 1


def test_a_pipelined_post_whose_body_ends_after_the_first_answer_is_answered_whole(timed, monkeypatch):
    """B, pipelined behind A with its body not all sent when A is answered, is started then: its body
    coming afterwards is its own, not the rest of an answered request's, and B is answered whole
    (not closed by the idle timeout while generating)."""
    rt = timed.state.batch.runtime
    forward = rt.forward

    def slow(*args, **kwargs):  # a generation far longer than the 0.5 s idle and header timeouts
        time.sleep(0.1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(rt, "forward", slow)
    body = json.dumps({"inputs": "w2 w3", "parameters": {"max_new_tokens": 20}}).encode()
    s = _connect(timed)
    s.sendall(_post(body) + _post(body)[:-10])  # A whole, B's headers and most of its body
    assert _answer(s).startswith(b"HTTP/1.1 200")
    time.sleep(0.2)
    s.sendall(_post(body)[-10:])  # the rest of B's body, after A's answer
    reply = _read_all(s, 60.0)  # B's answer, then the close at the idle timeout
    assert _statuses(reply) == [200], reply[:200]
    head, _, content = reply.partition(b"\r\n\r\n")
    assert len(content) == int(re.search(rb"content-length: (\d+)", head).group(1)), reply


@pytest.mark.parametrize("ws", ["default", "auto"])
def test_a_websocket_upgrade_leaves_no_connection_counted_against_the_cap(model, monkeypatch, ws):  # noqa: F811
    """By default a websocket upgrade is answered as plain HTTP (the app has no websocket route);
    with a websocket protocol configured, the connection handed to it leaves the guard: either
    way, once the sockets close, none holds a slot of the cap."""
    import test_server

    from spec_plugins.server.app import http_server

    if ws != "default":
        monkeypatch.setattr(test_server, "http_server", lambda *a, **k: http_server(*a, ws=ws, **k))
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(max_connections=2, reserve=1))
    upgrade = (b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
               b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
    try:
        for _ in range(3):
            s = _connect(srv)
            s.sendall(upgrade)
            assert _statuses(s.recv(1000)) == [200 if ws == "default" else 403]
            s.close()
        _wait_open(srv, 0)
    finally:
        srv.stop()


@pytest.mark.parametrize("when", ["with the body", "after the answer", "two after the answer"])
def test_a_stray_crlf_after_a_request_leaves_the_idle_timeout_running(timed, when):
    """Up to two CRLFs after a request (RFC 9112 2.2: a server ignores them) are no request's bytes:
    the kept-alive connection closes at the idle timeout, silently, with no 408 for a request
    never sent."""
    before = timed.guard.counts["header_timeout"]
    s = _connect(timed)
    s.sendall(_post(GENERATE) + (b"\r\n" if when == "with the body" else b""))
    assert _answer(s).startswith(b"HTTP/1.1 200")
    if when != "with the body":
        s.sendall(b"\r\n" * (2 if when.startswith("two") else 1))
    assert _read_all(s) == b""  # closed by the idle timeout, nothing more sent
    assert timed.guard.counts["header_timeout"] == before
