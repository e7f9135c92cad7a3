"""One forward-cost model: seconds of a target forward over (batch rows, positions per row).

A draft of k tokens pays one target forward over k+1 positions per row plus the drafting. On a
GPU that forward costs about the same for 1 or 9 positions; on a CPU it grows with the
positions, and it grows with the rows of the batch, so the best draft length depends on the
machine and the load. The model is measured once per runtime through the Runtime contract only
(prefill, forward, rollback), so it works on every backend; the 1-D curve of a single
generation is its one-row case.

One statistic, one smoothing rule, one online correction:
- **minimum of the repeats**: on a shared machine noise only ever adds time. A burst that hits
  most repeats of one width makes a median read that width as far dearer than it is, and
  ``auto`` then stops drafting that deep. The minimum also drops the first, allocating call of
  a shape, so a single warm-up suffices.
- **no smoothing**: matmul kernels make some widths cheaper than narrower ones; a monotone fit
  would hide that from the policy, and the online correction below absorbs what is noise.
- **online correction** (``OnlineCost``): the forwards the round actually runs correct the curve
  per width (longer contexts, machine drift), shared by every batch size and generation.

The measured model and its corrections are held explicitly (``policy.costs.Costs``), by whoever
owns the runtime: measured at setup, never inside a round.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch


@dataclass(frozen=True)
class DraftCost:
    """Seconds of one ``propose`` call and per drafted token (a draft model's forwards)."""

    per_call: float = 0.0
    per_token: float = 0.0

    def __call__(self, drafted: float) -> float:
        return self.per_call + self.per_token * drafted


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Linear between measured points; beyond the last, the average slope of the whole curve, never
    below 0: a noisy curve whose last point reads cheaper than its first would otherwise price
    wider forwards ever cheaper, then free, then negative (never measured, so never trusted)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] + max(0.0, (ys[-1] - ys[0]) / (xs[-1] - xs[0])) * (x - xs[-1])
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    raise AssertionError("unreachable")


class ForwardCost:
    """Measured seconds per (rows, positions per row), interpolated between measured points.

    Positions interpolate within each measured row count; rows interpolate between measured row
    counts; past the largest of either, the cost grows linearly and never falls below the last
    measured value (``_interp``). A model measured for one row only prices every batch as one
    row, which is what a single generation needs."""

    def __init__(self, table: dict[tuple[int, int], float], context: int = 0, runtime: str = "",
                 repeats: int = 0) -> None:
        if not table:
            raise ValueError("a forward-cost model needs at least one measured point")
        if any(b < 1 or n < 1 or not (t > 0) for (b, n), t in table.items()):
            raise ValueError(f"forward costs need rows, positions >= 1 and positive seconds, got {table}")
        self.table = dict(table)
        self.rows = sorted({b for b, _ in table})
        curves = {b: sorted((n, t) for (bb, n), t in table.items() if bb == b) for b in self.rows}
        # positions and seconds per row count, split once: the policy prices tens of (rows, n) a round
        self._curves = {b: ([n for n, _ in c], [t for _, t in c]) for b, c in curves.items()}
        self.context, self.runtime, self.repeats = context, runtime, repeats

    @classmethod
    def from_curve(cls, seconds: Sequence[float], **meta: Any) -> "ForwardCost":
        """The one-row model of a curve: ``seconds[N-1]`` for a forward over N positions."""
        return cls({(1, n + 1): float(t) for n, t in enumerate(seconds)}, **meta)

    @property
    def max_positions(self) -> int:
        """Widths measured for every row count (beyond them the curve is extrapolated)."""
        return min(xs[-1] for xs, _ in self._curves.values())

    def _row(self, b: int, n: float) -> float:
        return _interp(*self._curves[b], n)

    def __call__(self, b: float, n: float) -> float:
        if n < 1 or b < 1:
            raise ValueError(f"a forward covers at least 1 row and 1 position, got {b} x {n}")
        rs = self.rows
        return _interp(rs, [self._row(r, n) for r in rs], b) if len(rs) > 1 else self._row(rs[0], n)

    def curve(self, b: int = 1) -> list[float]:
        """Seconds for N = 1..max_positions positions on ``b`` rows."""
        return [self(b, n) for n in range(1, self.max_positions + 1)]

    def relative(self, b: int = 1) -> list[float]:
        """T(N) / T(1): what verifying N positions costs in single-token forwards."""
        c = self.curve(b)
        return [t / c[0] for t in c]

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "positions": list(range(1, self.max_positions + 1)),
                "target_seconds": self.curve(1), "target_relative": self.relative(1),
                "table": {f"{b}x{n}": t for (b, n), t in sorted(self.table.items())},
                "statistic": "min", "smoothing": "none", "context": self.context, "runtime": self.runtime,
                "repeats": self.repeats}


