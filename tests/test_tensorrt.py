"""TensorRT exporter + runtime: everything that needs no GPU runs here; the engine tests run
where ``tensorrt`` imports and a CUDA GPU is visible, and skip with that reason elsewhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from conftest import tiny_llama
from spec_plugins.backends.torch_runtime import TorchRuntime
from spec_plugins.graphs.io import DecoderShape, io_spec
from spec_plugins.exporters.tensorrt_build import network_flags, precision_of
from spec_plugins.graphs.engines import (BuildEnv, EngineEntry, EngineManifest, EngineManifestError,
                                                      EngineMismatch, check_compatible, torch_dtype_name)
from spec_plugins.graphs.profiles import Limits, ProfileError, bindings, check_graph, profiles
from spec_plugins.tree import layout, with_root

ROOT = Path(__file__).resolve().parents[1]
SHAPE = DecoderShape(num_layers=2, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=32, max_context=256)
INPUTS, OUTPUTS = io_spec(SHAPE, "float32")


def _has_gpu_trt() -> tuple[bool, str]:
    if importlib.util.find_spec("tensorrt") is None:
        return False, "needs the tensorrt package (not installed here)"
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU (torch sees none)"
    return True, ""


HAS_TRT, NO_TRT_REASON = _has_gpu_trt()
gpu_trt = pytest.mark.skipif(not HAS_TRT, reason=f"TensorRT engine test: {NO_TRT_REASON}")


# ---- limits and profiles ------------------------------------------------------------------------
@pytest.mark.parametrize("kw, needle", [
    ({"max_draft": 0}, "--max-draft must be >= 1"),
    ({"max_batch": 0}, "--max-batch must be >= 1"),
    ({"max_draft": 8, "max_context": 9}, "--max-context 9 is too small for --max-draft 8"),
    ({"max_context": 64, "prefill_chunk": 65}, "--prefill-chunk must be in 1..max_context"),
    ({"max_batch": 2, "opt_batch": 3}, "opt batch 3"),
    ({"max_context": 64, "opt_context": 65}, "opt context 65"),
])
def test_impossible_limits_are_refused_with_the_flag(kw, needle):
    with pytest.raises(ProfileError, match=needle):
        Limits(**kw)


def test_profiles_from_limits():
    lim = Limits(max_batch=4, max_draft=5, max_context=128, prefill_chunk=32, opt_batch=2)
    dec, pre = profiles(lim)
    assert dec.name == "decode" and pre.name == "prefill"
    assert dec.ranges == {"B": (1, 2, 4), "N": (1, 6, 6), "P": (0, 64, 128), "T": (1, 70, 134)}
    assert pre.ranges == {"B": (1, 2, 4), "N": (1, 32, 32), "P": (0, 0, 128), "T": (1, 32, 160)}
    shapes = dec.shapes(INPUTS)
    assert shapes["input_ids"] == ((1, 1), (2, 6), (4, 6))
    assert shapes["attention_mask"] == ((1, 1, 1, 1), (2, 1, 6, 70), (4, 1, 6, 134))
    assert shapes["past_key.1"] == ((1, 2, 0, 8), (2, 2, 64, 8), (4, 2, 128, 8))
    assert set(shapes) == {t["name"] for t in INPUTS}
    # a prefill chunk no longer than a step needs no second profile
    assert [p.name for p in profiles(Limits(max_draft=7, max_context=64, prefill_chunk=8))] == ["decode"]


def test_binding_shapes_and_profile_choice():
    profs = profiles(Limits(max_batch=2, max_draft=4, max_context=100, prefill_chunk=16))
    bd = bindings(INPUTS, OUTPUTS, profs, B=2, N=5, P=37)
    assert bd.profile == 0
    assert bd.inputs["input_ids"] == (2, 5) and bd.inputs["attention_mask"] == (2, 1, 5, 42)
    assert bd.inputs["past_value.0"] == (2, 2, 37, 8)
    assert bd.outputs["logits"] == (2, 5, 32) and bd.outputs["hidden"] == (2, 5, 32)
    assert bd.outputs["present_key.1"] == (2, 2, 42, 8)
    assert bindings(INPUTS, OUTPUTS, profs, B=1, N=16, P=0).profile == 1  # a prompt chunk
    assert bindings(INPUTS, OUTPUTS, profs, B=1, N=3, P=0, prefer="prefill").profile == 1
    assert bindings(INPUTS, OUTPUTS, profs, B=1, N=3, P=0, prefer="decode").profile == 0
    with pytest.raises(ProfileError, match=r"B=3 exceeds .* --max-batch"):
        bindings(INPUTS, OUTPUTS, profs, B=3, N=1, P=0)
    with pytest.raises(ProfileError, match=r"P=101 exceeds .* --max-context"):
        bindings(INPUTS, OUTPUTS, profs, B=1, N=1, P=101)
    with pytest.raises(ProfileError, match="N=17 exceeds"):
        bindings(INPUTS, OUTPUTS, profs, B=1, N=17, P=0)


def test_graph_with_unknown_axis_is_refused():
    check_graph(INPUTS, OUTPUTS, "verify")
    bad = [{"name": "x", "dtype": "float32", "shape": ["B", "heads"]}]
    with pytest.raises(ProfileError, match="dynamic axis 'heads'"):
        check_graph(bad, OUTPUTS, "medusa")


def test_precision_flags_and_network_flags():
    assert precision_of(False, False, False) == "fp32"
    assert precision_of(True, False, False) == "fp16"
    with pytest.raises(ProfileError, match="--fp16, --bf16"):
        precision_of(True, True, False)
    flag = SimpleNamespace(EXPLICIT_BATCH=0)
    assert network_flags(SimpleNamespace(__version__="10.3.0.26", NetworkDefinitionCreationFlag=flag)) == 0
    assert network_flags(SimpleNamespace(__version__="8.6.1", NetworkDefinitionCreationFlag=flag)) == 1


# ---- manifest and compatibility -----------------------------------------------------------------
ENV = BuildEnv("10.3.0", "NVIDIA H200", (9, 0))


def _manifest(tmp_path: Path, plan: bytes = b"plan-bytes") -> EngineManifest:
    import hashlib

    (tmp_path / "verify.plan").write_bytes(plan)
    lim = Limits(max_batch=2, max_draft=4, max_context=100, prefill_chunk=16)
    entry = EngineEntry(name="verify", plan="verify.plan", onnx_file="verify.onnx",
                        sha256=hashlib.sha256(plan).hexdigest(), size_bytes=len(plan), build_seconds=1.5,
                        profiles=[p.to_dict() for p in profiles(lim)], inputs=INPUTS, outputs=OUTPUTS,
                        model={"num_layers": 2, "vocab_size": 32, "max_context": 256})
    man = EngineManifest(engines=[entry], built_with=ENV.to_dict(), precision="fp16", limits=lim.to_dict(),
                         onnx_manifest_sha256="ab" * 32, eos_token_ids=[2])
    man.write(tmp_path)
    return man


def test_manifest_round_trip_and_plan_checksum(tmp_path):
    man = _manifest(tmp_path)
    back = EngineManifest.read(tmp_path)
    assert back == man
    assert back.env == ENV and back.limits_object() == Limits(max_batch=2, max_draft=4, max_context=100,
                                                              prefill_chunk=16)
    assert back.engine("verify").profile_objects() == profiles(back.limits_object())
    assert back.check_plan(tmp_path, "verify") == b"plan-bytes"
    (tmp_path / "verify.plan").write_bytes(b"plan-byte")  # truncated copy
    with pytest.raises(EngineManifestError, match="checksum"):
        back.check_plan(tmp_path, "verify")
    with pytest.raises(EngineManifestError, match="no engine 'draft'"):
        back.engine("draft")


def test_manifest_errors_name_the_problem(tmp_path):
    with pytest.raises(EngineManifestError, match="spec-plugins export tensorrt"):
        EngineManifest.read(tmp_path)
    _manifest(tmp_path)
    path = tmp_path / "tensorrt_manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "format": "something-else"}))
    with pytest.raises(EngineManifestError, match="rebuild"):
        EngineManifest.read(tmp_path)
    path.write_text(json.dumps({**data, "limits": {**data["limits"], "max_draft": 0}}))
    with pytest.raises(EngineManifestError, match="malformed"):
        EngineManifest.read(tmp_path)


def test_version_and_gpu_mismatch_refused():
    check_compatible(ENV, BuildEnv("10.3.0", "NVIDIA H200", (9, 0)))
    with pytest.raises(EngineMismatch, match=r"built with TensorRT 10\.3\.0, but TensorRT 10\.4\.0 is installed"):
        check_compatible(ENV, BuildEnv("10.4.0", "NVIDIA H200", (9, 0)))
    with pytest.raises(EngineMismatch, match=r"compute capability 9\.0.*NVIDIA A100.*compute capability 8\.0"):
        check_compatible(ENV, BuildEnv("10.3.0", "NVIDIA A100", (8, 0)))
    with pytest.raises(EngineMismatch, match="allow_gpu_mismatch"):
        check_compatible(ENV, BuildEnv("10.3.0", "NVIDIA H100 80GB HBM3", (9, 0)))
    check_compatible(ENV, BuildEnv("10.3.0", "NVIDIA H100 80GB HBM3", (9, 0)), allow_gpu_mismatch=True)
    with pytest.raises(EngineMismatch, match="compute capability"):  # never across compute capabilities
        check_compatible(ENV, BuildEnv("10.3.0", "NVIDIA A100", (8, 0)), allow_gpu_mismatch=True)


def test_hardware_compatible_plans_relax_only_the_gpu_check():
    a100, rtx = BuildEnv("10.3.0", "NVIDIA A100", (8, 0)), BuildEnv("10.3.0", "NVIDIA T4", (7, 5))
    check_compatible(ENV, a100, hardware_compatibility="ampere_plus")
    with pytest.raises(EngineMismatch, match="Ampere and newer"):
        check_compatible(ENV, rtx, hardware_compatibility="ampere_plus")
    with pytest.raises(EngineMismatch, match="TensorRT 10.4.0 is installed"):  # never across versions
        check_compatible(ENV, BuildEnv("10.4.0", "NVIDIA H200", (9, 0)), hardware_compatibility="ampere_plus")
    check_compatible(ENV, BuildEnv("10.3.0", "NVIDIA H100 80GB HBM3", (9, 0)), hardware_compatibility="same_cc")
    with pytest.raises(EngineMismatch, match="compute capability"):
        check_compatible(ENV, a100, hardware_compatibility="same_cc")


def test_trt_dtype_names():
    assert torch_dtype_name("HALF") == "float16" and torch_dtype_name("INT64") == "int64"
    assert all(hasattr(torch, torch_dtype_name(n)) for n in ("FLOAT", "HALF", "BF16", "INT32", "BOOL"))
    with pytest.raises(EngineManifestError, match="FP8"):
        torch_dtype_name("FP8")


# ---- the TensorRT runtime over the real exported graph, its engine call done by ONNX Runtime ------
class OrtExecutedEngine:
    """Test harness, not a backend: the real ``TensorRTRuntime`` class (profile choice, binding
    shapes, chunked prefill, masks, present -> past hand-off, the slot layer's plans) with only
    ``_run_engine`` replaced by onnxruntime on CPU, driving the exported verify graph. Asserts every
    output shape the layout predicts is the one the graph produces."""

    @staticmethod
    def build(onnx_dir: Path, limits: Limits):
        import onnxruntime as ort

        from spec_plugins.backends.tensorrt_runtime import TensorRTRuntime
        from spec_plugins.graphs.manifest import Manifest

        g = Manifest.read(onnx_dir).graph("verify")

        class Engine(TensorRTRuntime):
            def _run_engine(self, profile, feeds, out_shapes):
                self.calls.append((profile, tuple(feeds["input_ids"].shape)))
                res = self.sess.run(list(out_shapes), {k: v.numpy() for k, v in feeds.items()})
                outs = {n: torch.from_numpy(r) for n, r in zip(out_shapes, res)}
                for n, shape in out_shapes.items():
                    assert tuple(outs[n].shape) == shape, (n, outs[n].shape, shape)
                return outs

        eng = Engine.__new__(Engine)  # no TensorRT engine to deserialise: set up the layout only
        eng.sess = ort.InferenceSession(str(onnx_dir / g.file), providers=["CPUExecutionProvider"])
        eng.calls = []
        eng.inputs, eng.outputs = g.inputs, g.outputs
        dtypes = {t["name"]: getattr(torch, t["dtype"]) for t in g.inputs + g.outputs}
        # the fields the engine manifest copies from the graph's (exporters/tensorrt_build.py)
        model = {"num_layers": g.num_layers, "vocab_size": g.vocab_size, "max_context": g.max_context,
                 "source_model": g.source_model, "feature_layers": g.feature_layers}
        eng._init_layout(profiles(limits), limits, model, dtypes, torch.device("cpu"), None)
        return eng


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from spec_plugins.exporters.onnx_export import export_models

    model = tiny_llama(vocab=32, seed=2, sharpness=3.0)
    d = tmp_path_factory.mktemp("onnx")
    export_models(d, (model, None, "tiny-llama"))
    return model, d


def test_engine_protocol_matches_torch_runtime(exported):
    model, onnx_dir = exported
    eng = OrtExecutedEngine.build(onnx_dir, Limits(max_batch=4, max_draft=5, max_context=100, prefill_chunk=8))
    ref = TorchRuntime(model)
    close = dict(atol=1e-4, rtol=1e-4)
    rows = [list(range(1, 20)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9]]  # 19 tokens: 3 prefill chunks
    got, want = eng.prefill(rows, want_hidden=True), ref.prefill(rows, want_hidden=True)
    torch.testing.assert_close(got.logits, want.logits, **close)
    torch.testing.assert_close(got.hidden[:, -1], want.hidden[:, -1], **close)
    assert [c for c in eng.calls[-3:]] == [(1, (3, 8)), (1, (3, 8)), (1, (3, 3))]  # the prefill profile
    tree = layout(with_root((-1, -1, 0, 1, 1)))
    toks = torch.tensor([[9, 10, 11, 12, 13, 14]] * 3)
    torch.testing.assert_close(eng.forward(toks, tree).logits, ref.forward(toks, tree).logits, **close)
    assert eng.calls[-1] == (0, (3, 6))  # the decode profile
    for r in (eng, ref):
        r.commit([[0, 2, 5], [0], [0, 1]])
    assert torch.equal(eng.slots.pos, ref.slots.pos)
    for r in (eng, ref):
        r.rollback([20, 4, 11])
        r.select_rows([2, 0])
    assert eng.lengths() == ref.lengths() and torch.equal(eng.slots.pos, ref.slots.pos)
    nxt = torch.tensor([[3, 4], [5, 6]])
    torch.testing.assert_close(eng.forward(nxt).logits, ref.forward(nxt).logits, **close)


def test_engine_compacts_holes_before_the_slot_axis_outgrows_the_profile(exported):
    model, onnx_dir = exported
    eng = OrtExecutedEngine.build(onnx_dir, Limits(max_batch=2, max_draft=5, max_context=40, prefill_chunk=8))
    ref = TorchRuntime(model)
    for r in (eng, ref):
        r.compact_holes = 1.0  # only the engine's bounded past may compact here
        r.prefill([[1, 2, 3, 4], [4, 3, 2, 1]])
    toks = torch.tensor([[7, 8, 9, 10, 11, 12]] * 2)
    compacted = False
    for i in range(9):  # rows alternate 1 and 6 kept nodes: slots grow 6 per round, lengths 3.5
        keep = [[0], list(range(6))] if i % 2 else [list(range(6)), [0]]
        slots_before = eng.slots.slots
        torch.testing.assert_close(eng.forward(toks).logits, ref.forward(toks).logits, atol=1e-4, rtol=1e-4)
        compacted |= eng.slots.slots - 6 < slots_before
        for r in (eng, ref):
            r.commit(keep)
        assert eng.lengths() == ref.lengths() and max(eng.lengths()) < 40
    assert compacted and ref.slots.slots > 40  # the torch runtime's slot axis outgrew 40; the engine's never


def test_engine_add_rows_matches_torch_runtime(exported):
    model, onnx_dir = exported
    eng = OrtExecutedEngine.build(onnx_dir, Limits(max_batch=3, max_draft=5, max_context=100, prefill_chunk=8))
    ref = TorchRuntime(model)
    for r in (eng, ref):
        r.prefill([[1, 2, 3], [4, 5, 6, 7]])
        r.forward(torch.tensor([[8, 9, 10]] * 2))
        r.commit([[0], [0, 1, 2]])
    got, want = eng.add_rows([list(range(1, 12))]), ref.add_rows([list(range(1, 12))])  # longer than the slots
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(eng.slots.pos, ref.slots.pos) and eng.lengths() == ref.lengths()
    toks = torch.tensor([[5, 6]] * 3)
    torch.testing.assert_close(eng.forward(toks).logits, ref.forward(toks).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="between forward"):
        eng.add_rows([[1]])
    eng.commit([[0, 1]] * 3)
    with pytest.raises(ValueError, match="--max-batch"):
        eng.add_rows([[1]])


def test_engine_greedy_decode_equals_torch_runtime(exported):
    from spec_plugins import SpecConfig, SpeculativeDecoder

    model, onnx_dir = exported
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "unused"},
                            "proposer": {"type": "ngram", "num_draft_tokens": 4}})
    eng = OrtExecutedEngine.build(onnx_dir, Limits(max_batch=3, max_draft=4, max_context=120, prefill_chunk=8))
    a = SpeculativeDecoder.from_config(cfg, target=eng)
    b = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 8, 9, 7, 7, 8], [4, 5, 6]]
    got = [r.token_ids for r in a.generate_batch(prompts, max_new_tokens=30)]
    assert got == [r.token_ids for r in b.generate_batch(prompts, max_new_tokens=30)]
    assert a.last_stats.draft_tokens > 0


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_export_tensorrt_cli_checks_flags_then_gives_install_hint(exported, tmp_path):
    from typer.testing import CliRunner

    from spec_plugins.cli import app

    _, onnx_dir = exported
    run = lambda *a: CliRunner().invoke(app, ["export", "tensorrt", "--onnx", str(onnx_dir),  # noqa: E731
                                              "--out", str(tmp_path / "engines"), *a])
    res = run("--fp16", "--max-draft", "4")
    assert res.exit_code == 2 and "spec-plugins[tensorrt]" in res.output, res.output
    assert "choose one precision flag" in run("--fp16", "--bf16").output
    assert "--max-draft must be >= 1" in run("--max-draft", "0").output
    assert "--hardware-compat" in CliRunner().invoke(app, ["export", "tensorrt", "--help"]).output
    assert not (tmp_path / "engines").exists()


def _fake_trt11() -> ModuleType:
    """TensorRT 11's Python module as far as the builder reaches: BuilderFlag as NVIDIA/TensorRT
    v11.0 binds it (no FP16 / BF16: networks are always strongly typed); the parser reads the
    ONNX file's input and output names; a build returns placeholder bytes."""
    import enum

    import onnx

    def parse(network: SimpleNamespace, path: str) -> bool:
        g = onnx.load(path, load_external_data=False).graph
        network.num_inputs, network.num_outputs = len(g.input), len(g.output)
        network.get_input, network.get_output = g.input.__getitem__, g.output.__getitem__
        return True

    trt = ModuleType("tensorrt")
    trt.__version__ = "11.4.0.106"
    trt.BuilderFlag = enum.IntEnum("BuilderFlag", "DEBUG GPU_FALLBACK REFIT TF32 STRIP_PLAN STRICT_NANS")
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level=None: None})
    none = lambda *a: None  # noqa: E731
    trt.Builder = lambda logger: SimpleNamespace(
        create_network=lambda flags=0: SimpleNamespace(),
        create_builder_config=lambda: SimpleNamespace(set_flag=none, clear_flag=none, add_optimization_profile=none),
        create_optimization_profile=lambda: SimpleNamespace(set_shape=none),
        build_serialized_network=lambda network, config: b"plan")
    trt.OnnxParser = lambda network, logger: SimpleNamespace(num_errors=0, parse_from_file=lambda f: parse(network, f))
    return trt


