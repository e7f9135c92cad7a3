"""The data curve and the ablation of the trained drafters (issue 20), from finished training runs.

For each run directory (``train_report.json`` + the head): the training data size and time and
the held-out numbers from its report, and accepted tokens per target forward measured in the
real loop: the dev prompts' first turns, greedy, 64 new tokens (by default), EAGLE tree (16 nodes) and chain
on ONNX Runtime. Acceptance does not depend on timing, so this may run beside other work.
Writes a JSON file, a plot and a section of docs/benchmarks.md.

    python scripts/data_curve.py --runs runs   # the runs of scripts/train_heads.sh
    python scripts/data_curve.py --runs runs --only eagle-b1-e2,eagle-1.5M-b1 --merge   # add runs

Each row names the machine it was trained on: held-out top-1 and accepted tokens per forward do
not depend on the machine, training time does.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def dev_turns(n: int = 7) -> list[str]:
    rows = [json.loads(x) for x in (ROOT / "examples/prompts/dev.jsonl").read_text().splitlines() if x.strip()]
    return [r["turns"][0] for r in rows][:n]


def target_and_prompts() -> tuple:
    """SmolLM2 on ONNX Runtime (fp32) and the dev prompts' first turns in its chat template."""
    from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

    target = OnnxRuntime.from_config(OnnxRuntime.Config(model="smollm2-135m-instruct"))
    tok = target.tokenizer
    return target, [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True)["input_ids"]) for t in dev_turns()]


def accepted(target, head: Path, kind: str, mode: str, prompts: list[list[int]], new: int) -> float:
    from spec_plugins.config import SpecConfig
    from spec_plugins.decoder import SpeculativeDecoder

    layer = kind in ("eagle", "parallel")  # drafters of the EAGLE layer: the same tree settings
    section = {"type": kind, "heads": str(head), "mode": mode, "num_draft_tokens": 6 if layer else 4}
    if mode == "tree":
        section.update(tree_nodes=16 if layer else 12, top_k=4)
    cfg = SpecConfig.parse({"target": {"backend": "onnxruntime", "model": "smollm2-135m-instruct"},
                            "proposer": section})
    dec = SpeculativeDecoder.from_config(cfg, target=target)
    emitted = forwards = 0
    for p in prompts:
        r = dec.generate(p, new)
        emitted += r.stats.emitted_tokens
        forwards += r.stats.target_forwards
    return round(emitted / forwards, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--curve", default="eagle-16000,eagle-48000,eagle-128000,eagle-full")
    ap.add_argument("--ablation", default="abl-b1-full,abl-b1-no-ttt,abl-b1-no-fused,abl-b1-top1,abl-b1-self")
    ap.add_argument("--medusa", default="medusa-full")
    ap.add_argument("--longer", default="eagle-b1-e2,eagle-1.5M-b1,gpu-eagle-19M",
                    help="the full recipe trained longer (batch 1, several epochs, more data): the next rungs")
    ap.add_argument("--only", default=None, help="measure only these runs (comma list)")
    ap.add_argument("--merge", action="store_true", help="keep the rows of --out that are not measured again")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="docs/reports/drafters.json")
    ap.add_argument("--plot", default="docs/img/data_curve.png")
    ap.add_argument("--markdown", default="docs/benchmarks.md")
    args = ap.parse_args()

    target, prompts = target_and_prompts()
    from spec_plugins.bench.docs import machine

    runs = Path(args.runs)
    rows: dict[str, dict] = {}
    old = json.loads(Path(args.out).read_text()) if args.merge and Path(args.out).is_file() else {}
    order = [*args.curve.split(","), *args.longer.split(","), *args.ablation.split(","), *args.medusa.split(",")]
    names = args.only.split(",") if args.only else order
    for name in dict.fromkeys(order + names):
        if name not in names:
            if name in old:
                rows[name] = kept_row(name, old[name], runs / name)
            continue
        d = runs / name
        if not (d / "train_report.json").is_file():
            print(f"{name}: no finished run, skipped")
            continue
        rep = json.loads((d / "train_report.json").read_text())
        facts = head_facts(d)
        kind = facts["kind"]
        row = {**facts, "train_tokens": rep["train_tokens"], "train_seconds": rep["train_seconds"],
               "steps": rep["steps"], "draft_vocab": rep["draft_vocab"], "coverage": rep["draft_vocab_coverage"],
               "heldout": rep.get("heldout"), "head_bytes": rep["head_bytes"], "train": rep["train"],
               "features": rep["features"].get("responses"), "machine": rep.get("trained_on") or machine()}
        modes = ("tree", "chain")
        for mode in modes:
            row[f"accepted_{mode}"] = accepted(target, d, kind, mode, prompts, args.new_tokens)
        rows[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k not in ("train",)}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    curve = [rows[n] for n in args.curve.split(",") if n in rows]
    plot(curve, [rows[n] for n in args.longer.split(",") if n in rows], Path(args.plot))
    write_markdown(rows, args, Path(args.markdown))


