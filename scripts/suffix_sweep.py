"""Suffix decoding's settings, swept by replay over one recorded greedy bench run (issue 22).

Greedy output does not depend on the proposer, and suffix decoding reads only token sequences,
so one recorded run (a bench report with plain decoding's token ids) replays every setting
through the real round (``bench.replay.ReplayRuntime``): the same drafts, tree sizes, verifier
and commits as a live run, in simulated time from the report's measured cost curve. Turns replay
in the bench's order with one proposer, so the global index sees earlier requests exactly as in
``spec-plugins bench --memory sequence``. The bench remains the measurement; this says which
settings are worth a bench run, and why suffix decoding stops where it stops.

It also prints a ceiling for any drafter that copies text (``copy_oracle``): one that knows the
future and drafts, each round, the longest continuation (up to 16 tokens) that follows the last
``m`` tokens of the context somewhere in the text seen so far (this request's prompt and output,
and every earlier request), priced by the same cost curve and per-round overhead.

    python scripts/suffix_sweep.py --report b-rep-seq/report.json --prompts examples/prompts/repetitive.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from spec_plugins.bench.replay import (auto, check_replayable, not_replayable, replay_sequence, report_config,
                                       report_limits, round_overhead, turns_from_report)
from spec_plugins.policy import DraftCost, FixedLength, ForwardCost
from spec_plugins.registry import PROPOSERS

BASE = {"type": "suffix", "scope": "global", "num_draft_tokens": 16, "tree_nodes": "auto"}
VARIANTS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "request-only": {"scope": "request"},
    "spec-factor-2": {"max_spec_factor": 2.0},
    "spec-factor-4": {"max_spec_factor": 4.0},
    "min-prob-0.05": {"min_token_prob": 0.05},
    "min-prob-0.3": {"min_token_prob": 0.3},
    "deep-32": {"num_draft_tokens": 32, "depth": 48},
    "deep-32-factor-4": {"num_draft_tokens": 32, "depth": 48, "max_spec_factor": 4.0},
    "match-24": {"max_match": 24, "depth": 48, "num_draft_tokens": 24},
    "nodes-8": {"tree_nodes": 8},
    "nodes-16": {"tree_nodes": 16},
}


def copy_oracle(turns: Sequence[tuple[str, list[int], list[int]]], cost: ForwardCost, overhead: float,
                min_context: int, depth: int = 32, max_draft: int = 16) -> dict[str, dict[str, float]]:
    """Per category: tokens/s and accepted tokens per forward of the clairvoyant copying drafter."""
    seen: set[tuple[int, ...]] = set()  # every substring of up to depth tokens seen so far

    def add(seq: Sequence[int], start: int) -> None:  # the substrings that end at seq[start:]
        for e in range(start, len(seq)):
            for b in range(max(0, e - depth + 1), e + 1):
                seen.add(tuple(seq[b:e + 1]))

    acc: dict[str, list[float]] = {}
    for cat, prompt, out in turns:
        seq = list(prompt)
        add(seq, 0)
        i = seconds = forwards = 0
        while i < len(out):  # out[i] is known (the last forward's token); draft out[i+1:]
            ctx = (seq + [out[i]])[-min_context:]
            n = 0
            while n < max_draft and i + 1 + n < len(out) and tuple(ctx + out[i + 1:i + 2 + n]) in seen:
                n += 1
            seconds += cost(1, 1 + n) + overhead
            forwards += 1
            seq.extend(out[i:i + n + 1])
            add(seq, len(seq) - n - 1)
            i += n + 1
        for c in (cat, "all"):
            t = acc.setdefault(c, [0.0, 0.0, 0.0])
            t[0] += len(out)
            t[1] += seconds
            t[2] += forwards
    return {c: {"tokens_per_s": n / s, "accepted": n / f} for c, (n, s, f) in acc.items()}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="report.json of a greedy bench run with plain decoding")
    ap.add_argument("--prompts", required=True, help="the prompts file that run used")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    from spec_plugins.decoder import SpeculativeDecoder

    report = json.loads(open(args.report).read())
    if why := not_replayable(report.get("meta", {})):
        ap.error(f"--report {args.report}: {why}")
    try:  # the ngram-auto row replays the report's own proposer
        cfg = report_config(report)  # a file, or the built-in default a run without --config records
        check_replayable(cfg.proposer.type if cfg.proposer else "none")
    except ValueError as exc:  # ConfigError is one
        ap.error(f"--report {args.report}: {exc}")
    dec = SpeculativeDecoder.from_config(cfg)  # its tokenizer re-encodes the turns as the bench did
    cm = report["cost_model"]
    cost = ForwardCost.from_curve(cm.get("raw_target_seconds") or cm["target_seconds"])
    draft = DraftCost(cm["draft_round_seconds"], cm["draft_step_seconds"])
    turns = turns_from_report(report, args.prompts, dec)
    over = round_overhead(report)
    limits = report_limits(report, dec)  # a turn that ended on EOS drafted its last rounds up to max_new
    runs: dict[str, dict[str, dict[str, float]]] = {}
    runs["plain"] = replay_sequence(turns, lambda rt: PROPOSERS.get("ngram")(PROPOSERS.get("ngram").Config()),
                                    lambda: FixedLength(0), cost, over, draft, **limits)
    ngram = cfg.proposer
    runs["ngram-auto"] = replay_sequence(turns, lambda rt: PROPOSERS.get(ngram.type)(ngram), auto(cost, draft),
                                         cost, over, draft, **limits)
    for name, change in VARIANTS.items():
        pcfg = PROPOSERS.get("suffix").Config(**{**BASE, **change})
        runs[name] = replay_sequence(turns, lambda rt, c=pcfg: PROPOSERS.get("suffix")(c, target=rt),
                                     lambda c=pcfg: FixedLength(int(c.num_draft_tokens)), cost, over, draft, **limits)
    for m in (1, 2, 3):
        runs[f"oracle-copy-m{m}"] = copy_oracle(turns, cost, over, m)
    cats = list(dict.fromkeys(c for c, _, _ in turns)) + ["all"]
    plain, ng = runs["plain"]["all"]["tokens_per_s"], runs["ngram-auto"]["all"]["tokens_per_s"]
    print(f"overhead per round {over * 1e3:.2f} ms; simulated tokens/s (accepted / forward)")
    print(f"{'setting':18}" + "".join(f"{c:>20}" for c in cats) + "   vs plain  vs n-gram")
    for name, row in runs.items():
        cells = "".join(f"{row[c]['tokens_per_s']:12.1f} ({row[c]['accepted']:4.2f})" for c in cats)
        tps = row["all"]["tokens_per_s"]
        print(f"{name:18}{cells}   {tps / plain:7.2f}x {tps / ng:7.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"recorded_run": {k: report["meta"].get(k) for k in ("machine", "started_utc", "backend",
                                                                            "max_new_tokens", "memory")},
                       "prompts": Path(args.prompts).name, "overhead_s_per_round": over, "base": BASE,
                       "variants": VARIANTS, "results": runs}, f, indent=1)


if __name__ == "__main__":
    main()
