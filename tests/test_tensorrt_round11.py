"""Round 11: the engine manifest checked field by field, the engine directory's mode, the
``--workspace-gib`` and runtime ``max_context`` checks, and a failed build's parent directories.
TensorRT is faked as in tests/test_tensorrt.py (``_fake_trt11``); nothing here needs a GPU."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
from types import SimpleNamespace

import pytest
import torch
from test_tensorrt import ENV, _fake_trt11, _manifest, exported  # noqa: F401  (exported: a fixture)

from spec_plugins.graphs.engines import BuildEnv, EngineManifest, EngineManifestError


@pytest.fixture
def fake_trt(monkeypatch):
    """The builder over ``_fake_trt11``: no GPU, a made-up one reported (as the existing tests do)."""
    import spec_plugins.backends.tensorrt_runtime as trt_runtime

    trt = _fake_trt11()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_runtime, "cuda_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(BuildEnv, "current", classmethod(lambda cls, device=0: cls(trt.__version__, "GPU", (9, 0))))
    return trt


def _cli(*args: str):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    return CliRunner().invoke(app, ["export", "tensorrt", *args])


# ---- 1, 2: EngineManifest.read checks every field, nested ones too, and the tokenizer ----------
def _set(path: tuple, value):
    def edit(d: dict) -> None:
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


def _drop(path: tuple):
    def edit(d: dict) -> None:
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_drop(("engines", 0, "model", "vocab_size")), r"engines\[0\] \('verify'\) model lacks field\(s\) vocab_size"),
    (_drop(("engines", 0, "profiles", 0, "ranges")),
     r"engines\[0\] \('verify'\) profiles\[0\] lacks field\(s\) ranges"),
    (_set(("engines", 0, "profiles"), 3), r"field profiles: input should be a valid list"),
    (_set(("eos_token_ids",), "12"), r"field eos_token_ids: input should be a valid list"),
    (_set(("limits", "max_context"), 64.5), r"limits field max_context: input should be a valid integer"),
    (_set(("engines",), {"verify": 1}), r"engines must be a list of objects"),
    (_set(("engines", 0, "model", "max_context"), "256"), r"model field max_context: input should be a valid integer"),
    (_set(("engines", 0, "model", "vocab_size"), 0), r"model vocab_size is 0"),
    (_set(("engines", 0, "model", "layers"), 2), r"model has unknown field\(s\) layers"),
    (_drop(("engines", 0, "inputs", 0, "shape")), r"inputs\[0\] lacks field\(s\) shape"),
    (_set(("engines", 0, "profiles", 0, "ranges", "N"), [1, 5]), r"range N is \[1, 5\]"),
    (_set(("engines", 0, "profiles", 0, "ranges", "N"), [5, 1, 5]), r"range N is \[5, 1, 5\]"),
    (_drop(("engines", 0, "profiles", 0, "ranges", "N")), r"ranges cover B, P, T"),
    (_set(("engines", 0, "profiles"), []), r"lists no profiles"),
    (_set(("built_with", "compute_capability"), [9]), r"compute_capability must be \[major, minor\]"),
    (_drop(("built_with", "gpu_name")), r"built_with lacks field\(s\) gpu_name"),
    (_set(("engines", 0, "size_bytes"), True), r"field size_bytes: input should be a valid integer"),
])
def test_malformed_engine_manifest_refused_naming_the_field(tmp_path, edit, needle):
    _manifest(tmp_path)
    path = tmp_path / "tensorrt_manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(EngineManifestError, match=needle):
        EngineManifest.read(tmp_path)


def test_engine_manifest_tokenizer_must_exist(tmp_path):
    """As ``Manifest.read`` refuses an ONNX export naming a missing tokenizer directory."""
    man = _manifest(tmp_path)
    man.tokenizer = "tokenizer"
    man.write(tmp_path)
    with pytest.raises(EngineManifestError, match="tokenizer 'tokenizer' names a directory that does not exist"):
        EngineManifest.read(tmp_path)
    (tmp_path / "tokenizer").mkdir()
    assert EngineManifest.read(tmp_path) == man


# ---- 5, 6, 8: the builder ---------------------------------------------------------------------
def test_engine_directory_has_the_onnx_exports_mode(exported, tmp_path, fake_trt):  # noqa: F811
    from spec_plugins.exporters.tensorrt_build import build_engines

    from spec_plugins.graphs.profiles import Limits

    _, onnx_dir = exported
    em = build_engines(onnx_dir, tmp_path / "engines", limits=Limits(max_context=64, prefill_chunk=16))
    mode = stat.S_IMODE(os.stat(tmp_path / "engines").st_mode)
    assert mode == stat.S_IMODE(os.stat(onnx_dir).st_mode) == 0o755
    assert EngineManifest.read(tmp_path / "engines") == em  # what the builder writes passes the checks


@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf", "1e-12"])
def test_workspace_gib_must_be_finite_and_positive_before_anything_loads(tmp_path, value):
    """Checked before the ONNX export is read: a missing --onnx is not what the error names."""
    out = tmp_path / "engines"
    res = _cli("--onnx", str(tmp_path / "no-export"), "--out", str(out), "--workspace-gib", value)
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert f"--workspace-gib {float(value)}: give a finite workspace size above 0" in res.output, res.output
    assert not out.exists()


def test_workspace_gib_reaches_tensorrt_in_bytes_and_the_api_checks_it(exported, tmp_path, fake_trt,  # noqa: F811
                                                                       monkeypatch):
    from spec_plugins.exporters.tensorrt_build import build_engines

    _, onnx_dir = exported
    pools: list = []
    builder = fake_trt.Builder

    def with_pools(logger):
        b = builder(logger)
        make = b.create_builder_config
        b.create_builder_config = lambda: SimpleNamespace(**vars(make()),
                                                          set_memory_pool_limit=lambda *a: pools.append(a))
        return b

    monkeypatch.setattr(fake_trt, "Builder", with_pools)
    monkeypatch.setattr(fake_trt, "MemoryPoolType", SimpleNamespace(WORKSPACE="WORKSPACE"), raising=False)
    res = _cli("--onnx", str(onnx_dir), "--out", str(tmp_path / "e"), "--max-context", "64", "--workspace-gib", "1.5")
    assert res.exit_code == 0, res.output
    assert pools == [("WORKSPACE", 3 * 2**29)]
    with pytest.raises(ValueError, match="--workspace-gib -1"):
        build_engines(onnx_dir, tmp_path / "f", workspace_gib=-1)
    assert not (tmp_path / "f").exists()


def test_failed_build_removes_the_parents_it_created(exported, tmp_path, fake_trt, monkeypatch):  # noqa: F811
    """Only those it made: a parent that was there before stays, with what it held."""
    _, onnx_dir = exported
    monkeypatch.setattr(fake_trt, "OnnxParser", lambda network, logger: SimpleNamespace(
        num_errors=1, get_error=lambda i: "unsupported op", parse_from_file=lambda f: False))
    res = _cli("--onnx", str(onnx_dir), "--out", str(tmp_path / "new" / "a" / "engines"), "--max-context", "64")
    assert res.exit_code == 2 and "unsupported op" in res.output, res.output
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("x")
    res = _cli("--onnx", str(onnx_dir), "--out", str(tmp_path / "old" / "b" / "engines"), "--max-context", "64")
    assert res.exit_code == 2, res.output
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["keep.txt"]


# ---- 7: the runtime refuses a max_context above the engine's ------------------------------------
def _fake_runtime(monkeypatch, man: EngineManifest) -> list:
    """``TensorRTRuntime.from_config`` runnable on the CPU: an engine whose I/O is the manifest's,
    no CUDA streams; returns the list of plans handed to TensorRT to deserialise."""
    import spec_plugins.backends.tensorrt_runtime as rt

    entry = man.engine("verify")
    dtypes = {t["name"]: t["dtype"] for t in entry.inputs + entry.outputs}
    names, ins = list(dtypes), {t["name"] for t in entry.inputs}
    trt_names = {"float32": "FLOAT", "int64": "INT64"}
    engine = SimpleNamespace(num_optimization_profiles=len(entry.profiles), num_io_tensors=len(names),
                             get_tensor_name=names.__getitem__, get_tensor_mode=lambda n: "in" if n in ins else "out",
                             get_tensor_dtype=lambda n: SimpleNamespace(name=trt_names[dtypes[n]]),
                             create_execution_context=lambda: SimpleNamespace(
                                 set_optimization_profile_async=lambda i, h: None))
    plans: list = []
    trt = SimpleNamespace(Logger=_fake_trt11().Logger, TensorIOMode=SimpleNamespace(INPUT="in"),
                          Runtime=lambda logger: SimpleNamespace(
                              deserialize_cuda_engine=lambda plan: plans.append(plan) or engine))
    monkeypatch.setattr(rt, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(rt, "cuda_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(BuildEnv, "current", classmethod(lambda cls, device=0: ENV))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: SimpleNamespace(cuda_stream=0x7F00))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return plans


def test_runtime_max_context_above_the_engines_is_refused(tmp_path, monkeypatch):
    """The engine holds 100 positions (--max-context 100, its model 256): more is refused before
    the plan loads, as much or less is held."""
    from spec_plugins.backends.tensorrt_runtime import TensorRTRuntime

    man = _manifest(tmp_path)
    plans = _fake_runtime(monkeypatch, man)

    def config(**kw):
        return TensorRTRuntime.Config(engine_dir=str(tmp_path), **kw)

    with pytest.raises(ValueError, match=r"max_context 4096 exceeds the 100 positions this engine was built for "
                                         r"\(--max-context 100\); use max_context <= 100"):
        TensorRTRuntime.from_config(config(max_context=4096))
    with pytest.raises(ValueError, match="max_context 101 exceeds the 100 positions"):
        TensorRTRuntime.from_config(config(max_context=101))
    assert plans == []
    assert TensorRTRuntime.from_config(config(max_context=100)).max_context == 100
    assert TensorRTRuntime.from_config(config(max_context=50)).max_context == 50
    assert TensorRTRuntime.from_config(config()).max_context == man.limits_object().max_context == 100
    assert plans == [b"plan-bytes"] * 3
