"""A smaller model with the same tokenizer drafts autoregressively on any runtime.

Its KV cache follows the target's: after each round it is rolled back to the longest prefix it
shares with the committed sequence, so it never re-reads the prompt.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from spec_plugins.config import ProposerConfig, TargetField
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundRecord
from spec_plugins.registry import register_proposer
from spec_plugins.sampling import sample
from spec_plugins.vocab import check_vocab_compatible, fit_vocab


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    class Config(ProposerConfig):
        type: Literal["draft_model"] = "draft_model"
        model: TargetField = Field(description="The draft model's runtime section (any backend).")

    def __init__(self, config: "DraftModelProposer.Config", target: Any = None, tokenizer: Any = None,
                 runtime: Any = None, **_: object) -> None:
        from spec_plugins.backends import build_runtime

        self.config = config
        self.runtime = runtime if runtime is not None else build_runtime(config.model)
        self.vocab_size = target.vocab_size if target is not None else self.runtime.vocab_size
        if tokenizer is not None and getattr(self.runtime, "tokenizer", None) is not None:
            check_vocab_compatible(tokenizer, self.runtime.tokenizer, "target", "draft model")
        self._fed: list[list[int]] = []  # tokens in the draft's cache, per row
        self._base: list[int] = []  # committed length per row when the last draft started
        self._forward_time = 0.0

    @property
    def draft_forward_time(self) -> float:
        return self._forward_time

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runtime.forward(tokens).logits
        self._forward_time += time.perf_counter() - t0
        return fit_vocab(logits.float(), self.vocab_size)

    def _start(self, prompts: Sequence[Sequence[int]]) -> None:
        """A fresh batch: cache all but the last prompt token; propose() feeds the rest with the
        pending token (one-token prompts: nothing to hold back)."""
        heads = [list(p[:-1]) for p in prompts]
        if not all(heads):
            heads = [list(p) for p in prompts]
        self.runtime.prefill(heads)
        self._fed = heads
        self._base = []

    def propose(self, ctx: ProposeContext) -> Draft | None:
        k = max(ctx.budgets, default=0)
        if k <= 0:
            return None
        seqs = ctx.sequences
        # 1. catch up: every row feeds the same number of tokens (rows needing fewer re-feed one)
        need = max(len(s) - len(f) for s, f in zip(seqs, self._fed))
        need = max(need, 1)
        starts = [len(s) - need for s in seqs]
        if any(len(f) != st for f, st in zip(self._fed, starts)):
            self.runtime.rollback(starts)
        feed = torch.tensor([list(s[st:]) for s, st in zip(seqs, starts)], dtype=torch.long, device=self.runtime.device)
        logits = self._forward(feed)[:, -1]
        self._fed = [list(s) for s in seqs]
        self._base = [len(s) for s in seqs]
        B = len(seqs)
        toks = torch.zeros(B, k, dtype=torch.long, device=logits.device)
        probs = None if ctx.pipeline.greedy else torch.zeros(B, k, self.vocab_size, device=logits.device)
        prefix = [list(s) for s in seqs]
        # 2. draft k tokens autoregressively, each from the processed draft distribution q
        for i in range(k):
            z = ctx.pipeline.process_rows(logits, prefix)
            if ctx.pipeline.greedy:
                x = z.argmax(-1)
            else:
                q = z.float().softmax(-1)
                probs[:, i] = q
                x = sample(q, ctx.generator)
            toks[:, i] = x
            for b, t in enumerate(x.tolist()):
                prefix[b].append(t)
            if i + 1 < k:  # the last token's logits are never needed
                logits = self._forward(x[:, None])[:, -1]
                for b, t in enumerate(x.tolist()):
                    self._fed[b].append(t)
        valid = torch.arange(k, device="cpu")[None, :] < torch.tensor(list(ctx.budgets), device="cpu")[:, None]
        return Draft(toks, tuple(range(-1, k - 1)), probs, None if bool(valid.all()) else valid)  # host valid

    def observe(self, result: RoundRecord) -> None:
        # Keep the longest prefix the draft cache shares with each row's new sequence; only the
        # part fed since propose() started (from self._base) can differ.
        lengths = []
        for b, seq in enumerate(result.sequences):
            fed = self._fed[b]
            n = min(len(fed), len(seq))
            i = min(self._base[b], n) if b < len(self._base) else 0
            while i < n and fed[i] == seq[i]:
                i += 1
            lengths.append(i)
            self._fed[b] = fed[:i]
        self.runtime.rollback(lengths)

    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        # cache all but the last prompt token (a one-token prompt is cached whole); propose()
        # feeds each row whatever its cache lacks
        t0 = time.perf_counter()
        if not self._fed:
            self._start(prompts)
        else:
            heads = [list(p[:-1]) if len(p) > 1 else list(p) for p in prompts]
            self.runtime.add_rows(heads)
            self._fed += heads
            if self._base:
                self._base += [len(h) for h in heads]
        self._forward_time += time.perf_counter() - t0

    def select_rows(self, rows: Sequence[int]) -> None:
        self.runtime.select_rows(rows)
        self._fed = [self._fed[r] for r in rows]
        self._base = [self._base[r] for r in rows if r < len(self._base)]

    def num_rows(self) -> int:
        return len(self._fed)
