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