def test_fp16_bf16_on_tensorrt_11_refused_with_what_to_do_instead(exported, tmp_path, monkeypatch):
    """TensorRT 11 has no FP16 / BF16 builder flags: the CLI says to export the ONNX graph in
    float16 instead (rc 2, no traceback, nothing left in --out); fp32 still builds."""
    from typer.testing import CliRunner

    import spec_plugins.backends.tensorrt_runtime as trt_runtime
    from spec_plugins.cli import app

    _, onnx_dir = exported
    trt = _fake_trt11()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(trt_runtime, "cuda_device", lambda name: torch.device("cuda", 0))  # no GPU here
    monkeypatch.setattr(BuildEnv, "current", classmethod(lambda cls, device=0: cls(trt.__version__, "GPU", (9, 0))))
    run = lambda out, *a: CliRunner().invoke(app, ["export", "tensorrt", "--onnx", str(onnx_dir),  # noqa: E731
                                                   "--out", str(tmp_path / out), "--max-context", "64", *a])
    res = run("e16", "--fp16")
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "no BuilderFlag.FP16" in res.output and "(these graphs: float32)" in res.output, res.output
    assert "`dtype: float16`" in res.output and "spec-plugins export onnx --config" in res.output
    res = run("e16", "--bf16")
    assert res.exit_code == 2 and "no BuilderFlag.BF16" in res.output and ">= 9" not in res.output, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no --out, no temporary directory
    res = run("e32")
    assert res.exit_code == 0 and (tmp_path / "e32" / "verify.plan").read_bytes() == b"plan", res.output
    from spec_plugins.exporters.tensorrt_build import BuildError, check_precision

    flags = lambda *names: SimpleNamespace(__version__="8.6.1",  # noqa: E731
                                           BuilderFlag=SimpleNamespace(**dict.fromkeys(names)))
    check_precision(flags("FP16", "BF16"), "bf16", ["float32"])  # TensorRT 9 / 10: the flag is set
    with pytest.raises(BuildError, match=">= 9"):  # TensorRT 8.x: fp16 only
        check_precision(flags("FP16"), "bf16", ["float32"])


