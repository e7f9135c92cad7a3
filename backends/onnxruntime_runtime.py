"""ONNX Runtime runtime over an exported verify graph (``spec_plugins.exporters``).

KV layout and bookkeeping are the slot layer's (``backends/slot_runtime.py``): per layer a key
and a value tensor [B, H_kv, S, D] with a shared slot axis, plus ``pos [B, S]`` (-1 = hole).
The graph always takes an additive mask [B, 1, N, S+N], so trees and holes cost nothing extra.

The KV lives in torch tensors on the session's device and is handed to ONNX Runtime by
pointer through IO binding, in both directions: the graph's ``present`` outputs are written
straight into tensors that become the next step's past, so nothing is copied between steps
(on CPU and CUDA alike). ``commit`` and ``rollback`` are slot plans applied to those tensors;
the prefix is never re-run.

``onnxruntime`` is imported only when a session is built, so configs validate without it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, model_validator

from spec_plugins.backends.base import RuntimeCapabilities, StepOutput, Want
from spec_plugins.backends.llamacpp_config import MAX_THREADS
from spec_plugins.backends.onnx_cache import exported_from, first_use_export
from spec_plugins.backends.onnx_providers import (  # callers import these from here too
    check_session_providers, check_torch_cuda, provider_options, providers_for, session_stream)
from spec_plugins.backends.slot_runtime import SlotRuntime
from spec_plugins.slots import KVSlots
from spec_plugins.config import RuntimeConfig
from spec_plugins.graphs.io import GRAPH_DTYPES, Port
from spec_plugins.registry import register_backend

INSTALL_HINT = "install the [onnx] extra: pip install 'spec-plugins[onnx]' (or [gpu] for onnxruntime-gpu)"
_OPT_LEVELS = ("disable", "basic", "extended", "all")
# the names an export's graphs have: the decoders (onnx_export.export_models) and the trained heads'
# graphs (proposer type, and its block graph: onnx_heads.head_graphs)
GraphName = Literal["verify", "draft", "medusa", "eagle", "eagle-block", "parallel", "parallel-block"]
_TORCH_DTYPES = {name: getattr(torch, name) for name in GRAPH_DTYPES}


def import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(f"backend 'onnxruntime' needs the onnxruntime package; {INSTALL_HINT}") from exc
    return onnxruntime


def create_session(file: str | Path, device: str = "cpu", device_id: int = 0, graph_optimization: str = "all",
                   threads: int | None = None, arena: bool = True, spinning: bool = False) -> Any:
    """An InferenceSession with the configured providers, optimisation level, threads, CPU memory
    arena and intra-op spinning (idle threads spin-wait for the next parallel section). On CUDA it
    runs on a torch stream of its own (``provider_options``); torch's streams come from a pool
    that lives as long as the process, so the session may keep the handle."""
    ort = import_ort()
    if device == "cuda":  # no CUDA in torch: the config's device field, named, before the providers' checks
        from spec_plugins.backends.torch_runtime import pick_device

        pick_device(device)
    providers = providers_for(device, ort.get_available_providers(), torch.cuda.is_available())
    stream = None
    if "CUDAExecutionProvider" in providers:  # torch has CUDA: device: cuda was checked above, auto asks torch
        stream = torch.cuda.Stream(torch.device("cuda", device_id)).cuda_stream
    so = ort.SessionOptions()
    if graph_optimization not in _OPT_LEVELS:
        raise ValueError(f"graph_optimization={graph_optimization!r}; allowed values: {', '.join(_OPT_LEVELS)}")
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, {
        "disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
        "all": "ORT_ENABLE_ALL"}[graph_optimization])
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.enable_cpu_mem_arena = arena
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    opts = provider_options(providers, device_id, stream)
    try:
        session = ort.InferenceSession(str(file), so, providers=providers, provider_options=opts)
    except load_errors(ort) as exc:
        from spec_plugins.graphs.manifest import ManifestError, unreadable_weights

        # a bare Fail is also a weights file it cannot read in full, or an opset it does not take;
        # any other Fail (a provider's) is not the file's and stays as it is
        bare = isinstance(exc, ort.capi.onnxruntime_pybind11_state.Fail)
        if bare and (why := unreadable_weights(Path(file))):
            raise ManifestError(f"ONNX Runtime cannot load graph {file}: {why}; export again") from exc
        if bare and "opset" not in str(exc).lower():
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ManifestError(f"ONNX Runtime cannot load graph {file}: {reason} (onnxruntime {ort.__version__}); if "
                            "the file is damaged (corrupted in place) or holds what this onnxruntime does not "
                            "support (an opset), export again") from exc
    check_session_providers(session, providers, device, file)  # ONNX Runtime falls back to the CPU silently
    return session


def load_errors(ort: Any) -> tuple[type[Exception], ...]:
    """ONNX Runtime's errors for a graph file it cannot load: one it cannot read, and its bare
    ``Fail``, which may be a graph it will not take (an opset it does not support, a weights file
    cut short: ``create_session`` tells those from a provider's, which re-exporting would not
    help). Caught around ``InferenceSession``'s construction only, so a step's failures are not
    taken for the file's."""
    state = ort.capi.onnxruntime_pybind11_state
    names = ("InvalidGraph", "InvalidProtobuf", "NoModel", "NoSuchFile", "Fail")
    return tuple(getattr(state, n) for n in names if hasattr(state, n))


