"""ONNX Runtime session options measured on this machine (issue 21): intra-op threads, the CPU
memory arena and thread spinning, for the fp32 and int8 verify graphs, one-position and
8-position forwards (median of 15 after warm-up). Run alone on the machine.

    python scripts/ort_session_options.py
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import torch

    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

    ids = list(range(200, 456))
    rows = []
    for quant, threads, arena, spin in itertools.product(("none", "int8"), (1, 2), (True, False), (True, False)):
        rt = OnnxRuntime.from_config(OnnxRuntime.Config(model="smollm2-135m-instruct", quantize=quant, threads=threads,
                                                        arena=arena, spinning=spin))
        rt.prefill([ids])
        out = {}
        for n in (1, 8):
            ts = []
            for _ in range(18):
                t0 = time.perf_counter()
                rt.forward(torch.tensor([ids[:n]]))
                ts.append(time.perf_counter() - t0)
                rt.rollback([len(ids)])
            out[n] = statistics.median(ts[3:]) * 1e3
        row = {"quantize": quant, "threads": threads, "arena": arena, "spinning": spin,
               "t1_ms": round(out[1], 2), "t8_ms": round(out[8], 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for quant in ("none", "int8"):
        best = min((r for r in rows if r["quantize"] == quant), key=lambda r: r["t1_ms"])
        print(f"{quant}: fastest one-position forward with {best}")


if __name__ == "__main__":
    main()
