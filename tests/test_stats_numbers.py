"""DecodeStats and the bench's pages report what was spent and counted: a draft model's forwards in
propose() count as draft-forward time, row compaction counts as cache time, a row failing in a
round is no row-round, the docs page embeds only this run's plots, and the mismatch warning and
the tables' column say what they count and agree."""

from __future__ import annotations

import re

import pytest

from conftest import tiny_llama
from grammar_helpers import tiny_tokenizer
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench import BenchOptions, BenchPrompt, run_bench
from spec_plugins.bench.docs import section
from spec_plugins.bench.report import build_report, markdown
from spec_plugins.bench.runner import Method, PromptRun
from spec_plugins.config import SamplingConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.grammar import GrammarSpec
from spec_plugins.loop.round import decode
from spec_plugins.proposers.draft_model import DraftModelProposer
from spec_plugins.proposers.ngram import NgramProposer
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.verifiers import ExactVerifier
from test_bench import tiny_decoder


# ---- time: a draft model's forwards ---------------------------------------------------------------
def test_draft_model_forwards_in_propose_count_as_draft_forward_time():
    """The draft model's forward seconds spent inside propose() (and observe()), as the proposer
    itself counts them, are the stats' time_draft_forward; its prefill at admission is prefill."""
    rt = TorchRuntime(tiny_llama(vocab=64, seed=0, sharpness=8.0))
    cfg = DraftModelProposer.Config(num_draft_tokens=3, model={"backend": "torch", "model": "tiny-test-model"})
    prop = DraftModelProposer(cfg, target=rt, runtime=TorchRuntime(tiny_llama(vocab=64, seed=0, sharpness=8.0)))
    spent = {"propose": 0.0, "observe": 0.0, "calls": 0}

    def counted(name, fn):
        def call(*args, **kw):
            f0 = prop.draft_forward_time
            try:
                return fn(*args, **kw)
            finally:
                spent[name] += prop.draft_forward_time - f0
                spent["calls"] += name == "propose"
        return call

    prop.propose = counted("propose", prop.propose)
    prop.observe = counted("observe", prop.observe)
    s = SpeculativeDecoder(rt, prop, ExactVerifier()).generate([1, 2, 3, 4, 5], 24).stats
    assert spent["calls"] > 0 and spent["propose"] > 0.0  # the draft model did forward while proposing
    assert s.time_draft_forward == pytest.approx(spent["propose"] + spent["observe"], rel=1e-9, abs=1e-12)
    assert s.time_draft_forward <= s.time_draft  # of drafting's time, on the same clock
    shares = s.to_dict()
    assert shares["time_outside_forwards"] == pytest.approx(
        s.time_total - s.time_prefill - s.time_target_forward - s.time_draft_forward)


# ---- time: row compaction -------------------------------------------------------------------------
def test_row_compaction_counts_as_cache_time_and_total():
    """Rows finishing in different rounds are compacted out of the cache before the next round:
    on a clock that moves only while the runtime compacts, that time is time_cache and time_total."""
    rt = TorchRuntime(tiny_llama(seed=3))
    now = [0.0]
    calls = []
    select = rt.select_rows

    def slow_select(keep):
        calls.append(list(keep))
        now[0] += 1.0
        return select(keep)

    rt.select_rows = slow_select
    stats = DecodeStats()
    steps = list(decode(rt, None, ExactVerifier(), LogitsPipeline(SamplingConfig()), [[1, 2, 3], [4, 5], [6, 7, 8]],
                        [2, 4, 6], stats=stats, clock=lambda: now[0]))
    assert sum(len(t) for st in steps for t in st.emitted.values()) == 12
    compactions = len(calls) - 1  # the first empties the runtime as the batch starts, before any timing
    assert calls[0] == [] and compactions == 2  # row 0 leaves before round 2, row 1 before round 4
    assert stats.time_cache == pytest.approx(compactions * 1.0)
    assert stats.time_total == pytest.approx(compactions * 1.0)
    assert stats.tokens_per_second == pytest.approx(12 / stats.time_total)


# ---- counts: a row failing in a round -------------------------------------------------------------
def test_plain_decoding_with_a_failing_processor_keeps_one_token_per_row_round():
    """Plain decoding emits one token per row-round; the round a row fails in emits none and is
    left out, so mean_accepted_tokens stays 1.0 (the target forward of that round still counts)."""
    dec = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=3, sharpness=2.0)), None, tokenizer=tiny_tokenizer())
    calls = [0]

    def fails_on_4th_call(ids, logits):
        calls[0] += 1
        if calls[0] > 3:
            raise RuntimeError("late failure")
        return logits

    r = dec.generate("abcxy12abc", 20, processors=[fails_on_4th_call])
    s = r.stats
    assert r.finish_reason == "error" and len(r.token_ids) == 3  # prefill's token + 2 rounds, then a failing round
    assert s.target_forwards == 3
    assert s.row_rounds == s.emitted_tokens == len(r.token_ids) - 1
    assert s.mean_accepted_tokens == 1.0
    dead = dec.generate("abcxy12abc", 20, grammar=GrammarSpec.regex("abz"))
    assert dead.finish_reason == "error"
    assert dead.stats.row_rounds == dead.stats.emitted_tokens == len(dead.token_ids) - 1


class _Rounds:
    """Per round and row: drafted nodes by depth, accepted length, emitted count, whether it failed."""

    def __init__(self) -> None:
        self.rows: list[tuple[list[int], int, int, bool]] = []

    def observe(self, record) -> None:
        for b, e in enumerate(record.emissions):
            self.rows.append((record.drafted_by_depth()[b], len(record.accepted[b]), len(record.emitted[b]),
                              e.error is not None))