class _Stream:
    """A stand-in for torch.cuda.Stream that logs waits into ``log``; handle 0 is the null stream."""

    def __init__(self, log: list, handle: int) -> None:
        self.log, self.cuda_stream = log, handle

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait", self.cuda_stream, other.cuda_stream))


def test_engine_runs_on_its_own_stream_between_waits(tmp_path, monkeypatch):
    """Profiles and enqueues get the runtime's own stream, never the default (null) one (on which
    TensorRT adds device syncs); the engine waits for the caller's stream, the caller's stream
    for the engine, and every bound tensor is recorded on the engine's stream. CUDA streams and
    the engine are fakes that log what TensorRT is handed."""
    import contextlib

    from spec_plugins.backends.tensorrt_runtime import TensorRTRuntime

    log: list = []
    null = _Stream(log, 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream(log, 0x7F00 + len(log)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: null)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: log.append(("record", stream.cuda_stream)))
    man = _manifest(tmp_path)
    entry, limits = man.engine("verify"), man.limits_object()
    bd = bindings(INPUTS, OUTPUTS, entry.profile_objects(), B=1, N=2, P=3)
    dtypes = {t["name"]: t["dtype"] for t in INPUTS + OUTPUTS}
    names = list(dtypes)
    ctx = SimpleNamespace(set_optimization_profile_async=lambda i, h: log.append(("profile", i, h)),
                          set_input_shape=lambda n, s: None, set_tensor_address=lambda n, a: None,
                          get_tensor_shape=bd.outputs.__getitem__,
                          execute_async_v3=lambda h: log.append(("execute", h)) or True)
    trt_names = {"float32": "FLOAT", "int64": "INT64"}
    engine = SimpleNamespace(num_optimization_profiles=2, num_io_tensors=len(names), get_tensor_name=names.__getitem__,
                             get_tensor_mode=lambda n: "in" if n in bd.inputs else "out",
                             get_tensor_dtype=lambda n: SimpleNamespace(name=trt_names[dtypes[n]]),
                             create_execution_context=lambda: ctx)
    trt = SimpleNamespace(Logger=_fake_trt11().Logger, TensorIOMode=SimpleNamespace(INPUT="in"),
                          Runtime=lambda logger: SimpleNamespace(deserialize_cuda_engine=lambda plan: engine))
    rt = TensorRTRuntime(trt, b"plan", entry, limits, torch.device("cpu"))
    profiles_set = [e for e in log if e[0] == "profile"]
    own = profiles_set[0][2]
    assert own != 0 and profiles_set == [("profile", 0, own), ("profile", 1, own)]
    del log[:]
    feeds = {n: torch.zeros(shape, dtype=getattr(torch, dtypes[n])) for n, shape in bd.inputs.items()}
    outs = rt._run_engine(bd.profile, feeds, bd.outputs)
    assert {n: tuple(t.shape) for n, t in outs.items()} == bd.outputs
    assert [e for e in log if e[0] != "record"] == [("wait", own, 0), ("execute", own), ("wait", 0, own)]
    assert log.count(("record", own)) == len(feeds) + len(outs) == len(log) - 3


