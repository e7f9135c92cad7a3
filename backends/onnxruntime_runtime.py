"""ONNX Runtime runtime over an exported verify graph (``spec_plugins.exporters``).

KV layout and bookkeeping follow ``torch_runtime.py``: per layer a key and a value tensor
[B, H_kv, S, D] with a shared slot axis, plus ``pos [B, S]`` (-1 = hole). The graph always
takes an additive mask [B, 1, N, S+N], so trees and holes cost nothing extra.

The KV lives in torch tensors on the session's device and is handed to ONNX Runtime by
pointer through IO binding, in both directions: the graph's ``present`` outputs are written
straight into tensors that become the next step's past, so nothing is copied between steps
(on CPU and CUDA alike). ``commit`` and ``rollback`` reuse the torch runtime's tail
compaction / crop on those tensors; the prefix is never re-run.

``onnxruntime`` is imported only when a session is built, so configs validate without it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from spec_plugins.backends.kv_slots import keep_index
from spec_plugins.backends.base import RuntimeCapabilities, StepOutput
from spec_plugins.config import RuntimeConfig
from spec_plugins.registry import register_backend
from spec_plugins.tree import TreeLayout

INSTALL_HINT = "install the [onnx] extra: pip install 'spec-plugins[onnx]' (or [gpu] for onnxruntime-gpu)"
_OPT_LEVELS = ("disable", "basic", "extended", "all")
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def import_ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(f"backend 'onnxruntime' needs the onnxruntime package; {INSTALL_HINT}") from exc
    return onnxruntime


def providers_for(device: str, available: Sequence[str]) -> list[str]:
    """Execution providers for a device setting; CUDA requested but absent is an error."""
    has_cuda = "CUDAExecutionProvider" in available
    if device == "cuda" and not has_cuda:
        raise RuntimeError(
            "device 'cuda' requested but this onnxruntime has no CUDAExecutionProvider (available: "
            f"{', '.join(available)}); install onnxruntime-gpu (pip install 'spec-plugins[gpu]') or set device: cpu"
        )
    if device == "cuda" or (device == "auto" and has_cuda):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def create_session(file: str | Path, device: str = "cpu", device_id: int = 0, graph_optimization: str = "all",
                   threads: int | None = None) -> Any:
    """An InferenceSession with the configured providers, optimisation level and threads."""
    ort = import_ort()
    providers = providers_for(device, ort.get_available_providers())
    so = ort.SessionOptions()
    if graph_optimization not in _OPT_LEVELS:
        raise ValueError(f"graph_optimization={graph_optimization!r}; allowed values: {', '.join(_OPT_LEVELS)}")
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, {
        "disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
        "all": "ORT_ENABLE_ALL"}[graph_optimization])
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    opts = [{"device_id": device_id} if p == "CUDAExecutionProvider" else {} for p in providers]
    return ort.InferenceSession(str(file), so, providers=providers, provider_options=opts)


def export_cache_dir(model: str) -> Path:
    """Where export-on-first-use puts a model's graphs, keyed by the source files' identity."""
    from spec_plugins.exporters.manifest import EXPORTER_VERSION
    from spec_plugins.exporters.onnx_verify import OPSET
    from spec_plugins.models import cache_root, resolve_model

    src = resolve_model(model)
    f = src.gguf_path or (src.directory / "config.json")
    st = f.stat()
    key = f"{f.resolve()}:{st.st_size}:{int(st.st_mtime)}:{EXPORTER_VERSION}:{OPSET}"
    return cache_root() / "onnx" / f"{src.name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


@register_backend("onnxruntime", install_hint=INSTALL_HINT)
class OnnxRuntime:
    """An exported decoder graph in an ONNX Runtime session with a batched, hole-masked KV cache."""

    class Config(RuntimeConfig):
        backend: Literal["onnxruntime"] = "onnxruntime"
        path: str | None = Field(
            None, description="Export directory (spec-plugins export onnx); None = export `model` on first use "
                              "into the cache (~/.cache/spec-plugins/onnx).")
        graph: str = Field("verify", description="Graph of the export to run: verify (target) or draft.")
        device: Literal["auto", "cpu", "cuda"] = Field(
            "auto", description="auto = CUDAExecutionProvider when onnxruntime has it, else CPUExecutionProvider.")
        device_id: int = Field(0, ge=0, description="CUDA device index.")
        graph_optimization: Literal["disable", "basic", "extended", "all"] = Field(
            "all", description="ONNX Runtime graph optimisation level.")
        threads: int | None = Field(None, ge=1, description="Intra-op threads (None = onnxruntime's default).")
        max_context: int | None = Field(None, ge=1, description="Override the model's context length.")

    @classmethod
    def from_config(cls, config: "OnnxRuntime.Config") -> "OnnxRuntime":
        from spec_plugins.exporters.manifest import Manifest

        import_ort()  # fail early with the install hint, before any export work
        if config.path is not None:
            directory = Path(config.path).expanduser()
        else:
            directory = export_cache_dir(config.model)
            if not (directory / "manifest.json").is_file():
                _export_on_first_use(config.model, directory)
        man = Manifest.read(directory)
        entry = man.graph(config.graph)
        if config.path is not None and entry.source_model != config.model:
            raise ValueError(
                f"target.path {directory} holds graph {config.graph!r} exported from model {entry.source_model!r}, "
                f"but the config says model: {config.model!r}; set model: {entry.source_model!r} or export again"
            )
        session = create_session(directory / entry.file, config.device, config.device_id,
                                 config.graph_optimization, config.threads)
        tok = None
        if man.tokenizer and (directory / man.tokenizer).is_dir():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(directory / man.tokenizer))
        return cls(session, entry, tok, config.max_context, man.eos_token_ids, config.device_id)

    def __init__(self, session: Any, entry: Any, tokenizer: Any = None, max_context: int | None = None,
                 eos_token_ids: Sequence[int] = (), device_id: int = 0) -> None:
        from spec_plugins.exporters.onnx_verify import input_names, output_names

        if entry.kind != "decoder_with_past":
            raise ValueError(f"graph {entry.name!r} is a {entry.kind} graph; the onnxruntime backend runs decoder "
                             "graphs (verify, draft)")
        self.session = session
        self.entry = entry
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        on_cuda = session.get_providers()[0] == "CUDAExecutionProvider"
        if on_cuda and not torch.cuda.is_available():
            raise RuntimeError("the CUDA execution provider keeps the KV cache in torch CUDA tensors, "
                               "but this torch has no CUDA; install a CUDA torch or set device: cpu")
        self.device = torch.device("cuda", device_id) if on_cuda else torch.device("cpu")
        self._ort_device = ("cuda", device_id) if on_cuda else ("cpu", 0)
        if entry.dtype not in _TORCH_DTYPES:
            raise ValueError(f"graph dtype {entry.dtype!r} is not supported; expected one of {list(_TORCH_DTYPES)}")
        self.dtype = _TORCH_DTYPES[entry.dtype]
        self.vocab_size = int(entry.vocab_size)
        self.max_context = int(max_context or entry.max_context)
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=True, batch=True, name="onnxruntime")
        self._in = input_names(entry.num_layers)
        self._out = output_names(entry.num_layers)
        self._scratch = torch.empty(16, dtype=torch.float32, device=self.device)
        self.kv: list[torch.Tensor] = []  # past_key.0, past_value.0, past_key.1, ... [B, H_kv, S, D]
        self.pos = torch.empty(0, 0, dtype=torch.long)
        self._next: list[int] = []
        self._holes = False
        self._tail: tuple[int, int] | None = None
        self._before: list[int] = []

    # ---- graph call ----------------------------------------------------------------------
    def _bind(self, io: Any, name: str, t: torch.Tensor, output: bool) -> None:
        """Hand ``t``'s memory to ONNX Runtime (no copy). Zero-size tensors (an empty past)
        still need a valid pointer, so they point at a small scratch buffer."""
        ptr = t.data_ptr() if t.numel() else self._scratch.data_ptr()
        dev, idx = self._ort_device
        (io.bind_output if output else io.bind_input)(name, dev, idx, _np(t.dtype), list(t.shape), ptr)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, want_hidden: bool) -> StepOutput:
        """One graph call; the presents replace ``self.kv``."""
        B, N = ids.shape
        S = self.kv[0].shape[2] if self.kv else 0
        e = self.entry
        dev = self.device
        if not self.kv:
            self.kv = [torch.empty(B, e.num_kv_heads, 0, e.head_dim, dtype=self.dtype, device=dev)
                       for _ in range(2 * e.num_layers)]
        feeds = [ids.to(dev, torch.long).contiguous(), pos.to(dev, torch.long).contiguous(),
                 mask.to(dev, self.dtype).contiguous()] + [t.contiguous() for t in self.kv]
        logits = torch.empty(B, N, self.vocab_size, dtype=torch.float32, device=dev)
        hidden = torch.empty(B, N, e.hidden_size, dtype=self.dtype, device=dev) if want_hidden else None
        presents = [torch.empty(B, e.num_kv_heads, S + N, e.head_dim, dtype=self.dtype, device=dev)
                    for _ in range(2 * e.num_layers)]
        io = self.session.io_binding()
        for name, t in zip(self._in, feeds):
            self._bind(io, name, t, output=False)
        self._bind(io, "logits", logits, output=True)
        if hidden is not None:
            self._bind(io, "hidden", hidden, output=True)
        for name, t in zip(self._out[2:], presents):
            self._bind(io, name, t, output=True)
        self.session.run_with_iobinding(io)
        self.kv = presents
        return StepOutput(logits, hidden)

    def _mask(self, new_pos: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
        """Additive mask [B, 1, N, S+N]: past slots that are not holes + ancestors in the tree."""
        B, N = new_pos.shape
        past_ok = (self.pos >= 0)[:, None, None, :].expand(B, 1, N, self.pos.shape[1])
        new_ok = anc[None, None].expand(B, 1, N, N)
        ok = torch.cat([past_ok, new_ok], dim=-1)
        return torch.zeros(ok.shape, dtype=self.dtype).masked_fill_(~ok, torch.finfo(self.dtype).min)

    # ---- Runtime contract -----------------------------------------------------------------
    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prefill needs at least one token per row")
        longest = max(len(r) for r in rows)
        if longest > self.max_context:
            raise ValueError(f"prompt of {longest} tokens exceeds the context of {self.max_context}")
        B = len(rows)
        ids = torch.zeros(B, longest, dtype=torch.long)
        pos = torch.full((B, longest), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            off = longest - len(r)  # left padding
            ids[b, off:] = torch.as_tensor(list(r), dtype=torch.long)
            pos[b, off:] = torch.arange(len(r))
        anc = torch.ones(longest, longest, dtype=torch.bool).tril()
        # a padding query attends to itself only, keeping softmax finite
        ok = (anc[None] & (pos >= 0)[:, None, :]) | torch.eye(longest, dtype=torch.bool)[None]
        mask = torch.zeros(B, 1, longest, longest, dtype=self.dtype).masked_fill_(~ok[:, None],
                                                                                   torch.finfo(self.dtype).min)
        self.kv = []
        out = self._run(ids, pos.clamp_min(0), mask, want_hidden)
        self.pos = pos
        self._holes = bool((pos < 0).any())
        self._next = [len(r) for r in rows]
        self._tail = None
        return StepOutput(out.logits[:, -1:], out.hidden)

    def forward(self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: bool = False) -> StepOutput:
        B, N = tokens.shape
        depth = tree.depth if tree is not None else torch.arange(N)
        new_pos = torch.tensor(self._next, dtype=torch.long)[:, None] + depth[None, :]
        if int(new_pos.max()) >= self.max_context:
            raise ValueError(f"position {int(new_pos.max())} exceeds the context of {self.max_context}")
        anc = tree.ancestors if tree is not None else torch.ones(N, N, dtype=torch.bool).tril()
        S = self.pos.shape[1]
        out = self._run(tokens, new_pos, self._mask(new_pos, anc), want_hidden)
        self.pos = torch.cat([self.pos, new_pos], dim=1)
        self._tail = (S, N)
        self._before = list(self._next)
        self._next = [n + int(depth.max()) + 1 for n in self._next]
        return out

    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        if self._tail is None:
            raise RuntimeError("commit() without a preceding forward()")
        S, N = self._tail
        self._tail = None
        counts = [len(k) for k in keep]
        m = max(counts)
        self._next = [n + c for n, c in zip(self._before, counts)]
        if all(list(k) == list(range(len(k))) for k in keep) and len(set(counts)) == 1:
            self._crop(S + m)  # every row keeps the same leading nodes (plain decoding: a no-op)
            return
        idx, tail_pos = keep_index(keep, self.pos[:, S:])
        gidx = idx.to(self.device)
        for i, t in enumerate(self.kv):
            g = gidx[:, None, :, None].expand(t.shape[0], t.shape[1], m, t.shape[3])
            self.kv[i] = torch.cat([t[:, :, :S], t[:, :, S:].gather(2, g)], dim=2)
        self.pos = torch.cat([self.pos[:, :S], tail_pos], dim=1)
        self._holes = bool((self.pos < 0).any())

    def _crop(self, slots: int) -> None:
        if self.kv and self.kv[0].shape[2] > slots:
            self.kv = [t[:, :, :slots] for t in self.kv]  # a view; made contiguous when next bound
        self.pos = self.pos[:, :slots]
        self._holes = bool((self.pos < 0).any())

    def rollback(self, lengths: Sequence[int]) -> None:
        self._tail = None
        lim = torch.tensor(list(lengths), dtype=torch.long)[:, None]
        self.pos = torch.where(self.pos < lim, self.pos, torch.full_like(self.pos, -1))
        live = (self.pos >= 0).any(0).nonzero()
        self._crop(int(live.max()) + 1 if live.numel() else 0)
        self._next = [min(n, int(L)) for n, L in zip(self._next, lengths)]

    def lengths(self) -> list[int]:
        return list(self._next)

    def select_rows(self, rows: Sequence[int]) -> None:
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        dev_idx = idx.to(self.device)
        self.kv = [t[dev_idx] for t in self.kv]
        self.pos = self.pos[idx]
        self._next = [self._next[r] for r in rows]
        self._holes = bool((self.pos < 0).any())
        live = (self.pos >= 0).any(0).nonzero()
        if live.numel() and int(live.max()) + 1 < self.pos.shape[1]:
            self._crop(int(live.max()) + 1)

    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: bool = False) -> StepOutput:
        """Prefill ``rows`` into the running batch (continuous batching), as the torch runtime
        does: prefill them alone, left-pad both caches with holes to one slot count, concatenate
        along the batch axis. Output as ``prefill``, for the new rows only."""
        if not self.kv or not self._next:
            return self.prefill(rows, want_hidden)
        if self._tail is not None:
            raise RuntimeError("add_rows() between forward() and commit()")
        old_kv, old_pos, old_next = self.kv, self.pos, self._next
        out = self.prefill(rows, want_hidden)
        S = max(old_pos.shape[1], self.pos.shape[1])

        def pad(t: torch.Tensor) -> torch.Tensor:  # left-pad the slot axis (dim 2) with zeros
            z = t.new_zeros(t.shape[0], t.shape[1], S - t.shape[2], t.shape[3])
            return torch.cat([z, t], dim=2) if z.shape[2] else t

        def pad_pos(p: torch.Tensor) -> torch.Tensor:
            return torch.cat([torch.full((p.shape[0], S - p.shape[1]), -1, dtype=torch.long), p], dim=1)

        self.kv = [torch.cat([pad(a), pad(b)], dim=0) for a, b in zip(old_kv, self.kv)]
        self.pos = torch.cat([pad_pos(old_pos), pad_pos(self.pos)], dim=0)
        self._next = list(old_next) + list(self._next)
        self._holes = bool((self.pos < 0).any())
        return out


def _np(dtype: torch.dtype) -> Any:
    import numpy as np

    return {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}[dtype]


def _export_on_first_use(model: str, directory: Path) -> None:
    """Export ``model`` (float32) as a lone verify graph into the cache directory."""
    from spec_plugins.backends.torch_runtime import load_hf
    from spec_plugins.exporters.onnx_export import export_models

    hf, tok = load_hf(model, "float32", "cpu")
    export_models(directory, (hf, tok, model))
