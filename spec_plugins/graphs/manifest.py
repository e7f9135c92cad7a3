"""The export manifest: which graphs a directory holds, their I/O, dtypes and provenance.

A runtime reads only the manifest and the files it names, never the source model, so an
exported directory is self-contained (the tokenizer is saved next to the graphs).
"""

from __future__ import annotations

import json
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from spec_plugins.graphs.io import GRAPH_DTYPES, MAX_OPSET, MIN_OPSET, Port, layout_fields


MANIFEST_NAME = "manifest.json"
FORMAT = "spec-plugins-onnx"
MANIFEST_VERSION = 1
EXPORTER_VERSION = "2"  # bump when the graph layout changes; runtimes refuse other versions


class ManifestError(ValueError):
    """A missing, malformed or incompatible export directory (the message names the problem)."""


@dataclass
class GraphEntry:
    """One exported graph."""

    name: str  # "verify" (target), "draft" (draft model), "medusa", "eagle"
    kind: str  # "decoder_with_past" (the layout of onnx_verify.py), "medusa_heads", "eagle_layer", "block_refiner"
    file: str  # relative to the export directory
    source_model: str  # the config's model string (built-in name or path)
    dtype: str
    inputs: list[dict]
    outputs: list[dict]
    size_bytes: int
    export_seconds: float
    num_layers: int = 0  # decoder graphs: what a runtime needs to size the KV cache
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    max_context: int = 0
    # decoder graphs: positions past which the model's outputs change (a learned position table,
    # longrope, dynamic NTK rope: ``hf_compat.context_cap``); None: a runtime may hold more
    context_cap: int | None = None
    source_heads: str | None = None  # head graphs: the trained head directory
    feature_layers: list[int] = field(default_factory=list)  # decoder graphs: layers of the `features` output
    quantization: dict | None = None  # weight-only scheme (``exporters.onnx_quantize``), None = as exported


@dataclass
class Manifest:
    graphs: list[GraphEntry]
    opset: int
    exporter_version: str = EXPORTER_VERSION
    versions: dict[str, str] = field(default_factory=dict)  # spec-plugins, torch, transformers, onnx
    tokenizer: str | None = "tokenizer"  # directory with the target's tokenizer
    eos_token_ids: list[int] = field(default_factory=list)  # from the generation config
    pending: list[str] = field(default_factory=list)  # graphs asked for but not exportable yet (why)
    format: str = FORMAT
    manifest_version: int = MANIFEST_VERSION

    def graph(self, name: str) -> GraphEntry:
        for g in self.graphs:
            if g.name == name:
                return g
        raise ManifestError(f"no graph {name!r} in the export; it holds: {', '.join(g.name for g in self.graphs)}")

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | Path) -> "Manifest":
        """The manifest of an export directory, its fields checked for type and sense and the
        files it names for presence, so a damaged or hand-edited export fails here, naming the
        field or file, rather than somewhere inside a run."""
        path, data = read_json(Path(directory), MANIFEST_NAME, ManifestError, "is not an ONNX export",
                               "create one with `spec-plugins export onnx --config FILE --out DIR`")
        if data.get("format") != FORMAT:
            raise ManifestError(f"{path}: format {data.get('format')!r} is not {FORMAT!r}")
        if data.get("exporter_version") != EXPORTER_VERSION:
            raise ManifestError(f"{path}: exported with exporter version {data.get('exporter_version')!r}, this "
                                f"spec-plugins reads version {EXPORTER_VERSION!r}; export again")
        raw = data.pop("graphs", None)
        if not isinstance(raw, list) or not all(isinstance(g, dict) for g in raw):
            raise ManifestError(f"{path}: malformed manifest (graphs must be a list of objects, got {raw!r:.80})")
        check_fields(cls, data, f"{path}: ", skip=("graphs",))
        for i, g in enumerate(raw):
            check_fields(GraphEntry, g, f"{path}: graphs[{i}] ({g.get('name', '?')!r}) ")
        man = cls(graphs=[GraphEntry(**g) for g in raw], **data)
        if not MIN_OPSET <= man.opset <= MAX_OPSET:
            raise ManifestError(f"{path}: opset {man.opset} is outside the opsets the ONNX export writes "
                                f"({MIN_OPSET}..{MAX_OPSET}); restore the manifest or export again")
        for g in man.graphs:
            check_entry(path, g)
        if man.tokenizer is not None and not (path.parent / man.tokenizer).is_dir():
            raise ManifestError(f"{path}: tokenizer {man.tokenizer!r} names a directory that does not exist")
        return man


