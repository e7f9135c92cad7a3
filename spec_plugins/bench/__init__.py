"""``spec-plugins bench``: ours against plain decoding and peer implementations, in one run.

prompts (JSONL) -> runner (interleaved methods, medians over runs) -> report (JSON, Markdown)
-> plots (PNG). Peers are a registry (``baselines``) other runtimes extend.
"""

from spec_plugins.bench.baselines import (
    BASELINES,
    BaselineContext,
    BaselineUnavailable,
    TurnRun,
    plain_decoding,
    register_baseline,
)
from spec_plugins.bench.prompts import BenchPrompt, load_prompts
from spec_plugins.bench.runner import Bench, BenchOptions

__all__ = ["BASELINES", "Bench", "BenchOptions", "BenchPrompt", "BaselineContext", "BaselineUnavailable",
           "TurnRun", "load_prompts", "plain_decoding", "register_baseline", "run_bench"]


def run_bench(decoder, prompts, options: BenchOptions, out=None, meta: dict | None = None,
              started: float | None = None) -> dict:
    """Run, summarise and (if ``out`` is a directory path) write the PNGs, then report.json (with
    ``files``: the PNGs written) and summary.md, once. ``started``: a ``time.perf_counter()``
    reading where the caller's work began (model loading included), recorded as
    ``meta.wall_s_including_load``. A plot that fails is recorded in the report (``plot_errors``)
    and raised as ``PlotError`` after the report is written: the run's numbers are kept."""
    import time
    from pathlib import Path

    from spec_plugins.bench.plots import PLOTS, PlotError, write_plots
    from spec_plugins.bench.report import build_report, markdown, write_json
    from spec_plugins.files import write_text_atomic
    from spec_plugins.bench.prompts import check_prompts

    check_prompts(prompts)  # bad prompts and options fail here, before an earlier run's files go
    bench = Bench(decoder, options)
    partial = None
    if out is not None:
        # an earlier run's files would pass for this run's if it fails: only the names the bench
        # writes are removed, other files in the directory are left alone
        Path(out).mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "summary.md", "partial.jsonl", *PLOTS):
            (Path(out) / name).unlink(missing_ok=True)
        partial = Path(out) / "partial.jsonl"
    raw = bench.run(prompts, partial)
    # chat: whether turns were wrapped in the chat template where the model has one (False: --raw),
    # so the replay encodes the prompts as the bench did
    base_meta = {"max_new_tokens": options.max_new_tokens, "runs": options.runs, "num_prompts": len(prompts),
                 "num_turns": sum(len(p.turns) for p in prompts), "chat": options.chat}
    report = build_report(raw, {**base_meta, **(meta or {})}, decoder.tokenizer)
    if out is None:
        return report
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files, failed = write_plots(report, out)
    report["files"] = [str(p) for p in files]
    if failed:
        report["plot_errors"] = failed
    if started is not None:
        report["meta"]["wall_s_including_load"] = time.perf_counter() - started
    write_json(report, out / "report.json")
    write_text_atomic(out / "summary.md", markdown(report))
    if failed:
        raise PlotError(f"{len(failed)} plot(s) failed, " + "; ".join(f"{n}: {why}" for n, why in failed.items())
                        + f" (report.json, summary.md and the other plots are in {out}/)")
    return report
