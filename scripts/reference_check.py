"""Greedy output of configs against transformers' own greedy generate(), on a prompt file.

For each config: every turn of every prompt as a one-turn chat, decoded by our engine one row at
a time and all rows as one batch, compared with ``model.generate`` on the same weights one prompt
at a time (``spec_plugins.bench.reference``: a split is allowed only at a near-tie of the
reference's own logits, and is reported with its gap). Needs a torch target (the reference runs
the same model). Prints one table; exit 1 on any FAIL.

    python scripts/reference_check.py --config default --config examples/configs/smollm2-eagle.yaml \
        --prompts examples/prompts/dev.jsonl --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", required=True, help="config file, or 'default' (repeatable)")
    ap.add_argument("--prompts", default="examples/prompts/dev.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    import torch
    import transformers

    from spec_plugins import SpeculativeDecoder
    from spec_plugins.bench.prompts import load_prompts
    from spec_plugins.bench.reference import compare, greedy_reference
    from spec_plugins.config import SpecConfig, default_config

    print(f"reference_check: transformers {transformers.__version__}, torch {torch.__version__}, {cpu_name()}")
    prompts = load_prompts(args.prompts)
    rows, failed = [], False
    for name in args.config:
        cfg = default_config() if name == "default" else SpecConfig.from_file(name)
        dec = SpeculativeDecoder.from_config(cfg)
        model = getattr(dec.target, "model", None)
        if model is None or not hasattr(model, "generate"):
            raise SystemExit(f"{name}: the reference needs a torch target (target.backend: torch)")
        ids = [dec.encode(t, chat=dec.has_chat_template) for p in prompts for t in p.turns]
        eos = dec.eos_ids()
        t0 = time.perf_counter()
        refs = greedy_reference(model, ids, args.max_new_tokens, eos)
        t_ref = time.perf_counter() - t0
        dtype = next(model.parameters()).dtype
        one = [dec.generate_batch([x], max_new_tokens=args.max_new_tokens)[0] for x in ids]
        batch = dec.generate_batch(ids, max_new_tokens=args.max_new_tokens)
        for layout, res in (("one row at a time", one), (f"one batch of {len(ids)}", batch)):
            verdict = compare([r.token_ids for r in res], refs, dtype)
            failed |= not verdict.ok
            acc = sum(r.stats.mean_accepted_tokens for r in res) / len(res)
            rows.append((name, layout, verdict.verdict, f"{acc:.2f}", sum(len(r.token_ids) for r in res),
                         verdict.note))
        print(f"{name}: {len(ids)} prompts, reference {t_ref:.0f} s", flush=True)
    print("\n| config | layout | vs transformers generate() | accepted/forward | tokens | note |\n|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
