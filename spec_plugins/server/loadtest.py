"""Loopback load test: speculation on vs off, same run, same prompts, greedy.

Starts two servers (``serve`` with the config, and with ``--no-speculation``) on free loopback
ports, computes each prompt's solo greedy output in-process (plain decoding, batch 1), then for
every concurrency level runs a bounded number of requests against each server in turn and checks
that every request completed and returned exactly its prompt's solo output (no cross-talk).
Reports throughput (generated tokens / wall time of the level) and p50/p95 latency of the
successful requests (``percentile``: a measured sample, numpy's ``method="nearest"``); failed
requests (any status but 200, or a transport error: ``transport: ReadTimeout``) are counted
apart, by status, with their own latencies in ``results``, so a fast 422 or 429 never pulls the
percentiles below every served request, and a timeout or a reset never loses the report.
``--draft-policies load,fixed`` starts one speculating server per draft policy, so the two are
compared side by side in one run.

    flock /tmp/spec-bench.lock python -m spec_plugins.server.loadtest --config examples/configs/smollm2-server.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spec_plugins.server.setup import DRAFT_POLICIES

PROMPTS = [
    "What is the capital of France?",
    "List the planets of the solar system.",
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes, "
    "honeydew, kiwis, lemons.",
    "Copy the following paragraph verbatim: The quick brown fox jumps over the lazy dog. The dog did not move. "
    "The fox ran into the forest, where it met an owl who asked it where it was going so late at night.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "Rewrite both functions with type hints and docstrings.",
    "Write a haiku about the sea.",
    "Translate to French: The cat sleeps on the mat and the dog sleeps by the door.",
    "Explain in two sentences what a binary search is.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(config: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``spec-plugins serve`` in a subprocess on a free loopback port (``--ray ...`` in ``extra``
    serves it through Ray Serve)."""
    port = _free_port()
    cmd = [sys.executable, "-c", "from spec_plugins.cli import app; app()", "serve", "--config", config, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ,
                                                                                   "HF_HUB_OFFLINE": "1"})
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server {url} not healthy after {timeout}s")


