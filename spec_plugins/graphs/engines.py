"""The TensorRT engine manifest: which plans a directory holds and what they were built for.

A serialized TensorRT plan only runs on the TensorRT version that built it and on the GPU
(compute capability, by default the exact model) it was tuned on. Loading it elsewhere either
fails deep inside ``deserialize_cuda_engine`` or, worse, runs kernels tuned for another chip.
So the builder records both next to the plans, and :func:`check_compatible` refuses a
mismatch up front with a message that says what was built, what is present and what to do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from spec_plugins.graphs.manifest import ManifestError, check_fields, read_json
from spec_plugins.graphs.profiles import SYMBOLS, Limits, Profile

MANIFEST_NAME = "tensorrt_manifest.json"
FORMAT = "spec-plugins-tensorrt"
MANIFEST_VERSION = 1
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
# TensorRT hardware-compatibility levels this builder can ask for -> trt.HardwareCompatibilityLevel member
HARDWARE_COMPAT = {"none": "NONE", "same_cc": "SAME_COMPUTE_CAPABILITY", "ampere_plus": "AMPERE_PLUS"}


class EngineMismatch(RuntimeError):
    """The engines were built for another TensorRT version or GPU."""


class EngineManifestError(ValueError):
    """A missing, malformed or tampered engine directory."""


@dataclass(frozen=True)
class BuildEnv:
    """Where a plan was built, or where it is about to run."""

    tensorrt_version: str
    gpu_name: str
    compute_capability: tuple[int, int]

    def to_dict(self) -> dict:
        return {"tensorrt_version": self.tensorrt_version, "gpu_name": self.gpu_name,
                "compute_capability": list(self.compute_capability)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "BuildEnv":
        cc = d["compute_capability"]
        return cls(str(d["tensorrt_version"]), str(d["gpu_name"]), (int(cc[0]), int(cc[1])))

    @classmethod
    def current(cls, device: int = 0) -> "BuildEnv":
        """This process's TensorRT and the CUDA device torch sees (needs both)."""
        import tensorrt as trt
        import torch

        return cls(trt.__version__, torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)))


@dataclass
class EngineEntry:
    """One plan: the ONNX graph it came from, its I/O (symbolic shapes) and its profiles."""

    name: str  # graph name of the ONNX export: "verify", "draft"
    plan: str  # file relative to the engine directory
    onnx_file: str
    sha256: str  # of the plan, to catch a truncated copy before TensorRT does
    size_bytes: int
    build_seconds: float
    profiles: list[dict]  # Profile.to_dict(), index = TensorRT profile index
    inputs: list[dict]
    outputs: list[dict]
    model: dict  # num_layers, num_kv_heads, head_dim, hidden_size, vocab_size, max_context, dtype

    def profile_objects(self) -> list[Profile]:
        return [Profile.from_dict(p) for p in self.profiles]


