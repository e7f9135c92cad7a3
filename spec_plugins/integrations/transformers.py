"""``model.generate(..., custom_generate=speculative_generate, spec_config=...)``: our decode loop
inside transformers' ``generate()``.

transformers prepares everything (generation config, logits processors incl. its own warpers,
stopping criteria, left-padded ``input_ids``) and calls this function instead of its greedy/sample
loop. We strip each row's left pads (the runtime never sees them), decode the batch with any
registered proposer and the verifier ``spec_config`` names (``exact`` unless it says otherwise; a
lossy one, e.g. ``typical``, warns when it samples), and return transformers' layout: prompt incl.
pads + new tokens, right-padded with ``pad_token_id``.

What user processors see: for row b, exactly what plain ``generate()`` shows them for that row,
i.e. ``input_ids[b]`` with its left pads + the tokens before the scored one (the engine's
``processor_prefix``). Length-based processors (min_length, min_new_tokens, forced EOS,
suppress-at-begin) therefore count as transformers does. Processors must be functions of
(row prefix, scores): they are called per drafted node, rows grouped by prefix length, so one
that reads a batch index or keeps state between calls is refused or mis-applied (see
``integrations.hf_processors``). A draft model runs the processors over the same padded prefixes
(its drafts then follow them as the target will); either way the verifier uses the target's scores.

transformers 5.x does not pass ``streamer`` or ``assistant_model`` to a callable
``custom_generate`` (it forwards only the keyword arguments that ``_sample`` lacks), so the
callable takes them under its own names: ``spec_streamer=`` and ``draft_model=``. The directory
form, ``custom_generate=CUSTOM_GENERATE`` with ``trust_remote_code=True``, receives every
``generate()`` argument (transformers' documented way for custom decoding methods) and hands
``streamer=`` and ``assistant_model=`` to the callable under those names. ``synced_gpus`` is
dropped from a callable too (it is ``_sample``'s own): it is read from ``generate()``'s frame
(``hf_guards``) and refused.

Sampling: with a proposer drafting point masses (every model-free one, the heads), each call
draws one seed per row from torch's global RNG (``torch.manual_seed`` decides them) and decodes
the rows as seeded rows, whose samples are keyed on their positions (``keyed_draws``): the
output does not depend on the draft schedule. A draft model's drafts carry its distribution,
whose rejection tests draw from a stream anyway: those calls sample from torch's global RNG.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from spec_plugins.config import ConfigError, SamplingConfig, SpecConfig, default_config, load_file
from spec_plugins.integrations.hf_guards import (check_context, check_dropped_streamer, check_sampling_section,
                                                 check_supported, synced_gpus_of)
from spec_plugins.integrations.hf_inputs import split_left_padding
from spec_plugins.integrations.hf_processors import adapt_processors
from spec_plugins.integrations.hf_stops import Stops, pad_of, token_ids
from spec_plugins.integrations.plugin_state import Setup, model_lock
from spec_plugins.loop import decode
from spec_plugins.loop.verdicts import takes_keyed_draws
from spec_plugins.proposers.base import Proposer
from spec_plugins.registry import VERIFIERS
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats

__all__ = ["CUSTOM_GENERATE", "speculative_generate"]

# ``model.generate(..., custom_generate=CUSTOM_GENERATE, trust_remote_code=True)``: a directory
# holding ``custom_generate/generate.py``, which receives every ``generate()`` argument
CUSTOM_GENERATE = str(Path(__file__).resolve().parent / "hf_generate")


def speculative_generate(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: Sequence[Any] | None = None,
    stopping_criteria: Sequence[Any] | None = None,
    generation_config: Any = None,
    synced_gpus: bool = False,
    spec_streamer: Any = None,
    spec_config: SpecConfig | dict | str | Path | None = None,
    draft_model: Any = None,
    proposer: Proposer | None = None,
    spec_stats: DecodeStats | None = None,
    stop_strings: str | Sequence[str] | None = None,
    spec_tokenizer: Any = None,
    **model_kwargs: Any,
) -> Any:
    """Speculative ``generate()`` loop. Extra ``generate()`` kwargs: ``spec_config`` (file, dict or
    SpecConfig; its proposer/verifier are used, a lossy verifier with a ``UserWarning`` per sampled
    call, its target section is not and its sampling section must be the default: the model and
    ``generation_config`` are), ``draft_model`` (a loaded model
    for the draft_model proposer), ``spec_streamer`` (a streamer: transformers keeps ``streamer=`` from a callable;
    the ``CUSTOM_GENERATE`` directory form takes ``streamer=`` and ``assistant_model=``),
    ``proposer`` (a Proposer instance), ``spec_stats`` (a DecodeStats to fill), ``stop_strings``
    with ``spec_tokenizer`` (the tokenizer: transformers drops ``tokenizer=`` from a callable; the
    directory form takes ``tokenizer=``). Calls on one model decode one after another
    (``plugin_state.model_lock``), and so do calls sharing one ``proposer`` instance (``_locks``).
    A call that raises ends the streamer first."""
    gc = generation_config if generation_config is not None else model.generation_config
    streamer = spec_streamer
    caller = sys._getframe(1)
    with _ends_on_error(streamer):
        check_dropped_streamer(caller)
        check_supported(model, gc, synced_gpus_of(model, synced_gpus, caller), model_kwargs)
        # generate() stores the resolved ids (pad falls back to EOS) as tensors on the config
        eos = token_ids(getattr(gc, "_eos_token_tensor", gc.eos_token_id))
        pad_id = next(iter(token_ids(getattr(gc, "_pad_token_tensor", gc.pad_token_id))), None)

        # 1. rows: strip left padding, keep the pads for the processors' view
        rows, pads = split_left_padding(input_ids, model_kwargs.get("attention_mask"), pad_id)
        max_new = int(gc.max_length) - input_ids.shape[1]

        with _locks(model, proposer):
            # 2. components: the user's model as target (its runtime wrapper, costs and wired proposers kept,
            # so later calls measure nothing: ``plugin_state.Setup``), proposer/verifier from the spec config
            cfg = _spec_config(spec_config)
            setup = Setup.of(model)
            target = setup.runtime
            check_context(rows, max_new, target.max_context)
            wiring = setup.wired(cfg, draft_model, spec_config is None, proposer, tokenizer=spec_tokenizer)
            # no proposer: plain decoding, the target's law (the exact verifier), as ``from_config``
            verifier = VERIFIERS.get(cfg.verifier.type)(cfg.verifier) if wiring.proposer is not None else VERIFIERS.get("exact")()
            if gc.do_sample and getattr(verifier, "lossy", True):  # at temperature 0 every verifier is greedy
                warnings.warn(f"speculative_generate: the {cfg.verifier.type!r} verifier is lossy: the samples do "
                              "not follow the model's distribution (use verifier: {type: exact})", UserWarning,
                              stacklevel=2)
            # transformers' processor list already holds its warpers (temperature, top-k, top-p, ...):
            # sample from the processed scores as they are (temperature 1), or take their argmax.
            sampling = SamplingConfig(temperature=1.0 if gc.do_sample else 0.0, seed=None)
            pipeline = LogitsPipeline(sampling, adapt_processors(logits_processor or [], input_ids))
            criteria = [*(stopping_criteria or []), *_stop_string_criteria(stop_strings, spec_tokenizer)]
            out: list[list[int]] = [[] for _ in rows]
            done = [False] * len(rows)
            stop = Stops.build(criteria, gc, eos, pad_id, pads, rows, input_ids.device)
            # seeded rows where their draws are keyed; a drafted distribution's rejection tests draw from
            # streams either way (seeds would cost one verifier call per row): torch's global RNG there
            keyed = wiring.traits.point_masses and takes_keyed_draws(verifier)
            seeds = _row_seeds(len(rows)) if gc.do_sample and keyed else None

            # 3. decode, streaming as we go
            stats = spec_stats if spec_stats is not None else DecodeStats()
            sent = cut = 0
            if streamer is not None:
                streamer.put(input_ids.cpu())  # the prompt first, as generate() puts it
            errors: dict[int, tuple[int, str]] = {}  # failed row -> (its kept tokens, why)
            try:
                for step in decode(target, wiring.proposer, verifier, pipeline, rows, max_new, eos, None, stats,
                                   wiring.policy(), processor_prefix=pads, stop=stop, seeds=seeds,
                                   traits=wiring.traits):
                    for i, toks in step.emitted.items():
                        out[i].extend(toks)
                    for i in step.finished:
                        done[i] = True
                    errors |= {i: (len(out[i]), why) for i, why in step.errors.items()}
                    if stop is not None:  # the criteria, step by step over the whole batch (``hf_stops``)
                        gone, errors = stop.settle(out, done, errors)
                        cut += gone
                    if errors:  # plain generate() raises at the first column where a row's processing fails
                        if _reached(out, done, errors):
                            break
                        continue
                    if streamer is not None:
                        sent = _stream(streamer, out, done, sent, pad_id, None if stop is None else stop.checked)
            finally:  # the kept runtime (and proposer) hold no rows or KV between calls, also after a
                # streamer, stopping criterion or Ctrl-C raised mid-decode
                target.select_rows([])
                if wiring.traits.row_aware:
                    wiring.proposer.select_rows([])
                _uncount(stats, cut)
            if errors:
                i, (end, why) = min(errors.items(), key=lambda e: (e[1][0], e[0]))
                if streamer is not None:  # the columns plain generate() streamed before it raised
                    _stream(streamer, [o[:end] for o in out], [d and j not in errors for j, d in enumerate(done)],
                            sent, pad_id)
                raise RuntimeError(f"speculative_generate: row {i} failed: {why}")
            if streamer is not None:
                _stream(streamer, out, [True] * len(out), sent, pad_id)
    if streamer is not None:
        streamer.end()

    # 4. transformers' layout: padded prompt + new tokens, right-padded with pad_token_id
    sequences = _assemble(input_ids, out, pad_id)
    if gc.return_dict_in_generate:
        from transformers.generation import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


# ---- checks ------------------------------------------------------------------------------------
@contextmanager
def _ends_on_error(streamer: Any) -> Iterator[None]:
    """End the streamer where the call raises (a refusal before anything is streamed, or an error
    mid-decode), then re-raise: a thread reading a ``TextIteratorStreamer`` would otherwise wait
    forever for an ``end()`` that never comes."""
    try:
        yield
    except BaseException:
        if streamer is not None:
            streamer.end()
        raise


@contextmanager
def _locks(model: Any, proposer: Proposer | None) -> Iterator[None]:
    """The model's lock, then the ``proposer`` instance's (where one is passed): a proposer keeps
    its drafting state (a cache, per-row state) on itself, so two models' calls sharing it decode
    one after another. Every call takes them in this order, so none waits for a lock while
    holding one another call waits for first."""
    if proposer is not None and not isinstance(proposer, Proposer):
        raise TypeError(f"proposer= must be a Proposer instance (a spec_plugins.proposers.base.Proposer subclass), "
                        f"got {type(proposer).__name__}")
    with ExitStack() as held:
        held.enter_context(model_lock(model))
        if proposer is not None:
            held.enter_context(model_lock(proposer))  # the same lock registry, keyed on the instance
        yield


# ---- components ----------------------------------------------------------------------------------
def _spec_config(spec: SpecConfig | dict | str | Path | None) -> SpecConfig:
    """File path (YAML/JSON), dict or SpecConfig. A file or dict gets a placeholder target where it
    names none: the model ``generate()`` was called on is the target (one it names is unused). A
    sampling section other than the default is refused (``generate()``'s arguments sample)."""
    if spec is None:
        return default_config()
    source = "spec_config"
    if isinstance(spec, (str, Path)):
        spec, source = load_file(spec, what="spec_config"), str(spec)
        if not isinstance(spec, dict):
            raise ConfigError(f"spec_config {source} must be a mapping of config sections (proposer, verifier, "
                              f"sampling), got {type(spec).__name__}")
    if isinstance(spec, dict):
        data = dict(spec)
        data.setdefault("target", {"backend": "torch", "model": "<the model generate() was called on>"})
        spec = SpecConfig.parse(data, source=source)
    if isinstance(spec, SpecConfig):
        check_sampling_section(spec.sampling, source)
        return spec
    raise TypeError(f"spec_config must be a path, a dict or a SpecConfig, got {type(spec).__name__}")


def _row_seeds(n: int) -> list[int]:
    """One seed per row, drawn from torch's global RNG, so ``torch.manual_seed`` decides them and
    every sampled call takes the same n draws from it. A seeded row's samples are keyed on (seed,
    position) (``keyed_draws``), so its output does not depend on how many tokens each round
    drafted (timed costs, the tree sizer's state), as draws from one shared stream would."""
    return [int(s) for s in torch.randint(0, 2**63 - 1, (n,)).tolist()]


def _stop_string_criteria(stop_strings: str | Sequence[str] | None, tokenizer: Any) -> list[Any]:
    """transformers' stop-string criterion, built here as plain ``generate()`` builds it: for a
    callable ``custom_generate``, ``generate()`` drops ``tokenizer=`` and would refuse
    ``stop_strings`` for want of it, so this function takes both itself."""
    if stop_strings is None:
        return []
    if tokenizer is None:
        raise ValueError("speculative_generate: stop_strings needs the tokenizer, which transformers does not hand "
                         "to a callable custom_generate (it drops tokenizer=): pass it as spec_tokenizer=, or use "
                         "the directory form (custom_generate=CUSTOM_GENERATE, trust_remote_code=True), which "
                         "takes tokenizer=")
    from transformers.generation.stopping_criteria import StopStringCriteria

    return [StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)]


