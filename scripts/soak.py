"""Soak the single-machine server (issue 23): thousands of requests at a fixed concurrency, mixed
lengths and sampling settings, with the server's resident memory sampled through the run.

Greedy requests are checked against the same request alone (sampled ones cannot be: a seed
reproduces an output only under the same draft schedule, which depends on the batch). Reports
completed / failed counts, RSS after warm-up and at the end, and p95 latency of the first and
last 10 % of requests.

    python scripts/soak.py --config examples/configs/smollm2-server-onnx.yaml --requests 2000 --clients 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spec_plugins.server.loadtest import PROMPTS, _start, _wait_healthy, rss_mib  # noqa: E402


def plan(n: int, seed: int = 0) -> list[dict]:
    """Mixed requests: prompt, length 4-64, greedy or sampled (temperature / top-k / top-p), seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        params: dict = {"max_new_tokens": rng.choice([4, 8, 16, 24, 32, 48, 64]), "details": True}
        kind = rng.random()
        if kind < 0.5:
            pass  # greedy
        elif kind < 0.8:
            params.update(do_sample=True, temperature=rng.choice([0.3, 0.7, 1.0, 1.3]), seed=rng.randrange(2**31))
        else:
            params.update(do_sample=True, temperature=1.0, top_k=rng.choice([5, 20, 50]), top_p=rng.choice([0.8, 0.95]),
                          seed=rng.randrange(2**31))
        out.append({"i": i, "prompt": rng.randrange(len(PROMPTS)), "parameters": params})
    return out


async def run(url: str, inputs: list[str], jobs: list[dict], clients: int, pid: int) -> tuple[list[dict], list]:
    import httpx

    todo = list(jobs)
    done: list[dict] = []
    rss: list[tuple[int, float]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            job = todo.pop(0)
            t0 = time.perf_counter()
            try:
                r = await client.post(url + "/generate", json={"inputs": inputs[job["prompt"]],
                                                               "parameters": job["parameters"]})
                ok = r.status_code == 200
                ids = [t["id"] for t in r.json()["details"]["tokens"]] if ok else []
                status = r.status_code
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
                ok, ids, status = False, [], repr(exc)[:80]
            done.append({**job, "ok": ok, "ids": ids, "status": status, "latency": time.perf_counter() - t0})
            if len(done) % 100 == 0:
                rss.append((len(done), rss_mib(pid)))
                print(f"{len(done)} done, rss {rss[-1][1]:.0f} MiB", flush=True)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return done, rss


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="examples/configs/smollm2-server-onnx.yaml")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--out", default="soak.json")
    a = ap.parse_args()
    import httpx

    proc, url = _start(a.config, ["--max-batch", str(a.max_batch), "--max-total-tokens", "1024",
                                  "--max-input-tokens", "512"], Path("/tmp/spec-soak.log"))
    try:
        _wait_healthy(url, proc)
        from spec_plugins.config import SpecConfig
        from spec_plugins.decoder import SpeculativeDecoder

        dec = SpeculativeDecoder.from_config(SpecConfig.from_file(a.config)).without_speculation()
        tok = dec.tokenizer
        inputs = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=False) for p in PROMPTS]
        jobs = plan(a.warmup + a.requests)
        warm, _ = asyncio.run(run(url, inputs, jobs[: a.warmup], a.clients, proc.pid))
        rss_start = rss_mib(proc.pid)
        t0 = time.perf_counter()
        done, rss = asyncio.run(run(url, inputs, jobs[a.warmup:], a.clients, proc.pid))
        wall = time.perf_counter() - t0
        rss_end = rss_mib(proc.pid)
        # correctness: greedy requests against the same request alone
        refs: dict[tuple, list[int]] = {}
        checked = wrong = 0
        greedy = [d for d in done if d["ok"] and not d["parameters"].get("do_sample")]
        sample = greedy[:: max(1, len(greedy) // 200)]  # ~200 spread over the run
        for d in sample:
            key = (d["prompt"], json.dumps(d["parameters"], sort_keys=True))
            if key not in refs:
                r = httpx.post(url + "/generate", json={"inputs": inputs[d["prompt"]], "parameters": d["parameters"]},
                               timeout=600)
                refs[key] = [t["id"] for t in r.json()["details"]["tokens"]]
            checked += 1
            wrong += d["ids"] != refs[key]
        done.sort(key=lambda d: d["i"])
        tenth = max(1, len(done) // 10)
        report = {
            "config": a.config, "requests": len(done), "clients": a.clients, "warmup": a.warmup,
            "completed": sum(d["ok"] for d in done), "failed": sum(not d["ok"] for d in done),
            "failures": sorted({str(d["status"]) for d in done if not d["ok"]}),
            "wall_s": round(wall, 1), "tokens": sum(len(d["ids"]) for d in done),
            "rss_mib_after_warmup": rss_start, "rss_mib_end": rss_end,
            "rss_growth": round(rss_end / rss_start - 1, 4) if rss_start else None,
            "rss_mib_every_100": rss,
            "p95_first_10pct_s": round(p95([d["latency"] for d in done[:tenth]]), 3),
            "p95_last_10pct_s": round(p95([d["latency"] for d in done[-tenth:]]), 3),
            "outputs_checked": checked, "outputs_differing_from_solo": wrong,
            "metrics": httpx.get(url + "/metrics").text.count("\n"),
        }
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({k: v for k, v in report.items() if k != "rss_mib_every_100"}, indent=1))
        return 0 if report["failed"] == 0 and wrong == 0 else 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
