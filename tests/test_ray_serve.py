"""The server as a Ray Serve deployment, on loopback: a local Ray, 2 replicas of a tiny model, the
real TGI and Hugging Face clients. Concurrent greedy requests equal solo output, bad requests get
the single server's 4xx bodies, each replica reports itself, and when a replica is killed with
requests in flight each of them completes correctly or fails visibly, and the deployment returns
to 2 healthy replicas."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers import plain_greedy

from conftest import tiny_llama

ray = pytest.importorskip("ray", reason="Ray Serve tests need the [ray] extra")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
text_generation = pytest.importorskip("text_generation")

from spec_plugins.server.ray_serve import ReplicaOptions, Scaling, application  # noqa: E402
from support import free_port  # noqa: E402

WORDS = [f"w{i}" for i in range(2, 32)]
PROMPTS = ["w2 w3 w4 w2 w3 w4 w2", "w9 w8 w7 w6 w5 w9 w8 w7 w6 w5 w9", "w17", "w5 w5 w5 w5 w5 w5 w6",
           "w30 w31 w30 w31 w30", "w11 w12 w13"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}w2")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray") / "tiny"
    _tokenizer().save_pretrained(str(d))
    tiny_llama(seed=3, layers=4, hidden=128, max_pos=1024).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def deployed(model_dir):
    port = free_port()
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = {"target": {"backend": "torch", "model": str(model_dir)},
              "proposer": {"type": "ngram", "num_draft_tokens": 4}}
    opts = ReplicaOptions(config, max_batch=4, max_total_tokens=1024, max_input_tokens=64, draft_policy="fixed",
                          shutdown_timeout=5.0, threads=1)
    serve.run(application(opts, Scaling(replicas=2, num_cpus=0.5)), name="spec-plugins", route_prefix="/")
    startup = time.perf_counter() - t0
    yield f"http://127.0.0.1:{port}", startup
    serve.shutdown()
    ray.shutdown()


def solo(model, tok, text, n):
    return plain_greedy(model, tok(text)["input_ids"], n, eos=[tok.eos_token_id])


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval(), _tokenizer()


def test_concurrent_requests_equal_solo_through_both_clients(deployed, reference, monkeypatch):
    url, startup = deployed
    model, tok = reference
    client = text_generation.AsyncClient(url, timeout=120)
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + 3 * i) for i in range(16)]

    async def main():
        return await asyncio.gather(*(client.generate(p, max_new_tokens=n) for p, n in jobs))

    for (p, n), r in zip(jobs, asyncio.run(main())):
        assert [t.id for t in r.details.tokens] == solo(model, tok, p, n), p
    streamed = [r.token.id for r in text_generation.Client(url, timeout=60).generate_stream(PROMPTS[1], max_new_tokens=12)]
    assert streamed == solo(model, tok, PROMPTS[1], 12)
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the client talks to loopback only
    hf = InferenceClient(base_url=url, timeout=60)
    for p in PROMPTS[:3]:
        events = list(hf.text_generation(p, max_new_tokens=10, stream=True, details=True))
        assert [e.token.id for e in events] == solo(model, tok, p, 10)
        assert events[-1].details is not None and events[-1].details.generated_tokens == len(events)
    seen = {httpx.get(url + "/info").json()["replica"] for _ in range(30)}
    assert len(seen) == 2  # both replicas answer, each with its own id
    assert 'replica="' in httpx.get(url + "/metrics").text
    assert httpx.get(url + "/health").status_code == 200
    print(f"Ray start-up incl. 2 replicas: {startup:.1f} s")


def test_bad_requests_get_the_single_servers_bodies(deployed):
    url, _ = deployed
    r = httpx.post(url + "/generate", json={"inputs": "", "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 422 and r.json() == {"error": "`inputs` cannot be empty", "error_type": "validation"}
    r = httpx.post(url + "/generate", json={"inputs": "w2", "parameters": {"temperature": -1, "do_sample": True}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    r = httpx.get(url + "/nowhere")
    assert r.status_code == 404 and r.json()["error_type"] == "http"


def _replica_handles():
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA")]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]


def _running_replicas() -> int:
    st = serve.status().applications["spec-plugins"].deployments["spec-plugins"]
    return st.replica_states.get("RUNNING", 0)


def test_killing_a_replica_mid_flight_fails_visibly_and_recovers(deployed, reference):
    url, _ = deployed
    model, tok = reference
    outcomes = {"completed": 0, "errored": 0, "wrong": 0}
    lock = threading.Lock()
    streaming = threading.Event()  # set at the first streamed token: requests are being served

    def one(i: int) -> None:
        p, n = PROMPTS[i % len(PROMPTS)], 300
        stream = i % 2 == 0
        try:
            if stream:
                toks, final = [], None
                for ev in text_generation.Client(url, timeout=120).generate_stream(p, max_new_tokens=n):
                    streaming.set()
                    toks.append(ev.token.id)
                    final = ev.details
                ok = final is not None  # the last event carries the finish reason; without it: cut off
                result = toks if ok else None
            else:
                r = text_generation.Client(url, timeout=120).generate(p, max_new_tokens=n)
                result = [t.id for t in r.details.tokens]
        except Exception:  # noqa: BLE001 - any visible error is an acceptable outcome
            result = None
        with lock:
            if result is None:
                outcomes["errored"] += 1
            elif result == solo(model, tok, p, n):
                outcomes["completed"] += 1
            else:
                outcomes["wrong"] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    # Kill at the first streamed token rather than after a fixed sleep: on a fast CPU the tiny
    # model can finish all 8 requests within a second, and the kill would then hit an idle replica.
    assert streaming.wait(60), "no request started streaming"
    victim = _replica_handles()[0]
    t_kill = time.perf_counter()
    ray.kill(victim, no_restart=True)
    with lock:
        in_flight = 8 - sum(outcomes.values())
    for t in threads:
        t.join(timeout=180)
    deadline = time.time() + 120
    while _running_replicas() < 2:
        assert time.time() < deadline, "the deployment did not return to 2 replicas"
        time.sleep(0.5)
    recovery = time.perf_counter() - t_kill
    assert outcomes["wrong"] == 0, outcomes
    assert outcomes["completed"] + outcomes["errored"] == 8
    r = text_generation.Client(url, timeout=60).generate(PROMPTS[2], max_new_tokens=6)
    assert [t.id for t in r.details.tokens] == solo(model, tok, PROMPTS[2], 6)
    print(f"fault test: {in_flight} of 8 in flight at the kill, {outcomes}, "
          f"back to 2 replicas {recovery:.1f} s after the kill")


def test_body_timeout_and_cpu_workers_reach_each_replica(model_dir, tmp_path):
    """``serve --ray`` carries them in the Serve config file, and each replica's state applies them."""
    import dataclasses

    import yaml
    from typer.testing import CliRunner

    from spec_plugins.cli import app
    from spec_plugins.server import ray_serve

    cfg = tmp_path / "spec.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(model_dir)}}))
    out = tmp_path / "serve.yaml"
    res = CliRunner().invoke(app, ["serve", "--ray", "-c", str(cfg), "--body-timeout", "3", "--cpu-workers", "5",
                                   "--write-config", str(out)])
    assert res.exit_code == 0, res.output
    opts = ReplicaOptions(**yaml.safe_load(out.read_text())["applications"][0]["args"]["options"])
    assert (opts.body_timeout, opts.cpu_workers) == (3.0, 5)
    ray_serve.build_replica_app(dataclasses.replace(opts, threads=None))  # as a replica builds it, outside Ray
    state = ray_serve._REPLICA["state"]
    assert (state.body_timeout, state.cpu_workers, state.cpu_limiter.total_tokens) == (3.0, 5, 5)