def head_facts(run: Path) -> dict:
    """The head's kind and whether it reads fused target layers, from the run's config.json (its
    name says neither: a parallel run is no Medusa head, a run may be named for other settings)."""
    path = run / "config.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no head config; the table reads the head's kind and input from it (for a row "
                         "of --out written before it recorded them too): give --runs the run's finished directory")
    cfg = json.loads(path.read_text())
    return {"kind": cfg["kind"], "fused": bool(cfg.get("feature_layers"))}


def kept_row(name: str, row: dict, run: Path) -> dict:
    """A row of --out kept by --merge. One written before it recorded the head's kind and input
    takes them from its run's config.json, or where that run is gone, from its name as the table
    read them then (``no-fused`` in it: the last hidden state), with a warning saying so."""
    if "kind" in row and "fused" in row:
        return row
    if (run / "config.json").is_file():
        return {**row, **head_facts(run)}
    kind = row.get("kind") or ("medusa" if "medusa" in name else "eagle")
    facts = {"kind": kind, "fused": kind == "eagle" and "no-fused" not in name}
    print(f"warning: {name}: its row in --out records no head kind or input and {run / 'config.json'} is "
          f"absent; taken from its name: {facts} (give --runs the run's directory to read them)", flush=True)
    return {**row, **facts}


def describe(r: dict) -> str:
    """The table's ``labels / input / TTT`` of a row (its ``kind`` and ``fused`` from ``head_facts``)."""
    t = r["train"]
    if r["kind"] == "medusa":
        return f"{t.get('loss')} / medusa heads / –"
    layers = "fused" if r["fused"] else "last hidden"
    if r["kind"] == "parallel":
        return f"{t.get('loss')} / {layers}, parallel block / –"
    return f"{t.get('loss')} / {layers} / {t.get('unroll')}"


def plot(curve: list[dict], longer: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curve:
        return
    xs = [r["train_tokens"] for r in curve]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    ax[0].plot(xs, [r["heldout"]["top1_by_step"][0] for r in curve], "o-", label="step 1")
    ax[0].plot(xs, [r["heldout"]["top1_by_step"][2] for r in curve], "s--", label="step 3 (own features)")
    ax[0].set_ylabel("held-out top-1 (= the target's greedy token)")
    ax[1].plot(xs, [r["accepted_tree"] for r in curve], "o-", label="EAGLE tree (16 nodes)")
    ax[1].plot(xs, [r["accepted_chain"] for r in curve], "s--", label="EAGLE chain")
    ax[1].plot(xs, [r["heldout"]["accepted_along_text"] for r in curve], "^:", label="chain along held-out text")
    if longer:  # the same recipe at batch 1 over several epochs: more optimizer steps per token
        lx = [r["train_tokens"] for r in longer]
        ax[0].plot(lx, [r["heldout"]["top1_by_step"][0] for r in longer], "D-", color="C3",
                   label="step 1, batch 1, several epochs")
        ax[1].plot(lx, [r["accepted_tree"] for r in longer], "D-", color="C3", label="tree, batch 1, several epochs")
    ax[1].set_ylabel("accepted tokens per target forward")
    for a in ax:
        a.set_xscale("log")
        a.set_xlabel("training tokens (ShareGPT, fixed responses)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("EAGLE-3-style drafter for SmolLM2-135M: data curve")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write_markdown(rows: dict[str, dict], args: argparse.Namespace, doc: Path) -> None:
    from spec_plugins.bench.docs import update

    machines = list(dict.fromkeys(r.get("machine", "") for r in rows.values()))
    head = ("| run | labels / input / TTT | train tokens | batch x epochs (steps) | train time | machine | "
            "held-out top-1 (steps 1, 2, 3) | chain along held-out text | accepted / forward: tree | chain |")
    lines = ["## Trained drafters: data curve and ablation", "",
             *[f"- machine {chr(65 + i)}: {m or 'not recorded'}" for i, m in enumerate(machines)],
             "- command: `bash scripts/train_heads.sh && python scripts/data_curve.py`",
             f"- accepted tokens per forward: dev prompts' first turns, greedy, {args.new_tokens} new tokens, "
             "ONNX Runtime fp32, EAGLE tree of 16 nodes (top-4, depth 6) and chain of 5; Medusa tree of 12 and chain of 4",
             "- held-out top-1 and accepted tokens do not depend on the machine; training time does",
             "", head, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        t = r["train"]
        desc = describe(r)
        if r["features"] == "self":
            desc += " (self-distilled)"
        h = r["heldout"] or {}
        top = h.get("top1_by_step") or h.get("top1_by_head") or []
        lines.append(f"| {name} | {desc} | {r['train_tokens']:,} | {t.get('batch_size')} x {t.get('epochs'):g} "
                     f"({r['steps']:,}) | {r['train_seconds'] / 60:.1f} min | "
                     f"{chr(65 + machines.index(r.get('machine', '')))} | "
                     f"{', '.join(f'{x:.3f}' for x in top[:3])} | {h.get('accepted_along_text', '–')} | "
                     f"{r['accepted_tree']} | {r['accepted_chain']} |")
    lines += ["", "![data curve](img/data_curve.png)", ""]
    update(doc, "Trained drafters: data curve and ablation", "\n".join(lines))

if __name__ == "__main__":
    main()
