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

Before them, the default config's (``compile: auto``) time from constructing the decoder to the
prefill's token and to the first decode step's token (the compiled or captured step is built in
that step, so only the second includes it), cold (the first in the process: loads, captures or
compiles) and warm (a second one).

Every method is warmed up on the longest prompt (the static buffers reach their size), then the
prompts run with the methods interleaved per prompt, each method warmed on the prompt (untimed,
``--no-warm-each`` skips it) before its timed run, so no compile or capture lands in a timed run.
A method that raises is recorded with its error and dropped; the others go on. It prints tok/s
(median over prompts and the whole), accepted tokens per forward, host syncs per round (CUDA's
sync debug mode, a separate untimed pass on one prompt) and whether each output equals plain
eager's token for token. Results are written to ``--out`` as JSON as each method finishes, so a run
cut off by the call's limit still reports.

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
import traceback
from pathlib import Path
from typing import Any

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
    """Seconds from constructing the default decoder (``compile: auto``) to its first token, which
    the eager prefill makes (``prefill``), and to the first token of the first decode step
    (``decode_step``: the compiled or captured step that ``auto`` builds is built there), cold (the
    first in this process) and warm (a second construction)."""
    from spec_plugins.decoder import SpeculativeDecoder

    out: dict = {"prefill": {}, "decode_step": {}}
    for run in ("cold", "warm"):
        t0 = time.monotonic()
        dec = SpeculativeDecoder.from_config({"target": {"backend": "torch", "model": args.model, "device": args.device,
                                                         "dtype": args.dtype}})
        marks, seen = [], 0
        for ev in dec.stream([{"role": "user", "content": "Name three colours."}], max_new_tokens=2):
            if ev.token_ids:
                sync(args.device)
                seen += len(ev.token_ids)
                marks += [round(time.monotonic() - t0, 2)] * min(len(ev.token_ids), 2 - len(marks))
            if seen >= 2:
                break
        out["prefill"][run] = marks[0] if marks else None
        out["decode_step"][run] = marks[1] if len(marks) > 1 else None  # None: it ended after one token
        del dec
    return out


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(dec: Any, ids: list[int], max_new: int, device: str) -> tuple[Any, float]:
    """One greedy generate and its seconds, the device's queue drained before and after."""
    sync(device)
    s0 = time.perf_counter()
    res = dec.generate(ids, max_new_tokens=max_new)
    sync(device)
    return res, time.perf_counter() - s0


