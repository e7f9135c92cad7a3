"""Quantized ONNX Runtime graphs measured side by side in one process (issue 21): export and
quantization time, graph size, the verify-cost curve N = 1..16, perplexity on held-out ShareGPT
answers, and greedy agreement with fp32 on the dev prompts; llama.cpp's own Q4_1 GGUF measured
the same way. Picks the default scheme: the fastest (one-position forward) whose perplexity is
within 2 % of fp32's, else int8.

    python scripts/quant_report.py --out docs/reports/quantization.json

Run it alone on the machine (it times forwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = {  # label -> ONNX Runtime config fields
    "fp32": {},
    "int8": {"quantize": "int8"},
    "int8-fp32head": {"quantize": "int8", "quant_lm_head": False},
    "int4": {"quantize": "int4"},
    "int4-fp32head": {"quantize": "int4", "quant_lm_head": False},
    "int4-b16": {"quantize": "int4", "quant_block_size": 16},
    "int4-asym": {"quantize": "int4", "quant_symmetric": False},
    "int4-gguf": {"quantize": "int4", "quant_grid": "gguf"},
}
# the least each count may be (a scored token needs one before it: --max-seq 2), checked before
# anything loads rather than after the fp32 export, when perplexity() would refuse an empty set
MINIMA = {"heldout": 1, "max_seq": 2, "new_tokens": 1, "threads": 1}


def dev_first_turns(n: int) -> list[str]:
    """The first ``n`` distinct first turns of the dev prompts, in file order. dev-extended.jsonl
    starts with dev.jsonl's prompts, so without dropping repeats some prompts would count twice in
    the agreement figures; fewer than ``n`` distinct turns is refused rather than padded."""
    rows = []
    for f in ("dev.jsonl", "dev-extended.jsonl"):
        rows += [json.loads(x) for x in (ROOT / "examples" / "prompts" / f).read_text().splitlines() if x.strip()]
    turns = list(dict.fromkeys(r["turns"][0] for r in rows))
    if not 1 <= n <= len(turns):
        raise ValueError(f"--prompts {n}: the dev prompts have {len(turns)} distinct first turns; ask for 1 to {len(turns)}")
    return turns[:n]


def scheme_labels(text: str) -> list[str]:
    """The ``--schemes`` labels, checked against ``SCHEMES`` before anything is loaded. fp32 is the
    reference every scheme is compared with, so it is measured first even when not asked for."""
    labels = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in labels if x not in SCHEMES]
    if unknown or not labels:
        raise ValueError(f"--schemes {text!r}: unknown {', '.join(unknown) or 'empty list'}; "
                         f"known: {', '.join(SCHEMES)}")
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"--schemes {text!r}: {', '.join(repeated)} given more than once")
    if "fp32" not in labels:
        print("fp32 added to --schemes: it is the reference for perplexity and greedy agreement", flush=True)
    return ["fp32", *(x for x in labels if x != "fp32")]


def check_counts(args: argparse.Namespace) -> None:
    """Each count in ``MINIMA`` at least its least, named by its flag (ValueError otherwise)."""
    for name, least in MINIMA.items():
        value = getattr(args, name)
        if value < least:
            raise ValueError(f"--{name.replace('_', '-')} {value}: give at least {least}")


def read_report(path: Path) -> dict:
    """A saved report for ``--from-json``; a missing or malformed file is refused by name."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--from-json {path}: {exc}") from exc


