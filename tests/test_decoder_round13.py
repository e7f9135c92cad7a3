"""A stream frees its decoder with its last event (the one carrying ``finish_reason``): a reader
that stops there, holding every token, without closing the stream, leaves the decoder to
another thread; whatever ended the row (its token limit, a stop string, an error)."""

from __future__ import annotations

from typing import Any


from conftest import tiny_llama
from helpers import plain_greedy
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder, StreamEvent
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.verifiers import ExactVerifier
from support import RaisesAt, in_thread

P1 = [2, 3, 4, 2, 3, 4, 2]
P2 = [9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9]


def _read_to_finish(stream: Any) -> list[StreamEvent]:
    """The common reader: stop at the event with a finish reason, not closing the stream."""
    events = []
    for ev in stream:
        events.append(ev)
        if ev.finish_reason:
            break
    return events


def _ids(events: list[StreamEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_a_stream_read_to_its_finish_reason_frees_the_decoder_without_close():
    model = tiny_llama(seed=3, sharpness=2.0)
    dec = SpeculativeDecoder(TorchRuntime(model), NgramProposer(NgramProposer.Config(num_draft_tokens=5)),
                             ExactVerifier())
    want = plain_greedy(model, P1, 20)  # the reference, outside the decoder
    other = plain_greedy(model, P2, 12)
    stream = dec.stream(P1, 20)
    events = _read_to_finish(stream)
    assert events[-1].finish_reason == "length" and _ids(events) == want
    assert not dec.generation_lock.held
    assert in_thread(lambda: dec.generate(P2, 12).token_ids) == {"value": other}
    assert next(stream, None) is None  # nothing came after the final event
    assert dec.generate(P1, 20).token_ids == want


def test_a_stream_ended_by_a_stop_string_or_an_error_frees_the_decoder_at_its_last_event():
    from test_text_round9 import STOP, TEXT, decoders, forcing, merged_tokenizer, text_ids

    tok = merged_tokenizer()
    ids, at = text_ids(tok)
    dec = decoders(tok)["ngram"]
    prompt = tok("say " + TEXT, add_special_tokens=False)["input_ids"]  # the n-gram drafts the text
    other = dec.generate(prompt, 6).token_ids
    stream = dec.stream(prompt, len(ids), processors=[forcing(ids, len(prompt))], stop=[STOP])
    events = _read_to_finish(stream)
    assert events[-1].finish_reason == "stop_sequence"
    assert "".join(e.text for e in events) == TEXT[: TEXT.find(STOP)] and _ids(events) == ids[: at + 1]
    assert in_thread(lambda: dec.generate(prompt, 6).token_ids) == {"value": other}
    assert next(stream, None) is None

    whole = dec.generate(prompt, 16, processors=[RaisesAt(len(prompt) + 3)])
    assert whole.finish_reason == "error"
    stream = dec.stream(prompt, 16, processors=[RaisesAt(len(prompt) + 3)])
    events = _read_to_finish(stream)
    assert (events[-1].finish_reason, events[-1].error) == ("error", whole.error)
    assert _ids(events) == whole.token_ids and "".join(e.text for e in events) == whole.text
    assert in_thread(lambda: dec.generate(prompt, 6).token_ids) == {"value": other}
    assert next(stream, None) is None


def test_a_stream_closed_early_still_frees_the_decoder_and_holds_it_until_then():
    model = tiny_llama(seed=3, sharpness=2.0)
    dec = SpeculativeDecoder(TorchRuntime(model), NgramProposer(NgramProposer.Config(num_draft_tokens=5)),
                             ExactVerifier())
    stream = dec.stream(P1, 20)
    first = next(stream)
    assert first.finish_reason is None and dec.generation_lock.held  # unfinished: still held
    assert "generating in another thread" in str(in_thread(lambda: dec.generate(P2, 4)).get("error"))
    stream.close()
    assert in_thread(lambda: dec.generate(P2, 12).token_ids) == {"value": plain_greedy(model, P2, 12)}
