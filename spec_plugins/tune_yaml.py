"""The YAML ``spec-plugins tune`` writes: the chosen config, with the measurements that chose it
(plain speed and cost curve per runtime, every candidate's prediction and measurement, the notes
of what was cut or not measured) as comments."""

from __future__ import annotations

import time

from spec_plugins.tune import Measured, TuneResult


def predicted_ratio(res: TuneResult, m: Measured) -> float:
    """The speed-up ``m``'s prediction promised: its predicted tok/s over the plain tok/s of the same
    runtime in the same pass (not the confirmation run's plain, timed later on fewer prompts)."""
    return (m.predicted or 0.0) / res.runtimes[m.runtime]["plain_tokens_per_s"]


def render_yaml(res: TuneResult, command: str) -> str:
    """The config, with the measurements that chose it as comments."""
    import yaml

    c = res.chosen
    lines = [f"# written by: {command}", f"# tuned in {res.seconds:.0f} s on {time.strftime('%Y-%m-%d')}",
             "# plain decoding per runtime (tok/s, one-position forward, T(N)/T(1) for N = 1, 2, 4, 8, 16):"]
    for rt, d in res.runtimes.items():
        rel = d["cost_relative"]
        pick = [rel[i] for i in (0, 1, 3, 7, 15) if i < len(rel)]
        lines.append(f"#   {rt}: {d['plain_tokens_per_s']} tok/s, T(1) {d['t1_ms']} ms, T(N)/T(1) {pick}")
    lines.append("# candidates (predicted tok/s; measured in the confirmation run where one took place):")
    for m in res.measured:
        meas = f", measured {m.tokens_per_s:.1f}" if m.tokens_per_s else ""
        lines.append(f"#   {m.label} (draft {m.draft}): predicted {m.predicted or 0:.1f}{meas}")
    lines.append(f"# plain on the fastest runtime in the confirmation run: {res.plain.tokens_per_s:.1f} tok/s")
    if c is res.plain:
        why = "was faster by more than noise" if res.measured else "was measured"
        lines.append(f"# chosen: plain decoding (no speculative configuration {why})")
    else:
        lines.append(f"# chosen: {c.label}, measured {c.tokens_per_s:.1f} tok/s = "
                     f"{c.tokens_per_s / res.plain.tokens_per_s:.2f}x plain (predicted "
                     f"{predicted_ratio(res, c):.2f}x plain on {c.runtime})")
    lines += [f"# note: {n}" for n in res.notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(res.config, sort_keys=False)
