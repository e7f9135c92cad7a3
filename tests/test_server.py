"""The TGI-compatible server over real HTTP on loopback, driven by the official clients."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from helpers import plain_greedy

from conftest import tiny_llama

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
text_generation = pytest.importorskip("text_generation")

from spec_plugins.backends.torch_runtime import TorchRuntime  # noqa: E402
from spec_plugins.decoder import SpeculativeDecoder  # noqa: E402
from spec_plugins.proposers.ngram import NgramProposer  # noqa: E402
from spec_plugins.server.app import http_server  # noqa: E402
from spec_plugins.server.setup import build_state  # noqa: E402
from spec_plugins.verifiers import ExactVerifier  # noqa: E402
from support import free_port, serve_in_thread  # noqa: E402

WORDS = [f"w{i}" for i in range(2, 32)]
CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}w2"


def tiny_tokenizer(eos: bool = True):
    """A 32-word WordLevel tokenizer (ids 0 <unk>, 1 </s>, 2.. w2..w31) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>" if eos else None,
                                   chat_template=CHAT)


class LiveServer:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, model, tokenizer, max_batch: int = 4, policy: str = "load", max_total: int = 128,
                 max_input: int = 48, shutdown_timeout: float = 30.0, proposer=None, limits=None) -> None:
        from spec_plugins.server.connections import ConnectionLimits

        rt = TorchRuntime(model, tokenizer)
        proposer = proposer if proposer is not None else NgramProposer(NgramProposer.Config(num_draft_tokens=5))
        self.decoder = SpeculativeDecoder(rt, proposer, ExactVerifier(), tokenizer=tokenizer)
        self.state = build_state(self.decoder, max_batch, max_input, max_total, policy, model_id="tiny")
        self.state.shutdown_timeout = shutdown_timeout
        self.port = free_port()
        self.server, self.guard = http_server(self.state, "127.0.0.1", self.port, limits or ConnectionLimits(),
                                              log_level="warning")  # as `spec-plugins serve` builds it
        self.thread = serve_in_thread(self.server)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def live(model, tok):
    srv = LiveServer(model, tok)
    yield srv
    srv.stop()


PROMPTS = ["w2 w3 w4 w2 w3 w4 w2", "w9 w8 w7 w6 w5 w9 w8 w7 w6 w5 w9", "w17", "w5 w5 w5 w5 w5 w5 w5 w5 w5 w5 w5 w6",
           "w30 w31 w30 w31 w30"]


def solo(model, tok, text: str, n: int) -> list[int]:
    return plain_greedy(model, tok(text)["input_ids"], n, eos=[tok.eos_token_id])


def test_text_generation_client_generate_and_stream(live, model, tok):
    client = text_generation.Client(live.url, timeout=60)
    for p, n in zip(PROMPTS, [12, 20, 7, 30, 16]):
        want = solo(model, tok, p, n)
        r = client.generate(p, max_new_tokens=n)
        assert [t.id for t in r.details.tokens] == want
        assert r.generated_text == tok.decode(want, skip_special_tokens=True)
        assert r.details.generated_tokens == len(want)
        assert r.details.finish_reason.value in ("length", "eos_token")
        events = list(client.generate_stream(p, max_new_tokens=n))
        assert [e.token.id for e in events] == want  # one event per token
        assert all(e.generated_text is None for e in events[:-1])
        assert events[-1].generated_text == r.generated_text and events[-1].details.generated_tokens == len(want)
    full = client.generate(PROMPTS[0], max_new_tokens=4, return_full_text=True)
    assert full.generated_text.startswith(PROMPTS[0])


def test_async_client_concurrent_requests_equal_solo(live, model, tok):
    """More concurrent requests than slots (max_batch 4): rows join and leave a running batch."""
    client = text_generation.AsyncClient(live.url, timeout=120)
    jobs = [(p, n, stream) for stream in (False, True) for p, n in zip(PROMPTS, [25, 9, 31, 14, 20])]

    async def one(p, n, stream):
        if stream:
            return [e.token.id async for e in client.generate_stream(p, max_new_tokens=n)]
        r = await client.generate(p, max_new_tokens=n)
        return [t.id for t in r.details.tokens]

    async def main():
        return await asyncio.gather(*(one(*j) for j in jobs))

    outs = asyncio.run(main())
    for (p, n, _), got in zip(jobs, outs):
        assert got == solo(model, tok, p, n), p
    assert live.state.policy.length.by_key  # per-row auto: the n-gram keys' estimates, learnt in the server


