"""Bench inputs that would mislead are refused before anything is measured or overwritten:
--methods labels that would merge with a built-in method, a prompt category named like the
report's aggregate, duplicate ids, colliding --markdown section titles, a --markdown that cannot be
written, an empty set of our methods, and bench_heads.py --set overrides that would go unused. A
failed run leaves no earlier run's files to pass for its own."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from spec_plugins.bench import BenchOptions, load_prompts, register_baseline, run_bench
from spec_plugins.bench.baselines import time_decoder
from spec_plugins.bench.docs import update
from spec_plugins.bench.runner import Bench
from test_bench import PROMPTS, _saved_tiny, tiny_decoder

NGRAM = {"type": "ngram", "num_draft_tokens": 4}
ROOT = Path(__file__).resolve().parents[1]


# ---- --methods labels ----------------------------------------------------------------------------
@pytest.mark.parametrize("labels", [["plain"], ["ours_k2"], ["ours_auto"], ["ours_k7"], ["transformers"],
                                    ["ngram@onnxruntime"], ["a", "a"]])
def test_methods_label_that_would_merge_with_another_method_is_refused(labels):
    """Results are keyed by method name: a label equal to a built-in method's (or to a name the
    bench gives its own methods, or to another label) would pool two methods' runs."""
    dec, _ = tiny_decoder()
    opts = BenchOptions(max_new_tokens=4, gammas=[2], auto=True, baselines=["transformers"], progress=False,
                        methods=[(lab, NGRAM) for lab in labels])
    with pytest.raises(ValueError, match=f"--methods label '{labels[0]}'"):
        Bench(dec, opts, log=lambda m: None)


def test_methods_with_own_labels_still_run_beside_ours():
    dec, _ = tiny_decoder()
    opts = BenchOptions(max_new_tokens=4, gammas=[2], auto=False, baselines=[], progress=False,
                        methods=[("plain-ngram", NGRAM)])
    assert [m.name for m in Bench(dec, opts, log=lambda m: None).methods] == ["plain", "ours_k2", "plain-ngram"]


# ---- --out after a failed run -------------------------------------------------------------------
@register_baseline("test_fails_on_prompt_b")
def _fails_on_b(ctx):
    """Plain decoding that raises on prompt b's ids (prompt a runs to the end)."""
    dec = ctx.decoder.without_speculation()
    bad = dec.encode([{"role": "user", "content": PROMPTS[1].turns[0]}])

    def run(ids: list[int], n: int):
        if ids == bad:
            raise RuntimeError("this baseline fails on prompt b")
        return time_decoder(dec, ids, n)

    return run


def _earlier_run(out: Path) -> None:
    """An earlier run's files, and one the bench never writes."""
    out.mkdir()
    for name in ("report.json", "summary.md", "partial.jsonl", "cost_model.png", "speedup_vs_theory.png"):
        (out / name).write_text("earlier run")
    (out / "notes.txt").write_text("mine")


def test_failed_run_leaves_only_its_partial_results_in_out(tmp_path):
    """The bench's own names are cleared at the start (other files stay): after a failure only
    this run's partial.jsonl, with the prompts it finished, is there."""
    dec, _ = tiny_decoder()
    out = tmp_path / "out"
    _earlier_run(out)
    opts = BenchOptions(max_new_tokens=4, gammas=[2], auto=False, baselines=["test_fails_on_prompt_b"],
                        warmup=False, progress=False, cost_positions=4)
    with pytest.raises(RuntimeError, match="fails on prompt b"):
        run_bench(dec, PROMPTS, opts, out=out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "partial.jsonl"]
    lines = [json.loads(x) for x in (out / "partial.jsonl").read_text().splitlines()]
    assert [x["question_id"] for x in lines] == ["a"]


def test_refused_options_keep_the_earlier_run(tmp_path):
    dec, _ = tiny_decoder()
    out = tmp_path / "out"
    _earlier_run(out)
    bad = BenchOptions(max_new_tokens=4, gammas=[2], auto=False, baselines=[], progress=False,
                       methods=[("ours_k2", NGRAM)])
    with pytest.raises(ValueError, match="--methods label"):
        run_bench(dec, PROMPTS, bad, out=out)
    assert (out / "report.json").read_text() == "earlier run"


