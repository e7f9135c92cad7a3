"""OpenAI routes, round 11.

Logprobs of a SentencePiece vocabulary whose decoder strips the text's leading space (Llama 2,
Mistral: ``Strip(" ", 1, 0)``; or a ``Metaspace`` decoder that prepends one): a token decoded
alone lost its own space, so the legacy ``tokens`` and ``top_logprobs`` keys and chat's
``token``/``bytes`` no longer joined to the text while ``text_offset`` counted the space. Each token
is named by the text it adds where it stands, checked against decoding the whole prefix.

``logit_bias`` keys: only ASCII decimal ids (``str.isdigit`` took "٣٠" as token 30), and two keys
naming one token ("5" and "05") are refused instead of one bias silently lost.
"""

from __future__ import annotations

import json

import pytest
from conftest import tiny_llama
from helpers import full_logits
from test_server import LiveServer, tiny_tokenizer
from test_server_logprobs import byte_fallback_tokenizer
from test_text import byte_tokenizer

from spec_plugins.server.controls import openai_logit_bias
from spec_plugins.server.openai_routes import strips_start

httpx = pytest.importorskip("httpx")  # test_server skips this module without the server's packages

WORDS = [f"w{i}" for i in range(2, 32)]
PROMPT = "w2 w3 w4 w2 w3"


