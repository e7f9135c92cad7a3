"""Which statistic and smoothing the forward-cost model uses, by measurement.

    python scripts/cost_statistic.py --config examples/configs/smollm2-ngram-bench.yaml --calibrations 8

Runs the cost model's own timing loop (``policy.cost.time_forwards``) ``--calibrations`` times on the
same runtime (repeats 3, widths 1..17, as at load) and compares, across calibrations, how stable
each candidate curve is: the minimum of the repeats against their median, each with and without a
monotone (isotonic) fit. It also counts, per width, how often a wider forward measured cheaper than
the next narrower one: a kernel effect a policy should see (a monotone fit hides it), or noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def isotonic(values: list[float]) -> list[float]:
    """Least-squares nondecreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/smollm2-ngram-bench.yaml")
    ap.add_argument("--calibrations", type=int, default=8)
    ap.add_argument("--widths", type=int, default=17)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from spec_plugins.backends import build_runtime
    from spec_plugins.config import SpecConfig
    from spec_plugins.policy.cost import _context_tokens, time_forwards

    rt = build_runtime(SpecConfig.from_file(a.config).target)
    ctx = _context_tokens(rt.vocab_size, 128 + a.widths)
    new = torch.tensor([ctx[128:128 + a.widths]])
    widths = list(range(1, a.widths + 1))
    curves: dict[str, list[list[float]]] = {"min": [], "median": [], "min+isotonic": [], "median+isotonic": []}
    for _ in range(a.calibrations):
        s = time_forwards(rt, [ctx[:128]], new, widths, 3, warmup=(1, a.widths, 1))
        mn = [min(s[n]) for n in widths]
        md = [statistics.median(s[n]) for n in widths]
        for name, c in (("min", mn), ("median", md), ("min+isotonic", isotonic(mn)), ("median+isotonic", isotonic(md))):
            curves[name].append([t / c[0] for t in c])  # relative to N = 1: what the policy trades on
    out: dict = {"runtime": rt.capabilities.name, "calibrations": a.calibrations, "statistics": {}}
    for name, cs in curves.items():
        spread = [max(c[j] for c in cs) - min(c[j] for c in cs) for j in range(len(widths))]
        out["statistics"][name] = {"median_relative": [round(statistics.median(c[j] for c in cs), 3)
                                                       for j in range(len(widths))],
                                   "max_spread": round(max(spread), 3), "mean_spread": round(statistics.mean(spread), 3)}
    dips = {n: sum(c[n - 1] < c[n - 2] for c in curves["min"]) for n in widths[1:]}
    out["wider_cheaper_than_narrower_in_min_curves"] = {str(n): k for n, k in dips.items() if k}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
