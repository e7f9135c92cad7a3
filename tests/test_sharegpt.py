"""The ShareGPT loader: a cut-off JSON file, conversation shapes, filters, the split, and
turn-by-turn chat-template encoding with the assistant's tokens marked."""

from __future__ import annotations

import json

import pytest

from spec_plugins.training.sharegpt import (DataFilter, FilterCounts, conversations, encode_conversation, is_english,
                                            is_heldout, iter_records, messages_of)


def rec(i, *turns, rid=None):
    return {"id": rid or f"c{i}_0", "conversations": [{"from": f, "value": v} for f, v in turns]}


def write(path, records, cut: int | None = None):
    text = json.dumps(records, indent=2)
    path.write_text(text[:cut] if cut else text)
    return path


def test_iter_records_keeps_every_complete_record_of_a_cut_off_file(tmp_path):
    records = [rec(i, ("human", f"question {i} " + "x" * 50), ("gpt", f"answer {i}")) for i in range(40)]
    full = json.dumps(records, indent=2)
    cut = full.index('"c37_0"')  # inside record 37
    got = list(iter_records(write(tmp_path / "d.json", records, cut), chunk=64))
    assert [r["id"] for r in got] == [f"c{i}_0" for i in range(37)]
    assert list(iter_records(write(tmp_path / "e.json", records), chunk=100)) == records
    with pytest.raises(json.JSONDecodeError):
        json.loads(full[:cut])  # what a strict parse does


def test_messages_merge_drop_and_refuse():
    m = messages_of(rec(0, ("gpt", "continued answer"), ("human", "q1"), ("human", "more"), ("gpt", "a1"),
                        ("human", "unanswered")))
    assert m == [{"role": "user", "content": "q1\nmore"}, {"role": "assistant", "content": "a1"}]
    assert messages_of(rec(0, ("system", "be brief"), ("human", "q"), ("gpt", "a")))[0]["role"] == "system"
    assert messages_of(rec(0, ("human", "q"), ("robot", "a"))) is None  # unknown speaker
    assert messages_of(rec(0, ("human", "q"), ("system", "late"), ("gpt", "a"))) is None
    assert messages_of({"id": "x", "conversations": []}) is None
    assert messages_of(rec(0, ("gpt", "only an answer"))) is None


def test_filters_dedupe_language_and_a_disjoint_stable_split(tmp_path):
    long_answer = "a fine and complete answer"
    records = [rec(i, ("human", f"Tell me about topic {i % 30}"), ("gpt", long_answer)) for i in range(60)]
    records += [rec(100, ("human", "Расскажи мне о погоде сегодня"), ("gpt", long_answer)),
                rec(101, ("human", "hi there friend"), ("gpt", "ok"))]
    path = write(tmp_path / "d.json", records)
    counts = FilterCounts()
    kept = list(conversations(path, DataFilter(), "all", counts=counts))
    assert counts.duplicate == 30 and counts.language == 1 and counts.too_short == 1 and len(kept) == 30
    assert counts.kept == 30 and counts.read == 62
    train = {i for i, _ in conversations(path, DataFilter(dedupe=False), "train", 0.3)}
    held = {i for i, _ in conversations(path, DataFilter(dedupe=False), "heldout", 0.3)}
    assert train and held and not train & held
    assert all(is_heldout(i, 0.3) for i in held)
    # parts of one conversation stay on one side
    assert is_heldout("abc_0", 0.5) == is_heldout("abc_7", 0.5)
    assert is_english("How do I sort a list in Python?") and not is_english("如何在Python中对列表排序？")


@pytest.fixture(scope="module")
def chatml_tokenizer():
    """A word-level tokenizer with a ChatML template, built in memory (no files, no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "<unk> <|im_start|> <|im_end|> system user assistant \n be brief q1 a1 q2 a2 more words here".split(" ")
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + ["\n"]))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|> ' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}")
    return tok


def test_encode_marks_exactly_the_assistant_turns(chatml_tokenizer):
    tok = chatml_tokenizer
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1 more"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    enc = encode_conversation(tok, msgs)
    full = tok.apply_chat_template(msgs, tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    assert enc.ids == full
    marked = tok.convert_ids_to_tokens([i for i, a in zip(enc.ids, enc.assistant) if a])
    assert marked == ["a1", "more", "<|im_end|>", "a2", "<|im_end|>"]
    cut = encode_conversation(tok, msgs, max_tokens=9)
    assert cut.ids == full[:9] and cut.assistant == enc.assistant[:9]
    assert encode_conversation(tok, msgs, max_tokens=3) is None  # no answer token left


def test_smollm2_template_marks_answers_and_end_token_but_not_the_newline():
    """On the real chat template (ChatML with a default system prompt), the marked tokens are
    each answer followed by <|im_end|>; the template's newline after it is not an answer token."""
    from spec_plugins.models import ModelNotFound, load_gguf_tokenizer

    try:
        tok = load_gguf_tokenizer("smollm2-135m-instruct")
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green, of course."}]
    enc = encode_conversation(tok, msgs)
    spans, cur = [], []
    for i, a in zip(enc.ids, enc.assistant):
        if a:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    assert spans == ["Blue.<|im_end|>", "Green, of course.<|im_end|>"]