@pytest.mark.parametrize("kind", ["eagle-tree", "eagle-chain", "medusa-tree"])
def test_hidden_state_heads_serve_concurrent_requests_equal_solo(model, tok, kind):
    """Feature drafters in the server: 8 concurrent greedy requests through 4 slots, each equal to
    its solo output (rows join and leave with their target features)."""
    from test_heads import MAKERS

    srv = LiveServer(model, tok, max_batch=4, proposer=MAKERS[kind](model), policy="fixed")  # random heads: auto would stop drafting
    try:
        client = text_generation.AsyncClient(srv.url, timeout=120)
        jobs = list(zip(PROMPTS + PROMPTS[:3], [25, 9, 31, 14, 20, 7, 18, 11]))

        async def main():
            return await asyncio.gather(*(client.generate(p, max_new_tokens=n) for p, n in jobs))

        for (p, n), r in zip(jobs, asyncio.run(main())):
            assert [t.id for t in r.details.tokens] == solo(model, tok, p, n), (kind, p)
        assert srv.metric("spec_draft_tokens_total") > 0
    finally:
        srv.stop()


def test_seeded_sampling_is_reproducible(live):
    client = text_generation.Client(live.url, timeout=60)
    a = client.generate(PROMPTS[1], max_new_tokens=15, do_sample=True, temperature=0.8, seed=42)
    b = client.generate(PROMPTS[1], max_new_tokens=15, do_sample=True, temperature=0.8, seed=42)
    assert a.generated_text == b.generated_text and a.details.seed == 42


