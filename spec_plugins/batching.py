"""Continuous batching: a running batch whose rows join and leave between rounds.

``engine.decode`` runs a fixed batch. A server needs requests to join while others decode, so
:class:`ContinuousBatch` keeps the runtime and proposer state alive between calls: ``add`` prefills
new rows into the running batch (``runtime.add_rows`` + ``proposer.admit``), ``remove`` drops
finished or cancelled rows at once (``select_rows``), ``step`` runs one round for every row:

1. draft (one proposer call, per-row budgets) -> 2. ONE target forward over all rows' drafts ->
3. logits processed per group of rows with equal sampling -> 4. the registered verifier, per group
(greedy rows together, rows with their own seeded generator alone) -> 5. commit + observe.

Each row has its own sampling parameters and generator; the accept/reject math stays in the
verifier. The draft length per round comes from a policy of the batch size
(:class:`LoadAwareDraftLength`: shrink it, down to 0, when verifying stops being free).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from spec_plugins.backends.base import can_add_rows
from spec_plugins.config import SamplingConfig
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundResult
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.tree import layout, with_root
from spec_plugins.verify import Verdict


@dataclass
class RowRequest:
    """A sequence to decode: prompt token ids, a limit, its own sampling and seed."""

    key: Hashable
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None  # own generator (reproducible per request); None = the batch's


@dataclass
class Emission:
    """Tokens one row emitted in one prefill/round (with their log-probabilities)."""

    key: Hashable
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None  # "eos_token" | "length" when the row finished


@dataclass
class _Row:
    key: Hashable
    tokens: list[int]  # prompt + output; tokens[-1] is pending (emitted, not yet cached)
    prompt_len: int
    max_new: int
    pipeline: LogitsPipeline
    generator: torch.Generator | None
    done: bool = False

    @property
    def n_new(self) -> int:
        return len(self.tokens) - self.prompt_len


class RowPipelines:
    """The rows' pipelines seen as one (what a proposer's ``ctx.pipeline`` needs).

    ``greedy`` only if every row is greedy; in a mixed batch the greedy rows' logits become a
    point mass at their argmax, so a sampling drafter drafts exactly what a greedy one would."""

    def __init__(self, pipelines: Sequence[LogitsPipeline]) -> None:
        self.pipelines = list(pipelines)
        self.greedy = all(p.greedy for p in self.pipelines)
        self.needs_prefix = any(p.needs_prefix for p in self.pipelines)
        self.sampling = self.pipelines[0].sampling if self.pipelines else SamplingConfig()

    def _groups(self) -> dict[int, list[int]]:
        g: dict[int, list[int]] = {}
        for r, p in enumerate(self.pipelines):
            g.setdefault(id(p), []).append(r)
        return g

    def process_rows(self, logits: torch.Tensor, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        out = torch.empty_like(logits)
        for rows in self._groups().values():
            p = self.pipelines[rows[0]]
            z = p.process_rows(logits[rows], [prefixes[r] for r in rows])
            if p.greedy and not self.greedy:
                z = z.masked_fill(z < z.max(-1, keepdim=True).values, float("-inf"))
            out[rows] = z
        return out

    def process_tree(self, logits: torch.Tensor, sequences: Sequence[Sequence[int]], tokens: torch.Tensor,
                     parents: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty_like(logits)
        for rows in self._groups().values():
            out[rows] = self.pipelines[rows[0]].process_tree(logits[rows], [sequences[r] for r in rows],
                                                             tokens[rows], parents)
        return out

    def probs(self, processed: torch.Tensor) -> torch.Tensor:
        return processed.float().softmax(-1)


DraftPolicy = Callable[[int], int]  # batch size -> draft length this round


class ContinuousBatch:
    """One target runtime + proposer decoding a batch that rows join and leave between rounds."""

    def __init__(self, target: Any, proposer: Proposer | None, verifier: Callable, eos_ids: Sequence[int] = (),
                 draft_length: DraftPolicy = lambda b: 5, stats: DecodeStats | None = None, seed: int | None = 0
                 ) -> None:
        if not can_add_rows(target):
            raise ValueError(f"runtime {type(target).__name__} has no add_rows(); it cannot batch continuously")
        if proposer is not None and type(proposer).admit is Proposer.admit:
            raise ValueError(f"proposer {type(proposer).__name__} has no admit(); it cannot batch continuously")
        if proposer is not None and proposer.needs_hidden:
            raise ValueError(f"proposer {type(proposer).__name__} needs target hidden states, which continuous "
                             "batching does not carry yet")
        self.target, self.proposer, self.verifier = target, proposer, verifier
        self.eos = {int(e) for e in eos_ids}
        self.draft_length = draft_length
        self.stats = stats if stats is not None else DecodeStats()
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.rows: list[_Row] = []
        self.last_k = 0
        self._pipes: dict[SamplingConfig, LogitsPipeline] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def keys(self) -> list[Hashable]:
        return [r.key for r in self.rows]

    def _pipeline(self, s: SamplingConfig) -> LogitsPipeline:
        if s not in self._pipes:
            self._pipes[s] = LogitsPipeline(s)
        return self._pipes[s]

    # ---- rows join ---------------------------------------------------------------------------
    def add(self, requests: Sequence[RowRequest]) -> list[Emission]:
        """Prefill new rows into the running batch; returns each one's first token."""
        if not requests:
            return []
        for r in requests:
            if not r.prompt:
                raise ValueError(f"request {r.key!r}: prompt is empty")
            if len(r.prompt) >= self.target.max_context:
                raise ValueError(f"request {r.key!r}: prompt has {len(r.prompt)} tokens; the context holds "
                                 f"{self.target.max_context}")
            if r.max_new_tokens < 1:
                raise ValueError(f"request {r.key!r}: max_new_tokens must be >= 1")
        t0 = time.perf_counter()
        fresh = not self.rows
        out = self.target.add_rows([r.prompt for r in requests])
        self.stats.time_prefill += time.perf_counter() - t0
        self.stats.prefill_forwards += 1
        new = [_Row(r.key, list(r.prompt), len(r.prompt), min(r.max_new_tokens, self.target.max_context - len(r.prompt)),
                    self._pipeline(r.sampling),
                    torch.Generator().manual_seed(r.seed) if r.seed is not None else self.generator)
               for r in requests]
        if self.proposer is not None:
            t1 = time.perf_counter()
            (self.proposer.begin if fresh else self.proposer.admit)([r.prompt for r in requests])
            self.stats.time_draft += time.perf_counter() - t1
        # the first token: the verifier over an empty draft (argmax, or a sample from p)
        t1 = time.perf_counter()
        pending = torch.tensor([[r.tokens[-1]] for r in new])
        z = RowPipelines([r.pipeline for r in new]).process_tree(out.logits[:, -1:], [r.tokens for r in new],
                                                                 pending, (-1,))
        verdict = self._verify(new, None, (), z)
        self.stats.time_verify += time.perf_counter() - t1
        self.rows += new
        ems = []
        for b, r in enumerate(new):
            toks = [verdict.next_tokens[b]]
            ems.append(self._emit(r, toks, _logprobs(z[b], [0], toks)))
        self.stats.new_tokens += len(new)
        self.stats.time_total += time.perf_counter() - t0
        return ems

    # ---- rows leave --------------------------------------------------------------------------
    def remove(self, keys: Sequence[Hashable]) -> None:
        """Drop rows (finished or cancelled) from the runtime and proposer at once."""
        gone = set(keys)
        keep = [b for b, r in enumerate(self.rows) if r.key not in gone]
        if len(keep) == len(self.rows):
            return
        self.target.select_rows(keep)
        if self.proposer is not None:
            self.proposer.select_rows(keep)
        self.rows = [self.rows[b] for b in keep]

    def finished(self) -> list[Hashable]:
        return [r.key for r in self.rows if r.done]

    # ---- one round ---------------------------------------------------------------------------
    def step(self) -> list[Emission]:
        """One round for every live row: draft, one target forward, verify, commit."""
        self.remove(self.finished())
        if not self.rows:
            return []
        t_round = time.perf_counter()
        rows, stats = self.rows, self.stats
        seqs = [r.tokens for r in rows]
        pipes = RowPipelines([r.pipeline for r in rows])
        # 1. draft
        draft: Draft | None = None
        keys: list[int] | None = None
        if self.proposer is not None and not self.proposer.tree and hasattr(self.draft_length, "observe_rows"):
            t0 = time.perf_counter()
            keys = self.proposer.draft_keys(seqs)  # per-row class of the coming draft (n-gram: match length, agreement)
            stats.time_draft += time.perf_counter() - t0
        if self.proposer is None:
            k = 0
        elif keys is not None:
            k = int(self.draft_length(len(rows), keys))  # type: ignore[call-arg]
        else:
            k = int(self.draft_length(len(rows)))
        k = self.last_k = max(0, k)
        budgets = [max(0, min(k, r.max_new - r.n_new - 1)) for r in rows]
        if k > 0:
            if max(budgets) > 0:
                t0 = time.perf_counter()
                fwd0 = self.proposer.draft_forward_time
                ctx = ProposeContext(seqs, budgets, pipes, self.generator, self.target.capabilities.tree_mask, None)
                draft = self.proposer.propose(ctx)
                stats.time_draft += time.perf_counter() - t0
                stats.time_draft_forward += self.proposer.draft_forward_time - fwd0
        parents = draft.parents if draft is not None else ()
        pending = torch.tensor([[s[-1]] for s in seqs], dtype=torch.long)
        tokens = torch.cat([pending, draft.tokens.cpu()], 1) if draft is not None else pending
        full = layout(with_root(parents))
        # 2. one target forward over every row's root and drafted nodes
        t0 = time.perf_counter()
        out = self.target.forward(tokens, tree=None if full.is_chain else full)
        dt = time.perf_counter() - t0
        stats.time_target_forward += dt
        stats.target_forwards += 1
        stats.verify_positions += tokens.shape[1]
        observe = getattr(self.draft_length, "observe_forward", None)
        if observe is not None:
            observe(len(rows), tokens.shape[1], dt)
        # 3-4. per-row logits processing, then the verifier per group
        t0 = time.perf_counter()
        z = pipes.process_tree(out.logits, seqs, tokens, full.parents)
        verdict = self._verify(rows, draft, parents, z)
        stats.time_verify += time.perf_counter() - t0
        # 5. commit the accepted paths, emit, let the proposer learn / roll back
        t0 = time.perf_counter()
        keep = verdict.keep()
        self.target.commit(keep)
        stats.time_cache += time.perf_counter() - t0
        depth_all = _depth_counts(draft) if draft is not None else []
        ems, emitted = [], []
        for b, r in enumerate(rows):
            acc = verdict.accepted[b]
            toks = [int(tokens[b, j + 1]) for j in acc] + [verdict.next_tokens[b]]
            em = self._emit(r, toks, _logprobs(z[b], keep[b], toks))
            ems.append(em)
            emitted.append(em.tokens)
            drafted = depth_all if draft is None or draft.valid is None else _depth_counts(draft, b)
            stats.observe_round(drafted, len(acc), len(em.tokens))
            stats.new_tokens += len(em.tokens)
        if keys is not None:
            n_drafted = draft.row_sizes() if draft is not None else [0] * len(rows)
            self.draft_length.observe_rows(keys, budgets, n_drafted,  # type: ignore[attr-defined]
                                           [len(a) for a in verdict.accepted])
        if self.proposer is not None:
            t0 = time.perf_counter()
            fwd0 = self.proposer.draft_forward_time
            self.proposer.observe(RoundResult(draft, verdict.accepted, emitted, seqs, z))
            stats.time_draft += time.perf_counter() - t0
            stats.time_draft_forward += self.proposer.draft_forward_time - fwd0
        stats.time_total += time.perf_counter() - t_round
        return ems

    def _verify(self, rows: Sequence[_Row], draft: Draft | None, parents: tuple[int, ...], z: torch.Tensor) -> Verdict:
        """The registered verifier on row groups: greedy rows together, sampled rows by generator."""
        B = len(rows)
        x = draft.tokens.cpu() if draft is not None else torch.zeros(B, 0, dtype=torch.long)
        groups: dict[Hashable, list[int]] = {}
        for b, r in enumerate(rows):
            groups.setdefault("greedy" if r.pipeline.greedy else id(r.generator), []).append(b)
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

    def _emit(self, row: _Row, toks: list[int], lps: list[float]) -> Emission:
        """Append tokens to a row, stopping at EOS or its limit."""
        room = row.max_new - row.n_new
        out: list[int] = []
        reason = None
        for t in toks[:room]:
            out.append(t)
            if t in self.eos:
                reason = "eos_token"
                break
        row.tokens.extend(out)
        if reason is None and row.n_new >= row.max_new:
            reason = "length"
        row.done = reason is not None
        return Emission(row.key, out, lps[: len(out)], reason)


