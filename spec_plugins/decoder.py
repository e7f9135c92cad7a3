"""User-facing API: text/chat/token-id prompts in, text + token ids + stats out.

``SpeculativeDecoder`` wires a target runtime, a proposer and a verifier from a SpecConfig and
adds what the engine does not care about: tokenization, chat templates, stop strings,
streaming. Plain decoding is the same object with no proposer.
"""

from __future__ import annotations

import os

from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, Union

from spec_plugins.api_inputs import (Stop, batch_prompts, chat_messages, checked_sampling, in_vocab, not_bytes,
                                     ordered_sequence, per_prompt, row_sampling, row_seeds, stop_strings, token_id,
                                     token_limits)
from spec_plugins.backends import build_runtime
from spec_plugins.config import SamplingConfig, SpecConfig
from spec_plugins.decoder_lock import runtime_lock
from spec_plugins.loop.ownership import drafter_runtimes
from spec_plugins.grammar import GrammarSpec, RowGrammar, compile_grammar, ll_tokenizer
from spec_plugins.grammar.spec import GrammarError, from_response_format, from_tgi
from spec_plugins.loop import Step, decode
from spec_plugins.policy import Costs, DraftPolicy
from spec_plugins.registry import VERIFIERS
from spec_plugins.sampling import LogitsPipeline, LogitsProcessorFn
from spec_plugins.stats import BatchStats, DecodeStats
from spec_plugins.text import StopFreeText, StopStrings, TextStream
from spec_plugins.wiring import Wiring, target_for, wire

Prompt = Union[str, Sequence[dict], Sequence[int]]
# a constraint on the output: a GrammarSpec, or TGI's {"type": "json" | "regex", "value": ...}
Grammar = Union[GrammarSpec, dict, None]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats
    prompt_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    error: str | None = None  # why the output ended with finish_reason "error"

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "error": self.error, "stats": self.stats.to_dict()}


@dataclass
class StreamEvent:
    token_ids: list[int]  # new tokens this round
    text: str  # new text this round (may be empty while a multi-byte char is incomplete)
    finish_reason: str | None = None
    error: str | None = None  # why the output ended with finish_reason "error"