@dataclass
class EngineManifest:
    engines: list[EngineEntry]
    built_with: dict  # BuildEnv.to_dict()
    precision: str
    limits: dict  # Limits.to_dict()
    onnx_manifest_sha256: str  # the ONNX export these plans were built from
    tokenizer: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # ONNX graphs not built (why)
    hardware_compatibility: str = "none"  # a HARDWARE_COMPAT key
    format: str = FORMAT
    manifest_version: int = MANIFEST_VERSION

    @property
    def env(self) -> BuildEnv:
        return BuildEnv.from_dict(self.built_with)

    def limits_object(self) -> Limits:
        return Limits(**self.limits)

    def engine(self, name: str) -> EngineEntry:
        for e in self.engines:
            if e.name == name:
                return e
        built = ", ".join(e.name for e in self.engines) or "none"
        raise EngineManifestError(f"no engine {name!r} here; built: {built}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, directory: str | Path) -> "EngineManifest":
        """The manifest of an engine directory, every field (nested objects too) checked for type
        and sense and its tokenizer for presence, as ``Manifest.read`` checks an ONNX export, so a
        damaged or hand-edited manifest fails here, naming the field, not inside the runtime."""
        path, data = read_json(Path(directory), MANIFEST_NAME, EngineManifestError, "holds no TensorRT engines",
                               "build them with `spec-plugins export tensorrt --onnx ONNX_DIR --out DIR`")
        if data.get("format") != FORMAT or data.get("manifest_version") != MANIFEST_VERSION:
            raise EngineManifestError(f"{path}: format {data.get('format')!r} v{data.get('manifest_version')} is not "
                                      f"{FORMAT!r} v{MANIFEST_VERSION}; rebuild the engines")
        raw = data.pop("engines", None)
        if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
            raise EngineManifestError(f"{path}: malformed manifest (engines must be a list of objects, "
                                      f"got {raw!r:.80})")
        _check(cls, data, f"{path}: ", skip=("engines",))
        _check(BuiltWith, data["built_with"], f"{path}: built_with ")
        _check(Limits, data["limits"], f"{path}: limits ")
        if len(data["built_with"]["compute_capability"]) != 2:
            raise EngineManifestError(f"{path}: built_with compute_capability must be [major, minor], got "
                                      f"{data['built_with']['compute_capability']!r:.80}")
        man = cls(engines=[_read_entry(path, i, e) for i, e in enumerate(raw)], **data)
        try:
            man.limits_object()
        except ValueError as exc:  # Limits' own checks (ProfileError)
            raise EngineManifestError(f"{path}: malformed manifest ({exc})") from None
        if man.hardware_compatibility not in HARDWARE_COMPAT:
            raise EngineManifestError(f"{path}: unknown hardware compatibility {man.hardware_compatibility!r}")
        if man.precision not in PRECISIONS:
            raise EngineManifestError(f"{path}: unknown precision {man.precision!r} (known: {', '.join(PRECISIONS)})")
        if man.tokenizer is not None and not (path.parent / man.tokenizer).is_dir():
            raise EngineManifestError(f"{path}: tokenizer {man.tokenizer!r} names a directory that does not exist")
        return man

    def check_plan(self, directory: str | Path, name: str) -> bytes:
        """The plan's bytes, after checking they are the ones the builder wrote."""
        e = self.engine(name)
        path = Path(directory) / e.plan
        if not path.is_file():
            raise EngineManifestError(f"engine {name!r}: plan file {path} is missing")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != e.sha256:
            raise EngineManifestError(f"engine {name!r}: {path} does not match the manifest's checksum "
                                      "(truncated or replaced); rebuild the engines")
        return data


# JSON shapes of the manifest's nested objects, held to ``check_fields`` as the dataclasses are
@dataclass
class BuiltWith:
    """``built_with``: ``BuildEnv.to_dict()`` (JSON has no tuples)."""

    tensorrt_version: str
    gpu_name: str
    compute_capability: list[int]


@dataclass
class EngineModel:
    """An engine's ``model``: the ONNX graph's decoder fields; the runtime reads vocab_size and
    max_context, so those two are required."""

    vocab_size: int
    max_context: int
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    dtype: str = ""
    source_model: str = ""
    feature_layers: list[int] = field(default_factory=list)


@dataclass
class PortSpec:
    """One engine input or output (``graphs.io.io_spec``): symbolic dims are names."""

    name: str
    dtype: str
    shape: list[int | str]


@dataclass
class ProfileSpec:
    """One optimisation profile (``Profile.to_dict``): symbol -> [min, opt, max]."""

    name: str
    ranges: dict[str, list[int]]


def _check(cls: type, data: dict, where: str, skip: tuple[str, ...] = ()) -> None:
    """``manifest.check_fields`` (unknown, missing and mistyped fields), raised as this module's
    error so callers catch one type for a bad engine directory."""
    try:
        check_fields(cls, data, where, skip)
    except ManifestError as exc:
        raise EngineManifestError(str(exc)) from None


def _read_entry(path: Path, i: int, e: dict) -> EngineEntry:
    """``engines[i]``, its nested objects checked too: the runtime sizes its KV, vocabulary and
    profile choice from them."""
    where = f"{path}: engines[{i}] ({e.get('name', '?')!r}) "
    _check(EngineEntry, e, where)
    _check(EngineModel, e["model"], f"{where}model ")
    for name in ("vocab_size", "max_context"):
        if e["model"][name] < 1:
            raise EngineManifestError(f"{where}model {name} is {e['model'][name]}; an engine needs at least 1")
    for key in ("inputs", "outputs"):
        for j, t in enumerate(e[key]):
            _check(PortSpec, t, f"{where}{key}[{j}] ")
    if not e["profiles"]:
        raise EngineManifestError(f"{where}lists no profiles; an engine has at least one")
    for j, p in enumerate(e["profiles"]):
        _check(ProfileSpec, p, f"{where}profiles[{j}] ")
        _check_ranges(p["ranges"], f"{where}profiles[{j}] ")
    return EngineEntry(**e)


def _check_ranges(ranges: dict[str, list[int]], where: str) -> None:
    """A profile sizes every axis of the verify layout with 0 <= min <= opt <= max."""
    if sorted(ranges) != sorted(SYMBOLS):
        raise EngineManifestError(f"{where}ranges cover {', '.join(ranges) or 'no axis'}; a profile sizes the axes "
                                  f"{', '.join(SYMBOLS)}")
    for s, r in ranges.items():
        if len(r) != 3 or not 0 <= r[0] <= r[1] <= r[2]:
            raise EngineManifestError(f"{where}range {s} is {r}; expected [min, opt, max] with 0 <= min <= opt <= max")


def check_compatible(built: BuildEnv, here: BuildEnv, allow_gpu_mismatch: bool = False,
                     hardware_compatibility: str = "none") -> None:
    """Refuse to run a plan built with another TensorRT version or for another GPU.

    TensorRT versions must match exactly (plans are not portable across releases). The compute
    capability must match (kernels are compiled for it) unless the plan was built
    hardware-compatible (``ampere_plus``: any GPU from compute capability 8.0; ``same_cc``: any
    GPU model of that capability). A different GPU model with the same compute capability
    deserialises but runs tactics timed on another chip, so it is refused too unless the plan is
    hardware-compatible or ``allow_gpu_mismatch`` says the user accepts that."""
    rebuild = "rebuild them on this machine with `spec-plugins export tensorrt`"
    if built.tensorrt_version != here.tensorrt_version:
        raise EngineMismatch(f"these engines were built with TensorRT {built.tensorrt_version}, but TensorRT "
                             f"{here.tensorrt_version} is installed; install TensorRT {built.tensorrt_version} "
                             f"or {rebuild}")
    if hardware_compatibility == "ampere_plus":
        if here.compute_capability < (8, 0):
            raise EngineMismatch(f"these engines were built for Ampere and newer GPUs (compute capability >= 8.0), "
                                 f"this GPU is {here.gpu_name} ({here.compute_capability[0]}."
                                 f"{here.compute_capability[1]}); {rebuild}")
        return
    if built.compute_capability != here.compute_capability:
        b, h = built.compute_capability, here.compute_capability
        raise EngineMismatch(f"these engines were built for {built.gpu_name} (compute capability {b[0]}.{b[1]}), but "
                             f"this GPU is {here.gpu_name} (compute capability {h[0]}.{h[1]}); {rebuild}")
    if built.gpu_name != here.gpu_name and not allow_gpu_mismatch and hardware_compatibility != "same_cc":
        raise EngineMismatch(f"these engines were built on {built.gpu_name!r}, this GPU is {here.gpu_name!r} (same "
                             f"compute capability); {rebuild}, or set allow_gpu_mismatch: true to run them anyway")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# TensorRT DataType member name -> torch dtype name (names, so this table is testable without TensorRT)
TRT_TO_TORCH = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64",
                "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}


def torch_dtype_name(trt_dtype_name: str) -> str:
    """``trt.DataType.X.name`` -> torch dtype name; unsupported I/O types are refused by name."""
    try:
        return TRT_TO_TORCH[trt_dtype_name]
    except KeyError:
        raise EngineManifestError(f"engine I/O type {trt_dtype_name} has no torch equivalent here "
                                  f"(supported: {', '.join(TRT_TO_TORCH)})") from None