# ---- prompts ------------------------------------------------------------------------------------
def test_prompt_category_all_is_refused_naming_the_line(tmp_path):
    """"all" is the report's aggregate over every prompt: a category of that name would be counted twice."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"question_id": "x", "category": "code", "prompt": "a"}\n'
                 '{"question_id": "y", "category": "all", "prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: category 'all'"):
        load_prompts(f)


@pytest.mark.parametrize("lines, says", [
    ('{"question_id": "1", "prompt": "a"}\n{"prompt": "b"}\n',
     "p.jsonl:2: duplicate question_id '1': this line has no question_id and gets its position as its id, "
     "and {f}:1 gives it"),
    ('{"prompt": "a"}\n{"question_id": "0", "prompt": "b"}\n',
     "p.jsonl:2: duplicate question_id '0': this line gives it, and {f}:1 has no question_id and gets its "
     "position as its id"),
])
def test_duplicate_id_says_which_one_is_a_default(tmp_path, lines, says):
    f = tmp_path / "p.jsonl"
    f.write_text(lines)
    with pytest.raises(ValueError) as exc:
        load_prompts(f)
    assert says.format(f=f) in str(exc.value)


# ---- --markdown section titles --------------------------------------------------------------------
def test_markdown_titles_with_the_same_slug_do_not_replace_each_other(tmp_path):
    doc = tmp_path / "bench.md"
    update(doc, "Dev prompts (ORT)", "## Dev prompts (ORT)\nfirst run\n")
    before = doc.read_text()
    with pytest.raises(ValueError, match=r"'Dev prompts, ORT'.*'Dev prompts \(ORT\)'"):
        update(doc, "Dev prompts, ORT", "## Dev prompts, ORT\nsecond run\n")
    assert doc.read_text() == before
    update(doc, "Dev prompts (ORT)", "## Dev prompts (ORT)\nrerun\n")  # the same title replaces its section
    assert "rerun" in doc.read_text() and "first run" not in doc.read_text()


# ---- the CLI: refused before the bench runs ----------------------------------------------------------
def _cli(tmp_path: Path, *args: str):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    cfg = _saved_tiny(tmp_path)  # its proposer drafts `auto`
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": "x", "category": "c", "turns": ["w1 w2 w1 w2 w1"]}\n')
    return CliRunner().invoke(app, ["bench", "--config", str(cfg), "--prompts", str(prompts), "-n", "4",
                                    "--baselines", "plain", "--no-progress", "--out", str(tmp_path / "out"),
                                    *args])


@pytest.mark.parametrize("args, msg", [
    (["--gammas", "2", "--markdown", "{tmp}/missing/bench.md", "--title", "T"], "the directory"),
    (["--gammas", "2", "--markdown", "{tmp}"], "is a directory"),
    (["--gammas", "2", "--markdown", "{tmp}/doc.md", "--title", "Dev prompts, ORT"], "'Dev prompts (ORT)'"),
    (["--gammas", "", "--no-auto"], "--no-auto"),  # would have run ours_auto
])
def test_cli_bench_refuses_before_measuring(tmp_path, args, msg):
    update(tmp_path / "doc.md", "Dev prompts (ORT)", "## Dev prompts (ORT)\nfirst run\n")
    res = _cli(tmp_path, *[a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 2 and "error:" in res.output and msg in res.output, res.output
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_cli_bench_markdown_write_error_is_reported(tmp_path):
    """A --markdown document that fails at write (its img directory is a file) ends in the CLI's
    error, naming where the run's own files are."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "img").write_text("not a directory")
    res = _cli(tmp_path, "--gammas", "2", "--markdown", str(tmp_path / "docs" / "b.md"), "--title", "T")
    assert res.exit_code == 2 and "error: --markdown" in res.output, res.output
    assert "the run's own files are in" in res.output and (tmp_path / "out" / "report.json").is_file()


# ---- examples/bench_heads.py --set ---------------------------------------------------------------------
def _bench_heads():
    spec = importlib.util.spec_from_file_location("bench_heads", ROOT / "examples" / "bench_heads.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, msg", [
    (["--methods", "ngram", "--set", "ngarm.num_draft_tokens=3"], "method 'ngarm' is not among --methods"),
    (["--methods", "ngram", "--set", "eagle-tree.tree_nodes=3"], "method 'eagle-tree' is not among --methods"),
    (["--methods", "ngram", "--set", "ngram=3"], "expected method.field=value"),
    (["--methods", "ngram", "--set", "ngram.num_draft_tokens"], "expected method.field=value"),
    (["--methods", "ngrm"], "--methods: unknown ngrm"),
    (["--methods", "ngram", "--prompts", "qa-1,qa-2"], "--prompts: unknown qa-2; known: chat-1"),
])
def test_bench_heads_refuses_a_set_it_would_not_apply(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        _bench_heads().parse_args(argv)
    assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_bench_heads_applies_its_sets():
    args, specs = _bench_heads().parse_args(["--methods", "ngram,eagle-tree", "--set", "ngram.num_draft_tokens=3",
                                             "--set", "eagle-tree.top_k=2"])
    assert specs["ngram"]["num_draft_tokens"] == 3 and specs["eagle-tree"]["top_k"] == 2
    assert specs["ngram"]["max_ngram"] == 3  # the rest of the method's section is kept
