"""Hardening round 17, OpenAI's routes: /v1/completions' ``top_logprobs`` always hold the sampled
token, under its label with its own logprob (up to ``logprobs`` + 1 entries; ``logprobs: 0`` the
token alone), as OpenAI and vLLM answer (a sampled token outside the top N was missing); and a chat
message that gives no content (left out, null, no parts) is a 422 naming ``messages[i].content``,
by the Python API's own check, rather than an empty turn answered."""

from __future__ import annotations

import re

import pytest
from helpers import full_logits
from test_server import LiveServer, model, tok  # noqa: F401 (fixtures; skips without the server's packages)
from test_server_logprobs import completion, streamed

from spec_plugins.api_inputs import chat_messages

httpx = pytest.importorskip("httpx")

PROMPT = "w2 w3 w4 w2 w3"
SAMPLED = {"prompt": PROMPT, "max_tokens": 16, "temperature": 2.0, "seed": 7}


@pytest.fixture(scope="module")
def live(model, tok):  # noqa: F811
    srv = LiveServer(model, tok, policy="fixed")  # a fixed draft length: seeded samples reproduce
    yield srv
    srv.stop()


def check_sampled_in_top(model, tok, lp: dict, n: int) -> int:  # noqa: F811
    """Every token's ``top_logprobs`` dict holds the token under its label with its own logprob,
    and at most ``n`` + 1 entries; the others are the ``n`` likeliest, as a direct forward ranks
    them. Returns how many tokens were sampled from outside the top ``n``."""
    ids, outside = tok(PROMPT)["input_ids"], 0
    assert len(lp["top_logprobs"]) == len(lp["tokens"]) > 0
    for i, (label, own, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        assert label in top and top[label] == own, (i, label, own, top)
        assert len(top) <= n + 1, (i, top)
        best = full_logits(model, ids).log_softmax(-1).topk(n).values.tolist()
        if len(top) == n + 1:  # the sampled token is not among the n likeliest
            outside += 1
            assert [v for k, v in top.items() if k != label] == pytest.approx(best, abs=1e-4), (i, top)
        ids.append(tok.convert_tokens_to_ids(label))
    return outside


@pytest.mark.parametrize("n", [1, 2])
def test_top_logprobs_hold_the_sampled_token_outside_the_top_n(live, model, tok, n):  # noqa: F811
    """temperature 2 draws tokens far down the ranking: each is in its own dict beside the top n,
    streamed and not (the dict held the top n only)."""
    body = dict(SAMPLED, logprobs=n)
    whole = completion(live, body)["logprobs"]
    assert check_sampled_in_top(model, tok, whole, n) > 0  # the case under test happened
    _, lists = streamed(live, body)
    assert check_sampled_in_top(model, tok, lists, n) > 0


def test_logprobs_0_gives_each_sampled_token_alone(live):
    """OpenAI's and vLLM's ``logprobs: 0``: one entry per token, itself (it was null)."""
    for lp in (completion(live, dict(SAMPLED, logprobs=0))["logprobs"], streamed(live, dict(SAMPLED, logprobs=0))[1]):
        assert lp["tokens"]
        assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]


# ---- a message with no content is refused by name ------------------------------------------------
CALL = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
NO_CONTENT = [
    ([{"role": "user"}], "messages[0].content is missing"),
    ([{"role": "system"}, {"role": "user", "content": "w2"}], "messages[0].content is missing"),
    ([{"role": "user", "content": None}], "messages[0].content is null"),
    ([{"role": "user", "content": []}], "messages[0].content is an empty list"),
    ([{"role": "system", "content": "w2"}, {"role": "tool", "content": None}], "messages[1].content is null"),
    ([{"role": "user", "content": "w2"}, {"role": "assistant", "content": None}],
     "messages[1].content is null: give a string or a list of text parts (an assistant turn may leave it out only "
     "where it holds a non-empty tool_calls list or a function_call object)"),
    ([{"role": "user", "content": "w2"}, {"role": "assistant"}], "messages[1].content is missing"),
    ([{"role": "user", "content": "w2"}, {"role": "assistant", "tool_calls": []}], "messages[1].content is missing"),
    # calls that are not calls: a string for the list, a non-object function_call
    ([{"role": "user", "content": "w2"}, {"role": "assistant", "tool_calls": "x"}], "messages[1].content is missing"),
    ([{"role": "user", "content": "w2"}, {"role": "assistant", "content": None, "function_call": {}}],
     "messages[1].content is null"),
    ([{"role": "user", "content": "w2"}, {"role": "assistant", "function_call": False}],
     "messages[1].content is missing"),
    ([{"role": "user", "content": "w2"}, {"role": "assistant", "content": [], "tool_calls": CALL}],
     "messages[1].content is an empty list"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("msgs, named", NO_CONTENT, ids=[f"case{i}" for i in range(len(NO_CONTENT))])
def test_a_chat_message_without_content_is_a_422_naming_it(live, msgs, named, stream):
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "stream": stream},
                   timeout=60)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation" and named in err["message"], r.text
    with pytest.raises(ValueError, match=re.escape(named)):
        chat_messages(msgs)  # the Python API refuses it alike (one check)


@pytest.mark.parametrize("msgs", [
    [{"role": "user", "content": ""}],  # an empty string is text, as at OpenAI
    [{"role": "user", "content": "w2"}, {"role": "assistant", "tool_calls": CALL},
     {"role": "tool", "content": "w3", "tool_call_id": "call_1"}],
    [{"role": "user", "content": "w2"}, {"role": "assistant", "content": None, "tool_calls": CALL},
     {"role": "tool", "content": "w3", "tool_call_id": "call_1"}],
    [{"role": "user", "content": "w2"}, {"role": "assistant", "content": None, "function_call": {"name": "f"}},
     {"role": "function", "content": "w3", "name": "f"}],
])
def test_an_assistant_turn_holding_tool_calls_may_leave_content_out(live, msgs):
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert [m["role"] for m in chat_messages(msgs)] == [m["role"] for m in msgs]
