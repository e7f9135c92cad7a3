"""A PREDICTION, not a measurement: speculative decoding on the H200 from recorded acceptance.

Greedy acceptance does not depend on the device (the same model gives the same tokens), so the
dev prompts' recorded greedy outputs (a bench report, with the token ids of plain decoding) are
replayed through the real round (``spec_plugins.bench.replay``: the same policy, drafts,
verifier and commits as a live run) with the forward costs measured on the H200
(``../shared/gpu/*.jsonl``, random weights at SmolLM2's shape, bf16, context 512):

- ``eager``: one eager forward over N positions (measured to N = 128);
- ``graphed``: the same forward replayed as a CUDA graph, measured for N = 1 and 2 only, so wider
  steps are an assumption, printed with every row: ``graphed-rel`` scales N = 1 by the eager
  curve's relative cost, ``graphed-linear`` extends the N = 1 -> 2 step linearly (pessimistic);
- ``measured-graphs on <device>`` (with ``--measured $OUT/gpu_check.jsonl`` from a lent GPU): the
  captured bf16 step's own cost per width 1..17, as ``scripts/gpu_check.py`` measured it at each
  shape on that device (issue 45 item 3: n-gram ``auto`` on graphs at Llama-3.2-1B's shape is this
  replay under that curve); any other curve row (a CPU run's, one without its device) is refused,
  and its speedup over the stored eager curve is given only where both are the H200's.

Per round, the host's work outside forwards is ``--overhead-ms`` (default: the report's measured
per-round overhead on this CPU). Prints tokens/s per policy and category under each curve, and
the speedups that the GPU issue asks for (compiled plain / eager plain, n-gram `auto` and suffix
(its own drafting cost measured here) / compiled plain), for SmolLM2's shape and Llama-3.2-1B's (the
same acceptance: a prediction twice over for the larger shape; ``--shapes``).

    python scripts/gpu_prediction.py --report bench-out/report.json --prompts examples/prompts/dev.jsonl \
        [--measured gpu_check.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
STORED_DEVICE = "H200"  # the device the stored curves (../shared/gpu/h200-*.jsonl) were measured on
# what ``gpu_check`` writes on a CUDA device, the curve these rounds are priced as: the captured bf16
# step at the stored curves' context, widths 1..17 (``auto`` drafts at most 16, plus the round's token)
NEEDED = {"kv": "graphs", "dtype": "bfloat16", "context": 512}
NEEDED_WIDTHS = 17


def measured_curves(path: Path | None) -> dict[str, dict]:
    """shape -> the cost curve ``gpu_check`` measured on the device (its ``cost curve`` rows in
    ``gpu_check.jsonl``); none without ``path``. A path with no such row is refused: the
    prediction would silently fall back to the assumed curves; so is a row ``check_curve`` refuses."""
    if path is None:
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    found = {r["curve"]["shape"]: check_curve(r["curve"]) for r in rows if r.get("curve") and r.get("result") == "ok"}
    if not found:
        raise ValueError(f"{path} has no finished `cost curve` row: was it written by scripts/gpu_check.py on the device?")
    return found


def check_curve(curve: dict) -> dict:
    """``curve`` if it is a GPU's captured bf16 step over the widths priced (``NEEDED``); else a
    clear error naming what it is: a CPU smoke run's curve (``gpu_check --cpu``: static, float32,
    context 32, widths 1..3) or a row from before devices were recorded must not become a GPU's."""
    widths = sorted(int(k) for k in curve.get("ms", {}))
    device = curve.get("device")
    wrong = [k for k, v in NEEDED.items() if curve.get(k) != v]
    wrong += ["device"] if not device or device == "cpu" else []
    wrong += ["widths"] if widths[:NEEDED_WIDTHS] != list(range(1, NEEDED_WIDTHS + 1)) else []
    if wrong:
        raise ValueError(
            f"cost curve {curve.get('shape')!r} (kv={curve.get('kv')}, dtype={curve.get('dtype')}, context="
            f"{curve.get('context')}, device={device or 'not recorded'}, widths={widths}) cannot be priced: "
            f"{', '.join(wrong)} wrong; needed a CUDA device, kv={NEEDED['kv']}, dtype={NEEDED['dtype']}, "
            f"context={NEEDED['context']}, widths 1..{NEEDED_WIDTHS}, as scripts/gpu_check.py writes on the GPU")
    return curve


