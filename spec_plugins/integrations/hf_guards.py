"""What ``speculative_generate`` refuses before it decodes, and the ``generate()`` arguments that
transformers drops from a callable ``custom_generate`` but that still decide the call: read from
``generate()``'s own frame, so they are refused rather than ignored."""

from __future__ import annotations

from typing import Any

from spec_plugins.backends import hf_compat
from spec_plugins.config import ConfigError, SamplingConfig

# model_kwargs transformers always prepares for decoder-only models; anything else is a model
# input we do not forward (images, embeddings, token types...).
# The cache arrives under the model's own keyword ('cache' or 'past_key_values', by version).
# generate() also puts the config's output_attentions / output_hidden_states here for its forwards:
# without return_dict_in_generate it drops what they return (the sequences do not change), and with
# it ``check_supported`` refuses them first.
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "logits_to_keep", "use_cache", "output_attentions",
                       "output_hidden_states", *hf_compat.CACHE_KEYWORDS}


def check_supported(model: Any, gc: Any, synced_gpus: bool, model_kwargs: dict) -> None:
    """Refuse, by name, every option whose meaning we cannot reproduce exactly."""
    from transformers.generation import GenerationMode

    if model.config.is_encoder_decoder:
        raise ValueError("speculative_generate supports decoder-only models; this one is encoder-decoder")
    mode = gc.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        hint = {
            GenerationMode.ASSISTED_GENERATION: " (prompt_lookup_num_tokens / assistant options: choose the draft "
                                                "source with spec_config's proposer, e.g. type ngram, or draft_model=)",
        }.get(mode, f" (num_beams={gc.num_beams}; only num_beams=1 is supported)"
              if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE, GenerationMode.GROUP_BEAM_SEARCH,
                          GenerationMode.CONSTRAINED_BEAM_SEARCH) else "")
        raise ValueError(f"speculative_generate supports greedy search and sampling, not {mode.value}{hint}")
    if synced_gpus:
        raise ValueError("speculative_generate does not support synced_gpus (multi-GPU ZeRO-3/FSDP generation: "
                         "every rank would have to run the same forwards, and this engine's rounds differ per rank)")
    if gc.return_dict_in_generate:
        wanted = [n for n in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
                  if getattr(gc, n, False)]
        if wanted:
            raise NotImplementedError(
                f"speculative_generate returns sequences only; {', '.join(wanted)} is not supported "
                "(scores of drafted positions are not produced one step at a time)")
    extra = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS and v is not None)
    if extra:
        raise ValueError(f"speculative_generate takes input_ids (+ attention_mask) only; got {', '.join(extra)}")
    _check_positions(gc, model_kwargs)
    cache = model_kwargs.get(hf_compat.cache_keyword(model))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("speculative_generate cannot continue from a pre-filled cache; pass the full input_ids")


def _check_positions(gc: Any, model_kwargs: dict) -> None:
    """Refuse ``position_ids`` other than the ones ``generate()`` derives itself: it fills them in
    when not given (``attention_mask.cumsum(-1) - 1``, or ``arange`` where it dropped an all-ones
    mask), and this engine derives positions from the mask, so any others would be dropped where
    plain ``generate()`` uses them. Pad slots are not compared: no real token attends to them."""
    import torch

    given = model_kwargs.get("position_ids")
    if given is None:
        return
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        real = mask.to(given.device) != 0
        expected = real.long().cumsum(-1) - 1
    else:  # generate() dropped an all-ones mask, noting its length (a direct call: the positions' own)
        length = getattr(gc, "_mask_length", None) or given.shape[-1]
        expected = torch.arange(length, device=given.device)[None]
        real = torch.ones_like(expected, dtype=torch.bool)
    # [B, L], [1, L] or leading axes (multimodal rope) over them, each equal to the default
    fits = (given.dim() >= 2 and given.shape[-1] == expected.shape[-1]
            and (given.shape[-2] == expected.shape[0] or 1 in (given.shape[-2], expected.shape[0])))
    if not fits or bool(((given != expected) & real).any()):
        raise ValueError(f"speculative_generate does not take custom position_ids (given, shape {tuple(given.shape)}): "
                         "the plugin derives positions from the attention mask (attention_mask.cumsum(-1) - 1 at each "
                         "prompt token, what generate() uses without position_ids), so these would be ignored; "
                         "drop position_ids")


def generate_frame(caller: Any) -> Any:
    """``caller`` where it is transformers' ``generate()`` (which called a callable
    ``custom_generate``), else None: only that frame's locals are read."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    return caller if caller.f_code is inspect.unwrap(GenerationMixin.generate).__code__ else None


def synced_gpus_of(model: Any, given: bool, caller: Any) -> bool:
    """Whether the call runs with ``synced_gpus``. transformers hands a callable
    ``custom_generate`` only the keywords ``_sample`` lacks, and ``synced_gpus`` is one of
    ``_sample``'s, so it never arrives (``given`` is then its default): read it from
    ``generate()``'s frame, and where it is None there, resolve it as ``generate()`` does (on
    under DeepSpeed ZeRO-3 or FSDP with more than one process)."""
    frame = generate_frame(caller)
    if frame is None:
        return bool(given)
    asked = frame.f_locals.get("synced_gpus")
    if asked is not None:
        return bool(asked)
    import torch.distributed as dist
    from transformers.generation import utils as gen_utils

    # the names generate() itself calls, as its version imports them
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return bool((gen_utils.is_deepspeed_zero3_enabled() or gen_utils.is_fsdp_managed_module(model)) and world > 1)


def check_dropped_streamer(caller: Any) -> None:
    """transformers puts the prompt into ``generate(streamer=...)`` and then calls a callable
    ``custom_generate`` without it, so nothing more would reach it and its ``end()`` would never
    come (a thread reading a ``TextIteratorStreamer`` would wait forever): refuse it, ending it
    first so such a reader stops. ``caller`` is read only when it is transformers' ``generate()``."""
    frame = generate_frame(caller)
    streamer = frame.f_locals.get("streamer") if frame is not None else None
    if streamer is not None:
        streamer.end()
        raise ValueError("speculative_generate: transformers does not hand streamer= to a callable custom_generate "
                         "(it would receive the prompt only): pass it as spec_streamer=, or use the directory "
                         "form (custom_generate=CUSTOM_GENERATE, trust_remote_code=True), which takes streamer=")


