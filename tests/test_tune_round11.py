"""``spec-plugins tune``: when every default runtime is left out there is nothing to measure, a
TuneError names each runtime and why (it was ``max() arg is an empty sequence``); a runtime or
proposer named twice is refused before anything loads (it was measured twice and its candidates
listed twice, wrong numbers beside the copies)."""

from __future__ import annotations

import pytest
from test_tune import _prompts

import spec_plugins.tune as tune_module
from spec_plugins.tune import Budget, TuneError, check_choices, tune


def _no_model_loads(monkeypatch) -> None:
    """Every runtime the test reaches refuses the model when built, as a directory no runtime
    can load does (``tune`` leaves such a default runtime out with its reason)."""
    def refuse(model, rt, proposer, *args, **kwargs):
        raise ValueError(f"{rt} cannot read this model")

    monkeypatch.setattr(tune_module, "_decoder", refuse)
    monkeypatch.setattr(tune_module, "default_runtimes", lambda model: (
        ["torch", "onnxruntime"], {"llamacpp": "is not installed: pip install -e '.[llamacpp]'"}))


def test_every_default_runtime_left_out_is_a_tune_error_naming_each(monkeypatch, tmp_path):
    _no_model_loads(monkeypatch)
    logs: list[str] = []
    with pytest.raises(TuneError) as err:
        tune(str(tmp_path), ["w1 w2"], None, ["ngram"], Budget(600), max_new=8, log=logs.append)
    msg = str(err.value)
    assert msg.startswith(f"no runtime can run {str(tmp_path)!r} here")
    for why in ("llamacpp left out: it is not installed: pip install -e '.[llamacpp]'",
                "torch left out: torch cannot read this model",
                "onnxruntime left out: onnxruntime cannot read this model"):
        assert why in msg
    assert "[tune] runtime torch left out: torch cannot read this model" in logs


def test_the_cli_says_no_runtime_can_run_the_model_and_writes_nothing(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    _no_model_loads(monkeypatch)
    out = tmp_path / "t.yaml"
    r = CliRunner().invoke(app, ["tune", "--model", str(tmp_path), "--prompts", str(_prompts(tmp_path)),
                                 "--proposers", "ngram", "--max-new-tokens", "8", "--out", str(out)])
    assert r.exit_code == 2 and "error: no runtime can run" in r.output, r.output
    assert "max() arg" not in r.output and "torch left out: torch cannot read this model" in r.output
    assert not out.exists()


@pytest.mark.parametrize(("runtimes", "proposers", "message"), [
    (["torch", "torch"], ["ngram"], "runtime 'torch' is named more than once"),
    (["torch", "onnxruntime", "torch"], ["ngram"], "runtime 'torch' is named more than once"),
    (["torch"], ["ngram", "suffix", "ngram"], "proposer 'ngram' is named more than once"),
])
def test_a_name_given_twice_is_refused(runtimes, proposers, message):
    with pytest.raises(TuneError, match=message):
        check_choices(runtimes, proposers)


def test_tune_refuses_a_repeat_before_any_model_loads(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    def load(model, rt, *args, **kwargs):
        raise AssertionError(f"runtime {rt} loaded before the names were checked")

    monkeypatch.setattr(tune_module, "_decoder", load)
    with pytest.raises(TuneError, match="proposer 'ngram' is named more than once; name each proposer once"):
        tune(str(tmp_path), ["w1 w2"], ["torch"], ["ngram", "ngram"], Budget(600), max_new=8, log=lambda m: None)
    out = tmp_path / "t.yaml"
    r = CliRunner().invoke(app, ["tune", "--model", str(tmp_path), "--prompts", str(_prompts(tmp_path)),
                                 "--runtimes", "torch,torch", "--proposers", "ngram", "--out", str(out)])
    assert r.exit_code == 2 and "runtime 'torch' is named more than once" in r.output, r.output
    assert not out.exists()
