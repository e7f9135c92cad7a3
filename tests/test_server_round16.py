"""Hardening round 16, TGI's routes: a `truncate` over --max-input-tokens is a 422 in TGI's words
(it was taken as no truncation), an invalid `best_of`/`typical_p` is refused as invalid before the
"not supported" rule (`best_of: 0` was "not supported"), and POST /tokenize answers TGI's token
list with byte offsets under the same input limits as /generate (it was a 404)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_server import LiveServer, model, solo, tok  # noqa: F401 (fixtures)

httpx = pytest.importorskip("httpx")
text_generation = pytest.importorskip("text_generation")

from spec_plugins.server import requests  # noqa: E402
from spec_plugins.server.schemas import ApiError, GenerateParameters  # noqa: E402

MAX_INPUT = 48  # LiveServer's --max-input-tokens


@pytest.fixture(scope="module")
def live(model, tok):  # noqa: F811
    srv = LiveServer(model, tok, max_batch=2, max_input=MAX_INPUT)
    yield srv
    srv.stop()


def _post(live, route: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + route, json=body, timeout=60)


# ---- truncate is bounded by --max-input-tokens ---------------------------------------------------
@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/tokenize"])
@pytest.mark.parametrize("truncate", [MAX_INPUT + 1, 10**6, 0, -3])
def test_a_truncate_outside_1_to_the_input_limit_is_a_422_in_tgis_words(live, route, truncate):
    r = _post(live, route, {"inputs": "w2 w3", "parameters": {"truncate": truncate, "max_new_tokens": 2}})
    assert r.status_code == 422, r.text
    assert r.json() == {"error": f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: {truncate}",
                        "error_type": "validation"}


def test_the_text_generation_client_gets_a_validation_error_for_a_truncate_over_the_limit(live, model, tok):  # noqa: F811
    client = text_generation.Client(live.url, timeout=60)
    with pytest.raises(text_generation.errors.ValidationError, match=r"`truncate` must be strictly positive and "
                                                                     rf"less than {MAX_INPUT}\. Given: 100"):
        client.generate("w2 w3 w4", max_new_tokens=2, truncate=100)
    # the limit itself is taken (TGI's rule), and cuts a longer input to its last 48 tokens
    long = " ".join(["w5"] * 60 + ["w2", "w3"])
    r = client.generate(long, max_new_tokens=2, truncate=MAX_INPUT)
    assert [t.id for t in r.details.tokens] == solo(model, tok, " ".join(long.split()[-MAX_INPUT:]), 2)


# ---- an invalid value is invalid, not "not supported" --------------------------------------------
@pytest.mark.parametrize("params,message", [
    ({"best_of": 0}, "`best_of` must be > 0 and <= 1. Given: 0"),
    ({"best_of": -2}, "`best_of` must be > 0 and <= 1. Given: -2"),
    ({"typical_p": 1.5}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": -0.5}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"best_of": 2}, "`best_of` is not supported by this server (spec-plugins); leave it unset"),
    ({"typical_p": 0.5}, "`typical_p` is not supported by this server (spec-plugins); leave it unset"),
])
def test_an_invalid_best_of_or_typical_p_is_refused_as_invalid_before_unsupported(live, params, message):
    r = _post(live, "/generate", {"inputs": "w2", "parameters": {"max_new_tokens": 2, **params}})
    assert r.status_code == 422 and r.json() == {"error": message, "error_type": "validation"}, r.text


def test_neutral_best_of_and_typical_p_are_still_accepted():
    assert GenerateParameters(best_of=1, typical_p=1.0).best_of == 1
    with pytest.raises(ValueError, match=r"`best_of` must be > 0 and <= 1\. Given: 0"):
        GenerateParameters(best_of=0)


# ---- POST /tokenize --------------------------------------------------------------------------------
def test_tokenize_answers_tgis_token_list_with_byte_offsets(live, tok):  # noqa: F811
    text = "w2  w17 é w3"  # é is one character, two UTF-8 bytes: w3's offsets are past it in bytes
    r = _post(live, "/tokenize", {"inputs": text})
    assert r.status_code == 200, r.text
    assert r.json() == [{"id": tok.convert_tokens_to_ids("w2"), "text": "w2", "start": 0, "stop": 2},
                        {"id": tok.convert_tokens_to_ids("w17"), "text": "w17", "start": 4, "stop": 7},
                        {"id": tok.unk_token_id, "text": "é", "start": 8, "stop": 10},
                        {"id": tok.convert_tokens_to_ids("w3"), "text": "w3", "start": 11, "stop": 13}]
    assert [t["id"] for t in r.json()] == tok(text)["input_ids"]  # the ids /generate reads
    raw = text.encode()
    assert all(raw[t["start"]:t["stop"]].decode() == t["text"] for t in r.json())


def test_tokenize_applies_truncate_and_the_input_limits_as_generate_does(live, tok):  # noqa: F811
    # a long text with truncate: only its tail is tokenized, offsets still index the whole text
    text = "w9 " * 200_000 + "w2 w3 w4"
    r = _post(live, "/tokenize", {"inputs": text, "parameters": {"truncate": 3}})
    assert r.status_code == 200, r.text
    n = len(text)
    assert r.json() == [{"id": tok.convert_tokens_to_ids(w), "text": w, "start": n - 8 + 3 * i,
                         "stop": n - 6 + 3 * i} for i, w in enumerate(["w2", "w3", "w4"])]
    # over --max-input-tokens: /generate's 422, on /tokenize too (short text and long text)
    for words in (60, 100_000):
        body = {"inputs": " ".join(["w3"] * words), "parameters": {"max_new_tokens": 1}}
        got = _post(live, "/tokenize", body)
        want = _post(live, "/generate", body)
        assert got.status_code == want.status_code == 422, got.text
        assert got.json() == want.json() and f"`inputs` tokens must be <= {MAX_INPUT}" in got.json()["error"]
    # the parameters are checked (TGI's schema), the body as every route reads it
    assert _post(live, "/tokenize", {"inputs": "w2", "parameters": {"frobnicate": 1}}).status_code == 422
    assert _post(live, "/tokenize", {"inputs": ""}).json()["error"] == "`inputs` cannot be empty"


def _state(tokenizer) -> SimpleNamespace:
    return SimpleNamespace(tokenizer=tokenizer, max_token_chars=requests.max_token_chars(tokenizer), max_input_tokens=MAX_INPUT)


def test_tokens_the_tokenizer_adds_span_zero_to_zero(tok):  # noqa: F811
    import copy

    from tokenizers import processors

    eos_after = copy.deepcopy(tok)  # the module's tokenizer stays as it is
    eos_after.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                                               special_tokens=[("</s>", 1)])
    spans = requests.token_spans(_state(eos_after), "w2 w3")
    assert spans[-1] == {"id": 1, "text": "", "start": 0, "stop": 0}
    assert [s["text"] for s in spans[:-1]] == ["w2", "w3"]


def test_tokenize_takes_tgis_add_special_tokens_and_spans_only_added_tokens_zero_to_zero(live, tok):  # noqa: F811
    """TGI's top-level ``add_special_tokens: false`` tokenizes without what the tokenizer adds (it
    was refused as an unknown field); an empty token of the text itself keeps its own offsets."""
    import copy

    from tokenizers import processors

    r = _post(live, "/tokenize", {"inputs": "w2 w3", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    assert [s["id"] for s in r.json()] == tok("w2 w3", add_special_tokens=False)["input_ids"]
    assert _post(live, "/tokenize", {"inputs": "w2", "stream": True}).status_code == 422  # not a /tokenize field
    both = copy.deepcopy(tok)
    both.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                                          special_tokens=[("<s>", 0), ("</s>", 1)])
    assert [s["id"] for s in requests.token_spans(_state(both), "w2 w3", special=False)] == \
        tok("w2 w3", add_special_tokens=False)["input_ids"]
    with_them = requests.token_spans(_state(both), "w2 w3")
    assert (with_them[0]["start"], with_them[0]["stop"], with_them[-1]["start"]) == (0, 0, 0)


def test_a_tokenizer_without_offsets_is_a_clear_error(tok):  # noqa: F811
    class Slow:  # a Python ("slow") tokenizer: transformers gives it no offsets mapping
        is_fast = False

        def get_vocab(self):
            return tok.get_vocab()

    with pytest.raises(ApiError) as err:
        requests.token_spans(_state(Slow()), "w2 w3")
    assert err.value.status == 404 and err.value.error_type == "tokenizer"
    assert err.value.message.startswith("No fast tokenizer available") and "Slow" in err.value.message
