"""Server lifetime, round 9: a request answered before its body came whole does not hold its
connection (the rest is read for up to the header timeout, then it closes), and /health and Ray's
health check report a server whose rounds all fail as unhealthy, not only one whose decode
thread died."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("httptools")
httpx = pytest.importorskip("httpx")

from test_connections import _closed, _connect  # noqa: E402
from test_server import LiveServer, model, tiny_tokenizer  # noqa: E402,F401 (fixtures)

from spec_plugins.server import ray_serve  # noqa: E402
from spec_plugins.server.connections import ConnectionLimits  # noqa: E402
from spec_plugins.server.scheduler import UNHEALTHY_AFTER  # noqa: E402

UNREAD = {  # requests answered without their body being read: (head, the status they get)
    "415": (b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\ncontent-length: 100000\r\n\r\n", 415),
    "health": (b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n", 200),
    "404": (b"POST /nope HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n", 404),
}


@pytest.fixture(scope="module")
def timed(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=0.5, idle_timeout=0.5))
    yield srv
    srv.stop()


def _answer(s: socket.socket) -> bytes:
    """One whole response (its headers and its content-length of body), the connection left open."""
    s.settimeout(10)
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(65536)
    return head


@pytest.mark.parametrize("kind", list(UNREAD))
def test_an_unread_body_dripped_after_its_answer_does_not_hold_the_connection(timed, kind):
    head, status = UNREAD[kind]
    s = _connect(timed)
    s.sendall(head + b"x")
    assert _answer(s).startswith(b"HTTP/1.1 %d" % status)
    try:
        for _ in range(50):  # 5 s of one body byte at a time, far past the 0.5 s header timeout
            s.sendall(b"x")
            time.sleep(0.1)
    except OSError:
        pass  # the server closed the connection
    assert _closed(s, 2.0), "a connection dripping the body of an answered request was still held"
    assert httpx.get(timed.url + "/health").status_code == 200


def test_an_unread_body_that_ends_leaves_the_connection_serving(timed):
    """A kept-alive client whose answer came before its whole body (httpx sending a 415'd body)
    sends its next request on the same connection once the body is out: it is served."""
    s = _connect(timed)
    s.sendall(UNREAD["415"][0].replace(b"100000", b"20"))
    assert _answer(s).startswith(b"HTTP/1.1 415")
    s.sendall(b"x" * 20 + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # the body's end, and the next request
    assert _answer(s).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert _answer(s).startswith(b"HTTP/1.1 200")


@pytest.fixture
def broken(model):  # noqa: F811
    """A server whose runtime fails every forward (a sticky device error); ``fix()`` repairs it."""
    srv = LiveServer(model, tiny_tokenizer(), max_batch=2)
    rt = srv.state.batch.runtime

    def forward(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rt.forward = forward
    srv.fix = lambda: rt.__dict__.pop("forward", None)
    yield srv
    srv.stop()


def _generate(srv: LiveServer) -> httpx.Response:
    return httpx.post(srv.url + "/generate", json={"inputs": "w2 w3", "parameters": {"max_new_tokens": 3}},
                      timeout=60)


def test_health_and_ray_check_health_fail_when_every_round_fails_and_recover(broken, monkeypatch):
    monkeypatch.setitem(ray_serve._REPLICA, "state", broken.state)
    replica = ray_serve.SpecReplica()
    for i in range(UNHEALTHY_AFTER):
        assert _generate(broken).status_code == 500
        health = httpx.get(broken.url + "/health")
        if i < UNHEALTHY_AFTER - 1:  # one failure may be a request's own: still healthy
            assert health.status_code == 200, health.text
            replica.check_health()
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["error_type"] == "unhealthy" and "failed" in body["error"] and "RuntimeError" in body["error"]
    with pytest.raises(RuntimeError, match="unhealthy.*RuntimeError"):
        replica.check_health()
    broken.fix()  # the device recovers: the next round that runs makes the server healthy again
    assert _generate(broken).status_code == 200
    assert httpx.get(broken.url + "/health").status_code == 200
    replica.check_health()


def test_an_idle_server_is_healthy_again_once_its_failures_are_old(broken, monkeypatch):
    """Only a round that ran cleared the count, and an idle server (a probe taking it out of
    rotation) runs none: it stayed 503 for good after a transient device error. Failures older
    than ``UNHEALTHY_FOR`` no longer count; a runtime still broken fails 3 more and is down again."""
    from spec_plugins.server import scheduler

    for _ in range(UNHEALTHY_AFTER):
        assert _generate(broken).status_code == 500
    assert httpx.get(broken.url + "/health").status_code == 503
    monkeypatch.setattr(scheduler, "UNHEALTHY_FOR", 0.0)  # as if that long had passed, with no request
    assert httpx.get(broken.url + "/health").status_code == 200
    monkeypatch.setattr(scheduler, "UNHEALTHY_FOR", 3600.0)
    assert httpx.get(broken.url + "/health").status_code == 503  # still broken: the count was never cleared
