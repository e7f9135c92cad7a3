"""The GPU-fast torch path on real weights, on the dev prompts: issue 36's table, for a lent GPU.

One process, one model, greedy, the first turn of each dev prompt through the chat template:

- ``plain eager``: the growing-cache runtime (``kv: dynamic``), what the torch runtime was;
- ``plain compiled``: the static cache and the compiled fixed-shape step (CUDA graphs on CUDA);
- ``ngram auto`` and ``suffix auto`` on the same compiled runtime (their draft sizes priced by
  the cost model measured on that runtime, i.e. on the compiled path);
- ``eagle tree auto`` and ``parallel tree auto`` (the shipped heads) on the same runtime (``--heads``);
- optionally ``ngram auto eager`` on the growing cache (``--eager-spec``);
- what a GPU user would pick instead (``--hf``): transformers' own ``generate()`` eager, with a static
  cache and ``torch.compile`` (its documented fast path), and with prompt lookup
  (``prompt_lookup_num_tokens``), each on its own copy of the weights.

Before them, the time to first token of the default config (``compile: auto``) from constructing
the decoder, cold (the first in the process: loads, captures or compiles) and warm (a second one).

Every method is warmed up once (the compiles happen there, timed), then the prompts run with the
methods interleaved per prompt. It prints tok/s (median over prompts and the whole), accepted
tokens per forward, host syncs per round (CUDA's sync debug mode, a separate untimed pass on one
prompt) and whether each output equals plain eager's token for token. Results are written to
``--out`` as JSON as each method finishes, so a run cut off by the call's limit still reports.

    python scripts/gpu_speed.py --model path/to/smollm2.gguf --out $OUT/speed.json   # on the GPU
    python scripts/gpu_speed.py --device cpu --model smollm2-135m-instruct --max-new 8 --limit 2 --compile off  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]


def target(model: str, device: str, dtype: str, kv: str, compile_: str = "on") -> dict:
    return {"backend": "torch", "model": model, "device": device, "dtype": dtype, "kv": kv,
            "compile": compile_ if kv == "static" else "off"}


def decoders(args: argparse.Namespace) -> dict:
    """name -> SpeculativeDecoder; the compiled methods share one runtime (and its graphs)."""
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.decoder import SpeculativeDecoder

    ngram = {"type": "ngram", "num_draft_tokens": "auto", "max_ngram": 3}
    suffix = {"type": "suffix", "scope": "request", "num_draft_tokens": 16, "tree_nodes": "auto"}
    base = {"verifier": {"type": "exact"}, "sampling": {"temperature": 0.0, "seed": 0}}
    static = SpeculativeDecoder.from_config({**base, "target": target(args.model, args.device, args.dtype, "static", args.compile),
                                             "proposer": ngram})
    rt = static.target
    eager_rt = TorchRuntime(rt.model, rt.tokenizer, rt.max_context)  # the same weights, the growing cache
    eager_cfg = {**base, "target": target(args.model, args.device, args.dtype, "dynamic")}
    out = {"plain eager": SpeculativeDecoder.from_config(eager_cfg, target=eager_rt),
           "plain compiled": static.without_speculation(),
           "ngram auto compiled": static,
           "suffix auto compiled": SpeculativeDecoder.from_config(
               {**base, "target": target(args.model, args.device, args.dtype, "static", args.compile), "proposer": suffix},
               target=rt, costs=static.costs)}
    heads = ROOT / "examples/heads/smollm2-135m-instruct"
    for kind in ("eagle", "parallel") if args.heads else ():
        prop = {"type": kind, "heads": str(heads / kind), "mode": "tree", "num_draft_tokens": 6, "tree_nodes": "auto",
                "top_k": 4}
        out[f"{kind} tree auto compiled"] = SpeculativeDecoder.from_config(
            {**base, "target": target(args.model, args.device, args.dtype, "static", args.compile), "proposer": prop},
            target=rt, costs=static.costs)
    if args.eager_spec:
        out["ngram auto eager"] = SpeculativeDecoder.from_config({**eager_cfg, "proposer": ngram}, target=eager_rt)
    if args.hf:
        for mode in ("eager", "static compile", "prompt lookup"):
            out[f"transformers {mode}"] = HFGenerate(rt.model, mode, compile_=args.device == "cuda")
    return out


class HFGenerate:
    """transformers' own ``generate()`` (greedy) on a copy of the weights, called as our decoders
    are: ``eager`` (its dynamic cache), ``static compile`` (``cache_implementation="static"`` and
    the forward compiled in ``reduce-overhead`` mode, where ``compile_``), ``prompt lookup``."""

    def __init__(self, model, mode: str, compile_: bool) -> None:
        import copy

        import torch

        self.model, self.mode = copy.deepcopy(model).eval(), mode
        if mode == "static compile" and compile_:
            self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)

    def generate(self, ids: list[int], max_new_tokens: int):
        import types

        import torch

        kw: dict = {"do_sample": False, "max_new_tokens": max_new_tokens}
        if self.mode == "static compile":
            kw["cache_implementation"] = "static"
        if self.mode == "prompt lookup":
            kw["prompt_lookup_num_tokens"] = 10
        x = torch.tensor([ids], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))  # our decoders stop at the end token
        return types.SimpleNamespace(token_ids=out[:cut], stats=types.SimpleNamespace(tokens_per_forward=None))


def first_token(args: argparse.Namespace) -> dict:
    """Seconds from constructing the default decoder (``compile: auto``) to its first token, cold
    (the first in this process) and warm (a second construction)."""
    from spec_plugins.decoder import SpeculativeDecoder

    out = {}
    for run in ("cold", "warm"):
        t0 = time.monotonic()
        dec = SpeculativeDecoder.from_config({"target": {"backend": "torch", "model": args.model, "device": args.device,
                                                         "dtype": args.dtype}})
        dec.generate([{"role": "user", "content": "Name three colours."}], max_new_tokens=1)
        sync(args.device)
        out[run] = round(time.monotonic() - t0, 2)
        del dec
    return out


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, .gguf file or transformers dir")
    ap.add_argument("--prompts", default=str(ROOT / "examples/prompts/dev.jsonl"))
    ap.add_argument("--limit", type=int, default=None, help="first N prompts")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", default="graphs", choices=("graphs", "on", "off"),
                    help="the static path: CUDA graphs of the eager step (graphs), torch.compile (on), eager (off: CPU smoke)")
    ap.add_argument("--eager-spec", action="store_true", help="also n-gram auto on the eager runtime")
    ap.add_argument("--heads", action=argparse.BooleanOptionalAction, default=True,
                    help="EAGLE and the parallel drafter (shipped heads) in auto trees on the compiled runtime")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                    help="transformers' generate(): eager, static cache + torch.compile, prompt lookup")
    ap.add_argument("--ttft", action=argparse.BooleanOptionalAction, default=True,
                    help="time to first token of the default config from construction, cold and warm")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: stop starting new prompts after this")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from gpu_check import Syncs

    from spec_plugins.bench.prompts import load_prompts

    t0 = time.monotonic()
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"gpu_speed on {where}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    prompts = load_prompts(args.prompts, limit=args.limit)
    ttft = first_token(args) if args.ttft else None
    if ttft:
        print(f"time to first token from construction, default config: cold {ttft['cold']} s, warm {ttft['warm']} s",
              flush=True)
    decs = decoders(args)
    enc = next(iter(decs.values()))
    ids = [enc.encode([{"role": "user", "content": p.turns[0]}]) for p in prompts]
    print(f"loaded in {time.monotonic() - t0:.0f} s; {len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} "
          f"tokens, {args.max_new} new tokens each", flush=True)
    report: dict = {"device": where, "torch": torch.__version__, "transformers": transformers.__version__,
                    "model": Path(args.model).name, "dtype": args.dtype, "compile": args.compile, "max_new": args.max_new,
                    "prompts": [p.question_id for p in prompts], "first_token_s": ttft, "methods": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    # 1. warm-up: the longest prompt first (the static buffers reach their size), every method
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    for name, dec in decs.items():
        w0 = time.monotonic()
        dec.generate(ids[longest], max_new_tokens=args.max_new)
        sync(args.device)
        report["methods"][name] = {"warmup_s": round(time.monotonic() - w0, 1), "tps": [], "tokens": [],
                                   "seconds": [], "accepted": [], "same_as_plain_eager": []}
        print(f"warm-up {name}: {time.monotonic() - w0:.1f} s", flush=True)
        save()
    # 2. timed: per prompt, the methods in turn
    for i, p in enumerate(prompts):
        if time.monotonic() - t0 > args.budget:
            print(f"budget spent: stopped before prompt {i + 1}", flush=True)
            break
        ref = None
        for name, dec in decs.items():
            sync(args.device)
            s0 = time.perf_counter()
            res = dec.generate(ids[i], max_new_tokens=args.max_new)
            sync(args.device)
            dt = time.perf_counter() - s0
            ref = res.token_ids if ref is None else ref
            m = report["methods"][name]
            m["tps"].append(round(len(res.token_ids) / dt, 2))
            m["tokens"].append(len(res.token_ids))
            m["seconds"].append(round(dt, 4))
            tpf = res.stats.tokens_per_forward  # None: transformers' generate() does not say
            m["accepted"].append(None if tpf is None else round(tpf, 3))
            m["same_as_plain_eager"].append(res.token_ids == ref)
        print(f"prompt {p.question_id}: " + ", ".join(f"{n} {report['methods'][n]['tps'][-1]:.0f}" for n in decs),
              flush=True)
        save()
    # 3. host syncs per round: one untimed pass on the first prompt under the sync debug mode
    if args.device == "cuda":
        for name, dec in decs.items():
            if isinstance(dec, HFGenerate):
                continue
            with Syncs(True) as syncs:
                res = dec.generate(ids[0], max_new_tokens=min(args.max_new, 48))
            rounds = max(res.stats.target_forwards, 1)
            report["methods"][name]["syncs_per_round"] = round(syncs.count() / rounds, 2)
        save()
    # 4. the table
    plain = report["methods"]["plain compiled"]
    eager = report["methods"]["plain eager"]
    whole = lambda m: sum(m["tokens"]) / max(sum(m["seconds"]), 1e-9)  # noqa: E731
    known = lambda m: [a for a in m["accepted"] if a is not None]  # noqa: E731
    acc = lambda m: f"{statistics.mean(known(m)):.2f}" if known(m) else "-"  # noqa: E731
    print(f"\n{where}, {report['model']} {args.dtype}, {len(plain['tps'])} prompts x {args.max_new} tokens, greedy")
    print("| method | tok/s (median) | tok/s (all) | vs plain eager | vs plain compiled | acc/fwd | syncs/round "
          "| = plain eager | warm-up s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in report["methods"].items():
        if not m["tps"]:
            continue
        m["tps_all"] = round(whole(m), 2)
        print(f"| {name} | {statistics.median(m['tps']):.1f} | {whole(m):.1f} | {whole(m) / whole(eager):.2f}x | "
              f"{whole(m) / whole(plain):.2f}x | {acc(m)} | {m.get('syncs_per_round', '-')} "
              f"| {sum(m['same_as_plain_eager'])}/{len(m['tps'])} | {m['warmup_s']} |")
    save()
    print(f"gpu_speed: {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
