"""The CLI refuses what the server refuses (non-finite numbers, ``max_new_tokens`` 0, an empty
prompt) and checks ``tune --out`` before anything loads or is measured: each case exits 2 with
a message naming the flag, and the model loader / the tuner is never reached."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from spec_plugins.cli import app


@pytest.fixture
def nothing_runs(monkeypatch):
    """Loading a model or tuning fails the test: the command must stop before."""
    import spec_plugins.tune
    from spec_plugins.decoder import SpeculativeDecoder

    def boom(*a, **kw):
        raise AssertionError("reached model loading / measuring")

    monkeypatch.setattr(SpeculativeDecoder, "from_config", boom)
    monkeypatch.setattr(spec_plugins.tune, "tune", boom)


def run(args: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(app, args)
    return res.exit_code, res.output


@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt", "hi", "--temperature", "inf"], "--temperature inf: give a finite number"),
    (["generate", "--prompt", "hi", "-n", "0"], "-n"),
    (["generate", "--prompt", ""], "--prompt cannot be empty"),
    (["serve", "--shutdown-timeout", "inf", "--port", "0"], "--shutdown-timeout inf: give a finite number"),
    (["serve", "--body-timeout", "inf", "--port", "0"], "--body-timeout inf: give a finite number"),
    # Ray Serve's replica flags without --ray started a local server as if they were not given
    (["serve", "--replicas", "3", "--num-gpus", "1", "--port", "0"], "--replicas, --num-gpus configure Ray Serve"),
    (["serve", "--ray-address", "ray://head:10001", "--port", "0"], "--ray-address configure Ray Serve"),
    (["serve", "--autoscale", "2:8", "--num-cpus", "2", "--port", "0"], "--autoscale, --num-cpus configure Ray"),
])
def test_generate_and_serve_refuse_before_loading(nothing_runs, args, msg):
    code, out = run(args)
    assert code == 2 and msg in out, out


@pytest.mark.parametrize("budget,msg", [("nan", "must be a positive, finite time"),
                                        ("inf", "must be a positive, finite time"),
                                        ("1e99h", "at most 168 h"), ("-5m", "must be a positive, finite time")])
def test_tune_refuses_non_finite_and_absurd_budgets(nothing_runs, tmp_path, budget, msg):
    code, out = run(["tune", "--budget", budget, "--limit", "1", "--out", str(tmp_path / "t.yaml")])
    assert code == 2 and msg in out, out


def test_tune_checks_out_before_measuring(nothing_runs, tmp_path):
    code, out = run(["tune", "--budget", "1s", "--limit", "1", "--out", str(tmp_path)])
    assert code == 2 and "is a directory; give a file name" in out, out
    code, out = run(["tune", "--budget", "1s", "--out", str(tmp_path / "missing" / "t.yaml")])
    assert code == 2 and "does not exist" in out, out


def test_generate_refuses_a_bad_grammar_option_before_loading(nothing_runs, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    good = tmp_path / "schema.json"
    good.write_text('{"type": "object"}')
    for args, msg in [(["--json-schema", str(tmp_path / "missing.json")], "missing.json"),
                      (["--json-schema", str(bad)], "bad.json: Expecting property name"),
                      (["--json-schema", str(good), "--regex", "a+"], "not both"),
                      (["--regex", ""], "--regex cannot be empty")]:
        code, out = run(["generate", "--prompt", "hi"] + args)
        assert code == 2 and msg in out, out


def test_unreadable_option_files_are_errors_naming_the_file_not_tracebacks(nothing_runs, tmp_path):
    """A malformed ``--methods`` YAML and a ``--json-schema`` file that is not UTF-8 exit 2 with
    ``error: ...`` naming the file (and the line, where YAML knows it), before any model loads."""
    methods = tmp_path / "methods.yaml"
    methods.write_text("a: [1, 2\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"type": "string", "description": "\xe9"}')
    for args, msg in [(["bench", "--prompts", str(prompts), "--methods", str(methods), "--out", str(tmp_path / "o")],
                       f"error: --methods {methods} cannot be read (line 2, column 1)"),
                      (["generate", "--prompt", "hi", "--json-schema", str(latin1)],
                       f"error: --json-schema {latin1}: not UTF-8 (byte 0xe9 at offset 35)")]:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.exception
        assert msg in res.output.replace("\n", ""), res.output


@pytest.mark.parametrize("module", ["spec_plugins.cli", "spec_plugins"])
def test_python_dash_m_runs_every_subcommand(module):
    """``python -m spec_plugins.cli tune`` said "No such command": the subcommands add themselves to
    ``spec_plugins.cli.app``, not to the ``__main__`` copy that ran; ``python -m spec_plugins`` works too."""
    import os
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", module, "tune", "--help"], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert res.returncode == 0 and "--budget" in res.stdout, res.stdout + res.stderr


def test_a_list_for_a_plugin_name_is_an_error_not_a_traceback(nothing_runs, tmp_path):
    """``type: [ngram]`` in a config was a raw ``TypeError: unhashable type``: exit 2, naming the field."""
    config = tmp_path / "c.yaml"
    config.write_text("target: {backend: torch, model: x}\nproposer:\n  type: [ngram]\n")
    res = CliRunner().invoke(app, ["generate", "-c", str(config), "-p", "hi"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.exception
    assert "proposer: type must be a proposer name (a string), got list" in res.output.replace("\n", ""), res.output
