"""OpenAI routes: ``text_offset`` from each token's own text (a stop string that may still match
holds text back from the stream, never from the offsets), streamed or not; and a field sent as
null taken as one left out, as OpenAI takes it (``max_tokens`` 16 on /v1/completions)."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_llama

# test_server skips this module without the server's packages
from test_server import LiveServer, tiny_tokenizer

from spec_plugins.server.openai_schemas import ChatRequest, CompletionRequest

httpx = pytest.importorskip("httpx")

PROMPT = "w2 w3 w4 w2 w3"  # greedy: w5 w8 w14 w5 w8 w14 ... (no EOS within 20 tokens)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def live(tok):
    srv = LiveServer(tiny_llama(seed=3), tok, policy="fixed")  # a fixed draft length: seeded samples reproduce
    yield srv
    srv.stop()


def answer(live, body: dict, route: str = "/v1/completions") -> dict:
    r = httpx.post(live.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(live, body: dict) -> dict[int, tuple[str, list[int]]]:
    """Per choice index: the streamed text and the chunks' ``text_offset`` lists, concatenated."""
    out: dict[int, tuple[str, list[int]]] = {}
    with httpx.stream("POST", live.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            for ch in json.loads(line[5:])["choices"]:
                text, offs = out.get(ch["index"], ("", []))
                out[ch["index"]] = (text + ch["text"], offs + (ch["logprobs"] or {}).get("text_offset", []))
    return out


def reference_offsets(tok, labels: list[str], text: str) -> list[int]:
    """Where each token's text starts, from the tokenizer alone: the length of the decoded tokens
    before it, clipped to the completion's text (which a matched stop string ends)."""
    ids = tok.convert_tokens_to_ids(labels)
    return [min(len(tok.decode(ids[:k], skip_special_tokens=True)), len(text)) for k in range(len(ids))]


def test_a_stop_string_that_never_matches_moves_no_offset(live, tok):
    """A stop string whose start ends some tokens' text (held back from the stream until the next
    token rules it out) changes neither the text nor any token's offset."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    plain = answer(live, body)["choices"][0]
    labels = plain["logprobs"]["tokens"]
    assert plain["logprobs"]["text_offset"] == reference_offsets(tok, labels, plain["text"])
    stop = f"{labels[2]} w99"  # w99 is no word of the vocabulary: never matches; "w14" is its start
    assert labels.count(labels[2]) >= 3 and stop not in plain["text"]
    held = answer(live, dict(body, stop=stop))["choices"][0]
    assert held["text"] == plain["text"] and held["finish_reason"] == "length"
    assert held["logprobs"] == plain["logprobs"]
    text, offs = streamed(live, dict(body, stop=stop))[0]
    assert text == plain["text"] and offs == plain["logprobs"]["text_offset"]


def test_offsets_after_a_matched_stop_string_are_clipped_to_the_text(live, tok):
    """A stop string that matches ends the text before it; its tokens' offsets end there too,
    streamed as answered."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    labels = answer(live, body)["choices"][0]["logprobs"]["tokens"]
    stop = f"{labels[1]} {labels[2]}"  # the text ends before the second token's word
    got = answer(live, dict(body, stop=stop))["choices"][0]
    assert got["finish_reason"] == "stop" and stop not in got["text"]
    lp = got["logprobs"]
    assert lp["tokens"] == labels[:3]
    assert lp["text_offset"] == reference_offsets(tok, lp["tokens"], got["text"])
    assert lp["text_offset"][-1] == len(got["text"])  # clipped: its own text starts past the end
    text, offs = streamed(live, dict(body, stop=stop))[0]
    assert text == got["text"] and offs == lp["text_offset"]


def test_sampled_choices_stream_the_answers_offsets(live, tok):
    """Each of ``n`` seeded choices, with a stop string of theirs that never matches: the streamed
    offsets are the answer's, and the answer's are the tokenizer's."""
    body = {"prompt": "w9 w8 w7", "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 2, "logprobs": 2,
            "stop": ["w5 w99", "w8 w99", "w14 w99"]}
    choices = answer(live, body)["choices"]
    stream = streamed(live, body)
    for ch in choices:
        offs = ch["logprobs"]["text_offset"]
        assert offs == reference_offsets(tok, ch["logprobs"]["tokens"], ch["text"])
        assert stream[ch["index"]] == (ch["text"], offs)


def comparable(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("id", "created")}


COMPLETION = {"prompt": PROMPT, "seed": 7, "temperature": 0.9, "max_tokens": 6}
CHAT = {"messages": [{"role": "user", "content": "w9 w8 w7"}], "seed": 7, "temperature": 0.9, "max_tokens": 6}


def optional_fields(model) -> list[str]:
    return sorted(name for name, f in model.model_fields.items() if not f.is_required())


@pytest.mark.parametrize("route,base,field",
                         [("/v1/completions", COMPLETION, f) for f in optional_fields(CompletionRequest)]
                         + [("/v1/chat/completions", CHAT, f) for f in optional_fields(ChatRequest)])
def test_a_null_field_is_a_field_left_out(live, route, base, field):
    """Every optional field of both routes, sent as null, answers as if it were not sent (OpenAI's
    reading; clients send their unset fields as null). Without a seed, greedy: comparable."""
    absent = {k: v for k, v in (base if field != "seed" else dict(base, temperature=0)).items() if k != field}
    assert comparable(answer(live, dict(absent, **{field: None}), route)) == comparable(answer(live, absent, route))


def test_null_max_tokens_stream_and_echo_on_completions(live):
    """``max_tokens: null`` is OpenAI's default 16 (not as many as fit); ``stream: null`` answers
    in one JSON body and ``echo: null`` leaves the prompt out."""
    got = answer(live, {"prompt": PROMPT, "temperature": 0, "max_tokens": None, "stream": None, "echo": None})
    assert got["usage"]["completion_tokens"] == 16
    assert got["choices"][0]["finish_reason"] == "length"
    assert not got["choices"][0]["text"].startswith(PROMPT)


@pytest.mark.parametrize("route,field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_a_null_required_field_is_refused_naming_it(live, route, field):
    body = dict(COMPLETION if field == "prompt" else CHAT, **{field: None})
    r = httpx.post(live.url + route, json=body, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(f"`{field}")