def metaspace_tokenizer(decoder: str, byte_pieces: int = 0):
    """A Llama-2-style vocabulary (``▁w2`` .. ``▁w31``, ``</s>``, then ``byte_pieces`` byte-fallback
    pieces ``<0x80>``..), pre-tokenized by ``Metaspace``; ``decoder`` "strip": Llama 2's / Mistral's
    tokenizer.json decoder, "metaspace": the decoder newer conversions write; either drops the
    text's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1} | {"\u2581" + w: i + 2 for i, w in enumerate(WORDS)}
    vocab |= {f"<0x{0x80 + b:02X}>": 32 + b for b in range(byte_pieces)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.decoder = (decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)]) if decoder == "strip"
                  else decoders.Metaspace(replacement="\u2581", prepend_scheme="always"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w2")


def test_strips_start_is_only_the_decoders_that_drop_the_leading_space():
    assert strips_start(metaspace_tokenizer("strip")) and strips_start(metaspace_tokenizer("metaspace"))
    # a byte-level vocabulary, a byte-fallback one without Strip, and one with no decoder keep their labels
    assert not any(strips_start(t) for t in (byte_tokenizer(), byte_fallback_tokenizer(), tiny_tokenizer()))


def own_text(tok, prefix: list[int], t: int) -> str:
    """Reference: what ``t`` adds to the decoded completion ``prefix`` (special tokens: their name)."""
    if t in tok.all_special_ids:
        return tok.decode([t], skip_special_tokens=False)
    return tok.decode(prefix + [t])[len(tok.decode(prefix)):]


def post(srv, route: str, body: dict) -> dict:
    r = httpx.post(srv.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(srv, route: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", srv.url + route, json=dict(body, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                out.extend(json.loads(line[5:])["choices"])
    return out


@pytest.fixture(scope="module", params=["strip", "metaspace"])
def served(request):
    tok = metaspace_tokenizer(request.param)
    model = tiny_llama(vocab=len(tok), seed=4, sharpness=8.0)  # greedy: 8 words, no </s>, prompt or chat
    srv = LiveServer(model, tok, policy="fixed")
    yield srv, tok, model
    srv.stop()


def test_legacy_tokens_and_top_logprobs_keep_each_tokens_own_space(served):
    srv, tok, model = served
    ids = tok(PROMPT)["input_ids"]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 5}
    ch = post(srv, "/v1/completions", body)["choices"][0]
    lp, text = ch["logprobs"], ch["text"]
    assert len(lp["tokens"]) >= 3 and " " in text
    assert "".join(lp["tokens"]) == text  # the space of every word after the first is its token's
    out = tok(text, add_special_tokens=False)["input_ids"]  # each word is one token of this vocabulary
    for k, t in enumerate(out):
        assert lp["tokens"][k] == own_text(tok, out[:k], t)
        assert lp["text_offset"][k] == len(tok.decode(out[:k]))
        top = full_logits(model, ids + out[:k]).log_softmax(-1).topk(5)
        want = {own_text(tok, out[:k], int(a)): float(v) for v, a in zip(top.values, top.indices)}
        assert lp["top_logprobs"][k].keys() == want.keys(), k
        assert list(lp["top_logprobs"][k].values()) == pytest.approx(list(want.values()), abs=1e-4)
    got = events(srv, "/v1/completions", body)
    assert [t for c in got if c["logprobs"] for t in c["logprobs"]["tokens"]] == lp["tokens"]
    assert [t for c in got if c["logprobs"] for t in c["logprobs"]["top_logprobs"]] == lp["top_logprobs"]


def test_chat_tokens_and_bytes_join_to_the_content(served):
    srv, tok, _ = served
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    m = post(srv, "/v1/chat/completions", body)["choices"][0]
    content, entries = m["message"]["content"], m["logprobs"]["content"]
    assert len(entries) >= 3 and " " in content
    assert "".join(e["token"] for e in entries) == content
    assert bytes(b for e in entries for b in e["bytes"]) == content.encode()
    out = tok(content, add_special_tokens=False)["input_ids"]
    for k, e in enumerate(entries):
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the emitted token leads, named alike
        for alt in e["top_logprobs"]:
            a = tok.convert_tokens_to_ids(alt["token"].replace(" ", "\u2581"))
            if a != tok.unk_token_id:
                assert alt["token"] == own_text(tok, out[:k], a) and alt["bytes"] == list(alt["token"].encode())
    streamed = [e for c in events(srv, "/v1/chat/completions", body) if c["logprobs"]
                for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]


def test_alternatives_after_a_byte_fallback_piece_keep_their_space():
    """Forced (``logit_bias``) to emit the byte piece ``<0x80>`` (a lone continuation byte, U+FFFD
    in the text), the row's tokens are named by their byte and every word among the alternatives
    after one by the text it adds there: its space included."""
    tok = metaspace_tokenizer("strip", byte_pieces=32)
    srv = LiveServer(tiny_llama(vocab=len(tok), seed=4, sharpness=8.0), tok, policy="fixed")
    try:
        lp = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 5,
                                           "logit_bias": {"32": 100}})["choices"][0]["logprobs"]
    finally:
        srv.stop()
    assert lp["tokens"] == ["bytes:\\x80"] * 4
    words = 0
    for k, top in enumerate(lp["top_logprobs"]):
        for key in top:
            a = tok.convert_tokens_to_ids("\u2581" + key.strip())
            if not key.startswith("bytes:") and a != tok.unk_token_id:
                assert key == own_text(tok, [32] * k, a) == (" " if k else "") + key.strip(), (k, key)
                words += k > 0
    assert words >= 3


# ---- logit_bias keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["\u0663\u0660", "\u00b2", "\uff13", "3.0", "+3", " 3", "3 ", "0x3", ""])
def test_logit_bias_keys_must_be_ascii_decimal_token_ids(key):
    with pytest.raises(ValueError, match="`logit_bias` keys must be decimal token ids") as err:
        openai_logit_bias({key: 100})
    assert repr(key) in str(err.value)


@pytest.mark.parametrize("keys", [("5", "05"), ("0", "-0"), ("7", "007")])
def test_two_logit_bias_keys_naming_one_token_are_refused(keys):
    with pytest.raises(ValueError, match=f"keys {keys[0]!r} and {keys[1]!r} both name token {int(keys[0])}"):
        openai_logit_bias({keys[0]: 10, keys[1]: -10})


def test_logit_bias_takes_ascii_ids():
    assert openai_logit_bias({"30": 100, "-1": -5, "7": 0.5}) == ((30, 100.0), (-1, -5.0), (7, 0.5))


def test_a_unicode_digit_key_is_a_422_naming_it():
    tok = tiny_tokenizer()
    srv = LiveServer(tiny_llama(seed=3), tok, policy="fixed")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                         "logit_bias": {"\u0663\u0660": 100}}, timeout=60)
        dup = httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "logit_bias": {"5": 1, "05": 2}},
            timeout=60)
    finally:
        srv.stop()
    assert r.status_code == 422 and "keys must be decimal token ids" in r.json()["error"]["message"]
    assert "\u0663\u0660" in r.json()["error"]["message"]
    assert dup.status_code == 422 and "both name token 5" in dup.json()["error"]["message"]