# ---- without TensorRT: configs validate, building says how to install ----------------------------
def test_tensorrt_config_validates_and_missing_tensorrt_gives_install_hint(tmp_path):
    from spec_plugins import SpecConfig
    from spec_plugins.backends import build_runtime
    from spec_plugins.registry import RegistryError

    cfg = SpecConfig.parse({"target": {"backend": "tensorrt", "engine_dir": str(tmp_path)},
                            "proposer": {"type": "ngram"}})
    assert cfg.target.backend == "tensorrt" and cfg.target.graph == "verify"
    if HAS_TRT:
        pytest.skip("tensorrt and a GPU are present: the hint is not shown")
    with pytest.raises(RegistryError, match=r"spec-plugins\[tensorrt\]|CUDA GPU"):
        build_runtime(cfg.target)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_cli_without_tensorrt_prints_hint_not_traceback(tmp_path):
    cfg = tmp_path / "trt.yaml"
    cfg.write_text(f"target: {{backend: tensorrt, engine_dir: {tmp_path}}}\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-m", "spec_plugins.cli", "generate", "-p", "hi", "-c", str(cfg)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "spec-plugins[tensorrt]" in res.stderr and "Traceback" not in res.stderr


def test_gpu_check_script_without_gpu_says_so_quickly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would run the full matrix")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "no CUDA GPU" in res.stdout


# ---- on a GPU with TensorRT ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A tiny llama exported to ONNX, then built into fp32 engines (module-scoped: builds take seconds)."""
    from spec_plugins.exporters.onnx_export import export_models
    from spec_plugins.exporters.tensorrt_build import build_engines

    d = tmp_path_factory.mktemp("trt")
    model = tiny_llama(vocab=32, seed=2, sharpness=3.0)
    export_models(d / "onnx", (model, None, "tiny-llama"))
    build_engines(d / "onnx", d / "engines", "fp32", Limits(max_batch=4, max_draft=6, max_context=128,
                                                           prefill_chunk=16))
    return model, d / "engines"


def _trt_runtime(engine_dir: Path):
    from spec_plugins.backends.tensorrt_runtime import TensorRTRuntime

    return TensorRTRuntime.from_config(TensorRTRuntime.Config(engine_dir=str(engine_dir)))


@gpu_trt
def test_gpu_trt_tree_rollback_batch_match_torch_cuda(engines):
    model, engine_dir = engines
    trt_rt, ref = _trt_runtime(engine_dir), TorchRuntime(model.cuda())
    rows = [list(range(1, 20)), [5, 6, 7]]  # 19 tokens: two prefill chunks
    torch.testing.assert_close(trt_rt.prefill(rows).logits.cpu(), ref.prefill(rows).logits.cpu(), atol=1e-3, rtol=1e-3)
    tree = layout(with_root((-1, -1, 0, 1, 1)))
    toks = torch.tensor([[9, 10, 11, 12, 13, 14]] * 2)
    torch.testing.assert_close(trt_rt.forward(toks, tree).logits.cpu(), ref.forward(toks, tree).logits.cpu(),
                               atol=1e-3, rtol=1e-3)
    for r in (trt_rt, ref):
        r.commit([[0, 2, 5], [0]])
        r.rollback([20, 4])
    assert trt_rt.lengths() == ref.lengths() and torch.equal(trt_rt.slots.pos, ref.slots.pos)
    nxt = torch.tensor([[3, 4], [5, 6]])
    torch.testing.assert_close(trt_rt.forward(nxt).logits.cpu(), ref.forward(nxt).logits.cpu(), atol=1e-3, rtol=1e-3)


@gpu_trt
def test_gpu_trt_config_swap_same_greedy_tokens(engines):
    from spec_plugins import SpecConfig, SpeculativeDecoder

    model, engine_dir = engines
    prop = {"type": "ngram", "num_draft_tokens": 5}
    trt_dec = SpeculativeDecoder.from_config(SpecConfig.parse(
        {"target": {"backend": "tensorrt", "engine_dir": str(engine_dir)}, "proposer": prop}))
    torch_dec = SpeculativeDecoder.from_config(SpecConfig.parse(
        {"target": {"backend": "torch", "model": "unused"}, "proposer": prop}), target=TorchRuntime(model.cuda()))
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 8, 9, 7, 7]):
        a = trt_dec.generate(prompt, max_new_tokens=40)
        b = torch_dec.generate(prompt, max_new_tokens=40)
        assert a.token_ids == b.token_ids
        assert a.token_ids == trt_dec.without_speculation().generate(prompt, max_new_tokens=40).token_ids


