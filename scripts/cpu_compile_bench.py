"""Why ``compile: auto`` stays off on a CPU (issue 36): one forward over N positions, one row,
256 tokens of warm context, on the growing cache (the CPU default), the static cache eager, and
the static cache compiled; the compile time of the buckets is printed first. Each pass measures
every path in turn (the minimum of 5 repeats per width); the table is the median of 3 passes.

    python scripts/cpu_compile_bench.py [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    import torch

    from spec_plugins.backends import build_runtime
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.policy.cost import measure

    c = dict(model=args.model, device="cpu", dtype="float32")
    paths = {"growing cache (default)": TorchRuntime.Config(**c),
             "static eager": TorchRuntime.Config(**c, kv="static", compile="off"),
             "static compiled": TorchRuntime.Config(**c, kv="static", compile="on")}
    rts = {k: build_runtime(cfg) for k, cfg in paths.items()}
    widths = (1, 2, 4, 8, 16)
    t0 = time.perf_counter()
    measure(rts["static compiled"], widths=widths, context=256, repeats=1)  # compiles every bucket once
    print(f"compiling {len(widths)} buckets: {time.perf_counter() - t0:.0f} s")
    ms: dict[str, dict[int, list[float]]] = {k: {n: [] for n in widths} for k in paths}
    for _ in range(3):
        for k, rt in rts.items():
            fc = measure(rt, widths=widths, context=256, repeats=5)
            for n in widths:
                ms[k][n].append(fc.table[(1, n)] * 1e3)
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(cpu, "| torch", torch.__version__, "| threads", torch.get_num_threads())
    print("| path | " + " | ".join(f"N={n} ms" for n in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for k in paths:
        print(f"| {k} | " + " | ".join(f"{statistics.median(ms[k][n]):.1f}" for n in widths) + " |")
    base = next(iter(paths))
    for k in paths:
        print(k, "vs default:", " ".join(
            f"N={n} {statistics.median(ms[k][n]) / statistics.median(ms[base][n]):.2f}x" for n in widths))


if __name__ == "__main__":
    main()
