"""``scripts/quant_report.py``'s inputs and outputs, checked without loading a model: the schemes
are checked (and fp32, the reference, always measured) before anything loads, the dev prompts
it decodes are distinct, the shipped reports count each prompt once, and a perplexity over no
scored token is refused rather than reported as a perfect 1.0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_llama
from test_gpu_scripts import _script

from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.bench.quality import greedy_agreement, perplexity

ROOT = Path(__file__).resolve().parents[1]
XEON_TITLE = "Quantized ONNX Runtime graphs on an AVX-512 VNNI and AMX CPU"


def _no_load(monkeypatch) -> None:
    """Loading the tokenizer (the script's first load) fails the test: refusals come before it."""
    import spec_plugins.models

    def load(*_a, **_k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(spec_plugins.models, "load_gguf_tokenizer", load)


def _run_main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr("sys.argv", ["quant_report.py", *argv])
    _script("quant_report").main()


def test_unknown_scheme_is_refused_before_anything_loads(monkeypatch, capsys, tmp_path):
    _no_load(monkeypatch)
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exc:
        _run_main(monkeypatch, "--schemes", "int8,int9", "--no-llamacpp", "--out", str(out))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown int9" in err and "int4-gguf" in err  # names the bad label and the known ones
    assert not out.exists()


def test_fp32_is_measured_first_when_not_asked_for(capsys):
    labels = _script("quant_report").scheme_labels
    assert labels("int8") == ["fp32", "int8"]
    assert "fp32 added" in capsys.readouterr().out
    assert labels("int4, fp32,int8") == ["fp32", "int4", "int8"]
    assert capsys.readouterr().out == ""
    for bad in ("", "int8,int8"):
        with pytest.raises(ValueError, match="--schemes"):
            labels(bad)


def test_markdown_title_clash_is_refused_before_anything_loads(monkeypatch, capsys, tmp_path):
    """A clashing section title used to fail after every scheme was measured and --out written."""
    _no_load(monkeypatch)
    doc, out = tmp_path / "b.md", tmp_path / "report.json"
    doc.write_text("<!-- bench:quant-a -->\n## Quant (A)\n<!-- /bench:quant-a -->\n")
    with pytest.raises(SystemExit):
        _run_main(monkeypatch, "--schemes", "int8", "--no-llamacpp", "--out", str(out),
                  "--markdown", str(doc), "--title", "Quant, A")
    assert "same key" in capsys.readouterr().err
    assert not out.exists()


def _first_turns(name: str) -> list[str]:
    rows = (ROOT / "examples" / "prompts" / name).read_text().splitlines()
    return [json.loads(x)["turns"][0] for x in rows if x.strip()]


def test_dev_prompts_are_distinct_and_too_many_is_refused():
    dev_first_turns = _script("quant_report").dev_first_turns
    distinct: list[str] = []  # the reference: every first turn once, in file order
    for t in _first_turns("dev.jsonl") + _first_turns("dev-extended.jsonl"):
        if t not in distinct:
            distinct.append(t)
    turns = dev_first_turns(10)
    assert len(set(turns)) == 10 and turns == distinct[:10]
    assert dev_first_turns(len(distinct)) == distinct
    for n in (0, len(distinct) + 1):
        with pytest.raises(ValueError, match=f"--prompts {n}: .* {len(distinct)} distinct"):
            dev_first_turns(n)


@pytest.mark.parametrize("name", ["quantization.json", "quantization-xeon.json"])
def test_shipped_reports_count_each_dev_prompt_once(name):
    """The shipped runs decoded dev_first_turns(10) before it dropped repeats; their agreement
    figures cover the distinct prompts only, recomputed from the greedy outputs they hold."""
    report = json.loads((ROOT / "docs" / "reports" / name).read_text())
    n = report["dev_prompts"]
    asked = _first_turns("dev.jsonl") + _first_turns("dev-extended.jsonl")
    assert len(set(asked[:n])) == n
    ref = report["results"]["fp32"]["greedy"][:n]
    for label, r in report["results"].items():
        assert r["agreement_with_fp32"] == greedy_agreement(r["greedy"][:n], ref), label


def test_benchmarks_page_renders_from_the_corrected_report(tmp_path):
    """docs/benchmarks.md's quantization section is what --from-json renders from its report,
    written by rename with no temporary file left beside it."""
    qr = _script("quant_report")
    page = ROOT / "docs" / "benchmarks.md"
    doc = tmp_path / "benchmarks.md"
    doc.write_text(page.read_text())
    qr.write_markdown(json.loads((ROOT / "docs/reports/quantization-xeon.json").read_text()), doc, XEON_TITLE)
    assert doc.read_text() == page.read_text()
    assert "on 7 distinct dev prompts" in doc.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmarks.md"]


def test_perplexity_of_nothing_is_refused():
    rt = TorchRuntime(tiny_llama(seed=5))
    ids = [1, 2, 3, 4, 5, 6]
    for texts, mask in (([ids], [[False] * len(ids)]), ([], None), ([[7]], None)):
        with pytest.raises(ValueError, match="no token scored"):
            perplexity(rt, texts, mask)
    assert perplexity(rt, [ids], None).tokens == len(ids) - 1


@pytest.mark.parametrize("flag, value", [("--heldout", "0"), ("--heldout", "-3"), ("--new-tokens", "0"),
                                         ("--max-seq", "1"), ("--threads", "0")])
def test_counts_below_their_least_are_refused_before_anything_loads(monkeypatch, capsys, tmp_path, flag, value):
    """``--heldout 0`` used to pass the checks, load the tokenizer and export fp32 before
    perplexity() refused the empty set; ``--threads 0`` ended in torch's traceback."""
    _no_load(monkeypatch)
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exc:
        _run_main(monkeypatch, "--schemes", "int8", "--no-llamacpp", "--out", str(out), flag, value)
    assert exc.value.code == 2
    assert f"{flag} {value}: give at least" in capsys.readouterr().err
    assert not out.exists()


def test_no_held_out_answer_within_max_seq_is_refused_before_any_export(monkeypatch, capsys):
    """Every conversation's answer past ``--max-seq``: refused once the tokenizer is loaded,
    before the first runtime is built."""
    import spec_plugins.models
    import spec_plugins.training.sources

    class Tokenizer:
        def apply_chat_template(self, *_a, **_k):
            raise AssertionError("went on past an empty held-out set")

    monkeypatch.setattr(spec_plugins.models, "load_gguf_tokenizer", lambda *_a, **_k: Tokenizer())
    monkeypatch.setattr(spec_plugins.training.sources, "sharegpt_examples", lambda *_a, **_k: iter(()))
    with pytest.raises(SystemExit) as exc:
        _run_main(monkeypatch, "--schemes", "int8", "--no-llamacpp", "--max-seq", "8")
    assert exc.value.code == 2
    assert "--max-seq 8: no held-out ShareGPT conversation" in capsys.readouterr().err


def test_from_json_refuses_a_clashing_title_or_a_bad_report_by_name(monkeypatch, capsys, tmp_path):
    """Both ended in a traceback; the page is left as it was, with nothing beside it."""
    doc, report = tmp_path / "b.md", tmp_path / "report.json"
    page = "<!-- bench:quant-a -->\n## Quant (A)\n<!-- /bench:quant-a -->\n"
    doc.write_text(page)
    report.write_text((ROOT / "docs/reports/quantization-xeon.json").read_text())
    for argv, says in (((str(report), "--title", "Quant, A"), "same key"),
                       ((str(tmp_path / "missing.json"),), "--from-json"),
                       ((str(doc),), f"--from-json {doc}")):  # not JSON
        with pytest.raises(SystemExit) as exc:
            _run_main(monkeypatch, "--from-json", argv[0], "--markdown", str(doc), *argv[1:])
        assert exc.value.code == 2 and says in capsys.readouterr().err
        assert doc.read_text() == page
        assert sorted(p.name for p in tmp_path.iterdir()) == ["b.md", "report.json"]


def test_a_failed_write_leaves_the_old_report_and_no_temporary_file(tmp_path):
    out = tmp_path / "report.json"
    out.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        _script("quant_report").write_atomic(out, "half \ud800")  # fails once its file is open
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def _write_report(path: Path, text: str) -> None:
    _script("quant_report").write_atomic(path, text)


def _write_page(path: Path, text: str) -> None:
    report = json.loads((ROOT / "docs/reports/quantization-xeon.json").read_text())
    _script("quant_report").write_markdown({**report, "note": text}, path, XEON_TITLE)


@pytest.mark.parametrize("write", [_write_report, _write_page], ids=["write_atomic", "write_markdown"])
def test_overlapping_runs_each_rename_their_own_file(monkeypatch, tmp_path, write):
    """Run B writes the same output while run A's file waits for its rename: each renames its
    own temporary file (one fixed name made A's rename fail), the last rename wins, nothing is
    left beside it, and the file has the mode a plain write gives."""
    out = tmp_path / "out.md"
    real = Path.replace
    calls = []

    def replace(self: Path, target: Path | str) -> Path:
        calls.append(self)
        if len(calls) == 1:  # run A's rename: run B first, start to end
            write(out, "run B")
        return real(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    write(out, "run A")
    assert "run A" in out.read_text() and "run B" not in out.read_text()
    assert calls[0] != calls[1]
    reference = tmp_path / "plain"
    reference.write_text("")
    assert out.stat().st_mode == reference.stat().st_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.md", "plain"]


def test_a_page_written_from_nothing_starts_with_its_header(tmp_path):
    """A new page gets ``update``'s header, as before the temporary file had a unique name."""
    doc = tmp_path / "new.md"
    _write_page(doc, "first")
    assert doc.read_text().startswith("# Benchmarks\n") and "Note: first" in doc.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.md"]
