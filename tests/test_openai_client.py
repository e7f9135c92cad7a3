"""The OpenAI-compatible routes driven by the official ``openai`` package (from PyPI) against a live
server: every call the issue lists, each answer checked against plain greedy decoding of the
tiny model, or against the model's own log-probabilities."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import plain_greedy
from test_server import LiveServer, model, tiny_tokenizer  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

# roles matter in this template: a system message starts with w30, so `developer` (sent to the
# template as `system`) is told apart from a user message
ROLE_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}w30 {% endif %}{{ m['content'] }} "
                 "{% endfor %}w2")


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    t.chat_template = ROLE_TEMPLATE
    return t


@pytest.fixture(scope="module")
def live(model, tok):
    # a fixed draft length: a seed reproduces a sample for the same draft schedule (docs/serving.md), and
    # the load-aware policy re-plans it from the costs it keeps measuring
    srv = LiveServer(model, tok, max_batch=4, policy="fixed")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(tok, messages) -> list[int]:
    msgs = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in messages]
    return list(tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"])


def greedy_text(model, tok, ids: list[int], n: int) -> tuple[list[int], str]:
    out = plain_greedy(model, ids, n, eos=[tok.eos_token_id])
    return out, tok.decode(out, skip_special_tokens=True)


def target_logprobs(model, ids: list[int], new: list[int]) -> list[float]:
    """log p(new[i] | ids + new[:i]) under the model itself."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1: len(ids) + len(new) - 1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1).tolist()


MSGS = [{"role": "user", "content": "w4 w5 w4 w5 w4"}]


def test_models_list_and_retrieve(client, live):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "spec-plugins"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_plain_system_developer_and_max_completion_tokens(client, model, tok):
    for first in ([], [{"role": "system", "content": "w9"}], [{"role": "developer", "content": "w9"}]):
        messages = first + MSGS
        want, text = greedy_text(model, tok, chat_ids(tok, messages), 7)
        r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=7)
        assert r.choices[0].message.content == text and r.usage.completion_tokens == len(want)
        assert r.usage.prompt_tokens == len(chat_ids(tok, messages))
    dev = [{"role": "developer", "content": "w9"}] + MSGS
    # the role reached the template
    assert chat_ids(tok, dev) != chat_ids(tok, [{"role": "user", "content": "w9"}] + MSGS)
    # the async client, several at once (rows of one batch): each equal to its solo output
    aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=60)
    jobs = [[{"role": "developer", "content": p}] + MSGS for p in ("w4 w5 w4", "w9 w8 w7 w9", "w17", "w3 w3 w3 w3")]

    async def main():
        return await asyncio.gather(*(aclient.chat.completions.create(model="tiny", messages=m, temperature=0,
                                                                       max_tokens=10) for m in jobs))

    for m, r in zip(jobs, asyncio.run(main())):
        assert r.choices[0].message.content == greedy_text(model, tok, chat_ids(tok, m), 10)[1]
    # max_completion_tokens wins over max_tokens; 0 is refused, by its own name
    r = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_completion_tokens=3,
                                       max_tokens=9)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=0, max_tokens=3)
    assert e.value.body["message"] == "`max_completion_tokens` must be strictly positive"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=500)
    assert "`messages` tokens + `max_completion_tokens` must be <= 128" in e.value.body["message"]


def test_chat_streaming_with_usage_chunk(client, model, tok):
    want, text = greedy_text(model, tok, chat_ids(tok, MSGS), 9)
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=9,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=9, stream=True))
    assert all(c.choices for c in plain) and "".join(c.choices[0].delta.content or "" for c in plain) == text