class SpeculativeDecoder:
    def __init__(self, target: Any, proposer: Any = None, verifier: Any = None, config: SpecConfig | None = None,
                 tokenizer: Any = None, costs: Costs | None = None, wiring: Wiring | None = None) -> None:
        """``costs``: the runtime's measured costs to reuse; measured here (setup) when the
        proposer's section sizes anything ``auto`` and they are missing. ``wiring``: the proposer
        already wired to ``target`` (``from_config``)."""
        self.target = target
        self.verifier = verifier or VERIFIERS.get("exact")()
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        self.last_stats: DecodeStats | None = None  # the last generation's (a batch's totals: ``BatchStats``)
        if wiring is None:
            section = (config.proposer if config is not None else proposer.config) if proposer is not None else None
            wiring = wire(target, section, proposer=proposer, costs=costs)
        self.wiring = wiring  # proposer, costs and the tree sizer, whose calibrations carry across generations
        # one generation's thread at a time per runtime, the target's and its drafters' (a draft
        # model's, a hybrid child's: they hold one batch's rows): shared by every decoder over them
        p = wiring.proposer
        self.generation_lock = runtime_lock(target, *drafter_runtimes(p, p.sources() if p is not None else ()))

    @property
    def proposer(self) -> Any:
        return self.wiring.proposer

    @property
    def section(self) -> Any:
        return self.wiring.section

    @property
    def costs(self) -> Costs | None:
        return self.wiring.costs

    @property
    def sizer(self) -> Any:
        return self.wiring.sizer

    @classmethod
    def from_config(cls, config: SpecConfig | dict | str | os.PathLike, target: Any = None,
                    costs: Costs | None = None) -> "SpeculativeDecoder":
        """Build every component from a config (object, dict or file path); ``target`` and its
        measured ``costs`` to reuse instead of loading / measuring."""
        if isinstance(config, (str, os.PathLike)):
            config = SpecConfig.from_file(config)
        elif isinstance(config, dict):
            config = SpecConfig.parse(config)
        elif not isinstance(config, SpecConfig):
            raise TypeError(f"config must be a SpecConfig, a dict or a file path, got {type(config).__name__}")
        target = target if target is not None else build_runtime(target_for(config.target, config.proposer))
        wiring = wire(target, config.proposer, costs=costs, tokenizer=getattr(target, "tokenizer", None))
        # with no proposer nothing is drafted: plain decoding samples the target's law (the exact
        # verifier, the default), as ``without_speculation`` does, whatever verifier the config names
        verifier = VERIFIERS.get(config.verifier.type)(config.verifier) if config.proposer is not None else None
        return cls(target, verifier=verifier, config=config, wiring=wiring)

    def without_speculation(self) -> "SpeculativeDecoder":
        """The same runtime and sampling, plain autoregressive decoding (for comparisons): the exact
        verifier (the default), so its law is the target's even under a lossy config's verifier. It
        shares the runtime's generation lock with this decoder (and any other over it)."""
        return SpeculativeDecoder(self.target, None, None, self.config, self.tokenizer, self.costs)

    # ---- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """str -> tokens (as one user turn of the chat template if ``chat`` is True; a model
        without one is refused rather than prompted raw), messages -> chat template (each checked
        and mapped as the server's chat route does: ``api_inputs.chat_messages``), ids as is
        (integers within the target's vocabulary). Text needs the runtime's tokenizer; bytes are
        refused (``api_inputs.not_bytes``)."""
        not_bytes(prompt)
        if isinstance(prompt, str) or isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None:
                raise ValueError("a text or chat prompt needs a tokenizer (this runtime has none); pass token ids")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty")
            if chat:
                if not self.has_chat_template:
                    raise ValueError("chat=True, but the model's tokenizer has no chat template; pass chat=False "
                                     "to prompt with the raw text")
                return self.encode([{"role": "user", "content": prompt}])
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            return in_vocab(list(ids), self.target.vocab_size)
        seq = list(ordered_sequence(prompt))
        if not seq:
            raise ValueError("prompt is empty")
        if isinstance(seq[0], dict):
            msgs = chat_messages(seq)
            if not self.has_chat_template:
                raise ValueError("chat messages given but the model's tokenizer has no chat template")
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return in_vocab(list(ids), self.target.vocab_size)
        return in_vocab([token_id(t, i) for i, t in enumerate(seq)], self.target.vocab_size)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def eos_ids(self) -> list[int]:
        ids: set[int] = set()
        tok = self.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        gen_cfg = getattr(getattr(self.target, "model", None), "generation_config", None)
        e = getattr(gen_cfg, "eos_token_id", None)
        if e is not None:
            ids.update([e] if isinstance(e, int) else list(e))
        # runtimes without a transformers model (exported graphs) carry the ids themselves
        ids.update(int(i) for i in getattr(self.target, "eos_token_ids", ()))
        return sorted(ids)

    def policy(self) -> DraftPolicy:
        """The draft policy of one generation (fresh acceptance estimates) over this decoder's
        costs and tree sizer, which carry across generations."""
        return self.wiring.policy()

    # ---- generation ------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        stop: Stop = (),
        processors: Sequence[LogitsProcessorFn] = (),
        chat: bool | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        stats: DecodeStats | None = None,
        observers: Sequence[Any] = (),
        grammar: Grammar = None,
        response_format: dict | None = None,
        forced_drafts: bool = True,
    ) -> Iterator[StreamEvent]:
        """Yield new tokens/text each round; stops at EOS, max_new_tokens or a stop string (the
        text then ends before it; finish reason ``stop_sequence``). ``grammar`` or OpenAI's
        ``response_format``: the output is held to it at every drafted node (``grammar.rounds``);
        ``forced_drafts``: draft the tokens it forces. ``stop``: one stop string or several. A row
        that fails (a logits processor raising, a grammar with no way on) ends with finish reason
        ``error`` and the event's ``error`` says why."""
        ids = self.encode(prompt, chat)
        stops = stop_strings(stop)
        pipeline = LogitsPipeline(self._sampling(temperature, seed, "stream"), processors)
        rows = self.row_grammars([grammar], response_format, forced_drafts)
        yield from self._stream_ids(ids, max_new_tokens, stops, pipeline, stats, observers, rows)

    def _stream_ids(self, ids: list[int], max_new_tokens: int, stop: Sequence[str], pipeline: LogitsPipeline,
                    stats: DecodeStats | None, observers: Sequence[Any], grammars: list | None = None
                    ) -> Iterator[StreamEvent]:
        streams = self._text_streams(1, stop)
        shown = StopFreeText(stop)  # text sent never holds a stop string, nor a tail that may become one
        pushed = 0
        with closing(self._rounds([ids], [pipeline], max_new_tokens, streams, None, stats, observers,
                                  pipeline.sampling.seed, grammars)) as rounds:  # ends it (and its lock) on return
            for step, _ in rounds:
                reason = step.finished.get(0)
                text = ""
                if streams:
                    s = streams[0]
                    text = shown.push(s.text[pushed:], s.stop_at, bool(reason))
                    pushed = len(s.text)
                event = StreamEvent(step.emitted.get(0, []), text, _reason(reason), step.errors.get(0))
                if reason:
                    # the row's end is the decode's end: the decoder is free before its last event,
                    # as a caller may stop reading there without closing the stream
                    rounds.close()
                yield event
                if reason:
                    return

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, stop: Stop = (),
                 processors: Sequence[LogitsProcessorFn] = (), chat: bool | None = None,
                 temperature: float | None = None, seed: int | None = None,
                 observers: Sequence[Any] = (), grammar: Grammar = None, response_format: dict | None = None,
                 forced_drafts: bool = True) -> GenerationResult:
        """One prompt to the end (``stream``'s arguments)."""
        ids = self.encode(prompt, chat)
        stops = stop_strings(stop)
        pipeline = LogitsPipeline(self._sampling(temperature, seed, "generate"), processors)
        rows = self.row_grammars([grammar], response_format, forced_drafts)
        stats = DecodeStats()
        toks: list[int] = []
        text = ""
        reason = "length"
        error = None
        with closing(self._stream_ids(ids, max_new_tokens, stops, pipeline, stats, observers, rows)) as events:
            for ev in events:
                toks.extend(ev.token_ids)
                text += ev.text
                reason = ev.finish_reason or reason
                error = ev.error or error
        return GenerationResult(text, toks, stats, ids, reason, error)

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int] = 128,
                       processors: Sequence[LogitsProcessorFn] = (), chat: bool | None = None,
                       temperature: float | None = None, seed: int | None = None,
                       sampling: Sequence[SamplingConfig | dict] | None = None,
                       seeds: Sequence[int | None] | None = None, observers: Sequence[Any] = (), stop: Stop = (),
                       grammar: Grammar | Sequence[Grammar] = None, forced_drafts: bool = True) -> list[GenerationResult]:
        """Decode several prompts (a list; ``generate`` takes one) as one batch (one target forward
        per round for all rows). ``sampling[i]``: row i's own sampling (a ``SamplingConfig`` or its
        fields as a dict; not with ``temperature``, which it would override), seeded from its
        ``seed`` as ``generate(seed=...)`` seeds one; ``seeds[i]``: row i's seed, over
        ``sampling[i].seed`` where both are given (a row with neither, ``seeds[i]`` None and no
        ``sampling[i].seed``: lane i of the config's sampling seed or ``seed``, so rows sharing a
        seed sample apart; no seed at all: torch's global generator). A
        seeded row's output depends on its seed alone, not on the drafts, the draft schedule or the
        rows beside it (``keyed_draws``; drafts with their own distributions, a draft model's, use
        the row's stream generator, and those do depend on the schedule);
        ``stop``: stop strings for every row; ``grammar``: one for every row, or one per row
        (None: that row is free). A row that fails ends with finish reason ``error`` and its
        result's ``error`` says why. Each result's ``stats`` are its row's own (its tokens, and the
        prefill and rounds it took part in, with their times); the whole batch's totals are
        ``decoder.last_stats`` (a ``BatchStats``, whose ``rows`` holds those per-row stats)."""
        if sampling is not None and temperature is not None:
            raise ValueError("give temperature or sampling, not both: sampling sets each row's temperature")
        ids = batch_prompts(prompts, lambda p: self.encode(p, chat))
        stops = stop_strings(stop)
        per_row = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * len(ids)
        if len(per_row) != len(ids):
            raise ValueError(f"grammar needs one entry per prompt ({len(ids)}), got {len(per_row)}")
        rows = self.row_grammars(per_row, None, forced_drafts)
        base = self._sampling(temperature, seed, "generate_batch")
        sampling = per_prompt("sampling", sampling, len(ids), "SamplingConfig or dict")
        configs = [row_sampling(s, i) for i, s in enumerate(sampling)] if sampling is not None else None
        seeds_by_row = row_seeds(per_prompt("seeds", seeds, len(ids), "seed (an int or None)"), configs)
        shared = {base: LogitsPipeline(base, processors)}
        for s in configs or ():
            shared.setdefault(s, LogitsPipeline(s, processors))
        pipes = [shared[s] for s in configs] if configs is not None else [shared[base]] * len(ids)
        streams = self._text_streams(len(ids), stops)
        outs: list[list[int]] = [[] for _ in ids]
        reasons = ["length"] * len(ids)
        errors: list[str | None] = [None] * len(ids)
        stats = BatchStats()
        rounds = self._rounds(ids, pipes, max_new_tokens, streams, seeds_by_row, stats, observers, base.seed, rows)
        with closing(rounds):
            for k, (step, _) in enumerate(rounds):
                if k == 0:  # decode's first step is the prefill: its rows' share of it
                    stats.observe_admitted(step.emitted, step.errors)
                for i, t in step.emitted.items():
                    outs[i].extend(t)
                for i, r in step.finished.items():
                    reasons[i] = _reason(r)
                for i, e in step.errors.items():
                    errors[i] = e
        texts = [s.visible for s in streams] if streams else [""] * len(ids)
        return [GenerationResult(t, o, stats.row(k), i, r, e)
                for k, (t, o, i, r, e) in enumerate(zip(texts, outs, ids, reasons, errors))]

    def _text_streams(self, rows: int, stop: Sequence[str]) -> list[TextStream]:
        """One incremental text stream per row (none without a tokenizer: token ids only)."""
        if self.tokenizer is None:
            if any(stop):
                raise ValueError("stop strings need a tokenizer (this runtime has none); stop on token ids instead")
            return []
        return [TextStream(self.tokenizer, stop) for _ in range(rows)]

    def _rounds(self, ids: Sequence[list[int]], pipes: Sequence[LogitsPipeline], max_new_tokens: int | Sequence[int],
                streams: Sequence[TextStream], seeds: Sequence[int | None] | None, stats: DecodeStats | None,
                observers: Sequence[Any], seed: int | None = None, grammars: list | None = None
                ) -> Iterator[tuple[Step, DecodeStats]]:
        """The one decode behind every method: rows' text streams see each token once (their stop
        strings are row stops), and end flushed. It holds the runtime's generation lock from its
        first step until it ends, raises or is closed (another thread is refused meanwhile)."""
        limits = token_limits(max_new_tokens, len(ids))
        stats = stats if stats is not None else DecodeStats()
        row_stop = [StopStrings(s) for s in streams]
        stop = (lambda i, toks, n: row_stop[i](toks, n)) if streams else None
        with self.generation_lock.holding():
            self.last_stats = stats
            for step in decode(self.target, self.proposer, self.verifier, list(pipes), ids, limits, self.eos_ids(),
                               None, stats, self.policy(), stop=stop, seeds=seeds, observers=observers,
                               traits=self.wiring.traits, grammars=grammars, seed=seed):
                for i in step.finished:
                    if streams:
                        streams[i].flush()
                yield step, stats

    def row_grammars(self, grammars: Sequence[Grammar], response_format: dict | None = None,
                     forced_drafts: bool = True) -> list[RowGrammar | None] | None:
        """Each row's grammar state (None: no row is constrained), compiled and checked before any
        row starts (``GrammarError`` names what is wrong)."""
        specs = [g if isinstance(g, GrammarSpec) or g is None else from_tgi(g) for g in grammars]
        if response_format is not None:
            if any(specs):
                raise GrammarError("give grammar or response_format, not both")
            specs = [from_response_format(response_format)] * len(specs)
        if not any(specs):
            return None
        if self.tokenizer is None:
            raise GrammarError("a grammar needs the model's tokenizer; this runtime has none")
        tok = ll_tokenizer(self.tokenizer, int(self.target.vocab_size), self.eos_ids())
        compiled: dict[int, Any] = {}
        for s in specs:
            if s is not None and id(s) not in compiled:
                compiled[id(s)] = compile_grammar(s, tok)
        return [None if s is None else RowGrammar(compiled[id(s)], self.eos_ids(), int(self.target.vocab_size),
                                                  forced_drafts) for s in specs]

    def _sampling(self, temperature: float | None, seed: int | None, call: str = "generate") -> SamplingConfig:
        """The config's sampling with the ``call``'s temperature and seed over it (an error names
        the argument, titled ``call``)."""
        base = self.config.sampling if self.config else SamplingConfig()
        upd: dict[str, Any] = {}
        if temperature is not None:
            upd["temperature"] = temperature
        if seed is not None:
            upd["seed"] = seed
        return checked_sampling(base.model_dump() | upd, call) if upd else base  # checked as a config is


def _reason(reason: str | None) -> str | None:
    """The batch's row-stop reason, named as the API names a stop string's."""
    return "stop_sequence" if reason == "stop" else reason
