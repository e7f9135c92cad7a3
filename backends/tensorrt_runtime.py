"""TensorRT runtime: plans of the verify-graph layout, KV kept on the GPU between steps.

Engines come from ``spec-plugins export tensorrt`` (``exporters/tensorrt_build.py``). One
execution context per optimisation profile (``decode``, ``prefill``); every call sets the
input shapes, binds torch CUDA tensors with ``set_tensor_address`` and runs
``execute_async_v3`` on a torch CUDA stream of the runtime's own (as the ONNX Runtime runtime's
``create_session`` gives its session one), on which the profiles were set too. Stream waits
order the engine after the torch work on the caller's current stream that writes its inputs, and
that stream's later work (masks, KV gathers) after the engine, without host syncs. TensorRT is
never handed the default (null) stream: on it TensorRT adds device-wide synchronisations.

KV layout and the Runtime contract come from
:class:`~spec_plugins.backends.slot_runtime.SlotRuntime`, the hole-masked slot layer shared with
the torch and ONNX Runtime runtimes; each call's ``present = past + new`` becomes the next call's
past; ``commit`` / ``rollback`` / ``select_rows`` apply slot plans to those GPU tensors (crop or
tail gather, never a re-run of the prefix). This module adds only what is TensorRT: loading, the
version/GPU check, contexts and the engine call.

``tensorrt`` is imported only when a runtime is built, so configs naming this backend validate
on machines without it; building one there fails with the install hint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from spec_plugins.backends.base import RuntimeCapabilities, StepOutput, Want
from spec_plugins.backends.slot_runtime import SlotRuntime
from spec_plugins.slots import KVSlots
from spec_plugins.config import RuntimeConfig
from spec_plugins.graphs.engines import (BuildEnv, EngineEntry, EngineManifest, EngineManifestError,
                                                      check_compatible, torch_dtype_name)
from spec_plugins.graphs.profiles import Limits, bindings
from spec_plugins.registry import RegistryError, register_backend

INSTALL_HINT = ('Install it with `pip install "spec-plugins[tensorrt]"` (TensorRT >= 10 wheels, fetched '
                "from pypi.nvidia.com) on a machine with an NVIDIA GPU and a CUDA build of torch.")


class TensorRTUnavailable(RegistryError):
    """TensorRT or a CUDA device is missing (a LookupError, so the CLI prints it without a traceback)."""


def import_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailable(f"backend 'tensorrt' needs the tensorrt package, which is not installed "
                                  f"({exc}). {INSTALL_HINT}") from None
    return trt


def parse_cuda(name: str) -> torch.device:
    """``name`` as a torch CUDA device ('cuda', 'cuda:N'), or a ValueError: TensorRT runs on
    CUDA only, so 'cpu' or a typo is refused when the config is read, not when an engine loads."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"backend 'tensorrt' runs on CUDA devices only: device must be 'cuda' or 'cuda:N' "
                         f"(N a GPU index), got {name!r}")
    return dev


