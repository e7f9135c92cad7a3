"""The parallel drafter's data curve (issue 47), from finished training runs, beside EAGLE heads.

For each run directory (``train_report.json`` + the head; the shipped EAGLE head's directory
works too): its training data (size, ShareGPT answers or self-distilled), time and machine, the
held-out numbers of its report (top-1 per draft position against the target's greedy token on
the 30,409 held-out positions, and the chain length along the held-out text), and accepted
tokens per target forward in the real loop (dev prompts' first turns, greedy, 64 new tokens, ONNX
Runtime fp32, a 16-node tree (top-4, depth 6) and a chain of 6: ``data_curve.accepted``).
Acceptance does not depend on timing, so this may run beside other work.

    python scripts/parallel_curve.py --runs runs --names eagle-1M,parallel-1M,parallel-init-1M,shipped-eagle
    python scripts/parallel_curve.py --runs runs --names parallel-2M --keep   # add a rung to the report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
SHIPPED = ROOT / "examples/heads/smollm2-135m-instruct/eagle"


def row(d: Path, target, prompts: list[list[int]], new: int) -> dict:
    from data_curve import accepted

    from spec_plugins.bench.docs import machine

    rep = json.loads((d / "train_report.json").read_text())
    feats = rep.get("features") or {}
    out = {"kind": rep["kind"], "train_tokens": rep["train_tokens"], "train_seconds": rep["train_seconds"],
           "steps": rep["steps"], "data": "self-distilled" if feats.get("responses") == "self" or
           (feats.get("token_meta") or {}).get("responses") == "self" else "ShareGPT answers",
           "init": (rep.get("train") or {}).get("init"), "heldout": rep.get("heldout"),
           "block_layers": (rep.get("train") or {}).get("block_layers") or 0,
           "block_context": bool((rep.get("train") or {}).get("block_context")),
           "machine": rep.get("trained_on") or machine(), "head_bytes": rep["head_bytes"]}
    for mode in ("tree", "chain"):
        out[f"accepted_{mode}"] = accepted(target, d, rep["kind"], mode, prompts, new)
    return out


def markdown(rows: dict[str, dict], new: int) -> str:
    machines = list(dict.fromkeys(r["machine"] for r in rows.values()))
    lines = ["## Parallel drafter: data curve beside the EAGLE head", "",
             *[f"- machine {chr(65 + i)}: {m}" for i, m in enumerate(machines)],
             "- command: `python scripts/parallel_curve.py --runs runs --names ...` (runs: `scripts/parallel_runs.sh`)",
             "- held-out: the 30,409 assistant positions of the held-out split, top-1 against the target's greedy "
             "token per draft position (EAGLE: per unrolled step), chain along the held-out text",
             f"- accepted tokens per forward: dev prompts' first turns, greedy, {new} new tokens, ONNX Runtime fp32, "
             "tree of 16 nodes (top-4, depth 6) and chain of 6", "",
             "| run | drafter | data | train tokens | steps | train time | machine | held-out top-1 by position | "
             "chain along held-out text | accepted / forward: tree | chain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        h = r["heldout"] or {}
        top = ", ".join("-" if x is None else f"{x:.3f}" for x in h.get("top1_by_step", [])[:6])
        layers = r.get("block_layers") or 0
        kind = r["kind"] + (f", {layers} block layers" if layers else "")
        kind += " seeing the context" if r.get("block_context") else ""
        kind += " (from the EAGLE head)" if r.get("init") else ""
        lines.append(f"| {name} | {kind} | {r['data']} | {r['train_tokens']:,} | {r['steps']:,} | "
                     f"{r['train_seconds'] / 60:.1f} min | {chr(65 + machines.index(r['machine']))} | {top} | "
                     f"{h.get('accepted_along_text', '–')} | {r['accepted_tree']} | {r['accepted_chain']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--names", required=True, help="comma list of run directories under --runs; "
                                                   "'shipped-eagle' = the shipped EAGLE head")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="docs/reports/parallel-curve.json")
    ap.add_argument("--markdown", default="docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="keep --out's other rows (measured earlier) and add "
                                                       "or replace the named ones")
    args = ap.parse_args()
    from data_curve import target_and_prompts

    from spec_plugins.bench.docs import update

    target, prompts = target_and_prompts()
    out = Path(args.out)
    rows = json.loads(out.read_text()) if args.keep and out.is_file() else {}
    for name in args.names.split(","):
        d = SHIPPED if name == "shipped-eagle" else Path(args.runs) / name
        if not (d / "train_report.json").is_file():
            sys.exit(f"parallel_curve: {d} holds no finished run (train_report.json)")
        rows[name] = row(d, target, prompts, args.new_tokens)
        print(name, json.dumps(rows[name]), flush=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    update(Path(args.markdown), "Parallel drafter: data curve beside the EAGLE head", markdown(rows, args.new_tokens))


if __name__ == "__main__":
    main()
