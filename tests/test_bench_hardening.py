"""The bench's numbers mean what the docs say: every run is checked for greedy identity, tokens/s
uses each run's own tokens, "auto" is our auto, the replay charges drafting where the real round
does, encodes prompts as the bench did and counts as DecodeStats does, and acceptance by
position is per row for trees."""

from __future__ import annotations

import json
import random

import pytest

from spec_plugins.bench import BenchOptions, BenchPrompt, register_baseline, run_bench
from spec_plugins.bench.baselines import TurnRun, time_decoder
from spec_plugins.bench.report import build_report
from spec_plugins.bench.runner import Bench, Method, PromptRun
from spec_plugins.policy import DraftCost, ForwardCost
from spec_plugins.registry import PROPOSERS
from spec_plugins.stats import DecodeStats
from test_bench import tiny_decoder

COST = {"draft_cost_ratio": 0.0, "target_relative": [1.0, 1.2], "target_seconds": [0.01, 0.012],
        "positions": [1, 2], "draft_round_seconds": 0.0, "draft_step_seconds": 0.0}


def _stats() -> DecodeStats:
    """One round that drafted 2 and accepted 1."""
    s = DecodeStats()
    s.observe_round([1, 1], 1, 2)
    s.time_total = 1.0
    return s


def _raw(methods: list[Method], prompts: list[BenchPrompt], runs: dict[str, list[list[tuple[int, float]]]]) -> dict:
    """Bench.run's raw results from (tokens, seconds) per prompt and run, for each method."""
    results = {m.name: [[PromptRun([[1] * n], s, _stats() if m.kind != "baseline" else None) for n, s in rs]
                        for rs in runs[m.name]] for m in methods}
    return {"prompts": prompts, "methods": methods, "results": results, "mismatches": [], "greedy": True,
            "cost_model": COST, "unavailable": {}, "duration_s": 1.0}


def _noop(ids: list[int], n: int) -> TurnRun:
    raise AssertionError("not run")


# ---- greedy identity: every run ----------------------------------------------------------------
@register_baseline("test_drifts_after_first_call")
def _drifts(ctx):
    """Plain decoding whose every call after the first emits a wrong first token."""
    dec, calls = ctx.decoder.without_speculation(), [0]

    def run(ids: list[int], n: int) -> TurnRun:
        r = time_decoder(dec, ids, n)
        calls[0] += 1
        toks = list(r.tokens)
        if calls[0] > 1:
            toks[0] = (toks[0] + 1) % 32
        return TurnRun(toks, r.seconds)

    return run


def test_greedy_identity_checks_every_run():
    """A method that equals plain in run 0 and differs later is a mismatch in each later run."""
    dec, _ = tiny_decoder(k=2)
    opts = BenchOptions(max_new_tokens=6, runs=3, baselines=["plain", "test_drifts_after_first_call"], gammas=[2],
                        auto=False, warmup=False, progress=False, cost_positions=4)
    prompts = [BenchPrompt("a", "copy", ("w1 w2 w3 w4 w1 w2",))]
    raw = Bench(dec, opts, log=lambda m: None).run(prompts)
    bad = [(mm["method"], mm["run"], mm["reference"]) for mm in raw["mismatches"]]
    assert bad == [("test_drifts_after_first_call", 1, "plain"), ("test_drifts_after_first_call", 2, "plain")]
    rep = build_report(raw, {})
    assert rep["prompts"][0]["methods"]["test_drifts_after_first_call"]["greedy_equal"] is False
    assert rep["prompts"][0]["methods"]["ours_k2"]["greedy_equal"] is True
    assert rep["summary"]["test_drifts_after_first_call"]["all"]["greedy_mismatches"] == 1


# ---- tokens/s: each run's own tokens -------------------------------------------------------------
def test_tokens_per_s_is_the_median_of_each_runs_own_rate():
    """Runs that emit different tokens (sampling, auto) are each rated by their own tokens and time:
    per prompt the median of tokens_r / seconds_r, per category the median of the run's totals."""
    methods = [Method("plain", "baseline", None, _noop), Method("ours_k2", "ours", 2, _noop)]
    prompts = [BenchPrompt("a", "c", ("x",)), BenchPrompt("b", "c", ("y",))]
    runs = {"plain": [[(10, 1.0), (40, 2.0), (30, 3.0)], [(20, 1.0)] * 3],
            "ours_k2": [[(20, 1.0)] * 3, [(20, 1.0)] * 3]}
    rep = build_report(_raw(methods, prompts, runs), {})
    a = rep["prompts"][0]["methods"]["plain"]
    assert a["tokens_per_s"] == pytest.approx(10.0)  # median of 10, 20, 10 (not run 0's 10 tokens / 2 s)
    assert a["new_tokens_runs"] == [10, 40, 30]
    row = rep["summary"]["plain"]["c"]
    assert row["tokens_per_s"] == pytest.approx(15.0)  # runs: 30 / 2, 60 / 3, 50 / 4
    assert row["tokens_runs"] == [30, 60, 50] and row["seconds_runs"] == [2.0, 3.0, 4.0]
    assert rep["summary"]["ours_k2"]["c"]["speedup"] == pytest.approx(20.0 / 15.0)


