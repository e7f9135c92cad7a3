"""Shutdown while a request is being admitted: its prefill runs outside the scheduler's lock,
after the request left the waiting list and before it joined the running batch. SIGTERM then
must still drain it (within ``--shutdown-timeout``) or end it with the error event, never leave
its stream hanging until uvicorn's deadline cuts it."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import tiny_llama

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from test_server import LiveServer, _events, solo, tiny_tokenizer

BODY = {"inputs": "w2 w3", "parameters": {"max_new_tokens": 120}}
STOPPED = "the server shut down before this request finished"


def _hold_prefill(srv: LiveServer) -> tuple[threading.Event, threading.Event]:
    """Make the runtime's prefill wait: ``entered`` is set when a request's prefill begins, and the
    prefill goes on once ``release`` is set (a long prompt on a real model, made deterministic)."""
    rt = srv.state.batch.runtime
    add_rows, entered, release = rt.add_rows, threading.Event(), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(60), "the prefill was never released"
        return add_rows(*args, **kwargs)

    rt.add_rows = held
    return entered, release


def _shutdown_during_prefill(srv: LiveServer) -> list:
    """Stream ``BODY``, ask the server to exit while its prefill runs, and return the stream's
    events. The prefill goes on once the scheduler has halted, or after a second if it is still
    draining (it waits for this request then)."""
    entered, release = _hold_prefill(srv)
    events: list = []
    client = threading.Thread(target=_events, args=(srv.url, BODY, events))
    client.start()
    assert entered.wait(30), "the request never reached its prefill"
    srv.server.should_exit = True  # SIGTERM: DrainingServer stops the scheduler
    sched, wait_until = srv.state.scheduler, time.monotonic() + 1.0
    while not sched._halt and time.monotonic() < wait_until:
        time.sleep(0.01)
    release.set()
    client.join(60)
    srv.thread.join(60)
    assert not client.is_alive() and not srv.thread.is_alive()
    return events


def test_a_request_in_its_prefill_at_shutdown_drains():
    """With time to finish, the request whose prefill ran as SIGTERM came completes: every token
    greedy decoding gives, then the final event with its finish reason."""
    model, tok = tiny_llama(seed=3, max_pos=1024), tiny_tokenizer()
    srv = LiveServer(model, tok, max_batch=2, max_total=600, policy="fixed",
                     shutdown_timeout=30.0)
    events = _shutdown_during_prefill(srv)
    assert events and events[-1].get("generated_text") is not None, events[-3:]
    assert [e["token"]["id"] for e in events] == solo(model, tok, BODY["inputs"], 120)


def test_a_request_in_its_prefill_at_an_immediate_shutdown_gets_the_error_event():
    """``--shutdown-timeout 0``: the request whose prefill ran as SIGTERM came ends with the
    scheduler's error event (the stream's last event), not a cut-off stream."""
    srv = LiveServer(tiny_llama(seed=3, max_pos=1024), tiny_tokenizer(), max_batch=2, max_total=600, policy="fixed",
                     shutdown_timeout=0.0)
    events = _shutdown_during_prefill(srv)
    assert events and events[-1].get("error", "").startswith(STOPPED), events[-3:]
    assert events[-1].get("error_type") == "generation"
