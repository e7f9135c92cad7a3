"""Export what a SpecConfig runs to ONNX: the target's verify graph and the draft graphs.

One entry point, :func:`export_config`, used by ``spec-plugins export onnx`` and by the ONNX
Runtime backend's export-on-first-use. Graphs are written to a temporary directory next to the
target and renamed into place at the end (``exporters.staging``), so an interrupted export (an
error, Ctrl-C, SIGTERM) never leaves a half-written directory; one killed outright leaves its
temporary one, which the next export to that target removes. Only a previous export (or an empty
directory) is ever replaced.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from spec_plugins.backends import hf_compat
from spec_plugins.backends.onnx_cache import stored_model_name
from spec_plugins.graphs.manifest import (FORMAT, MANIFEST_NAME, GraphEntry, Manifest, ManifestError,
                                          graph_files, library_versions, read_json)
from spec_plugins.exporters.onnx_verify import export_verify_graph, graph_context_cap
from spec_plugins.exporters.staging import move_into_place, staged
from spec_plugins.graphs.io import GRAPH_DTYPES, MAX_OPSET, MIN_OPSET, OPSET

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def graph_entry(name: str, model: Any, source: str, path: Path, opset: int = OPSET,
                feature_layers: tuple[int, ...] = ()) -> GraphEntry:
    """Export one decoder (target or draft model) in the verify-graph layout."""
    check_dtype(model, source)
    res = export_verify_graph(model, path, opset, feature_layers)
    s = res.shape
    return GraphEntry(name=name, kind="decoder_with_past", file=path.name, source_model=source, dtype=res.dtype,
                      num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                      hidden_size=s.hidden_size, vocab_size=s.vocab_size, max_context=s.max_context,
                      context_cap=graph_context_cap(model), inputs=res.inputs, outputs=res.outputs,
                      size_bytes=res.size_bytes, export_seconds=round(res.seconds, 3), feature_layers=list(res.feature_layers))


def check_dtype(model: Any, source: str) -> None:
    """Refuse a decoder whose dtype the graphs do not come in (bfloat16: the tracer fails on it
    and ONNX Runtime's CPU kernels lack it), before any tracing."""
    name = str(next(model.parameters()).dtype).removeprefix("torch.")
    if name not in GRAPH_DTYPES:
        raise ValueError(f"{source} is loaded as {name}; ONNX export writes {' or '.join(GRAPH_DTYPES)} graphs: "
                         f"set the model's dtype to {' or '.join(GRAPH_DTYPES)} in the config")


def check_opset(opset: int) -> None:
    """Refuse opsets the exporter does not write, naming the range it does."""
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset {opset} is not supported; the ONNX export writes opsets {MIN_OPSET}..{MAX_OPSET}")


def check_out_dir(out: Path, holds_previous: Callable[[Path], bool] | None = None,
                  what: str = f"ONNX export ({MANIFEST_NAME})") -> None:
    """Refuse an output directory that is not safe to replace: only a new path, an empty
    directory or a previous output of the same kind (``holds_previous``, by default an ONNX
    export's manifest.json; ``what`` names it) is replaced, and never the current directory or
    one above it. Shared by the ONNX export and the TensorRT builder."""
    here, target = Path.cwd().resolve(), out.resolve()
    if target == here or target in here.parents:
        raise ValueError(f"output directory {out} is the current directory or one above it; give a new directory "
                         "for the export (its contents would be replaced)")
    if out.is_symlink():
        raise ValueError(f"output directory {out} is a symbolic link; give the directory itself")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"output directory {out} exists and is not a directory")
    if any(out.iterdir()) and not (holds_previous or holds_manifest)(out):
        raise ValueError(f"output directory {out} is not empty and holds no {what}; refusing to replace it: "
                         "give a new or empty directory, or a previous one")


def holds_manifest(directory: Path, name: str = MANIFEST_NAME, error: type[Exception] = ManifestError,
                   fmt: str = FORMAT) -> bool:
    """Whether ``directory`` holds a manifest ``name`` of format ``fmt`` (any version): by default
    an ONNX export's; the TensorRT builder asks for its engine manifest."""
    try:
        _, data = read_json(directory, name, error, "", "")
    except error:
        return False
    return data.get("format") == fmt


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if e is not None:
        ids.update([e] if isinstance(e, int) else list(e))
    return sorted(ids)


