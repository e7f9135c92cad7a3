"""Bench inputs refused before any work or any file is touched (no prompts, a --gammas range past
the limit, a --categories naming none, a replay with no fixed draft length), reports the replay
reads back from anywhere (the built-in default config, relative config paths), draft lengths only
for baselines that draft, distinct plot colours, and --markdown images of this run only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench import _saved_tiny, tiny_decoder
from test_bench_hardening import _auto_report
from test_bench_inputs import _cli, _earlier_run

from spec_plugins.bench import (
    BenchOptions,
    load_prompts,
    plain_decoding,
    register_baseline,
    run_bench,
)
from spec_plugins.bench.baselines import BASELINES, drafts, time_decoder
from spec_plugins.bench.cli import parse_gammas
from spec_plugins.bench.runner import Bench


# ---- no prompts: refused before an earlier run's files go ---------------------------------------------
@pytest.mark.parametrize("warmup", [True, False])
def test_run_bench_without_prompts_keeps_the_earlier_run(tmp_path, warmup):
    dec, _ = tiny_decoder()
    out = tmp_path / "out"
    _earlier_run(out)
    before = sorted(p.name for p in out.iterdir())
    opts = BenchOptions(max_new_tokens=4, gammas=[2], auto=False, baselines=["plain"], warmup=warmup,
                        progress=False, cost_positions=4)
    with pytest.raises(ValueError, match="no prompts"):
        run_bench(dec, [], opts, out=out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "report.json").read_text() == "earlier run"
    with pytest.raises(ValueError, match="no prompts"):
        Bench(dec, opts, log=lambda m: None).run([])


# ---- --gammas: a range past the limit is refused as written --------------------------------------------
@pytest.mark.parametrize("text, part", [("1-2000000", "'1-2000000'"), ("2,60-65", "'60-65'"), ("0", "'0'")])
def test_parse_gammas_refuses_a_part_outside_the_limit_naming_it(text, part):
    with pytest.raises(ValueError) as exc:
        parse_gammas(text)
    msg = str(exc.value)
    assert msg.startswith(f"--gammas: {part} reaches outside 1..64") and len(msg) < 120


def test_bench_options_name_a_few_bad_gammas_only():
    with pytest.raises(ValueError) as exc:
        BenchOptions(gammas=range(1, 10_000))
    assert "[65, 66, 67, 68, 69] ... (9935 in all)" in str(exc.value) and len(str(exc.value)) < 120


# ---- --categories naming none ----------------------------------------------------------------------------
def test_categories_naming_none_are_refused(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"question_id": "x", "category": "c", "prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"categories=\[\] names no category"):
        load_prompts(f, categories=[])
    assert len(load_prompts(f, categories=None)) == 1  # None: every category
    for given in (",", " ", ""):
        res = _cli(tmp_path, "--gammas", "2", "--categories", given)
        assert res.exit_code == 2 and f"--categories {given!r} names no category" in res.output, res.output
        assert not (tmp_path / "out").exists()


# ---- replay: the report's config read back from anywhere ---------------------------------------------------
def _bench_then_replay(tmp_path: Path, monkeypatch, with_config: bool, *replay_args: str) -> None:
    """A bench run from ``tmp_path`` (its config given relative, or none: the built-in default, here
    the tiny model), then the replay of its report from another directory."""
    from typer.testing import CliRunner

    import spec_plugins.config
    from spec_plugins.bench import replay
    from spec_plugins.cli import app

    cfg = _saved_tiny(tmp_path)
    monkeypatch.setattr(spec_plugins.config, "default_config", lambda: spec_plugins.config.SpecConfig.from_file(cfg))
    (tmp_path / "p.jsonl").write_text('{"question_id": "x", "category": "c", "turns": ["w1 w2 w1 w2 w1 w2"]}\n')
    monkeypatch.chdir(tmp_path)
    args = ["--config", cfg.name] if with_config else []
    res = CliRunner().invoke(app, ["bench", *args, "--prompts", "p.jsonl", "-n", "6", "--gammas", "2",
                                   "--baselines", "plain", "--no-progress", "--out", "out"])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "out" / "report.json").read_text())["meta"]
    assert meta["config"] == (str(cfg.resolve()) if with_config else "built-in default")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    replay.main(["--report", str(tmp_path / "out" / "report.json"), "--prompts", str(tmp_path / "p.jsonl"),
                 *replay_args])


@pytest.mark.parametrize("with_config", [True, False])
def test_replay_reads_the_reports_config_from_another_directory(tmp_path, monkeypatch, capsys, with_config):
    _bench_then_replay(tmp_path, monkeypatch, with_config, "--gammas", "1-2")
    out = capsys.readouterr().out
    assert "best fixed k" in out and "auto/best" in out


def test_replay_without_fixed_gammas_is_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        _bench_then_replay(tmp_path, monkeypatch, True, "--gammas", "")
    assert exc.value.code == 2 and "--gammas '' names no draft length" in capsys.readouterr().err


# ---- draft lengths: only for baselines that draft -------------------------------------------------------------
@register_baseline("test_plain_peer")
@plain_decoding
def _plain_peer(ctx):
    dec = ctx.decoder.without_speculation()
    return lambda ids, n: time_decoder(dec, ids, n)


@register_baseline("test_drafting_peer")
def _drafting_peer(ctx):
    return lambda ids, n: time_decoder(ctx.decoder, ids, n)


def test_only_drafting_baselines_get_a_draft_length():
    assert not drafts(BASELINES.get("llamacpp")) and not drafts(BASELINES.get("plain"))
    assert drafts(BASELINES.get("llamacpp_prompt_lookup")) and drafts(BASELINES.get("transformers"))
    dec, _ = tiny_decoder(k=3)
    opts = BenchOptions(max_new_tokens=4, gammas=[2], auto=False, progress=False,
                        baselines=["plain", "test_plain_peer", "test_drafting_peer"])
    gammas = {m.name: m.gamma for m in Bench(dec, opts, log=lambda m: None).methods}
    assert gammas == {"plain": None, "test_plain_peer": None, "test_drafting_peer": 3, "ours_k2": 2}


# ---- acceptance plot: one colour per method -----------------------------------------------------------------
def test_acceptance_plot_colours_span_the_methods_other_than_auto(tmp_path, monkeypatch):
    """Methods listed after auto get their own colours from the map, as those before it do."""
    import matplotlib

    from spec_plugins.bench import plots

    rep = _auto_report(with_ours_auto=True)
    st = rep["summary"]["ours_k4"]["all"]["stats"]
    for name in ("other-b", "other-a"):  # listed after ours_auto
        rep["methods"].insert(4, {"name": name, "kind": "method", "gamma": 3, "group": ""})
        rep["summary"][name] = {"all": {"stats": st}}
    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    plots.acceptance_by_position(rep, tmp_path / "a.png")
    lines = {ln.get_label(): matplotlib.colors.to_rgba(ln.get_color()) for ln in figs[0].axes[0].get_lines()}
    viridis = matplotlib.colormaps["viridis"]
    got = [lines[k] for k in ("γ = 4", "suffix_global", "other-a", "other-b")]
    assert got == [tuple(map(float, viridis(i / 3))) for i in range(4)]


# ---- --markdown: the image folder holds this run's plots only ---------------------------------------------------
def test_markdown_section_drops_an_earlier_runs_plots(tmp_path, monkeypatch):
    from spec_plugins.bench import docs

    monkeypatch.setattr(docs, "markdown", lambda report: "# title\nbody\n")
    out, doc = tmp_path / "out", tmp_path / "docs" / "bench.md"
    out.mkdir()
    (out / "cost_model.png").write_bytes(b"this run")
    img = doc.parent / "img" / "t"
    img.mkdir(parents=True)
    (img / "speedup_vs_theory.png").write_bytes(b"earlier run")  # a plot this run does not draw
    (img / "mine.png").write_bytes(b"not a bench plot")
    text = docs.section({"meta": {}, "files": [str(out / "cost_model.png")]}, "T", "spec-plugins bench", out, doc)
    assert sorted(p.name for p in img.iterdir()) == ["cost_model.png", "mine.png"]
    assert (img / "cost_model.png").read_bytes() == b"this run" and "speedup_vs_theory" not in text