@register_backend("onnxruntime", install_hint=INSTALL_HINT)
class OnnxRuntime(SlotRuntime):
    """An exported decoder graph in an ONNX Runtime session with a batched, hole-masked KV cache."""

    class Config(RuntimeConfig):
        backend: Literal["onnxruntime"] = "onnxruntime"
        path: str | None = Field(
            None, description="Export directory (spec-plugins export onnx); None = export `model` on first use "
                              "into the cache (~/.cache/spec-plugins/onnx).")
        graph: GraphName = Field(
            "verify", description="Graph of the export to run: verify (target) or draft (a draft model's; only "
                                  "`export onnx` of a draft_model config writes one). The head graphs' names are "
                                  "taken too, and refused on load by their kind: the head proposers "
                                  "on this target open those where they compute the proposer's head.")
        device: Literal["auto", "cpu", "cuda"] = Field(
            "auto", description="auto = CUDAExecutionProvider when onnxruntime has it and torch has CUDA, else "
                              "CPUExecutionProvider (with a warning where only onnxruntime has CUDA).")
        device_id: int = Field(0, ge=0, description="CUDA device index.")
        graph_optimization: Literal["disable", "basic", "extended", "all"] = Field(
            "all", description="ONNX Runtime graph optimisation level.")
        threads: int | None = Field(None, ge=1, le=MAX_THREADS,
                                    description="Intra-op threads (None = onnxruntime's default).")
        arena: bool = Field(True, description="ONNX Runtime's CPU memory arena (buffers reused between calls).")
        pad_single: bool | Literal["auto"] = Field(
            "auto", description="Run one-position forwards as two positions. auto: where the graph's quantized "
                                "MatMuls quantize activations (accuracy level >= 2), whose one-row kernel computes "
                                "a position differently from wider forwards; speculation needs them to agree.")
        spinning: bool = Field(
            False, description="Idle intra-op threads spin-wait instead of sleeping. Off by default: between "
                               "forwards the spinning threads take the cores from drafting and the decode loop "
                               "(measured here: EAGLE drafting 97 -> 57 ms per round, plain decoding not slower).")
        max_context: int | None = Field(None, ge=1, description="Override the model's context length.")
        feature_layers: list[int] | None = Field(
            None, description="Decoder layers whose outputs the graph exported on first use returns for an EAGLE-3 "
                              "or parallel drafter (its config.json's feature_layers; [] = none); None = the "
                              "default low/mid/high. With `path`, the export's own layers (then it must match).")
        dtype: Literal["auto", "float32", "float16"] = Field(
            "auto", description="Graph dtype. Without `path`: the dtype exported on first use (auto = float32); "
                                "with `path`: the export's own (auto = whatever it is; else it must match).")
        quantize: Literal["none", "int4", "int8"] = Field(
            "none", description="Weight-only quantization of the graph exported on first use (MatMulNBits); "
                                "with `path`, the export must have been made with the same scheme.")
        quant_block_size: int = Field(32, ge=16, description="Weights sharing one scale: 16, 32, 64, 128 or 256 "
                                                             "(the sizes ONNX Runtime's quantizer takes).")
        quant_symmetric: bool = Field(True, description="Symmetric blocks (no zero points).")
        quant_accuracy_level: int = Field(4, ge=0, le=4, description="ORT's compute accuracy (4 = int8 activations).")
        quant_lm_head: bool = Field(True, description="Quantize the LM head too (else it stays fp32).")
        quant_grid: Literal["rtn", "gguf"] = Field(
            "rtn", description="rtn: ONNX Runtime's round-to-nearest blocks; gguf: the source GGUF's own Q4_1/Q8_0 "
                               "blocks carried over (its weights exactly).")

        @model_validator(mode="after")
        def _device_id_that_applies(self) -> OnnxRuntime.Config:
            """``device_id`` picks a CUDA device: with ``device: cpu`` it would be ignored, so a
            value other than the default is refused by field (a dumped config carries every field)."""
            if self.device == "cpu" and "device_id" in self.model_fields_set and self.device_id != 0:
                raise ValueError(f"device_id: {self.device_id} picks a CUDA device, but device is cpu; set "
                                 "device: cuda (or auto) to run on that device, or leave device_id out")
            return self

        @model_validator(mode="after")
        def _quant_fields_that_apply(self) -> "OnnxRuntime.Config":
            """``quant_*`` fields change nothing without ``quantize``, and the gguf grid takes the
            GGUF's own bits, block and symmetry: refused here, by field, not after an export."""
            from spec_plugins.graphs.quant import QuantScheme, gguf_conflicts

            fields = type(self).model_fields  # a dumped config carries every field: only changed values count
            given = sorted(f for f in self.model_fields_set
                           if f.startswith("quant_") and getattr(self, f) != fields[f].default)
            if self.quantize == "none":
                if given:
                    raise ValueError(f"{', '.join(given)} set how weights are quantized; they do nothing with "
                                     "quantize: none (set quantize: int4 or int8, or leave them out)")
                return self
            scheme = QuantScheme(**self.scheme())  # type: ignore[arg-type]  # (a block size not a power of two)
            if self.quant_grid == "gguf" and (bad := gguf_conflicts(scheme)):
                fields = {"bits": f"quantize: {self.quantize}", "block_size": f"quant_block_size: {self.quant_block_size}",
                          "symmetric": "quant_symmetric: false"}
                raise ValueError(f"quant_grid: gguf carries the GGUF's own blocks (Q4_1 4-bit, Q8_0 8-bit, 32 weights a "
                                 f"block); it takes no {', '.join(fields[f] for f in bad)}: use quantize: int4 with the "
                                 "default quant_block_size and quant_symmetric")
            return self

        def scheme(self) -> dict | None:
            """The ``QuantScheme`` fields of ``quantize``, or None."""
            if self.quantize == "none":
                return None
            return {"bits": int(self.quantize[3:]), "block_size": self.quant_block_size,
                    "symmetric": self.quant_symmetric, "accuracy_level": self.quant_accuracy_level,
                    "lm_head": self.quant_lm_head, "grid": self.quant_grid}

    @classmethod
    def from_config(cls, config: "OnnxRuntime.Config") -> "OnnxRuntime":
        from spec_plugins.graphs.manifest import Manifest

        import_ort()  # fail early with the install hint, before any export work
        from spec_plugins.graphs.quant import scheme_name

        scheme = config.scheme()
        if config.path is not None:
            directory = Path(config.path).expanduser()
        else:
            dtype = "float32" if config.dtype == "auto" else config.dtype
            directory = first_use_export(config.model, scheme, dtype, config.feature_layers)
        man = Manifest.read(directory)
        entry = man.graph(config.graph)
        if config.dtype not in ("auto", entry.dtype):
            raise ValueError(f"path {directory} holds graph {config.graph!r} in {entry.dtype}, but the config "
                             f"asks for dtype: {config.dtype}; set dtype: {entry.dtype} (or auto) or export again "
                             f"from a torch target with dtype: {config.dtype}")
        have = (entry.quantization or {}).get("name", "none")
        if config.path is not None and have != scheme_name(scheme):
            raise ValueError(f"path {directory} holds graph {config.graph!r} quantized as {have!r}, but the "
                             f"config asks for {scheme_name(scheme)!r}; set quantize to match or export again")
        if config.feature_layers is not None and list(config.feature_layers) != list(entry.feature_layers):
            want = list(config.feature_layers)
            raise ValueError(f"path {directory} holds graph {config.graph!r} returning decoder layers "
                             f"{entry.feature_layers}, not feature_layers: {want}; set them to match or export "
                             f"again with --feature-layers {','.join(map(str, want)) or 'none'}")
        if config.path is not None and not exported_from(entry.source_model, config.model):
            raise ValueError(
                f"path {directory} holds graph {config.graph!r} exported from model {entry.source_model!r}, "
                f"but the config says model: {config.model!r}; set model: {entry.source_model!r} or export again"
            )
        session = create_session(directory / entry.file, config.device, config.device_id,
                                 config.graph_optimization, config.threads, config.arena, config.spinning)
        tok = None
        if man.tokenizer:  # Manifest.read checked that the directory exists
            from spec_plugins.models import load_tokenizer

            tok = load_tokenizer(str(directory / man.tokenizer))
        rt = cls(session, entry, tok, config.max_context, man.eos_token_ids, config.device_id)
        rt.source_model = config.model  # the export's model (``exported_from``), where it is now
        rt.export_dir = directory  # the head proposers open its head graphs (``heads.runner.export_graph``)
        rt.pad_single = rt.pad_single if config.pad_single == "auto" else bool(config.pad_single)
        rt.capabilities = replace(rt.capabilities, batch_invariant=not rt.single_differs or rt.pad_single)
        return rt

    def __init__(self, session: Any, entry: Any, tokenizer: Any = None, max_context: int | None = None,
                 eos_token_ids: Sequence[int] = (), device_id: int = 0) -> None:
        from spec_plugins.graphs.io import input_names, present_names
        from spec_plugins.graphs.manifest import check_decoder_io

        if entry.kind != "decoder_with_past":
            raise ValueError(f"graph {entry.name!r} is a {entry.kind} graph; the onnxruntime backend runs decoder "
                             "graphs (verify, draft)")
        check_decoder_io(entry, _ports(session.get_inputs()), _ports(session.get_outputs()))
        self.session = session
        self.entry = entry
        self.source_model = entry.source_model  # trained heads load the LM head and embeddings from it
        self.export_dir: Path | None = None  # the export it was loaded from (``from_config``)
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        on_cuda = session.get_providers()[0] == "CUDAExecutionProvider"
        if on_cuda:
            check_torch_cuda()
        self.device = torch.device("cuda", device_id) if on_cuda else torch.device("cpu")
        self._stream = session_stream(session, self.device) if on_cuda else None  # None: CPU, in order
        self._ort_device = ("cuda", device_id) if on_cuda else ("cpu", 0)
        if entry.dtype not in _TORCH_DTYPES:
            raise ValueError(f"graph dtype {entry.dtype!r} is not supported; expected one of {list(_TORCH_DTYPES)}")
        self.dtype = self.mask_dtype = _TORCH_DTYPES[entry.dtype]
        self.vocab_size = int(entry.vocab_size)
        cap = entry.context_cap
        if max_context and cap is not None and max_context > cap:  # where the model's positions stop being exact
            raise ValueError(f"max_context {max_context} exceeds the {cap} positions graph {entry.name!r} is exact for "
                             f"(its manifest's context_cap: a learned position table, a length-dependent rope or a "
                             f"sliding window); use max_context <= {cap}")
        self.max_context = int(max_context or entry.max_context)
        q = entry.quantization or {}
        # int8 activations (accuracy level >= 2): the one-row kernel differs from the wider ones
        self.single_differs = bool(q) and int(q.get("accuracy_level", 0)) >= 2
        self.pad_single = self.single_differs
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=True,
                                                feature_layers=tuple(entry.feature_layers), name="onnxruntime")
        self._in = input_names(entry.num_layers)
        self._presents = present_names(entry.num_layers)
        self._scratch = torch.empty(16, dtype=torch.float32, device=self.device)
        self.kv: list[torch.Tensor] = []  # past_key.0, past_value.0, past_key.1, ... [B, H_kv, S, D]
        self.slots = KVSlots()

    # ---- graph call ----------------------------------------------------------------------
    def _bind(self, io: Any, name: str, t: torch.Tensor, output: bool) -> None:
        """Hand ``t``'s memory to ONNX Runtime (no copy). Zero-size tensors (an empty past)
        still need a valid pointer, so they point at a small scratch buffer."""
        ptr = t.data_ptr() if t.numel() else self._scratch.data_ptr()
        dev, idx = self._ort_device
        (io.bind_output if output else io.bind_input)(name, dev, idx, _np(t.dtype), list(t.shape), ptr)

    def _reset_kv(self, rows: int) -> None:
        e = self.entry
        self.kv = [torch.empty(rows, e.num_kv_heads, 0, e.head_dim, dtype=self.dtype, device=self.device)
                   for _ in range(2 * e.num_layers)]

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, want_hidden: Want,
              prefill: bool) -> StepOutput:
        """One graph call (the graph always takes a mask: ``always_mask``); the presents
        replace ``self.kv``. One position is padded to two where the graph's kernels compute a
        lone position differently (``pad_single``)."""
        if self.pad_single and ids.shape[1] == 1:
            return self._call_padded(ids, pos, mask, want_hidden, prefill)
        B, N = ids.shape
        S = self.kv[0].shape[2]
        e, dev = self.entry, self.device
        feeds = [ids.to(dev, torch.long).contiguous(), pos.to(dev, torch.long).contiguous(),
                 mask.to(dev, self.dtype).contiguous()] + [t.contiguous() for t in self.kv]
        logits = torch.empty(B, N, self.vocab_size, dtype=torch.float32, device=dev)
        layers = want_hidden if isinstance(want_hidden, tuple) else ()
        if layers and layers != self.capabilities.feature_layers:
            raise ValueError(f"the drafter needs decoder layers {list(layers)}, but graph {e.name!r} returns "
                             f"{list(e.feature_layers) or 'none'}; export again with those --feature-layers")
        width = e.hidden_size * (len(layers) or 1)
        hidden = torch.empty(B, N, width, dtype=self.dtype, device=dev) if want_hidden else None
        presents = [torch.empty(B, e.num_kv_heads, S + N, e.head_dim, dtype=self.dtype, device=dev)
                    for _ in range(2 * e.num_layers)]
        io = self.session.io_binding()
        for name, t in zip(self._in, feeds):
            self._bind(io, name, t, output=False)
        self._bind(io, "logits", logits, output=True)
        if hidden is not None:
            self._bind(io, "features" if layers else "hidden", hidden, output=True)
        for name, t in zip(self._presents, presents):
            self._bind(io, name, t, output=True)
        if self._stream is not None:  # the graph's kernels start after torch's work on the inputs (any stream)
            self._stream.wait_stream(torch.cuda.current_stream(dev))
        self.session.run_with_iobinding(io)  # returns once the session's stream is done: outputs ready
        self.kv = presents
        return StepOutput(logits, hidden)

    def _call_padded(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, want_hidden: Want,
                     prefill: bool) -> StepOutput:
        """A one-position forward as a two-position one whose second position attends only to
        itself: the first position's result is the one a wider forward computes for it (ONNX
        Runtime's one-row MatMulNBits kernel quantizes activations differently from the wider
        kernels, which agree with each other)."""
        S = self.kv[0].shape[2]
        B = ids.shape[0]
        wide = torch.full((B, 1, 2, S + 2), torch.finfo(self.dtype).min, dtype=self.dtype, device=mask.device)
        wide[:, :, 0, : S + 1] = mask[:, :, 0, : S + 1]
        wide[:, :, 1, S + 1] = 0.0
        self.pad_single = False  # one real call, then back
        try:
            out = self._call(torch.cat([ids, ids], 1), torch.cat([pos, pos], 1), wide, want_hidden, prefill)
        finally:
            self.pad_single = True
        self.kv = [t[:, :, : S + 1] for t in self.kv]  # the padding position leaves no KV
        return StepOutput(out.logits[:, :1], out.hidden[:, :1] if out.hidden is not None else None)


def _ports(args: Sequence[Any]) -> dict[str, Port]:
    """A session's inputs or outputs as (dtype name, shape) by name: ``tensor(float)`` is float32."""
    names = {"float": "float32", "double": "float64"}
    out = {}
    for a in args:
        t = a.type.removeprefix("tensor(").removesuffix(")")
        out[a.name] = (names.get(t, t), list(a.shape))
    return out


def _np(dtype: torch.dtype) -> Any:
    import numpy as np

    return {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}[dtype]
