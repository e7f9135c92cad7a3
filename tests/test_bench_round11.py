"""Bench round 11: text with `$` drawn as written in the plots (a token `$$` is not mathtext), a
plot that fails keeps the run's numbers, report.json written once with its files, and the replay
(EOS turns decoded with the bench's limits, checked against the engine; sampling runs and
proposers it cannot reproduce refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_bench
from conftest import tiny_llama
from test_bench import PROMPTS, WORDS, _saved_tiny, tiny_decoder, word_tokenizer

from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench import BenchOptions, BenchPrompt, run_bench
from spec_plugins.config import SpecConfig
from spec_plugins.decoder import SpeculativeDecoder

PNGS = {"acceptance_by_position.png", "speedup_by_category.png", "speedup_vs_theory.png", "rejected_tokens.png",
        "cost_model.png"}


def _quick(**kw) -> BenchOptions:
    """A short bench: plain and one fixed draft length (theory plot included)."""
    return BenchOptions(**{"max_new_tokens": 8, "runs": 1, "gammas": [2], "auto": False, "baselines": ["plain"],
                           "progress": False, "cost_positions": 4, **kw})


# ---- plots: `$` in token text, method names and categories ---------------------------------------------
def _width(text: str, parse_math: bool = True) -> float:
    """Rendered width of ``text`` in pixels (parse_math=False: matplotlib draws it as written)."""
    import matplotlib.pyplot as plt

    fig = plt.figure()
    t = fig.text(0, 0, text, parse_math=parse_math)
    fig.canvas.draw()
    width = t.get_window_extent().width
    plt.close(fig)
    return width


@pytest.mark.parametrize("text", ["'$$'", "' $$'", "a $x$ b", "$5 and $6"])
def test_plain_text_is_drawn_as_written(text):
    from spec_plugins.bench.plots import plain_text

    assert _width(plain_text(text)) == pytest.approx(_width(text, parse_math=False))


def test_plots_draw_dollar_tokens_method_names_and_categories(tmp_path):
    """SmolLM2 has the tokens '$$' and ' $$'; a --methods label or a category may hold `$` too."""
    from spec_plugins.bench.plots import write_plots

    dec, _ = tiny_decoder(k=2)
    rep = run_bench(dec, [BenchPrompt("a", "c$1$", ("w1 w2 w3 w1 w2 w3 w1",))], _quick())
    rep["most_rejected_tokens"] = [{"token_id": 5, "text": "$$", "count": 3},
                                   {"token_id": 6, "text": " $$", "count": 2}]
    ours = next(m for m in rep["methods"] if m["name"] == "ours_k2")  # a --methods label with `$`: a legend
    rep["methods"].append({**ours, "kind": "method", "name": "$m$"})  # entry and the heatmap's axis
    rep["summary"]["$m$"] = rep["summary"]["ours_k2"]
    files, failed = write_plots(rep, tmp_path)
    assert failed == {} and {p.name for p in files} == PNGS
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in PNGS)


def test_bench_whose_most_rejected_token_is_dollars_finishes(tmp_path, monkeypatch):
    """The hunter's run: token 6 ('w4' renamed '$$') is the most rejected draft token."""
    monkeypatch.setattr(test_bench, "WORDS", [*WORDS[:6], "$$", *WORDS[7:]])  # what word_tokenizer reads
    dec, _ = tiny_decoder(k=3, seed=3)
    prompts = [BenchPrompt("a", "copy", ("w1 w2 w3 $$ w1 w2 w3 $$ w1", "w5 w6 w5")),
               BenchPrompt("c", "copy", ("w3 $$ w5 w3 $$",))]
    rep = run_bench(dec, prompts, _quick(max_new_tokens=12, gammas=[1, 3]), out=tmp_path)
    assert "$$" in [r["text"] for r in rep["most_rejected_tokens"]]
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert {Path(f).name for f in on_disk["files"]} == PNGS and "plot_errors" not in on_disk
    assert all((tmp_path / name).is_file() for name in PNGS)


# ---- a plot that fails: the numbers are written, the error names it --------------------------------------
def _boom(report, path):
    import matplotlib.pyplot as plt

    plt.subplots()  # a figure left open, as a failing savefig leaves it
    raise ValueError("cannot draw\nthis")


