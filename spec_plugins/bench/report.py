"""Turn raw bench results into numbers: per prompt, per category, overall; JSON and Markdown.

tokens/s is the median over runs of one run's tokens over that run's seconds: per prompt, its
tokens and seconds in the run; per category, the run's totals over the category's prompts (long
answers weigh more, as they do for a user). Each run's own tokens count, because runs may emit
different tokens (sampling; ``auto``, whose costs and sizer carry across runs). The decode
statistics (forwards, acceptance, time shares) pool every run, so they describe the same runs as
the rate; their counts go with the sums of ``tokens_runs`` and ``seconds_runs``. Speedup is
tokens/s over plain's. The theoretical S(gamma) = (1 - a^(g+1)) / ((1 - a)(1 + g c)) uses the
per-token acceptance a of our fixed-gamma chain runs (accepted over judged depths, pooled:
``DecodeStats.judged_acceptance``; accepted over drafted would count the depths past a rejection,
never judged, as rejected) and the measured draft cost ratio c; a second curve divides by the
measured verify cost T(g+1)/T(1) instead of 1, which is what a CPU sees.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from spec_plugins.bench.methods import ours_name
from spec_plugins.files import write_text_atomic
from spec_plugins.stats import DecodeStats

SHARES = ("prefill", "target_forward", "draft", "verify", "cache", "other")


def _shares(s: DecodeStats) -> dict[str, float]:
    tot = s.time_total or 1.0
    parts = {"prefill": s.time_prefill, "target_forward": s.time_target_forward, "draft": s.time_draft,
             "verify": s.time_verify, "cache": s.time_cache, "other": s.time_other}
    return {k: v / tot for k, v in parts.items()}


def _stats_summary(s: DecodeStats | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "target_forwards": s.target_forwards,
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "judged_tokens": s.judged_tokens,
        "mean_accepted_tokens": s.mean_accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "judged_acceptance": s.judged_acceptance,
        "accepted_by_position": list(s.accepted_by_position),
        "drafted_by_position": list(s.drafted_by_position),
        "rows_by_position": list(s.rows_by_position),
        "acceptance_by_position": s.acceptance_by_position,
        "time_share": _shares(s),
        "share_outside_forwards": s.time_outside_forwards / s.time_total if s.time_total else 0.0,
        "lossy": s.lossy,  # a lossy verifier ran: the method's outputs do not follow the target's law
    }


def pooled(stats: Sequence[DecodeStats | None]) -> DecodeStats | None:
    """The runs' statistics as one (None when no run kept any)."""
    kept = [s for s in stats if s is not None]
    if not kept:
        return None
    out = kept[0]
    for s in kept[1:]:
        out = out.merge(s)
    return out


def theoretical_speedup(alpha: float, gamma: int, c: float, verify_ratio: float = 1.0) -> float:
    """S(gamma) = (1 - a^(g+1)) / ((1 - a) (verify_ratio + g c)); verify_ratio = T(g+1)/T(1)."""
    tokens = gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return tokens / (verify_ratio + gamma * c)


def run_rate(tokens: Sequence[int], seconds: Sequence[float]) -> float:
    """tokens/s of runs: the median over runs of ``tokens[r] / seconds[r]`` (a run's own tokens
    over its own time; runs without time are left out)."""
    rates = [n / s for n, s in zip(tokens, seconds) if s > 0]
    return statistics.median(rates) if rates else 0.0


def _reference(m: Any) -> str:
    """Speedups of a runtime's methods are over that runtime's plain decoding; another runtime's
    plain decoding is compared with the primary runtime's plain decoding."""
    group = getattr(m, "group", "")
    if not group or m.name == f"plain@{group}":
        return "plain"
    return f"plain@{group}"