def cuda_device(name: str) -> torch.device:
    """The CUDA device ``name`` names, with the current device for a bare 'cuda'; needs a GPU."""
    dev = parse_cuda(name)
    if not torch.cuda.is_available():
        raise TensorRTUnavailable("backend 'tensorrt' needs a CUDA GPU, but torch sees none "
                                  f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def engine_tokenizer(directory: Path) -> Any:
    """The tokenizer the ONNX export saved next to the graphs (copied into the engine dir), or None
    where the engine dir holds none (``spec_plugins.models.load_tokenizer``: failures name it)."""
    from spec_plugins.models import load_tokenizer

    return load_tokenizer(str(directory)) if directory.is_dir() else None


def engine_context(limits: Limits, model: dict, asked: int | None) -> int:
    """The positions a runtime holds: ``asked`` (a config's max_context), at most what the engine
    was built for (its --max-context, within the model's positions); more is refused, as the torch
    and ONNX Runtime runtimes refuse a context above their model's, rather than silently lowered."""
    limit = min(limits.max_context, int(model["max_context"]))
    if asked is not None and asked > limit:
        raise ValueError(f"max_context {asked} exceeds the {limit} positions this engine was built for "
                         f"(--max-context {limits.max_context}); use max_context <= {limit} or rebuild the "
                         "engines with a larger --max-context")
    return asked or limit


@register_backend("tensorrt")
class TensorRTRuntime(SlotRuntime):
    """A TensorRT engine of the verify-graph layout with a batched, hole-masked KV on the GPU."""

    class Config(RuntimeConfig):
        backend: Literal["tensorrt"] = "tensorrt"
        engine_dir: str = Field(description="Directory written by `spec-plugins export tensorrt`.")
        model: str = Field("", description="The model the engines were built from, where it is now: trained heads "
                                            "load its LM head and embeddings (default: the manifest's source_model; "
                                            "the engine dir holds the tokenizer).")
        graph: str = Field("verify", description="Engine to run: 'verify' (a target) or 'draft' (a draft model).")
        device: str = Field("cuda", description="CUDA device: 'cuda', 'cuda:1', ...")
        allow_gpu_mismatch: bool = Field(
            False, description="Run engines built on another GPU model of the same compute capability.")
        max_context: int | None = Field(None, ge=2,
                                        description="Cap on positions (at most the engines' --max-context; "
                                                    "more is refused).")

        @field_validator("device")
        @classmethod
        def _check_device(cls, value: str) -> str:
            """A CUDA device torch can parse (no GPU needed to validate a config)."""
            parse_cuda(value)
            return value

    @classmethod
    def from_config(cls, config: "TensorRTRuntime.Config") -> "TensorRTRuntime":
        trt = import_tensorrt()
        device = cuda_device(config.device)
        directory = Path(config.engine_dir)
        man = EngineManifest.read(directory)
        check_compatible(man.env, BuildEnv.current(device.index or 0), config.allow_gpu_mismatch,
                         man.hardware_compatibility)
        engine_context(man.limits_object(), man.engine(config.graph).model, config.max_context)  # before the plan
        plan = man.check_plan(directory, config.graph)
        tok = engine_tokenizer(directory / man.tokenizer) if man.tokenizer else None
        rt = cls(trt, plan, man.engine(config.graph), man.limits_object(), device, tok, config.max_context)
        rt.eos_token_ids = list(man.eos_token_ids)
        rt.source_model = config.model or rt.source_model  # the built-from model where it is now, if named
        return rt

    def __init__(self, trt: Any, plan: bytes, entry: EngineEntry, limits: Limits, device: torch.device,
                 tokenizer: Any = None, max_context: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids: list[int] = []
        self.inputs, self.outputs = entry.inputs, entry.outputs
        profiles = entry.profile_objects()
        with torch.cuda.device(device):
            self._logger = trt.Logger(trt.Logger.WARNING)
            self._trt_runtime = trt.Runtime(self._logger)
            self.engine = self._trt_runtime.deserialize_cuda_engine(plan)
            if self.engine is None:
                raise EngineManifestError(f"TensorRT could not deserialise engine {entry.name!r} (see its log above)")
            if self.engine.num_optimization_profiles != len(profiles):
                raise EngineManifestError(f"engine {entry.name!r} has {self.engine.num_optimization_profiles} "
                                          f"profiles, its manifest lists {len(profiles)}; rebuild the engines")
            dtypes = self._io_dtypes(trt)
            # torch's streams come from a pool that lives as long as the process: the handle stays valid
            self._stream = torch.cuda.Stream(device)
            self.contexts = []
            for i in range(len(profiles)):  # one context per profile: switching profiles costs a sync
                ctx = self.engine.create_execution_context()
                ctx.set_optimization_profile_async(i, self._stream.cuda_stream)  # ordered before every enqueue
                self.contexts.append(ctx)
        self._scratch = torch.empty(256, dtype=torch.uint8, device=device)  # address for empty tensors
        self._init_layout(profiles, limits, entry.model, dtypes, device, max_context)

    def _init_layout(self, profiles: list, limits: Limits, model: dict, dtypes: dict[str, torch.dtype],
                     device: torch.device, max_context: int | None) -> None:
        """Sizes and names of the verify-graph layout, from the manifest (no engine calls)."""
        self.profiles, self.limits, self._dtypes, self.device = profiles, limits, dtypes, device
        self.vocab_size = int(model["vocab_size"])
        # trained heads load the LM head and embeddings from the model the engine was built from
        self.source_model = model.get("source_model") or None
        self.max_context = engine_context(limits, model, max_context)
        self.max_slots = limits.max_context  # the engines' past axis P is bounded
        self.prefill_chunk = max(p.ranges["N"][2] for p in profiles)
        self.max_draft_nodes = self.prefill_chunk - 1  # the widest step any profile binds: 1 + this (loop.capacity)
        self.mask_dtype = dtypes["attention_mask"]
        has_hidden = any(t["name"] == "hidden" for t in self.outputs)
        layers = tuple(model.get("feature_layers") or ()) if any(t["name"] == "features" for t in self.outputs) else ()
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=has_hidden, feature_layers=layers,
                                                name="tensorrt")
        self._past_names = [t["name"] for t in self.inputs if t["name"].startswith("past_")]
        self._present_names = [n.replace("past_", "present_", 1) for n in self._past_names]  # past i -> present i
        kv = next(t["shape"] for t in self.inputs if t["name"].startswith("past_"))
        self._kv_heads, self._head_dim = int(kv[1]), int(kv[3])
        self.slots = KVSlots()
        self.kv: list[torch.Tensor] = []  # per layer key, value: [B, H_kv, S, D] on ``device``

    def _io_dtypes(self, trt: Any) -> dict[str, torch.dtype]:
        """Torch dtype of every engine I/O tensor; the engine's names must be the manifest's."""
        eng = self.engine
        got = {eng.get_tensor_name(i) for i in range(eng.num_io_tensors)}
        want = {t["name"] for t in self.inputs + self.outputs}
        if got != want:
            raise EngineManifestError(f"engine I/O {sorted(got)} differs from the manifest's {sorted(want)}")
        for t in self.inputs:
            if eng.get_tensor_mode(t["name"]) != trt.TensorIOMode.INPUT:
                raise EngineManifestError(f"engine tensor {t['name']!r} is not an input")
        return {n: getattr(torch, torch_dtype_name(eng.get_tensor_dtype(n).name)) for n in got}

    # ---- the engine call ---------------------------------------------------------------------------
    def _reset_kv(self, rows: int) -> None:
        dt = self._dtypes[self._past_names[0]]
        self.kv = [torch.empty(rows, self._kv_heads, 0, self._head_dim, dtype=dt, device=self.device)
                   for _ in self._past_names]

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, want_hidden: Want,
              prefill: bool) -> StepOutput:
        """Pick the profile and exact shapes (``graphs.profiles.bindings``), bind and run; the
        presents become the next call's past. Engine inputs must be dense, hence ``contiguous``."""
        B, N = ids.shape
        P = int(self.kv[0].shape[2])
        bd = bindings(self.inputs, self.outputs, self.profiles, B, N, P, "prefill" if prefill else "decode")
        dev, dt = self.device, self._dtypes
        feeds = {"input_ids": ids.to(dev, dt["input_ids"]).contiguous(),
                 "position_ids": pos.to(dev, dt["position_ids"]).contiguous(),
                 "attention_mask": mask.to(dev, dt["attention_mask"]).contiguous(),
                 **{n: t.contiguous() for n, t in zip(self._past_names, self.kv)}}
        for name, t in feeds.items():
            if tuple(t.shape) != bd.inputs[name]:
                raise RuntimeError(f"internal: input {name} has shape {tuple(t.shape)}, bindings say {bd.inputs[name]}")
        outs = self._run_engine(bd.profile, feeds, bd.outputs)
        self.kv = [outs[n] for n in self._present_names]
        name = "features" if isinstance(want_hidden, tuple) and want_hidden else "hidden"
        return StepOutput(outs["logits"].float(), outs[name] if want_hidden else None)

    def add_rows(self, rows: Any, want_hidden: Want = False) -> StepOutput:
        if not self.slots.pending_commit and self.slots.rows + len(rows) > self.limits.max_batch:
            raise ValueError(f"{self.slots.rows} running + {len(rows)} new rows exceed the engine's max batch "
                             f"{self.limits.max_batch} (rebuild with a larger --max-batch)")
        return super().add_rows(rows, want_hidden)

    def _addr(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self._scratch.data_ptr()

    def _run_engine(self, profile: int, feeds: dict[str, torch.Tensor],
                    out_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Bind torch CUDA tensors by address and enqueue on the runtime's stream, between stream
        waits on the caller's current stream (no host sync), with the runtime's device current, as
        when its engine and contexts were made (a caller on another device, e.g. a draft on cuda:1
        beside a target on cuda:0, would else run them there). Every bound tensor is recorded on
        the runtime's stream, so the caching allocator hands its memory to no other stream's work
        before the engine is done with it, whichever stream the caller runs on next."""
        ctx = self.contexts[profile]
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            for name, t in feeds.items():
                ctx.set_input_shape(name, tuple(t.shape))
                ctx.set_tensor_address(name, self._addr(t))
            outs = {}
            for name, shape in out_shapes.items():
                got = tuple(ctx.get_tensor_shape(name))
                if got != shape:
                    raise RuntimeError(f"engine output {name} has shape {got}; the manifest layout gives {shape}")
                outs[name] = torch.empty(shape, dtype=self._dtypes[name], device=self.device)
                ctx.set_tensor_address(name, self._addr(outs[name]))
            for t in (*feeds.values(), *outs.values()):
                t.record_stream(self._stream)
            self._stream.wait_stream(current)  # inputs written, output memory free
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
            current.wait_stream(self._stream)  # the caller's next work reads the outputs
        return outs
