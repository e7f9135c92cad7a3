"""Peer implementations the bench runs next to ours, as a small registry.

A baseline is a factory ``make(ctx) -> run`` where ``run(prompt_ids, max_new_tokens) -> TurnRun``
decodes one turn and times it. The factory does its setup once (load a model, build a generation
config) and raises ``BaselineUnavailable`` when it does not apply (wrong runtime, method it does
not implement), which the bench reports instead of failing. Register more with
``@register_baseline("name")`` or the entry-point group ``spec_plugins.baselines``; a baseline
that does not draft (plain decoding) is marked ``@plain_decoding``, so the report gives it no
draft length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from spec_plugins.registry import Registry
from spec_plugins.stats import DecodeStats

if TYPE_CHECKING:
    from spec_plugins.decoder import SpeculativeDecoder


@dataclass
class TurnRun:
    """One decoded turn: the new tokens (EOS included if emitted) and the wall time."""

    tokens: list[int]
    seconds: float
    stats: DecodeStats | None = None  # our engine's per-round record; None for peers


@dataclass(frozen=True)
class BaselineContext:
    """What a baseline may build itself from."""

    decoder: "SpeculativeDecoder"  # ours: target runtime, proposer, tokenizer, config
    num_draft_tokens: int  # gamma a peer speculative implementation should use
    eos_ids: tuple[int, ...]


TurnFn = Callable[[list[int], int], TurnRun]
BaselineFactory = Callable[[BaselineContext], TurnFn]


class BaselineUnavailable(RuntimeError):
    """This baseline does not apply to the configured runtime/method (the message says why)."""


BASELINES: Registry[BaselineFactory] = Registry("baseline", "spec_plugins.baselines")
register_baseline = BASELINES.register


def plain_decoding(factory: BaselineFactory) -> BaselineFactory:
    """Marks a baseline factory as plain (non-drafting) decoding: no draft length is reported for it."""
    factory.drafts = False  # type: ignore[attr-defined]
    return factory


def drafts(factory: BaselineFactory) -> bool:
    """Whether a baseline drafts (a peer speculative implementation, run with the peers' draft
    length); unmarked factories do."""
    return bool(getattr(factory, "drafts", True))


def time_decoder(decoder: "SpeculativeDecoder", prompt_ids: list[int], max_new_tokens: int,
                 observers: Sequence[Any] = ()) -> TurnRun:
    """Run our decode loop on one prompt (token ids in, no per-round detokenisation) and time it."""
    t0 = time.perf_counter()
    r = decoder.generate_batch([prompt_ids], max_new_tokens=max_new_tokens, observers=observers)[0]
    return TurnRun(r.token_ids, time.perf_counter() - t0, r.stats)


@register_baseline("plain")
@plain_decoding
def plain(ctx: BaselineContext) -> TurnFn:
    """Plain autoregressive decoding on our runtime: the reference for speed and for output."""
    dec = ctx.decoder.without_speculation()
    return lambda ids, n: time_decoder(dec, ids, n)


@register_baseline("transformers")
def transformers_generate(ctx: BaselineContext) -> TurnFn:
    """Hugging Face ``generate``: prompt lookup for ngram, assisted generation for draft_model,
    plain greedy/sampling without a proposer. Needs the torch runtime (it runs the same model)."""
    import torch
    from transformers import GenerationConfig

    dec = ctx.decoder
    model = getattr(dec.target, "model", None)
    if getattr(dec.target.capabilities, "name", "") != "torch" or model is None or not hasattr(model, "generate"):
        raise BaselineUnavailable("the transformers baseline needs the torch runtime (target.backend: torch)")
    s = dec._sampling(None, None)
    kw: dict[str, Any] = dict(do_sample=not s.greedy, eos_token_id=list(ctx.eos_ids) or None,
                              pad_token_id=ctx.eos_ids[0] if ctx.eos_ids else 0)
    if not s.greedy:
        kw.update(temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p or 1.0)
    if s.repetition_penalty not in (None, 1.0):
        kw["repetition_penalty"] = s.repetition_penalty
    extra: dict[str, Any] = {}
    prop = dec.config.proposer if dec.config is not None else None
    if prop is None:
        pass
    elif prop.type == "ngram":
        kw.update(prompt_lookup_num_tokens=ctx.num_draft_tokens, max_matching_ngram_size=prop.max_ngram)
    elif prop.type == "draft_model":
        assistant = getattr(dec.proposer.runtime, "model", None)  # a draft_model proposer's runtime
        if assistant is None or not hasattr(assistant, "generate"):
            raise BaselineUnavailable("transformers assisted generation needs a torch draft model")
        kw.update(num_assistant_tokens=ctx.num_draft_tokens, num_assistant_tokens_schedule="constant")
        extra["assistant_model"] = assistant
    else:
        raise BaselineUnavailable(f"transformers has no implementation of proposer {prop.type!r}")
    device = next(model.parameters()).device

    def run(ids: list[int], max_new_tokens: int) -> TurnRun:
        x = torch.tensor([ids], device=device)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, **kw)
        if s.seed is not None:
            torch.manual_seed(s.seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg, **extra)
        new = out[0, len(ids):].tolist()
        return TurnRun(new, time.perf_counter() - t0)

    return run


# llama-cpp-python's own plain and prompt-lookup decoding (skipped unless the target is on llama.cpp)
BASELINES.add_lazy("llamacpp", "spec_plugins.bench.llamacpp_baselines:llamacpp_plain")
BASELINES.add_lazy("llamacpp_prompt_lookup", "spec_plugins.bench.llamacpp_baselines:llamacpp_prompt_lookup")
