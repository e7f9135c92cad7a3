"""Structured outputs under speculation: JSON-heavy prompts, each method against plain constrained
decoding on the same runtime, in one process, methods interleaved per prompt.

    python scripts/bench_structured.py --config examples/configs/smollm2-ngram-bench-onnx.yaml \
        --prompts examples/prompts/json.jsonl --out /tmp/structured-ort

Methods (greedy, each prompt's schema as ``response_format`` would give it):
  plain          no proposer, the grammar's forced tokens not drafted (plain constrained decoding)
  plain+forced   no proposer, forced tokens drafted
  ngram          the config's proposer (n-gram ``auto``), forced tokens not drafted
  ngram+forced   the config's proposer, forced tokens drafted ahead of its chain
  free / ngram-free  the same two decoders without a grammar: what the constraint costs, and that
                 unconstrained rows pay nothing for it (its hooks' time in those rows)
Reports tok/s, speedup over plain, tokens per forward, the share of tokens that were forced, the
constraint's own time per round (masks built and applied, forced tokens, commits), whether every
finished output validates against its schema, and whether every method's output is token-identical
to plain constrained decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema  # noqa: E402

from spec_plugins.bench.docs import machine  # noqa: E402
from spec_plugins.decoder import SpeculativeDecoder  # noqa: E402
from spec_plugins.grammar import GrammarSpec, RowGrammar  # noqa: E402
from spec_plugins.grammar import rounds  # noqa: E402

SPENT = {"seconds": 0.0}


def _timed(owner, name):
    """Wrap ``owner.name`` so its time adds to SPENT (the constraint's own cost)."""
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            SPENT["seconds"] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


for _name in ("round_masks", "apply_masks", "forced", "splice"):
    _timed(rounds, _name)
_timed(RowGrammar, "advance")


def run_one(dec, messages, n, spec, forced):
    SPENT["seconds"] = 0.0
    t0 = time.perf_counter()
    res = dec.generate(messages, n, grammar=spec, forced_drafts=forced)
    wall = time.perf_counter() - t0
    return {"tokens": res.token_ids, "text": res.text, "finish": res.finish_reason, "wall": wall,
            "stats": res.stats.to_dict(), "constraint_s": SPENT["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--prompts", default="examples/prompts/json.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec_dec = SpeculativeDecoder.from_config(args.config)
    plain_dec = spec_dec.without_speculation()
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    methods = {"plain": (plain_dec, True, False), "plain+forced": (plain_dec, True, True),
               "ngram": (spec_dec, True, False), "ngram+forced": (spec_dec, True, True),
               "free": (plain_dec, False, False), "ngram-free": (spec_dec, False, False)}
    warm = [{"role": "user", "content": "Say hi as JSON."}]
    for dec, constrained, forced in methods.values():  # compiles, tokenizer tables, cost curves
        dec.generate(warm, 8, grammar=GrammarSpec("json_object") if constrained else None, forced_drafts=forced)
    rows = []
    for p in prompts:
        spec = GrammarSpec.json_schema(p["schema"])
        messages = [{"role": "user", "content": p["turns"][0]}]
        row = {"id": p["question_id"], "category": p["category"]}
        for name, (dec, constrained, forced) in methods.items():
            row[name] = run_one(dec, messages, args.max_new_tokens, spec if constrained else None, forced)
            r = row[name]
            if constrained and r["finish"] == "eos_token":
                try:
                    jsonschema.validate(json.loads(r["text"]), p["schema"])
                    r["valid"] = True
                except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                    r["valid"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        print(p["question_id"], {m: round(len(row[m]["tokens"]) / row[m]["wall"], 1) for m in methods}, flush=True)
    summary = summarise(rows, list(methods))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "machine": machine()}
    (out / "report.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    (out / "summary.md").write_text(table(summary, meta))
    print(table(summary, meta))


def summarise(rows, methods):
    out = {}
    for cat in sorted({r["category"] for r in rows}) + ["all"]:
        sel = [r for r in rows if cat in ("all", r["category"])]
        out[cat] = {}
        for m in methods:
            toks = sum(len(r[m]["tokens"]) for r in sel)
            wall = sum(r[m]["wall"] for r in sel)
            fwd = sum(r[m]["stats"]["target_forwards"] + r[m]["stats"]["prefill_forwards"] for r in sel)
            rounds_ = sum(r[m]["stats"]["target_forwards"] for r in sel)
            forced = sum(r[m]["stats"]["forced_tokens"] for r in sel)
            out[cat][m] = {
                "tokens": toks, "tok_s": toks / wall, "tokens_per_forward": toks / fwd,
                "forced_share": forced / toks if toks else 0.0,
                "constraint_us_per_round": 1e6 * sum(r[m]["constraint_s"] for r in sel) / max(rounds_, 1),
                "valid": sum(r[m].get("valid") is True for r in sel),
                "finished": sum(r[m]["finish"] == "eos_token" for r in sel),
                "identical_to_plain": sum(r[m]["tokens"] == r["plain"]["tokens"] for r in sel) if m not in (
                    "free", "ngram-free") else None,
                "n": len(sel)}
        base = out[cat]["plain"]["tok_s"]
        free = out[cat]["free"]["tok_s"]
        for m in methods:
            out[cat][m]["speedup"] = out[cat][m]["tok_s"] / (free if m.endswith("free") else base)
    return out


def table(summary, meta):
    lines = [f"# Structured outputs ({meta['config']}, {meta['machine']})", "",
             "| category | method | tok/s | speedup | tokens/forward | forced share | constraint us/round | "
             "valid/finished | identical to plain |", "|---|---|---|---|---|---|---|---|---|"]
    for cat, ms in summary.items():
        for m, s in ms.items():
            ident = "-" if s["identical_to_plain"] is None else f"{s['identical_to_plain']}/{s['n']}"
            lines.append(f"| {cat} | {m} | {s['tok_s']:.1f} | {s['speedup']:.2f}x | {s['tokens_per_forward']:.2f} | "
                         f"{s['forced_share']:.1%} | {s['constraint_us_per_round']:.0f} | "
                         f"{s['valid']}/{s['finished']} | {ident} |")
    lines.append("")
    lines.append("speedup: over `plain` (constrained) for constrained methods, over `free` for `ngram-free`.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