def build_report(raw: dict, meta: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """Everything the JSON file holds; Markdown and plots read only this dict."""
    prompts, methods, results = raw["prompts"], raw["methods"], raw["results"]
    names = [m.name for m in methods]
    greedy = raw["greedy"]
    bad = {(mm["question_id"], mm["method"]) for mm in raw["mismatches"]}
    per_prompt: list[dict] = []
    agg: dict[str, dict[str, dict]] = {n: {} for n in names}  # method -> category -> sums
    for i, p in enumerate(prompts):
        entry: dict[str, Any] = {"question_id": p.question_id, "category": p.category, "turns": len(p.turns),
                                 "methods": {}}
        tps_of: dict[str, float] = {}
        for m in sorted(methods, key=lambda m: not m.name.startswith("plain")):  # plains first
            runs = results[m.name][i]
            toks = [r.new_tokens for r in runs]
            secs = [r.seconds for r in runs]
            tps = run_rate(toks, secs)
            tps_of[m.name] = tps
            ref = tps_of.get(_reference(m))
            entry["methods"][m.name] = {
                "new_tokens": toks[0],  # run 0's, as token_ids
                "new_tokens_runs": toks,
                "seconds_runs": secs,
                "median_seconds": statistics.median(secs),
                "tokens_per_s": tps,
                "speedup": tps / ref if ref else None,
                # plain too: its later runs are checked against its run 0
                "greedy_equal": None if not greedy else (p.question_id, m.name) not in bad,
                "stats": _stats_summary(pooled([r.stats for r in runs])),
                "token_ids": runs[0].tokens,  # run 0's (greedy identity holds every run to them)
            }
            for cat in (p.category, "all"):
                a = agg[m.name].setdefault(cat, {"tokens": [0] * len(runs), "seconds": [0.0] * len(runs),
                                                 "stats": None, "prompts": 0, "mismatches": 0})
                a["tokens"] = [x + n for x, n in zip(a["tokens"], toks)]
                a["seconds"] = [x + t for x, t in zip(a["seconds"], secs)]
                a["prompts"] += 1
                a["mismatches"] += int((p.question_id, m.name) in bad)
                a["stats"] = pooled([a["stats"], *(r.stats for r in runs)])
        per_prompt.append(entry)

    categories = list(dict.fromkeys(p.category for p in prompts)) + ["all"]
    summary: dict[str, dict[str, dict]] = {}
    for m in methods:
        summary[m.name] = {}
        for cat in categories:
            a = agg[m.name][cat]
            summary[m.name][cat] = {"tokens": statistics.median(a["tokens"]),
                                    "seconds": statistics.median(a["seconds"]),
                                    "tokens_runs": a["tokens"], "seconds_runs": a["seconds"],
                                    "tokens_per_s": run_rate(a["tokens"], a["seconds"]),
                                    "prompts": a["prompts"], "greedy_mismatches": a["mismatches"],
                                    "stats": _stats_summary(a["stats"])}
    for m in methods:
        for cat in categories:
            row = summary[m.name][cat]
            base = summary[_reference(m)][cat]["tokens_per_s"]
            row["speedup"] = row["tokens_per_s"] / base if base else None
            for peer in (x.name for x in methods if x.kind == "baseline" and x.name != "plain"):
                    ref = summary[peer][cat]["tokens_per_s"]
                    row[f"vs_{peer}"] = row["tokens_per_s"] / ref if ref else None

    ours_fixed = [m for m in methods if m.kind == "ours" and m.gamma != "auto"]
    # our auto only: another proposer (--methods) or runtime (--compare-config) may draft "auto" too
    auto = next((m for m in methods if m.kind == "ours" and m.name == ours_name("auto")), None)
    auto_vs_best: dict[str, dict] = {}
    if ours_fixed and auto is not None:
        for cat in categories:
            best = max(ours_fixed, key=lambda m: summary[m.name][cat]["tokens_per_s"])
            b, a = summary[best.name][cat]["tokens_per_s"], summary[auto.name][cat]["tokens_per_s"]
            auto_vs_best[cat] = {"best_fixed": best.name, "best_gamma": best.gamma, "best_tokens_per_s": b,
                                 "auto_tokens_per_s": a, "auto_over_best": a / b if b else None}

    cost = raw["cost_model"]
    # the per-token acceptance the formula assumes: accepted over judged depths, pooled over the
    # runs that drafted chains (the formula's model; a tree's judged depths are an upper bound)
    chains = [m for m in ours_fixed if drafts_chains(summary[m.name]["all"]["stats"])]
    judged = sum(summary[m.name]["all"]["stats"]["judged_tokens"] for m in chains)
    accepted = sum(summary[m.name]["all"]["stats"]["accepted_tokens"] for m in chains)
    alpha = accepted / judged if judged else 0.0
    c = cost["draft_cost_ratio"]
    rel = cost["target_relative"]
    gammas = sorted({int(m.gamma) for m in ours_fixed} | set(range(1, 9)))
    # T(g+1)/T(1) is rel[g]; a γ past the measured curve has no verify cost (None, "–")
    verify = [rel[g] if g < len(rel) else None for g in gammas]
    theory = {
        "alpha": alpha,
        "c": c,
        "gammas": gammas,
        "ideal": [theoretical_speedup(alpha, g, c) for g in gammas],
        "with_verify_cost": [None if v is None else theoretical_speedup(alpha, g, c, v) for g, v in zip(gammas, verify)],
        "alpha_from": [m.name for m in chains],
        "measured": {str(m.gamma): summary[m.name]["all"]["speedup"] for m in chains},
        "measured_auto": summary[auto.name]["all"]["speedup"] if auto is not None else None,
    }

    rejected: Counter = Counter()
    for m in methods:
        if m.recorder is not None:
            rejected.update(m.recorder.rejected)
    top = [{"token_id": t, "text": tokenizer.decode([t]) if tokenizer is not None else str(t), "count": n}
           for t, n in rejected.most_common(25)]
    chosen = {m.name: {str(k): v for k, v in sorted(m.chosen_k.items())} for m in methods if m.chosen_k}
    return {
        "meta": {**meta, "duration_s": raw["duration_s"], "greedy": greedy},
        "methods": [{"name": m.name, "kind": m.kind, "gamma": m.gamma, "group": m.group,
                     "speedup_reference": _reference(m)} for m in methods],
        "unavailable_baselines": raw["unavailable"],
        "categories": categories,
        "summary": summary,
        "auto_vs_best_fixed": auto_vs_best,
        "auto_chosen_gamma": chosen,
        "cost_model": cost,
        "target_kernels": ({"choice": k.describe(), **k.to_dict()} if (k := raw.get("kernels")) is not None else None),
        "theory": theory,
        "greedy_mismatches": raw["mismatches"],
        "most_rejected_tokens": top,
        "prompts": per_prompt,
    }


def write_json(report: dict, path: Path) -> None:
    write_text_atomic(path, json.dumps(report, indent=1))


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(report: dict) -> str:
    """The summary tables a reader needs to pick a method."""
    meta, summ, cats = report["meta"], report["summary"], report["categories"]
    peers = [m["name"] for m in report["methods"] if m["kind"] == "baseline" and m["name"] != "plain"]
    L: list[str] = ["# spec-plugins bench", ""]
    L.append(f"config `{meta.get('config')}` · model `{meta.get('model')}` · proposer `{meta.get('proposer')}` · "
             f"prompts `{meta.get('prompts_file')}` ({meta.get('num_prompts')} prompts, {meta.get('num_turns')} turns) · "
             f"max_new_tokens {meta.get('max_new_tokens')} · runs {meta.get('runs')} · "
             f"bench took {meta['duration_s']:.0f} s")
    L.append("")
    lossy = [] if meta.get("greedy") else lossy_methods(report)  # greedy: every verifier matches the argmax
    if lossy:
        L += [f"**WARNING: LOSSY verifier `{meta.get('verifier', {}).get('type', '?')}`: the outputs of "
              + ", ".join(f"`{n}`" for n in lossy) + " do not follow the target model's distribution; their "
              "speedups are not for the same output as plain decoding's.**", ""]
    mm = report["greedy_mismatches"]
    if meta["greedy"]:
        if mm:
            pairs = len({(x["method"], x["question_id"]) for x in mm})  # what the tables' column sums to
            L.append(f"**WARNING: greedy outputs differ from plain decoding in {len(mm)} run(s) of {pairs} "
                     f"method × prompt pair(s):** "
                     + ", ".join(f"{x['method']} on {x['question_id']} (run {x.get('run', 0)}, turn {x['turn']}, "
                                 f"token {x['index']})"
                                 for x in mm))
        else:
            L.append("Greedy outputs: every method's tokens are identical to plain decoding on every prompt, "
                     "in every run.")
        L.append("")
    for name, why in report["unavailable_baselines"].items():
        L.append(f"Baseline `{name}` not run: {why}")
    head = "| method | γ | tokens/s | speedup vs plain | " + "".join(f"vs {p} | " for p in peers)
    head += "mean accepted / forward | acceptance | draft | verify | other | prompts with greedy mismatch |"
    L += ["## Overall", "", head, "|" + "---|" * (head.count("|") - 1)]
    for m in report["methods"]:
        r = summ[m["name"]]["all"]
        s = r["stats"]
        cells = [f"`{m['name']}`", str(m["gamma"] if m["gamma"] is not None else "–"), _f(r["tokens_per_s"], "{:.1f}"),
                 _f(r["speedup"]) + "×"]
        cells += [_f(r.get(f"vs_{p}")) + "×" for p in peers]
        if s is not None:
            sh = s["time_share"]
            cells += [_f(s["mean_accepted_tokens"]), _f(s["acceptance_rate"] if s["draft_tokens"] else None, "{:.0%}"), _f(sh["draft"], "{:.1%}"),
                      _f(sh["verify"], "{:.1%}"), _f(sh["other"] + sh["cache"], "{:.1%}")]
        else:
            cells += ["–"] * 5
        cells.append(str(r["greedy_mismatches"]) if meta["greedy"] else "–")
        L.append("| " + " | ".join(cells) + " |")
    L += ["", "draft / verify / other: share of our decode time spent proposing, in accept/reject + logits "
          "processing, and in cache bookkeeping + loop overhead (the rest is target forwards and prefill). "
          "prompts with greedy mismatch: prompts on which some run of the method differs from plain decoding "
          "(each differing run is listed above the table).", ""]
    others = [m for m in report["methods"] if m.get("group")]
    if others:
        L += ["`name@runtime`: measured on another runtime in the same run; its speedup is over "
              "`plain@runtime`, and `plain@runtime`'s speedup is over the primary runtime's `plain`; its "
              "greedy outputs are checked against `plain@runtime`, and `plain@runtime`'s against `plain`.", ""]
    for title, key, fmt in (("Speedup over plain by category", "speedup", "{:.2f}×"),
                            ("Tokens/s by category", "tokens_per_s", "{:.1f}")):
        L += [f"## {title}", "", "| method | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
        for m in report["methods"]:
            L.append(f"| `{m['name']}` | " + " | ".join(_f(summ[m['name']][c][key], fmt) for c in cats) + " |")
        L.append("")
    avb = report["auto_vs_best_fixed"]
    if avb:
        L += ["## auto against the best fixed γ", "", "| category | best fixed γ | its tokens/s | auto tokens/s | auto / best |",
              "|---|---|---|---|---|"]
        for c, r in avb.items():
            L.append(f"| {c} | {r['best_gamma']} | {r['best_tokens_per_s']:.1f} | {r['auto_tokens_per_s']:.1f} | "
                     f"{_f(r['auto_over_best'])} |")
        ch = report["auto_chosen_gamma"].get("ours_auto")
        if ch:
            L += ["", "γ chosen by auto (rounds): " + ", ".join(f"{k}: {v}" for k, v in ch.items())]
        L.append("")
    cm = report["cost_model"]
    pick = [n for n in (1, 2, 4, 8, 16, 32) if n <= len(cm["target_seconds"])]
    L += ["## Cost model (target forward over N new positions, warm cache)", "",
          "| N | " + " | ".join(str(n) for n in pick) + " |", "|" + "---|" * (len(pick) + 1),
          "| ms | " + " | ".join(f"{cm['target_seconds'][n - 1] * 1e3:.1f}" for n in pick) + " |",
          "| × T(1) | " + " | ".join(f"{cm['target_relative'][n - 1]:.2f}" for n in pick) + " |", "",
          f"Draft: {cm['draft_round_seconds'] * 1e3:.3f} ms per propose call + {cm['draft_step_seconds'] * 1e3:.3f} ms "
          f"per drafted token (c = {cm['draft_cost_ratio']:.3f} of one target forward).", ""]
    if k := report.get("target_kernels"):
        L += [f"Target matmul kernels (measured at load, `matmul: {matmul_setting(k)}`): {k['choice']}.", ""]
    th = report["theory"]
    if has_theory(report):  # without fixed-γ chain runs there is no α to put into the formula
        L += ["## Measured speedup against theory", "",
              f"α = {th['alpha']:.3f} (per-token acceptance of the fixed-γ chain runs: accepted / judged drafted tokens), "
              f"c = {th['c']:.3f}", "",
              "| γ | S(γ) ideal | S(γ) with measured verify cost | measured |", "|---|---|---|---|"]
        for g, a, b in zip(th["gammas"], th["ideal"], th["with_verify_cost"]):
            L.append(f"| {g} | {a:.2f} | {_f(b)} | {_f(th['measured'].get(str(g)))} |")
        L.append("")
    if report["most_rejected_tokens"]:
        L += ["## Most rejected draft tokens", "",
              ", ".join(f"{t['text']!r} ({t['count']})" for t in report["most_rejected_tokens"][:15]), ""]
    return "\n".join(L)


def matmul_setting(kernels: dict) -> str:
    """The runtime's ``matmul`` setting that measured ``target_kernels``: ``auto_transposed`` also
    times the transposed one-row kernel (``KernelChoice.to_dict`` records it), ``auto`` does not."""
    return "auto_transposed" if "transposed_1row_ms" in kernels else "auto"


def lossy_methods(report: dict) -> list[str]:
    """The methods whose pooled stats say a lossy verifier ran (``DecodeStats.lossy``): a reader
    must not take their speedups for lossless ones."""
    return [m["name"] for m in report["methods"]
            if (s := report["summary"][m["name"]]["all"]["stats"]) is not None and s.get("lossy")]


def drafts_chains(stats: dict | None) -> bool:
    """Whether a method's pooled stats (``_stats_summary``) drafted chains only: one node per depth
    per row-round that drafted it, the draft the formula S(γ) describes (a run that drafted
    nothing adds nothing to α and keeps its measured point)."""
    return stats is not None and stats["drafted_by_position"] == stats["rows_by_position"]


def has_theory(report: dict) -> bool:
    """Whether the run measured any fixed γ drafting chains (the theory table and plot need their
    pooled α)."""
    return any(v is not None for v in report["theory"].get("measured", {}).values())
