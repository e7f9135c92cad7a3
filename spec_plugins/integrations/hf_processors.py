"""transformers' logits processors made row-free for speculative rounds.

The round scores every drafted node of every row as one batch of prefixes, so a processor may see
a row's prefix at any batch index. transformers builds some processors per batch row (the
repetition penalty's left pads, the ``encoder_*`` processors' prompts): they are rebuilt here to
find their row from the prefix itself. Processors that depend on the batch layout in a way a
prefix cannot tell are refused, naming why.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch


class _PromptIndex:
    """Finds each prefix's row by its padded prompt: a row's prefix starts with it (the first L
    columns), whatever token fills its pads. Prompts are looked up by a hash of those columns, then
    compared exactly, so one lookup serves any number of rows and prompts."""

    def __init__(self, prompts: torch.Tensor) -> None:
        self.prompts = prompts  # distinct padded prompts [U, L]
        gen = torch.Generator().manual_seed(0)  # not torch's global RNG, which sampling draws from
        while True:  # weights under which the distinct prompts hash apart, so one lookup finds each
            self.weights = torch.randint(1, 2**31, (prompts.shape[1],), generator=gen).to(prompts.device)
            self.keys = self._hash(prompts)
            if len(set(self.keys.tolist())) == len(prompts):
                break

    def _hash(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids * self.weights.to(ids.device)).sum(1)

    def find(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt index [R], whether row r starts with that prompt [R]) on input_ids' device."""
        dev = input_ids.device
        prompts, keys = self.prompts.to(dev), self.keys.to(dev)
        head = input_ids[:, :prompts.shape[1]]
        at = torch.zeros(input_ids.shape[0], dtype=torch.long, device=dev)
        found = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=dev)
        if head.shape[1] == prompts.shape[1]:
            hit = self._hash(head)[:, None] == keys[None]  # [R, U]
            at = hit.long().argmax(1)
            found = hit.any(1) & (head == prompts[at]).all(1)
        return at, found


class _PromptRepetitionPenalty:
    """transformers' repetition penalty for a padded batch skips row b's first
    ``prompt_ignore_length[b]`` tokens (its left pads) by batch index, which breaks once rows are
    regrouped per drafted node. Same effect, row-free: the row's count comes from the padded prompt
    its prefix starts with (``_PromptIndex``; a draft model's processors get the same padded prefixes,
    ``ProposeContext.processor_prefix``); a prefix that is no prompt skips nothing."""

    def __init__(self, penalty: float, prompts: torch.Tensor, ignore: torch.Tensor) -> None:
        # distinct padded prompts [U, L] and their counts [U], on the prompts' device
        self.penalty, self.index, self.ignore = penalty, _PromptIndex(prompts), ignore.to(prompts.device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from transformers import RepetitionPenaltyLogitsProcessor

        at, found = self.index.find(input_ids)
        lead = torch.where(found, self.ignore.to(input_ids.device)[at], torch.zeros_like(at))
        return RepetitionPenaltyLogitsProcessor(self.penalty, prompt_ignore_length=lead)(input_ids, scores)


def _repetition_penalty(p: Any, input_ids: torch.Tensor) -> Any:
    """transformers' per-row ``prompt_ignore_length`` (generate()'s: the left pads) made row-free."""
    from transformers.generation import logits_process as lp

    counts = p.prompt_ignore_length.tolist()
    if len(counts) != input_ids.shape[0]:
        raise ValueError(f"RepetitionPenaltyLogitsProcessor: prompt_ignore_length has {len(counts)} entries for a "
                         f"batch of {input_ids.shape[0]} rows")
    if not any(counts):
        return lp.RepetitionPenaltyLogitsProcessor(p.penalty)
    first: dict[tuple[int, ...], int] = {}
    for b, row in enumerate(map(tuple, input_ids.tolist())):
        c = first.setdefault(row, b)
        if counts[c] != counts[b]:
            raise ValueError(f"repetition_penalty: rows {c} and {b} have identical input_ids but skip {counts[c]} "
                             f"and {counts[b]} leading tokens (their attention masks differ); rows regrouped per "
                             "drafted node are told apart by their prompt only, so this batch is not supported")
    rows = list(first.values())
    return _PromptRepetitionPenalty(p.penalty, input_ids[rows], torch.tensor([counts[b] for b in rows]))


class _PromptScoped:
    """transformers builds its ``encoder_*`` processors from the whole prompt batch (also for
    decoder-only models) and indexes them by batch row, which breaks once rows are regrouped per
    drafted node. Same effect, row-free: one processor per distinct padded prompt, built once (the
    n-gram table is costly to build), applied to the rows whose prefix starts with that prompt
    (``_PromptIndex``), as plain ``generate()`` applies it to that prompt's row. A prefix that is no
    prompt keeps its scores, as the repetition penalty skips nothing there."""

    def __init__(self, build: Callable[[torch.Tensor], Any], input_ids: torch.Tensor) -> None:
        prompts = torch.unique(input_ids, dim=0)  # distinct padded prompts [U, L]
        self.index = _PromptIndex(prompts)
        self.procs = [build(prompt[None]) for prompt in prompts]  # each from its prompt, batch size 1

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        at, found = self.index.find(input_ids)
        out = scores.clone()
        for u in torch.unique(at[found]).tolist():
            rows = (found & (at == u)).nonzero().squeeze(1)
            out[rows] = self.procs[u](input_ids[rows], scores[rows])
        return out


def _encoder_processor(p: Any, input_ids: torch.Tensor) -> _PromptScoped:
    """An ``encoder_*`` processor per prompt row; the penalty is copied as stored (the constructor
    keeps 1/penalty, which a round trip could round)."""
    from transformers.generation import logits_process as lp

    if isinstance(p, lp.EncoderNoRepeatNGramLogitsProcessor):
        return _PromptScoped(lambda enc: lp.EncoderNoRepeatNGramLogitsProcessor(p.ngram_size, enc), input_ids)

    def with_prompt(enc: torch.Tensor) -> Any:
        q = copy.copy(p)
        q.encoder_input_ids = enc
        return q

    return _PromptScoped(with_prompt, input_ids)


def adapt_processors(procs: Sequence[Any], input_ids: torch.Tensor) -> list[Any]:
    """Make transformers' processor list row-free; refuse processors that depend on batch layout."""
    from transformers.generation import logits_process as lp

    refused = {
        "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn receives a batch index",
        "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance runs its own model with a cache between calls",
        "ClassifierFreeGuidanceLogitsProcessor": "it expects the batch doubled with unconditional rows",
        "SynthIDTextWatermarkLogitsProcessor": "it keeps state between calls (its recent contexts), which calls per "
                                               "drafted node would advance out of step",
    }
    out = []
    for p in procs:
        name = type(p).__name__
        if name in refused:
            raise ValueError(f"logits processor {name} is not supported by speculative_generate: {refused[name]}")
        if isinstance(p, lp.RepetitionPenaltyLogitsProcessor) and isinstance(p.prompt_ignore_length, torch.Tensor):
            p = _repetition_penalty(p, input_ids)
        elif isinstance(p, (lp.EncoderRepetitionPenaltyLogitsProcessor, lp.EncoderNoRepeatNGramLogitsProcessor)):
            p = _encoder_processor(p, input_ids)
        out.append(p)
    return out