class OnlineCost:
    """The measured model, corrected by the forwards the round actually runs.

    Each observed forward updates a forgetting mean of observed / measured for its width N; a
    width not seen yet takes the ratio interpolated between the nearest seen widths (costs change
    smoothly between kernel steps), so relative costs start as measured and move toward what the
    generations see. The ratio is shared by every row count: what a width costs relative to the
    measurement follows the kernel and the machine more than the batch. Held by the runtime's
    ``Costs``, so what one generation learns carries to the next."""

    def __init__(self, base: ForwardCost, prior_weight: float = 1.0, decay: float = 0.98) -> None:
        if prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"prior_weight must be > 0 and decay in (0, 1], got {prior_weight}, {decay}")
        self.base, self.prior_weight, self.decay = base, prior_weight, decay
        n = base.max_positions
        self._sum, self._cnt = [0.0] * n, [0.0] * n  # forgetting sums of observed / measured, per N
        self._ratios: list[float] | None = None
        self._seconds: dict[int, list[float]] = {}  # corrected seconds per N, per row count priced
        self._measured: dict[int, list[float]] = {}  # the base's seconds per N, per row count (fixed)

    @property
    def max_positions(self) -> int:
        return self.base.max_positions

    def observe(self, rows: int, positions: int, seconds: float) -> None:
        """One forward over ``rows`` x ``positions`` took ``seconds``."""
        if not (1 <= positions <= self.max_positions and rows >= 1 and seconds > 0):
            return  # beyond the model (nothing to correct) or a clock glitch
        i, lam = positions - 1, self.decay
        self._sum[i] = lam * self._sum[i] + seconds / self._measured_curve(rows)[i]
        self._cnt[i] = lam * self._cnt[i] + 1.0
        self._ratios, self._seconds = None, {}

    def _measured_curve(self, b: int) -> list[float]:
        """The base model's seconds for N = 1..max_positions on ``b`` rows, interpolated once."""
        m = self._measured.get(b)
        if m is None:
            m = self._measured[b] = [self.base(b, j + 1) for j in range(self.max_positions)]
        return m

    def ratio(self, positions: int) -> float:
        """Observed / measured for width N (1 until something near it was observed)."""
        return self._table()[min(max(positions, 1), self.max_positions) - 1]

    def _table(self) -> list[float]:
        """Ratio per width, rebuilt in O(max_positions) after an observation."""
        if self._ratios is None:
            n, w = self.max_positions, self.prior_weight
            mean = [self._sum[j] / self._cnt[j] if self._cnt[j] >= 0.5 else None for j in range(n)]
            prior = _neighbour_priors(mean)
            self._ratios = [(self._sum[j] + w * prior[j]) / (self._cnt[j] + w) for j in range(n)]
        return self._ratios

    def __call__(self, b: int, n: float) -> float:
        """Corrected seconds of a forward over ``b`` rows x ``n`` positions (fractional n
        interpolates; the last width's ratio beyond the model)."""
        if n < 1:
            raise ValueError(f"a forward covers at least 1 position, got {n}")
        c = self._seconds.get(b)
        if c is None:  # after an observation: the fixed measured curve times the new ratios
            c = self._seconds[b] = [t * r for t, r in zip(self._measured_curve(b), self._table())]
        lo = int(n)
        if n > len(c):  # beyond the measured widths
            return self.base(b, n) * self._table()[-1]
        return c[lo - 1] if n == lo else c[lo - 1] + (n - lo) * (c[lo] - c[lo - 1])


