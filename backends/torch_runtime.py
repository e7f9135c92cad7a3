"""PyTorch runtime over transformers causal LMs (CPU here, CUDA where present).

KV layout: one transformers ``DynamicCache`` with a shared slot axis for the whole batch plus
``pos [B, S]``, the position of each slot (-1 = a hole: left padding, a rejected tree node, or a
token another row did not keep). Holes are masked out with a 4D additive attention mask, so rows
can accept different numbers of tokens without moving the cache. Fast path: one row, no holes,
a chain -> no mask at all (the model's own causal path). ``commit`` compacts only the tail
written by the last forward (O(draft) per round), ``rollback`` crops.

Sliding-window models (Gemma 2/3, Mistral ...): every layer's cache keeps every position
(``hf_compat.full_cache``) and the mask of a sliding layer is cut to its window by position
(``hf_compat.MaskLayout``); the fast path leaves both to the model's own mask code.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from spec_plugins.backends import hf_compat, torch_kernels
from spec_plugins.backends.base import RuntimeCapabilities, StepOutput, Want
from spec_plugins.backends.llamacpp_config import MAX_THREADS
from spec_plugins.backends.slot_runtime import SlotRuntime
from spec_plugins.slots import KVSlots
from spec_plugins.config import SWITCH, RuntimeConfig
from spec_plugins.transfer import upload

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    """The torch device a ``device`` setting names; a CUDA device this host lacks is a ValueError
    naming the field (a config error, as a mistyped device is), raised here, where the device is
    picked: a config may be written on one host and run on another."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} needs a CUDA device, but torch sees none on this host; "
                         "set device: cpu (or auto)")
    if dev.type == "meta":
        raise ValueError(f"device: {name!r} holds no data (shapes only): set device: cpu, cuda or auto")
    if dev.type not in ("cpu", "cuda") and not _available(dev.type):
        raise ValueError(f"device: {name!r}: this torch ({torch.__version__}) has no {dev.type} device on this host; "
                         "set device: cpu (or auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= (count := torch.cuda.device_count()):
        raise ValueError(f"device: {name!r}: torch sees {count} CUDA device(s) on this host (cuda:0 to "
                         f"cuda:{count - 1})")
    return dev


def _available(kind: str) -> bool:
    """Whether torch can run on an accelerator of ``kind`` other than CUDA (``mps``, ``xpu``, ...):
    its module's ``is_available()`` (mps's under ``torch.backends``). A kind with no such check (a
    privateuse1 backend, ``hpu`` from its own package) is left for torch to judge when used."""
    module = torch.backends.mps if kind == "mps" else getattr(torch, kind, None)
    check = getattr(module, "is_available", None)
    try:
        return bool(check()) if callable(check) else True
    except (RuntimeError, AssertionError):
        return False


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA (the runtime returns float32 logits for sampling), float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def selects_static(config: Any) -> bool:
    """Whether a torch config runs on the static cache: asked for, implied by compiling, or ``auto`` on
    CUDA (on a CPU compiling every bucket costs more than a generation wins back: docs/runtimes/torch.md)."""
    if config.kv != "auto":
        return config.kv == "static"
    return config.compile in ("on", "graphs") or pick_device(config.device).type == "cuda"


def static_by_config(config: Any) -> str | None:
    """The settings that select the static cache on any host, as the refusals name them (None: the
    growing cache on a CPU; ``kv: auto`` on CUDA picks the static cache, where the measured kernels
    never run anyway: they are CPU kernels)."""
    if config.kv != "auto":
        return "kv: static" if config.kv == "static" else None
    if config.compile in ("on", "graphs"):
        return f"kv: auto with compile: {config.compile}"
    return None


def _transposed_refusal(why: str) -> str:
    return (f"matmul: auto_transposed needs kv: dynamic (the growing cache), but {why} selects the static cache, "
            "which runs native kernels and would drop it: set kv: dynamic (with compile: off or auto) to keep "
            "the transposed kernels, or matmul: auto or native")


MASKED_ATTENTION = ("sdpa", "eager")  # transformers' attention functions that apply any 4D mask as given


def attention_implementation(model: Any) -> str:
    """The attention implementation of ``model``'s decoder, refused unless it applies this runtime's
    4D tree and hole masks exactly (additive floats on the growing cache; booleans for SDPA and
    additive floats for eager on the static one). transformers' ``flex_attention`` adds the mask to
    the scores (a boolean one hides nothing) and its flash attention reads a 2D padding mask only:
    either would decode with wrong masks and no error."""
    cfg = hf_compat.text_config(model)
    impl = getattr(cfg, "_attn_implementation", None) or "eager"  # None: transformers' attention runs eager
    if impl not in MASKED_ATTENTION:
        raise ValueError(f"{type(model).__name__} is loaded with attn_implementation={impl!r}, which does not "
                         "apply this runtime's 4D attention masks (draft trees, rows of different lengths) "
                         "exactly: load the model with attn_implementation=\"sdpa\" (or call "
                         "model.set_attn_implementation(\"sdpa\") on it)")
    return impl


def load_for(config: Any) -> tuple[Any, Any]:
    """The model and tokenizer a torch config names, on its device and in its dtype (threads set first)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    return load_hf(config.model, config.dtype, config.device)


def load_hf(model: str, dtype: str = "float32", device: str = "auto") -> tuple[Any, Any]:
    """Load a transformers model + tokenizer from a built-in name, .gguf path or local dir.

    A GGUF is dequantised by transformers once (tens of seconds, mostly the tokenizer
    conversion) and then cached as a transformers directory (see ``models.converted_dir``)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spec_plugins.models import converted_dir, load_tokenizer, resolve_model

    src = resolve_model(model)
    path, kwargs = str(src.directory), src.hf_kwargs()
    cached = converted_dir(src) if src.gguf_file else None
    if cached is not None and (cached / "config.json").exists():
        path, kwargs = str(cached), {}
    tok = load_tokenizer(path, **kwargs)  # a ValueError naming the path where it cannot
    dev = pick_device(device)
    m = load_weights(path, pick_dtype(dtype, dev), torch.device("cpu"), kwargs.get("gguf_file"))
    if cached is not None and kwargs:
        _save_converted(m, tok, cached)
    return m.to(dev), tok


def load_weights(path: str, dtype: torch.dtype, device: torch.device, gguf_file: str | None = None) -> Any:
    """A transformers model from a directory (or a GGUF file in it, dequantised by transformers),
    on ``device``, in eval mode; files transformers cannot load are a ValueError naming ``path``."""
    import pickle

    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError) as exc:
        # a directory with config.json but no weights, or a weights file cut short (torch's zip
        # reader raises RuntimeError): bad input, named
        raise ValueError(f"cannot load the model weights from {path}: {type(exc).__name__}: {exc}") from exc
    return model.to(device).eval()