def test_chat_logprobs_and_top_logprobs(client, model, tok):
    ids = chat_ids(tok, MSGS)
    want, _ = greedy_text(model, tok, ids, 6)
    r = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in want]
    assert [c.logprob for c in content] == pytest.approx(target_logprobs(model, ids, want), abs=1e-4)
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token  # greedy: the argmax
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.bytes == list(c.token.encode())
    streamed = [e for ch in client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=6,
                                                           logprobs=True, top_logprobs=1, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_chat_n_choices_are_rows_with_seed_plus_index(client, model, tok):
    want, text = greedy_text(model, tok, chat_ids(tok, MSGS), 5)
    r = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == text for c in r.choices)
    assert r.usage.completion_tokens == 3 * len(want)
    kw = dict(model="tiny", messages=MSGS, temperature=1.0, max_tokens=12, n=2, seed=40)
    both = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert both[0] != both[1]  # seeds 40 and 41: two samples, not one copied
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == both  # reproducible
    parts: dict[int, str] = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
    assert [parts[0], parts[1]] == both


def test_response_format_text_and_refusals(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.UnprocessableEntityError) as e:  # json_object and json_schema: tests/test_server_grammar.py
        client.chat.completions.create(model="tiny", messages=MSGS, response_format={"type": "yaml"})
    assert "response_format" in e.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, n=5)
    assert "`n` must be <= 4" in e.value.body["message"]


def test_stop_strings_end_the_text_before_the_stop_streaming_or_not(client, model, tok):
    """OpenAI's clients expect the text to end where the stop string starts: not the stop, not the
    rest of the token that completed it, and (streaming) not the stop's beginning sent early."""
    _, text = greedy_text(model, tok, chat_ids(tok, MSGS), 12)
    words = text.split()
    stop = f"{words[3][-1]} {words[4][:2]}"  # spans two tokens: '5 w4' in '... w5 w4 ...'
    want = text[:text.find(stop)]
    assert want and stop not in want
    r = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=12, stop=[stop])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=MSGS, temperature=0, max_tokens=12, stop=[stop], stream=True) if c.choices]
    assert "".join(chunks) == want
    prompt = "w2 w3 w4 w2 w3"
    _, text = greedy_text(model, tok, tok(prompt)["input_ids"], 10)
    words = text.split()
    stop = f"{words[2][-1]} {words[3][:2]}"
    want = text[:text.find(stop)]
    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stop=stop).choices[0]
    assert c.text == want and c.finish_reason == "stop"
    assert "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, stop=stop, stream=True) if ch.choices) == want


def test_text_completions(client, model, tok):
    prompt = "w2 w3 w4 w2 w3"
    ids = tok(prompt)["input_ids"]
    want, text = greedy_text(model, tok, ids, 8)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.text == text and r.usage.completion_tokens == len(want) and r.usage.prompt_tokens == len(ids)
    assert c.logprobs.token_logprobs == pytest.approx(target_logprobs(model, ids, want), abs=1e-4)
    assert all(len(top) == 2 and tok_ in top for top, tok_ in zip(c.logprobs.top_logprobs, c.logprobs.tokens))
    # each offset is where the token's text starts (this word-level tokenizer puts the space before it)
    starts = [text[o:].lstrip().startswith(t) for o, t in zip(c.logprobs.text_offset, c.logprobs.tokens)]
    assert starts == [True] * len(want)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text == text
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                     echo=True).choices[0].text == prompt + text
    # OpenAI's default: 16 tokens
    assert client.completions.create(model="tiny", prompt=prompt, temperature=0).usage.completion_tokens == 16
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert streamed == text
    many = client.completions.create(model="tiny", prompt=[prompt, "w9 w8 w7"], max_tokens=4, temperature=0, n=2)
    first, second = (greedy_text(model, tok, tok(p)["input_ids"], 4)[1] for p in (prompt, "w9 w8 w7"))
    assert [(c.index, c.text) for c in many.choices] == [(0, first), (1, first), (2, second), (3, second)]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert e.value.body["message"] == "`max_tokens` must be strictly positive"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model="tiny", prompt=[5, 99], max_tokens=2)
    assert "`prompt`: token id 99 is not in this model's vocabulary" in e.value.body["message"]
