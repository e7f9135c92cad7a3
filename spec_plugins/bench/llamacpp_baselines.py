"""llama-cpp-python's own decoding as bench baselines, when the target runs on llama.cpp.

``llamacpp``: its plain ``Llama.generate``. ``llamacpp_prompt_lookup``: the same with
``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=gamma, max_ngram_size=max_ngram)``,
its prompt-lookup speculative decoding. Both load the target's GGUF with the target's threads,
context type and attention settings, so only the decoding loop differs from ours. Each turn
starts from an empty cache (``reset``), as ours does, so no run reuses another's prefill.
The plain baseline has the target's context; prompt lookup's is capped (``_MAX_BASELINE_CTX``), and a
turn that does not fit it stops the bench with an error naming the cap, raised before the turn is timed.
"""

from __future__ import annotations

import time
from typing import Any

from spec_plugins.bench.baselines import BaselineContext, BaselineUnavailable, TurnFn, TurnRun, plain_decoding

_MAX_BASELINE_CTX = 2048  # with a draft model llama-cpp-python keeps n_ctx x vocab float logits


def _llama(ctx: BaselineContext, draft_model: Any = None) -> tuple[Any, dict]:
    dec = ctx.decoder
    target = dec.target
    if getattr(target.capabilities, "name", "") != "llamacpp" or dec.config is None:
        raise BaselineUnavailable("llama-cpp-python baselines need the llamacpp runtime (target.backend: llamacpp)")
    import llama_cpp

    from spec_plugins.backends.llamacpp_runtime import _GGML_TYPES
    from spec_plugins.models import resolve_model

    cfg = dec.config.target
    kv = {} if cfg.dtype is None else {"type_k": _GGML_TYPES[cfg.dtype], "type_v": _GGML_TYPES[cfg.dtype]}
    n_ctx = target.max_context if draft_model is None else min(target.max_context, _MAX_BASELINE_CTX)
    llm = llama_cpp.Llama(
        str(resolve_model(cfg.model).gguf_path), n_ctx=n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_batch,
        n_threads=target.threads, n_threads_batch=target.threads_batch, flash_attn=cfg.flash_attn,
        swa_full=cfg.swa_full, n_gpu_layers=cfg.gpu_layers, draft_model=draft_model, verbose=False, **kv,
    )
    s = dec._sampling(None, None)
    kw = dict(temp=s.temperature, top_k=s.top_k or 0, top_p=s.top_p or 1.0, min_p=0.0, repeat_penalty=1.0)
    if s.repetition_penalty not in (None, 1.0):
        kw["repeat_penalty"] = s.repetition_penalty
    if s.seed is not None:
        llm.set_seed(s.seed)
    return llm, kw


def _runner(llm: Any, kw: dict, eos: tuple[int, ...], why: str = "") -> TurnFn:
    """A turn function over ``llm``; ``why`` explains its n_ctx in the error of a turn that does not fit."""
    stop = set(eos) | {int(llm.token_eos())}

    def run(ids: list[int], max_new_tokens: int) -> TurnRun:
        if len(ids) + max_new_tokens > llm.n_ctx():  # before the clock starts: no partial turn is timed
            raise ValueError(f"prompt of {len(ids)} + {max_new_tokens} new tokens exceeds the baseline's "
                             f"n_ctx={llm.n_ctx()}{why}")
        llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, reset=True, **kw):
            out.append(int(tok))
            if tok in stop or len(out) >= max_new_tokens:
                break
        return TurnRun(out, time.perf_counter() - t0)

    return run


@plain_decoding
def llamacpp_plain(ctx: BaselineContext) -> TurnFn:
    """llama-cpp-python's plain decoding of the same GGUF."""
    llm, kw = _llama(ctx)
    return _runner(llm, kw, ctx.eos_ids)


def llamacpp_prompt_lookup(ctx: BaselineContext) -> TurnFn:
    """llama-cpp-python's prompt-lookup speculative decoding (``LlamaPromptLookupDecoding``)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    prop = ctx.decoder.config.proposer if ctx.decoder.config is not None else None
    if prop is None or prop.type != "ngram":
        raise BaselineUnavailable("llama-cpp-python's prompt lookup is the peer of the ngram proposer only")
    ngram = prop.max_ngram
    llm, kw = _llama(ctx, LlamaPromptLookupDecoding(max_ngram_size=ngram, num_pred_tokens=ctx.num_draft_tokens))
    why = (f" (capped at {_MAX_BASELINE_CTX}: with a draft model llama-cpp-python keeps n_ctx x vocab logits); "
           "shorten the prompts, lower --max-new-tokens, or leave llamacpp_prompt_lookup out of --baselines")
    return _runner(llm, kw, ctx.eos_ids, why)
