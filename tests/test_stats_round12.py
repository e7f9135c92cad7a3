"""The bench's theory alpha is the per-token acceptance the formula S(gamma) assumes: accepted over
judged drafted depths, not over drafted ones (a chain's depths past its first rejection are drafted
but never judged); an output cut inside the accepted path (EOS, limit, grammar, stop) judged no
rejection there."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from test_adaptive import record

from spec_plugins.bench import BenchPrompt
from spec_plugins.bench.report import build_report
from spec_plugins.bench.runner import Method, PromptRun
from spec_plugins.stats import DecodeStats, row_shares

ALPHA, GAMMA, ROWS, ROUNDS = 0.8, 4, 4, 5000
COST = {"draft_cost_ratio": 0.0, "target_relative": [1.0] * 17, "target_seconds": [0.01] * 17,
        "positions": list(range(1, 18)), "draft_round_seconds": 0.0, "draft_step_seconds": 0.0}


def _noop(ids: list[int], n: int) -> None:
    raise AssertionError("not run")


def _iid_rounds(seed: int = 0) -> tuple[DecodeStats, list[int], int]:
    """Chains of ``GAMMA`` drafted tokens, each accepted with probability ``ALPHA`` while the ones
    before it were (Leviathan's i.i.d. model), observed as the batch reports rounds; returns the
    stats, each row-round's emitted tokens and the number of acceptance trials drawn."""
    rng = random.Random(seed)
    stats, emitted, trials = DecodeStats(), [], 0
    for _ in range(ROUNDS):
        accepted = []
        for _ in range(ROWS):
            a = 0
            while a < GAMMA:
                trials += 1
                if rng.random() >= ALPHA:
                    break
                a += 1
            accepted.append(a)
        stats.observe(record([GAMMA] * ROWS, [GAMMA] * ROWS, accepted))
        emitted += [a + 1 for a in accepted]
    return stats, emitted, trials


def _report(stats: DecodeStats) -> dict:
    methods = [Method("plain", "baseline", None, _noop), Method("ours_k4", "ours", GAMMA, _noop)]
    results = {"plain": [[PromptRun([[1] * 100], 1.0, None)]], "ours_k4": [[PromptRun([[1] * 100], 1.0, stats)]]}
    raw = {"prompts": [BenchPrompt("a", "c", ("x",))], "methods": methods, "results": results, "mismatches": [],
           "greedy": True, "cost_model": COST, "unavailable": {}, "duration_s": 1.0}
    return build_report(raw, {})


def test_theory_alpha_is_the_per_token_acceptance_of_iid_chains():
    """The report's alpha was accepted / drafted (0.59 for a true 0.8), so S(4) came out 2.27
    where each round emitted 3.36 tokens. Now alpha is within 5 standard errors of the true one
    (accepted / judged is the mean of ``judged`` Bernoulli(alpha) trials), and S(gamma) at c = 0
    and a flat verify cost matches the closed form E[tokens per round] = sum_{i<=gamma} alpha^i
    and the measured tokens per round."""
    stats, emitted, trials = _iid_rounds()
    th = _report(stats)["theory"]
    alpha_tol = 5 * math.sqrt(ALPHA * (1 - ALPHA) / trials)  # ~0.008 for ~59,000 trials
    assert th["alpha"] == pytest.approx(ALPHA, abs=alpha_tol)
    assert stats.judged_tokens == trials and stats.judged_acceptance == th["alpha"]

    expected = sum(ALPHA ** i for i in range(GAMMA + 1))  # the independent reference
    slope = sum(i * ALPHA ** (i - 1) for i in range(1, GAMMA + 1))  # d expected / d alpha
    ideal = th["ideal"][th["gammas"].index(GAMMA)]
    assert ideal == pytest.approx(expected, abs=slope * alpha_tol)
    assert th["with_verify_cost"][th["gammas"].index(GAMMA)] == pytest.approx(ideal)
    mean_tol = 5 * statistics.stdev(emitted) / math.sqrt(len(emitted))
    assert stats.mean_accepted_tokens == pytest.approx(statistics.mean(emitted))
    assert stats.mean_accepted_tokens == pytest.approx(expected, abs=mean_tol)
    assert ideal == pytest.approx(stats.mean_accepted_tokens, abs=mean_tol + slope * alpha_tol)


def test_an_output_cut_inside_the_accepted_path_judged_no_rejection():
    """Rows of one round, each drafting a chain of 4: accepted 3 and cut by EOS at its 2nd token
    (2 judged, both accepted: the cut depths were judged by nobody in the output); accepted 2 then
    rejected (3 judged); all 4 accepted (4 judged, nothing deeper); accepted 1, its corrected
    token cut by the limit (the path is whole: 2 judged)."""
    rec = record([4] * 4, [4] * 4, [3, 2, 4, 1])
    rec.emitted = [[5, 2], [5, 5, 6], [5] * 5, [5]]
    shares = row_shares(rec)
    assert [s.kept for s in shares] == [2, 2, 4, 1]
    assert [s.judged for s in shares] == [2, 3, 4, 2]
    stats = DecodeStats()
    stats.observe(rec)
    assert (stats.accepted_tokens, stats.judged_tokens) == (9, 11)
    assert stats.judged_acceptance == pytest.approx(9 / 11)

    cut = record([4], [4], [3])
    cut.emitted = [[5, 2]]  # EOS at the 2nd token, inside the accepted path
    alone = DecodeStats()
    alone.observe(cut)
    assert (alone.accepted_tokens, alone.judged_tokens, alone.judged_acceptance) == (2, 2, 1.0)


def test_judged_counts_merge_serialise_and_default_for_existing_callers():
    """``observe_round`` without ``judged`` counts the accepted path plus the depth after it when one
    was drafted (padded depths hold none); ``merge`` sums the counter; ``to_dict`` and the bench's
    stats summary carry it."""
    s = DecodeStats()
    s.observe_round([1, 1, 1, 1], 2, 3)  # rejected at depth 3
    s.observe_round([1, 1, 0, 0], 2, 3)  # a batch's padded depths: the draft ended at 2
    s.observe_round([], 0, 1)  # no draft: nothing judged
    assert (s.accepted_tokens, s.judged_tokens, s.draft_tokens) == (4, 5, 6)
    assert DecodeStats().judged_acceptance == 0.0
    both = s.merge(s)
    assert both.judged_tokens == 10 and both.judged_acceptance == pytest.approx(0.8)
    assert s.to_dict()["judged_tokens"] == 5 and s.to_dict()["judged_acceptance"] == pytest.approx(0.8)
    summary = _report(s)["summary"]["ours_k4"]["all"]["stats"]
    assert summary["judged_tokens"] == 5 and summary["judged_acceptance"] == pytest.approx(0.8)


def _tree_stats() -> DecodeStats:
    """Rounds of a two-wide tree (two nodes at each of two depths), one accepted node each: no
    chain, so the chain formula has no alpha to take from it."""
    s = DecodeStats()
    for _ in range(10):
        s.row_rounds += 1
        s.target_forwards += 1
        s.observe_round([2, 2], 1, 2)
    s.time_total = 1.0
    return s


def test_theory_alpha_leaves_tree_runs_out_and_the_table_shows_no_rate_where_nothing_was_drafted():
    """S(gamma) models chains: a tree run's judged depths count a rejection below any deeper
    branch, so its alpha would read low; with only tree runs there is no theory table. A run that
    drafted nothing shows no acceptance rate ("–"), not 0%."""
    from spec_plugins.bench.report import has_theory, markdown

    rep = _report(_tree_stats())
    assert rep["theory"]["alpha_from"] == [] and not has_theory(rep)
    assert "Measured speedup against theory" not in markdown(rep)
    chain, _, _ = _iid_rounds()
    rep = _report(chain)
    assert rep["theory"]["alpha_from"] == ["ours_k4"] and has_theory(rep)
    idle = DecodeStats()
    idle.observe_round([], 0, 1)
    idle.row_rounds, idle.target_forwards, idle.time_total = 1, 1, 1.0
    lines = markdown(_report(idle)).splitlines()
    row = next(line for line in lines if line.startswith("| `ours_k4`")).split("|")
    head = next(line for line in lines if "| acceptance |" in line).split("|")
    assert row[[c.strip() for c in head].index("acceptance")].strip() == "–"