def test_decode_statistics_pool_every_run_as_the_rate_does():
    """An auto method's runs differ (costs and sizer carry over): its acceptance and forwards are
    every run's, per prompt and per category, not run 0's; the replay's per-round overhead and the
    GPU prediction divide them by the runs' summed seconds and tokens."""
    methods = [Method("plain", "baseline", None, _noop), Method("ours_k2", "ours", 2, _noop)]
    prompts = [BenchPrompt("a", "c", ("x",))]
    raw = _raw(methods, prompts, {"plain": [[(10, 1.0)] * 3], "ours_k2": [[(20, 1.0)] * 3]})
    late = DecodeStats()
    late.observe_round([1, 1], 2, 3)  # a later run: both drafted tokens accepted
    late.time_total = 1.0
    raw["results"]["ours_k2"][0][2] = PromptRun([[1] * 20], 1.0, late)
    for run in raw["results"]["ours_k2"][0]:
        run.stats.target_forwards = 1
    runs = [r.stats for r in raw["results"]["ours_k2"][0]]
    want = {k: sum(getattr(st, k) for st in runs) for k in ("target_forwards", "draft_tokens", "accepted_tokens")}
    assert want["accepted_tokens"] != 3 * runs[0].accepted_tokens  # the late run differs from run 0
    rep = build_report(raw, {})
    for st in (rep["prompts"][0]["methods"]["ours_k2"]["stats"], rep["summary"]["ours_k2"]["all"]["stats"]):
        assert {k: st[k] for k in want} == want
    from spec_plugins.bench.replay import round_overhead

    share = rep["summary"]["ours_k2"]["all"]["stats"]["time_share"]
    spent = (share["verify"] + share["cache"] + share["other"]) * 3.0  # three runs of 1 s
    assert round_overhead(rep) == pytest.approx(spent / 3)  # over three rounds, one per run


# ---- "auto" in the report is our auto --------------------------------------------------------------
def _auto_report(with_ours_auto: bool) -> dict:
    """plain, ours_k4, a --methods proposer drafting auto (listed first), maybe ours_auto, and
    another runtime's plain and auto, each 100 tokens in its seconds."""
    secs = {"plain": 2.0, "ours_k4": 1.0, "suffix_global": 0.5, "ours_auto": 1.6, "plain@onnxruntime": 1.0,
            "ours_auto@onnxruntime": 0.8}
    methods = [Method("plain", "baseline", None, _noop), Method("ours_k4", "ours", 4, _noop),
               Method("suffix_global", "method", "auto", _noop), Method("ours_auto", "ours", "auto", _noop),
               Method("plain@onnxruntime", "compare", None, _noop, group="onnxruntime"),
               Method("ours_auto@onnxruntime", "compare", "auto", _noop, group="onnxruntime")]
    methods = [m for m in methods if with_ours_auto or m.name != "ours_auto"]
    prompts = [BenchPrompt("a", "c", ("x",))]
    return build_report(_raw(methods, prompts, {m.name: [[(100, secs[m.name])]] for m in methods}), {})


def test_report_auto_is_our_auto_method():
    """Another proposer or runtime drafting ``auto`` is not reported as our auto."""
    rep = _auto_report(with_ours_auto=False)
    assert rep["auto_vs_best_fixed"] == {} and rep["theory"]["measured_auto"] is None
    rep = _auto_report(with_ours_auto=True)
    assert rep["auto_vs_best_fixed"]["all"]["auto_tokens_per_s"] == pytest.approx(100 / 1.6)
    assert rep["theory"]["measured_auto"] == pytest.approx(2.0 / 1.6)


def test_acceptance_plot_labels_other_methods_by_name(tmp_path, monkeypatch):
    """The acceptance plot's "auto" line is our auto; another method drafting auto is labelled by name."""
    from spec_plugins.bench import plots

    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)  # keep the figure to read its legend
    plots.acceptance_by_position(_auto_report(with_ours_auto=True), tmp_path / "a.png")
    labels = figs[0].axes[0].get_legend_handles_labels()[1]
    assert labels == ["γ = 4", "suffix_global", "auto"]


# ---- replay: drafting charged in the draft step -----------------------------------------------------
def _repetitive() -> tuple[list[int], list[int]]:
    random.seed(0)
    block = [random.randrange(2, 50) for _ in range(12)]
    return block * 2, (block * 12)[:120]


def _ngram_auto():
    cls = PROPOSERS.get("ngram")
    return cls(cls.Config(type="ngram", num_draft_tokens="auto", max_ngram=3))


