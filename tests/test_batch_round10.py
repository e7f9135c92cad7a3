"""A batch beside other generations on its runtime, and user processors that raise at drafted nodes.

An empty batch (an idle server's) takes its runtime back when rows next join, so one direct
``generate()`` on the decoder a server was built from does not break the server; a batch holding
rows is still refused. A processor raising at a drafted node plain decoding never reaches fails
nothing; raising where plain decoding reads, it fails the row with the same error as there.
"""

from __future__ import annotations

import asyncio
import copy
import re
import threading

import pytest
import torch
from helpers import plain_greedy

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.config import SamplingConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.decoder_lock import BUSY, GenerationLock
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import DraftPolicy, FixedLength
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.server.scheduler import Job, Scheduler
from spec_plugins.types import RowRequest
from spec_plugins.verifiers import ExactVerifier
from support import RaisesAt

TAKEN = "another generation on this decoder started before this one finished"
P1, P2 = [5, 17, 30, 42, 9, 7], [40, 41, 42, 3, 3, 3, 3, 3, 3, 25, 11]
P3 = [47, 59, 3, 47, 9, 17, 30, 5, 17, 30, 42, 9, 7]  # the n-gram drafter drafts its output right and wrong


def _decoder(kind: str, model) -> SpeculativeDecoder:
    """Over ``model``: an n-gram drafter, or a draft model that is the target with a noisy head
    (it drafts the target's token about half the time)."""
    rt = TorchRuntime(model)
    if kind == "ngram":
        return SpeculativeDecoder(rt, NgramProposer(NgramProposer.Config(num_draft_tokens=3)), ExactVerifier())
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    return SpeculativeDecoder(rt, DraftModelProposer(None, target=rt, runtime=TorchRuntime(draft)), ExactVerifier())


def _run(batch: Batch, requests: list[RowRequest], errors: dict | None = None) -> dict:
    """Rows to the end on ``batch``: their tokens by key (``errors``: filled with each failed row's error)."""
    out: dict = {r.key: [] for r in requests}
    ems = batch.add(requests)
    policy = DraftPolicy.of(FixedLength(3))
    while True:
        for em in ems:
            out[em.key] += em.tokens
            if em.error is not None and errors is not None:
                errors[em.key] = em.error
        batch.drop_finished()
        if not batch.rows or (record := run_round(batch, policy)) is None:
            return out
        ems = record.emissions


# ---- 1. an idle batch beside a generate() on its decoder ---------------------------------------------
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_an_empty_batch_takes_its_runtime_back_after_a_generate_on_its_decoder(kind):
    """The server's batch, idle, and a direct generate() on its decoder: the recovery path's
    close + check holds (it asserted: the runtime held the generate's row), and the next rows
    decode as alone."""
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    dec = _decoder(kind, model)
    batch = Batch(dec.target, dec.proposer, dec.verifier)  # as ``server.setup.build_state`` builds it
    assert _run(batch, [RowRequest(0, P1, 8)])[0] == plain_greedy(model, P1, 8)
    assert dec.generate(P2, 8).token_ids == plain_greedy(model, P2, 8)
    batch.close()  # ``Scheduler._fail_all``
    batch.check()
    assert _run(batch, [RowRequest(1, P1, 8), RowRequest(2, P2, 8)]) == {
        1: plain_greedy(model, P1, 8), 2: plain_greedy(model, P2, 8)}
    batch.check()
    stream = dec.stream(P2, 8)  # a generation in this thread the empty batch takes the runtime from
    next(stream)
    batch.add([RowRequest(3, P1, 8)])
    with pytest.raises(RuntimeError, match=TAKEN):
        next(stream)


def _scheduler(dec: SpeculativeDecoder) -> Scheduler:
    """A started scheduler over ``dec`` wired as ``server.setup.build_state`` wires it: its batch,
    and the decoder's generation lock."""
    sched = Scheduler(Batch(dec.target, dec.proposer, dec.verifier), max_batch=2,
                      policy=DraftPolicy.of(FixedLength(3)), lock=dec.generation_lock)
    sched.start()
    return sched


