"""The one batch: rows that join and leave between rounds, over one runtime and one proposer.

A fixed batch (``generate``, ``generate_batch``, the transformers plugin) is a batch with no
arrivals; the server adds and removes rows between rounds. Each row carries its own sampling
pipeline and generator, its processor prefix, stop rule, limit and (for feature drafters) the
target hidden states its proposer has not consumed yet. The round (``loop.round``) calls the
steps below in order; they hold the mechanics, the round holds the order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from spec_plugins.config import SamplingConfig
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.sampling import LogitsPipeline, RowPipelines
from spec_plugins.stats import DecodeStats
from spec_plugins.tree import TreeLayout, layout, with_root
from spec_plugins.types import (BatchView, Draft, Emission, ProposeContext, Ranked, RoundRecord, RowRequest,
                                RowStop, Verdict)

GREEDY = SamplingConfig()


@dataclass
class Row:
    """One sequence being decoded. ``tokens[-1]`` is pending (emitted, not yet cached)."""

    key: Hashable
    tokens: list[int]
    prompt_len: int
    max_new: int
    pipeline: LogitsPipeline
    generator: torch.Generator | None
    prefix: tuple[int, ...] = ()
    stop: RowStop | None = None
    logprobs: bool = False
    tenant: Hashable = None
    hidden: torch.Tensor | None = None  # [T, H] target features the proposer has not consumed
    done: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when this row's sampling failed; it leaves at the next round

    @property
    def n_new(self) -> int:
        return len(self.tokens) - self.prompt_len


def check_pairing(runtime: Any, proposer: Any) -> ProposerTraits:
    """The proposer's traits, refused where the runtime cannot serve them (checked once)."""
    traits = ProposerTraits.of(proposer)
    caps = runtime.capabilities
    if traits.tree and not caps.tree_mask:
        raise ValueError(f"proposer {type(proposer).__name__} drafts token trees, but the {caps.name or 'target'} "
                         "runtime cannot verify a tree mask; use a chain proposer on this runtime")
    if traits.needs_hidden and not caps.hidden_states:
        raise ValueError(f"proposer {type(proposer).__name__} needs the target's hidden states, which the "
                         f"{caps.name or 'target'} runtime does not return")
    if proposer is not None and not getattr(caps, "batch_invariant", True):
        raise ValueError(f"the {caps.name or 'target'} runtime computes a position differently in a one-position "
                         "forward than in a wider one (quantized kernels with int8 activations), so speculative "
                         "output would leave its plain output; set pad_single: true (or auto) on the target, or "
                         "decode without speculation")
    if traits.feature_layers and not caps.serves(traits.feature_layers):
        have = "none" if not caps.feature_layers else list(caps.feature_layers)
        raise ValueError(f"proposer {type(proposer).__name__} reads decoder layers {list(traits.feature_layers)}, "
                         f"but the {caps.name or 'target'} runtime returns {have}; export the target again with "
                         f"--feature-layers {','.join(map(str, traits.feature_layers))}")
    return traits


