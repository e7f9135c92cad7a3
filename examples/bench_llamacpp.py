"""Compact llama.cpp comparison in one process: plain, ours (n-gram, fixed k and auto) and
llama-cpp-python's own plain / prompt-lookup decoding, interleaved per prompt, medians of runs;
then the same n-gram config with only the backend line changed (torch vs llamacpp).

    flock /tmp/spec-bench.lock python examples/bench_llamacpp.py --runs 3 --max-new-tokens 64

`spec-plugins bench --baselines llamacpp,llamacpp_prompt_lookup` gives the full report; this script
is the short version used for the numbers in the README."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
# the side-by-side configs: only the backend line differs
SIDE_BY_SIDE = {"torch": ROOT / "examples" / "configs" / "smollm2-ngram.yaml",
                "llamacpp": ROOT / "examples" / "configs" / "smollm2-ngram-llamacpp.yaml"}

TEXT = ("The city council voted on Tuesday to expand the bicycle lane network by 40 kilometres over the "
        "next three years. The plan adds protected lanes on the main north-south avenues, new bike parking "
        "near the train stations and a bike-share scheme with 500 bicycles. Opponents said the lanes would "
        "slow car traffic; supporters said the city must cut emissions and make short trips safer.")
PROMPTS = {
    "copy": "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "summary": "Summarise the following article in three sentences, quoting its numbers.\n\n" + TEXT,
    "code": "Add a docstring to this Python function and keep the code unchanged:\n\n"
            "def merge_counts(a, b):\n    result = dict(a)\n    for key, value in b.items():\n"
            "        result[key] = result.get(key, 0) + value\n    return result\n",
    "open": "Give three tips for learning to play the guitar.",
}


def _methods(model: str, k: int, threads: int):
    from spec_plugins import SpeculativeDecoder
    from spec_plugins.bench.baselines import BASELINES, BaselineContext, time_decoder

    base = {"target": {"backend": "llamacpp", "model": model, "threads": threads}, "sampling": {"temperature": 0.0}}
    auto = SpeculativeDecoder.from_config({**base, "proposer": {"type": "ngram", "num_draft_tokens": "auto",
                                                                "max_ngram": 3}})
    fixed = SpeculativeDecoder.from_config({**base, "proposer": {"type": "ngram", "num_draft_tokens": k,
                                                                 "max_ngram": 3}}, target=auto.target)
    ctx = BaselineContext(fixed, k, tuple(fixed.eos_ids()))
    ctx10 = BaselineContext(fixed, 10, tuple(fixed.eos_ids()))
    return auto, {
        "plain": lambda ids, n: time_decoder(auto.without_speculation(), ids, n),
        f"ours k={k}": lambda ids, n: time_decoder(fixed, ids, n),
        "ours auto": lambda ids, n: time_decoder(auto, ids, n),
        "llama-cpp-python plain": BASELINES.get("llamacpp")(ctx),
        f"llama-cpp-python PLD k={k}": BASELINES.get("llamacpp_prompt_lookup")(ctx),
        "llama-cpp-python PLD k=10": BASELINES.get("llamacpp_prompt_lookup")(ctx10),
    }


def compare(model: str, k: int, runs: int, max_new: int, threads: int) -> dict:
    dec, methods = _methods(model, k, threads)
    out: dict = {}
    names = list(methods)
    for pname, text in PROMPTS.items():
        ids = dec.encode(text, chat=dec.has_chat_template)
        speeds: dict[str, list[float]] = {m: [] for m in names}
        toks: dict[str, list[int]] = {}
        for r in range(runs + 1):  # run 0 warms up and is not counted
            order = names[r % len(names):] + names[: r % len(names)]
            for m in order:
                res = methods[m](ids, max_new)
                if r:
                    speeds[m].append(len(res.tokens) / res.seconds)
                toks[m] = res.tokens
        ref = toks["llama-cpp-python plain"]
        out[pname] = {m: {"tok_s": statistics.median(v), "tok_s_runs": v,
                          "agree_vs_llama_cpp_plain": sum(a == b for a, b in zip(toks[m], ref)) / max(len(ref), 1),
                          "identical": toks[m] == ref, "tokens": len(toks[m])} for m, v in speeds.items()}
        print(model, pname, json.dumps({m: round(d["tok_s"], 1) for m, d in out[pname].items()}), flush=True)
    return out


def side_by_side_configs(threads: int) -> dict[str, dict]:
    """``SIDE_BY_SIDE``'s configs, read from the repository whatever the working directory, each
    target on ``threads`` threads (the files leave them to the runtime's default), as the first
    stage's targets are."""
    from spec_plugins.config import load_file

    configs = {b: load_file(path) for b, path in SIDE_BY_SIDE.items()}
    return {b: {**cfg, "target": {**cfg["target"], "threads": threads}} for b, cfg in configs.items()}


def backends_side_by_side(runs: int, max_new: int, threads: int) -> dict:
    """examples/configs/smollm2-ngram.yaml vs -llamacpp.yaml: only the backend line differs."""
    from spec_plugins import SpeculativeDecoder

    res = {}
    decs = {b: SpeculativeDecoder.from_config(cfg) for b, cfg in side_by_side_configs(threads).items()}
    for pname, text in PROMPTS.items():
        row = {}
        for b, d in decs.items():
            d.generate(text, max_new_tokens=8, chat=d.has_chat_template)  # warm-up
            speeds, plain = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                r = d.generate(text, max_new_tokens=max_new, chat=d.has_chat_template)
                speeds.append(len(r.token_ids) / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                p = d.without_speculation().generate(text, max_new_tokens=max_new,
                                                    chat=d.has_chat_template)
                plain.append(len(p.token_ids) / (time.perf_counter() - t0))
            row[b] = {"ngram_tok_s": statistics.median(speeds), "plain_tok_s": statistics.median(plain),
                      "identical_to_own_plain": r.token_ids == p.token_ids}
        res[pname] = row
        print("torch vs llamacpp", pname, json.dumps(row), flush=True)
    return res


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, so that 0 runs or tokens is a usage error before any
    model loads, not a failed median after every method ran."""
    return bounded_int(text, None)


def thread_count(text: str) -> int:
    """An argparse type: a thread count, 1..MAX_THREADS as every runtime takes it."""
    from spec_plugins.backends.llamacpp_config import (
        MAX_THREADS,  # imported once HF_HUB_OFFLINE is set
    )

    return bounded_int(text, MAX_THREADS)


def bounded_int(text: str, most: int | None) -> int:
    """An integer >= 1 (and <= ``most`` where given), or argparse's usage error."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1 or (most is not None and n > most):
        raise argparse.ArgumentTypeError(f"must be in 1..{most}, got {n}" if most else f"must be >= 1, got {n}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its numbers checked before anything loads."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--k", type=int, default=4, help="fixed draft length for ours and the peer")
    ap.add_argument("--runs", type=positive_int, default=3, help="timed runs per method and prompt (medians)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--threads", type=thread_count, default=2,
                    help="threads of every target, the side-by-side configs' too")
    ap.add_argument("--skip-backends", action="store_true")
    ap.add_argument("--out", default="bench-llamacpp.json")
    return ap.parse_args(argv)


def main() -> None:
    a = parse_args()
    t0 = time.perf_counter()
    report = {"models": {m: compare(m, a.k, a.runs, a.max_new_tokens, a.threads) for m in a.models.split(",")}}
    if not a.skip_backends:
        report["backends"] = backends_side_by_side(a.runs, a.max_new_tokens, a.threads)
    report["wall_s"] = time.perf_counter() - t0
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.out} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