def test_a_row_failing_in_a_drafted_round_is_left_out_of_acceptance_counts():
    """The round a row fails in (its draft offered, its verdict ignored) adds nothing to drafted,
    accepted, emitted or per-depth counts; the rounds it did not fail in add what they did."""
    model = tiny_llama(seed=3, sharpness=2.0)
    dec = SpeculativeDecoder(TorchRuntime(model), NgramProposer(NgramProposer.Config(num_draft_tokens=3)),
                             ExactVerifier())
    prompt = [1, 2, 3] * 4

    def fails_late(ids, logits):  # ids: [1, L], the node's sequence
        if ids.shape[-1] >= len(prompt) + 6:
            raise RuntimeError("late failure")
        return logits

    seen = _Rounds()
    r = dec.generate(prompt, 20, processors=[fails_late], observers=[seen])
    s = r.stats
    assert r.finish_reason == "error"
    failed = [row for row in seen.rows if row[3]]
    assert len(failed) == 1 and sum(failed[0][0]) > 0  # the failing round had drafted nodes
    ok = [row for row in seen.rows if not row[3]]
    assert s.row_rounds == len(ok)
    assert s.draft_tokens == sum(sum(d) for d, _, _, _ in ok)
    assert s.accepted_tokens == sum(a for _, a, _, _ in ok)
    assert s.emitted_tokens == sum(e for _, _, e, _ in ok)
    # the failing round's tokens before the raising node are output (as plain decoding's are) and
    # counted in new_tokens, not in the round counts
    assert s.new_tokens == len(r.token_ids) > s.emitted_tokens + 1
    depth = max(len(d) for d, _, _, _ in seen.rows)
    assert s.rows_by_position[:depth] + [0] * (depth - len(s.rows_by_position)) == [
        sum(1 for d, _, _, _ in ok if j < len(d) and d[j] > 0) for j in range(depth)]
    assert s.accepted_by_position[:depth] + [0] * (depth - len(s.accepted_by_position)) == [
        sum(1 for _, a, _, _ in ok if a > j) for j in range(depth)]


# ---- the bench's pages ----------------------------------------------------------------------------
def test_docs_section_embeds_only_this_runs_plots(tmp_path):
    """A PNG an earlier run left in --out (this run draws no theory plot: no fixed γ) is neither
    copied nor embedded; a report without its files list is refused, naming why."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "speedup_vs_theory.png").write_bytes(b"stale")
    dec, _ = tiny_decoder(k=2)
    opts = BenchOptions(max_new_tokens=6, runs=1, baselines=("plain",), gammas=(), auto=True, warmup=False,
                        progress=False, cost_positions=4)
    rep = run_bench(dec, [BenchPrompt("a", "copy", ("w1 w2 w3 w4 w1 w2",))], opts, out=out)
    wrote = sorted(p.split("/")[-1] for p in rep["files"])
    assert "speedup_vs_theory.png" not in wrote
    doc = tmp_path / "docs" / "benchmarks.md"
    text = section(rep, "run 2", "spec-plugins bench", out, doc)
    embedded = sorted(re.findall(r"!\[[^\]]*\]\(img/run-2/([^)]+)\)", text))
    assert embedded == wrote
    assert sorted(p.name for p in (doc.parent / "img" / "run-2").iterdir()) == wrote
    with pytest.raises(ValueError, match="lists no files"):
        section({k: v for k, v in rep.items() if k != "files"}, "run 3", "spec-plugins bench", out, doc)


COST = {"draft_cost_ratio": 0.0, "target_relative": [1.0, 1.2], "target_seconds": [0.01, 0.012],
        "positions": [1, 2], "draft_round_seconds": 0.0, "draft_step_seconds": 0.0}


def test_mismatch_warning_and_table_column_agree_and_say_what_they_count():
    """4 differing runs on 2 (method, prompt) pairs: the warning names both counts, the column
    (prompts with a mismatch, per method) sums to the pairs."""
    noop = lambda ids, n: None  # noqa: E731
    methods = [Method("plain", "baseline", None, noop), Method("ours_k2", "ours", 2, noop),
               Method("drifty", "baseline", None, noop)]
    prompts = [BenchPrompt("a", "copy", ("x",)), BenchPrompt("b", "copy", ("y",))]
    stats = DecodeStats()
    stats.observe_round([1], 1, 2)
    results = {m.name: [[PromptRun([[1, 2]], 1.0, stats if m.kind == "ours" else None)] * 3 for _ in prompts]
               for m in methods}
    mm = [{"question_id": q, "method": "drifty", "turn": 0, "index": 1, "reference": "plain", "run": r}
          for q, r in (("a", 0), ("a", 1), ("a", 2), ("b", 1))]
    raw = {"prompts": prompts, "methods": methods, "results": results, "mismatches": mm, "greedy": True,
           "cost_model": COST, "unavailable": {}, "duration_s": 1.0}
    rep = build_report(raw, {})
    md = markdown(rep)
    warning = next(line for line in md.splitlines() if line.startswith("**WARNING"))
    runs, pairs = (int(x) for x in re.search(r"in (\d+) run\(s\) of (\d+) method × prompt pair", warning).groups())
    assert (runs, pairs) == (4, 2)
    header = next(line for line in md.splitlines() if line.startswith("| method | γ"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    col = cols.index("prompts with greedy mismatch")
    rows = [line for line in md.splitlines() if line.startswith("| `")][: len(methods)]
    counts = {r.split("|")[1].strip(" `"): int(r.strip("|").split("|")[col]) for r in rows}
    assert counts == {"plain": 0, "ours_k2": 0, "drifty": 2}
    assert sum(counts.values()) == pairs
    assert rep["summary"]["drifty"]["all"]["greedy_mismatches"] == 2