class Batch:
    """Rows decoded together: one target forward per round for all of them."""

    def __init__(self, runtime: Any, proposer: Any, verifier: Callable, eos_ids: Sequence[int] = (),
                 seed: int | None = 0, generator: torch.Generator | None = None, stats: DecodeStats | None = None,
                 observers: Sequence[Any] = (), clock: Callable[[], float] = time.perf_counter) -> None:
        self.runtime, self.proposer, self.verifier = runtime, proposer, verifier
        self.traits = check_pairing(runtime, proposer)
        self.device = torch.device(getattr(runtime, "device", "cpu"))
        self.eos = {int(e) for e in eos_ids}
        self.lossy = bool(getattr(verifier, "lossy", False))
        self.generator = generator if generator is not None else (
            torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None)
        self.stats = stats if stats is not None else DecodeStats()
        self.stats.lossy = self.stats.lossy or self.lossy
        self.observers = list(observers)
        self.clock = clock
        self.rows: list[Row] = []
        self._pipes: dict[tuple, LogitsPipeline] = {}
        self._rp: tuple[tuple, RowPipelines] | None = None  # the current rows' RowPipelines, by pipeline ids
        self.top_logprobs = 0  # alternatives reported with each emitted token's logprob (a server sets it)
        self._logits: torch.Tensor | None = None  # this round's raw target logits: logprobs read them
        self._select([])  # the runtime and proposer start with no rows (a previous batch may have left some)

    def __len__(self) -> int:
        return len(self.rows)

    def keys(self) -> list[Hashable]:
        return [r.key for r in self.rows]

    # ---- rows join --------------------------------------------------------------------------------
    def add(self, requests: Sequence[RowRequest]) -> list[Emission]:
        """Prefill new rows into the batch; returns each one's first token (a row asking for no
        tokens finishes at once, without touching the runtime)."""
        for r in requests:
            self._check_request(r)
        out = [Emission(r.key, [], [], "length") for r in requests if r.max_new_tokens == 0]
        live = [r for r in requests if r.max_new_tokens > 0]
        if not live:
            return out
        t0 = self.clock()
        new = [self._row(r) for r in live]
        n0 = len(self.rows)
        step = self.runtime.add_rows([r.prompt for r in live], want_hidden=self.traits.want_hidden)
        try:
            if self.traits.row_aware:
                self.proposer.admit([r.prompt for r in live])
            pending = torch.tensor([[r.tokens[-1]] for r in new], device=self.device)
            z = self._process(new, step.logits[:, -1:], pending, (-1,))
            verdict = self._verify(new, None, z)
        except BaseException:
            self._select(list(range(n0)))  # admission is atomic: the running rows as before
            raise
        for b, r in enumerate(new):
            r.hidden = step.hidden[b] if step.hidden is not None else None
        self.rows += new
        out += [Emission(r.key, [], [], "error", r.error) if r.error
                else self._emit(r, [verdict.next_tokens[b]], step.logits[b, -1:], [0]) for b, r in enumerate(new)]
        self.stats.observe_admit(len(new), self.clock() - t0)
        return out

    def _check_request(self, r: RowRequest) -> None:
        if not r.prompt:
            raise ValueError(f"request {r.key!r}: prompt is empty")
        if len(r.prompt) >= self.runtime.max_context:
            raise ValueError(f"request {r.key!r}: prompt has {len(r.prompt)} tokens; the context holds "
                             f"{self.runtime.max_context}")
        if r.max_new_tokens < 0:
            raise ValueError(f"request {r.key!r}: max_new_tokens must be >= 0")

    def _row(self, r: RowRequest) -> Row:
        pipeline = r.pipeline
        if pipeline is None:
            sampling = r.sampling or GREEDY
            # rows with equal settings share one pipeline, hence one processing group (the seed is
            # the generator's, not the pipeline's); the cache stays bounded in a long-lived server
            key = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty,
                   tuple(id(p) for p in r.processors))
            if key not in self._pipes:
                if len(self._pipes) >= 1024:
                    self._pipes.clear()  # rows hold their pipelines; only sharing restarts
                self._pipes[key] = LogitsPipeline(sampling, r.processors)
            pipeline = self._pipes[key]
        gen = self.generator
        if r.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(r.seed)
        limit = min(r.max_new_tokens, self.runtime.max_context - len(r.prompt))
        return Row(r.key, list(r.prompt), len(r.prompt), limit, pipeline, gen, tuple(r.prefix), r.stop,
                   r.logprobs, r.tenant)

    # ---- rows leave -------------------------------------------------------------------------------
    def remove(self, keys: Sequence[Hashable]) -> None:
        """Drop rows (finished or cancelled) from the runtime and proposer at once."""
        gone = set(keys)
        keep = [b for b, r in enumerate(self.rows) if r.key not in gone]
        if len(keep) < len(self.rows):
            self._select(keep)
            self.rows = [self.rows[b] for b in keep]

    def drop_finished(self) -> None:
        self.remove([r.key for r in self.rows if r.done])

    def close(self) -> None:
        """Release every row (the runtime then holds nothing of this batch)."""
        self._select([])
        self.rows = []

    def _select(self, keep: list[int]) -> None:
        self.runtime.select_rows(keep)
        if self.traits.row_aware:
            self.proposer.select_rows(keep)

    # ---- the steps of a round -----------------------------------------------------------------------
    def view(self) -> BatchView:
        """What the draft-length policy sees: sequences, room under each row's limit, draft keys."""
        seqs = [r.tokens for r in self.rows]
        room = [max(0, r.max_new - r.n_new - 1) for r in self.rows]
        if not self.traits.keyed:
            return BatchView(seqs, room)
        free = lambda rows, k: self.proposer.free_drafts([seqs[b] for b in rows], k)  # noqa: E731
        return BatchView(seqs, room, self.proposer.draft_keys(seqs), free)

    def draft(self, view: BatchView, ks: Sequence[int], sizing: Any = None) -> tuple[list[int], Draft | Ranked | None]:
        """Per-row budgets (lengths within each row's room) and the proposer's draft (a tree
        drafter's ranked candidates, for the policy to size), or None. ``sizing``: the policy's
        tree sizer, which a hybrid prices its children's candidates with."""
        budgets = [max(0, min(int(k), room)) for k, room in zip(ks, view.room)]
        if self.proposer is None or max(budgets, default=0) == 0:
            return budgets, None
        hidden = [r.hidden for r in self.rows] if self.traits.needs_hidden else None
        ctx = ProposeContext(view.sequences, budgets, self._row_pipelines(self.rows),
                             self.generator, self.runtime.capabilities.tree_mask, hidden,
                             [r.tenant for r in self.rows], sizing)
        return budgets, self.proposer.propose(ctx)

    def place(self, draft: Draft | None) -> Draft | None:
        """The sized draft on the runtime's device (moved once)."""
        return draft.to(self.device) if draft is not None else None

    def verify_input(self, draft: Draft | None) -> tuple[torch.Tensor, TreeLayout]:
        """The forward's input [B, 1 + n] (pending token + drafted nodes) on the runtime's device,
        and the layout of root + nodes."""
        pending = torch.tensor([[r.tokens[-1]] for r in self.rows], dtype=torch.long, device=self.device)
        if draft is None:
            return pending, layout((-1,))
        return torch.cat([pending, draft.tokens.to(torch.long)], 1), layout(with_root(draft.parents))

    def process(self, logits: torch.Tensor, tokens: torch.Tensor, tree: TreeLayout) -> torch.Tensor:
        """Each row's sampling pipeline over every node, with the prefix that node would have."""
        self._logits = logits
        return self._process(self.rows, logits, tokens, tree.parents)

    def _process(self, rows: Sequence[Row], logits: torch.Tensor, tokens: torch.Tensor,
                 parents: tuple[int, ...]) -> torch.Tensor:
        """Processed logits of ``rows``; a row whose processing raises or yields no finite
        distribution fails alone (``_fail``) and gets a harmless placeholder."""
        seen = self._seen(rows)
        try:
            z = self._row_pipelines(rows).process_tree(logits, seen, tokens, parents)
        except Exception:  # noqa: BLE001 - find the rows it fails for, one at a time
            z = torch.zeros_like(logits)
            for b, r in enumerate(rows):
                try:
                    z[b] = r.pipeline.process_tree(logits[b:b + 1], [seen[b]], tokens[b:b + 1], parents)[0]
                except Exception as exc:  # noqa: BLE001
                    self._fail(r, f"logits processing failed: {type(exc).__name__}: {exc}")
        bad = (~torch.isfinite(z.amax(-1)).all(-1)).nonzero().flatten().tolist()  # NaN, +inf or nothing allowed
        for b in bad:
            if rows[b].error is None:
                self._fail(rows[b], "sampling failed: the processed logits are not finite (NaN, inf, or every "
                                    "token masked)")
        for b, r in enumerate(rows):
            if r.error is not None:
                z[b] = 0.0  # the verifier sees a valid distribution; the row emits nothing
        return z

    def verify(self, draft: Draft | None, z: torch.Tensor) -> Verdict:
        return self._verify(self.rows, draft, z)

    def _fail(self, row: Row, message: str) -> None:
        row.error, row.done, row.finish_reason = message, True, "error"

    def check(self) -> None:
        """The batch's invariants: the runtime holds exactly its rows, each live row's cache is its
        sequence minus the pending token, and a RowAware proposer follows the same rows."""
        lengths = self.runtime.lengths()
        if len(lengths) != len(self.rows):
            raise AssertionError(f"the runtime holds {len(lengths)} rows, the batch {len(self.rows)}")
        for n, r in zip(lengths, self.rows):
            if not r.done and n != len(r.tokens) - 1:
                raise AssertionError(f"row {r.key!r}: the runtime caches {n} tokens, the row has {len(r.tokens) - 1}")
        if self.traits.row_aware and self.proposer.num_rows() != len(self.rows):
            raise AssertionError(f"the proposer follows {self.proposer.num_rows()} rows, the batch {len(self.rows)}")

    def emit(self, verdict: Verdict, keep: list[list[int]], tokens: torch.Tensor, z: torch.Tensor,
             hidden: torch.Tensor | None) -> list[Emission]:
        """Append each row's accepted tokens and its next token, stopping at EOS, its limit or its
        stop rule; keep the target features of the committed path for the proposer."""
        host = tokens.tolist()
        out = []
        for b, r in enumerate(self.rows):
            if r.error is not None:
                out.append(Emission(r.key, [], [], "error", r.error))
                continue
            toks = [host[b][j + 1] for j in verdict.accepted[b]] + [verdict.next_tokens[b]]
            out.append(self._emit(r, toks, self._logits[b], keep[b]))
            if hidden is not None:
                r.hidden = hidden[b, keep[b]]
        self._logits = None  # not held between rounds
        return out

    def observe(self, record: RoundRecord) -> None:
        """The proposer learns (and rolls back its own cache) first, then stats and observers."""
        if self.proposer is not None:
            t0, f0 = self.clock(), self.proposer.draft_forward_time
            self.proposer.observe(record)
            record.times.draft += self.clock() - t0
            record.times.draft_forward += self.proposer.draft_forward_time - f0
        self.stats.observe(record)
        for o in self.observers:
            o.observe(record)

    # ---- mechanics ----------------------------------------------------------------------------------
    def _row_pipelines(self, rows: Sequence[Row]) -> RowPipelines:
        """The rows' pipelines seen as one, built once per batch composition (a round reads it
        twice: the proposer's context and the logits processing)."""
        key = tuple(id(r.pipeline) for r in rows)
        if self._rp is None or self._rp[0] != key:
            self._rp = (key, RowPipelines([r.pipeline for r in rows]))
        return self._rp[1]

    def _seen(self, rows: Sequence[Row]) -> list[list[int]]:
        """The sequences the rows' user processors see: the row's prefix + its tokens."""
        return [list(r.prefix) + r.tokens if r.prefix else r.tokens for r in rows]

    def _verify(self, rows: Sequence[Row], draft: Draft | None, z: torch.Tensor) -> Verdict:
        """The registered verifier on row groups: greedy rows together, sampled rows by generator."""
        B = len(rows)
        x = draft.tokens if draft is not None else torch.zeros(B, 0, dtype=torch.long, device=z.device)
        parents = draft.parents if draft is not None else ()
        groups: dict[Hashable, list[int]] = {}
        for b, r in enumerate(rows):
            groups.setdefault("greedy" if r.pipeline.greedy else id(r.generator), []).append(b)
        if len(groups) == 1:
            r0 = rows[0]
            q = draft.probs if draft is not None else None
            valid = draft.valid if draft is not None else None
            return self.verifier(x, parents, z, q, r0.pipeline, r0.generator, valid)
        accepted: list[list[int]] = [[] for _ in range(B)]
        nxt = [0] * B
        for idx in groups.values():
            r0 = rows[idx[0]]
            q = draft.probs[idx] if draft is not None and draft.probs is not None else None
            valid = draft.valid[idx] if draft is not None and draft.valid is not None else None
            v = self.verifier(x[idx], parents, z[idx], q, r0.pipeline, r0.generator, valid)
            for j, b in enumerate(idx):
                accepted[b], nxt[b] = list(v.accepted[j]), int(v.next_tokens[j])
        return Verdict(accepted, nxt)

    def _emit(self, row: Row, toks: list[int], logits_row: torch.Tensor, at: Sequence[int]) -> Emission:
        """Append tokens to a row, stopping at EOS, its limit or its stop rule (``logits_row``
        [N, V]: the row's raw target logits, for logprobs)."""
        out: list[int] = []
        for t in toks[: row.max_new - row.n_new]:
            out.append(t)
            if t in self.eos:
                row.finish_reason = "eos_token"
                break
        row.tokens.extend(out)
        if row.stop is not None and out:
            keep = row.stop(row.tokens, len(out))
            if keep is not None:
                del row.tokens[len(row.tokens) - len(out) + keep:]
                out, row.finish_reason = out[:keep], "stop"
        if row.finish_reason is None and row.n_new >= row.max_new:
            row.finish_reason = "length"
        row.done = row.finish_reason is not None
        lps = _logprobs(logits_row, at, out, self.top_logprobs) if row.logprobs else []
        return Emission(row.key, out, lps, row.finish_reason)