def export_models(out: str | Path, target: tuple[Any, Any, str], draft: tuple[Any, str] | None = None,
                  pending: list[str] | None = None, opset: int = OPSET, log: Log = _quiet,
                  heads: list[tuple[str, Any, str]] | None = None,
                  feature_layers: tuple[int, ...] | None = None, quantize: Any = None) -> Manifest:
    """Write ``verify.onnx`` (+ ``draft.onnx``, head graphs), the tokenizer and ``manifest.json``.

    ``target`` is (model, tokenizer, source name); ``draft`` is (model, source name); ``heads``
    are (graph name, MedusaHeads or EagleDrafter, trained head directory). The verify graph
    also returns ``feature_layers`` (default: EAGLE-3's low/mid/high layers; () for none).
    ``quantize`` (an ``onnx_quantize.QuantScheme``) quantizes the decoder graphs' weights, or,
    a dict of graph name -> scheme (None: float), each graph with its own (a config's target and
    draft sections may differ); head graphs stay float, so their manifest entries carry no
    scheme and are checked as float. Local model and head paths are recorded absolute
    (``stored_model_name``)."""
    out = Path(out).absolute()
    target = (target[0], target[1], stored_model_name(target[2]))
    draft = (draft[0], stored_model_name(draft[1])) if draft is not None else None
    heads = [(name, head, stored_model_name(where)) for name, head, where in heads or []]
    check_opset(opset)
    check_dtype(target[0], target[2])  # before any directory is made
    if draft is not None:
        check_dtype(*draft)
    check_out_dir(out)
    with staged(out) as tmp:
        model, tok, source = target
        log(f"exporting verify graph of {source} ...")
        if feature_layers is None:
            from spec_plugins.heads.eagle import default_feature_layers

            feature_layers = default_feature_layers(int(hf_compat.decoder_layers(model)))
        graphs = [graph_entry("verify", model, source, tmp / "verify.onnx", opset, tuple(feature_layers))]
        log(f"  verify.onnx: {graphs[0].size_bytes / 2**20:.1f} MiB in {graphs[0].export_seconds:.1f} s")
        if draft is not None:
            dmodel, dsource = draft
            log(f"exporting draft graph of {dsource} ...")
            graphs.append(graph_entry("draft", dmodel, dsource, tmp / "draft.onnx", opset))
            log(f"  draft.onnx: {graphs[1].size_bytes / 2**20:.1f} MiB in {graphs[1].export_seconds:.1f} s")
        for head, whole, head_dir in heads:
            from spec_plugins.exporters.onnx_heads import export_head, head_graphs

            for name, module in head_graphs(head, whole):
                log(f"exporting {name} head graph from {head_dir} ...")
                graphs.append(export_head(module, tmp / f"{name}.onnx", name, source, head_dir, opset))
                log(f"  {name}.onnx: {graphs[-1].size_bytes / 2**20:.1f} MiB in {graphs[-1].export_seconds:.1f} s")
        for g in graphs:
            scheme = quantize.get(g.name) if isinstance(quantize, dict) else quantize
            if g.kind == "decoder_with_past" and scheme is not None:
                _quantize_entry(tmp, g, scheme, log)
        if tok is not None:
            tok.save_pretrained(str(tmp / "tokenizer"))
        man = Manifest(graphs=graphs, opset=opset, versions=library_versions(),
                       tokenizer="tokenizer" if tok is not None else None, eos_token_ids=_eos_ids(model, tok),
                       pending=list(pending or []))
        man.write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        move_into_place(tmp, out)
        return man


def _quantize_entry(directory: Path, g: GraphEntry, scheme: Any, log: Log) -> None:
    """Replace graph ``g``'s files (the graph and its weights: ``graph_files``) by its quantized
    version and record the scheme."""
    from spec_plugins.exporters.onnx_quantize import quantize_graph

    from spec_plugins.models import ModelNotFound, resolve_model

    src = directory / g.file
    dst = directory / f"{src.stem}.{scheme.name}.onnx"
    log(f"quantizing {g.name} ({scheme.name}) ...")
    try:
        gguf = resolve_model(g.source_model).gguf_path
    except ModelNotFound:
        gguf = None  # a model given otherwise than by a known name: only the rtn grid applies
    files = graph_files(src)
    info = quantize_graph(src, dst, scheme, gguf)
    for f in files:  # the graph's own: each graph of an export keeps its weights in its own file (gather_weights)
        f.unlink()
    g.file, g.size_bytes, g.quantization = dst.name, info["size_bytes"], info
    log(f"  {dst.name}: {info['size_bytes'] / 2**20:.1f} MiB in {info['seconds']:.1f} s "
        f"({info['quantized_matmuls']} MatMuls quantized)")


