"""Connection limits of ``spec-plugins serve`` over real sockets: a request line and headers must
arrive within the header timeout, header bytes are capped while they are read (431), idle
kept-alive connections close, and past the connection cap the oldest connection without a request
in progress is closed, a reserve answers /health and /metrics, and nothing is ever refused."""

from __future__ import annotations

import logging
import socket
import time

import pytest

pytest.importorskip("httptools")
httpx = pytest.importorskip("httpx")

from test_server import LiveServer, model, tiny_tokenizer  # noqa: E402,F401 (fixtures)

from spec_plugins.server.connections import ConnectionLimits, ThrottledLog  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _connect(srv: LiveServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    return s


def _read_all(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes (raises socket.timeout if it does not)."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _closed(s: socket.socket, timeout: float = 10.0) -> bool:
    try:
        _read_all(s, timeout)
        return True
    except socket.timeout:
        return False


@pytest.fixture(scope="module")
def timed(model, tok):
    srv = LiveServer(model, tok, limits=ConnectionLimits(header_timeout=0.5, idle_timeout=0.5))
    yield srv
    srv.stop()


def test_a_socket_that_sends_nothing_is_closed_after_the_header_timeout(timed):
    s = _connect(timed)
    assert _closed(s, 10.0), "a silent socket was still held"
    assert httpx.get(timed.url + "/health").status_code == 200


def test_headers_dripped_a_byte_at_a_time_get_a_408_and_a_close(timed):
    s = _connect(timed)
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
    got = b""
    try:
        for _ in range(100):  # 10 s of dripping, far past the 0.5 s header timeout
            s.sendall(b"a")
            time.sleep(0.1)
    except OSError:
        pass  # the server closed the connection
    got = _read_all(s, 10.0)
    assert got.startswith(b"HTTP/1.1 408"), got[:80]
    assert timed.guard.counts["header_timeout"] >= 1


def test_an_idle_kept_alive_connection_is_closed_and_a_next_request_is_timed_again(timed):
    s = _connect(timed)
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    s.settimeout(10)
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    assert _closed(s, 10.0), "an idle kept-alive connection was still held"
    # the next request's headers on a kept-alive connection are timed too
    s = _connect(timed)
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /health HTTP/1.1\r\n")
    assert _read_all(s, 10.0).startswith(b"HTTP/1.1 408")


@pytest.fixture(scope="module")
def capped(model, tok):
    srv = LiveServer(model, tok, limits=ConnectionLimits(header_timeout=60.0, max_header_bytes=1024,
                                                         max_headers_bytes=4096, max_connections=4))
    srv.state.body_timeout = 60.0
    yield srv
    srv.stop()


def test_a_header_line_over_the_cap_is_a_431_while_it_is_read(capped):
    ok = httpx.get(capped.url + "/health", headers={"x-fill": "a" * 900})
    assert ok.status_code == 200
    s = _connect(capped)
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-fill: ")
    sent = 0
    try:
        for _ in range(64 * 16):  # up to 64 MiB of one header, never finished
            s.sendall(b"a" * 65536)
            sent += 65536
    except OSError:
        pass
    reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 431") and b"header line over 1024 bytes" in reply, reply[:120]
    assert sent < 8 << 20, f"the server read {sent} bytes of one header before refusing it"


def test_all_headers_over_the_cap_are_a_431(capped):
    s = _connect(capped)
    lines = b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 500) for i in range(12))  # 12 x ~508 bytes > 4096
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + lines + b"\r\n")
    reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 431") and b"headers over 4096 bytes" in reply
    # a request after a body on a kept-alive connection counts its own headers only
    with httpx.Client() as c:
        for _ in range(3):
            r = c.post(capped.url + "/generate", json={"inputs": "w2 w3 " * 300, "parameters": {"max_new_tokens": 1}})
            assert r.status_code in (200, 422), r.text


def test_past_the_cap_the_oldest_idle_connection_closes_and_health_answers(capped):
    idle = [_connect(capped) for _ in range(4)]
    time.sleep(0.3)
    before = capped.guard.counts["evicted"]
    assert httpx.get(capped.url + "/health", headers={"connection": "close"}).status_code == 200
    assert _closed(idle[0], 10.0), "the oldest idle connection was kept past the cap"
    assert capped.guard.counts["evicted"] > before
    for s in idle:
        s.close()


def _busy(srv: LiveServer, n: int) -> list[socket.socket]:
    """``n`` connections whose requests are in progress: headers complete, body still pending."""
    out = []
    for _ in range(n):
        s = _connect(srv)
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"inputs\"")
        out.append(s)
    time.sleep(0.5)
    return out


def test_when_every_connection_is_busy_the_reserve_answers_health_and_503s_the_rest(capped):
    time.sleep(0.3)
    busy = _busy(capped, 4)
    assert httpx.get(capped.url + "/health", headers={"connection": "close"}).status_code == 200
    assert httpx.get(capped.url + "/metrics", headers={"connection": "close"}).status_code == 200
    r = httpx.post(capped.url + "/generate", json={"inputs": "w2"}, headers={"connection": "close"})
    assert r.status_code == 503 and "maximum of connections" in r.text
    # a flood of silent sockets past a busy cap: they close each other, /health still answers
    flood = [_connect(capped) for _ in range(60)]
    time.sleep(0.5)
    assert len(capped.guard.open) <= 4 + 1
    assert sum(_closed(s, 0.01) for s in flood[:-1]) == 59
    assert httpx.get(capped.url + "/health", headers={"connection": "close"}).status_code == 200
    for s in flood + busy:
        s.close()


def test_past_the_cap_and_its_reserve_a_new_connection_gets_a_503_at_once(model, tok):
    srv = LiveServer(model, tok, limits=ConnectionLimits(header_timeout=60.0, max_connections=2, reserve=0))
    srv.state.body_timeout = 60.0
    try:
        busy = _busy(srv, 2)
        s = _connect(srv)
        reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 503") and b"maximum of connections" in reply
        assert srv.guard.counts["over_capacity"] == 1
        for b in busy:
            b.close()
    finally:
        srv.stop()


def test_events_are_logged_once_per_address_and_interval(caplog):
    now = [0.0]
    tl = ThrottledLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="spec_plugins.server"):
        assert tl.event("header_timeout", "10.0.0.1", "slow")
        for _ in range(50):
            assert not tl.event("header_timeout", "10.0.0.1", "slow")
        assert tl.event("header_timeout", "10.0.0.2", "slow")  # another address
        assert tl.event("evicted", "10.0.0.1", "evicted")  # another kind
        now[0] = 11.0
        assert tl.event("header_timeout", "10.0.0.1", "slow")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and lines[-1] == "slow from 10.0.0.1 (and 50 more in the last 10 s)"


def test_limits_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="--max-connections"):
        ConnectionLimits(max_connections=0).check()
    with pytest.raises(ValueError, match="--max-header-bytes"):
        ConnectionLimits(max_header_bytes=8192, max_headers_bytes=4096).check()
    with pytest.raises(ValueError, match="--header-timeout"):
        ConnectionLimits(header_timeout=0).check()
