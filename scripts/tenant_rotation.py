"""Tenant rotation against suffix decoding's tenant-scoped index: finished requests of N distinct
tenants go through the proposer's own ``observe`` (what the server's decode thread runs for each
finished request), and the index's size and the time of each add are printed every 10,000
tenants. ``python scripts/tenant_rotation.py [--tenants 50000] [--tokens 40]``"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import os

from spec_plugins.proposers.suffix import SuffixProposer
from spec_plugins.types import Emission, RoundRecord


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tenants", type=int, default=50_000)
    ap.add_argument("--tokens", type=int, default=40, help="tokens per finished request (prompt + output)")
    ap.add_argument("--every", type=int, default=10_000)
    args = ap.parse_args()
    rng = random.Random(0)
    prop = SuffixProposer(SuffixProposer.Config(scope="tenant"))
    times: list[float] = []
    print("tenants  indexes  held_requests  nodes  rss_MiB  add_ms_median  add_ms_p95")
    for i in range(1, args.tenants + 1):
        seq = [rng.randrange(2000) for _ in range(args.tokens)]
        record = RoundRecord(keys=[i], sequences=[seq], budgets=[0], draft_keys=None, draft=None, accepted=[[]],
                             emitted=[[seq[-1]]], emissions=[Emission(i, [seq[-1]], [], "length")], positions=1,
                             tenants=[f"tenant-{i}"])
        t0 = time.perf_counter()
        prop.observe(record)
        times.append(time.perf_counter() - t0)
        if i % args.every == 0:
            gc.collect()
            rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            window = sorted(times[-args.every:])
            print(f"{i:7d}  {len(prop.index.tries):7d}  {prop.index.stats.requests:13d}  {prop.index.stats.nodes:6d}  "
                  f"{rss / 2**20:7.1f}  {statistics.median(window) * 1e3:13.3f}  "
                  f"{window[int(0.95 * len(window))] * 1e3:10.3f}", flush=True)


if __name__ == "__main__":
    main()
