"""``spec-plugins tune`` (round 17): a runtime package that is installed but fails to import
(llama-cpp-python whose shared library does not load raises RuntimeError) crashed tune with a
traceback, throwing away every runtime already measured: on the default list it is left out with
its reason, named in --runtimes it is refused before anything is measured. A prompt too long for
the context was reported as "request 0" whichever it was: it is named by its question_id."""

from __future__ import annotations

import sys

import pytest
from test_tune import _prompts
from test_tune_round13 import _tiny

from spec_plugins.tune import Budget, TuneError, check_choices, tune

FAILURES = {  # what a broken install raises on import, as its package's own code raises it
    "RuntimeError": "raise RuntimeError(\"Failed to load shared library '/x/libllama.so': libggml-base.so: "
                    "cannot open shared object file\")",
    "OSError": "raise OSError('libonnxruntime.so.1: cannot open shared object file')",
    "ImportError": "raise ImportError('DLL load failed while importing onnxruntime_pybind11_state')",
    # a library built for another version: ctypes binding a symbol it lacks
    "AttributeError": "raise AttributeError('/x/libllama.so: undefined symbol: llama_max_devices')",
}


def _broken(tmp_path, monkeypatch, package: str, failure: str = "RuntimeError") -> None:
    """A real ``package`` first on sys.path whose import raises ``failure``; the installed one (and
    its submodules) dropped from sys.modules for the test, so importing it runs the broken one."""
    root = tmp_path / "broken"
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(FAILURES[failure] + "\n")
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("tune17") / "tiny-model")


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_package_that_fails_to_import_is_refused_with_its_reason(tmp_path, monkeypatch, failure):
    _broken(tmp_path, monkeypatch, "llama_cpp", failure)
    with pytest.raises(TuneError, match=f"runtime 'llamacpp' is installed but its package llama_cpp fails to "
                                        f"import \\({failure}: "):
        check_choices(["llamacpp"], ["ngram"])


def test_a_named_runtime_that_fails_to_import_is_an_error_before_anything_is_measured(tiny_dir, tmp_path,
                                                                                      monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    _broken(tmp_path, monkeypatch, "onnxruntime")
    out = tmp_path / "t.yaml"
    r = CliRunner().invoke(app, ["tune", "--model", str(tiny_dir), "--prompts", str(_prompts(tmp_path)),
                                 "--runtimes", "torch,onnxruntime", "--proposers", "ngram", "--max-new-tokens", "8",
                                 "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert ("error: runtime 'onnxruntime' is installed but its package onnxruntime fails to import (RuntimeError: "
            "Failed to load shared library") in r.output
    assert "[tune] torch" not in r.output and not out.exists()


def test_a_default_runtime_that_fails_to_import_is_left_out_with_its_reason(tiny_dir, tmp_path, monkeypatch):
    import yaml

    from typer.testing import CliRunner

    from spec_plugins.cli import app
    from spec_plugins.config import SpecConfig

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    _broken(tmp_path, monkeypatch, "onnxruntime")
    out = tmp_path / "t.yaml"
    r = CliRunner().invoke(app, ["tune", "--model", str(tiny_dir), "--prompts", str(_prompts(tmp_path)),
                                 "--proposers", "ngram", "--max-new-tokens", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    for rt in ("onnxruntime", "onnxruntime-int8", "onnxruntime-int4"):
        why = f"runtime {rt} left out: it is installed but its package onnxruntime fails to import (RuntimeError: "
        assert why in r.output and f"# note: {why}" in text
    assert SpecConfig.parse(yaml.safe_load(text)).target.backend == "torch"


def test_a_prompt_too_long_for_the_context_is_named(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    d = _tiny(tmp_path / "short", max_pos=32)
    prompts = tmp_path / "p.jsonl"
    long = " ".join(["w1 w2 w3"] * 9)  # 27 tokens: with 8 new ones past the 32 positions
    prompts.write_text('{"question_id": "short", "turns": ["w1 w2 w3 w1 w2 w3"]}\n'
                       f'{{"question_id": "long-one", "turns": ["{long}"]}}\n')
    out = tmp_path / "t.yaml"
    r = CliRunner().invoke(app, ["tune", "--model", str(d), "--prompts", str(prompts), "--runtimes", "torch",
                                 "--proposers", "ngram", "--max-new-tokens", "8", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert (f"error: {prompts}: question_id 'long-one': a prompt of 27 tokens plus --max-new-tokens 8 runs past "
            "the context of 32 positions on runtime torch") in r.output
    assert "request 0" not in r.output and not out.exists()
    with pytest.raises(TuneError, match=r"^prompts\[1\]: a prompt of 27 tokens"):  # called without names
        tune(str(d), ["w1 w2 w3", long], ["torch"], ["ngram"], Budget(600), max_new=8, log=lambda m: None)


def test_the_warm_up_stays_within_max_new_tokens(tmp_path, monkeypatch):
    """The warm-up decoded 8 tokens of the first prompt whatever ``max_new`` was: a prompt that fits
    with its own 4 new tokens failed as "request 0" (Python API; the CLI's least is 8)."""
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    d = _tiny(tmp_path / "short", max_pos=32)
    near_full = " ".join(["w1 w2 w3 w4"] * 7)  # 28 tokens: 4 new ones fill the 32 positions
    result = tune(str(d), [near_full, "w1 w2 w3"], ["torch"], ["ngram"], Budget(600), max_new=4,
                  log=lambda m: None)
    assert result is not None
