"""Connection-level refusals (408, 431, 503, a body's 431) as JSON in the error shape of the
request's path, over real sockets and through the real clients: ``text_generation`` reads every
error body as JSON before it looks at the status (a text body was a bare ``JSONDecodeError``), and
the ``openai`` client reads OpenAI's ``{"error": {...}}``. Where no path came yet (a silent
socket, a request line cut short), TGI's shape. Also examples/bench_llamacpp.py's and
examples/server_clients.py's command-line fixes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("httptools")
text_generation = pytest.importorskip("text_generation")
openai = pytest.importorskip("openai")

from test_connections import _busy, _connect, _read_all  # noqa: E402
from test_server import LiveServer, model, tiny_tokenizer  # noqa: E402,F401 (fixtures)

from spec_plugins.server.connections import BUSY, ConnectionLimits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINE_431 = "request header fields too large: a header line over 1024 bytes"
LATE_408 = "the request line and headers did not arrive in time"
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def _reply(raw: bytes) -> tuple[int, dict[str, str], object]:
    """A refusal's status, headers (lower-cased names) and JSON body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (x.partition(":") for x in lines[1:]))
    assert headers["content-type"] == "application/json" and headers["connection"] == "close", headers
    assert int(headers["content-length"]) == len(body), (headers, body)
    return int(lines[0].split()[1]), headers, json.loads(body)


def _send(srv: LiveServer, data: bytes) -> bytes:
    s = _connect(srv)
    s.sendall(data)
    return _read_all(s)


def _openai_error(message: str, kind: str, openai_type: str) -> dict:
    return {"error": {"message": message, "type": openai_type, "param": None, "code": kind}}


@pytest.fixture(scope="module")
def capped(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=60.0, max_header_bytes=1024,
                                                                      max_headers_bytes=4096))
    srv.state.body_timeout = 60.0
    yield srv
    srv.stop()


# ---- 431: a header line over the cap -------------------------------------------------------------
def test_a_431_on_a_tgi_route_is_tgi_json_the_text_generation_client_reads(capped):
    status, _, body = _reply(_send(capped, b"GET /health HTTP/1.1\r\nhost: x\r\nx-fill: " + b"a" * 2000 + b"\r\n\r\n"))
    assert (status, body) == (431, {"error": LINE_431, "error_type": "http"})
    client = text_generation.Client(capped.url, headers={"x-fill": "a" * 2000}, timeout=60)
    with pytest.raises(text_generation.errors.UnknownError, match=LINE_431):
        client.generate("w2 w3", max_new_tokens=2)


def test_a_431_on_an_openai_route_is_openai_json_the_openai_client_reads(capped):
    status, _, body = _reply(_send(capped, CHAT + b"x-fill: " + b"a" * 2000 + b"\r\n\r\n"))
    assert (status, body) == (431, _openai_error(LINE_431, "http", "invalid_request_error"))
    client = openai.OpenAI(base_url=capped.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                           default_headers={"x-fill": "a" * 2000})
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w2"}])
    assert e.value.status_code == 431 and e.value.body == _openai_error(LINE_431, "http", "invalid_request_error")["error"]


@pytest.mark.parametrize("line", [b"GET /v1/" + b"a" * 2000, b"POST /v1/chat/completions" + b"a" * 2000])
def test_a_request_line_over_the_cap_has_no_path_yet_and_gets_tgi_json(capped, line):
    status, _, body = _reply(_send(capped, line + b" HTTP/1.1\r\n\r\n"))
    assert (status, body) == (431, {"error": LINE_431, "error_type": "http"})


def test_a_431_for_trailers_after_an_openai_requests_headers_is_openai_json(capped):
    chunked = CHAT.replace(b"content-type", b"transfer-encoding: chunked\r\ncontent-type") + b"\r\n"
    trailers = b"".join(b"x-t%d: %s\r\n" % (i, b"b" * 900) for i in range(6))  # ~5.4 KiB > 4096
    status, _, body = _reply(_send(capped, chunked + b"2\r\n{}\r\n0\r\n" + trailers + b"\r\n"))
    message = "request header fields too large: trailers over 4096 bytes"
    assert (status, body) == (431, _openai_error(message, "http", "invalid_request_error"))