@pytest.mark.parametrize("replicas", ["3", "1"])  # 1 is the default, given explicitly
@pytest.mark.parametrize("mode", ["--write-config", "--ray"])
def test_replicas_with_autoscale_is_refused_before_anything_is_written(model_dir, tmp_path, monkeypatch, replicas,
                                                                        mode):
    """``--replicas N --autoscale MIN:MAX``: --autoscale used to win and --replicas was dropped
    without a word, in the written config too. Now the command exits 2 naming both flags, with no
    file written and no Ray started."""
    import yaml
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", no_ray)
    cfg = tmp_path / "spec.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(model_dir)}}))
    out = tmp_path / "serve.yaml"
    args = ["serve", "-c", str(cfg), "--replicas", replicas, "--autoscale", "1:2"]
    args += ["--write-config", str(out)] if mode == "--write-config" else ["--ray", "--port", "0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, (res.output, res.exception)
    assert f"--replicas {replicas} and --autoscale 1:2" in res.output, res.output
    assert not out.exists()


def test_ctrl_c_drains_in_flight_streams_before_the_proxy_stops(model_dir, tmp_path):
    """``spec-plugins serve --ray`` on Ctrl-C: a stream in flight ends with its final event and
    every token it was due. ``serve.shutdown`` alone took Ray's proxy down with the replicas and cut
    the stream; the app is now deleted first, so its replica drains while the proxy carries the
    stream, then Serve and Ray stop and the command exits 0."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "spec.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(model_dir)}}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "from spec_plugins.cli import app; app()", "serve", "--ray",
                             "-c", str(cfg), "--port", str(port), "--no-speculation", "--max-total-tokens", "1024",
                             "--max-input-tokens", "16", "--num-cpus", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    serving, err = threading.Event(), []

    def read_stderr() -> None:
        for line in proc.stderr:
            err.append(line)
            if "serving on" in line:
                serving.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        assert serving.wait(180), "".join(err[-30:])
        events, first = [], threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/generate_stream", timeout=120,
                                  json={"inputs": "w2", "parameters": {"max_new_tokens": 1000}}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            events.append(json.loads(line[5:]))
                            first.set()
            except httpx.HTTPError as exc:
                events.append({"broken": repr(exc)})
            first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(60), "no token came"
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        client.join(120)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    assert events and events[-1].get("details") is not None, events[-2:]
    assert events[-1]["details"]["generated_tokens"] == len(events)
    assert proc.returncode == 0 and '{"stopped": true}' in out, "".join(err[-30:])


def test_a_serve_config_with_replicas_and_autoscale_is_refused():
    """A Serve config file (``app_from_args``) or a ``Scaling`` giving a replica count beside an
    autoscale range is refused naming both, as the CLI refuses the two flags."""
    from spec_plugins.server.ray_serve import app_from_args

    with pytest.raises(ValueError, match=r"replicas 3 and autoscale \[1, 2\] both set the replica count"):
        Scaling(replicas=3, autoscale=(1, 2))
    with pytest.raises(ValueError, match="replicas 2 and autoscale"):
        app_from_args({"options": {"config": {}}, "scaling": {"replicas": 2, "autoscale": [1, 4]}})
    assert Scaling(autoscale=(1, 2)).deployment_options()["autoscaling_config"]["min_replicas"] == 1
