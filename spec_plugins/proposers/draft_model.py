"""A smaller model with the same tokenizer drafts autoregressively on any runtime.

Its KV cache follows the target's: after each round it is rolled back to the longest prefix it
shares with the committed sequence (known from the verdict: the accepted drafted tokens), so it
never re-reads the prompt. A row whose sequence and draft would pass the draft model's context
(shorter than the target's) gets no draft; the target goes on alone there. Drafted tokens stay
on the drafting device: each step's token feeds the next step there, and the user processors see
each row's prefix there too; nothing is read back.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from spec_plugins.config import ProposerConfig, TargetField
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundRecord
from spec_plugins.registry import register_proposer
from spec_plugins.sampling import process_rows_apart, sample_rows
from spec_plugins.transfer import upload_tensor
from spec_plugins.vocab import check_vocab_compatible, fit_vocab


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    point_masses = False  # sampled drafts carry the draft model's distribution
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
        self._cached: list[int] = []  # tokens in the draft's cache, per row
        self._base: list[int] = []  # per row: its sequence's length when the last draft started (0: none)
        self._forward_time = 0.0

    @property
    def draft_forward_time(self) -> float:
        return self._forward_time

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runtime.forward(tokens).logits
        self._forward_time += time.perf_counter() - t0
        return fit_vocab(logits.float(), self.vocab_size)

    def _check_ids(self, rows: Sequence[Sequence[int]]) -> None:
        """Refuse a token the draft model has no embedding for (a draft with a smaller vocabulary
        than the target's: with tokenizers, ``check_vocab_compatible`` refuses such a pair up front)."""
        top = max((max(r) for r in rows if r), default=-1)
        if top >= self.runtime.vocab_size:
            raise ValueError(f"token {top} is outside the draft model's vocabulary of {self.runtime.vocab_size}: "
                             f"the target (vocabulary {self.vocab_size}) emits tokens the draft cannot read")

    def _heads(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """What the draft caches of each new row: all but the last prompt token (``propose`` feeds
        it with the pending token), a one-token prompt whole. A prompt that leaves the draft's
        context no room for one more token can never be drafted for (its sequence only grows):
        the draft runtime holds a row for it all the same, of its first token only."""
        heads = [list(p[:1]) if len(p) >= self.runtime.max_context else list(p[:-1]) or list(p) for p in prompts]
        self._check_ids(heads)
        return heads

    def _catch_up(self, seqs: Sequence[Sequence[int]], fits: Sequence[bool], room: int) -> torch.Tensor:
        """Feed each row that fits what its cache lacks of its sequence; returns the logits after
        each row's last fed token [B, V]. A forward feeds every row as many tokens, so a row
        missing fewer re-feeds tokens it holds; a row too short to re-feed that many (it joined
        after rounds without a draft) bounds the width, and the rows missing more catch up over
        several forwards. A row that does not fit (past the draft's context) drafts nothing: it
        re-feeds tokens of its own below ``room``, so the draft steps after stay in the context."""
        held = list(self._cached)
        while True:
            missing = max(len(s) - c for s, c, f in zip(seqs, held, fits) if f)
            width = min(max(1, missing), min(len(s) for s, f in zip(seqs, fits) if f))
            ends = [max(width, min(len(s), c + width) if f else min(c, room)) for s, c, f in zip(seqs, held, fits)]
            starts = [e - width for e in ends]
            if starts != held:
                self.runtime.rollback(starts)
            fed = [list(s[a:e]) for s, a, e in zip(seqs, starts, ends)]
            self._check_ids(fed)
            logits = self._forward(upload_tensor(fed, self.runtime.device))[:, -1]
            held = ends
            if all(e == len(s) for s, e, f in zip(seqs, ends, fits) if f):
                self._cached = held
                return logits

    @property
    def pool(self) -> Any:
        """The draft runtime's shared cache (llama.cpp), if it has one: rows are admitted against
        it as against the target's (``Batch.shortfall``)."""
        return getattr(self.runtime, "pool", None)

    def propose(self, ctx: ProposeContext) -> Draft | None:
        k = max(ctx.budgets, default=0)
        seqs = ctx.sequences
        if self.pool is not None:  # one cache holds every row's sequence and the k - 1 drafts fed to all
            k = min(k, (self.pool.cells - sum(len(s) for s in seqs)) // len(seqs) + 1)
        # a row drafts only where its k-1 fed draft tokens stay inside the draft's context
        room = self.runtime.max_context - (k - 1)
        fits = [len(s) <= room for s in seqs]
        budgets = [min(n, k) if f else 0 for f, n in zip(fits, ctx.budgets)]
        k = max(budgets, default=0)
        if k <= 0:
            return None
        # 1. catch up: every row's cache up to its sequence (rows past the context: within it)
        logits = self._catch_up(seqs, fits, room)
        self._base = list(self._cached)
        B = len(seqs)
        toks = torch.zeros(B, k, dtype=torch.long, device=logits.device)
        probs = None if ctx.pipeline.greedy else torch.zeros(B, k, self.vocab_size, device=logits.device)
        prefix = [upload_tensor(list(s), logits.device) for s in seqs] if ctx.pipeline.needs_prefix else seqs
        # 2. draft k tokens autoregressively, each from the processed draft distribution q; a row
        # whose processors raise drafts nothing (the batch fails it alone when it processes its logits)
        failed: set[int] = set()
        for i in range(k):
            z, bad = process_rows_apart(ctx.pipeline, logits, prefix)
            failed.update(bad)
            if ctx.pipeline.greedy:
                x = z.argmax(-1)
            else:
                q = z.float().softmax(-1)
                probs[:, i] = q
                x = sample_rows(q, ctx.generators or [ctx.generator] * B)
            toks[:, i] = x
            if ctx.pipeline.needs_prefix:
                prefix = [torch.cat([p, x[b:b + 1]]) for b, p in enumerate(prefix)]
            if i + 1 < k:  # the last token's logits are never needed
                logits = self._forward(x[:, None])[:, -1]
        self._cached = [b + k - 1 for b in self._base]
        budgets = [0 if b in failed else n for b, n in enumerate(budgets)]
        valid = torch.arange(k, device="cpu")[None, :] < torch.tensor(budgets, device="cpu")[:, None]
        return Draft(toks, tuple(range(-1, k - 1)), probs, None if bool(valid.all()) else valid)  # host valid

    def observe(self, result: RoundRecord) -> None:
        """Keep what the draft cache shares with each row's new sequence: its sequence before the
        draft and the accepted drafted tokens it fed (the first rejected one can never be the
        token emitted in its place)."""
        if not any(self._base):
            return
        lengths = [min(c, b + len(acc)) if b else c
                   for c, b, acc in zip(self._cached, self._base, result.accepted)]
        self._cached = lengths
        self._base = [0] * len(lengths)
        self.runtime.rollback(lengths)

    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        # propose() feeds each row whatever its cache lacks
        t0 = time.perf_counter()
        heads = self._heads(prompts)
        if not self._cached:
            self.runtime.prefill(heads)
            self._cached, self._base = [], []
        else:
            self.runtime.add_rows(heads)
        self._cached += [len(h) for h in heads]
        self._base += [0] * len(heads)
        self._forward_time += time.perf_counter() - t0

    def select_rows(self, rows: Sequence[int]) -> None:
        self.runtime.select_rows(rows)
        self._cached = [self._cached[r] for r in rows]
        self._base = [self._base[r] for r in rows]

    def num_rows(self) -> int:
        return len(self._cached)
