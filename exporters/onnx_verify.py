"""The ONNX verify graph: one decoder step over N new nodes with an explicit KV past, the same
layout for a target's verify graph and a draft model's graph. The layout (inputs, outputs,
shapes) is written down once, in ``spec_plugins.graphs.io``, shared with the runtimes.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from io import BufferedReader
from pathlib import Path
from typing import Any, BinaryIO

import torch

from spec_plugins.backends import hf_compat
from spec_plugins.graphs.io import OPSET, DecoderShape, input_names, io_spec, output_names, present_names
from spec_plugins.graphs.manifest import graph_files
# The dummy input used for tracing. N must be > 1: transformers' SDPA wrapper picks a
# single-query GQA packing path for N == 1, which the tracer would freeze into the graph.
_TRACE_B, _TRACE_N, _TRACE_P = 2, 3, 4
# (B, N, P) the exported graph is run at against the model (``check_traced``): token counts (B*N) and
# batch sizes unlike the trace's, one of them a single new token.
_CHECK_SHAPES = ((1, 5, 3), (3, 1, 6))
# A frozen step computes something else, off by about the outputs' whole scale; float rounding over
# many layers (the KV outputs too) must not be mistaken for it: the check's bound, not export check's.
_CHECK_RTOL = 1e-2


class UnsupportedModel(ValueError):
    """The model cannot be exported with the verify-graph layout (the message says why)."""


def check_exportable(model: Any) -> None:
    """Refuse models whose cache is not one plain growing KV per layer, that place tokens by cache
    slot rather than by ``position_ids`` (``hf_compat.slot_positioned``: ALiBi, GPT-Neo's local
    layers), or whose attention a window limits within the context: the graph's attention sees all
    of its past, as the runtime's mask says (``hf_compat.mask_layout`` reads the window as the torch
    runtime does)."""
    cfg = hf_compat.text_config(model)
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel("encoder-decoder models are not supported by the verify graph")
    if (why := hf_compat.slot_positioned(model)) is not None:  # the graph's positions come from position_ids
        raise UnsupportedModel(why)
    name = type(model).__name__
    try:
        window = hf_compat.mask_layout(model).window
    except ValueError as exc:
        raise UnsupportedModel(f"{exc}; the ONNX verify graph supports full-attention decoders only") from None
    context = hf_compat.context_limit(model)
    if window is not None and window < context:
        raise UnsupportedModel(
            f"{name} attends within a sliding window (sliding_window={window}, below its context of {context}); "
            "the ONNX verify graph supports full-attention decoders only (sliding-window and hybrid models are "
            "not exported: run them on the torch backend)")


def graph_context_cap(model: Any) -> int | None:
    """The positions the graph is exact for (the manifest's ``context_cap``): where the model's
    positions stop being exact (``hf_compat.context_cap``) and its sliding window. The graph
    attends to all of its past, and ``check_exportable`` lets a window through only at or past the
    model's context, so a runtime that held more positions than the window would attend past it."""
    caps = (hf_compat.context_cap(model), hf_compat.mask_layout(model).window)
    return min((c for c in caps if c is not None), default=None)


def graph_shape(model: Any) -> DecoderShape:
    """The decoder's graph shape, its context capped where positions stop being exact
    (``hf_compat.context_limit``: the graph computes positions as the model does)."""
    return replace(DecoderShape.of(model), max_context=hf_compat.context_limit(model))


class VerifyGraph(torch.nn.Module):
    """Wraps a transformers causal LM: past tensors in, (logits, hidden, [features], presents) out.

    The past is put into a DynamicCache whose ``update`` concatenates the new keys/values, so
    the presents are past + new, as the graph layout promises. ``feature_layers`` adds the
    outputs of those decoder layers (EAGLE-3 drafters read them)."""

    def __init__(self, model: Any, feature_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.feature_layers = tuple(feature_layers)
        self.shape = graph_shape(model)

    def forward(self, input_ids, position_ids, attention_mask, *past):
        cache = hf_compat.full_cache(list(past))
        kw = {hf_compat.cache_keyword(self.model): cache}  # 'cache' or 'past_key_values' by version
        kw.update(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True)
        # ``forward`` called directly, not the module: the exporter then opens no scope for the causal LM
        # and the graph's node names stay those of its parts (the quantizer finds "/lm_head/MatMul")
        logits, h, feats = hf_compat.logits_and_hidden(self.model.forward, kw, self.feature_layers)
        if not torch.onnx.is_in_onnx_export():  # the parity reference: a cache this version ignored fails here
            hf_compat.check_cache_grew(cache, int(past[0].shape[-2]) if past else 0, int(input_ids.shape[1]),
                                       self.model)
        presents = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return (logits.float(), h, *([feats] if feats is not None else []), *presents)


def dummy_inputs(shape: DecoderShape, B: int, N: int, P: int, dtype: torch.dtype = torch.float32,
                 tree: torch.Tensor | None = None, generator: torch.Generator | None = None) -> tuple:
    """Random inputs of the verify layout: random ids, past of length P, a causal (or tree) mask."""
    g = generator
    ids = torch.randint(0, shape.vocab_size, (B, N), generator=g)
    pos = (torch.arange(N) + P)[None].expand(B, N).contiguous()
    anc = tree if tree is not None else torch.ones(N, N, dtype=torch.bool).tril()
    if tree is not None:  # tree nodes sit at past + depth
        pos = (anc.sum(-1) - 1 + P)[None].expand(B, N).contiguous()
    ok = torch.cat([torch.ones(N, P, dtype=torch.bool), anc], -1)
    mask = torch.zeros(B, 1, N, P + N, dtype=dtype).masked_fill_(~ok[None, None], torch.finfo(dtype).min)
    past = [torch.randn(B, shape.num_kv_heads, P, shape.head_dim, generator=g).to(dtype)
            for _ in range(2 * shape.num_layers)]
    return (ids, pos, mask, *past)


@dataclass(frozen=True)
class ExportResult:
    path: Path
    seconds: float
    size_bytes: int
    inputs: list[dict]
    outputs: list[dict]
    shape: DecoderShape
    dtype: str
    feature_layers: tuple[int, ...] = ()


@torch.no_grad()
def export_verify_graph(model: Any, path: str | Path, opset: int = OPSET, feature_layers: tuple[int, ...] = ()
                        ) -> ExportResult:
    """Trace ``model`` into ``path`` (legacy TorchScript exporter) and validate with onnx.checker.

    The TorchScript exporter is used because it handles transformers' Python-side cache and
    mask code with dynamic axes reliably; the dynamo exporter is not needed for this layout."""
    import warnings

    import onnx

    check_exportable(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = VerifyGraph(model, feature_layers).eval()
    shape = wrapper.shape
    p0 = next(model.parameters())
    dtype = p0.dtype
    dname = str(dtype).removeprefix("torch.")
    args = tuple(a.to(p0.device) for a in dummy_inputs(shape, _TRACE_B, _TRACE_N, _TRACE_P, dtype))
    L = shape.num_layers
    ins, outs = input_names(L), output_names(L, bool(feature_layers))
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "B", 1: "N"}, "position_ids": {0: "B", 1: "N"}, "attention_mask": {0: "B", 2: "N", 3: "T"},
        "logits": {0: "B", 1: "N"}, "hidden": {0: "B", 1: "N"}, "features": {0: "B", 1: "N"},
    }
    axes.update({n: {0: "B", 2: "P"} for n in ins[3:]})
    axes.update({n: {0: "B", 2: "T"} for n in present_names(L)})
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about transformers' shape checks
        try:
            torch.onnx.export(wrapper, args, str(path), input_names=ins, output_names=outs, dynamic_axes=axes,
                              opset_version=opset, dynamo=False, do_constant_folding=True)
        except (OSError, MemoryError, ImportError):  # the machine's or the install's, not the model's
            raise
        except Exception as exc:  # an op or a shape rule the TorchScript exporter lacks
            if _out_of_memory(exc):
                raise
            raise UnsupportedModel(f"{family(model)} cannot be traced into the ONNX verify graph "
                                   f"({type(exc).__name__}: {_first_line(exc)}); run it on the torch backend"
                                   ) from exc
    size = gather_weights(path)
    onnx.checker.check_model(str(path))  # by path: works above the 2 GB protobuf limit too
    try:
        check_traced(path, wrapper, p0.device)
    except UnsupportedModel:
        for f in graph_files(path):  # a graph that computes something else is not left behind
            f.unlink()
        raise
    seconds = time.perf_counter() - t0
    spec_in, spec_out = io_spec(shape, dname, tuple(feature_layers))
    return ExportResult(path, seconds, size, spec_in, spec_out, shape, dname, tuple(feature_layers))


def family(model: Any) -> str:
    """The model's class and ``model_type``, as error messages name a family."""
    return f"{type(model).__name__} (model_type {getattr(hf_compat.text_config(model), 'model_type', '?')})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the machine's (an allocation failed), not the model's: raised as it is."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or any(
        s in text for s in ("out of memory", "can't allocate", "cannot allocate", "failed to allocate", "bad_alloc"))


@torch.no_grad()
def check_traced(path: Path, wrapper: VerifyGraph, device: torch.device) -> None:
    """Run graph ``path`` at the shapes ``_CHECK_SHAPES`` against ``wrapper``'s model, every output
    held to the parity rule (at ``_CHECK_RTOL``, or the graph dtype's looser ``parity_rule.RTOL``). The tracer records one path
    through the model's Python: a step whose shapes depend on the data (an MoE that splits the
    tokens among its experts by counts) is frozen at the trace's, and the graph, though valid,
    computes something else (or fails) at other token counts. Refused by name rather than written."""
    from spec_plugins.backends.onnxruntime_runtime import create_session
    from spec_plugins.exporters.parity_rule import RTOL, compare

    session = create_session(path, "cpu")
    names = [i.name for i in session.get_inputs()]
    dtype = next(wrapper.model.parameters()).dtype
    rtol = max(_CHECK_RTOL, RTOL[str(dtype).removeprefix("torch.")])  # the graph dtypes (check_dtype ran)
    gen = torch.Generator().manual_seed(0)
    for B, N, P in _CHECK_SHAPES:
        args = dummy_inputs(wrapper.shape, B, N, P, dtype, generator=gen)
        want = wrapper(*(a.to(device) for a in args))
        where = f"B={B} N={N} P={P} (traced at B={_TRACE_B} N={_TRACE_N} P={_TRACE_P})"
        try:
            got = session.run(None, {k: v.numpy() for k, v in zip(names, args)})
        except Exception as exc:  # ONNX Runtime's errors are its own classes
            if _out_of_memory(exc):
                raise
            raise UnsupportedModel(f"the ONNX verify graph of {family(wrapper.model)} fails at {where}: "
                                   f"{_first_line(exc)}; its trace froze a data-dependent step (such as an "
                                   "MoE's expert routing): run it on the torch backend") from exc
        for out, g, w in zip(session.get_outputs(), got, want):
            case = compare("verify", where, g, w.cpu(), rtol, output=out.name)
            if not case.ok:
                raise UnsupportedModel(
                    f"the ONNX verify graph of {family(wrapper.model)} computes another {out.name} than the "
                    f"model at {where}: max|diff| {case.max_abs:.3g} > {rtol:g} x max|model| {case.ref_scale:.3g}; "
                    "its trace froze a data-dependent step (such as an MoE's expert routing): run it on the "
                    "torch backend")


def gather_weights(path: Path) -> int:
    """Keep graph ``path``'s external weights in one file, ``<file>.data``, and return the bytes
    its files hold together (the manifest's ``size_bytes``). Above 2 GiB torch's exporter writes
    each weight to a file of its own, named after the tensor: graphs exported into one directory
    would overwrite each other's, and a graph whose weights sit in a file of its own name can be
    replaced (the quantizer) without touching another's. A graph holding its weights, or already
    in one ``<file>.data``, is left as it is."""
    files = graph_files(path)
    data = path.with_name(path.name + ".data")
    if files[1:] not in ([], [data]):
        stream_weights(path, data)
        files = graph_files(path)
    return sum(f.stat().st_size for f in files)


_CHUNK = 16 << 20  # bytes copied at a time: what the gathering holds in memory


def stream_weights(path: Path, data: Path) -> None:
    """Move graph ``path``'s external weights into ``data``, file by file, each deleted once copied:
    the graph is read without its weights, so a first-use export (the torch model still in memory)
    holds one chunk more, not the model again, and the disk holds each weight once, not twice. The
    weights follow each other unpadded, as onnx's own writer lays them out (``onnx.save_model``)."""
    import onnx
    from onnx.external_data_helper import (
        ExternalDataInfo,
        set_external_data,
        uses_external_data,
    )

    from spec_plugins.graphs.manifest import unreadable_weights

    if (why := unreadable_weights(path)) is not None:
        raise ValueError(f"cannot gather the weights of graph {path}: {why}")
    model = onnx.load(str(path), load_external_data=False)
    tensors = [t for t in model.graph.initializer if uses_external_data(t)]
    infos = [ExternalDataInfo(t) for t in tensors]
    sources = {i.location: (path.parent / i.location).resolve() for i in infos}  # by file: any spelling
    held = [loc for loc, f in sources.items() if f == data.resolve()]
    if held:  # weights already in ``data`` are copied from it under another name
        aside = data.replace(data.with_name(data.name + ".gathering"))
        sources.update({loc: aside for loc in held})
    else:
        data.unlink(missing_ok=True)
    uses = Counter(sources[i.location] for i in infos)
    with open(data, "xb") as out:  # created at the umask's mode, as the graph file
        for t, info in zip(tensors, infos):
            offset = out.tell()
            with open(sources[info.location], "rb") as f:
                f.seek(info.offset or 0)
                _copy(f, out, info.length)
            t.raw_data = b""  # set_external_data asks for the field, which a tensor read without its weights lacks
            set_external_data(t, data.name, offset, out.tell() - offset)
            t.ClearField("raw_data")
            src = sources[info.location]
            uses[src] -= 1
            if not uses[src]:
                src.unlink()
    onnx.save_model(model, str(path))  # the graph alone: no tensor holds its data


def _copy(src: BufferedReader, dst: BinaryIO, length: int | None) -> None:
    """Copy ``length`` bytes (None: the rest of the file) from ``src`` to ``dst`` through one buffer
    of ``_CHUNK`` bytes, reused: a chunk read into a new object would be held twice at a time."""
    buf = memoryview(bytearray(_CHUNK))
    left = length
    while left is None or left > 0:
        n = src.readinto(buf[:_CHUNK if left is None else min(_CHUNK, left)])
        if not n:
            break
        dst.write(buf[:n])
        left = None if left is None else left - n