def test_a_failing_plot_keeps_the_numbers_and_the_other_plots(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from spec_plugins.bench import plots

    monkeypatch.setitem(plots.PLOTS, "rejected_tokens.png", _boom)
    dec, _ = tiny_decoder(k=2)
    open_before = len(plt.get_fignums())
    with pytest.raises(plots.PlotError, match=r"1 plot\(s\) failed, rejected_tokens.png: ValueError: cannot draw this"):
        run_bench(dec, PROMPTS[1:], _quick(), out=tmp_path)
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["plot_errors"] == {"rejected_tokens.png": "ValueError: cannot draw this"}
    assert {Path(f).name for f in rep["files"]} == PNGS - {"rejected_tokens.png"}
    assert all((tmp_path / Path(f).name).is_file() for f in rep["files"])
    assert not (tmp_path / "rejected_tokens.png").exists() and (tmp_path / "summary.md").is_file()
    assert rep["summary"]["plain"]["all"]["tokens"] > 0 and len(plt.get_fignums()) == open_before


def test_cli_reports_a_failing_plot_after_writing_the_report(tmp_path, monkeypatch):
    from test_bench_inputs import _cli

    from spec_plugins.bench import plots

    monkeypatch.setitem(plots.PLOTS, "cost_model.png", _boom)
    res = _cli(tmp_path, "--gammas", "2", "--no-auto")
    assert res.exit_code == 2 and "cost_model.png: ValueError: cannot draw this" in res.output, res.output
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "cost_model.png" in rep["plot_errors"] and rep["meta"]["wall_s_including_load"] > 0


# ---- report.json: written once, after the plots, with its files ----------------------------------------
def test_run_bench_writes_the_report_with_its_files(tmp_path):
    from spec_plugins.bench.docs import section

    dec, _ = tiny_decoder(k=2)
    rep = run_bench(dec, PROMPTS[1:], _quick(), out=tmp_path, meta={"config": "test"})
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["files"] == rep["files"] and {Path(f).name for f in rep["files"]} == PNGS
    text = section(on_disk, "T", "cmd", tmp_path, tmp_path / "doc" / "bench.md")  # refused without files
    assert "![rejected_tokens](img/t/rejected_tokens.png)" in text


def test_cli_report_on_disk_has_files_and_wall_time(tmp_path):
    from test_bench_inputs import _cli

    res = _cli(tmp_path, "--gammas", "2", "--no-auto", "--json")
    assert res.exit_code == 0, res.output
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    assert on_disk == printed and on_disk["meta"]["wall_s_including_load"] > 0
    assert {Path(f).name for f in on_disk["files"]} == PNGS


# ---- replay: a turn that ended on EOS before max_new_tokens --------------------------------------------
def _eos_decoder(k: int, eos_word: str) -> SpeculativeDecoder:
    tok = word_tokenizer()
    tok.eos_token = eos_word
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "tiny-test-model"},
                            "proposer": {"type": "ngram", "num_draft_tokens": k, "max_ngram": 3}})
    return SpeculativeDecoder.from_config(cfg, target=TorchRuntime(tiny_llama(seed=10), tok))


def _engine_widths(dec: SpeculativeDecoder, ids: list[int], max_new: int) -> tuple[list[int], list[int]]:
    """Tokens and forward widths of a real speculative generation (an observer of its rounds)."""
    seen: list[int] = []

    class Widths:
        def observe(self, record):
            seen.append(record.positions)

    out = dec.generate_batch([ids], max_new_tokens=max_new, observers=[Widths()])[0].token_ids
    return out, seen


def test_replay_report_decodes_eos_turns_as_the_engine_did():
    """A turn that ended on EOS well before max_new_tokens: the engine drafted its last rounds with
    the room max_new_tokens left, so the replay (what ``python -m spec_plugins.bench.replay`` runs)
    must price the same forward widths, not those of a limit equal to the output's length."""
    from spec_plugins.bench.replay import fixed, replay_report
    from spec_plugins.policy import ForwardCost
    from spec_plugins.proposers.ngram import NgramProposer

    max_new = 60
    dec = _eos_decoder(3, "<eos>")
    ids = dec.encode([{"role": "user", "content": PROMPTS[0].turns[0]}])
    out = dec.without_speculation().generate_batch([ids], max_new_tokens=max_new)[0].token_ids
    pos = next(i for i in range(13, len(out)) if out[i] not in out[:i])  # first seen at >= 13: its EOS
    cost = ForwardCost.from_curve([0.01 + 0.001 * i for i in range(40)])
    for k in (3, 5, 8):
        dec = _eos_decoder(k, WORDS[out[pos]])
        eos = list(dec.eos_ids())
        real, widths = _engine_widths(dec, ids, max_new)
        assert real == out[: pos + 1] and real[-1] in eos and len(real) < max_new
        sim = replay_report([("c", ids, real)], lambda d=dec: NgramProposer(d.config.proposer), {"k": fixed(k)},
                            cost, 0.0, max_new=max_new, eos_ids=eos)
        seconds = cost(1, len(ids)) + sum(cost(1, n) for n in widths)  # the prefill, then every forward
        assert sim["k"]["all"] == pytest.approx(len(real) / seconds)


