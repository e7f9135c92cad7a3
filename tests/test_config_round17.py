"""Config and environment inputs, round 17: a CUDA device on a host without one is one ``error:``
line naming the device field (torch and onnxruntime); a cache root that is a file warns and the
load goes on; an empty ``SPEC_PLUGINS_CACHE`` counts as unset (not the working directory); torch
and onnxruntime threads are capped where llama.cpp's are; a .json config with a UTF-8 BOM loads."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from test_tune import tiny_dir  # noqa: F401 - fixture
from typer.testing import CliRunner

from spec_plugins.backends.llamacpp_config import MAX_THREADS
from spec_plugins.cli import app
from spec_plugins.config import ConfigError, SpecConfig
from spec_plugins.models import cache_root, write_cache_dir

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: device: cuda is not refused")
NO_CUDA_LINE = "error: device: 'cuda' needs a CUDA device, but torch sees none on this host; set device: cpu (or auto)"


def _cuda_config(tmp_path: Path, model: Path) -> Path:
    cfg = tmp_path / "cuda.yaml"
    cfg.write_text(yaml.safe_dump({"target": {"backend": "torch", "model": str(model), "device": "cuda"}}))
    return cfg


def _error_lines(res) -> list[str]:
    return [ln for ln in res.output.splitlines() if ln.startswith("error:")]


@no_cuda
def test_generate_with_device_cuda_and_no_cuda_is_one_error_line(tiny_dir, tmp_path):  # noqa: F811
    res = CliRunner().invoke(app, ["generate", "-p", "w1 w2", "-n", "2", "-c", str(_cuda_config(tmp_path, tiny_dir))])
    assert res.exit_code == 2, (res.output, res.exception)  # was 1, a RuntimeError traceback
    assert _error_lines(res) == [NO_CUDA_LINE], res.output


@no_cuda
def test_serve_with_device_cuda_and_no_cuda_is_one_error_line(tiny_dir, tmp_path):  # noqa: F811
    pytest.importorskip("spec_plugins.server.app")
    res = CliRunner().invoke(app, ["serve", "-c", str(_cuda_config(tmp_path, tiny_dir)), "--port", "0"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert _error_lines(res) == [NO_CUDA_LINE], res.output


@no_cuda
def test_onnxruntime_device_cuda_without_cuda_names_the_field(tmp_path):
    """Refused before ONNX Runtime's providers are asked (a CPU onnxruntime's RuntimeError was first)."""
    pytest.importorskip("onnxruntime")
    from spec_plugins.backends.onnxruntime_runtime import create_session

    with pytest.raises(ValueError, match=r"^device: 'cuda' needs a CUDA device"):
        create_session(tmp_path / "verify.onnx", "cuda")


def test_cache_root_that_is_a_file_warns_and_writes_nothing(tmp_path, monkeypatch):
    """A cache is an optimisation: the loaded model is still returned (was NotADirectoryError)."""
    root = tmp_path / "afile"
    root.write_text("x\n")
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(root))
    written = []
    target = cache_root() / "tokenizers" / "m"
    with pytest.warns(UserWarning, match=rf"could not cache {target}: .*Not a directory"):
        write_cache_dir(target, written.append)
    assert written == [] and root.read_text() == "x\n"


def test_write_cache_dir_still_writes_where_it_can(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "cache"))
    target = cache_root() / "tokenizers" / "m"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_cache_dir(target, lambda d: (d / "tokenizer_config.json").write_text("{}"))
    assert [p.name for p in target.parent.iterdir()] == ["m"]  # no temporary directory left beside it
    assert (target / "tokenizer_config.json").read_text() == "{}"


def test_empty_cache_variable_is_unset(tmp_path, monkeypatch):
    """``SPEC_PLUGINS_CACHE=`` read as ``Path("")`` put a 517 MB converted model in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", "")
    assert cache_root() == tmp_path / ".cache" / "spec-plugins"
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_threads_past_any_cpu_are_refused_at_parse_time(backend):
    """torch.set_num_threads(10**12) failed at load with "Overflow when unpacking long", naming no field."""
    cfg = {"target": {"backend": backend, "model": "m", "threads": 10**12}}
    with pytest.raises(ConfigError, match=rf"threads.*less than or equal to {MAX_THREADS}"):
        SpecConfig.parse(cfg)
    cfg["target"]["threads"] = MAX_THREADS
    assert SpecConfig.parse(cfg).target.threads == MAX_THREADS