def check_context(rows: list[list[int]], max_new: int, context: int) -> None:
    """Refuse a call that would run past the model's context: plain ``generate()`` runs on there
    (rotary positions extrapolate), where this engine stops each row at it, which would cut the
    output short without a word."""
    longest = max((len(r) for r in rows), default=0)
    if longest + max_new > context:
        raise ValueError(f"speculative_generate: a prompt of {longest} tokens plus max_new_tokens {max_new} runs past "
                         f"the model's context of {context} positions (max_position_embeddings), where this engine "
                         "stops: lower max_new_tokens (or max_length)")


def check_sampling_section(sampling: SamplingConfig, source: str) -> None:
    """Refuse a ``spec_config`` sampling section other than the default: the call samples as
    ``generate()``'s own arguments say (its processors, ``torch.manual_seed``), so the section
    would be dropped and e.g. a temperature-0.8 config would decode greedily without a word."""
    default = SamplingConfig().model_dump()
    changed = {k: v for k, v in sampling.model_dump().items() if v != default[k]}
    if changed:
        fields = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        raise ConfigError(f"{source}: its sampling section ({fields}) is not used by speculative_generate: the "
                          "call's sampling comes from generate()'s own arguments (do_sample=True, temperature=..., "
                          "top_p=..., top_k=..., repetition_penalty=...; torch.manual_seed for the seed): pass them "
                          "there and drop the section (or keep it at the default, temperature 0 and seed 0)")


def heal_prompts(model: Any, tokenizer: Any, kwargs: dict) -> dict:
    """The directory form's ``generate()`` arguments with ``token_healing`` done here: plain
    ``generate()`` heals the prompts with ``tokenizer=`` before it decodes, but its heal step for a
    callable ``custom_generate`` never has the tokenizer (transformers drops it) and raises asking
    for it. Healed here with ``generate()``'s own ``heal_tokens``, the prompts go on with healing
    off and a mask over every healed slot: plain ``generate()`` decodes them with none (it drops an
    all-ones mask). It heals after expanding the prompts for ``num_return_sequences``, as plain
    ``generate()`` does (a sampling model config heals each copy with its own draws), and the copies
    go on as one sequence each. Padded prompts are refused: there it pairs the healed
    (re-tokenized) prompts with the mask of the unhealed ones, which this engine would not reproduce."""
    import torch

    names = ("token_healing", "pad_token_id", "eos_token_id", "do_sample", "num_return_sequences", "num_beams")
    setting = _settings(model, kwargs, names)
    if not setting["token_healing"]:
        return kwargs
    key = "inputs" if kwargs.get("inputs") is not None else "input_ids"
    ids, mask = kwargs.get(key), kwargs.get("attention_mask")
    if ids is None:
        raise ValueError("speculative_generate: token_healing=True heals input_ids; none were given")
    pad, eos = setting["pad_token_id"], setting["eos_token_id"]
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    # generate() reads a pad id (one that is not an EOS id) in the prompts as padding when no mask is given
    padded = bool((mask == 0).any()) if mask is not None else (
        pad is not None and pad not in eos and bool((ids == pad).any()))
    if padded:
        raise ValueError("speculative_generate: token_healing=True with padded prompts is not supported (plain "
                         "generate() decodes the healed, re-tokenized prompts under the unhealed prompts' "
                         "attention_mask): heal one prompt per call, or drop token_healing")
    copies = setting["num_return_sequences"] or 1
    # greedy (or beam search) with several sequences: left as it is for the call below to refuse
    expand = copies > 1 and bool(setting["do_sample"]) and (setting["num_beams"] or 1) == 1
    healed = model.heal_tokens(ids.repeat_interleave(copies, dim=0) if expand else ids, tokenizer)
    off = {"token_healing": False, **({"num_return_sequences": 1} if expand else {})}
    return {**kwargs, key: healed, "attention_mask": torch.ones_like(healed), **_switched(kwargs, off)}


def _settings(model: Any, kwargs: dict, names: tuple[str, ...]) -> dict[str, Any]:
    """The generation settings ``names`` as ``generate()`` resolves them: its keyword, else the given
    ``generation_config`` with the model's and transformers' defaults filling its unset fields
    (``_prepare_generation_config``, called without the keywords so it warns about nothing)."""
    base, _ = model._prepare_generation_config(kwargs.get("generation_config"))
    return {n: kwargs[n] if kwargs.get(n) is not None else getattr(base, n, None) for n in names}


def _switched(kwargs: dict, values: dict[str, Any]) -> dict[str, Any]:
    """``generate()`` arguments setting ``values``: as keywords where the caller passed that keyword
    or no ``generation_config``, else on a copy of the ``generation_config`` (a keyword next to one
    makes transformers warn that the two together are deprecated)."""
    import copy

    gc = kwargs.get("generation_config")
    keywords = {k: v for k, v in values.items() if gc is None or k in kwargs}
    rest = {k: v for k, v in values.items() if k not in keywords}
    if not rest:
        return keywords
    gc = copy.deepcopy(gc)
    gc.update(**rest)
    return {**keywords, "generation_config": gc}
