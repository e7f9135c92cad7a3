"""A smaller model with the same tokenizer drafts autoregressively on any runtime.

The same tokenizer: every token both tokenizers hold has one id (``vocab.check_vocab_compatible``);
tokens only one of them holds (an added pad token) are accepted. A draft's tokens past the
target's logits width are never drafted (``fit_vocab`` cuts its logits); the target's past the
draft's vocabulary are handled as below.

Its KV cache follows the target's: after each round it is rolled back to the longest prefix it
shares with the committed sequence (known from the verdict: the accepted drafted tokens), so it
never re-reads the prompt. A row whose sequence and draft would pass the draft model's context
(shorter than the target's) gets no draft; the target goes on alone there. So does a row whose
sequence holds a token the draft model has no embedding for (a draft with a smaller vocabulary than
the target's, whose logits ``fit_vocab`` pads: a prompt's token, or one the target emits or a
processor forces): its sequence only grows, so it never drafts again, and what the draft caches
and feeds for it holds such tokens clamped into its vocabulary (a placeholder never drafted from).

Drafted tokens stay on the drafting device: each step's token feeds the next step there, and the
user processors see each row's prefix there too; nothing is read back. Each row draws from its
generator only for the tokens of its own budget, so a seeded row's draws do not depend on the rows
beside it. A row whose processed draft logits are no distribution (NaN, inf, every token masked)
draws a placeholder token from a point mass; its q stays NaN, which rejects that token, and the
target's pass fails the row alone where its own logits are no distribution either.
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


SECTION = "proposer.model"  # the config section a draft model's runtime is built from


def build_draft_runtime(section: Any) -> Any:
    """The draft model's runtime. Its load errors name only what they check (``path ... holds graph
    'draft' ...``, the same words as the target's), so a ValueError (a ManifestError too) is raised
    again, of its own type, with the config section before its message."""
    from spec_plugins.backends import build_runtime

    try:
        return build_runtime(section)
    except ValueError as exc:
        named = with_section(exc, SECTION)
        if named is exc:
            raise
        raise named from exc


def with_section(exc: ValueError, section: str) -> ValueError:
    """``exc`` as a new error of its type whose message starts with ``section: ``; ``exc`` itself
    where its type is not built from one message (a pydantic ValidationError, a JSONDecodeError)."""
    if len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return exc
    try:
        return type(exc)(f"{section}: {exc.args[0]}")
    except TypeError:
        return exc


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    point_masses = False  # sampled drafts carry the draft model's distribution
    class Config(ProposerConfig):
        type: Literal["draft_model"] = "draft_model"
        model: TargetField = Field(description="The draft model's runtime section (any backend).")

    def __init__(self, config: "DraftModelProposer.Config", target: Any = None, tokenizer: Any = None,
                 runtime: Any = None, **_: object) -> None:
        self.config = config
        self.runtime = runtime if runtime is not None else build_draft_runtime(config.model)
        self.vocab_size = target.vocab_size if target is not None else self.runtime.vocab_size
        if tokenizer is not None and getattr(self.runtime, "tokenizer", None) is not None:
            check_vocab_compatible(tokenizer, self.runtime.tokenizer, "target", "draft model")
        self._cached: list[int] = []  # tokens in the draft's cache, per row
        self._read: list[int] = []  # per row: leading tokens of its sequence the draft can read (-1: not all)
        self._base: list[int] = []  # per row: its sequence's length when the last draft started (0: none)
        self._forward_time = 0.0

    @property
    def draft_forward_time(self) -> float:
        return self._forward_time

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runtime.forward(self._clamp(tokens)).logits
        self._forward_time += time.perf_counter() - t0
        return fit_vocab(logits.float(), self.vocab_size)

    def _clamp(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens fed to a draft with a smaller vocabulary than the target's, clamped into it: only
        a row that drafts nothing (``_blind``) or a drafted token a processor forced outside it
        (whose q is its own, so verification stays exact) holds one; on the device, no sync."""
        return tokens.clamp_max(self.runtime.vocab_size - 1) if self.runtime.vocab_size < self.vocab_size else tokens

    def _blind(self, seqs: Sequence[Sequence[int]]) -> list[bool]:
        """Per row: whether its sequence holds a token the draft model has no embedding for (such a
        row never drafts: its sequence only grows). Each token is checked once, on the host."""
        top = self.runtime.vocab_size
        if top >= self.vocab_size:
            return [False] * len(seqs)
        for b, s in enumerate(seqs):
            n = self._read[b]
            if n >= 0:
                self._read[b] = len(s) if max(s[n:], default=-1) < top else -1
        return [n < 0 for n in self._read]

    def _heads(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """What the draft caches of each new row: all but the last prompt token (``propose`` feeds
        it with the pending token), a one-token prompt whole. A prompt that leaves the draft's
        context no room for one more token can never be drafted for (its sequence only grows):
        the draft runtime holds a row for it all the same, of its first token only. A prompt
        holding tokens the draft cannot read is cached with them clamped (it never drafts)."""
        heads = [list(p[:1]) if len(p) >= self.runtime.max_context else list(p[:-1]) or list(p) for p in prompts]
        top = self.runtime.vocab_size
        return [[min(t, top - 1) for t in h] for h in heads] if top < self.vocab_size else heads

    def _catch_up(self, seqs: Sequence[Sequence[int]], fits: Sequence[bool], room: int) -> torch.Tensor:
        """Feed each row that fits what its cache lacks of its sequence; returns the logits after
        each row's last fed token [B, V]. A forward feeds every row as many tokens, so a row
        missing fewer re-feeds tokens it holds; a row too short to re-feed that many (it joined
        after rounds without a draft, or drafts nothing) bounds the width, and the rows missing
        more catch up over several forwards. A row that does not fit (past the draft's context, or
        ``_blind``) drafts nothing: it re-feeds tokens of its own below ``room``, so the draft steps
        after stay in the context."""
        held = list(self._cached)
        while True:
            missing = max(len(s) - c for s, c, f in zip(seqs, held, fits) if f)
            width = min(max(1, missing), min(len(s) for s in seqs))
            ends = [max(width, min(len(s), c + width) if f else min(c, room)) for s, c, f in zip(seqs, held, fits)]
            starts = [e - width for e in ends]
            if starts != held:
                self.runtime.rollback(starts)
            fed = [list(s[a:e]) for s, a, e in zip(seqs, starts, ends)]
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
        fits = [len(s) <= room and not blind for s, blind in zip(seqs, self._blind(seqs))]
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
        pads = ctx.processor_prefix or [()] * B  # the processors see what the target's see (left pads first)
        prefix = ([upload_tensor([*pre, *s], logits.device) for pre, s in zip(pads, seqs)]
                  if ctx.pipeline.needs_prefix else seqs)
        # 2. draft k tokens autoregressively, each from the processed draft distribution q; a row
        # whose processors raise at a step drafts up to it (the batch judges that node as the target's)
        generators = list(ctx.generators or [ctx.generator] * B)
        for i in range(k):
            z, bad = process_rows_apart(ctx.pipeline, logits, prefix)
            for b in bad:
                budgets[b] = min(budgets[b], i)
            if ctx.pipeline.greedy:
                x = z.argmax(-1)
            else:
                q = z.float().softmax(-1)
                probs[:, i] = q
                x = _draw(q, generators, [b for b, n in enumerate(budgets) if n > i])
            toks[:, i] = x
            if ctx.pipeline.needs_prefix:
                prefix = [torch.cat([p, x[b:b + 1]]) for b, p in enumerate(prefix)]
            if i + 1 < k:  # the last token's logits are never needed
                logits = self._forward(x[:, None])[:, -1]
        self._cached = [b + k - 1 for b in self._base]
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
            self._cached, self._base, self._read = [], [], []
        else:
            self.runtime.add_rows(heads)
        self._cached += [len(h) for h in heads]
        self._base += [0] * len(heads)
        self._read += [0] * len(heads)
        self._forward_time += time.perf_counter() - t0

    def select_rows(self, rows: Sequence[int]) -> None:
        self.runtime.select_rows(rows)
        self._cached = [self._cached[r] for r in rows]
        self._base = [self._base[r] for r in rows]
        self._read = [self._read[r] for r in rows]

    def num_rows(self) -> int:
        return len(self._cached)


def _draw(q: torch.Tensor, generators: Sequence[torch.Generator | None], active: Sequence[int]) -> torch.Tensor:
    """One token per row of q [B, V], drawn only for the ``active`` rows (those whose budget reaches
    this step), each from its own generator, so a row's draws depend on its own budget alone; the
    others get token 0, a node their valid mask leaves out. A row whose q is NaN (its processed
    logits are no distribution: softmax then gives NaN throughout) draws from a point mass at 0:
    its q stays NaN, which rejects that token (``api_inputs.check_draft``)."""
    point = torch.zeros(q.shape[-1], device=q.device)
    point[0] = 1.0
    q = torch.where(q[:, :1].isnan(), point, q)
    if len(active) == q.shape[0]:
        return sample_rows(q, generators)
    x = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    if active:
        at = upload_tensor(list(active), q.device)
        x[at] = sample_rows(q[at], [generators[b] for b in active])
    return x
