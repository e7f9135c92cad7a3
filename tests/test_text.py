"""The one incremental text stream: linear work, whole characters, stop strings as row stops in
``generate``, ``stream`` and ``generate_batch``."""

from __future__ import annotations

import pytest


def byte_tokenizer():
    """A byte-level tokenizer (one token per byte, built in memory): multi-byte characters span
    several tokens, as they do in BPE vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


class Counting:
    """A tokenizer seen through a counter of the characters its decode() produces."""

    def __init__(self, tok) -> None:
        self.tok, self.calls, self.chars = tok, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        out = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        self.calls += 1
        self.chars += len(out)
        return out


TEXT = "Speculative décodage — 速い! naïve café " * 50  # 2-3 byte characters between ASCII


def test_stream_of_2000_tokens_is_linear_and_equals_the_full_decode():
    from spec_plugins.text import TextStream

    tok = byte_tokenizer()
    ids = tok(TEXT)["input_ids"][:2000]
    assert len(ids) == 2000
    counted = Counting(tok)
    s = TextStream(counted)
    pieces = [s.add(t) for t in ids]
    assert "\ufffd" not in "".join(pieces)  # no half character ever emitted
    assert "".join(pieces) + s.flush() == tok.decode(ids)
    # two short decodes per token: work linear in the length (a full re-decode per token would
    # be ~2 million characters here)
    assert counted.calls == 2 * len(ids) and counted.chars <= 8 * len(ids)


def test_stop_strings_stop_at_the_token_that_completes_them_even_across_tokens():
    from spec_plugins.text import StopStrings, TextStream

    tok = byte_tokenizer()
    ids = tok("abc STOP def")["input_ids"]
    s = TextStream(tok, stops=["ST" + "OP", "never"])
    rule = StopStrings(s)
    seq: list[int] = [0, 0]  # two prompt tokens
    keep = None
    for t in ids:  # one token per round
        seq.append(t)
        keep = rule(seq, 1)
        if keep is not None:
            break
    assert keep == 1 and tok.decode(seq[2:]) == "abc STOP"  # stopped at the 'P' that completed it
    assert s.visible == "abc " and s.add(ids[-1]) == ""  # nothing after a stop
    several = TextStream(tok, stops=["c S"])
    assert StopStrings(several)([0] + ids, len(ids)) == 5  # a stop inside one multi-token emission


def test_stop_strings_in_generate_batch_and_generate():
    from test_bench import tiny_decoder

    dec, _ = tiny_decoder(k=3)
    prompts = ["w1 w2 w3 w4 w1 w2 w3 w4 w1", "w7 w8 w9 w7 w8", "w5 w6 w5"]
    free = dec.generate_batch(prompts, max_new_tokens=16)
    words = free[0].text.split()
    stop = words[3]  # a word row 0 emits: it must stop there
    got = dec.generate_batch(prompts, max_new_tokens=16, stop=[" " + stop])
    for f, g in zip(free, got):
        cut = f.text.find(" " + stop)
        if cut == -1:
            assert (g.token_ids, g.text, g.finish_reason) == (f.token_ids, f.text, f.finish_reason)
            continue
        assert g.finish_reason == "stop_sequence" and g.text == f.text[:cut]
        n = len(g.token_ids)
        assert g.token_ids == f.token_ids[:n] and " " + stop in dec.tokenizer.decode(g.token_ids)
        assert " " + stop not in dec.tokenizer.decode(g.token_ids[:-1])  # the last token completed it
    one = dec.generate(prompts[0], max_new_tokens=16, stop=[" " + stop])
    assert (one.token_ids, one.text, one.finish_reason) == (got[0].token_ids, got[0].text, "stop_sequence")
    assert "".join(e.text for e in dec.stream(prompts[0], max_new_tokens=16, stop=[" " + stop])) == one.text


@pytest.mark.parametrize("speculate", [False, True])
def test_a_stop_string_completed_a_round_later_never_reaches_generate_or_stream(speculate):
    """A stop string whose first token comes a round before its last (always so in plain decoding):
    ``generate`` and ``stream`` hold its first part back, as ``generate_batch``'s text does."""
    from test_bench import tiny_decoder

    dec, _ = tiny_decoder(k=3)
    dec = dec if speculate else dec.without_speculation()
    prompt = "w5 w6 w5"
    free = dec.generate(prompt, max_new_tokens=12).text
    words = free.split()
    stop = f" {words[2]} {words[3]}"  # two tokens
    want = free[: free.find(stop)]
    assert dec.generate_batch([prompt], max_new_tokens=12, stop=[stop])[0].text == want
    one = dec.generate(prompt, max_new_tokens=12, stop=[stop])
    assert (one.text, one.finish_reason) == (want, "stop_sequence")
    pieces = [e.text for e in dec.stream(prompt, max_new_tokens=12, stop=[stop])]
    assert "".join(pieces) == want
    assert dec.generate(prompt, max_new_tokens=2, stop=[stop]).text == " ".join(words[:2])  # held back only while it may grow


def test_stop_strings_without_a_tokenizer_are_refused():
    from conftest import tiny_llama

    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3)))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        dec.generate([1, 2, 3], max_new_tokens=4, stop=["x"])
    assert dec.generate([1, 2, 3], max_new_tokens=4).text == ""  # token ids only, as before


def test_decoder_stream_of_2000_tokens_decodes_linear_work():
    """``stream`` through the real decoder: 2,000 tokens cost two short decodes per token, not a
    decode of the whole output per round (quadratic: millions of characters)."""
    from test_bench import word_tokenizer

    from conftest import tiny_llama
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder

    tok = word_tokenizer()
    counted = Counting(tok)
    counted.eos_token_id, counted.chat_template = None, None  # no EOS: all 2,000 tokens
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, max_pos=2100, layers=1, hidden=16), counted))
    events = list(dec.stream([2, 3, 4], max_new_tokens=2000))
    ids = [t for e in events for t in e.token_ids]
    assert len(ids) == 2000 and "".join(e.text for e in events) == tok.decode(ids, skip_special_tokens=True)
    assert counted.calls <= 2 * len(ids) and counted.chars <= 8 * len(tok.decode(ids))


def test_holding_back_a_possible_stop_costs_a_piece_the_same_however_long_the_text():
    """``StopFreeText`` per token: the same work (Python calls, counted by a profiler) at the
    2,000th piece as at the 10th, with a 1,000-character stop (comparing every tail up to the
    longest stop with every stop cost a call per tail: quadratic on the server's event loop)."""
    import sys

    from spec_plugins.text import StopFreeText

    shown = StopFreeText(["x" * 1000, "\n\nUser:"])

    def push_counted() -> int:
        n = [0]

        def count(frame, event, arg):
            n[0] += event in ("call", "c_call")

        sys.setprofile(count)
        try:
            assert shown.push("ab ", None, False) == "ab "
        finally:
            sys.setprofile(None)
        return n[0]

    counted = {}
    for i in range(2000):
        if i in (10, 1999):
            counted[i] = push_counted()
        else:
            shown.push("ab ", None, False)
    assert counted[1999] == counted[10]