# ---- 408: the request line and headers too slow --------------------------------------------------
@pytest.fixture(scope="module")
def timed(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=0.5, idle_timeout=0.5))
    yield srv
    srv.stop()


@pytest.mark.parametrize("sent,openai_shape", [
    (b"", False),  # a silent socket: no path came
    (b"POST /v1/chat/compl", False),  # the path cut short: not known yet
    (b"GET /health HTTP/1.1\r\nhost: x\r\n", False),
    (CHAT, True),
    (b"GET /v1/models?x=", True),  # the path ended at its query
])
def test_a_408_has_the_shape_of_the_path_that_came(timed, sent, openai_shape):
    status, _, body = _reply(_send(timed, sent))
    expected = _openai_error(LATE_408, "http", "invalid_request_error") if openai_shape else \
        {"error": LATE_408, "error_type": "http"}
    assert (status, body) == (408, expected)


# ---- 503: the connection cap ---------------------------------------------------------------------
def test_503s_of_the_connection_cap_are_json_in_their_paths_shape(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(), limits=ConnectionLimits(header_timeout=60.0, max_connections=1,
                                                                      reserve=0))
    srv.state.body_timeout = 60.0
    try:
        victim = _connect(srv)  # still sending its headers: closed with a 503 for a newer connection
        victim.sendall(CHAT)
        deadline = time.time() + 30
        while not any(c.header_bytes for c in srv.guard.open.values()):
            assert time.time() < deadline, "the server did not read the headers sent"
            time.sleep(0.05)
        newer = _connect(srv)
        status, headers, body = _reply(_read_all(victim))
        assert (status, body) == (503, _openai_error(BUSY, "overloaded", "server_error"))
        assert headers.get("retry-after") == "1"  # as the 503 of a full cap answered in the app
        newer.close()
        busy = _busy(srv, 1)  # the cap busy and no reserve: a new connection's 503 comes before any path
        status, headers, body = _reply(_read_all(_connect(srv)))
        assert (status, body) == (503, {"error": BUSY, "error_type": "overloaded"}) and headers["retry-after"] == "1"
        for b in busy:
            b.close()
    finally:
        srv.stop()


# ---- examples ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,named", [(["--runs", "0"], "--runs"), (["--max-new-tokens", "-1"], "--max-new-tokens"),
                                        (["--threads", "0"], "--threads"), (["--threads", "100000"], "--threads")])
def test_bench_llamacpp_refuses_non_positive_numbers_before_loading(args, named, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "bench_llamacpp.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"argument {named}:" in done.stderr, done.stderr


def test_bench_llamacpp_reads_its_side_by_side_configs_from_the_repo_with_the_threads(tmp_path, monkeypatch):
    from spec_plugins.config import SpecConfig

    monkeypatch.chdir(tmp_path)  # not the repository: the configs are found all the same
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import bench_llamacpp

    configs = bench_llamacpp.side_by_side_configs(3)
    assert {b: SpecConfig.parse(c).target.backend for b, c in configs.items()} == {"torch": "torch",
                                                                                  "llamacpp": "llamacpp"}
    assert all(SpecConfig.parse(c).target.threads == 3 for c in configs.values())


def test_server_clients_shows_the_servers_output_when_it_fails(tmp_path):
    missing = tmp_path / "missing.yaml"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "server_clients.py"), "--config", str(missing)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"config file not found: {missing}" in done.stderr, done.stderr[-2000:]
    for line in done.stderr.splitlines():  # the log it kept for the failure
        if line.startswith("failed; the server's output ("):
            Path(line.split("(", 1)[1].split(")", 1)[0]).unlink()
