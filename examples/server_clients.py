"""Drive a live `spec-plugins serve` with the real TGI clients and a few bad requests, printing
what comes back (the evidence for "existing clients just work").

    python examples/server_clients.py [--config examples/configs/smollm2-server.yaml]

Starts the server on a free loopback port, then: text_generation.Client generate + stream,
AsyncClient, huggingface_hub.InferenceClient text_generation (streamed) and chat completion
(streamed), and malformed / out-of-range requests with their status codes and TGI error bodies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spec_plugins.server.loadtest import _start, _wait_healthy  # noqa: E402

TIMEOUT = 120  # seconds a client waits for an answer (the clients' 10 s fail on a loaded CPU)
BAD = [
    ("malformed JSON", b"{not json"),
    ("unknown parameter", b'{"inputs": "Hi", "parameters": {"frobnicate": 1}}'),
    ("temperature <= 0", b'{"inputs": "Hi", "parameters": {"temperature": -1}}'),
    ("top_p out of range", b'{"inputs": "Hi", "parameters": {"top_p": 1.5}}'),
    ("max_new_tokens = 0", b'{"inputs": "Hi", "parameters": {"max_new_tokens": 0}}'),
    ("empty inputs", b'{"inputs": "", "parameters": {}}'),
    ("input over --max-input-tokens", ('{"inputs": "' + "word " * 600 + '"}').encode()),
    ("tokens + max_new_tokens over --max-total-tokens", b'{"inputs": "Hi", "parameters": {"max_new_tokens": 5000}}'),
]


def log_tail(log: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the server's output: why a client call failed is often there."""
    return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def main() -> None:
    import httpx
    import text_generation
    from huggingface_hub import InferenceClient

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "examples" / "configs" / "smollm2-server.yaml"))
    a = ap.parse_args()
    fd, name = tempfile.mkstemp(prefix="spec-server-clients-", suffix=".log")
    os.close(fd)
    log = Path(name)  # the server's stdout and stderr, shown when anything here fails
    proc, url = _start(a.config, ["--max-input-tokens", "512", "--max-total-tokens", "1024"], log)
    try:
        _wait_healthy(url, proc)
        prompt = "List three primary colors."
        c = text_generation.Client(url, timeout=TIMEOUT)
        r = c.generate(prompt, max_new_tokens=20)
        print(f"Client.generate: {r.generated_text!r} ({r.details.generated_tokens} tokens, "
              f"finish={r.details.finish_reason.value})")
        streamed = [ev.token.text for ev in c.generate_stream(prompt, max_new_tokens=20)]
        print(f"Client.generate_stream: {len(streamed)} events, text {''.join(streamed)!r}")

        async def many() -> list[str]:
            ac = text_generation.AsyncClient(url, timeout=TIMEOUT)
            rs = await asyncio.gather(*(ac.generate(p, max_new_tokens=12) for p in
                                        ("Name a fruit.", "Name a planet.", "Name a color.")))
            return [x.generated_text for x in rs]

        print(f"AsyncClient x3 concurrent: {asyncio.run(many())}")
        import huggingface_hub.constants

        # HF_HUB_OFFLINE blocks the hub client's HTTP session even for loopback; this client only
        # talks to our local server (base_url), so lift it here (the server stays offline)
        huggingface_hub.constants.HF_HUB_OFFLINE = False
        hub = InferenceClient(base_url=url, timeout=TIMEOUT)
        toks = list(hub.text_generation(prompt, max_new_tokens=20, stream=True))
        print(f"InferenceClient.text_generation(stream=True): {''.join(toks)!r}")
        chunks = hub.chat_completion([{"role": "user", "content": prompt}], max_tokens=20, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        print(f"InferenceClient.chat_completion(stream=True): {text!r}")
        for name, body in BAD:
            resp = httpx.post(url + "/generate", content=body, headers={"content-type": "application/json"},
                              timeout=TIMEOUT)
            print(f"bad request, {name}: HTTP {resp.status_code} {resp.text[:160]}")
        ok = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 5}}, timeout=TIMEOUT)
        print(f"after the bad requests: HTTP {ok.status_code} {ok.json()['generated_text']!r}")
    except Exception:
        print(f"failed; the server's output ({log}) ends with:\n{log_tail(log)}", file=sys.stderr, flush=True)
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log.unlink()  # it all went well: nothing to look at


if __name__ == "__main__":
    main()
