"""GPU acceptance check; run through ``scripts/gpu_check.sh`` (``--cpu``: the same on the CPU, in CI).

1. Exactness matrix: every proposer (``tests/helpers.EVERY_PROPOSER``, heads loaded from disk as
   trained ones are), fp32 and bf16, one row at a time and three rows of different lengths as one
   batch (holes), on a tiny random llama on the device, on the growing cache and on the static
   one (``backends/torch_static.py``), and n-gram through the compiled step (``--compile``). Each output is compared with an
   independent reference: transformers' own greedy ``generate()`` on the same model, device and
   dtype, one prompt at a time. A split is allowed only at a near-tie of the reference's own
   logits (bf16/fp32 arithmetic of a wider forward may rank those the other way), and the
   measured gap is printed. Host syncs per round are counted with
   ``torch.cuda.set_sync_debug_mode`` (CUDA only).
2. Speed: random weights at SmolLM2-135M's shape (no weights to carry): plain and n-gram decoding,
   eager on the growing cache and compiled on the static one, tok/s and host syncs per round;
   plain at Llama-3.2-1B's shape; then one forward's cost per width (1..17) on the captured step
   at both shapes, the curve ``gpu_prediction.py --measured`` prices the replayed dev prompts with.
3. The CUDA cases of ``tests/test_devices.py`` (the device audit on the GPU) and of
   ``tests/test_tensorrt.py`` (they skip, saying why, where TensorRT is not installed).

Rows past the time budget are skipped, each marked so, and counted under the table (the exactness
matrix runs the newest cases first: ``exactness_cases``). Each finished row is appended at once as a JSON
line to ``--rows`` (default ``$OUT/gpu_check.jsonl`` where ``$OUT`` is set, as on the lent machine), so
a call cut off by its limit still returns what it finished; the table is printed last, also when
SIGINT (``gpu_check.sh``'s time limit) cuts the run short, the unfinished rows marked ``cut off``.
Exit 1 on any FAIL, 130 when interrupted.
Installs nothing and downloads nothing (``gpu_check.sh`` installs carried wheels first).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_rows / gpu_device_tests, also when imported
from gpu_device_tests import DEVICE_STAGE, device_tests  # noqa: E402
from gpu_rows import BUDGET_SPENT, Row, Rows, Syncs, skipped_line, table  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 5], [7, 8, 9, 7, 8, 9, 7], [10, 11, 12, 13, 14, 10, 11]]


def decode_rows(rt, proposer, prompts, n: int, count_syncs: bool):
    """Greedy outputs per prompt (one batch), accepted tokens per forward, host syncs per round."""
    from spec_plugins.config import SamplingConfig
    from spec_plugins.loop import decode
    from spec_plugins.policy import FixedLength
    from spec_plugins.sampling import LogitsPipeline
    from spec_plugins.stats import DecodeStats
    from spec_plugins.verifiers import ExactVerifier

    outs, stats, per_round = [[] for _ in prompts], DecodeStats(), []
    steps = decode(rt, proposer, ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, n, (), None, stats,
                   FixedLength(3) if proposer is not None else None)
    with Syncs(count_syncs) as syncs:
        before = None
        for step in steps:
            if before is not None:
                per_round.append(syncs.count() - before)
            before = syncs.count()
            for i, t in step.emitted.items():
                outs[i].extend(t)
    return outs, stats.mean_accepted_tokens, per_round


def exactness(rows: Rows, dev: str, n: int, deadline: float, compiled: bool) -> None:
    from conftest import tiny_llama
    from helpers import save_random_heads

    with tempfile.TemporaryDirectory(prefix="gpu_check-heads-") as tmp:
        heads = save_random_heads(tiny_llama(vocab=64, seed=2, sharpness=3.0, layers=4, hidden=128, max_pos=1024),
                                  Path(tmp))
        _exactness(rows, dev, n, deadline, compiled, heads)


def exactness_cases(dev: str, compiled: bool) -> list[tuple[str, str, str]]:
    """(dtype, proposer, kv) in the order they run, so a budget spent early leaves out what a device
    has checked before: the captured step (``graphs``, CUDA only, never yet run on a GPU) in both
    dtypes first; every proposer on the growing and the static cache, fp32 then bf16; the compiled
    step last (each of its shape buckets compiles for ~27 s on the device)."""
    from helpers import EVERY_PROPOSER

    dtypes = ("float32", "bfloat16")
    cases = [(d, kind, "graphs") for d in dtypes for kind in ("ngram", "eagle-tree")] if dev == "cuda" else []
    cases += [(d, kind, kv) for d in dtypes for kind in EVERY_PROPOSER for kv in ("dynamic", "static")]
    return cases + ([(d, "ngram", "compiled") for d in dtypes] if compiled else [])


def _exactness(rows: Rows, dev: str, n: int, deadline: float, compiled: bool, heads) -> None:
    import torch
    from conftest import tiny_llama
    from helpers import every_proposer

    from spec_plugins.bench.reference import compare, greedy_reference

    built: dict = {}  # dtype name -> (target, draft model, reference outputs), built when first met
    for dname, kind, kv in exactness_cases(dev, compiled):
        dtype = getattr(torch, dname)
        if dname not in built:
            model = tiny_llama(vocab=64, seed=2, sharpness=3.0, layers=4, hidden=128, max_pos=1024).to(dev, dtype)
            draft = tiny_llama(vocab=64, seed=5, sharpness=3.0, layers=2, hidden=64, max_pos=1024).to(dev, dtype)
            built[dname] = (model, draft, greedy_reference(model, PROMPTS, n))
        model, draft, refs = built[dname]
        for batched in (False, True):
            row = rows.add(Row(f"{kind} {dname} {kv} {'batch of 3' if batched else '1 row'}"))
            if time.monotonic() > deadline:
                row.note = BUDGET_SPENT
                rows.finish(row)
                continue
            try:
                rt = runtime(kv, model)
                prop = every_proposer(kind, rt, heads, draft=lambda: runtime(kv, draft))
                groups = [PROMPTS] if batched else [[p] for p in PROMPTS]
                outs, acc, syncs = [], [], []
                for g in groups:
                    o, a, s = decode_rows(rt, prop, g, n, dev == "cuda")
                    outs, acc, syncs = outs + o, acc + [a], syncs + s
                verdict = compare(outs, refs, dtype)
                row.result, row.note = verdict.verdict, verdict.note
                row.accepted = sum(acc) / len(acc)
                if dev == "cuda" and syncs:
                    row.syncs = f"{sorted(syncs)[len(syncs) // 2]} (max {max(syncs)})"
            except Exception as exc:  # one failing proposer must not hide the others
                row.result, row.note = "FAIL", f"{type(exc).__name__}: {str(exc)[:140]}"
                traceback.print_exc()
            rows.finish(row)


def runtime(kv: str, model):
    """The torch runtime over ``model``: a growing cache, the static one eager, compiled, or its
    eager step captured as CUDA graphs (``graphs``, no compiler)."""
    from spec_plugins.backends.torch_runtime import TorchRuntime
    from spec_plugins.backends.torch_static import StaticTorchRuntime

    if kv == "dynamic":
        return TorchRuntime(model, matmul="native")
    return StaticTorchRuntime(model, compile=kv == "compiled", graphs=kv == "graphs")


SHAPES = {  # random weights at a real model's shape: its cost per forward, nothing to carry
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0),
    "llama1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0),
}


def model_shape(name: str, dev: str, dtype):
    """Random weights at the shape ``name`` (``SHAPES``), built on the device (fast at 1B)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[name], max_position_embeddings=8192, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        return LlamaForCausalLM(cfg).to(dtype).eval()


