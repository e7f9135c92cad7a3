"""Bench round 13: whole-file rewrites are atomic (docs page, report.json), a compare config must
decode as the primary does, API prompts are checked as load_prompts checks a file, --methods labels
are refused before any model loads, unreadable prompt files are named, and the theory's verify cost
is measured (or left out) past the cost curve."""

from __future__ import annotations

import json
import resource

import pytest
from test_bench import tiny_decoder, word_tokenizer
from test_bench_hardening import COST, _noop, _raw

from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench import BenchOptions, BenchPrompt, run_bench
from spec_plugins.bench.prompts import check_prompts, load_prompts, parse_prompt
from spec_plugins.bench.report import build_report, markdown, theoretical_speedup, write_json
from spec_plugins.bench.runner import Method
from spec_plugins.config import SpecConfig
from spec_plugins.decoder import SpeculativeDecoder
from conftest import tiny_llama


def _quick(**kw) -> BenchOptions:
    return BenchOptions(**{"max_new_tokens": 6, "runs": 1, "gammas": [2], "auto": False, "baselines": ["plain"],
                           "warmup": False, "progress": False, "cost_positions": 4, **kw})


P = [BenchPrompt("a", "copy", ("w1 w2 w3 w4 w1 w2",))]


# ---- 1. whole-file rewrites: a failed write keeps the old file ------------------------------------
def _fails_past(limit: int, write) -> OSError:
    """Run ``write`` with files limited to ``limit`` bytes (a full disk, for this process): the
    write raises part way (Python ignores SIGXFSZ, so it is an OSError)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        with pytest.raises(OSError) as err:
            write()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    return err.value


def test_docs_update_failed_write_keeps_every_section(tmp_path):
    from spec_plugins.bench.docs import update

    doc = tmp_path / "benchmarks.md"
    for i in range(20):
        update(doc, f"run {i}", f"## run {i}\n{'x' * 2000}\n")
    before = doc.read_text()
    # a section in the middle rewritten longer: the page passes the limit part way
    _fails_past(len(before) + 1000, lambda: update(doc, "run 3", "## run 3\n" + "y" * 5000 + "\n"))
    assert doc.read_text() == before  # was cut at the limit: the sections after run 3 lost
    assert [p.name for p in tmp_path.iterdir()] == ["benchmarks.md"]  # no temporary file left


def test_write_json_failed_write_keeps_old_report(tmp_path):
    path = tmp_path / "report.json"
    write_json({"old": 1}, path)
    _fails_past(4096, lambda: write_json({"new": "z" * 10000}, path))
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    write_json({"new": 2}, path)
    assert json.loads(path.read_text()) == {"new": 2}


# ---- 2. a compare config decodes as the primary does -------------------------------------------------
def _dec(sampling: dict) -> SpeculativeDecoder:
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "tiny-test-model"},
                            "proposer": {"type": "ngram", "num_draft_tokens": 2, "max_ngram": 3},
                            "sampling": sampling})
    return SpeculativeDecoder.from_config(cfg, target=TorchRuntime(tiny_llama(seed=3), word_tokenizer()))


@pytest.mark.parametrize("primary, other", [({"temperature": 1.0}, {"temperature": 0.0}),
                                            ({"temperature": 0.0}, {"temperature": 1.0}),
                                            ({"temperature": 0.0}, {"temperature": 0.0, "repetition_penalty": 1.3})])
def test_compare_with_other_sampling_refused(tmp_path, primary, other):
    with pytest.raises(ValueError, match=r"compare config 'x': its sampling .*'temperature'.* differs from the primary"):
        run_bench(_dec(primary), P, _quick(compare=[("x", _dec(other))]), out=tmp_path / "out")
    assert not (tmp_path / "out" / "report.json").exists()


def test_compare_config_sampling_refused_before_models_load(tmp_path):
    from spec_plugins.bench.cli import load_compare_configs
    from spec_plugins.cli import load_config

    head = "target: {backend: torch, model: tiny-test-model}\nproposer: {type: ngram, num_draft_tokens: 2}\n"
    primary, hot, seed = tmp_path / "p.yaml", tmp_path / "hot.yaml", tmp_path / "seed.yaml"
    primary.write_text(head)
    hot.write_text(head + "sampling: {temperature: 0.8}\n")
    seed.write_text(head + "sampling: {seed: 7}\n")  # greedy: the seed draws nothing
    cfg = load_config(primary)
    with pytest.raises(ValueError, match=rf"--compare-config {hot}: its sampling .*0\.8.* primary config's"):
        load_compare_configs([hot], cfg)
    assert [p for p, _ in load_compare_configs([seed], cfg)] == [seed]


# ---- 3. prompts from the API are checked as a file's are ---------------------------------------------
def test_check_prompts_refuses_category_all_and_duplicate_ids(tmp_path):
    with pytest.raises(ValueError) as file_err:
        parse_prompt({"prompt": "x", "category": "all"}, "prompts[0]")
    with pytest.raises(ValueError) as api_err:
        check_prompts([BenchPrompt("a", "all", ("x",)), BenchPrompt("b", "code", ("y",))])
    assert str(api_err.value) == str(file_err.value)
    with pytest.raises(ValueError, match=r"prompts\[1\]: duplicate question_id 'q': this prompt gives it, and "
                                         r"prompts\[0\] gives it; give each prompt its own id"):
        check_prompts([BenchPrompt("q", "c1", ("x",)), BenchPrompt("q", "c2", ("y",))])
    dec, _ = tiny_decoder(k=2)
    with pytest.raises(ValueError, match="category 'all'"):  # before anything runs or is written
        run_bench(dec, [BenchPrompt("a", "all", ("w1 w2",))], _quick(), out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [BenchPrompt("a", "copy", ()), BenchPrompt("a", "", ("x",)),
                                 BenchPrompt("a", "copy", ("x", "  ")), BenchPrompt("a", "copy", (5,))],
                         ids=["no-turns", "empty-category", "blank-turn", "non-string-turn"])
def test_check_prompts_refuses_what_a_prompt_file_refuses(bad):
    """A prompt list given to the API is checked as a prompt file's lines are (no turns ran the
    whole bench and failed in a plot), with the same message."""
    obj = {"question_id": bad.question_id, "category": bad.category, "turns": list(bad.turns)}
    with pytest.raises(ValueError) as file_err:
        parse_prompt(obj, "prompts[0]")
    with pytest.raises(ValueError) as api_err:
        check_prompts([bad])
    assert str(api_err.value) == str(file_err.value)


# ---- 4. --methods labels refused before any model loads ----------------------------------------------
def test_methods_label_clash_refused_before_any_model_loads(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    def no_load(*a, **k):
        raise AssertionError("a model loaded before the --methods labels were checked")

    monkeypatch.setattr(SpeculativeDecoder, "from_config", no_load)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("target: {backend: torch, model: tiny-test-model}\nproposer: {type: ngram, num_draft_tokens: 2}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2"}\n')
    for label in ("plain", "ours_k9", "ngram@cpu"):
        methods = tmp_path / "m.yaml"
        methods.write_text(f"{label}: {{type: ngram, num_draft_tokens: 3}}\n")
        res = CliRunner().invoke(app, ["bench", "--config", str(cfg), "--prompts", str(prompts), "--gammas", "2",
                                       "--baselines", "plain", "--methods", str(methods), "--no-progress",
                                       "--out", str(tmp_path / "out")])
        assert res.exit_code == 2 and f"--methods label {label!r}" in res.output, res.output


# ---- 5. prompt files that cannot be read are named ---------------------------------------------------
def test_prompt_file_directory_and_non_utf8_named(tmp_path):
    with pytest.raises(ValueError, match=rf"prompt file {tmp_path} is a directory"):
        load_prompts(tmp_path)
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"prompt file {bad} is not UTF-8 text \(byte 15"):
        load_prompts(bad)


# ---- 6. the theory's verify cost past the measured curve ---------------------------------------------
def test_theory_verify_cost_past_the_curve_is_left_out():
    methods = [Method("plain", "baseline", None, _noop), Method("ours_k2", "ours", 2, _noop)]
    raw = _raw(methods, P, {"plain": [[(10, 1.0)]], "ours_k2": [[(20, 1.0)]]})
    rel = COST["target_relative"]
    rep = build_report(raw, {"max_new_tokens": 6, "runs": 1})
    th = rep["theory"]
    for g, v in zip(th["gammas"], th["with_verify_cost"]):
        if g < len(rel):  # T(g+1)/T(1) measured
            assert v == pytest.approx(theoretical_speedup(th["alpha"], g, th["c"], rel[g]))
        else:
            assert v is None, g  # was the last measured width's
    assert th["gammas"][-1] >= len(rel)
    row = next(line for line in markdown(rep).splitlines() if line.startswith(f"| {th['gammas'][-1]} |"))
    assert row.split(" | ")[2] == "–"


def test_bench_measures_the_cost_curve_past_its_gammas(tmp_path):
    dec, _ = tiny_decoder(k=2)
    rep = run_bench(dec, P, _quick(gammas=[2, 5], cost_positions=2))
    rel = rep["cost_model"]["target_relative"]
    assert len(rel) >= 6  # T(6)/T(1) for γ = 5
    th = rep["theory"]
    i = th["gammas"].index(5)
    assert th["with_verify_cost"][i] == pytest.approx(theoretical_speedup(th["alpha"], 5, th["c"], rel[5]))


def test_an_atomic_write_replaces_a_read_only_file_keeping_its_mode(tmp_path):
    """The old file's mode is given to the new one once its text is written: a read-only report
    is replaced whole (the temporary file was made read-only before its text, and the write
    failed naming the temporary file), and nothing is left beside it."""
    import os
    import stat

    from spec_plugins.files import write_text_atomic

    path = tmp_path / "report.md"
    path.write_text("old\n")
    path.chmod(0o444)
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and stat.S_IMODE(os.stat(path).st_mode) == 0o444
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