def measured_name(curve: dict) -> str:
    """A measured curve's name: its step and the device it was measured on (labels and summary keys)."""
    return f"measured-{curve['kv']} on {curve['device']}"


def headline(measured: dict[str, dict], turns: int, overhead: float) -> str:
    """The first printed line: what is predicted and under which devices' curves."""
    devices = sorted({c["device"] for c in measured.values()})
    return (f"PREDICTION (not measured): {STORED_DEVICE} bf16 curves (random weights at each shape)"
            + (f" and the curves gpu_check measured on {', '.join(devices)}" if devices else "")
            + f", acceptance of {turns} recorded greedy SmolLM2 turns, host overhead {overhead * 1e3:.2f} ms/round")


def summary(res: dict[str, dict], measured: dict | None) -> tuple[dict[str, float], list[str]]:
    """The speedups the GPU issue asks for, each a ratio of two rows priced on one device: a curve
    measured on another device than the stored ones is never divided by their eager plain (the
    notes say which ratios were left out, and why)."""
    e = res["eager"]["plain"]["all"]
    line, notes = {"compiled_plain_over_eager_plain": res["graphed-rel"]["plain"]["all"] / e}, []
    name = measured_name(measured) if measured else None
    if name in res and STORED_DEVICE.lower() in measured["device"].lower():
        line[f"{name}_plain_over_eager_plain"] = res[name]["plain"]["all"] / e
    elif name in res:
        notes.append(f"{name}_plain_over_eager_plain left out: measured on {measured['device']}, the eager "
                     f"curve on the {STORED_DEVICE} (a ratio across devices is no speedup)")
    for c in (c for c in res if c != "eager"):
        for p in ("ngram-auto", "suffix-auto"):
            line[f"{p}_over_compiled_plain[{c}]"] = res[c][p]["all"] / res[c]["plain"]["all"]
    return line, notes


def curves(directory: Path, shape: str = "smollm2", measured: dict | None = None) -> dict[str, list[float]]:
    """Seconds for N = 1..128 positions under each curve (module docstring), and ``measured-<kv>``
    where ``measured`` (``measured_curves``) has this shape: its widths as measured, wider ones
    extended along its last step (``auto`` drafts at most 16, so only trees read past 17)."""
    verify = [json.loads(x) for x in (directory / "h200-verify-curve.jsonl").read_text().splitlines() if x.strip()]
    graphs = [json.loads(x) for x in (directory / "h200-cuda-graphs.jsonl").read_text().splitlines() if x.strip()]
    eager = next(r for r in verify if r["shape"] == shape and r["dtype"] == "bfloat16")
    graph = {}
    for r in graphs:
        if r["shape"] == shape:
            graph.update({int(k): v for k, v in r["graph_static"].items()})
    rel = {int(k): v for k, v in eager["rel"].items()}
    xs = sorted(rel)

    def interp(n: int) -> float:
        lo = max(x for x in xs if x <= n)
        hi = min((x for x in xs if x >= n), default=lo)
        return rel[lo] if hi == lo else rel[lo] + (rel[hi] - rel[lo]) * (n - lo) / (hi - lo)

    t1, g1 = eager["t1_ms"] / 1e3, graph[1] / 1e3
    g2 = graph.get(2, graph[1]) / 1e3
    return {
        "eager": [t1 * interp(n) for n in range(1, 129)],
        "graphed-rel": [g1 * interp(n) for n in range(1, 129)],
        "graphed-linear": [g1 + (g2 - g1) * (n - 1) for n in range(1, 129)],
        **({measured_name(measured[shape]): _extended(measured[shape]["ms"])} if measured and shape in measured else {}),
    }