def _logprobs(z_row: torch.Tensor, at: Sequence[int], toks: Sequence[int]) -> list[float]:
    """log p(token) under the processed logits it was emitted from (``z_row`` [N, V])."""
    n = min(len(at), len(toks))
    lp = z_row[list(at[:n])].float().log_softmax(-1)
    return lp.gather(-1, torch.tensor(list(toks[:n]))[:, None]).squeeze(-1).tolist()


def _depth_counts(draft: Draft, row: int | None = None) -> list[int]:
    depth = layout(draft.parents).depth
    if row is not None and draft.valid is not None:
        depth = depth[draft.valid[row].cpu()]
    return torch.bincount(depth).tolist() if depth.numel() else []


# ---- load-aware draft length ----------------------------------------------------------------
class ForwardCost:
    """Measured seconds of one target forward of ``n`` tokens per row for ``b`` rows, bilinear
    between the measured grid points (linear extrapolation beyond the largest batch/length)."""

    def __init__(self, table: dict[tuple[int, int], float]) -> None:
        self.table = dict(table)
        self.bs = sorted({b for b, _ in table})
        self.ns = sorted({n for _, n in table})
        missing = [(b, n) for b in self.bs for n in self.ns if (b, n) not in self.table]
        if missing:
            raise ValueError(f"forward cost grid is incomplete, missing {missing}")

    @staticmethod
    def _interp(xs: list[int], x: float, f: Callable[[int], float]) -> float:
        if len(xs) == 1 or x <= xs[0]:
            return f(xs[0])
        for lo, hi in zip(xs, xs[1:]):
            if x <= hi:
                return f(lo) + (f(hi) - f(lo)) * (x - lo) / (hi - lo)
        lo, hi = xs[-2], xs[-1]
        return f(hi) + (f(hi) - f(lo)) * (x - hi) / (hi - lo)

    def __call__(self, b: int, n: int) -> float:
        return self._interp(self.bs, b, lambda bb: self._interp(self.ns, n, lambda nn: self.table[(bb, nn)]))

    def to_dict(self) -> dict[str, float]:
        return {f"{b}x{n}": t for (b, n), t in sorted(self.table.items())}


