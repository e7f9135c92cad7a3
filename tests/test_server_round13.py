"""A streamed choice's last chunk carries logprobs only where it has a visible token (hardening
round 13): one ending on EOS sent ``{"content": [], "refusal": null}``, one ending by length
``null``."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_grammar import MESSAGES, SCHEMA, _fmt, live  # noqa: F401  (the module's server fixture)

pytest.importorskip("openai")


def _chunks(live, body: dict) -> list[dict]:  # noqa: F811
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line.removeprefix("data:")) for line in r.iter_lines()
                if line.startswith("data:") and line.removeprefix("data:").strip() != "[DONE]"]


def test_the_last_chunk_of_a_choice_ending_on_eos_has_no_empty_logprobs(live):  # noqa: F811
    body = {"model": "tiny", "messages": MESSAGES, "response_format": _fmt(SCHEMA), "max_tokens": 40,
            "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 1}
    chunks = [c for c in _chunks(live, body) if c["choices"]]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop"  # the grammar completed: EOS, hidden from the text
    assert last["logprobs"] is None, last
    shown = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert shown and all(c["choices"][0]["logprobs"] is None or c["choices"][0]["logprobs"]["content"]
                         for c in chunks)  # no chunk carries an empty list
