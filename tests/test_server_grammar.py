"""Structured outputs and the sampling options clients send, on both routes of a live server.

With the official ``openai`` client: ``response_format`` ``json_schema`` with ``strict``, streamed
and not, and a tool-call-shaped schema: every finished output parses and validates against its
schema, and the streamed text equals the whole answer. TGI's ``grammar`` (json, regex) holds the
output; ``logit_bias`` -100 keeps a token out; penalties change the output as the engine's
processors do. Bad grammars and values are 422s naming the problem, on both routes, and the server
keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from grammar_helpers import tiny_tokenizer
from test_server import LiveServer

from conftest import tiny_llama
from spec_plugins.proposers.ngram import NgramProposer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

COMPACT = {"whitespace_flexible": False}  # llguidance's option: no free whitespace, so tiny models finish
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["abc", "xy"]}, "b": {"enum": [12, 3]}},
          "required": ["a", "b"], "additionalProperties": False, "x-guidance": COMPACT}
TOOL = {"type": "object", "properties": {"name": {"const": "get_city"}, "arguments": {
    "type": "object", "properties": {"c": {"enum": ["xy", "abc"]}}, "required": ["c"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": COMPACT}
MESSAGES = [{"role": "user", "content": "abc"}]


LETTERS = "egimnrstu_"  # for "name", "arguments" and "get_city": a tool call's keys and name


def _tok():
    tok = tiny_tokenizer(LETTERS)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


@pytest.fixture(scope="module")
def live():
    tok = _tok()
    srv = LiveServer(tiny_llama(vocab=len(tok), seed=3, sharpness=2.0), tok, policy="fixed",
                     proposer=NgramProposer(NgramProposer.Config(num_draft_tokens=4)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _fmt(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}


def _valid(text, schema):
    jsonschema.validate(json.loads(text), {k: v for k, v in schema.items() if k != "x-guidance"})


@pytest.mark.parametrize("schema", [SCHEMA, TOOL], ids=["extraction", "tool-call"])
def test_json_schema_strict_streamed_and_not(client, schema):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=_fmt(schema),
                                           max_tokens=40, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    _valid(choice.message.content, schema)
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=_fmt(schema),
                                            max_tokens=40, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_json_object_and_sampled_outputs_parse(client):
    for seed in range(4):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=_fmt(SCHEMA),
                                             max_tokens=40, temperature=1.0, seed=seed)
        _valid(out.choices[0].message.content, SCHEMA)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
                                         max_tokens=12, temperature=0)
    assert out.choices[0].message.content.startswith("{")


def test_a_grammar_that_cannot_finish_in_time_ends_with_length(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=_fmt(SCHEMA),
                                         max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"


def test_tgi_grammar_json_and_regex(live):
    for grammar, check in [({"type": "regex", "value": "(ab|xy)+(12|3)"},
                            lambda t: re.fullmatch("(ab|xy)+(12|3)", t)),
                           ({"type": "json", "value": SCHEMA}, lambda t: _valid(t, SCHEMA) or True)]:
        r = httpx.post(live.url + "/generate", json={"inputs": "abc", "parameters": {
            "grammar": grammar, "max_new_tokens": 40, "details": True}}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["details"]["finish_reason"] == "eos_token"
        assert check(body["generated_text"].removesuffix("<eos>")), body


def test_logit_bias_keeps_a_token_out_and_penalties_change_the_output(client):
    plain = client.completions.create(model="tiny", prompt="abcab", max_tokens=16, temperature=0)
    text = plain.choices[0].text
    tok = _tok()
    ids = tok.encode(text)
    banned = max(set(ids), key=ids.count)
    biased = client.completions.create(model="tiny", prompt="abcab", max_tokens=16, temperature=0,
                                       logit_bias={str(banned): -100})
    assert banned not in tok.encode(biased.choices[0].text)
    pen = client.completions.create(model="tiny", prompt="abcab", max_tokens=16, temperature=0,
                                    frequency_penalty=2.0, presence_penalty=2.0)
    assert pen.choices[0].text != text


@pytest.mark.parametrize("route,body,message", [
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": _fmt({"type": "strin"})}, "invalid json schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "json_schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"99": 1}}, "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"3": 101}}, "between -100 and 100"),
    ("/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "abc", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/generate", {"inputs": "abc", "parameters": {"grammar": {"type": "regex", "value": "a(?=b)"}}}, "look-around"),
    ("/generate", {"inputs": "abc", "parameters": {"grammar": {"type": "regex", "value": "zzz"}}},
     "cannot match any output"),
    ("/generate", {"inputs": "abc", "parameters": {"grammar": {"type": "ebnf", "value": "x"}}}, "not supported"),
    ("/generate", {"inputs": "abc", "parameters": {"grammar": "json"}}, "`grammar` must be an object"),
    ("/generate", {"inputs": "abc", "parameters": {"frequency_penalty": 2.5}}, "frequency_penalty"),
])
def test_bad_grammars_and_values_are_422_naming_them(live, route, body, message):
    r = httpx.post(live.url + route, json=body, timeout=60)
    assert r.status_code == 422, (r.status_code, r.text)
    err = r.json()["error"]["message"] if route.startswith("/v1/") else r.json()["error"]  # OpenAI's shape on /v1
    assert message in err, r.json()
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_a_grammar_with_no_way_on_fails_the_row_naming_why(live):
    """Regex ``abz`` where no token spells "z": after "ab" the grammar has no way on. The row
    fails (500 naming the cause), never a finished output, and the server keeps serving."""
    r = httpx.post(live.url + "/generate", json={"inputs": "abc", "parameters": {
        "grammar": {"type": "regex", "value": "abz"}, "max_new_tokens": 12, "details": True}}, timeout=60)
    assert r.status_code == 500, (r.status_code, r.text)
    assert "no token of this model's vocabulary can continue the grammar" in r.json()["error"], r.json()
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_a_stream_carries_what_the_grammar_took_before_it_failed(live):
    """Regex ``cxyabz``: the grammar takes "c", "xy", "ab", then has no way on. Plain decoding
    streams those tokens one a round before the error event; a speculative round carries several
    to the failure at once, and they must stream too, before the error, never dropped."""
    events: list = []
    _events_of(live.url, {"inputs": "abc", "parameters": {
        "grammar": {"type": "regex", "value": "cxyabz"}, "max_new_tokens": 12}}, events)
    assert "error" in events[-1], events
    assert "".join(e["token"]["text"] for e in events[:-1]) == "cxyab", events


def _events_of(url: str, body: dict, out: list) -> None:
    """The SSE events of one /generate_stream request, appended to ``out``."""
    with httpx.stream("POST", url + "/generate_stream", timeout=120, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