def test_json_config_with_a_bom_loads_as_yaml_does(tmp_path):
    data = {"target": {"backend": "torch", "model": "m"}, "proposer": {"type": "ngram", "num_draft_tokens": 3}}
    for name in ("bom.json", "bom.yaml", "bom"):  # the suffix, the YAML reader, the JSON sniffing (a pipe)
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + json.dumps(data).encode())
        cfg = SpecConfig.from_file(path)
        assert (cfg.target.model, cfg.proposer.num_draft_tokens) == ("m", 3), name


# ---- review follow-ups: every device kind, the caches a run needs, every thread count --------------
@pytest.mark.parametrize("device, named", [
    ("meta", "holds no data"),
    ("mps", "has no mps device on this host"),
    ("xpu", "has no xpu device on this host"),
])
def test_a_device_this_host_cannot_run_is_named(device, named):
    """mps/xpu/meta were torch's own RuntimeError/AssertionError tracebacks at load."""
    from spec_plugins.backends.torch_runtime import _available, pick_device

    if device != "meta" and _available(device):
        pytest.skip(f"this host has {device}")
    with pytest.raises(ValueError, match=rf"^device: '{device}'.*{named}"):
        pick_device(device)


def test_a_cache_root_that_is_a_file_is_named_where_a_run_needs_the_cache(tmp_path, monkeypatch):
    """The ONNX export cache was a bare NotADirectoryError (no path, exit 1) after the target loaded."""
    from spec_plugins.backends.onnx_cache import export_cache_dir
    from spec_plugins.models import cache_dir

    root = tmp_path / "afile"
    root.write_text("x\n")
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(root))
    with pytest.raises(ValueError, match=rf"cache directory {root} \(SPEC_PLUGINS_CACHE.*is not a directory"):
        cache_dir("onnx-heads", "h", "head.onnx")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0")
    with pytest.raises(ValueError, match="is not a directory"):
        export_cache_dir(str(model))
    assert root.read_text() == "x\n"
    # a root under a file, and a subfolder that is a file (the root itself fine)
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(root / "sub"))
    with pytest.raises(ValueError, match=rf"cannot hold onnx-heads/h/head.onnx: {root} is not a directory"):
        cache_dir("onnx-heads", "h", "head.onnx")
    good = tmp_path / "cache"
    (good / "onnx-heads").parent.mkdir()
    (good / "onnx-heads").write_text("x\n")
    monkeypatch.setenv("SPEC_PLUGINS_CACHE", str(good))
    with pytest.raises(ValueError, match=rf"{good / 'onnx-heads'} is not a directory"):
        cache_dir("onnx-heads", "h", "head.onnx")
    assert cache_dir("onnx", "m") == good / "onnx" / "m"  # a path not made yet is fine


def test_thread_counts_past_any_cpu_are_refused_by_the_ray_options_and_the_train_cli(tmp_path):
    from spec_plugins.server.ray_serve import ReplicaOptions

    with pytest.raises(ValueError, match=rf"options.threads must be <= {MAX_THREADS}, got {10**12}"):
        ReplicaOptions({"target": {"model": "m"}}, threads=10**12)
    assert ReplicaOptions({"target": {"model": "m"}}, threads=MAX_THREADS).threads == MAX_THREADS
    r = CliRunner().invoke(app, ["train", "features", "--threads", str(10**12), "--out", str(tmp_path / "f")])
    assert r.exit_code == 2 and "--threads" in r.output, r.output
    import spec_plugins.exporters.cli  # noqa: F401 - registers `export`

    r = CliRunner().invoke(app, ["export", "check", "--threads", str(10**12), str(tmp_path / "none")])
    assert r.exit_code == 2 and "Invalid value for '--threads'" in r.output, r.output
