"""Config files written and read back: ``tune --out`` and ``serve --write-config`` keep the old
file whole when the write fails (a full disk) and say so in one line; ``tune --out x.json`` writes
JSON, as a .json config is read; a recycling section dumped with every default loads back; a
config with ``num_draft_tokens: 0`` benches with the drafting peers reported as skipped."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from test_bench import PROMPTS, tiny_decoder
from test_tune import tiny_dir  # noqa: F401 - fixture
from typer.testing import CliRunner

from spec_plugins.bench import BenchOptions, run_bench
from spec_plugins.cli import app
from spec_plugins.config import ConfigError, SpecConfig

OLD = "# the previous tuned config\ntarget: {backend: torch, model: old}\n"


def _tuned(monkeypatch: Any, model: str) -> dict:
    """``tune`` replaced by a finished result (no model loads): the CLI's write is under test."""
    import spec_plugins.tune as tune_module
    from spec_plugins.tune import Measured, TuneResult

    config = {"target": {"backend": "torch", "model": model, "dtype": "float32"},
              "proposer": {"type": "ngram", "num_draft_tokens": 3}, "verifier": {"type": "exact"}}
    chosen = Measured("torch+ngram", "torch", "ngram", 3, 120.0, predicted=110.0)
    plain = Measured("plain@torch", "torch", None, None, 100.0)
    runtimes = {"torch": {"plain_tokens_per_s": 100.0, "t1_ms": 1.0, "cost_relative": [1.0, 1.1]}}
    res = TuneResult(chosen, plain, [chosen], runtimes, config, 1.0)
    monkeypatch.setattr(tune_module, "tune", lambda *a, **k: res)
    return config


def _tune_args(tmp_path: Path, out: Path) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2 w3"}) + "\n")
    return ["tune", "--model", "m", "--prompts", str(prompts), "--runtimes", "torch", "--proposers", "ngram",
            "--out", str(out)]


def _invoke_past(limit: int, args: list[str]) -> Any:
    """The CLI run with files limited to ``limit`` bytes (a full disk, for this process; Python
    ignores SIGXFSZ, so a write past it raises OSError)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        return CliRunner().invoke(app, args)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)


def _check_kept(res: Any, out: Path, flag: str, after: Callable[[], None] = lambda: None) -> None:
    assert res.exit_code == 2, (res.output, res.exception)  # was 1, an OSError traceback
    lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: {flag} {out}: cannot write it (File too large)"], res.output
    assert out.read_text() == OLD  # was cut at the limit
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")] == []  # no temp file


def test_tune_failed_write_keeps_the_old_config(tmp_path, monkeypatch):
    _tuned(monkeypatch, "m")
    out = tmp_path / "tuned.yaml"
    out.write_text(OLD)
    _check_kept(_invoke_past(len(OLD) + 40, _tune_args(tmp_path, out)), out, "--out")


def test_serve_write_config_failed_write_keeps_the_old_file(tmp_path):
    pytest.importorskip("spec_plugins.server.connections")
    cfg = tmp_path / "spec.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": "m"}, "proposer": {"type": "ngram"}}))
    out = tmp_path / "serve.yaml"
    out.write_text(OLD)
    res = _invoke_past(len(OLD) + 40, ["serve", "--ray", "-c", str(cfg), "--write-config", str(out)])
    _check_kept(res, out, "--write-config")


def test_tune_json_out_is_json_the_suggested_generate_reads(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    """A .json config is parsed as JSON (``config.load_file``): YAML with comments was refused by
    the ``generate --config`` command tune suggests."""
    config = _tuned(monkeypatch, str(tiny_dir))
    out = tmp_path / "tuned.JSON"
    res = CliRunner().invoke(app, _tune_args(tmp_path, out))
    assert res.exit_code == 0, (res.output, res.exception)
    assert json.loads(out.read_text()) == config
    assert SpecConfig.from_file(out) == SpecConfig.parse(config)
    gen = CliRunner().invoke(app, ["generate", "--config", str(out), "--prompt", "w1 w2 w1", "-n", "3", "--raw"])
    assert gen.exit_code == 0, (gen.output, gen.exception)
    # a YAML name still gets the measurements as comments
    yml = tmp_path / "tuned.yaml"
    assert CliRunner().invoke(app, _tune_args(tmp_path, yml)).exit_code == 0
    assert yml.read_text().startswith("# written by: spec-plugins tune")
    assert yaml.safe_load(yml.read_text()) == config


@pytest.mark.parametrize("section", [{"type": "recycling", "candidates": 1},
                                     {"type": "recycling", "num_draft_tokens": 1}])
def test_a_full_dump_of_a_recycling_section_loads_back(tmp_path, section):
    """Every field at its default, as a dumped config carries them: the default ``tree_size`` is a
    cap, not a size the user asked for, so it is not checked against the tree's reach."""
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "x"}, "proposer": section})
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    back = SpecConfig.from_file(dumped)
    assert back.proposer.model_dump() == cfg.proposer.model_dump()
    # a size asked for that the tree cannot hold is still refused
    with pytest.raises(ConfigError, match="tree_size=13 cannot be reached"):
        SpecConfig.parse({"target": {"backend": "torch", "model": "x"}, "proposer": {**section, "tree_size": 13}})


def _bench_k0(**kw: Any) -> dict:
    dec, _ = tiny_decoder(k=0)
    opts = BenchOptions(max_new_tokens=6, runs=1, gammas=[], auto=False, baselines=["plain", "transformers"],
                        warmup=False, progress=False, cost_positions=4, **kw)
    return run_bench(dec, PROMPTS[1:], opts)


def test_bench_num_draft_tokens_0_skips_drafting_peers_naming_baseline_gamma():
    """Peers got draft length 0, and transformers refused it in its first decode, ending the run
    ("Invalid max_matching_ngram_size or num_output_tokens")."""
    report = _bench_k0()
    why = report["unavailable_baselines"]["transformers"]
    assert "num_draft_tokens is 0" in why and "--baseline-gamma" in why
    assert [m["name"] for m in report["methods"]] == ["plain", "ours_k0"]
    # with --baseline-gamma the peer runs, with that draft length
    ran = {m["name"]: m["gamma"] for m in _bench_k0(baseline_gamma=2)["methods"]}
    assert ran["transformers"] == 2


def test_an_output_that_is_not_a_regular_file_is_written_as_it_stands(tmp_path):
    """``--out /dev/stdout`` or a pipe: written through, not replaced by a renamed temporary file."""
    import os
    import stat

    from spec_plugins.files import write_text_atomic

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the write does not block
    try:
        write_text_atomic(fifo, "model: m\n")
        assert os.read(reader, 100) == b"model: m\n"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.mark.skipif(not Path("/dev/stdout").exists(), reason="no /dev/stdout on this system")
def test_dev_stdout_is_written_as_a_stream_piped_or_redirected(tmp_path):
    """``--out /dev/stdout`` resolves to a pipe or to the file stdout was redirected to: written
    through, after what the stream already carried (not renamed over a redirected file)."""
    import subprocess
    import sys

    code = ("from spec_plugins.files import write_text_atomic\n"
            "print('before', flush=True)\n"
            "write_text_atomic('/dev/stdout', 'model: m\\n')\n")
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert piped.stdout == "before\nmodel: m\n"
    out = tmp_path / "o.txt"
    with out.open("w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, check=True)
    assert out.read_text() == "before\nmodel: m\n"