def speed(rows: Rows, dev: str, n: int, compiled: bool, deadline: float) -> None:
    """Plain and n-gram decoding at SmolLM2's shape, plain at Llama-3.2-1B's (eager and captured):
    tok/s, host syncs per round, the warm-up in the note; then the cost curves; the compiled rows
    last, where the budget allows (each of their buckets compiles for tens of seconds)."""
    import torch

    from spec_plugins.proposers.ngram import NgramProposer

    ngram = NgramProposer(NgramProposer.Config())
    methods = (("plain", None), ("ngram (3 drafts)", ngram))
    on_device = ("dynamic", "graphs") if dev == "cuda" else ("dynamic",)
    plans: list[tuple] = [("smollm2", name, prop, kv, label) for name, prop in methods for kv in on_device
                          for label in ("1 row", "batch of 4")]
    plans += [("llama1b", "plain", None, kv, "1 row") for kv in on_device] if dev == "cuda" else []
    plans += [(shape, "curve") for shape in (("llama1b", "smollm2") if dev == "cuda" else ("smollm2",))]
    plans += [("smollm2", name, prop, "compiled", label) for name, prop in methods
              for label in ("1 row", "batch of 4")] if compiled else []
    models: dict = {}
    for shape, *plan in plans:
        if shape not in models and time.monotonic() < deadline:
            models.clear()  # one shape's weights on the device at a time
            models[shape] = model_shape(shape, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
        if plan == ["curve"]:
            cost_curve(rows, shape, models.get(shape), dev, deadline)
        else:
            speed_row(rows, shape, *plan, models.get(shape), dev, n, deadline)


def speed_row(rows: Rows, shape: str, name: str, prop, kv: str, label: str, model, dev: str, n: int,
              deadline: float) -> None:
    """One speed row: warm-up (compiles or captures the buckets it meets), a timed run, and on CUDA
    an untimed pass under the sync debug mode."""
    import torch

    row = rows.add(Row(f"speed {shape}-shape {name} {kv} {label}"))
    if model is None or time.monotonic() > deadline:
        row.note = BUDGET_SPENT
        rows.finish(row)
        return
    g = torch.Generator(device="cpu").manual_seed(0)
    block = torch.randint(0, model.config.vocab_size, (32,), generator=g, device="cpu").tolist()
    prompts = [(block * 8)[:200 + 13 * i] for i in range(4)]  # repetitive: n-gram finds drafts
    ps = prompts[:1] if label == "1 row" else prompts
    try:
        rt = runtime(kv, model)
        w0 = time.monotonic()
        decode_rows(rt, prop, ps, 8, False)
        decode_rows(rt, prop, ps, n, False)
        if dev == "cuda":
            torch.cuda.synchronize()
        warm = time.monotonic() - w0
        t0 = time.perf_counter()
        outs, acc, _ = decode_rows(rt, prop, ps, n, False)
        if dev == "cuda":
            torch.cuda.synchronize()
        row.tps = f"{sum(map(len, outs)) / (time.perf_counter() - t0):.1f}"
        row.result, row.accepted, row.note = "ok", acc, f"warm-up {warm:.0f} s"
        if dev == "cuda":
            syncs = decode_rows(rt, prop, ps, min(n, 32), True)[2]
            row.syncs = f"{sorted(syncs)[len(syncs) // 2]} (max {max(syncs)})" if syncs else "-"
    except Exception as exc:
        row.result, row.note = "FAIL", f"{type(exc).__name__}: {str(exc)[:140]}"
        traceback.print_exc()
    rows.finish(row)


def cost_curve(rows: Rows, shape: str, model, dev: str, deadline: float) -> None:
    """One forward's cost per width on the step the speculative rows run (``graphs`` on CUDA, the
    static eager step on the CPU), on a warm cache: the curve ``gpu_prediction.py --measured``
    replays the dev prompts' acceptance under (issue 45 item 3: n-gram ``auto`` at Llama-3.2-1B's
    shape, whose random weights accept nothing of their own). Widths 1..17 cover ``auto``'s
    drafts (at most 16) and the round's own token."""
    from spec_plugins.policy.cost import measure

    kv = "graphs" if dev == "cuda" else "static"
    on_cpu = dev != "cuda"
    widths, context = (range(1, 4), 32) if on_cpu else (range(1, 18), 512)
    row = rows.add(Row(f"cost curve {shape}-shape {kv} 1 row"))
    if model is None or time.monotonic() > deadline:
        row.note = BUDGET_SPENT
        rows.finish(row)
        return
    try:
        cost = measure(runtime(kv, model), rows=(1,), widths=tuple(widths), context=context, repeats=5)
        ms = {n: cost(1, n) * 1e3 for n in widths}
        last = max(ms)
        row.result, row.note = "ok", f"T(1) {ms[1]:.2f} ms, T({last})/T(1) {ms[last] / ms[1]:.2f}, context {context}"
        row.curve = {"shape": shape, "kv": kv, "dtype": str(model.dtype).removeprefix("torch."),
                     "context": context, "ms": ms, "device": device_name(dev)}
    except Exception as exc:
        row.result, row.note = "FAIL", f"{type(exc).__name__}: {str(exc)[:140]}"
        traceback.print_exc()
    rows.finish(row)


def device_name(dev: str) -> str:
    """The device a curve was measured on (``gpu_prediction`` prices a GPU's curve only)."""
    import torch

    return torch.cuda.get_device_name() if dev == "cuda" else "cpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="run the same checks on the CPU (the CI smoke test)")
    ap.add_argument("--max-new", type=int, default=24, help="tokens per prompt in the exactness matrix")
    ap.add_argument("--speed-tokens", type=int, default=128, help="tokens per prompt in the speed rows (0: none)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all stages")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="include the compiled static step (auto: on CUDA; compiling on a CPU takes minutes)")
    ap.add_argument("--rows", type=Path, default=None,
                    help="append each finished row here as a JSON line (default: $OUT/gpu_check.jsonl where $OUT is set)")
    args = ap.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'none'}); nothing to run.")
        return 0
    dev = "cpu" if args.cpu else "cuda"
    import transformers

    where = "CPU" if args.cpu else f"{torch.cuda.get_device_name(0)} (sm {torch.cuda.get_device_capability(0)})"
    print(f"gpu_check on {where}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    out = os.environ.get("OUT")
    rows = Rows(args.rows if args.rows is not None else Path(out) / "gpu_check.jsonl" if out else None)
    compiled = args.compile == "on" or (args.compile == "auto" and dev == "cuda")
    interrupted = False
    try:
        exactness(rows, dev, args.max_new, t0 + 0.55 * args.budget, compiled)  # the rest is left for the speed rows
        if args.speed_tokens:  # past the deadline its rows are each marked skipped
            speed(rows, dev, args.speed_tokens, compiled, deadline)
        if not args.cpu and time.monotonic() < deadline:
            device_tests(rows, deadline)
        elif not args.cpu:
            rows.finish(rows.add(Row(DEVICE_STAGE, note=BUDGET_SPENT)))
    except KeyboardInterrupt:  # gpu_check.sh's `timeout --signal=INT`: the rows so far, then the table
        interrupted = True
        rows.cut_off("interrupted (SIGINT: the time limit)")
    finally:
        rows.cut_off("the run stopped on an error (traceback above)")
        print(f"\ngpu_check: {where}, {time.monotonic() - t0:.0f} s; exactness: greedy, {args.max_new} tokens x "
              f"{len(PROMPTS)} prompts, against transformers generate()" + ("; INTERRUPTED" if interrupted else ""))
        print(table(rows))
        print(skipped_line(rows, args.budget), flush=True)
    if interrupted:
        return 130
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
