"""One decoder from two threads is refused clearly (a stream holds it until it ends, is closed or
collected); the transformers plugin serializes calls sharing one proposer instance; and
``generate_batch`` gives each row its own stats, the batch's totals on ``decoder.last_stats``."""

from __future__ import annotations

import gc
import threading
from collections import Counter
from typing import Any

import pytest
import torch

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.integrations import transformers as plugin
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.stats import DecodeStats
from spec_plugins.verifiers import ExactVerifier
from support import in_thread

PROMPTS = [[2, 3, 4, 2, 3, 4, 2], [9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9]]
COUNTS = ("target_forwards", "row_rounds", "verify_positions", "prefill_forwards", "draft_tokens", "accepted_tokens",
          "emitted_tokens", "forced_tokens", "new_tokens")


def _decoder(seed: int = 3) -> SpeculativeDecoder:
    proposer = NgramProposer(NgramProposer.Config(num_draft_tokens=5))
    return SpeculativeDecoder(TorchRuntime(tiny_llama(seed=seed, sharpness=2.0)), proposer, ExactVerifier())


# ---- 1. one decoder, two threads ------------------------------------------------------------------
def test_another_thread_is_refused_while_a_stream_holds_the_decoder_and_served_once_it_is_closed():
    dec = _decoder()
    want = dec.generate(PROMPTS[1], 20).token_ids
    stream = dec.stream(PROMPTS[0], 20)
    next(stream)
    for call in (lambda: dec.generate(PROMPTS[1], 20), lambda: dec.generate_batch([PROMPTS[1]], 20),
                 lambda: list(dec.stream(PROMPTS[1], 20)), lambda: dec.without_speculation().generate(PROMPTS[1], 5)):
        err = in_thread(call).get("error")
        assert isinstance(err, RuntimeError) and "generating in another thread" in str(err)
    next(stream)  # the refused calls touched nothing: the stream goes on
    stream.close()
    assert in_thread(lambda: dec.generate(PROMPTS[1], 20).token_ids) == {"value": want}


def test_a_stream_collected_without_close_and_a_generation_that_raised_release_the_decoder():
    dec = _decoder()
    want = dec.generate(PROMPTS[1], 20).token_ids
    stream = dec.stream(PROMPTS[0], 20)
    next(stream)
    del stream
    gc.collect()
    assert in_thread(lambda: dec.generate(PROMPTS[1], 20).token_ids) == {"value": want}

    class Raises:
        def observe(self, record: Any) -> None:
            raise ValueError("observer failed")

    with pytest.raises(ValueError, match="observer failed"):
        dec.generate(PROMPTS[0], 20, observers=[Raises()])
    assert in_thread(lambda: dec.generate(PROMPTS[1], 20).token_ids) == {"value": want}
    # a stream started in another thread and left open there is released where it is closed
    def started() -> Any:
        stream = dec.stream(PROMPTS[0], 20)
        next(stream)
        return stream

    held = in_thread(started)["value"]
    with pytest.raises(RuntimeError, match="generating in another thread"):
        dec.generate(PROMPTS[1], 20)
    held.close()
    assert dec.generate(PROMPTS[1], 20).token_ids == want


def test_interleaved_streams_in_one_thread_keep_their_own_error():
    dec = _decoder()
    first, second = dec.stream(PROMPTS[0], 20), dec.stream(PROMPTS[1], 20)
    next(first)
    next(second)  # the same thread is not refused: its streams may overlap
    with pytest.raises(RuntimeError, match="two stream\\(\\) generators interleaved"):
        next(first)
    list(second)
    assert in_thread(lambda: len(dec.generate(PROMPTS[0], 5).token_ids)) == {"value": 5}


