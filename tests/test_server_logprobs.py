"""Logprobs and seeds at the edges of the server's APIs: tokens that end inside a UTF-8 character
(a byte-level vocabulary, one token per byte) in ``/v1/completions``' legacy layout, streamed and
not, and seeds over the whole 64-bit range each API gives them (TGI: u64, OpenAI: int64)."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_llama
from helpers import full_logits, plain_greedy
from test_server import LiveServer  # skips this module without the server's packages
from test_text import byte_tokenizer

httpx = pytest.importorskip("httpx")

PROMPT = "猫が好き"  # three-byte characters: the model's bytes often start or end inside one


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(vocab=len(tok), seed=5)


@pytest.fixture(scope="module")
def live(model, tok):
    srv = LiveServer(model, tok, policy="fixed")  # a fixed draft length: seeded samples reproduce
    yield srv
    srv.stop()


def token_bytes(tok, t: int) -> bytes:
    """The byte a token of the byte-level vocabulary stands for (GPT-2's byte-to-character map)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in tok.convert_ids_to_tokens(t))


def openai_label(b: bytes) -> str:
    """OpenAI's legacy name of a token: its text, or ``bytes:\\xNN...`` when it is not UTF-8 text."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def completion(live, body: dict) -> dict:
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed(live, body: dict) -> tuple[str, dict[str, list]]:
    """The streamed text and the chunks' logprobs lists, concatenated in order."""
    text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", live.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            for ch in json.loads(line[5:])["choices"]:
                text += ch["text"]
                for k, v in (ch["logprobs"] or {}).items():
                    lists[k] += v
    return text, lists


def test_top_logprobs_keep_every_alternative_that_ends_inside_a_character(live, model, tok):
    """Each position's five alternatives, as a direct forward's log-softmax ranks them, each under
    its own key: pieces of characters no longer all collapse into one U+FFFD entry."""
    ids = tok(PROMPT)["input_ids"]
    want = plain_greedy(model, ids, 8)
    c = completion(live, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 5})
    lp = c["logprobs"]
    partial_alternatives = 0
    for i, t in enumerate(want):
        ref = full_logits(model, ids + want[:i]).log_softmax(-1)
        top = ref.topk(5)
        expect = {openai_label(token_bytes(tok, int(a))): float(v) for v, a in zip(top.values, top.indices)}
        assert len(expect) == 5  # one token per byte: five distinct labels
        assert lp["top_logprobs"][i].keys() == expect.keys(), i
        assert list(lp["top_logprobs"][i].values()) == pytest.approx(list(expect.values()), abs=1e-4)
        assert lp["tokens"][i] == openai_label(token_bytes(tok, t))
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[t]), abs=1e-4)
        partial_alternatives += sum(k.startswith("bytes:") for k in expect) >= 2
    assert partial_alternatives > 0  # the case that collided: several pieces of characters at one position


@pytest.mark.parametrize("seed,max_tokens", [(0, 6), (1, 5), (3, 6), (5, 7)])
def test_streamed_offsets_equal_the_answers_when_the_text_ends_inside_a_character(live, seed, max_tokens):
    """The stream's text and logprobs (offsets included) equal the non-streamed answer's; each case
    ends in a character its tokens never completed (U+FFFD, sent at the end)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "seed": seed, "temperature": 1.0, "logprobs": 5}
    answer = completion(live, body)
    text, lists = streamed(live, body)
    assert text == answer["text"] and text.endswith("\ufffd")
    assert lists["text_offset"] == answer["logprobs"]["text_offset"]
    assert lists == answer["logprobs"]
    assert max(lists["text_offset"]) < len(text)


def generate(live, seed: int) -> httpx.Response:
    return httpx.post(live.url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 8, "do_sample": True, "seed": seed, "details": True}}, timeout=60)


def test_tgi_takes_every_u64_seed_as_its_low_63_bits(live):
    """TGI's seed is a u64: 2**63 and above sample as the seed of their low 63 bits (the sampler's
    range), which ``details.seed`` reports; past 2**64 - 1 or below 0 the message gives the range."""
    for seed, same in [(2**64 - 1, 2**63 - 1), (2**63, 0), (2**63 + 12345, 12345)]:
        r, ref = generate(live, seed), generate(live, same)
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"] == ref.json()["generated_text"]
        assert r.json()["details"]["seed"] == same
    assert generate(live, 1).json()["generated_text"] != generate(live, 2).json()["generated_text"]
    for bad in (2**64, -1):
        r = generate(live, bad)
        assert r.status_code == 422
        assert r.json()["error"] == f"`seed` must be between 0 and {2**64 - 1}. Given: {bad}"


def test_openai_takes_every_int64_seed_as_its_low_63_bits(live):
    """OpenAI's seed is an int64, negative ones included: -1 samples as 2**63 - 1 (the same 64-bit
    pattern as TGI's 2**64 - 1); past the int64 range the message gives it."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    for seed, same in [(-1, 2**63 - 1), (-(2**63), 0)]:
        assert completion(live, dict(body, seed=seed))["text"] == completion(live, dict(body, seed=same))["text"]
    for bad in (2**63, -(2**63) - 1):
        r = httpx.post(live.url + "/v1/completions", json=dict(body, seed=bad), timeout=60)
        assert r.status_code == 422
        assert r.json()["error"]["message"] == f"`seed` must be between {-(2**63)} and {2**63 - 1}. Given: {bad}"


def byte_fallback_tokenizer():
    """A SentencePiece-style vocabulary of byte-fallback pieces only (``<0xE7>``, as gemma's):
    every character's bytes are tokens of their own, named by the pieces, not a byte alphabet."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def test_byte_fallback_pieces_are_named_by_their_bytes():
    """Pieces like ``<0xE7>`` decode alone to U+FFFD: the legacy layout names them ``bytes:\\xe7``
    too, each alternative under its own key (they collapsed into one U+FFFD entry)."""
    tok = byte_fallback_tokenizer()
    model = tiny_llama(vocab=len(tok), seed=6)
    srv = LiveServer(model, tok, policy="fixed")
    try:
        ids = tok(PROMPT)["input_ids"]
        want = plain_greedy(model, ids, 6)
        lp = completion(srv, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 5})["logprobs"]
    finally:
        srv.stop()
    for i, t in enumerate(want):
        top = full_logits(model, ids + want[:i]).log_softmax(-1).topk(5)
        expect = [openai_label(bytes([int(a) - 1])) for a in top.indices]  # piece <0xNN> is id NN + 1
        assert list(lp["top_logprobs"][i]) == expect, i
        assert lp["tokens"][i] == openai_label(bytes([t - 1]))
