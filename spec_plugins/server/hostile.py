"""/health latency and server memory while clients send bodies at the size cap.

Starts ``spec-plugins serve`` with the config on a free loopback port, measures /health from a
process of its own (so client-side work never delays the probe), and in each round lets
``--clients`` clients send a body of about ``--mib`` MiB at once (prompt text, brackets, a chat
message, by turns). Prints one JSON report: /health samples and percentiles, the status of every
big request, the server's RSS before, right after, and after a settle time. A /health that fails
(a status but 200, or a transport error) is counted in ``failed``, not in the percentiles, which
are those of the answered samples (``loadtest.percentile``).

    python -m spec_plugins.server.hostile --config examples/configs/smollm2-server.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

from spec_plugins.server.body import MAX_BODY_BYTES
from spec_plugins.server.loadtest import _start, _wait_healthy, percentile, rss_mib


def _bodies(size: int) -> list[tuple[str, str, bytes]]:
    """One body per kind of work it costs: text to count, brackets, a chat message to render,
    millions of numbers, of strings, of objects to parse and validate."""
    room = size - 200
    return [("text", "/generate", json.dumps({"inputs": "The quick brown fox. " * (room // 21)}).encode()),
            ("brackets", "/generate", b'{"inputs": ' + b"[" * room + b"}"),
            ("chat", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "Hello there! " *
                                                                       (room // 13)}]}).encode()),
            ("numbers", "/generate", b'{"inputs": "hi", "x": [' + b"1," * (room // 2) + b"1]}"),
            ("strings", "/v1/completions", json.dumps({"prompt": ["hi"] * (room // 6)}).encode()),
            ("objects", "/generate", b'{"inputs": "hi", "x": [' + b"{}," * (room // 3) + b"{}]}")]


def _poll(url: str, go: Any, stop: Any, out: Any) -> None:
    """In its own process: from ``go`` to ``stop``, GET /health every 10 ms; latencies (s) to ``out``,
    ``inf`` for a failure (a transport error too: the poller lives on, or the report would be lost)."""
    import httpx

    def health(c: httpx.Client) -> bool:
        try:
            return c.get(url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    lat = []
    with httpx.Client(timeout=30) as c:
        health(c)  # connect before the window opens
        go.wait()
        while not stop.is_set():
            t = time.perf_counter()
            ok = health(c)
            lat.append(time.perf_counter() - t if ok else float("inf"))
            time.sleep(0.01)
    out.put(lat)


def health_summary(lat: list[float]) -> dict[str, Any]:
    """Samples, failures (``inf``) and the answered samples' p50 / p95 / max in ms (None when
    none was answered): JSON numbers only, no ``Infinity``."""
    ok = [x for x in lat if x != float("inf")]
    ms = {"p50_ms": percentile(ok, 0.5), "p95_ms": percentile(ok, 0.95), "max_ms": max(ok)} if ok else {}
    return {"samples": len(lat), "failed": len(lat) - len(ok),
            **{k: round(ms[k] * 1e3, 1) if ok else None for k in ("p50_ms", "p95_ms", "max_ms")}}


async def _round(url: str, bodies: list[tuple[str, str, bytes]]) -> list[tuple[str, int, float]]:
    import httpx

    async def one(kind: str, route: str, raw: bytes) -> tuple[str, int, float]:
        async with httpx.AsyncClient(timeout=300) as c:  # one connection per client
            t = time.perf_counter()
            r = await c.post(url + route, content=raw, headers={"content-type": "application/json"})
            return kind, r.status_code, time.perf_counter() - t

    return list(await asyncio.gather(*(one(*b) for b in bodies)))


def _cpu() -> str:
    """The CPU's model name and vector extensions (Linux), for the report."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = info.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    ext = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
    return f"{name} ({', '.join(ext)}), {sum(ln.startswith('processor') for ln in lines)} logical CPUs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/smollm2-server.yaml")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--mib", type=float, default=4.0, help="Body size (just under the 4 MiB cap by default).")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--settle", type=float, default=5.0, help="Seconds before the last RSS reading.")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "spec-plugins-hostile-server.log",
                    help="The server's log.")
    args = ap.parse_args(argv)
    size = min(int(args.mib * (1 << 20)), MAX_BODY_BYTES)
    kinds = _bodies(size)
    proc, url = _start(args.config, [], args.log)
    try:
        _wait_healthy(url, proc)
        time.sleep(2.0)
        rss_before = rss_mib(proc.pid)
        idle = mp.get_context("spawn")
        go, stop, out = idle.Event(), idle.Event(), idle.Queue()
        poller = idle.Process(target=_poll, args=(url, go, stop, out))
        poller.start()
        time.sleep(5.0)  # the probe process is up and connected
        go.set()
        results, t0 = [], time.perf_counter()
        for i in range(args.rounds):
            kind = kinds[i % len(kinds)]
            results += asyncio.run(_round(url, [kind] * args.clients))
        wall = time.perf_counter() - t0
        stop.set()
        lat = out.get(timeout=60)
        poller.join(timeout=30)
        rss_after = rss_mib(proc.pid)
        time.sleep(args.settle)
        rss_settled = rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    statuses: dict[str, dict[int, int]] = {}
    for kind, status, _ in results:
        statuses.setdefault(kind, {}).setdefault(status, 0)
        statuses[kind][status] += 1
    report = {"config": args.config, "cpu": _cpu(), "clients": args.clients, "body_bytes": size, "rounds": args.rounds,
              "wall_s": round(wall, 2), "statuses": statuses,
              "request_s_max": round(max(s for *_, s in results), 3),
              "health": health_summary(lat),
              "rss_mib": {"before": rss_before, "after": rss_after, f"after_{args.settle:g}s": rss_settled}}
    write_report(report, args.out)
    return 0


def write_report(report: dict[str, Any], out: Path | None) -> None:
    """Print a JSON report, and write it to ``out`` when given."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