def write_atomic(path: Path, text: str) -> None:
    """A report written whole or not at all (``spec_plugins.files``)."""
    from spec_plugins.files import write_text_atomic

    write_text_atomic(path, text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heldout", type=int, default=16, help="held-out ShareGPT conversations for perplexity")
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=10, help="dev prompts for greedy agreement")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--markdown", default="", help="also write the tables as a section of this page")
    ap.add_argument("--title", default="Quantized ONNX Runtime graphs: speed and quality",
                    help="the section's title (a section per machine: sections are replaced by title)")
    ap.add_argument("--from-json", default="", help="render --markdown from a saved report, measure nothing")
    args = ap.parse_args()
    if args.from_json and not args.markdown:
        ap.error("--from-json renders --markdown: give the page to write")
    try:
        if args.markdown:
            from spec_plugins.bench.docs import check_title

            check_title(Path(args.markdown), args.title)
        if args.from_json:
            write_markdown(read_report(Path(args.from_json)), Path(args.markdown), args.title)
            return
        check_counts(args)
        labels = scheme_labels(args.schemes)
        turns = dev_first_turns(args.prompts)
    except ValueError as exc:
        ap.error(str(exc))

    import torch

    from spec_plugins.bench.quality import greedy_agreement, perplexity
    from spec_plugins.config import SamplingConfig
    from spec_plugins.loop import decode
    from spec_plugins.models import load_gguf_tokenizer
    from spec_plugins.policy import Costs
    from spec_plugins.registry import BACKENDS
    from spec_plugins.sampling import LogitsPipeline
    from spec_plugins.training.sources import sharegpt_examples
    from spec_plugins.verifiers import ExactVerifier

    torch.set_num_threads(args.threads)
    tok = load_gguf_tokenizer(args.model)
    held = []
    for ids, trained in sharegpt_examples(tok, "heldout", args.max_seq):
        held.append((ids, trained))
        if len(held) >= args.heldout:
            break
    if not held:  # each conversation's answer starts past --max-seq: perplexity() would refuse
        ap.error(f"--max-seq {args.max_seq}: no held-out ShareGPT conversation has an answer token within it")
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True)["input_ids"]) for p in turns]

    def greedy(rt) -> list[list[int]]:
        outs = []
        for p in prompts:
            toks: list[int] = []
            for step in decode(rt, None, ExactVerifier(), LogitsPipeline(SamplingConfig()), [p], args.new_tokens,
                               [tok.eos_token_id]):
                toks += step.emitted.get(0, [])
            outs.append(toks)
        return outs

    results: dict[str, dict] = {}
    reference = None
    runtimes = [(label, {"backend": "onnxruntime", "model": args.model, "threads": args.threads, **SCHEMES[label]})
                for label in labels]
    if args.llamacpp:
        runtimes.append(("llamacpp-Q4_1", {"backend": "llamacpp", "model": args.model, "threads": args.threads}))
    for label, section in runtimes:
        print(f"== {label}", flush=True)
        t0 = time.perf_counter()
        cls = BACKENDS.get(section["backend"])
        rt = cls.from_config(cls.Config(**section))
        load = time.perf_counter() - t0
        entry = getattr(rt, "entry", None)
        cost = Costs.measure(rt, max_positions=16, repeats=5).forward.base
        ppl = perplexity(rt, [h[0] for h in held], [h[1] for h in held])
        outs = greedy(rt)
        if label == "fp32":
            reference = outs
        results[label] = {
            "config": section, "load_or_export_seconds": round(load, 1),
            "graph_bytes": entry.size_bytes if entry is not None else None,
            "quantization": entry.quantization if entry is not None else None,
            "t1_ms": round(cost(1, 1) * 1e3, 2),
            "cost_relative": [round(cost(1, n) / cost(1, 1), 3) for n in range(1, 17)],
            "perplexity": round(ppl.ppl, 4), "perplexity_tokens": ppl.tokens,
            "greedy": outs,
        }
        print(json.dumps({k: v for k, v in results[label].items() if k != "greedy"}), flush=True)
        del rt
    base = results["fp32"]["perplexity"]
    for r in results.values():
        r["perplexity_vs_fp32"] = round(r["perplexity"] / base - 1, 4)
        r["agreement_with_fp32"] = greedy_agreement(r["greedy"], reference)
    ok = [k for k, r in results.items() if k.startswith("int") and r["perplexity_vs_fp32"] <= 0.02]
    default = min(ok, key=lambda k: results[k]["t1_ms"]) if ok else "int8"
    from spec_plugins.bench.docs import machine

    report = {"machine": machine(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
              "command": shlex.join(["python", "scripts/quant_report.py", *sys.argv[1:]]),
              "heldout_conversations": len(held), "dev_prompts": len(prompts),
              "new_tokens": args.new_tokens, "results": results, "default_scheme": default,
              "within_2pct": ok}
    print(f"default scheme: {default} (within 2 % of fp32 perplexity: {ok or 'none'})")
    staged = stage_markdown(report, Path(args.markdown), args.title) if args.markdown else None
    try:
        if args.out:
            write_atomic(Path(args.out), json.dumps(report, indent=1) + "\n")
    except BaseException:
        if staged is not None:
            staged.unlink(missing_ok=True)
        raise
    if staged is not None:
        staged.replace(args.markdown)


def write_markdown(report: dict, doc: Path, title: str) -> None:
    """The quantization tables as a section of ``doc``, replaced in one rename."""
    stage_markdown(report, doc, title).replace(doc)


def stage_markdown(report: dict, doc: Path, title: str) -> Path:
    """A copy of ``doc`` beside it with the quantization section updated (``spec_plugins.bench.docs``),
    for the caller to rename into place once every output is ready; nothing is left on failure."""
    import shutil

    from spec_plugins.bench.docs import update
    from spec_plugins.files import temp_beside

    text = markdown_section(report, title)
    tmp = temp_beside(doc)
    try:
        if doc.exists():
            shutil.copyfile(doc, tmp)
        else:  # update() starts a missing page with its header, an empty one without
            tmp.unlink()
        update(tmp, title, text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def markdown_section(report: dict, title: str) -> str:
    """The quantization tables of ``report`` as the text of a section titled ``title``."""
    res = report["results"]
    lines = [f"## {title}", "",
             f"- machine: {report['machine']}, {report['threads']} threads", f"- date: {report['date']}",
             f"- command: `{report['command']}`", "",
             f"Perplexity on {report['heldout_conversations']} held-out ShareGPT conversations (assistant tokens, "
             f"{next(iter(res.values()))['perplexity_tokens']} tokens); greedy agreement with fp32 on "
             f"{report['dev_prompts']} distinct dev prompts ({report['new_tokens']} new tokens); T(N) = one forward over N "
             "new positions.", "",
             "| runtime / scheme | graph MB | T(1) ms | T(4)/T(1) | T(8)/T(1) | T(16)/T(1) | perplexity | vs fp32 | "
             "identical to fp32 | first divergence |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in res.items():
        rel = r["cost_relative"]
        agree = r["agreement_with_fp32"]
        firsts = [f for f in agree["first_difference"] if f is not None]
        size = f"{r['graph_bytes'] / 2**20:.0f}" if r.get("graph_bytes") else "–"
        lines.append(f"| {label} | {size} | {r['t1_ms']:.1f} | {rel[3]:.2f} | {rel[7]:.2f} | {rel[15]:.2f} | "
                     f"{r['perplexity']:.3f} | {r['perplexity_vs_fp32']:+.1%} | {agree['identical']}/{agree['of']} | "
                     f"{f'{min(firsts)}-{max(firsts)}' if firsts else 'none'} |")
    lines += ["", f"Default scheme (the fastest one-position forward within 2 % of fp32's perplexity): "
                  f"**{report['default_scheme']}**; within 2 %: {', '.join(report['within_2pct']) or 'none'}.", ""]
    if report.get("note"):  # a correction made to the report after its run, shown with its tables
        lines += [f"Note: {report['note']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