def _served(sched: Scheduler, prompt: list[int], n: int, processors=()) -> tuple[Job, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    job = Job(RowRequest(sched.new_key(), prompt, n, pipeline=LogitsPipeline(SamplingConfig(), processors)), loop)
    sched.submit(job)
    return job, loop


def _tokens(job: Job, loop: asyncio.AbstractEventLoop) -> list[int] | str:
    """The job's tokens once it ends, or its error message."""
    out: list[int] = []
    try:
        while True:
            ev = loop.run_until_complete(asyncio.wait_for(job.queue.get(), 60))
            if ev[0] == "error":
                return ev[1]
            out += ev[1]
            if ev[3] is not None:
                return out
    finally:
        loop.close()


def _until(cond) -> None:
    """Wait for another thread to reach a state (bounded; no timing is asserted)."""
    for _ in range(3000):
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the other thread never got there")


def test_a_direct_generate_while_the_server_works_is_refused_and_its_requests_run_on():
    """The decode thread let the decoder go between rounds: a direct generate() could then take
    the runtime, and every running request failed (500). It holds the decoder while requests run."""
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    dec = _decoder("ngram", model)
    let_go: list[int] = []  # the running requests each time the decoder was let go

    class Watched(GenerationLock):
        def release(self) -> None:
            let_go.append(len(sched._jobs))
            super().release()

    dec.generation_lock = Watched()
    sched = _scheduler(dec)
    entered, go = threading.Event(), threading.Event()

    def pause(ids, scores):  # holds the server inside a round until the test has tried
        entered.set()
        go.wait(30)
        return scores

    try:
        job, loop = _served(sched, P1, 8, [pause])
        assert entered.wait(30)
        with pytest.raises(RuntimeError, match=re.escape(BUSY)):
            dec.generate(P2, 8)
        go.set()
        assert _tokens(job, loop) == plain_greedy(model, P1, 8)
        assert len(let_go) <= 1 and not any(let_go)  # not while the request ran
        with dec.generation_lock.holding(wait=True):  # the server, idle again, lets it go
            assert dec.generate(P2, 8).token_ids == plain_greedy(model, P2, 8)
    finally:
        go.set()
        sched.stop(timeout=0.0)


def test_a_request_waits_for_a_direct_generate_in_another_thread_and_says_so():
    """A request arriving while a direct generate() runs in another thread waits for it (the
    server's batch took the runtime from under it before), and ``unhealthy`` names why."""
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    dec = _decoder("ngram", model)
    sched = _scheduler(dec)
    entered, go, calls, out = threading.Event(), threading.Event(), [0], {}

    def pause(ids, scores):  # holds the generation inside its third processing call
        calls[0] += 1
        if calls[0] == 3:
            entered.set()
            go.wait(30)
        return scores

    def user():
        try:
            out["tokens"] = dec.generate(P2, 8, processors=[pause]).token_ids
        except Exception as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    t = threading.Thread(target=user)
    try:
        t.start()
        assert entered.wait(30)
        job, loop = _served(sched, P1, 8)
        _until(lambda: sched.unhealthy is not None)
        assert "waiting" in sched.unhealthy and "direct generation" in sched.unhealthy
    finally:
        go.set()
        t.join(30)
    try:
        assert out == {"tokens": plain_greedy(model, P2, 8)}
        assert _tokens(job, loop) == plain_greedy(model, P1, 8)
        assert sched.unhealthy is None
    finally:
        sched.stop(timeout=0.0)


def test_a_stream_left_unfinished_in_another_thread_stalls_nothing_it_cannot_report():
    """A stream another thread left unfinished holds the decoder: the decode thread waited on it
    for good, ``/health`` said healthy, and ``stop()`` left the thread running."""
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    dec = _decoder("ngram", model)
    sched = _scheduler(dec)
    kept = []
    t = threading.Thread(target=lambda: (kept.append(dec.stream(P2, 8)), next(kept[0])))
    t.start()
    t.join(30)
    job, loop = _served(sched, P1, 8)
    _until(lambda: sched.unhealthy is not None)
    assert "a stream holds the decoder" in sched.unhealthy
    sched.stop(timeout=0.0)
    assert not sched.alive
    assert _tokens(job, loop) == "the server shut down before this request finished"


def test_a_generate_that_raised_leaves_the_server_serving_while_its_error_is_kept():
    """A direct generate() that raised mid-round, its exception kept (a REPL's ``sys.last_value``),
    keeps its batch and unfinished rows alive; the server must still take its runtime back."""
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    dec = _decoder("ngram", model)
    forward, calls = dec.target.forward, [0]

    def failing(*a, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("device lost")
        return forward(*a, **kw)

    sched = _scheduler(dec)  # idle, its batch empty
    dec.target.forward = failing
    try:
        dec.generate(P2, 8)
    except RuntimeError as exc:
        kept = exc
    dec.target.forward = forward
    assert str(kept) == "device lost"
    try:
        job, loop = _served(sched, P1, 8)
        assert _tokens(job, loop) == plain_greedy(model, P1, 8)
    finally:
        sched.stop(timeout=0.0)


def test_a_batch_holding_rows_is_still_refused_after_a_generate_on_its_decoder():
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    dec = _decoder("ngram", model)
    batch = Batch(dec.target, dec.proposer, dec.verifier)
    batch.add([RowRequest(0, P1, 8)])
    dec.generate(P2, 8)
    with pytest.raises(RuntimeError, match=TAKEN):
        run_round(batch, DraftPolicy.of(FixedLength(3)))
    with pytest.raises(RuntimeError, match=TAKEN):
        batch.add([RowRequest(1, P2, 8)])
    with pytest.raises(RuntimeError, match=TAKEN):
        batch.check()
    batch.close()
    batch.check()
    assert _run(batch, [RowRequest(2, P2, 8)])[2] == plain_greedy(model, P2, 8)


def test_a_generate_beside_an_idle_server_leaves_it_serving():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import LiveServer, tiny_tokenizer

    srv = LiveServer(tiny_llama(seed=3), tiny_tokenizer(), max_batch=2)
    try:
        body = {"inputs": "w5 w6 w7", "parameters": {"max_new_tokens": 8}}
        first = httpx.post(srv.url + "/generate", json=body).json()
        with srv.decoder.generation_lock.holding(wait=True):  # the decode thread may still be tidying up
            alone = srv.decoder.generate("w9 w9 w3", max_new_tokens=8)
        for _ in range(2):
            r = httpx.post(srv.url + "/generate", json=body)
            assert r.status_code == 200 and r.json() == first
        assert httpx.get(srv.url + "/health").status_code == 200
        # a request arriving while a direct generation holds the decoder waits for it, then runs
        sched = srv.state.scheduler
        out: list = []
        with srv.decoder.generation_lock.holding(wait=True):
            waiting = threading.Thread(target=lambda: out.append(httpx.post(srv.url + "/generate", json=body)))
            waiting.start()
            _until(lambda: sched.waiting_since is not None)  # the decode thread waits for the decoder
            again = srv.decoder.generate("w9 w9 w3", max_new_tokens=8)
        waiting.join(60)
        assert again.token_ids == alone.token_ids
        assert out[0].status_code == 200 and out[0].json() == first
    finally:
        srv.stop()


# ---- 2. processors raising at drafted nodes ---------------------------------------------------------
P = [14, 14, 7, 3, 2, 5, 14]


class Diverged:
    """Raises when the generated text leaves ``reference`` (plain greedy's output): plain decoding
    never feeds it such a prefix, speculation does at drafted nodes after a rejected token."""

    def __init__(self, prompt_len: int, reference: list[int]) -> None:
        self.n, self.reference = prompt_len, torch.tensor(reference)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        gen = ids[:, self.n:]
        if (gen != self.reference[: gen.shape[1]]).any():
            raise ValueError("the prefix left plain decoding's output")
        return scores


def test_a_banned_token_drafted_off_the_path_fails_nothing():
    """The hunter's case: a processor that bans 7 and raises if 7 was generated; the n-gram
    drafter drafts 7 (rejected), and the nodes after it raised for the whole row."""
    class BanAndCheck:
        def __call__(self, ids, scores):
            if (ids[:, len(P):] == 7).any():
                raise ValueError("token 7 was generated (impossible: it is banned)")
            return scores.masked_fill(torch.arange(scores.shape[-1]) == 7, float("-inf"))

    model = tiny_llama(vocab=16, seed=11, sharpness=4.0)
    got = {}
    for name, prop in (("plain", None), ("ngram", NgramProposer(NgramProposer.Config(num_draft_tokens=3, max_ngram=2)))):
        r = SpeculativeDecoder(TorchRuntime(model), prop, ExactVerifier()).generate(P, 12, processors=[BanAndCheck()])
        got[name] = (r.finish_reason, r.token_ids, r.error)
    assert got["ngram"] == got["plain"] and got["plain"][0] == "length"


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_a_processor_raising_only_off_the_accepted_path_fails_nothing(kind):
    """Plain greedy's output, whatever speculation drafted (a draft model's step that raises ends
    that row's draft there)."""
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    ref = plain_greedy(model, P3, 16)
    dec = _decoder(kind, model)
    batch = Batch(dec.target, dec.proposer, dec.verifier)
    errors: dict = {}
    pipe = LogitsPipeline(SamplingConfig(), [Diverged(len(P3), ref)])
    assert _run(batch, [RowRequest(0, P3, 16, pipeline=pipe)], errors) == {0: ref} and errors == {}
    assert 0 < batch.stats.accepted_tokens < batch.stats.draft_tokens  # it drafted, right and wrong
    if kind == "ngram":  # through generate() too
        r = dec.generate(P3, 16, processors=[Diverged(len(P3), ref)])
        assert (r.finish_reason, r.token_ids, r.error) == ("length", ref, None)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_a_processor_raising_where_plain_decoding_reads_fails_the_row_with_its_error(kind):
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    plain = SpeculativeDecoder(TorchRuntime(model)).generate(P3, 16, processors=[RaisesAt(len(P3) + 5)])
    assert plain.finish_reason == "error" and plain.error == f"logits processing failed: ValueError: at length {len(P3) + 5}"
    dec = _decoder(kind, model)
    batch = Batch(dec.target, dec.proposer, dec.verifier)
    errors: dict = {}
    pipe = LogitsPipeline(SamplingConfig(), [RaisesAt(len(P3) + 5)])
    got = _run(batch, [RowRequest(0, P3, 16, pipeline=pipe)], errors)[0]
    assert errors == {0: plain.error} and got == plain.token_ids[: len(got)]
    assert batch.stats.draft_tokens > 0


def test_a_batch_row_whose_processor_raises_at_its_root_fails_alone():
    """Rows beside it decode on; the failing row names the processor's error."""
    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    dec = _decoder("ngram", model)
    batch = Batch(dec.target, dec.proposer, dec.verifier)
    bad = LogitsPipeline(SamplingConfig(), [RaisesAt(len(P1) + 2)])
    errors: dict = {}
    out = _run(batch, [RowRequest(0, P1, 8, pipeline=bad), RowRequest(1, P2, 8)], errors)
    assert out[1] == plain_greedy(model, P2, 8)
    assert out[0] == plain_greedy(model, P1, 2)[: len(out[0])]
    assert errors == {0: f"logits processing failed: ValueError: at length {len(P1) + 2}"}


# ---- 3. a draft model's processors see the target's padded prefixes ---------------------------------
def test_a_draft_models_processors_see_the_padded_prefixes_the_targets_do():
    """transformers' ``generate()`` passes its processors the left-padded rows; the draft model gave
    them pad-free prefixes, so a processor keyed on the padded prompt (a ``GrammarLogitsProcessor``,
    which now refuses an unknown prefix) stopped every padded row from drafting."""
    from test_transformers_integration import PAD, PROMPTS, left_padded
    from transformers import LogitsProcessorList

    from spec_plugins.integrations.transformers import speculative_generate
    from spec_plugins.stats import DecodeStats

    model = tiny_llama(vocab=64, seed=7, sharpness=6.0)
    inputs = left_padded(PROMPTS)
    padded = [tuple(r) for r in inputs["input_ids"].tolist()]
    seen: list[tuple[int, ...]] = []

    def record(ids, scores):  # a function of (prefix, scores), as processors must be
        seen.extend(tuple(r) for r in ids.tolist())
        return scores

    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    plain = model.generate(**inputs, **kw)
    stats = DecodeStats()
    out = model.generate(**inputs, **kw, logits_processor=LogitsProcessorList([record]),
                         custom_generate=speculative_generate, draft_model=model, spec_stats=stats)
    assert torch.equal(out, plain)
    assert stats.draft_tokens > 0
    strays = [s for s in seen if not any(s[:len(p)] == p for p in padded)]
    assert strays == []