def test_replay_charges_drafting_in_the_draft_step():
    """The drafter's seconds land in the round's draft time (as the real round measures them in
    propose), not in the commit, which the forward-cost correction counts as width cost."""
    from spec_plugins.bench.replay import fixed, replay_turn

    prompt, out = _repetitive()
    cost = ForwardCost.from_curve([0.01] * 17)
    draft = DraftCost(0.0, 0.004)
    st = replay_turn(prompt, out, _ngram_auto(), fixed(3)(), cost, 0.0, draft)
    assert st.draft_tokens > 0
    assert st.time_draft == pytest.approx(st.draft_tokens * draft.per_token)
    assert st.time_cache == 0.0  # no overhead given: commits cost nothing


def test_replayed_auto_decides_as_with_drafting_timed_in_propose():
    """auto's decisions on the replay equal those of a replay whose proposer itself advances the
    clock in propose (where the real round's clock sees drafting)."""
    from spec_plugins.bench.replay import ReplayRuntime, SimClock, _decode_recorded, auto

    prompt, out = _repetitive()
    cost = ForwardCost.from_curve([0.010 * (1 + 0.25 * n) for n in range(17)])
    draft = DraftCost(0.0, 0.004)

    def run(in_propose: bool) -> list[int]:
        clock = SimClock()
        rt = ReplayRuntime({tuple(prompt): out}, 64, clock=clock, cost=cost, draft=DraftCost() if in_propose else draft)
        prop, policy = _ngram_auto(), auto(cost, draft)()
        if in_propose:
            inner = prop.propose

            def propose(ctx):
                d = inner(ctx)
                clock.now += draft(d.tokens.shape[1]) if d is not None else 0.0
                return d

            prop.propose = propose
        _decode_recorded(rt, clock, prop, policy, prompt, len(out))
        return list(policy.length.chosen)

    assert run(in_propose=False) == run(in_propose=True)


# ---- replay: prompts encoded as the bench encoded them -------------------------------------------------
def test_replay_encodes_prompts_as_the_bench_did(tmp_path):
    """A --raw bench run records it; the replay then encodes without the chat template. A report
    without the field is read as the bench's default (the template)."""
    from spec_plugins.bench.replay import turns_from_report

    dec, _ = tiny_decoder(k=2)
    text = "w1 w2 w3 w4 w1 w2"
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text(json.dumps({"question_id": "a", "category": "copy", "turns": [text]}) + "\n")
    opts = BenchOptions(max_new_tokens=4, runs=1, baselines=["plain"], gammas=[2], auto=False, warmup=False,
                        progress=False, cost_positions=4, chat=False)
    rep = run_bench(dec, [BenchPrompt("a", "copy", (text,))], opts)
    assert rep["meta"]["chat"] is False
    turns = turns_from_report(rep, str(prompts_file), dec)
    assert turns[0][1] == dec.encode(text)  # what Bench._encode measured under --raw
    del rep["meta"]["chat"]  # a report from before the field
    assert turns_from_report(rep, str(prompts_file), dec)[0][1] == dec.encode([{"role": "user", "content": text}])


# ---- replay and tune: rates as DecodeStats and the bench count them -------------------------------
def test_replay_rates_count_as_the_bench_does():
    """Plain decoding replays at 1.0 accepted tokens per row-round, and tokens/s is every new token
    over the whole generation, prefill included (the bench's TurnRun), in the replay and in tune."""
    from spec_plugins.bench.replay import fixed, replay_sequence
    from spec_plugins.tune import _replay

    cls = PROPOSERS.get("ngram")
    prompt, out = [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14]  # no repetition: nothing drafted
    cost = ForwardCost.from_curve([0.01] * 17)
    r = replay_sequence([("c", prompt, out)], lambda rt: cls(cls.Config()), lambda: fixed(0)(), cost, 0.0)
    want = len(out) / (cost(1, len(prompt)) + (len(out) - 1) * cost(1, 1))  # prefill + one forward per token
    assert r["all"]["accepted"] == pytest.approx(1.0)
    assert r["all"]["tokens_per_s"] == pytest.approx(want)
    tuned = _replay([prompt], [out], lambda: cls(cls.Config()), cost, 0.0, 32)
    assert tuned["plain"] == pytest.approx(want)


# ---- acceptance by position: rows, not nodes -------------------------------------------------------
def test_acceptance_by_position_counts_rows_for_trees():
    s = DecodeStats()
    s.observe_round([4, 4], 2, 3)  # one row's tree: 4 nodes at each depth, its path accepted 2 deep
    assert s.acceptance_by_position == [1.0, 1.0]
    s.observe_round([2, 1], 1, 2)
    assert s.acceptance_by_position == [1.0, 0.5] and s.drafted_by_position == [6, 5]
    chain = DecodeStats()
    chain.observe_round([1, 1, 1], 1, 2)  # a chain: one node per depth, rows and nodes agree
    chain.observe_round([1, 1], 2, 3)
    assert chain.acceptance_by_position == [1.0, 0.5, 0.0]
    merged = s.merge(chain)
    assert merged.rows_by_position == [4, 4, 1] and merged.acceptance_by_position == [1.0, 0.5, 0.0]