class OnlineForwardCost:
    """A measured ``ForwardCost`` grid, corrected by the forwards the batch actually runs.

    The grid is timed once at startup, on random tokens at one context length; served traffic
    runs longer contexts on a machine whose speed drifts, and some widths run cheaper kernels
    than the grid's interpolation implies. Each observed forward updates a forgetting ratio of
    observed / grid for its tokens per row (``costmodel.OnlineCost``: unseen widths interpolate
    between seen ones), shared by every batch size: what a width costs relative to the grid
    follows the kernel and the machine more than the row count."""

    def __init__(self, base: ForwardCost, max_tokens: int, prior_weight: float = 1.0, decay: float = 0.98) -> None:
        from spec_plugins.costmodel import CostModel, OnlineCost

        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.base = base
        curve = CostModel(tuple(base(1, n) for n in range(1, max_tokens + 1)))
        self.online = OnlineCost(curve, prior_weight, decay)

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One forward over ``batch`` rows x ``tokens`` tokens per row took ``seconds``."""
        if batch >= 1 and tokens >= 1 and seconds > 0:
            self.online.observe_ratio(tokens, seconds / self.base(batch, tokens))

    def ratio(self, tokens: int) -> float:
        return self.online.ratio(tokens)

    def __call__(self, b: int, n: int) -> float:
        return self.base(b, n) * self.online.ratio(n)

    def to_dict(self) -> dict[str, float]:
        return self.base.to_dict()


@torch.inference_mode()
def measure_forward_cost(runtime: Any, batch_sizes: Sequence[int], tokens_per_row: Sequence[int],
                         context: int = 64, repeats: int = 5, vocab: int | None = None) -> ForwardCost:
    """Time ``runtime.forward`` for each (rows, tokens per row) after a ``context``-token prefill
    (``costmodel.time_forwards``: every shape warmed up, lengths in alternating order), take the
    median of ``repeats``, and make each batch size's curve nondecreasing in the tokens per row
    (a longer verify never costs less; noise saying otherwise would make drafting look free).
    Leaves the runtime with no rows."""
    from spec_plugins.costmodel import isotonic, time_forwards

    g = torch.Generator().manual_seed(0)
    v = min(vocab or runtime.vocab_size, runtime.vocab_size)
    table: dict[tuple[int, int], float] = {}
    ns = sorted(set(tokens_per_row))
    for b in batch_sizes:
        rows = torch.randint(0, v, (b, context), generator=g).tolist()
        samples = time_forwards(runtime, rows, torch.randint(0, v, (b, ns[-1]), generator=g), ns, repeats)
        fit = isotonic([statistics.median(samples[n]) for n in ns])
        table.update({(b, n): t for n, t in zip(ns, fit)})
    runtime.select_rows([])
    return ForwardCost(table)


class LoadAwareDraftLength:
    """Pick the draft length k in 0..max_k that maximises expected tokens per second for the
    current batch size: E[tokens per row per round](k) / cost(batch, k + 1).

    E(k) = 1 + sum_{d<k} a_d, with a_d the measured rate at which depth d is accepted
    (``stats.accepted_by_position / drafted_by_position``), shrunk towards ``prior ** (d + 1)``
    while few drafts were seen, times f, the share of row-rounds asked for a draft in which the
    proposer actually drafted (an n-gram proposer often finds no match; those rounds still pay
    for the padded verify). k = 0 (no drafting) wins once verifying k extra tokens per row
    costs more than the tokens it is expected to save."""

    def __init__(self, cost: Callable[[int, int], float], max_k: int, stats: DecodeStats,
                 prior: float = 0.6, prior_weight: float = 20.0, min_gain: float = 1.05) -> None:
        self.cost, self.max_k, self.stats = cost, max_k, stats
        # drafting must beat no drafting by this factor: the cost grid times the forward only, while
        # a padded verify also processes B x (k+1) logits rows; marginal wins are not worth the risk
        self.min_gain = min_gain
        self.prior, self.prior_weight = prior, prior_weight
        self.last: dict[str, float] = {}
        self._asked = 0  # row-rounds in which a draft (k >= 1) was asked for
        self._drafted0 = stats.drafted_by_position[0] if stats.drafted_by_position else 0
        # per draft key (``Proposer.draft_keys``): rows asked for depth d, drafted it, accepted through it
        self._by_key: dict[int, tuple[list[float], list[float], list[float]]] = {}
        self._recent_keys: deque[int] = deque(maxlen=256)

    def observe_forward(self, batch: int, tokens: int, seconds: float) -> None:
        """A forward the batch ran: corrects the cost grid when it learns online
        (``OnlineForwardCost``); a fixed grid ignores it."""
        observe = getattr(self.cost, "observe", None)
        if observe is not None:
            observe(batch, tokens, seconds)

    def draft_share(self) -> float:
        """f: drafted row-rounds / asked row-rounds, starting optimistic (1.0) while unmeasured."""
        s = self.stats
        drafted = (s.drafted_by_position[0] if s.drafted_by_position else 0) - self._drafted0
        return min(1.0, (drafted + self.prior_weight) / (self._asked + self.prior_weight))

    def expected_tokens(self, k: int) -> float:
        s, e = self.stats, 0.0
        for d in range(k):
            acc = s.accepted_by_position[d] if d < len(s.accepted_by_position) else 0
            dr = s.drafted_by_position[d] if d < len(s.drafted_by_position) else 0
            e += (acc + self.prior ** (d + 1) * self.prior_weight) / (dr + self.prior_weight)
        return 1.0 + self.draft_share() * e

    def choose(self, batch: int) -> int:
        """The best draft length for ``batch`` rows under the current acceptance estimates (with
        per-key evidence: rows drawn from the recent mix of keys; what /metrics shows per size)."""
        if self._recent_keys:
            return self._best_length(batch, lambda k: self._mean_expected(Counter(self._recent_keys), k))
        return self._best_length(batch, self.expected_tokens)

    def _best_length(self, batch: int, expected: Callable[[int], float]) -> int:
        """argmax_k expected(k) / cost(batch, k + 1); drafting (k >= 1) must beat k = 0 by min_gain."""
        best, best_rate = 0, -math.inf
        for k in range(self.max_k + 1):
            rate = expected(k) / self.cost(batch, k + 1)
            if rate > best_rate * (1.0001 if k == 0 or best > 0 else self.min_gain):
                best, best_rate = k, rate
        return best

    def _mean_expected(self, keys: Counter, k: int) -> float:
        """Mean over rows of E_key(k); keys counted once per distinct key (few: n-gram match classes)."""
        n = sum(keys.values())
        return sum(c * self.expected_tokens_for_key(key, k) for key, c in keys.items()) / n

    # ---- per-row keys: each row's expected tokens from the estimate of its own key ------------
    def expected_tokens_for_key(self, key: int, k: int) -> float:
        """1 + sum_{d<k} P(key's rows draft depth d) * P(accepted through d | drafted), both
        shrunk towards the prior while the key has little evidence."""
        asked, drafted, accepted = self._by_key.get(key, ([], [], []))
        w, e = self.prior_weight, 1.0
        for d in range(k):
            a_n = asked[d] if d < len(asked) else 0.0
            d_n = drafted[d] if d < len(drafted) else 0.0
            c_n = accepted[d] if d < len(accepted) else 0.0
            offered = (d_n + w) / (a_n + w)
            e += offered * (c_n + self.prior ** (d + 1) * w) / (d_n + w)
        return e

    def choose_for_keys(self, keys: Sequence[int]) -> int:
        """The padded draft length L maximising sum_rows E_key(L) / cost(rows, L + 1): every row
        pays for the padded verify, so one strong row (a 3-gram copy) can carry the batch, and a
        batch of unmatched rows does not draft at all."""
        counts = Counter(keys)
        return self._best_length(len(keys), lambda k: self._mean_expected(counts, k))

    def observe_rows(self, keys: Sequence[int], budgets: Sequence[int], drafted: Sequence[int],
                     accepted: Sequence[int]) -> None:
        for key, bud, d, a in zip(keys, budgets, drafted, accepted):
            asked, dr, acc = self._by_key.setdefault(key, ([], [], []))
            for lst, n in ((asked, bud), (dr, d), (acc, a)):
                while len(lst) < n:
                    lst.append(0.0)
                for j in range(n):
                    lst[j] += 1.0

    def __call__(self, batch: int, keys: Sequence[int] | None = None) -> int:
        if keys is not None:
            self._recent_keys.extend(keys)
            k = self.choose_for_keys(keys)
            if k >= 1:
                self._asked += batch
            e = self._mean_expected(Counter(keys), k) if keys else 1.0
            self.last = {"batch": batch, "draft_length": k, "expected_tokens": e}
            return k
        k = self.choose(batch)
        if k >= 1:
            self._asked += batch
        self.last = {"batch": batch, "draft_length": k, "expected_tokens": self.expected_tokens(k)}
        return k