def _neighbour_priors(mean: list[float | None]) -> list[float]:
    """Each width's prior ratio, in O(widths): interpolated between the nearest observed widths
    strictly below and above it (one side only: that side's; none: 1, the model as measured)."""
    n = len(mean)
    below: list[int | None] = [None] * n
    above: list[int | None] = [None] * n
    for j in range(1, n):
        below[j] = j - 1 if mean[j - 1] is not None else below[j - 1]
    for j in range(n - 2, -1, -1):
        above[j] = j + 1 if mean[j + 1] is not None else above[j + 1]
    out = []
    for j, lo, hi in zip(range(n), below, above):
        if lo is None and hi is None:
            out.append(1.0)
        elif lo is None or hi is None:
            out.append(mean[hi if lo is None else lo])  # type: ignore[arg-type, index]
        else:
            out.append(mean[lo] + (j - lo) / (hi - lo) * (mean[hi] - mean[lo]))  # type: ignore[operator]
    return out


# ---- measuring -------------------------------------------------------------------------------
def _context_tokens(vocab_size: int, n: int, period: int = 16) -> list[int]:
    """A deterministic, repetitive context: n-gram drafters find matches, models see real ids."""
    g = torch.Generator().manual_seed(1234)
    block = torch.randint(0, max(2, min(vocab_size, 30000)), (period,), generator=g, device="cpu").tolist()
    return (block * (n // period + 1))[:n]


def _sync(x: torch.Tensor) -> None:
    """Force an asynchronous device (CUDA) to finish before the clock is read."""
    x.reshape(-1)[:1].cpu()


def time_forwards(runtime: Any, rows: Sequence[Sequence[int]], new_tokens: torch.Tensor, widths: Sequence[int],
                  repeats: int, warmup: Sequence[int] | None = None) -> dict[int, list[float]]:
    """Seconds of ``runtime.forward`` over the first ``n`` columns of ``new_tokens`` [B, >= max
    width] appended to ``rows`` (prefilled once), ``repeats`` samples per width in ``widths``:
    warm-up forwards first (``warmup``, default every width), widths in alternating order per
    repeat so drift hits all alike, the device synchronised before the clock is read, the cache
    rolled back to the prompt after each forward."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runtime.prefill([list(r) for r in rows])
    base = [len(r) for r in rows]
    order = sorted(set(int(n) for n in widths))
    for n in order if warmup is None else warmup:
        _sync(runtime.forward(new_tokens[:, :n]).logits)
        runtime.rollback(base)
    samples: dict[int, list[float]] = {n: [] for n in order}
    for r in range(repeats):
        for n in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            _sync(runtime.forward(new_tokens[:, :n]).logits)
            samples[n].append(time.perf_counter() - t0)
            runtime.rollback(base)
    return samples


@torch.inference_mode()
def measure(runtime: Any, rows: Sequence[int] = (1,), widths: Sequence[int] = tuple(range(1, 18)),
            context: int = 128, repeats: int = 3) -> ForwardCost:
    """Time one forward of each (rows, width) on a warm cache of ``context`` tokens per row;
    the minimum of ``repeats`` (module docstring). Leaves the runtime with no rows."""
    widths = sorted(set(int(n) for n in widths))
    if not widths or widths[0] < 1 or min(rows) < 1 or context < 1 or repeats < 1:
        raise ValueError(f"rows, widths, context and repeats must be >= 1, got {rows}, {widths}, {context}, {repeats}")
    if context + widths[-1] > runtime.max_context:
        raise ValueError(f"context {context} + {widths[-1]} positions exceeds the runtime's {runtime.max_context}")
    rows = _fitting_rows(runtime, rows, context + widths[-1])
    ctx = _context_tokens(runtime.vocab_size, context + widths[-1])
    table: dict[tuple[int, int], float] = {}
    for b in sorted(set(rows)):
        new = torch.tensor([ctx[context: context + widths[-1]]] * b, dtype=torch.long, device=runtime.device)
        samples = time_forwards(runtime, [ctx[:context]] * b, new, widths, repeats, warmup=(1, widths[-1], 1))
        table.update({(b, n): min(samples[n]) for n in widths})
    runtime.select_rows([])
    return ForwardCost(table, context=context, runtime=runtime_name(runtime), repeats=repeats)


def runtime_name(runtime: Any) -> str:
    """The name a runtime's measured costs record (``ForwardCost.runtime``): its capabilities'
    name, else its class's."""
    return getattr(getattr(runtime, "capabilities", None), "name", "") or type(runtime).__name__


def _fitting_rows(runtime: Any, rows: Sequence[int], positions: int) -> list[int]:
    """The row counts a runtime whose rows share one cache (llama.cpp) can hold at ``positions``
    each (the others' costs are extrapolated from these); every count elsewhere. None fitting is
    refused, naming the cache."""
    from spec_plugins.loop.capacity import pool_of

    pool = pool_of(runtime)
    if pool is None:
        return list(rows)
    fit = [b for b in rows if b <= pool.sequences and b * positions <= pool.cells]
    if not fit:
        raise ValueError(f"measuring forward costs needs a row of {positions} positions, but the runtime's shared "
                         f"cache holds {pool.cells} cells and {pool.sequences} sequences; raise n_ctx")
    return fit


def measure_draft(proposer: Any, pipeline: Any, runtime: Any, context: int = 128, k: int = 4,
                  repeats: int = 3) -> DraftCost:
    """Per ``propose`` call and per drafted token, from budgets 1 and k on a repetitive context
    (medians of at least 5 interleaved pairs: a call is cheap, one outlier would read as free).
    A feature drafter gets the runtime's real hidden states of that context. The timing calls
    are no traffic: see ``measuring``."""
    with measuring(proposer):
        return _measure_draft(proposer, pipeline, runtime, context, k, repeats)


@contextmanager
def measuring(proposer: Any) -> Iterator[None]:
    """While the block runs, ``measuring`` is True on the proposer and each of its sources (a
    composition's children) that declare that attribute, so calls made only to time them stay
    out of what they count as traffic (suffix decoding's index lookups and hits in /metrics)."""
    from spec_plugins.proposers.base import ProposerTraits

    every = {id(p): p for p in (proposer, *ProposerTraits.of(proposer).sources)}.values()
    flagged = [p for p in every if hasattr(p, "measuring")]
    before = [p.measuring for p in flagged]
    for p in flagged:
        p.measuring = True
    try:
        yield
    finally:
        for p, was in zip(flagged, before):
            p.measuring = was


def _measure_draft(proposer: Any, pipeline: Any, runtime: Any, context: int, k: int, repeats: int) -> DraftCost:
    """``measure_draft``'s timing, with the proposer flagged as measuring."""
    from spec_plugins.proposers.base import ProposerTraits, RowAware
    from spec_plugins.types import ProposeContext, Ranked

    if k < 2:
        raise ValueError(f"k must be >= 2 to separate the per-token cost, got {k}")
    own = getattr(getattr(proposer, "runtime", None), "max_context", None)  # a draft model's context
    if own is not None:  # shorter than the context: it would draft nothing, and read as free
        context = max(2, min(context, own - k))
    seq = _context_tokens(runtime.vocab_size, context)
    hidden = None
    want = ProposerTraits.of(proposer).want_hidden
    if want:
        hidden = [runtime.prefill([seq[:-1]], want_hidden=want).hidden[0]]
        runtime.select_rows([])

    def once(budget: int) -> float:
        if isinstance(proposer, RowAware):
            proposer.select_rows([])
            proposer.admit([seq[:-1]])
        ctx = ProposeContext([seq], [budget], pipeline, None, runtime.capabilities.tree_mask, hidden)
        proposer.propose(ctx)  # catch-up (indexing / feeding the context) is not a per-round cost
        t0 = time.perf_counter()
        draft = proposer.propose(ctx)
        if isinstance(draft, Ranked):  # ranked candidates: their merge into a draft is part of drafting
            from spec_plugins.policy.tree_size import TreeSizer

            draft = TreeSizer().size(draft)
        if draft is not None:
            _sync(draft.tokens)
        return time.perf_counter() - t0

    once(1)
    once(k)  # warm-up
    pairs = [(once(1), once(k)) for _ in range(max(5, repeats))]
    t1 = statistics.median(a for a, _ in pairs)
    tk = statistics.median(b for _, b in pairs)
    step = max(0.0, (tk - t1) / (k - 1))
    if isinstance(proposer, RowAware):
        proposer.select_rows([])
    return DraftCost(max(0.0, t1 - step), step)