@gpu_trt
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (a runtime on cuda:1 called while cuda:0 is current)")
def test_gpu_trt_runtime_on_a_second_device_runs_while_another_is_current(engines):
    """The engine call makes the runtime's device current, as its engine and contexts were made."""
    import copy

    from spec_plugins.backends.tensorrt_runtime import TensorRTRuntime

    model, engine_dir = engines
    trt_rt = TensorRTRuntime.from_config(TensorRTRuntime.Config(engine_dir=str(engine_dir), device="cuda:1"))
    ref = TorchRuntime(copy.deepcopy(model).to("cuda:1"))
    rows = [list(range(1, 12)), [5, 6, 7]]
    nxt = torch.tensor([[3, 4], [5, 6]])
    with torch.cuda.device(0):
        got = [trt_rt.prefill(rows).logits.cpu(), trt_rt.forward(nxt).logits.cpu()]
    want = [ref.prefill(rows).logits.cpu(), ref.forward(nxt).logits.cpu()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["eagle", "medusa", "parallel"])
def test_trained_heads_draft_on_an_engine_built_from_a_model(tmp_path, kind):
    """A trained head shares the target's LM head and embeddings: on an engine they come from the
    model it was built from (the manifest's ``source_model``). The runtime kept no source model,
    so every trained-head proposer failed to build on TensorRT."""
    pytest.importorskip("onnxruntime")
    from helpers import save_random_heads

    from spec_plugins import SpecConfig, SpeculativeDecoder
    from spec_plugins.exporters.onnx_export import export_models

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama(vocab=32, seed=2, sharpness=3.0)
    src = tmp_path / "src"  # loadable by name, as a source model must be: weights and a tokenizer
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w31").save_pretrained(str(src))
    model.save_pretrained(str(src))
    export_models(tmp_path / "onnx", (model, None, str(src)), feature_layers=(1, 2))
    heads = save_random_heads(model, tmp_path / "heads")
    section = {"type": kind, "heads": str(heads[kind]), "num_draft_tokens": 3}
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "unused"}, "proposer": section})
    eng = OrtExecutedEngine.build(tmp_path / "onnx", Limits(max_batch=2, max_draft=8, max_context=120, prefill_chunk=8))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 8, 9, 7]]
    got = SpeculativeDecoder.from_config(cfg, target=eng).generate_batch(prompts, max_new_tokens=16)
    want = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model)).generate_batch(prompts, max_new_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_a_draft_is_cut_only_past_the_widest_step_an_engine_binds(exported):
    """A step wider than ``max_draft`` binds the prefill profile: a chain of 10 nodes runs whole on
    an engine of max_draft 4 (cutting it to 4 would change nothing but speed), and greedy output
    equals the torch runtime's."""
    from spec_plugins import SpecConfig, SpeculativeDecoder

    model, onnx_dir = exported
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "unused"},
                            "proposer": {"type": "ngram", "num_draft_tokens": 10}})
    eng = OrtExecutedEngine.build(onnx_dir, Limits(max_batch=2, max_draft=4, max_context=120))
    assert eng.max_draft_nodes == eng.prefill_chunk - 1 > 10
    prompts = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]]
    got = SpeculativeDecoder.from_config(cfg, target=eng).generate_batch(prompts, max_new_tokens=24)
    want = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model)).generate_batch(prompts, max_new_tokens=24)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert any(5 < n <= 11 for _, (_, n) in eng.calls[1:])  # decode steps past max_draft + 1 (after the prefill)


def test_an_auto_tree_on_a_narrow_engine_measures_and_drafts_within_it(exported):
    """An engine whose widest step is 8 positions: the policy's costs are measured up to it (not
    the default 17, a ProfileError at setup) and every draft fits."""
    from spec_plugins import SpecConfig, SpeculativeDecoder

    model, onnx_dir = exported
    cfg = SpecConfig.parse({"target": {"backend": "torch", "model": "unused"},
                            "proposer": {"type": "suffix", "num_draft_tokens": "auto", "tree_nodes": "auto"}})
    eng = OrtExecutedEngine.build(onnx_dir, Limits(max_batch=2, max_draft=4, max_context=120, prefill_chunk=8))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 8, 9, 7, 7, 8]]
    got = SpeculativeDecoder.from_config(cfg, target=eng).generate_batch(prompts, max_new_tokens=20)
    want = SpeculativeDecoder.from_config(cfg, target=TorchRuntime(model)).generate_batch(prompts, max_new_tokens=20)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert max(n for _, (_, n) in eng.calls) <= 8
