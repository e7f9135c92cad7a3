"""Benchmark the trained heads against plain decoding in one process (same runtime, same
prompts, methods interleaved per prompt so CPU contention hits them alike).

    flock /tmp/spec-bench.lock python examples/bench_heads.py --max-new-tokens 128 --out bench-heads.json

Reports per method: mean accepted tokens per target forward (stats convention: emitted tokens /
verify forwards), wall time, tokens/s, speedup over plain, and whether every greedy output is
token-identical to plain decoding. ``--cost-curve`` also times one target forward over N new
positions (the verify cost that sizes the trees).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

from spec_plugins.decoder import SpeculativeDecoder  # noqa: E402
from spec_plugins.registry import PROPOSERS  # noqa: E402
from spec_plugins.verifiers import ExactVerifier  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADS = ROOT / "examples" / "heads" / "smollm2-135m-instruct"
METHODS = {
    "medusa-tree": {"type": "medusa", "heads": str(HEADS / "medusa"), "mode": "tree", "num_draft_tokens": 4,
                    "tree_nodes": 10, "top_k": 3},
    "eagle-chain": {"type": "eagle", "heads": str(HEADS / "eagle"), "mode": "chain", "num_draft_tokens": 4},
    "eagle-tree": {"type": "eagle", "heads": str(HEADS / "eagle"), "mode": "tree", "num_draft_tokens": 5,
                   "tree_nodes": 10, "top_k": 3},
    "eagle-tree-auto": {"type": "eagle", "heads": str(HEADS / "eagle"), "mode": "tree", "num_draft_tokens": 6,
                        "tree_nodes": "auto", "top_k": 4},
    "ngram": {"type": "ngram", "num_draft_tokens": 5, "max_ngram": 3},
    "recycling-tree": {"type": "recycling", "num_draft_tokens": 6, "tree_size": "auto"},
    # large fixed trees: how many tokens a forward can accept when verification cost is ignored
    "recycling-tree-64": {"type": "recycling", "num_draft_tokens": 8, "tree_size": 64},
    "eagle-tree-64": {"type": "eagle", "heads": str(HEADS / "eagle"), "mode": "tree", "num_draft_tokens": 8,
                      "tree_nodes": 64, "top_k": 8},
}
PICK = ["chat-1", "code-1", "sum-1", "qa-1", "math-1", "trans-1"]
DEV = ROOT / "examples" / "prompts" / "dev.jsonl"


def dev_prompts(path: Path, ids: list[str]) -> list[tuple[str, str]]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    by_id = {r["question_id"]: r["turns"][0] for r in rows}
    return [(i, by_id[i]) for i in ids]


def cost_curve(target, ids: list[int], sizes: list[int], reps: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over N new chain positions after ``ids``."""
    out = {}
    for n in sizes:
        ts = []
        for _ in range(reps):
            target.prefill([ids])
            toks = torch.tensor([ids[-n:] if n <= len(ids) else (ids * n)[:n]])
            t0 = time.perf_counter()
            target.forward(toks)
            ts.append(time.perf_counter() - t0)
        out[n] = sorted(ts)[len(ts) // 2]
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, dict]]:
    """The command line and each selected method's proposer section with its ``--set`` overrides;
    an unknown method, or a ``--set`` not of the form ``method.field=value`` or for a method not
    selected, is refused before any model loads (it would otherwise be silently unused)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="medusa-tree,eagle-chain,eagle-tree")
    ap.add_argument("--prompts", default=",".join(PICK))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="method.field=value override, e.g. eagle-tree.tree_nodes=16")
    ap.add_argument("--cost-curve", default="", help="comma-separated N, e.g. 1,2,4,8,12,16,24")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(METHODS)}")
    specs = {name: dict(METHODS[name]) for name in names}
    for s in args.set:
        key, eq, val = s.partition("=")
        m, dot, field = key.partition(".")
        if not (eq and dot and m and field):
            ap.error(f"--set {s!r}: expected method.field=value, e.g. eagle-tree.tree_nodes=16")
        if m not in specs:
            ap.error(f"--set {s!r}: method {m!r} is not among --methods ({', '.join(names)})")
        specs[m][field] = yaml.safe_load(val)  # as a config file reads it; the proposer's Config validates
    known = [json.loads(x)["question_id"] for x in DEV.read_text().splitlines() if x.strip()]
    missing = [i for i in args.prompts.split(",") if i not in known]
    if missing:
        ap.error(f"--prompts: unknown {', '.join(missing)}; known: {', '.join(known)}")
    return args, specs


def main() -> None:
    args, specs = parse_args()
    torch.set_num_threads(args.threads)
    from spec_plugins.backends.torch_runtime import TorchRuntime

    target = TorchRuntime.from_config(TorchRuntime.Config(backend="torch", model="smollm2-135m-instruct",
                                                          device="cpu"))
    plain = SpeculativeDecoder(target, None, ExactVerifier())
    methods = {}
    for name, spec in specs.items():
        cls = PROPOSERS.get(spec["type"])
        prop = cls(cls.Config(**spec), target=target, tokenizer=target.tokenizer)
        methods[name] = (spec, SpeculativeDecoder(target, prop, ExactVerifier(),
                                                  _config(spec), target.tokenizer))
    report: dict = {"max_new_tokens": args.max_new_tokens, "threads": args.threads, "methods": {}, "prompts": []}
    totals = {m: {"time": 0.0, "tokens": 0, "forwards": 0, "emitted": 0, "identical": True}
              for m in ["plain", *methods]}
    for qid, text in dev_prompts(DEV, args.prompts.split(",")):
        ids = plain.encode([{"role": "user", "content": text}])
        ref = plain.generate(ids, args.max_new_tokens)
        row = {"id": qid, "prompt_tokens": len(ids), "plain": {"tokens": len(ref.token_ids), "s": ref.stats.time_total}}
        _add(totals["plain"], ref)
        for name, (_, dec) in methods.items():
            r = dec.generate(ids, args.max_new_tokens)
            same = r.token_ids == ref.token_ids
            _add(totals[name], r, same)
            row[name] = {"s": round(r.stats.time_total, 3), "mean_accepted": round(r.stats.mean_accepted_tokens, 3),
                         "identical": same}
        report["prompts"].append(row)
        print(json.dumps(row), flush=True)
    base = totals["plain"]["time"]
    for name, t in totals.items():
        report["methods"][name] = {
            "mean_accepted_tokens": round(t["emitted"] / t["forwards"], 3) if t["forwards"] else None,
            "seconds": round(t["time"], 2), "tokens": t["tokens"], "tokens_per_s": round(t["tokens"] / t["time"], 2),
            "speedup_vs_plain": round(base / t["time"], 3), "greedy_identical_to_plain": t["identical"],
            "config": methods[name][0] if name in methods else None}
    if args.cost_curve:
        ids = plain.encode([{"role": "user", "content": dev_prompts(DEV, ["qa-1"])[0][1]}])
        curve = cost_curve(target, ids, [int(x) for x in args.cost_curve.split(",")])
        report["verify_cost_curve_s"] = {n: round(s, 4) for n, s in curve.items()}
        report["verify_cost_relative"] = {n: round(s / curve[min(curve)], 2) for n, s in curve.items()}
    print(json.dumps({k: v for k, v in report.items() if k != "prompts"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def _config(spec: dict):
    from spec_plugins.config import SpecConfig

    return SpecConfig.parse({"target": {"backend": "torch", "model": "smollm2-135m-instruct"}, "proposer": spec})


def _add(t: dict, r, same: bool = True) -> None:
    t["time"] += r.stats.time_total
    t["tokens"] += len(r.token_ids)
    t["forwards"] += r.stats.target_forwards
    t["emitted"] += r.stats.emitted_tokens
    t["identical"] &= same


if __name__ == "__main__":
    main()