class TokenLogprob(float):
    """An emitted token's log-probability; ``top``: the most likely tokens at its position,
    ``(id, logprob)`` best first (``Batch.top_logprobs`` of them, none by default)."""

    top: tuple[tuple[int, float], ...] = ()


def _finite(x: float) -> float:
    # a finite float for JSON: the floor only guards the serialisation
    return x if math.isfinite(x) else -1e30


def _logprobs(logits_row: torch.Tensor, at: Sequence[int], toks: Sequence[int], top: int = 0) -> list[float]:
    """The target's log p(token) at the position it was emitted from: log-softmax of the raw
    logits (``logits_row`` [N, V]), before repetition penalty, temperature, top-k and top-p, so
    every sampling setting that emits a token reports the same number for it."""
    n = min(len(at), len(toks))
    if n == 0:
        return []
    lp = logits_row[list(at[:n])].float().log_softmax(-1)
    idx = torch.tensor(list(toks[:n]), device=lp.device)[:, None]
    out = [TokenLogprob(_finite(x)) for x in lp.gather(-1, idx).squeeze(-1).tolist()]
    if top > 0:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        for o, vs, ts in zip(out, vals.tolist(), ids.tolist()):
            o.top = tuple((t, _finite(v)) for t, v in zip(ts, vs))
    return out