def percentile(xs: list[float], q: float) -> float:
    """The sample at rank ``round(q * (n - 1))`` of the sorted ``xs`` (numpy's ``method="nearest"``):
    always a measured value, never an interpolation."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def _level(url: str, inputs: list[str], n_requests: int, clients: int, max_new: int) -> dict[str, Any]:
    import httpx

    todo = list(range(n_requests))
    results: list[dict[str, Any]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop(0)
            p = i % len(inputs)
            t0 = time.perf_counter()
            try:
                r: httpx.Response | None = await client.post(url + "/generate", json={
                    "inputs": inputs[p], "parameters": {"max_new_tokens": max_new, "details": True}})
            except httpx.TransportError as exc:  # a failure like a status: the report goes on
                r, error = None, f"transport: {type(exc).__name__}"
            dt = time.perf_counter() - t0
            status = r.status_code if r is not None else error
            ok = status == 200
            ids = [t["id"] for t in r.json()["details"]["tokens"]] if r is not None and ok else []
            results.append({"prompt": p, "ok": ok, "status": status, "latency": dt, "ids": ids})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    wall = time.perf_counter() - t0
    ok = [r["latency"] for r in results if r["ok"]]
    failed: dict[int | str, int] = {}
    for r in results:
        if not r["ok"]:
            failed[r["status"]] = failed.get(r["status"], 0) + 1
    tokens = sum(len(r["ids"]) for r in results)
    return {"requests": n_requests, "clients": clients, "completed": len(ok), "failed": len(results) - len(ok),
            "failed_statuses": failed, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "p50_s": percentile(ok, 0.5) if ok else None, "p95_s": percentile(ok, 0.95) if ok else None,
            "results": results}


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (Linux), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#") and (line.startswith("spec_policy_draft_length")
                                                  or line.split("{")[0].split(" ")[0] in (
                "spec_target_forwards_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
                "spec_mean_accepted_tokens") or line.startswith("spec_suffix_index")):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/smollm2-server.yaml")
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--requests", default="16,32,64", help="requests per level (comma list, one per level)")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--out", default="loadtest.json")
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--prompts", default=None, help="a bench prompt file (first turns) instead of the built-in prompts")
    ap.add_argument("--ray-replicas", default="", help="instead of spec off/on: the config served by Ray Serve with "
                                                       "these replica counts, e.g. 1,2")
    ap.add_argument("--draft-policies", default="load",
                    help="the speculating server's --draft-policy; several (load,fixed) start one server each, "
                         "measured in turn at every level")
    a = ap.parse_args(argv)
    policies = [p for p in a.draft_policies.split(",") if p]
    if not policies or any(p not in DRAFT_POLICIES for p in policies):
        ap.error(f"--draft-policies takes load and/or fixed, got {a.draft_policies!r}")
    if a.ray_replicas and policies != ["load"]:
        ap.error("--draft-policies compares single servers; with --ray-replicas each replica uses load")
    levels = [int(x) for x in a.levels.split(",")]
    counts = [int(x) for x in a.requests.split(",")]
    if len(counts) != len(levels):
        ap.error("--requests needs one count per level")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    servers = {}
    common = ["--max-batch", str(a.max_batch), "--max-total-tokens", "1024", "--max-input-tokens", "512"]
    try:
        modes = [("off", ["--no-speculation"])]
        modes += [("on" if len(policies) == 1 else f"on-{p}", ["--draft-policy", p]) for p in policies]
        if a.ray_replicas:
            cpus = max(1, (os.cpu_count() or 2) // max(int(r) for r in a.ray_replicas.split(",")))
            modes = [(f"ray{r}", ["--ray", "--replicas", r, "--num-cpus", str(cpus)]) for r in a.ray_replicas.split(",")]
        for mode, extra in modes:
            servers[mode] = _start(a.config, common + extra, Path(a.logs) / f"spec-loadtest-{mode}.log")
        for mode, (proc, url) in servers.items():
            _wait_healthy(url, proc)

        from spec_plugins.config import SpecConfig
        from spec_plugins.decoder import SpeculativeDecoder

        dec = SpeculativeDecoder.from_config(SpecConfig.from_file(a.config)).without_speculation()
        tok = dec.tokenizer
        texts = PROMPTS
        if a.prompts:
            from spec_plugins.bench.prompts import load_prompts

            texts = [p.turns[0] for p in load_prompts(a.prompts)]
        inputs = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=False) for p in texts]
        refs = []
        for text in inputs:
            ids = list(tok(text, add_special_tokens=True)["input_ids"])
            refs.append(dec.generate(ids, max_new_tokens=a.max_new_tokens).token_ids)
        print(f"prompt lengths (tokens): {[len(tok(t)['input_ids']) for t in inputs]}", flush=True)

        from spec_plugins.bench.docs import machine

        report: dict[str, Any] = {"machine": machine(), "max_new_tokens": a.max_new_tokens, "max_batch": a.max_batch,
                                  "levels": []}
        for clients, n in zip(levels, counts):
            row: dict[str, Any] = {"clients": clients}
            for mode in servers:
                proc, url = servers[mode]
                res = asyncio.run(_level(url, inputs, n, clients, a.max_new_tokens))
                mism = [r["prompt"] for r in res["results"] if r["ok"] and r["ids"] != refs[r["prompt"]]]
                res["mismatches"] = len(mism)
                res["mismatched_prompts"] = sorted(set(mism))
                res.pop("results")
                row[mode] = res
                pcts = " ".join(f"{k[:3]}={res[k]:.2f}s" if res[k] is not None else f"{k[:3]}=-" for k in ("p50_s", "p95_s"))
                print(f"clients={clients:3d} spec={mode:9s} requests={n} completed={res['completed']} "
                      f"failed={res['failed_statuses']} mismatches={len(mism)} tokens/s={res['tokens_per_s']:.1f} "
                      f"{pcts} (latency of the completed)", flush=True)
            report["levels"].append(row)
        report["metrics"] = {mode: _metrics(url) for mode, (_, url) in servers.items()}
        report["info"] = {mode: __import__("httpx").get(url + "/info").json() for mode, (_, url) in servers.items()}
        report["rss_mib_at_end"] = {mode: rss_mib(proc.pid) for mode, (proc, _) in servers.items()}
        Path(a.out).write_text(json.dumps(report, indent=2))
        print(json.dumps(report["metrics"], indent=1))
        return 0
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