@cache
def _adapter(hint: Any) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(hint)


def check_fields(cls: type, data: dict, where: str, skip: tuple[str, ...] = ()) -> None:
    """Hold a JSON object to dataclass ``cls``'s fields: no unknown or missing keys and every
    value of its annotated type (strict: no "3" for 3, no true for 1)."""
    from pydantic import ValidationError

    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ManifestError(f"{where}has unknown field(s) {', '.join(unknown)}")
    missing = [n for n, f in known.items() if n not in data and n not in skip
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ManifestError(f"{where}lacks field(s) {', '.join(missing)}")
    for name, value in data.items():
        try:
            _adapter(hints[name]).validate_python(value, strict=True)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            at = "".join(f"[{i}]" for i in err["loc"])
            raise ManifestError(f"{where}field {name}{at}: {err['msg'].lower()} "
                                f"(expected {_type_name(hints[name])}), got {value!r:.80}") from None


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


def check_entry(path: Path, g: GraphEntry) -> None:
    """One graph's values make sense and its files exist: the graph, and the external data
    files its weights live in, together the size the export wrote (``check_files``)."""
    where = f"{path}: graph {g.name!r}"
    if not (path.parent / g.file).is_file():
        raise ManifestError(f"{where} names {g.file}, which does not exist" +
                            (" as a file" if (path.parent / g.file).exists() else ""))
    if g.kind == "decoder_with_past":
        for name in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_context"):
            if getattr(g, name) < 1:
                raise ManifestError(f"{where}: {name} is {getattr(g, name)}; a decoder graph needs at least 1")
        if g.dtype not in GRAPH_DTYPES:
            raise ManifestError(f"{where}: dtype {g.dtype!r}; decoder graphs are {' or '.join(GRAPH_DTYPES)}")
        bad = [i for i in g.feature_layers if not 0 <= i <= g.num_layers]
        if bad:
            raise ManifestError(f"{where}: feature_layers {bad} are outside 0..num_layers ({g.num_layers})")
    check_files(path.parent, g, where)


# ops whose presence makes a graph quantized (``exporters.onnx_quantize`` writes MatMulNBits)
QUANTIZED_OPS = frozenset({"MatMulNBits", "MatMulInteger", "QLinearMatMul", "DequantizeLinear",
                           "GatherBlockQuantized"})


def check_files(directory: Path, g: GraphEntry, where: str) -> None:
    """Graph ``g``'s file and its external data files hold exactly the ``size_bytes`` the export
    wrote, and its ``quantization`` agrees with its ops, so a truncated, replaced or relabelled
    graph fails here, named, rather than as a protobuf or ONNX Runtime error. The graph is parsed
    (without its external weights) only when the weights are elsewhere or it claims a scheme: a
    float graph holding its own weights is never parsed."""
    size = (directory / g.file).stat().st_size
    if size == g.size_bytes and g.quantization is None:
        return
    model = load_graph(directory / g.file, where) if size <= g.size_bytes else None
    names = external_data(model) if model is not None else []
    for name in names:
        if not (directory / name).is_file():
            raise ManifestError(f"{where}: {g.file} keeps its weights in {name}, which does not exist in "
                                f"{directory}; copy it next to the graph or export again")
    total = size + sum((directory / name).stat().st_size for name in names)
    if model is None or total != g.size_bytes:
        files = " + ".join([g.file, *names])
        raise ManifestError(f"{where}: {files} {'hold' if names else 'holds'} {total} bytes, not the "
                            f"{g.size_bytes} the export wrote; "
                            "the graph was truncated or replaced: export again")
    check_quantization(g, model, where)


def load_graph(file: Path, where: str) -> Any:
    """The ONNX model in ``file`` without its external weights, or ManifestError naming the file."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(str(file), format="protobuf", load_external_data=False)
    except DecodeError as exc:
        raise ManifestError(f"{where}: {file.name} is not a readable ONNX graph ({exc}); it was truncated or "
                            "replaced: export again") from None


def external_data(model: Any) -> list[str]:
    """The external data files a graph's weights are stored in."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    return sorted({ExternalDataInfo(t).location for t in model.graph.initializer if uses_external_data(t)})


def graph_files(file: Path) -> list[Path]:
    """The files graph ``file`` consists of: itself, then the external data files its weights are
    in (the exporters keep them in one, ``<file>.data``; torch's exporter writes a graph above
    2 GiB one file a tensor). What an export sizes, and what replacing the graph deletes."""
    return [file, *(file.parent / name for name in external_data(load_graph(file, str(file.parent))))]


def unreadable_weights(file: Path) -> str | None:
    """Why graph ``file``'s external weights cannot be read in full (a data file missing, or
    shorter than a tensor it holds), or None: names the file where ONNX Runtime's own error on
    loading such a graph is a bare ``Fail``."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    for t in load_graph(file, str(file.parent)).graph.initializer:
        if not uses_external_data(t):
            continue
        info = ExternalDataInfo(t)
        data = file.parent / info.location
        if not data.is_file():
            return f"its weights file {info.location} does not exist in {file.parent}"
        end = (info.offset or 0) + (info.length or 0)
        if data.stat().st_size < end:
            return (f"its weights file {data} holds {data.stat().st_size} bytes, but tensor {t.name} ends at byte "
                    f"{end}: it was truncated or replaced")
    return None


def check_quantization(g: GraphEntry, model: Any, where: str) -> None:
    """The manifest's ``quantization`` says what the graph holds: a runtime takes it to decide
    whether one-position forwards need padding (``OnnxRuntime.pad_single``)."""
    ops = sorted({n.op_type for n in model.graph.node} & QUANTIZED_OPS)
    if bool(ops) != (g.quantization is not None):
        label = "null" if g.quantization is None else repr(g.quantization.get("name", "?"))
        holds = f"quantized weights ({', '.join(ops)})" if ops else "no quantized weights"
        raise ManifestError(f"{where}: the manifest's quantization is {label} but {g.file} holds {holds}; "
                            "restore the manifest or export again")


def check_decoder_io(g: GraphEntry, inputs: dict[str, Port], outputs: dict[str, Port]) -> None:
    """Hold a decoder graph's manifest fields to the graph's own inputs and outputs, so a wrong
    field fails here, named, rather than as an ONNX Runtime error in the middle of a run."""
    try:
        have = layout_fields(inputs, outputs)
    except ValueError as exc:
        raise ManifestError(f"graph {g.name!r} ({g.file}): {exc}") from None
    want: dict[str, object] = {k: getattr(g, k) for k in have}
    want["feature_layers"] = len(g.feature_layers)
    for name, value in have.items():
        if value is not None and value != want[name]:
            what = "counts" if name == "feature_layers" else "is"
            raise ManifestError(f"graph {g.name!r}: the manifest's {name} {what} {want[name]!r} but {g.file} has "
                                f"{value!r}; restore the manifest or export again")


def library_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("spec-plugins", "torch", "transformers", "onnx"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def read_json(directory: Path, name: str, error: type[Exception], what: str, hint: str) -> tuple[Path, dict]:
    """A manifest file's path and JSON object, or ``error`` naming the file and what to do."""
    path = directory / name
    if not path.is_file():
        raise error(f"{directory} {what}: {name} not found ({hint})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{path} is not a manifest: expected a JSON object, got {type(data).__name__}")
    return path, data