def export_config(config: Any, out: str | Path, opset: int = OPSET, log: Log = _quiet,
                  feature_layers: str = "auto", quantize: Any = None) -> Manifest:
    """Export the target (and the draft model or heads, if the proposer has them) of a SpecConfig.
    ``feature_layers``: ``auto`` (``export_layers``), ``none`` or a list. ``quantize``: as
    ``export_models`` takes it."""
    from spec_plugins.backends.torch_runtime import load_hf

    check_opset(opset)  # before any model loads
    check_out_dir(Path(out).absolute())
    tgt = config.target
    model, tok = load_hf(tgt.model, export_dtype(tgt), "cpu")
    draft = None
    heads: list[tuple[str, Any, str]] = []
    prop = config.proposer
    if prop is not None and prop.type == "draft_model":
        dm = prop.model
        dmodel, _ = load_hf(dm.model, export_dtype(dm), "cpu")
        draft = (dmodel, dm.model)
    elif prop is not None and prop.type in ("medusa", "eagle", "parallel"):
        from spec_plugins.heads import MedusaHeads
        from spec_plugins.proposers.medusa import resolve_head_dir
        from spec_plugins.registry import PROPOSERS

        where = str(resolve_head_dir(prop.heads))  # as the proposers find it: shipped examples from any directory
        # the proposer's own class, as the runtime loads it: a head of another kind is refused here
        cls = MedusaHeads if prop.type == "medusa" else PROPOSERS.get(prop.type).drafter_class
        heads.append((prop.type, cls.from_pretrained(where, model), where))
    layers = export_layers(feature_layers, tgt, prop, int(hf_compat.decoder_layers(model)))
    return export_models(out, (model, tok, tgt.model), draft, None, opset, log, heads, layers, quantize)


GRAPH_DTYPE_BACKENDS = ("torch", "onnxruntime")  # sections whose ``dtype`` is the weights' dtype


def export_dtype(section: Any) -> str:
    """The dtype ``load_hf`` loads a config section's model in for export: a torch or onnxruntime
    section's own ``dtype`` (``auto`` is float32 on this CPU load, as the onnxruntime runtime
    exports on first use). Any other backend's ``dtype`` means something else (llama.cpp: its KV
    cache's type, None for llama.cpp's default), so its model is exported in float32: a GGUF is
    dequantised by transformers (``load_hf``)."""
    if getattr(section, "backend", None) in GRAPH_DTYPE_BACKENDS:
        return section.dtype
    return "float32"


def export_layers(spec: str, target: Any, proposer: Any, num_layers: int) -> tuple[int, ...]:
    """The decoder layers the verify graph returns: ``spec``'s (--feature-layers); for ``auto``
    the config target's ``feature_layers`` where it sets them (so that target with ``path:``
    loads the export), else the drafter's (a hybrid's child's too, as the first-use export takes
    them), else low/mid/high. A target whose layers differ from ``spec`` or from its drafter's
    is refused, naming both, before anything is written."""
    from spec_plugins.heads.eagle import parse_feature_layers
    from spec_plugins.wiring import drafter_layers

    configured = getattr(target, "feature_layers", None)
    want = None if configured is None else parse_feature_layers(",".join(map(str, configured)) or "none",
                                                                num_layers)
    if spec != "auto":
        layers = parse_feature_layers(spec, num_layers)
        if want is not None and layers != want:
            raise ValueError(f"--feature-layers {spec} but the config's target says feature_layers: {list(want)}; "
                             "drop --feature-layers to export the config's layers, or make the two agree")
        return layers
    read = tuple(drafter_layers(proposer))
    if want is None:
        return read or parse_feature_layers("auto", num_layers)
    if read and read != want:
        raise ValueError(f"the config's target says feature_layers: {list(want)} but its drafter reads decoder "
                         f"layers {list(read)}; set the target's feature_layers to {list(read)} (or leave them out)")
    return want


def export_model(model: str, directory: str | Path, quantize: dict | None = None, dtype: str = "float32",
                 feature_layers: tuple[int, ...] | None = None) -> Manifest:
    """Export ``model`` in ``dtype`` as a lone verify graph into ``directory``, quantized with the
    scheme ``quantize`` (``QuantScheme`` fields) if given, returning the outputs of decoder layers
    ``feature_layers`` (None: the default low/mid/high): what ``backend: onnxruntime`` without
    a ``path`` does on first use (``EXPORTERS['onnx']``)."""
    from spec_plugins.backends.torch_runtime import load_hf
    from spec_plugins.exporters.onnx_quantize import QuantScheme

    from spec_plugins.heads.eagle import parse_feature_layers

    hf, tok = load_hf(model, dtype, "cpu")
    if feature_layers is not None:  # the same check as --feature-layers: layer outputs 1..num_layers
        spec = ",".join(map(str, feature_layers)) or "none"
        feature_layers = parse_feature_layers(spec, int(hf_compat.decoder_layers(hf)))
    return export_models(directory, (hf, tok, model), feature_layers=feature_layers,
                         quantize=QuantScheme(**quantize) if quantize else None)
