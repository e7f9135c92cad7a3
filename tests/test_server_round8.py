"""/metrics labels: a request that asked for a stream is counted under its route's stream label,
also when it is refused before its stream starts (the body's validation, intake, a full queue)."""

from __future__ import annotations

import time

import pytest
from test_server import LiveServer, model, tiny_tokenizer  # noqa: F401 (fixtures)

httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

CHAT = {"messages": [{"role": "user", "content": "w2"}], "max_tokens": 2}
# route -> (its plain label, a good body, a field its schema refuses, a token budget intake refuses)
ROUTES = {
    "/": ("compat", {"inputs": "w2 w3", "parameters": {"max_new_tokens": 2}},
          {"parameters": {"top_k": 0}}, {"parameters": {"max_new_tokens": 500}}),
    "/v1/chat/completions": ("chat_completions", CHAT, {"temperature": 5.0}, {"max_tokens": 500}),
    "/v1/completions": ("completions", {"prompt": "w2 w3", "max_tokens": 2}, {"temperature": 5.0},
                        {"max_tokens": 500}),
}


@pytest.fixture(scope="module")
def live(model):  # noqa: F811
    srv = LiveServer(model, tiny_tokenizer(eos=False), max_total=128, max_input=48)
    yield srv
    srv.stop()


def counts(srv: LiveServer) -> dict[tuple[str, str, str], float]:
    """Every request counter and latency-histogram count, by (sample, route, status)."""
    text = httpx.get(srv.url + "/metrics").text
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("spec_requests_total", "spec_request_duration_seconds_count"):
                out[(s.name, s.labels["route"], s.labels.get("status", ""))] = s.value
    return out


def counted(srv: LiveServer, path: str, **post) -> tuple[int, dict[tuple[str, str, str], float]]:
    """A POST's status and what it added to /metrics' request counts."""
    before = counts(srv)
    status = httpx.post(srv.url + path, timeout=60, **post).status_code
    deadline = time.monotonic() + 10  # a stream is counted as its response ends, just after its last byte
    while True:
        added = {k: v - before.get(k, 0) for k, v in counts(srv).items() if v != before.get(k, 0)}
        if sum(v for k, v in added.items() if k[0] == "spec_requests_total") or time.monotonic() > deadline:
            return status, added
        time.sleep(0.02)


def once(route: str, status: int) -> dict[tuple[str, str, str], float]:
    return {("spec_requests_total", route, str(status)): 1, ("spec_request_duration_seconds_count", route, ""): 1}


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("stream", [True, False])
def test_a_refused_request_is_counted_under_its_stream_label_when_it_asked_for_a_stream(live, path, stream,
                                                                                          monkeypatch):
    plain, good, bad_field, too_long = ROUTES[path]
    label = plain + "_stream" if stream else plain
    cases = [(422, {**good, **bad_field}),  # refused by the schema, before the body is a request
             (422, {**good, **too_long}),  # refused at intake (the token budget)
             (429, good),  # refused by a full queue
             (200, good)]
    got, room = [], live.state.scheduler.max_queue
    for status, body in cases:
        monkeypatch.setattr(live.state.scheduler, "max_queue", 0 if status == 429 else room)
        got.append(counted(live, path, json={**body, "stream": stream}))
    assert got == [(status, once(label, status)) for status, _ in cases]


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_body_with_no_stream_flag_to_read_stays_under_the_plain_label(live, path):
    plain = ROUTES[path][0]
    for body, status in ((b'{"stream": true, ', 400),  # not JSON
                         (b'[{"stream": true}]', 422),  # JSON, not an object
                         (b'{"stream": "true", "x": 1}', 422)):  # a string is no flag (the schemas are strict)
        got, added = counted(live, path, content=body, headers={"content-type": "application/json"})
        assert (got, added) == (status, once(plain, status)), body


def test_generate_stream_keeps_its_one_label_whatever_the_body(live):
    body = {"inputs": "w2", "stream": True, "parameters": {"top_k": 0}}
    got, added = counted(live, "/generate_stream", json=body)
    assert (got, added) == (422, once("generate_stream", 422))
