"""User-facing API: text/chat/token-id prompts in, text + token ids + stats out.

``SpeculativeDecoder`` wires a target runtime, a proposer and a verifier from a SpecConfig and
adds what the engine does not care about: tokenization, chat templates, stop strings,
streaming. Plain decoding is the same object with no proposer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, Union

import torch

from spec_plugins.backends import build_runtime
from spec_plugins.config import SamplingConfig, SpecConfig
from spec_plugins.loop import decode
from spec_plugins.loop.batch import check_pairing
from spec_plugins.policy import AutoDraftLength, DraftPolicy, FixedLength
from spec_plugins.registry import PROPOSERS, VERIFIERS
from spec_plugins.sampling import LogitsPipeline, LogitsProcessorFn
from spec_plugins.stats import DecodeStats

Prompt = Union[str, Sequence[dict], Sequence[int]]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: DecodeStats
    prompt_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


@dataclass
class StreamEvent:
    token_ids: list[int]  # new tokens this round
    text: str  # new text this round (may be empty while a multi-byte char is incomplete)
    finish_reason: str | None = None


class SpeculativeDecoder:
    def __init__(self, target: Any, proposer: Any = None, verifier: Any = None, config: SpecConfig | None = None,
                 tokenizer: Any = None) -> None:
        self.target = target
        self.proposer = proposer
        self.verifier = verifier or VERIFIERS.get("exact")()
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        self.last_stats: DecodeStats | None = None

    @classmethod
    def from_config(cls, config: SpecConfig | dict | str, target: Any = None) -> "SpeculativeDecoder":
        """Build every component from a config (object, dict or file path)."""
        if isinstance(config, str):
            config = SpecConfig.from_file(config)
        elif isinstance(config, dict):
            config = SpecConfig.parse(config)
        target = target if target is not None else build_runtime(config.target)
        proposer = None
        if config.proposer is not None:
            cls_ = PROPOSERS.get(config.proposer.type)
            proposer = cls_(config.proposer, target=target, tokenizer=getattr(target, "tokenizer", None))
            check_pairing(target, proposer)
        verifier = VERIFIERS.get(config.verifier.type)(config.verifier)
        return cls(target, proposer, verifier, config)

    def without_speculation(self) -> "SpeculativeDecoder":
        """The same runtime and sampling, plain autoregressive decoding (for comparisons)."""
        return SpeculativeDecoder(self.target, None, self.verifier, self.config, self.tokenizer)

    # ---- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """str -> tokens (chat template applied if ``chat``), messages -> chat template, ids as is."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty")
            if chat and self.has_chat_template:
                return self.encode([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        seq = list(prompt)
        if not seq:
            raise ValueError("prompt is empty")
        if isinstance(seq[0], dict):
            if not self.has_chat_template:
                raise ValueError("chat messages given but the model's tokenizer has no chat template")
            ids = self.tokenizer.apply_chat_template(seq, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return [int(t) for t in seq]

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

    def policy(self, pipeline: LogitsPipeline | None = None) -> DraftPolicy:
        """The draft-length policy of one generation: the configured length, or ``auto`` over the
        runtime's measured (cached, online-corrected) cost model."""
        k = self.config.proposer.num_draft_tokens if self.config and self.config.proposer else 5
        if k == "auto":
            return AutoDraftLength.for_runtime(self.target, self.proposer, pipeline)
        return FixedLength(int(k))

    def _generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=getattr(self.target, "device", "cpu")).manual_seed(seed)

    # ---- generation ------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        processors: Sequence[LogitsProcessorFn] = (),
        chat: bool | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        stats: DecodeStats | None = None,
        observers: Sequence[Any] = (),
    ) -> Iterator[StreamEvent]:
        """Yield new tokens/text each round; stops at EOS, max_new_tokens or a stop string."""
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        ids = self.encode(prompt, chat)
        sampling = self._sampling(temperature, seed)
        pipeline = LogitsPipeline(sampling, processors)
        stats = stats if stats is not None else DecodeStats()
        self.last_stats = stats
        out: list[int] = []
        text_done = ""
        for step in decode(self.target, self.proposer, self.verifier, pipeline, [ids], max_new_tokens,
                           self.eos_ids(), self._generator(sampling.seed), stats, self.policy(pipeline),
                           observers=observers):
            new = step.emitted.get(0, [])
            out.extend(new)
            reason = step.finished.get(0)
            text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else ""
            if stop:
                hit = _find_stop(text, stop, len(text_done))
                if hit is not None:
                    yield StreamEvent(new, text[len(text_done):hit], "stop_sequence")
                    return
            # hold back an incomplete UTF-8 character (shown as U+FFFD) until it completes
            safe = text if not text.endswith("\ufffd") or reason else text[: len(text_done)]
            yield StreamEvent(new, safe[len(text_done):], reason)
            text_done = safe
            if reason:
                return

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, stop: Sequence[str] = (),
                 processors: Sequence[LogitsProcessorFn] = (), chat: bool | None = None,
                 temperature: float | None = None, seed: int | None = None,
                 observers: Sequence[Any] = ()) -> GenerationResult:
        ids = self.encode(prompt, chat)
        stats = DecodeStats()
        toks: list[int] = []
        text = ""
        reason = "length"
        for ev in self.stream(ids, max_new_tokens, stop, processors, temperature=temperature, seed=seed, stats=stats,
                              observers=observers):
            toks.extend(ev.token_ids)
            text += ev.text
            reason = ev.finish_reason or reason
        return GenerationResult(text, toks, stats, ids, reason)

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int | Sequence[int] = 128,
                       processors: Sequence[LogitsProcessorFn] = (), chat: bool | None = None,
                       temperature: float | None = None, seed: int | None = None,
                       sampling: Sequence[SamplingConfig] | None = None, seeds: Sequence[int | None] | None = None,
                       observers: Sequence[Any] = ()) -> list[GenerationResult]:
        """Decode several prompts as one batch (one target forward per round for all rows).
        ``sampling[i]`` / ``seeds[i]``: row i's own sampling and generator (default: the config's
        sampling, one generator shared by the rows)."""
        ids = [self.encode(p, chat) for p in prompts]
        base = self._sampling(temperature, seed)
        if sampling is not None and len(sampling) != len(ids) or seeds is not None and len(seeds) != len(ids):
            raise ValueError(f"sampling and seeds need one entry per prompt ({len(ids)})")
        shared = {base: LogitsPipeline(base, processors)}
        for s in sampling or ():
            shared.setdefault(s, LogitsPipeline(s, processors))
        pipes = [shared[s] for s in sampling] if sampling is not None else [shared[base]] * len(ids)
        stats = DecodeStats()
        self.last_stats = stats
        outs: list[list[int]] = [[] for _ in ids]
        reasons = ["length"] * len(ids)
        for step in decode(self.target, self.proposer, self.verifier, pipes, ids, max_new_tokens, self.eos_ids(),
                           self._generator(base.seed), stats, self.policy(pipes[0]), seeds=seeds,
                           observers=observers):
            for i, t in step.emitted.items():
                outs[i].extend(t)
            for i, r in step.finished.items():
                reasons[i] = r
        dec = (lambda t: self.tokenizer.decode(t, skip_special_tokens=True)) if self.tokenizer else (lambda t: "")
        return [GenerationResult(dec(o), o, stats, i, r) for o, i, r in zip(outs, ids, reasons)]

    def _sampling(self, temperature: float | None, seed: int | None) -> SamplingConfig:
        base = self.config.sampling if self.config else SamplingConfig()
        upd: dict[str, Any] = {}
        if temperature is not None:
            upd["temperature"] = temperature
        if seed is not None:
            upd["seed"] = seed
        return base.model_copy(update=upd) if upd else base


def _find_stop(text: str, stops: Sequence[str], already: int) -> int | None:
    """Earliest index where a stop string starts, searching text not yet emitted."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, already - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