# ---- output ------------------------------------------------------------------------------------
def _stream(streamer: Any, out: list[list[int]], done: list[bool], sent: int, pad_id: int | None,
            final: int | None = None) -> int:
    """Batch 1: put each round's new tokens at once. Batch > 1: put column by column, [B] per put
    as plain generate() does, once every unfinished row has the column (finished rows: pad).
    ``final``: the columns the stopping criteria have checked (None: no criteria), the only ones
    no later check can cut."""
    if len(out) == 1:
        ready = len(out[0]) if final is None else min(len(out[0]), final)
        if ready > sent:
            streamer.put(torch.tensor(out[0][sent:ready], dtype=torch.long, device="cpu"))
        return max(sent, ready)
    ready = final if final is not None else min((len(o) for o, d in zip(out, done) if not d),
                                                default=max(len(o) for o in out))
    for c in range(sent, ready):
        streamer.put(torch.tensor([o[c] if c < len(o) else pad_of(pad_id) for o in out], dtype=torch.long, device="cpu"))
    return max(sent, ready)


def _reached(out: list[list[int]], done: list[bool], errors: dict[int, tuple[int, str]]) -> bool:
    """Whether every running row holds the first column a row failed at (``errors``: row -> its
    kept tokens): plain ``generate()`` streams the batch's columns up to that one, so the other
    rows decode on to it before the call raises."""
    end = min(n for n, _ in errors.values())
    return all(done[i] or len(o) >= end for i, o in enumerate(out) if i not in errors)


def _uncount(stats: DecodeStats, cut: int) -> None:
    """``new_tokens`` (and so ``tokens_per_second``) counts the tokens the call returns: take out
    the ``cut`` tokens the rounds emitted past where the stopping criteria ended their rows. The per-round counts (emitted,
    accepted, by depth) stay what the rounds did: they measure the speculation, not the output."""
    stats.new_tokens -= cut


def _assemble(input_ids: torch.Tensor, out: list[list[int]], pad_id: int | None) -> torch.Tensor:
    T = max((len(o) for o in out), default=0)
    new = [o + [pad_of(pad_id)] * (T - len(o)) if len(o) < T else o for o in out]
    new_t = torch.tensor(new, dtype=torch.long, device=input_ids.device).reshape(len(out), T)
    return torch.cat([input_ids, new_t], dim=1)