# ---- 2. the transformers plugin: one proposer instance, two models ----------------------------------
class _HoldingNgram(NgramProposer):
    """Holds its first round (after ``hold()``) until ``go`` is set: by the other call reaching
    its drafting (no lock kept it out) or waiting for the proposer's lock."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.holding, self.inside, self.go = False, threading.Event(), threading.Event()
        self.entered: list[str] = []

    def hold(self) -> None:
        self.holding = True

    def observe(self, record: Any) -> None:
        self.entered.append(threading.current_thread().name)
        if self.holding and self.inside.is_set():
            self.go.set()  # a second call decodes while the first holds its round
        if self.holding and not self.inside.is_set():
            self.inside.set()
            self.go.wait(timeout=120)
        super().observe(record)


class _SpyLock:
    """A lock that tells ``waiting`` when a call finds it taken."""

    def __init__(self, waiting: threading.Event) -> None:
        self._lock, self.waiting = threading.Lock(), waiting

    def __enter__(self) -> None:
        if self._lock.locked():
            self.waiting.set()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_calls_on_two_models_sharing_one_proposer_decode_one_after_another(monkeypatch):
    models = {"A": tiny_llama(seed=3), "B": tiny_llama(seed=4)}
    shared = _HoldingNgram(NgramProposer.Config(num_draft_tokens=4, max_ngram=2))
    spy = _SpyLock(shared.go)
    real = plugin.model_lock
    monkeypatch.setattr(plugin, "model_lock", lambda obj: spy if obj is shared else real(obj))
    inputs = {"A": torch.tensor([PROMPTS[0]]), "B": torch.tensor([PROMPTS[1]])}
    plain = {k: m.generate(input_ids=inputs[k], max_new_tokens=30, pad_token_id=0, do_sample=False)
             for k, m in models.items()}
    results: dict = {}

    def call(k: str) -> None:
        try:
            results[k] = models[k].generate(input_ids=inputs[k], max_new_tokens=30, pad_token_id=0, do_sample=False,
                                            custom_generate=plugin.speculative_generate, proposer=shared)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            results[k] = e

    shared.hold()
    a = threading.Thread(target=call, args=("A",), name="A")
    a.start()
    assert shared.inside.wait(timeout=300)
    b = threading.Thread(target=call, args=("B",), name="B")
    b.start()
    a.join(timeout=300)
    b.join(timeout=300)
    for k in models:
        assert isinstance(results[k], torch.Tensor), results[k]
        assert torch.equal(results[k], plain[k])
    first_b = shared.entered.index("B")
    assert "A" not in shared.entered[first_b:]  # B drafted only once A had finished


def test_a_proposer_that_is_no_proposer_is_refused_by_name():
    model = tiny_llama(seed=3)
    with pytest.raises(TypeError, match="proposer= must be a Proposer instance.*got str"):
        model.generate(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=4, pad_token_id=0, do_sample=False,
                       custom_generate=plugin.speculative_generate, proposer="ngram")


# ---- 3. generate_batch: each row's own stats ------------------------------------------------------
class _PerRow:
    """Independent counts from the round records: forwards each row took part in, tokens it emitted."""

    def __init__(self) -> None:
        self.forwards: Counter = Counter()
        self.emitted: Counter = Counter()

    def observe(self, record: Any) -> None:
        for key, em in zip(record.keys, record.emitted):
            self.forwards[key] += 1
            self.emitted[key] += len(em)


def test_each_batch_result_has_its_rows_stats_and_the_totals_are_the_decoders_last_stats():
    dec = _decoder()
    seen = _PerRow()
    res = dec.generate_batch([[5], [1, 2, 3, 1, 2, 3], [7, 8, 9], [4]], max_new_tokens=[2, 30, 10, 0],
                             observers=[seen])
    total = dec.last_stats
    assert [len(r.token_ids) for r in res] == [2, 30, 10, 0]
    assert [r.stats.new_tokens for r in res] == [2, 30, 10, 0]
    assert len({id(r.stats) for r in res}) == 4 and all(r.stats is not total for r in res)
    for k, r in enumerate(res):
        assert r.stats.target_forwards == seen.forwards[k] == r.stats.row_rounds
        assert r.stats.emitted_tokens == seen.emitted[k]
        assert r.stats.prefill_forwards == (1 if r.token_ids else 0)
        assert r.stats.time_total <= total.time_total
        assert set(r.stats.to_dict()) == set(DecodeStats().to_dict())
    for name in COUNTS:
        if name not in ("target_forwards", "prefill_forwards", "verify_positions"):
            assert sum(getattr(r.stats, name) for r in res) == getattr(total, name), name
    assert max(r.stats.target_forwards for r in res) == total.target_forwards
    assert total.new_tokens == 42 and total.draft_tokens > 0
    assert sum(r.stats.draft_tokens for r in res) == total.draft_tokens
    depth = len(total.drafted_by_position)
    assert [sum((r.stats.drafted_by_position + [0] * depth)[d] for r in res) for d in range(depth)] == \
        total.drafted_by_position


def test_a_single_rows_stats_are_unchanged_and_equal_a_one_row_batch():
    dec = _decoder()
    seen = _PerRow()
    one = dec.generate(PROMPTS[0], 25, observers=[seen])
    assert type(one.stats) is DecodeStats and dec.last_stats is one.stats
    assert one.stats.new_tokens == len(one.token_ids) == 25
    assert one.stats.target_forwards == one.stats.row_rounds == seen.forwards[0]
    assert one.stats.emitted_tokens == seen.emitted[0] == 24 and one.stats.prefill_forwards == 1
    batch = dec.generate_batch([PROMPTS[0]], 25)[0]
    assert batch.token_ids == one.token_ids
    assert {k: getattr(batch.stats, k) for k in COUNTS} == {k: getattr(dec.last_stats, k) for k in COUNTS}
    assert batch.stats.time_total == pytest.approx(dec.last_stats.time_total)
