"""Replay draft-length policies over recorded greedy outputs, without running the model.

Under greedy decoding every method emits the same tokens (the bench checks it), and a chain
proposer that only reads the sequence (n-gram) drafts the same tokens whatever the model
computes. So for any draft-length policy the rounds are fully determined by the recorded output:
each round accepts the longest prefix of the draft that the output continues with. Charging each
round the measured cost curve (``CostModel``) plus a measured per-round overhead predicts the
policy's time. This is how ``auto`` is tuned and checked against every fixed gamma in seconds of
CPU instead of a full bench per setting; the bench itself remains the measurement.

    python -m spec_plugins.bench.replay --report bench-out/report.json --prompts examples/prompts/dev.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from spec_plugins.costmodel import CostModel
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundResult
from spec_plugins.stats import DecodeStats

PolicyFactory = Callable[[], Callable[[DecodeStats], int]]


@dataclass
class ReplayResult:
    seconds: float
    tokens: int
    rounds: int
    stats: DecodeStats


def replay_turn(prompt: Sequence[int], output: Sequence[int], max_new: int, proposer: Proposer,
                policy: Callable[[DecodeStats], int], cost: CostModel, overhead: float,
                pipeline: Any = None) -> ReplayResult:
    """Simulate the decode loop of ``engine.decode`` for one row whose greedy output is known."""
    stats = DecodeStats()
    seq = list(prompt)
    proposer.begin([seq])
    seq.append(output[0])  # the prefill emits the first token
    pos, seconds, rounds = 1, 0.0, 0
    per_row = hasattr(policy, "per_row") and not proposer.tree
    while pos < len(output):
        keys = proposer.draft_keys([seq]) if per_row else None
        k = policy.per_row(stats, keys)[0] if keys is not None else policy(stats)  # type: ignore[attr-defined]
        if keys is not None and k == 0 and hasattr(policy, "shadow"):
            free = proposer.free_drafts([seq], policy.max_k)  # type: ignore[attr-defined]
            if free is not None:
                policy.shadow(keys, [seq], free)  # type: ignore[attr-defined]
        budget = max(0, min(k, max_new - pos - 1))
        chain: list[int] = []
        draft: Draft | None = None
        if budget > 0:
            draft = proposer.propose(ProposeContext([seq], [budget], pipeline))
            if draft is not None:
                n = int(draft.valid[0].sum()) if draft.valid is not None else draft.size
                chain = draft.tokens[0, :n].tolist()
        acc = 0
        while acc < len(chain) and pos + acc < len(output) and chain[acc] == output[pos + acc]:
            acc += 1
        n_emit = min(acc + 1, len(output) - pos)
        stats.observe_round([1] * len(chain), acc, n_emit)
        stats.target_forwards += 1
        stats.verify_positions += 1 + len(chain)
        t_fwd = cost.target(1 + len(chain))
        t_draft = (cost.draft_round_seconds + cost.draft_step_seconds * len(chain)) if budget > 0 else 0.0
        stats.time_target_forward += t_fwd
        stats.time_draft += t_draft
        stats.time_total += t_fwd + t_draft + overhead
        seconds += t_fwd + t_draft + overhead
        if keys is not None:
            policy.observe_rows(keys, [budget], [len(chain)], [acc])  # type: ignore[attr-defined]
        emitted = list(output[pos : pos + n_emit])
        seq.extend(emitted)
        proposer.observe(RoundResult(draft, [list(range(acc))], [emitted], [seq], None))
        pos += n_emit
        rounds += 1
    return ReplayResult(seconds, len(output), rounds, stats)


def fixed(k: int) -> PolicyFactory:
    return lambda: (lambda stats: k)


def auto(cost: CostModel, **kwargs: Any) -> PolicyFactory:
    """``auto`` as the engine builds it: one online cost correction shared by every turn."""
    from spec_plugins.adaptive import AutoDraftLength
    from spec_plugins.costmodel import OnlineCost

    online = OnlineCost(cost)
    return lambda: AutoDraftLength(cost, online=online, **kwargs)


def replay_report(report: dict, turns: Sequence[tuple[str, list[int], list[int]]], make_proposer: Callable[[], Proposer],
                  policies: dict[str, PolicyFactory], cost: CostModel, overhead: float) -> dict[str, dict[str, float]]:
    """tokens/s per policy and category (plus "all") over ``turns`` = (category, prompt ids, output)."""
    max_new = int(report["meta"]["max_new_tokens"])
    plain_round = cost.target(1) + overhead
    sums: dict[str, dict[str, list[float]]] = {}
    for name, factory in {"plain": fixed(0), **policies}.items():
        acc = sums.setdefault(name, {})
        for cat, prompt, out in turns:
            if name == "plain":
                secs, n = plain_round * (len(out) - 1), len(out)
            else:
                r = replay_turn(prompt, out, max_new, make_proposer(), factory(), cost, overhead)
                secs, n = r.seconds, r.tokens
            for c in (cat, "all"):
                t = acc.setdefault(c, [0.0, 0.0])
                t[0] += n
                t[1] += secs
    return {name: {c: n / s for c, (n, s) in cats.items()} for name, cats in sums.items()}


def _turns_from_report(report: dict, prompts_file: str, decoder: Any) -> list[tuple[str, list[int], list[int]]]:
    """(category, prompt ids, plain output) per turn, re-encoding multi-turn histories as the bench did."""
    from spec_plugins.bench.prompts import load_prompts

    by_id = {p.question_id: p for p in load_prompts(prompts_file)}
    out = []
    for entry in report["prompts"]:
        p = by_id[entry["question_id"]]
        history: list[dict] = []
        for turn, toks in zip(p.turns, entry["methods"]["plain"]["token_ids"]):
            history.append({"role": "user", "content": turn})
            ids = decoder.encode(history) if decoder.has_chat_template else decoder.encode(
                "\n\n".join(m["content"] for m in history))
            out.append((p.category, ids, list(toks)))
            history.append({"role": "assistant", "content": decoder.tokenizer.decode(toks, skip_special_tokens=True)})
    return out


def _overhead(report: dict) -> float:
    """Seconds per round outside target forwards and drafting, pooled over our runs on the primary runtime."""
    spent = rounds = 0.0
    for m in report["methods"]:
        if m["kind"] != "ours":
            continue
        s = report["summary"][m["name"]]["all"]
        st = s["stats"]
        share = st["time_share"]
        outside = share["verify"] + share["cache"] + share["other"]
        spent += outside * s["seconds"]
        rounds += st["target_forwards"]
    return spent / rounds if rounds else 0.0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="report.json of a greedy n-gram bench run")
    ap.add_argument("--prompts", required=True, help="the prompts file that bench run used")
    ap.add_argument("--config", default=None, help="config (tokenizer + proposer); default: the report's")
    ap.add_argument("--gammas", default="1-8")
    args = ap.parse_args(argv)
    from spec_plugins.bench.cli import parse_gammas
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.registry import PROPOSERS

    report = json.loads(open(args.report).read())
    cfg = SpecConfig.from_file(args.config or report["meta"]["config"])
    dec = SpeculativeDecoder.from_config(cfg)
    cm = report["cost_model"]
    # the per-N minima, as auto sees them (the monotone fit hides widths cheaper than narrower ones)
    cost = CostModel(tuple(cm.get("raw_target_seconds") or cm["target_seconds"]),
                     draft_round_seconds=cm["draft_round_seconds"], draft_step_seconds=cm["draft_step_seconds"])
    turns = _turns_from_report(report, args.prompts, dec)
    pcfg = cfg.proposer
    make = lambda: PROPOSERS.get(pcfg.type)(pcfg)  # noqa: E731
    policies: dict[str, PolicyFactory] = {f"k{g}": fixed(g) for g in parse_gammas(args.gammas)}
    policies["auto"] = auto(cost)
    over = _overhead(report)
    sim = replay_report(report, turns, make, policies, cost, over)
    measured = {("plain" if m["name"] == "plain" else m["name"].replace("ours_", "")): report["summary"][m["name"]]
                for m in report["methods"] if m["kind"] in ("ours",) or m["name"] == "plain"}
    cats = list(dict.fromkeys(c for c, _, _ in turns)) + ["all"]
    print(f"overhead per round {over * 1e3:.2f} ms; simulated (measured) tokens/s")
    print("policy  " + "".join(f"{c:>18}" for c in cats))
    for name, row in sim.items():
        cells = []
        for c in cats:
            m = measured.get(name, {}).get(c, {}).get("tokens_per_s")
            cells.append(f"{row[c]:8.1f} ({m:5.1f})" if m else f"{row[c]:8.1f}        ")
        print(f"{name:8}" + "".join(f"{x:>18}" for x in cells))
    fixed_names = [n for n in sim if n.startswith("k")]
    for c in cats:
        best = max(fixed_names, key=lambda n: sim[n][c])
        print(f"{c:14} best fixed {best} {sim[best][c]:.1f}; auto/best {sim['auto'][c] / sim[best][c]:.3f}")


if __name__ == "__main__":
    main()
