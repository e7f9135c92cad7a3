"""Connection attacks against a live ``spec-plugins serve``: /health latency, server memory and how
long each attacking connection was held, per attack.

Starts the server with the config on a free loopback port and probes /health every 10 ms from a
process of its own (a new connection each time, as a load balancer does). Each attack runs in
processes of their own:

- ``idle``: sockets that connect and send nothing, ``--idle`` of them from each of two processes
  (by default together past the process's open-file limit);
- ``big-header``: ``--big`` connections that each send 64 MiB of one header and never finish;
- ``slowloris``: ``--slow`` connections that send a request line, then a header byte every second.

For every attacking connection the report has how long the server held it (connect to close) and
how it ended (the status it was sent, or a plain close). One JSON report on stdout:

    python -m spec_plugins.server.attacks --config examples/configs/smollm2-server.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from spec_plugins.server.hostile import _cpu, health_summary, write_report
from spec_plugins.server.loadtest import _start, _wait_healthy, percentile, rss_mib


def _probe(url: str, go: Any, stop: Any, out: Any) -> None:
    """/health every 10 ms on a new connection each time; latency, or inf for a failure."""
    import httpx

    lat = []
    go.wait()
    while not stop.is_set():
        t = time.perf_counter()
        try:
            ok = httpx.get(url + "/health", timeout=10, headers={"connection": "close"}).status_code == 200
        except httpx.HTTPError:
            ok = False
        lat.append(time.perf_counter() - t if ok else float("inf"))
        time.sleep(0.01)
    out.put(lat)


async def _hold(host: str, port: int, kind: str, n: int, duration: float) -> list[tuple[float, str]]:
    """``n`` attacking connections of ``kind``; per connection (seconds held, how it ended)."""
    sem = asyncio.Semaphore(512)  # connects in flight at once

    async def one() -> tuple[float, str]:
        async with sem:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError as exc:
                return 0.0, f"connect failed: {exc.strerror or exc}"
        t0 = time.perf_counter()
        sent = 0
        try:
            if kind == "slowloris":
                writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            elif kind == "big-header":
                writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
            while time.perf_counter() - t0 < duration:
                sending = kind == "big-header" and sent < 64 << 20
                if sending:
                    writer.write(b"a" * (1 << 20))
                    sent += 1 << 20
                elif kind == "slowloris":
                    writer.write(b"a")  # a header byte a second (the read below waits the second)
                await writer.drain()
                try:
                    data = await asyncio.wait_for(reader.read(256), timeout=0.001 if sending else 1.0)
                except asyncio.TimeoutError:
                    continue
                return time.perf_counter() - t0, _status(data)
        except (ConnectionError, OSError):
            held = time.perf_counter() - t0
            try:  # the answer the server wrote before it closed, if it reached us
                data = await asyncio.wait_for(reader.read(256), timeout=1.0)
            except (ConnectionError, OSError, asyncio.TimeoutError):
                data = b""
            return held, _status(data) if data else "reset"
        finally:
            writer.close()
        return time.perf_counter() - t0, "still open"

    return list(await asyncio.gather(*(one() for _ in range(n))))


def _status(data: bytes) -> str:
    """How a connection ended: the status the server sent, or a plain close."""
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"


def _attacker(url: str, kind: str, n: int, duration: float, out: Any) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port = url.removeprefix("http://").split(":")
    out.put(asyncio.run(_hold(host, int(port), kind, n, duration)))


def _summary(held: list[tuple[float, str]]) -> dict[str, Any]:
    ends: dict[str, int] = {}
    for _, how in held:
        ends[how] = ends.get(how, 0) + 1
    secs = [s for s, how in held if not how.startswith("connect failed")]
    return {"connections": len(held), "ended": ends,
            "held_s": {"p50": round(percentile(secs, 0.5), 2), "max": round(max(secs), 2)} if secs else None}


def run_attack(url: str, pid: int, kind: str, per_process: list[int], duration: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    go, stop, lat_q, held_q = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    probe = ctx.Process(target=_probe, args=(url, go, stop, lat_q))
    probe.start()
    rss_before = rss_mib(pid)
    attackers = [ctx.Process(target=_attacker, args=(url, kind, n, duration, held_q)) for n in per_process]
    go.set()
    for a in attackers:
        a.start()
    rss_peak = rss_before or 0.0
    t0 = time.perf_counter()
    while any(a.is_alive() for a in attackers) and time.perf_counter() - t0 < duration + 120:
        rss_peak = max(rss_peak, rss_mib(pid) or 0.0)
        time.sleep(0.5)
    held = [h for _ in attackers for h in held_q.get(timeout=120)]
    stop.set()
    lat = lat_q.get(timeout=60)
    for p in attackers + [probe]:
        p.join(timeout=30)
    return {"attack": kind, "attackers": per_process, "duration_s": duration, **_summary(held),
            "health": health_summary(lat), "rss_mib": {"before": rss_before, "peak": rss_peak, "after": rss_mib(pid)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/smollm2-server.yaml")
    ap.add_argument("--idle", type=int, default=10_500, help="idle sockets per attacking process (two of them)")
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--slow", type=int, default=200)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds each attack lasts at most")
    ap.add_argument("--attacks", default="idle,big-header,slowloris")
    ap.add_argument("--serve-args", default="", help="extra `spec-plugins serve` options, e.g. '--header-timeout 5'")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "spec-plugins-attacks-server.log")
    args = ap.parse_args(argv)
    proc, url = _start(args.config, args.serve_args.split(), args.log)
    results = []
    try:
        _wait_healthy(url, proc)
        time.sleep(2.0)
        plan = {"idle": [args.idle, args.idle], "big-header": [args.big], "slowloris": [args.slow]}
        for kind in args.attacks.split(","):
            results.append(run_attack(url, proc.pid, kind, plan[kind], args.duration))
            print(json.dumps(results[-1]), flush=True)
            time.sleep(3.0)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    write_report({"config": args.config, "serve_args": args.serve_args, "cpu": _cpu(), "attacks": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