def test_replay_turn_refuses_an_output_its_limits_cannot_have_ended():
    from spec_plugins.bench.replay import fixed, replay_turn
    from spec_plugins.policy import ForwardCost
    from spec_plugins.proposers.ngram import NgramProposer

    cost = ForwardCost.from_curve([0.01, 0.02])
    prop = NgramProposer(NgramProposer.Config())
    with pytest.raises(ValueError, match=r"4 tokens ends before max_new_tokens 9 on none of the EOS ids \[1\]"):
        replay_turn([3, 4], [5, 6, 5, 6], prop, fixed(2)(), cost, 0.0, max_new=9, eos_ids=[1])
    with pytest.raises(ValueError, match="4 tokens is longer than max_new_tokens 3"):
        replay_turn([3, 4], [5, 6, 5, 6], prop, fixed(2)(), cost, 0.0, max_new=3, eos_ids=[1])
    assert replay_turn([3, 4], [5, 6, 1], prop, fixed(2)(), cost, 0.0, max_new=9, eos_ids=[1]).new_tokens == 3


# ---- replay CLI: only what it can reproduce -------------------------------------------------------------------
def _bench_cli(tmp_path: Path, extra_config: str = "") -> tuple[Path, Path, Path]:
    """A CLI bench of the tiny model (its config plus ``extra_config``): config, prompts, report."""
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    cfg = _saved_tiny(tmp_path)
    cfg.write_text(cfg.read_text() + extra_config)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": "x", "category": "c", "turns": ["w1 w2 w1 w2 w1 w2"]}\n')
    res = CliRunner().invoke(app, ["bench", "--config", str(cfg), "--prompts", str(prompts), "-n", "6", "--gammas",
                                   "2", "--no-auto", "--baselines", "plain", "--no-progress", "--out",
                                   str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    return cfg, prompts, tmp_path / "out" / "report.json"


def test_replay_refuses_a_sampling_run(tmp_path, capsys):
    from spec_plugins.bench import replay

    _, prompts, report = _bench_cli(tmp_path, "sampling: {temperature: 0.9, seed: 0}\n")
    assert json.loads(report.read_text())["meta"]["greedy"] is False
    with pytest.raises(SystemExit) as exc:
        replay.main(["--report", str(report), "--prompts", str(prompts), "--gammas", "2"])
    err = capsys.readouterr()
    assert exc.value.code == 2 and "meta.greedy is False (a sampling run)" in err.err and "auto/best" not in err.out


@pytest.mark.parametrize("proposer", ["{type: recycling}", "{type: lookahead}"])
def test_replay_refuses_a_proposer_it_cannot_reproduce(tmp_path, capsys, proposer):
    """Recycling and lookahead read the target's logits, which the replay only stands in for."""
    from spec_plugins.bench import replay

    _, prompts, report = _bench_cli(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(f"target: {{backend: torch, model: {tmp_path / 'tiny-model'}}}\nproposer: {proposer}\n")
    with pytest.raises(SystemExit) as exc:
        replay.main(["--report", str(report), "--prompts", str(prompts), "--config", str(other), "--gammas", "2"])
    err = capsys.readouterr()
    kind = proposer.split()[1].rstrip("}")
    assert exc.value.code == 2 and f"proposer {kind!r}: the replay reproduces only" in err.err
    assert "auto/best" not in err.out
    replay.main(["--report", str(report), "--prompts", str(prompts), "--gammas", "2"])  # its own ngram: replayed
    assert "auto/best" in capsys.readouterr().out