def _save_converted(model: Any, tok: Any, target: Any) -> None:
    """Write the dequantised model as a transformers directory (atomically, ``write_cache_dir``)."""
    import json

    from safetensors.torch import save_model

    from spec_plugins.models import write_cache_dir

    def write(d: Any) -> None:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)  # the weights are plain floats now
        (d / "config.json").write_text(json.dumps(cfg))
        model.generation_config.save_pretrained(str(d))
        save_model(model, str(d / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(str(d))

    write_cache_dir(target, write)


class TorchRuntime(SlotRuntime):
    """A transformers model over the hole-masked slot layer (``spec_plugins/slots.py``)."""

    always_mask = False  # one row, no holes, a chain: the model's own causal path, no mask

    class Config(RuntimeConfig):
        backend: Literal["torch"] = "torch"
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
            "auto", description="Weights/activations dtype; 'auto': bfloat16 on CUDA, float32 elsewhere (logits "
            "come back as float32 either way).")
        device: str = Field("auto", description="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1' ...")
        threads: int | None = Field(None, ge=1, le=MAX_THREADS,
                                    description="torch intra-op threads (None = torch default).")
        max_context: int | None = Field(None, ge=1, description="Override the model's context length.")
        matmul: Literal["auto", "auto_transposed", "native"] = Field(
            "auto", description="'auto': on CPU, time F.linear against weight@x.T per row count (1-16) at "
            "load and use the faster inside this runtime (see backends/torch_kernels.py); 'auto_transposed': "
            "also try x@W.T on a transposed copy of each weight for one row (2x weight memory); 'native': F.linear. "
            "A static cache runs native kernels: a config that selects it refuses auto_transposed.")
        kv: Literal["auto", "dynamic", "static"] = Field(
            "auto", description="'static': KV buffers preallocated on the device, written by slot, fixed shapes "
            "(backends/torch_static.py); 'dynamic': a growing transformers cache; 'auto': static on CUDA.")
        compile: Annotated[Literal["auto", "on", "off", "graphs"], SWITCH] = Field(
            "auto", description="Compile the static verify step per shape bucket (torch.compile fullgraph; CUDA "
            "graphs on CUDA). 'auto': on CUDA only (on a CPU each bucket compiles ~30 s); 'graphs': CUDA only, the eager step "
            "captured as CUDA graphs without a compiler (milliseconds per bucket instead of tens of seconds); "
            "needs kv: static.")

        @field_validator("device")
        @classmethod
        def _check_device(cls, value: str) -> str:
            """A device torch can parse ('auto' aside), so a typo is a config error, not a traceback at load."""
            if value != "auto":
                try:
                    torch.device(value)
                except RuntimeError as exc:
                    raise ValueError(f"device {value!r} is not a torch device ('auto', 'cpu', 'cuda', 'cuda:1', ...): "
                                     f"{exc}") from None
            return value

        @model_validator(mode="after")
        def _check_compile(self) -> "TorchRuntime.Config":
            if self.compile in ("on", "graphs") and self.kv == "dynamic":
                raise ValueError(f"compile: {self.compile} needs kv: static (a growing cache has no fixed shapes "
                                 "to compile)")
            if self.matmul == "auto_transposed" and (why := static_by_config(self)) is not None:
                raise ValueError(_transposed_refusal(why))
            return self

    @classmethod
    def from_config(cls, config: "TorchRuntime.Config") -> "TorchRuntime":
        """The growing-cache runtime. The ``torch`` backend entry (``torch_backend.TorchBackend``)
        chooses between it and the static one; a config that selects the static one is refused here."""
        if selects_static(config):
            raise ValueError("this torch config selects the static cache (kv: static, compile: on, or kv: auto on "
                             "CUDA): build it with spec_plugins.backends.build_runtime")
        model, tok = load_for(config)
        return cls(model, tok, max_context=config.max_context, matmul=config.matmul)

    def __init__(self, model: Any, tokenizer: Any = None, max_context: int | None = None,
                 matmul: Literal["auto", "auto_transposed", "native"] = "auto") -> None:
        if (why := hf_compat.slot_positioned(model)) is not None:  # ALiBi, GPT-Neo local layers: refused
            raise ValueError(why)
        self.model = model
        self.attention = attention_implementation(model)  # one that takes our 4D masks, else refused
        self.max_context = hf_compat.context_limit(model, max_context)  # capped where positions stop being exact
        # measured few-row kernel choice, active only inside _call (None: stock F.linear)
        self.kernels = (torch_kernels.tune(model, transposed=matmul == "auto_transposed")
                        if matmul != "native" else None)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = self.mask_dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=True, feature_layers=None,
                                                num_layers=hf_compat.decoder_layers(model), name="torch")
        # the KV cache keyword of this transformers version ('cache' or 'past_key_values')
        self._cache_kw = hf_compat.cache_keyword(model)
        self.layout = hf_compat.mask_layout(model)  # what a custom mask looks like (sliding-window layers)
        self.cache: Any = None  # a transformers DynamicCache over the slot axis
        self.slots = KVSlots()

    # ---- KV: the DynamicCache's per-layer tensors ------------------------------------------------
    @property
    def kv(self) -> list[torch.Tensor]:
        if self.cache is None or not all(getattr(lay, "is_initialized", False) for lay in self.cache.layers):
            return []
        return [t for lay in self.cache.layers for t in (lay.keys, lay.values)]

    @kv.setter
    def kv(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            self.cache = None
            return
        if self.cache is None or not self.kv:
            self.cache = hf_compat.full_cache(tensors)
            return
        for lay, k, v in zip(self.cache.layers, tensors[0::2], tensors[1::2]):
            lay.keys, lay.values = k, v

    def _reset_kv(self, rows: int) -> None:
        self.cache = None

    # ---- the engine call -------------------------------------------------------------------------
    def _model_call(self, kwargs: dict[str, Any], cache: Any, want_hidden: Want, last_only: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over ``kwargs`` with ``cache``: float logits and, if wanted, the last hidden
        state or the named decoder layers' outputs (concatenated). ``last_only``: logits of the last
        position only (a prefill). Traceable: the static runtime compiles it into its step."""
        if not want_hidden:
            if last_only:
                kwargs["logits_to_keep"] = 1
            kwargs[self._cache_kw] = cache
            return self.model(**kwargs).logits.float(), None
        layers = want_hidden if isinstance(want_hidden, tuple) else ()
        kwargs[self._cache_kw] = cache
        logits, h, feats = hf_compat.logits_and_hidden(self.model, kwargs, layers, last_only)
        return logits.float(), feats if layers else h

    def _call(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, want_hidden: Want,
              prefill: bool) -> StepOutput:
        if self.cache is None:
            self.cache = hf_compat.full_cache()
        before = hf_compat.cached_length(self.cache)
        dev_pos = upload(pos, self.device)
        kwargs: dict[str, Any] = dict(input_ids=upload(ids, self.device), position_ids=dev_pos, use_cache=True)
        if mask is not None:  # [B, 1, n, keys]: the keys are the slot layer's first slots
            k_pos = upload(self.slots.pos[:, : mask.shape[-1]], self.device) if self.layout.window else None
            kwargs["attention_mask"] = self.layout.masks(upload(mask, self.device), dev_pos, k_pos)
        with torch_kernels.active() if self.kernels is not None else contextlib.nullcontext():
            logits, hidden = self._model_call(kwargs, self.cache, want_hidden, last_only=prefill)
        out = StepOutput(logits, hidden)
        hf_compat.check_cache_grew(self.cache, before, int(ids.shape[1]), self.model)
        return out