def test_huggingface_hub_inference_client(live, model, tok, monkeypatch):
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    # HF_HUB_OFFLINE blocks every request of the hub's HTTP session, loopback included; this client
    # only ever talks to the local server (base_url), so lift it for this test.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(base_url=live.url, timeout=60)
    want = solo(model, tok, PROMPTS[0], 10)
    assert client.text_generation(PROMPTS[0], max_new_tokens=10) == tok.decode(want, skip_special_tokens=True)
    out = client.text_generation(PROMPTS[0], max_new_tokens=10, details=True)
    assert [t.id for t in out.details.tokens] == want
    streamed = list(client.text_generation(PROMPTS[0], max_new_tokens=10, stream=True, details=True))
    assert [e.token.id for e in streamed] == want and streamed[-1].details.generated_tokens == len(want)
    # chat: the model's template, greedy at temperature 0
    msgs = [{"role": "user", "content": "w4 w5 w4 w5"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want_chat = plain_greedy(model, ids, 12, eos=[tok.eos_token_id])
    text = tok.decode(want_chat, skip_special_tokens=True)
    chat = client.chat_completion(msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == text
    assert chat.usage.completion_tokens == len(want_chat)
    parts = [c.choices[0].delta.content or "" for c in client.chat_completion(msgs, max_tokens=12, temperature=0,
                                                                               stream=True)]
    assert "".join(parts) == text


def test_stop_sequence(live, model, tok):
    want = solo(model, tok, PROMPTS[3], 30)
    stop_word = tok.decode([want[4]])
    first = [tok.decode([t]) for t in want].index(stop_word)
    r = text_generation.Client(live.url).generate(PROMPTS[3], max_new_tokens=30, stop_sequences=[stop_word])
    assert r.details.finish_reason.value == "stop_sequence"
    assert [t.id for t in r.details.tokens] == want[: first + 1]


BAD = [
    (b"{not json", 400, "Failed to parse the request body as JSON"),
    (b'{"inputs": "w2", "parameters": {"max_new_tokens": 5, "frobnicate": 1}}', 422, "unknown field `frobnicate`"),
    (b'{"inputs": "w2", "bogus": true}', 422, "unknown field `bogus`"),
    (b'{"inputs": "w2", "parameters": {"temperature": -1}}', 422, "`temperature` must be strictly positive"),
    (b'{"inputs": "w2", "parameters": {"top_p": 1.5}}', 422, "`top_p` must be > 0.0 and < 1.0"),
    (b'{"inputs": "w2", "parameters": {"top_k": 0}}', 422, "`top_k` must be strictly positive"),
    (b'{"inputs": "w2", "parameters": {"max_new_tokens": 0}}', 422, "`max_new_tokens` must be strictly positive"),
    (b'{"inputs": "w2", "parameters": {"max_new_tokens": "many"}}', 422, "max_new_tokens"),
    (b'{"inputs": "", "parameters": {}}', 422, "`inputs` cannot be empty"),
    (b'{"parameters": {}}', 422, "inputs"),
    (b'{"inputs": "w2", "parameters": {"best_of": 3}}', 422, "`best_of` is not supported"),
    (b'[1, 2]', 422, "expected an object"),
    (json.dumps({"inputs": " ".join(["w3"] * 60)}).encode(), 422, "`inputs` tokens must be <= 48"),
    (json.dumps({"inputs": "w3 w4", "parameters": {"max_new_tokens": 127}}).encode(), 422,
     "`inputs` tokens + `max_new_tokens` must be <= 128"),
]


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_bad_requests_get_tgi_errors_and_server_keeps_serving(live, route):
    for body, status, msg in BAD:
        r = httpx.post(live.url + route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()
        assert msg in err["error"] and err["error_type"] == "validation", (body, err)
    r = httpx.post(live.url + route, json={"inputs": "w2 w3", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200


def test_bad_chat_requests(live):
    cases = [({"messages": []}, "`messages` cannot be empty"),
             ({"messages": [{"role": "user", "content": "w2"}], "n": 9}, "`n` must be <= 4 (--max-batch"),
             ({"messages": [{"role": "user", "content": "w2"}], "temperature": 9}, "temperature"),
             ({"messages": [{"role": "user", "content": "w2"}], "mystery": 1}, "unknown field `mystery`")]
    for body, msg in cases:
        r = httpx.post(live.url + "/v1/chat/completions", json=body)
        assert r.status_code == 422 and msg in r.json()["error"]["message"], (body, r.text)


def test_client_sees_validation_error(live):
    with pytest.raises(text_generation.errors.ValidationError, match="must be <= 48"):
        text_generation.Client(live.url).generate(" ".join(["w3"] * 60), max_new_tokens=2)


def test_info_health_metrics(live):
    info = httpx.get(live.url + "/info").json()
    assert info["max_total_tokens"] == 128 and info["max_input_tokens"] == 48 and info["max_batch_size"] == 4
    assert info["speculation"]["proposer"] == "ngram" and info["speculation"]["max_draft_length"] == 5
    assert info["speculation"]["lossy"] is False
    assert httpx.get(live.url + "/health").status_code == 200
    httpx.post(live.url + "/generate", json={"inputs": "w2 w3 w2 w3", "parameters": {"max_new_tokens": 8}})
    text = httpx.get(live.url + "/metrics").text
    for name in ('spec_requests_total{route="generate",status="200"}', "spec_request_duration_seconds_bucket",
                 "spec_generated_tokens_total", "spec_target_forwards_total", "spec_draft_tokens_total",
                 "spec_accepted_tokens_total", 'spec_acceptance_rate{position="0"}', "spec_batch_size",
                 "spec_draft_length ", 'spec_policy_draft_length{batch="1"}'):
        assert name in text, name
    assert live.metric("spec_target_forwards_total") > 0
    # per sequence per round (vLLM's mean acceptance length), the batch figure under its own name
    mean, per_forward = live.metric("spec_mean_accepted_tokens"), live.metric("spec_tokens_per_forward")
    assert 1.0 <= mean <= 6.0 and per_forward >= mean
    assert live.metric("spec_row_rounds_total") >= live.metric("spec_target_forwards_total")
    assert live.metric("spec_lossy") == 0


def test_disconnect_mid_stream_frees_slot(model):
    tok = tiny_tokenizer(eos=False)  # no EOS: only the length limit (or a cancel) ends a request
    big = LiveServer(tiny_llama(seed=3, max_pos=4096), tok, max_total=4000, max_input=32, policy="fixed")
    try:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", big.url + "/generate_stream",
                          json={"inputs": "w2 w3", "parameters": {"max_new_tokens": 3900}}) as r:
                lines = 0
                for line in r.iter_lines():
                    lines += line.startswith("data:")
                    if lines == 3:
                        break  # hang up mid-stream
        deadline = time.time() + 20
        while big.metric("spec_batch_size") != 0 or big.metric("spec_requests_cancelled_total") < 1:
            assert time.time() < deadline, "slot not freed after the client disconnected"
            time.sleep(0.1)
        assert big.metric("spec_decoded_tokens_total") < 3900  # stopped early, not run to the limit
        r = httpx.post(big.url + "/generate", json={"inputs": "w2", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200
    finally:
        big.stop()


def test_graceful_shutdown_finishes_in_flight_stream(model):
    tok = tiny_tokenizer(eos=False)
    srv = LiveServer(model, tok, max_total=200, max_input=16, policy="fixed")
    events = []

    def consume():
        with httpx.stream("POST", srv.url + "/generate_stream", timeout=60,
                          json={"inputs": "w2 w3", "parameters": {"max_new_tokens": 190}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.time() + 30
    while not events:
        assert time.time() < deadline
        time.sleep(0.005)
    srv.stop()  # SIGTERM equivalent: stop accepting, let in-flight requests finish
    t.join(timeout=60)
    assert events[-1]["details"]["finish_reason"] == "length" and len(events) == 190
    assert not srv.state.scheduler.alive
    with pytest.raises(httpx.ConnectError):
        httpx.post(srv.url + "/generate", json={"inputs": "w2"})


def test_scheduler_stop_cancels_what_cannot_finish():
    """A job in flight when the scheduler stops with no time left gets a clear error after the
    tokens it already had, and nothing new is accepted."""
    from spec_plugins.server.scheduler import Job
    from spec_plugins.types import RowRequest

    srv = LiveServer(tiny_llama(seed=3, max_pos=4096), tiny_tokenizer(eos=False), max_total=4000, max_input=16,
                     policy="fixed")
    sched = srv.state.scheduler
    loop = asyncio.new_event_loop()
    try:
        job = Job(RowRequest(sched.new_key(), [2, 3], 3900), loop)
        sched.submit(job)
        first = loop.run_until_complete(asyncio.wait_for(job.queue.get(), 30))
        assert first[0] == "tokens"  # in flight
        sched.stop(timeout=0.0)  # nothing may finish
        events = [first]
        while events[-1][0] == "tokens" and events[-1][3] is None:
            events.append(loop.run_until_complete(asyncio.wait_for(job.queue.get(), 30)))
        assert events[-1] == ("error", "the server shut down before this request finished")
        assert sum(len(e[1]) for e in events[:-1]) < 3900
        with pytest.raises(RuntimeError, match="shutting down"):
            sched.submit(Job(RowRequest(sched.new_key(), [2, 3], 5), loop))
        assert not sched.alive
    finally:
        loop.close()
        srv.stop()


def test_suffix_global_index_in_the_server_per_tenant(model, tok):
    """One index shared by all requests of a tenant (X-Tenant header), updated as requests
    finish; /metrics shows its size and hits; outputs equal solo greedy; the cap holds."""
    from spec_plugins.proposers.suffix import SuffixProposer

    prop = SuffixProposer(SuffixProposer.Config(scope="tenant", tree_nodes=8, min_token_prob=0.0,
                                                global_max_tokens=200))
    srv = LiveServer(model, tok, max_batch=4, proposer=prop, policy="fixed")
    try:
        jobs = list(zip(PROMPTS * 2, [25, 9, 31, 14, 20] * 2))
        for tenant in ("a", "b"):
            client = text_generation.AsyncClient(srv.url, timeout=120, headers={"X-Tenant": tenant})

            async def main():
                return await asyncio.gather(*(client.generate(p, max_new_tokens=n) for p, n in jobs))

            for (p, n), r in zip(jobs, asyncio.run(main())):
                assert [t.id for t in r.details.tokens] == solo(model, tok, p, n), p
        # tenant b's requests came last; under the 200-token cap a tenant whose requests were all
        # evicted holds no index at all
        assert ("tenant", "b") in prop.index.tries and set(prop.index.tries) <= {("tenant", "a"), ("tenant", "b")}
        assert all(held[0] > 0 for held in prop.index.held.values())
        assert srv.metric("spec_suffix_index_keys") == len(prop.index.tries)
        assert srv.metric("spec_suffix_index_requests") >= 1 and srv.metric("spec_suffix_index_hits_total") > 0
        assert srv.metric("spec_suffix_index_tokens") <= 200 == srv.metric("spec_suffix_index_max_tokens")
        assert srv.metric("spec_suffix_index_evicted_requests_total") > 0
        r = httpx.post(srv.url + "/generate", json={"inputs": "w2", "parameters": {"max_new_tokens": 2}},
                       headers={"X-Tenant": "x" * 200})
        assert r.status_code == 422 and "X-Tenant" in r.json()["error"]
    finally:
        srv.stop()


def test_a_hybrid_reports_its_suffix_index_metrics(model, tok):
    """A suffix + EAGLE hybrid in the server shows the suffix index's metrics on /metrics (the
    proposer declares ``ReportsMetrics``; nothing is read off a proposer's attributes)."""
    from test_heads import eagle

    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.hybrid import HybridProposer
    from spec_plugins.proposers.suffix import SuffixProposer

    suffix = SuffixProposer(SuffixProposer.Config(scope="global", tree_nodes=8, min_token_prob=0.0))
    eag = EagleProposer(EagleProposer.Config(heads="unused", tree_nodes=6, top_k=2), drafter=eagle(model))
    hyb = HybridProposer(HybridProposer.Config(proposers=[{"type": "suffix"}, {"type": "eagle", "heads": "x"}]),
                         children=[suffix, eag])
    srv = LiveServer(model, tok, max_batch=2, proposer=hyb, policy="fixed")
    try:
        for p, n in zip(PROMPTS[:3], [12, 9, 10]):
            r = text_generation.Client(srv.url, timeout=60).generate(p, max_new_tokens=n)
            assert [t.id for t in r.details.tokens] == solo(model, tok, p, n)
        assert srv.metric("spec_suffix_index_requests") >= 1
        assert srv.metric("spec_suffix_index_lookups_total") > 0
    finally:
        srv.stop()


def _events(url: str, body: dict, out: list) -> None:
    """The SSE events of one /generate_stream request, appended to ``out`` as they come; a stream
    that breaks off ends with ``{"broken": ...}``."""
    try:
        with httpx.stream("POST", url + "/generate_stream", timeout=120, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    out.append(json.loads(line[5:]))
    except httpx.HTTPError as exc:
        out.append({"broken": repr(exc)})


@pytest.mark.parametrize("timeout", [0.0, 0.5])
def test_serve_shutdown_ends_what_cannot_finish_with_an_error_event(monkeypatch, timeout):
    """`spec-plugins serve --shutdown-timeout T` (below a second, 0 included): a stream still
    running when the server is asked to exit ends with the scheduler's error event, and the server
    exits. (T < 1 was uvicorn's "wait forever"; and uvicorn's own deadline cut streams off with no
    event before the lifespan, which sends it, ran.)"""
    from typer.testing import CliRunner

    from spec_plugins.cli import app as cli

    tok = tiny_tokenizer(eos=False)
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, max_pos=4096), tok),
                             NgramProposer(NgramProposer.Config(num_draft_tokens=5)), ExactVerifier(), tokenizer=tok)
    monkeypatch.setattr(SpeculativeDecoder, "from_config", classmethod(lambda cls, cfg: dec))
    port = free_port()
    events: list = []
    exited: list = []
    real_run = uvicorn.Server.run

    def run(server, sockets=None):  # serve in a thread, stream, then ask the server to exit
        thread = serve_in_thread(server, lambda: real_run(server))
        deadline = time.time() + 30
        body = {"inputs": "w2 w3", "parameters": {"max_new_tokens": 3900}}
        consumer = threading.Thread(target=_events, args=(f"http://127.0.0.1:{port}", body, events), daemon=True)
        consumer.start()
        while len(events) < 3:
            assert time.time() < deadline and consumer.is_alive(), events
            time.sleep(0.005)
        server.should_exit = True  # what SIGTERM does
        thread.join(timeout=60)
        consumer.join(timeout=60)
        exited.append(not thread.is_alive())

    monkeypatch.setattr(uvicorn.Server, "run", run)
    res = CliRunner().invoke(cli, ["serve", "--port", str(port), "--max-total-tokens", "4000",
                                   "--max-input-tokens", "16", "--draft-policy", "fixed",
                                   "--shutdown-timeout", str(timeout)])
    assert res.exit_code == 0, res.output
    assert exited == [True]
    assert events[-1].get("error_type") == "generation", events[-1]
    assert "the server shut down before this request finished" in events[-1]["error"]
    assert all("token" in e for e in events[:-1]) and len(events) - 1 < 3900


def test_a_requests_choices_join_the_batch_in_one_round_and_none_overtakes_them(model):
    """n choices wait until the batch has room for all of them, and are admitted in the same
    round (with 1 of 4 slots busy, n=4 used to join as 3 + 1); a request queued after them waits
    its turn instead of taking the free slots first; a request larger than the batch is refused."""
    from spec_plugins.server.scheduler import Job
    from spec_plugins.types import RowRequest

    srv = LiveServer(tiny_llama(seed=3, max_pos=4096), tiny_tokenizer(eos=False), max_batch=4, max_total=4000,
                     max_input=32, policy="fixed")
    sched, batch, added = srv.state.scheduler, srv.state.batch, []
    real_add, real_remove = batch.add, batch.remove
    park, parked, resume = threading.Event(), threading.Event(), threading.Event()

    def add(rows):  # observed, not changed
        added.append([r.key for r in rows])
        return real_add(rows)

    def remove(keys):  # the decode thread calls it every iteration: there it waits while parked
        if park.is_set():
            parked.set()
            resume.wait(60)
            park.clear()
        return real_remove(keys)

    batch.add, batch.remove = add, remove
    answers: dict[str, httpx.Response] = {}

    def post(name: str, route: str, body: dict) -> threading.Thread:
        t = threading.Thread(target=lambda: answers.setdefault(name, httpx.post(srv.url + route, json=body,
                                                                                timeout=120)))
        t.start()
        return t

    def wait_until(cond) -> None:
        deadline = time.time() + 30
        while not cond():
            assert time.time() < deadline, (sched.snapshot(), added)
            time.sleep(0.01)

    try:
        long = {"inputs": "w2 w3", "parameters": {"max_new_tokens": 3900}}
        with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/generate_stream", json=long) as r:
            lines = r.iter_lines()  # one iterator: a dropped one closes the stream
            next(lines)  # it holds one slot
            park.set()
            wait_until(parked.is_set)  # the decode thread waits between rounds: requests queue up
            choices = post("choices", "/v1/completions", {"prompt": "w5 w6", "max_tokens": 8, "n": 4,
                                                          "temperature": 1.0, "seed": 3})
            wait_until(lambda: sched.snapshot()["queue"] == 4)
            single = post("single", "/generate", {"inputs": "w7", "parameters": {"max_new_tokens": 4}})
            wait_until(lambda: sched.snapshot()["queue"] == 5)
            forwards = batch.stats.target_forwards
            resume.set()
            wait_until(lambda: batch.stats.target_forwards >= forwards + 2)  # rounds with 3 slots free
        # the hang-up frees the long request's slot
        choices.join(timeout=120)
        single.join(timeout=120)
        assert answers["choices"].status_code == 200 and len(answers["choices"].json()["choices"]) == 4
        assert answers["single"].status_code == 200
        assert [len(keys) for keys in added] == [1, 4, 1], added
        assert max(added[1]) < added[2][0], added  # the request queued later joined later
        loop = asyncio.new_event_loop()
        try:
            with pytest.raises(ValueError, match="cannot join a batch of 4 slots"):
                sched.submit([Job(RowRequest(sched.new_key(), [2, 3], 2), loop) for _ in range(5)])
        finally:
            loop.close()
    finally:
        resume.set()
        srv.stop()
