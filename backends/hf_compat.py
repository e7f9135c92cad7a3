"""transformers API differences across the supported range, decided once per model class.

transformers renamed the KV-cache keyword of every model's ``forward`` from ``past_key_values``
to ``cache`` in 5.24. A model called with the other spelling takes it into ``**kwargs``, ignores
it and runs with no past at all: wrong tokens in one row, shape errors in batched or tree rounds,
and no error saying why. So the keyword is read from the model's own forward signature, and
every forward that feeds a cache is followed by a metadata-only check that the cache grew by the
positions fed (a future rename is then an error, not wrong text).

Custom attention masks: a decoder handed a 4D mask uses it as given in every layer, so a
sliding-window layer attends as far back as the mask lets it. ``MaskLayout`` puts the window into
the mask (per layer type where the model takes a mapping), and ``full_cache`` keeps every position
in every layer (transformers' sliding-window cache layers drop the oldest; tree rounds, rollback
and commit by slot need them all).

Positions: the runtimes give every token its position in ``position_ids``; ``slot_positioned``
names the families that place tokens by cache slot instead (ALiBi, GPT-Neo's local layers).

Context: ``context_limit`` caps a runtime's context where positions stop being exact (a learned
absolute position table ends; a longrope or dynamic-NTK rope starts choosing its frequencies from
each forward's longest position) and refuses a larger one asked for.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

CACHE_KEYWORDS = ("cache", "past_key_values")  # newest spelling first


@lru_cache(maxsize=64)
def _keyword_of(forward: Any) -> str:
    params = inspect.signature(forward).parameters
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    raise TypeError(f"{getattr(forward, '__qualname__', forward)} takes none of {', '.join(CACHE_KEYWORDS)}: "
                    "this transformers model API is not supported (see pyproject.toml for the tested range)")


def cache_keyword(module: Any) -> str:
    """The keyword ``module.forward`` takes its KV cache under (a transformers model or decoder)."""
    return _keyword_of(type(module).forward)


def cached_length(cache: Any) -> int:
    """Positions a transformers cache holds (layer 0's slot axis; shape metadata, no device sync)."""
    if cache is None or not cache.layers:
        return 0
    lay = cache.layers[0]
    return int(lay.keys.shape[-2]) if getattr(lay, "is_initialized", False) and lay.keys.dim() == 4 else 0


def check_cache_grew(cache: Any, before: int, fed: int, model: Any) -> None:
    """Raise if a forward that was handed ``cache`` did not append its ``fed`` positions to it."""
    after = cached_length(cache)
    if after == before + fed:
        return
    if any(getattr(lay, "is_sliding", False) for lay in cache.layers):
        raise RuntimeError(
            f"{type(model).__name__}'s KV cache has sliding-window layers, which keep only the last window of "
            f"positions (it held {before} positions, fed {fed}, now {after}): this runtime needs every position "
            "cached (build the cache with hf_compat.full_cache)")
    raise RuntimeError(
        f"{type(model).__name__} did not use the KV cache it was given (it held {before} positions, fed "
        f"{fed}, now {after}): this transformers version ({_version()}) takes the cache under a keyword "
        f"this runtime does not pass; decoding without the past would give wrong tokens")


def logits_and_hidden(forward: Any, kwargs: dict[str, Any], layers: tuple[int, ...] = (), last_only: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A causal LM's own forward (the model, or its bound ``forward``) over ``kwargs`` with its
    hidden states: logits (of the last position only if ``last_only``), the last hidden state
    (after the final norm: transformers' ``hidden_states[-1]``) and the named decoder layers'
    outputs concatenated (None without ``layers``). The logits are the model's, not its LM head's
    output, so whatever it does after the head (Gemma's softcapping, Granite's division by
    ``logits_scaling``, Cohere's ``logit_scale``, ...) is in them."""
    out = forward(**kwargs, output_hidden_states=True, logits_to_keep=1 if last_only else 0)
    states = out.hidden_states
    return out.logits, states[-1], torch.cat([states[i] for i in layers], -1) if layers else None


def full_cache(tensors: list[torch.Tensor] | None = None) -> Any:
    """A ``DynamicCache`` whose every layer keeps every position, holding ``tensors`` (keys and
    values of each layer in turn; the tensors themselves, not copies). Built without the model's
    config on purpose: from a config transformers makes sliding-window layers that drop positions
    the slot layer still addresses."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()  # layers past the given ones are added as plain DynamicLayers on update
    tensors = tensors or []
    for k, v in zip(tensors[0::2], tensors[1::2]):
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


ATTENTION_TYPES = ("full_attention", "sliding_attention")  # the layer types a custom mask can express


@dataclass(frozen=True)
class MaskLayout:
    """What a decoder's forward takes as a custom attention mask: one 4D mask for every layer, or
    (a config with ``layer_types`` and sliding layers) a mapping layer type -> 4D mask. Sliding
    layers get the full-attention mask cut to the window (a query at position q sees keys at
    positions k with q - k < window, transformers' own ``sliding_window_overlay``)."""

    window: int | None = None  # the sliding layers' window; None: no layer slides
    per_type: bool = False  # True: full-attention layers too, so the forward takes a mapping

    def masks(self, mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor | None
              ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The forward's mask from ``mask`` [B, 1, n, S] (boolean, or additive float): ``q_pos`` [B, n]
        each query's position, ``k_pos`` [B, S] each key slot's (read only where layers slide).
        Traceable: the static runtime builds these inside its compiled step."""
        if self.window is None:
            return mask
        if k_pos is None:
            raise ValueError("a sliding-window mask needs the key slots' positions")
        inside = (q_pos[:, None, :, None] - k_pos[:, None, None, :]) < self.window
        if mask.dtype == torch.bool:
            sliding = mask & inside
        else:
            sliding = mask.masked_fill(~inside, torch.finfo(mask.dtype).min)
        return {"full_attention": mask, "sliding_attention": sliding} if self.per_type else sliding


def text_config(model: Any) -> Any:
    """The decoder's config (a multimodal model's text config; the config itself otherwise)."""
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def decoder_layers(model: Any) -> int | None:
    """How many decoder layers a transformers causal LM has (None where its config does not say)."""
    cfg = text_config(model)
    count = getattr(cfg, "num_hidden_layers", None)
    return int(count) if count is not None else None


def mask_layout(model: Any) -> MaskLayout:
    """The mask layout of a transformers causal LM, read from its decoder config as transformers'
    own caches read it (``layer_types``, else every layer slides when ``sliding_window`` is set).
    Layer types a mask cannot express (chunked, linear, recurrent attention) are refused."""
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "attention_chunk_size", None) is not None:
            raise ValueError(f"{type(model).__name__} uses chunked attention (attention_chunk_size): this runtime "
                             f"supports {', '.join(ATTENTION_TYPES)} layers only")
        return MaskLayout(window=int(window) if window is not None else None)
    unknown = sorted(set(types) - set(ATTENTION_TYPES))
    if unknown:
        raise ValueError(f"{type(model).__name__} has layer types {unknown}: this runtime supports "
                         f"{', '.join(ATTENTION_TYPES)} layers only")
    if "sliding_attention" not in types:
        return MaskLayout()
    if window is None:
        raise ValueError(f"{type(model).__name__} has sliding_attention layers but its config sets no sliding_window")
    return MaskLayout(window=int(window), per_type=True)


ALIBI_FAMILIES = ("bloom", "mpt")  # transformers' ALiBi decoders without a switch (Falcon's is config.alibi)
_NEEDS_POSITIONS = ("; this runtime and the ONNX verify graph need positions from position_ids (their rows hold "
                    "holes: left padding, rejected drafts, tree nodes)")


def slot_positioned(model: Any) -> str | None:
    """Why ``model`` places tokens by their slot in the KV cache instead of by ``position_ids``, or
    None. ALiBi biases (Bloom, MPT, Falcon with ``alibi``) are built from the key slots' order or a
    2D mask, and GPT-Neo's local layers cut their window by slot distance: over rows with holes they
    would bias or window other keys than ``generate()`` does (or crash), whatever mask is passed.
    A GPT-Neo window at or past ``max_position_embeddings`` (the size of the model's own slot mask)
    hides no key, so the layer is full attention and is let through."""
    cfg = text_config(model)
    kind = str(getattr(cfg, "model_type", "") or type(model).__name__)
    name = f"{kind} ({type(model).__name__}"
    if kind in ALIBI_FAMILIES or bool(getattr(cfg, "alibi", False)):
        field = ", alibi=True" if kind not in ALIBI_FAMILIES else ""
        return f"{name}{field}) uses ALiBi biases computed from cache slot order{_NEEDS_POSITIONS}"
    window, table = getattr(cfg, "window_size", None), getattr(cfg, "max_position_embeddings", None)
    hides_none = window is not None and table is not None and int(window) >= int(table)
    if "local" in (getattr(cfg, "attention_layers", None) or ()) and not hides_none:
        return (f"{name}) has local attention layers (attention_layers lists 'local', window_size={window}, below "
                f"max_position_embeddings={table}) that cut their window by cache slot distance{_NEEDS_POSITIONS}")
    return None


POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")  # learned absolute position embeddings


def _rope_dicts(cfg: Any) -> list[dict]:
    """The config's rope parameter dicts: ``rope_parameters`` as transformers 5.x stores it (one dict,
    or one per layer type), else the older ``rope_scaling``."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]


def _rope_limit(cfg: Any) -> tuple[str, str, int] | None:
    """(rope type, config field, positions) up to which the rotary frequencies are fixed, for a rope
    that picks them per forward from its largest position (transformers' ``dynamic_rope_update``):
    past that, a verify forward's draft nodes would switch the frequencies of every position in it."""
    limits = []
    for d in _rope_dicts(cfg):
        kind = str(d.get("rope_type", d.get("type", "default")))
        if kind == "longrope":  # long factors once max(position) + 1 > original_max_position_embeddings
            orig = d.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
            limits.append((kind, "original_max_position_embeddings", int(orig or cfg.max_position_embeddings)))
        elif "dynamic" in kind:  # a new base once max(position) + 1 > max_position_embeddings
            limits.append((kind, "max_position_embeddings", int(cfg.max_position_embeddings)))
    return min(limits, key=lambda t: t[2]) if limits else None


def _position_table(model: Any, cfg: Any) -> tuple[str, int] | None:
    """(config field, positions) of a learned absolute position embedding (GPT-2's ``wpe``): no
    position past it has an embedding."""
    rows = [m.num_embeddings for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES]
    if not rows:
        return None
    field = getattr(cfg, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
    size = getattr(cfg, "max_position_embeddings", None)
    return field, min(rows) if size is None else min(int(size), *rows)


def _caps(model: Any) -> list[tuple[int, str]]:
    """(positions, why) of each point where ``model``'s positions stop being exact, smallest first."""
    cfg = text_config(model)
    name = type(model).__name__
    caps: list[tuple[int, str]] = []
    if (table := _position_table(model, cfg)) is not None:
        field, n = table
        caps.append((n, f"{name}'s learned absolute position table ({field}={n}) has no embedding past it"))
    if (rope := _rope_limit(cfg)) is not None:
        kind, field, n = rope
        caps.append((n, f"{name}'s {kind} rope ({field}={n}) recomputes its frequencies from each forward's "
                        "longest position past it, so plain and speculative decoding would differ from generate()"))
    return sorted(caps)


def context_cap(model: Any) -> int | None:
    """The positions past which ``model``'s outputs stop being exact (``context_limit``'s caps), None
    where nothing caps them (a plain rope runs past ``max_position_embeddings`` as the model does)."""
    caps = _caps(model)
    return caps[0][0] if caps else None


def context_limit(model: Any, requested: int | None = None) -> int:
    """The context a runtime of ``model`` holds: ``requested``, else the config's
    ``max_position_embeddings`` (2048 without one), capped where positions stop being exact: a
    learned absolute position table ends, or a rope changes its frequencies with the forward's
    length (longrope, dynamic NTK). A ``requested`` context past such a cap is refused."""
    cfg = text_config(model)
    limit = int(requested or getattr(cfg, "max_position_embeddings", None) or 2048)
    for n, why in _caps(model):
        if requested and requested > n:
            raise ValueError(f"max_context {requested} exceeds {n} positions: {why}; use max_context <= {n}")
        limit = min(limit, n)
    return limit


def _version() -> str:
    import transformers

    return transformers.__version__
