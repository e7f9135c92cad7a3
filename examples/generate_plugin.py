"""Speculative decoding inside ``model.generate()``: the model you loaded is the target, the draft
source comes from a spec config. Runs the one-line plugin call, then compares batched speculative
``generate()`` against plain ``generate()`` on the same left-padded batch (tokens/s, greedy rows).

    HF_HUB_OFFLINE=1 python examples/generate_plugin.py --batch 4 8 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spec_plugins import DecodeStats
from spec_plugins.integrations.transformers import speculative_generate
from spec_plugins.models import resolve_model

PROMPTS = [
    "Rewrite this list in upper case: apple, banana, cherry, apple, banana, cherry.",
    "Write a Python function that adds two numbers, then a second one that multiplies them.",
    "Name the planets of the solar system, one per line.",
    "Explain photosynthesis in simple terms.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
    "Give me a recipe for pancakes.",
    "Write a haiku about the moon.",
    "Correct the spelling in this sentence and repeat it: 'Teh cat sat on teh mat and looked at teh dog.'",
]


def useful(row: torch.Tensor, eos: int) -> list[int]:
    """New tokens up to and including the first EOS (what a user reads; pads after it dropped)."""
    toks = row.tolist()
    return toks[: toks.index(eos) + 1] if eos in toks else toks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--config", default="examples/configs/smollm2-ngram.yaml")
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    src = resolve_model(args.model)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file)
    tok.padding_side = "left"  # decoder-only batches are left-padded
    print(f"loaded {src.gguf_file} with from_pretrained(dir, gguf_file=...) in {time.perf_counter() - t0:.1f} s")

    # 1. the plugin call, one prompt
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, custom_generate=speculative_generate, spec_config=args.config,
                         max_new_tokens=args.max_new_tokens)
    print("batch 1:", repr(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)))

    # 2. batches: plain generate() vs speculative generate() on the same inputs, same process
    eos = int(model.generation_config.eos_token_id)
    warm = tok(["Hello"], return_tensors="pt")
    model.generate(**warm, max_new_tokens=4)
    model.generate(**warm, max_new_tokens=4, custom_generate=speculative_generate, spec_config=args.config)
    for B in args.batch:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in (PROMPTS * (B // len(PROMPTS) + 1))[:B]]
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        L = batch["input_ids"].shape[1]
        t0 = time.perf_counter()
        plain = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False)
        t_plain = time.perf_counter() - t0
        stats = DecodeStats()
        t0 = time.perf_counter()
        spec = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                              custom_generate=speculative_generate, spec_config=args.config, spec_stats=stats)
        t_spec = time.perf_counter() - t0
        rows_p = [useful(r[L:], eos) for r in plain]
        rows_s = [useful(r[L:], eos) for r in spec]
        n_p, n_s = sum(map(len, rows_p)), sum(map(len, rows_s))
        same = [a == b for a, b in zip(rows_p, rows_s)]
        print(f"batch {B}: plain {n_p} tokens in {t_plain:.2f} s = {n_p / t_plain:.1f} tok/s | speculative {n_s} "
              f"tokens in {t_spec:.2f} s = {n_s / t_spec:.1f} tok/s | speed-up {t_plain / t_spec * n_s / n_p:.2f}x | "
              f"mean accepted/forward {stats.mean_accepted_tokens:.2f} | greedy rows identical {sum(same)}/{B}"
              f" | full tensors equal {plain.shape == spec.shape and bool((plain == spec).all())}")
        for b, ok in enumerate(same):
            if not ok:
                k = next((j for j, (x, y) in enumerate(zip(rows_p[b], rows_s[b])) if x != y),
                         min(len(rows_p[b]), len(rows_s[b])))
                print(f"  row {b} differs from new token {k}: plain {rows_p[b][k:k + 5]} spec {rows_s[b][k:k + 5]}")


if __name__ == "__main__":
    main()
