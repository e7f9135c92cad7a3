"""Where ONNX exports live for the ONNX Runtime backend: the first-use export cache (keyed by the
source files' identity, scheme, dtype and feature layers) and how a manifest names its model, so an
export is found and matched however the model was spelled or where its project moved."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)


def source_files(src: Any) -> list[Path]:
    """The files an export of model ``src`` (a ``ModelSource``) reads: its GGUF, or every file at
    the top of its transformers directory (config, weights and their index, tokenizer)."""
    if src.gguf_path is not None:
        return [src.gguf_path]
    return sorted(p for p in src.directory.iterdir() if p.is_file())


def stored_model_name(name: str) -> str:
    """How a manifest names a model or head directory: a local path made absolute, so that the
    export is found from any directory and one model has one name however it was typed; a
    built-in name as given."""
    from spec_plugins.models import BUILTIN_MODELS

    p = Path(name).expanduser()
    return str(p.resolve()) if name not in BUILTIN_MODELS and p.exists() else name


def exported_from(recorded: str, model: str) -> bool:
    """Whether an export recorded as made from ``recorded`` is ``model``'s: the same files however
    spelled, or (an export moved with its project: the recorded absolute path is gone) a model of
    the same directory or file name."""
    from spec_plugins.models import same_model

    if same_model(recorded, model):
        return True
    gone = Path(recorded).is_absolute() and not Path(recorded).exists()
    return gone and Path(recorded).name == Path(model).expanduser().name


def export_cache_dir(model: str, quantize: str = "none", dtype: str = "float32",
                     feature_layers: Sequence[int] | None = None) -> Path:
    """Where export-on-first-use puts a model's graphs, keyed by the source files' identity (path,
    size and nanosecond mtime of each: a stat per file, where a content digest would read
    gigabytes of weights on every load), the quantization scheme's name, the graph dtype and the
    decoder layers its ``features`` output returns (None: the default ones)."""
    from spec_plugins.graphs.io import OPSET
    from spec_plugins.graphs.manifest import EXPORTER_VERSION
    from spec_plugins.models import cache_dir, resolve_model

    src = resolve_model(model)
    files = [(f.resolve(), f.stat()) for f in source_files(src)]
    ident = [f"{f}:{st.st_size}:{st.st_mtime_ns}" for f, st in files]
    layers = [] if feature_layers is None else [f"layers={','.join(map(str, feature_layers))}"]
    key = "|".join([*ident, EXPORTER_VERSION, str(OPSET), quantize, dtype, *layers])
    suffix = ("" if quantize == "none" else f"-{quantize}") + ("" if dtype == "float32" else f"-{dtype}")
    return cache_dir("onnx", f"{src.name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}{suffix}")


def first_use_export(model: str, scheme: Any, dtype: str, layers: Sequence[int] | None) -> Path:
    """The cached export of ``model`` returning decoder ``layers`` (None: the default ones), made
    on first use. Named layers equal to the defaults share the default export: that one is used
    when present, and an export made for named layers that turn out to be the defaults (the
    manifest knows the layer count) becomes the default one, so each graph is exported once. A
    cached export that fails its manifest's checks is exported again (``cached_manifest``)."""
    from spec_plugins.graphs.quant import QuantScheme, check_gguf_source, scheme_name
    from spec_plugins.heads.eagle import default_feature_layers
    from spec_plugins.registry import EXPORTERS

    default = export_cache_dir(model, scheme_name(scheme), dtype)
    man = cached_manifest(default)
    if layers is None or man is not None and list(man.graph("verify").feature_layers) == list(layers):
        directory = default
    else:
        directory = export_cache_dir(model, scheme_name(scheme), dtype, layers)
        man = cached_manifest(directory)
    if man is None:
        check_gguf_source(QuantScheme(**scheme) if scheme else None, model)  # before tracing a graph the quantizer would then refuse
        # the exporters package, looked up by name
        man = EXPORTERS.get("onnx")(model, directory, quantize=scheme, dtype=dtype,
                                    feature_layers=None if layers is None else tuple(layers))
        n = man.graph("verify").num_layers
        if directory != default and list(default_feature_layers(n)) == list(layers or ()):
            if not (default / "manifest.json").is_file():
                os.replace(directory, default)
            directory = default  # (a racing process made it first: the same graph)
    return directory


def cached_manifest(directory: Path) -> Any:
    """The manifest of the cache's export ``directory``, or None where there is none to use: none
    made yet, or one that fails its checks (a graph or weights file truncated or replaced), which
    is removed with a warning. No command writes into the cache, so exporting again is the only
    repair; a user's ``path:`` export is never touched here."""
    from spec_plugins.graphs.manifest import Manifest, ManifestError

    if not (directory / "manifest.json").is_file():
        return None
    try:
        return Manifest.read(directory)
    except ManifestError as exc:
        log.warning("the cached export %s cannot be loaded (%s): exporting it again", directory, exc)
        shutil.rmtree(directory, ignore_errors=True)  # an unreadable manifest.json: the exporter would refuse it
        return None
