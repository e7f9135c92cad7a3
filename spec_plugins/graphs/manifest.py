"""The export manifest: which graphs a directory holds, their I/O, dtypes and provenance.

A runtime reads only the manifest and the files it names, never the source model, so an
exported directory is self-contained (the tokenizer is saved next to the graphs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


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
        path, data = read_json(Path(directory), MANIFEST_NAME, ManifestError, "is not an ONNX export",
                               "create one with `spec-plugins export onnx --config FILE --out DIR`")
        if data.get("format") != FORMAT:
            raise ManifestError(f"{path}: format {data.get('format')!r} is not {FORMAT!r}")
        if data.get("exporter_version") != EXPORTER_VERSION:
            raise ManifestError(f"{path}: exported with exporter version {data.get('exporter_version')!r}, this "
                                f"spec-plugins reads version {EXPORTER_VERSION!r}; export again")
        try:
            graphs = [GraphEntry(**g) for g in data.pop("graphs")]
            man = cls(graphs=graphs, **data)
        except (TypeError, KeyError) as exc:
            raise ManifestError(f"{path}: malformed manifest ({exc})") from None
        for g in man.graphs:
            if not (path.parent / g.file).is_file():
                raise ManifestError(f"{path}: graph {g.name!r} names {g.file}, which does not exist")
        return man


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