def _extended(ms: dict) -> list[float]:
    """Seconds for N = 1..128 from measured milliseconds per width (consecutive from 1)."""
    pts = sorted((int(k), float(v) / 1e3) for k, v in ms.items())
    if [n for n, _ in pts] != list(range(1, len(pts) + 1)):
        raise ValueError(f"a measured curve needs widths 1..N without gaps, got {[n for n, _ in pts]}")
    secs = [t for _, t in pts]
    step = max(0.0, secs[-1] - secs[-2]) if len(secs) > 1 else 0.0
    return secs + [secs[-1] + step * (n - len(secs)) for n in range(len(secs) + 1, 129)]


def check_prompts(report: dict, prompts_file: str) -> None:
    """Every prompt the report answered must be in ``prompts_file`` (the replay re-encodes its turns)."""
    from spec_plugins.bench.prompts import load_prompts

    have = {p.question_id for p in load_prompts(prompts_file)}
    missing = [e["question_id"] for e in report["prompts"] if e["question_id"] not in have]
    if missing:
        raise ValueError(f"prompts {missing[:5]} of the report are not in {prompts_file}; give --prompts the file "
                         f"the bench ran on (its meta.prompts_file: {report['meta'].get('prompts_file')})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", required=True, help="report.json of a greedy bench run (plain's token ids)")
    ap.add_argument("--prompts", required=True, help="the prompts file that run used")
    ap.add_argument("--curves", default=str(ROOT.parent / "shared" / "gpu"), help="folder of the H200 jsonl files")
    ap.add_argument("--overhead-ms", type=float, default=None, help="host work per round (default: the report's)")
    ap.add_argument("--shapes", default="smollm2,llama1b", help="curve shapes to predict for (SmolLM2's acceptance)")
    ap.add_argument("--eagle-report", default=None,
                    help="a bench report.json with an EAGLE tree method (its acceptance and drafting, measured on the CPU)")
    ap.add_argument("--eagle-method", default="eagle-tree-auto", help="that method's name in the report")
    ap.add_argument("--measured", type=Path, default=None,
                    help="gpu_check.jsonl from the device: its cost-curve rows price the rounds too (measured-<kv>)")
    ap.add_argument("--out", default=None, help="write the prediction as JSON here")
    args = ap.parse_args()
    from spec_plugins.backends import build_runtime
    from spec_plugins.bench.replay import (auto, fixed, not_replayable, replay_report, report_config, report_limits,
                                           round_overhead, turns_from_report)
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder
    from spec_plugins.policy import DraftCost, ForwardCost
    from spec_plugins.registry import PROPOSERS

    measured = measured_curves(args.measured)
    report = json.loads(Path(args.report).read_text())
    cfg = report_config(report)
    check_prompts(report, args.prompts)
    cfg = SpecConfig.parse({**cfg.model_dump(mode="json"), "proposer": {"type": "ngram", "num_draft_tokens": "auto",
                                                                        "max_ngram": 3}})
    if why := not_replayable(report.get("meta", {})):  # before the model loads
        raise ValueError(f"--report {args.report}: {why}")
    dec = SpeculativeDecoder(build_runtime(cfg.target), None, None, cfg)  # its tokenizer re-encodes the turns
    turns = turns_from_report(report, args.prompts, dec)
    limits = report_limits(report, dec)  # a turn that ended on EOS drafted its last rounds up to max_new
    overhead = args.overhead_ms / 1e3 if args.overhead_ms is not None else round_overhead(report)
    cm = report["cost_model"]
    draft = DraftCost(cm["draft_round_seconds"], cm["draft_step_seconds"])  # n-gram lookups: this CPU's
    ngram = PROPOSERS.get("ngram")
    suffix = PROPOSERS.get("suffix")
    make_ngram = lambda: ngram(ngram.Config(max_ngram=3))  # noqa: E731
    make_suffix = lambda: suffix(suffix.Config(scope="request", num_draft_tokens=16, tree_nodes="auto"))  # noqa: E731
    from spec_plugins.config import SamplingConfig
    from spec_plugins.policy.cost import measure_draft
    from spec_plugins.sampling import LogitsPipeline

    suffix_draft = measure_draft(make_suffix(), LogitsPipeline(SamplingConfig()), dec.target)  # this CPU's
    out: dict = {"overhead_ms": overhead * 1e3, "prediction": True, "shapes": {}}
    cats = list(dict.fromkeys(c for c, _, _ in turns)) + ["all"]
    print(headline(measured, len(turns), overhead))
    for shape in args.shapes.split(","):
        res = out["shapes"][shape] = {}
        for name, secs in curves(Path(args.curves), shape, measured).items():
            cost = ForwardCost.from_curve(secs)
            pol = {"ngram-auto": auto(cost, draft, max_k=16), **{f"ngram-k{k}": fixed(k) for k in (2, 4, 8)}}
            sim = replay_report(turns, make_ngram, pol, cost, overhead, draft, **limits)
            sim["suffix-auto"] = replay_report(turns, make_suffix, {"s": auto(cost, suffix_draft, max_k=16)}, cost,
                                               overhead, suffix_draft, **limits)["s"]
            res[name] = sim
            print(f"\n[{shape}, {name}] tokens/s (speedup over plain under the same curve)")
            print("policy        " + "".join(f"{c:>16}" for c in cats))
            for p, row in sim.items():
                print(f"{p:14}" + "".join(f"{row[c]:9.1f} ({row[c] / sim['plain'][c]:.2f}x)" for c in cats))
        line, notes = summary(res, measured.get(shape))
        res["summary"] = line
        print(f"\n{shape}: " + ";  ".join(f"{k} {v:.2f}x" for k, v in line.items()))
        print("".join(f"{shape}: {n}\n" for n in notes), end="")
    if args.eagle_report:
        out["eagle"] = eagle_rows(json.loads(Path(args.eagle_report).read_text()), args.eagle_method,
                                  Path(args.curves), args.shapes.split(","), overhead, measured)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def eagle_rows(report: dict, method: str, directory: Path, shapes: list[str], overhead: float,
               measured: dict | None = None) -> dict:
    """EAGLE tree rows, a PREDICTION from the CPU bench: its hidden-state drafter cannot be replayed
    from token ids, so each category's measured rounds (tokens emitted, nodes verified per round)
    are priced under the H200 curves, with the drafting of a round priced as it measured on the
    CPU relative to one target forward there (``r``: draft seconds per round / plain's seconds
    per forward), i.e. ``r x T(1)`` on the GPU. Plain: one position per token."""
    summ = report["summary"]
    out: dict = {}
    print(f"\nPREDICTION (not measured): {method} from the CPU bench {report['meta'].get('config', '')}")
    for shape in shapes:
        for name, secs in curves(directory, shape, measured).items():
            rows = out.setdefault(shape, {}).setdefault(name, {})
            for cat in report["categories"]:
                e, p = summ[method][cat], summ["plain"][cat]
                st, pst = e["stats"], p["stats"]
                rounds = st["target_forwards"]  # the stats pool every run: so do the tokens and seconds
                nodes = st["draft_tokens"] / rounds
                t_cpu = pst["time_share"]["target_forward"] * sum(p["seconds_runs"]) / pst["target_forwards"]
                r = st["time_share"]["draft"] * sum(e["seconds_runs"]) / rounds / t_cpu
                t_round = _at(secs, 1 + nodes) + r * secs[0] + overhead
                tok_s = sum(e["tokens_runs"]) / (rounds * t_round)
                plain = 1.0 / (secs[0] + overhead)
                rows[cat] = {"tok_s": tok_s, "plain_tok_s": plain, "speedup": tok_s / plain, "nodes": nodes,
                             "tokens_per_round": sum(e["tokens_runs"]) / rounds, "draft_over_forward": r}
            print(f"[{shape}, {name}] " + "  ".join(f"{c}: {v['speedup']:.2f}x" for c, v in rows.items()))
    return out


def _at(secs: list[float], n: float) -> float:
    """The curve at a fractional width (linear between neighbours)."""
    lo = max(1, min(int(n), len(secs)))
    hi = min(lo + 1, len(secs))
    return secs[lo - 1] + (secs[hi - 1] - secs[lo - 1]) * (n - lo)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