def drop(report: dict, decs: dict, name: str, where: str, exc: Exception) -> None:
    """Record why ``name`` failed and drop it from the later loops: one method that fails (a capture
    never run on this GPU) must not end the others' run."""
    traceback.print_exc()
    report["methods"][name]["error"] = f"{where}: {type(exc).__name__}: {str(exc)[:300]}"
    del decs[name]
    print(f"{name} FAILED in {where} ({type(exc).__name__}); dropped from the rest of the run", flush=True)


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
    ap.add_argument("--warm-each", action=argparse.BooleanOptionalAction, default=True,
                    help="warm every method on each prompt before timing it (no compile in the timed runs)")
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
        print(f"time from construction, default config, to the prefill's token: cold {ttft['prefill']['cold']} s, "
              f"warm {ttft['prefill']['warm']} s; to the first decode step's token: cold "
              f"{ttft['decode_step']['cold']} s, warm {ttft['decode_step']['warm']} s", flush=True)
    decs = decoders(args)
    enc = next(iter(decs.values()))
    ids = [enc.encode([{"role": "user", "content": p.turns[0]}]) for p in prompts]
    print(f"loaded in {time.monotonic() - t0:.0f} s; {len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} "
          f"tokens, {args.max_new} new tokens each", flush=True)
    report: dict = {"device": where, "torch": torch.__version__, "transformers": transformers.__version__,
                    "model": Path(args.model).name, "dtype": args.dtype, "compile": args.compile, "max_new": args.max_new,
                    "prompts": [p.question_id for p in prompts], "first_token_s": ttft and ttft["prefill"],
                    "first_decode_step_token_s": ttft and ttft["decode_step"], "methods": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    # 1. warm-up: the longest prompt first (the static buffers reach their size), every method
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    for name in decs:
        report["methods"][name] = {"warmup_s": 0.0, "tps": [], "tokens": [], "seconds": [], "accepted": [],
                                   "same_as_plain_eager": []}
    for name, dec in list(decs.items()):
        try:
            report["methods"][name]["warmup_s"] = round(timed(dec, ids[longest], args.max_new, args.device)[1], 1)
            print(f"warm-up {name}: {report['methods'][name]['warmup_s']} s", flush=True)
        except Exception as exc:
            drop(report, decs, name, "warm-up", exc)
        save()
    # 2. timed: per prompt, the methods in turn, each first warmed on that prompt (untimed) where
    # --warm-each: transformers' static cache is sized per prompt length and our drafts differ per
    # prompt, so every shape the timed run meets is compiled or captured before it
    for i, p in enumerate(prompts):
        if time.monotonic() - t0 > args.budget:
            print(f"budget spent: stopped before prompt {i + 1}", flush=True)
            break
        for name, dec in list(decs.items()) if args.warm_each and i != longest else ():
            try:
                m = report["methods"][name]
                m["warmup_s"] = round(m["warmup_s"] + timed(dec, ids[i], args.max_new, args.device)[1], 1)
            except Exception as exc:
                drop(report, decs, name, f"warm-up on prompt {p.question_id}", exc)
        ref = None
        for name, dec in list(decs.items()):
            try:
                res, dt = timed(dec, ids[i], args.max_new, args.device)
            except Exception as exc:
                drop(report, decs, name, f"prompt {p.question_id}", exc)
                continue
            ref = res.token_ids if name == "plain eager" else ref
            m = report["methods"][name]
            m["tps"].append(round(len(res.token_ids) / dt, 2))
            m["tokens"].append(len(res.token_ids))
            m["seconds"].append(round(dt, 4))
            tpf = res.stats.tokens_per_forward  # None: transformers' generate() does not say
            m["accepted"].append(None if tpf is None else round(tpf, 3))
            m["same_as_plain_eager"].append(None if ref is None else res.token_ids == ref)
        print(f"prompt {p.question_id}: " + ", ".join(f"{n} {report['methods'][n]['tps'][-1]:.0f}" for n in decs),
              flush=True)
        save()
    # 3. host syncs per round: one untimed pass on the first prompt under the sync debug mode
    if args.device == "cuda":
        for name, dec in list(decs.items()):
            if isinstance(dec, HFGenerate):
                continue
            try:
                with Syncs(True) as syncs:
                    res = dec.generate(ids[0], max_new_tokens=min(args.max_new, 48))
            except Exception as exc:
                drop(report, decs, name, "the sync count", exc)
                continue
            rounds = max(res.stats.target_forwards, 1)
            report["methods"][name]["syncs_per_round"] = round(syncs.count() / rounds, 2)
        save()
    # 4. the table (a method that failed: its error, after it)
    print(f"\n{where}, {report['model']} {args.dtype}, {args.max_new} tokens per prompt, greedy")
    print(table(report["methods"]))
    save()
    print(f"gpu_speed: {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def table(methods: dict) -> str:
    """The markdown table: tok/s, the ratios to plain eager and plain compiled (``-`` where that one
    has no timed prompt), acceptance, syncs, identity, warm-up; then each failed method's error."""
    whole = lambda m: sum(m["tokens"]) / max(sum(m["seconds"]), 1e-9)  # noqa: E731
    known = lambda m: [a for a in m["accepted"] if a is not None]  # noqa: E731
    acc = lambda m: f"{statistics.mean(known(m)):.2f}" if known(m) else "-"  # noqa: E731
    base = {k: whole(methods[k]) for k in ("plain eager", "plain compiled") if methods.get(k, {}).get("tps")}
    ratio = lambda m, k: f"{whole(m) / base[k]:.2f}x" if k in base else "-"  # noqa: E731
    lines = ["| method | tok/s (median) | tok/s (all) | vs plain eager | vs plain compiled | acc/fwd | syncs/round "
             "| = plain eager | warm-up s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in methods.items():
        if m["tps"]:
            m["tps_all"] = round(whole(m), 2)
            same = [x for x in m["same_as_plain_eager"] if x is not None]
            lines.append(f"| {name} | {statistics.median(m['tps']):.1f} | {whole(m):.1f} | {ratio(m, 'plain eager')} | "
                         f"{ratio(m, 'plain compiled')} | {acc(m)} | {m.get('syncs_per_round', '-')} "
                         f"| {sum(same)}/{len(same)} | {m['warmup_s']} |")
    lines += [f"\n{name} FAILED ({len(m['tps'])} prompts timed before): {m['error']}"
              for name, m in methods.items() if "error" in m]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
