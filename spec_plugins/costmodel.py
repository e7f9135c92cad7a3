"""Measured cost of one round on the active runtime, so draft lengths come from numbers.

A draft of k tokens pays one target forward over k+1 positions plus the drafting itself. On a
GPU the forward costs about the same for 1 or 9 positions; on a CPU it does not (SmolLM2 fp32:
8 positions ~1.9x one), so the best k depends on the machine. ``measure_target`` times a forward
over N = 1..max new positions with a warm cache through the Runtime contract only (prefill,
forward, rollback), so it works on every backend; ``measure_draft`` times the proposer's own
``propose`` call. Results are cached per runtime / proposer object.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch


@dataclass(frozen=True)
class CostModel:
    """Seconds per round component, measured once per runtime (+ proposer)."""

    target_seconds: tuple[float, ...]  # [N-1]: one forward over N new positions, N = 1..len (isotonic fit)
    raw_target_seconds: tuple[float, ...] = ()  # per-N minima over repeats, before the monotone fit
    draft_round_seconds: float = 0.0  # fixed cost of one propose() call (any k >= 1)
    draft_step_seconds: float = 0.0  # extra cost per drafted token (a draft model's forward)
    context: int = 0  # cached tokens while the target was timed
    runtime: str = ""
    repeats: int = 0

    def __post_init__(self) -> None:
        if not self.target_seconds:
            raise ValueError("a cost model needs at least one target timing (N = 1)")
        if any(not (t > 0) for t in self.target_seconds):
            raise ValueError(f"target timings must be positive seconds, got {self.target_seconds}")

    @property
    def max_positions(self) -> int:
        return len(self.target_seconds)

    def target(self, n: float) -> float:
        """Seconds of a forward over ``n`` positions (fractional n interpolates; linear beyond)."""
        if n < 1:
            raise ValueError(f"a forward covers at least 1 position, got {n}")
        ts = self.target_seconds
        if n >= len(ts):
            slope = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0
            return ts[-1] + slope * (n - len(ts))
        lo = int(n)
        frac = n - lo
        return ts[lo - 1] + frac * (ts[lo] - ts[lo - 1]) if frac else ts[lo - 1]

    def unsmoothed(self) -> "CostModel":
        """This model on the per-N minima, without the monotone fit. Matmul kernels make some
        widths cheaper than narrower ones (bench runs here: verifying 4 positions cost less than
        3, in the load-time minima and in the decode loop alike), which a policy choosing the
        width should see; ``OnlineCost`` then corrects what is noise."""
        if len(self.raw_target_seconds) != len(self.target_seconds):
            return self
        return replace(self, target_seconds=self.raw_target_seconds)

    def relative(self) -> list[float]:
        """T(N) / T(1): what verifying N positions costs in single-token forwards."""
        return [t / self.target_seconds[0] for t in self.target_seconds]

    @property
    def draft_cost_ratio(self) -> float:
        """c in S(gamma): one draft step relative to one single-position target forward."""
        return self.draft_step_seconds / self.target_seconds[0]

    def round_seconds(self, expected_drafted: float, drafts: bool,
                      forward: "Callable[[float], float] | None" = None) -> float:
        """Expected cost of one round that feeds ``expected_drafted`` draft nodes to the target
        (``forward``: another forward-time curve, e.g. ``OnlineCost.target``; default this one)."""
        t = (forward or self.target)(1.0 + expected_drafted)
        if drafts:
            t += self.draft_round_seconds + self.draft_step_seconds * expected_drafted
        return t

    def to_dict(self) -> dict[str, Any]:
        return {
            "positions": list(range(1, self.max_positions + 1)),
            "target_seconds": list(self.target_seconds),
            "raw_target_seconds": list(self.raw_target_seconds),
            "target_relative": self.relative(),
            "draft_round_seconds": self.draft_round_seconds,
            "draft_step_seconds": self.draft_step_seconds,
            "draft_cost_ratio": self.draft_cost_ratio,
            "context": self.context,
            "runtime": self.runtime,
            "repeats": self.repeats,
        }


def isotonic(values: Sequence[float]) -> list[float]:
    """Least-squares nondecreasing fit (pool adjacent violators): more positions never cost less."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out.extend([s / c] * int(c))
    return out


def _context_tokens(vocab_size: int, n: int, period: int = 16) -> list[int]:
    """A deterministic, repetitive context: n-gram drafters find matches, models see real ids."""
    g = torch.Generator().manual_seed(1234)
    block = torch.randint(0, max(2, min(vocab_size, 30000)), (period,), generator=g).tolist()
    return (block * (n // period + 1))[:n]


def _sync(x: torch.Tensor) -> None:
    """Force an asynchronous device (CUDA) to finish before the clock is read."""
    x.reshape(-1)[:1].cpu()


def time_forwards(runtime: Any, rows: Sequence[Sequence[int]], new_tokens: torch.Tensor, widths: Sequence[int],
                  repeats: int, warmup: Sequence[int] | None = None) -> dict[int, list[float]]:
    """Seconds of ``runtime.forward`` over the first ``n`` columns of ``new_tokens`` [B, >= max
    width] appended to ``rows`` (prefilled once), ``repeats`` samples per width in ``widths``.

    The one timing loop behind every cost curve (``measure_target``, the server's per-batch
    ``measure_forward_cost``): warm-up forwards first (runtimes allocate per shape on first
    use; ``warmup`` = the widths to warm, default all), widths in alternating order per repeat
    so drift hits all of them alike, the device synchronised before the clock is read, and the
    cache rolled back to the prompt after each forward."""
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


def measure_target(runtime: Any, max_positions: int = 32, context: int = 128, repeats: int = 3) -> CostModel:
    """Time one forward over N = 1..max_positions new positions on a warm cache of ``context``
    tokens (minimum of ``repeats``, order alternated to cancel drift). Why the minimum: on a
    shared machine noise only ever adds time, and one burst that hits two of three repeats of
    some N made the median-based curve read N=5 as 2.5x N=1 (measured here; the monotone fit then
    spread it over N=5..10 and ``auto`` stopped drafting more than 3). Leaves the runtime with a
    synthetic batch in its cache; the next prefill replaces it."""
    if max_positions < 1 or context < 1 or repeats < 1:
        raise ValueError(f"max_positions, context and repeats must be >= 1, got {max_positions}, {context}, {repeats}")
    if context + max_positions > runtime.max_context:
        raise ValueError(f"context {context} + {max_positions} positions exceeds the runtime's {runtime.max_context}")
    ctx = _context_tokens(runtime.vocab_size, context + max_positions)
    new = torch.tensor([ctx[context : context + max_positions]], dtype=torch.long)
    order = list(range(1, max_positions + 1))
    samples = time_forwards(runtime, [ctx[:context]], new, order, repeats, warmup=(1, max_positions, 1))
    raw = [min(samples[n]) for n in order]
    name = getattr(getattr(runtime, "capabilities", None), "name", "") or type(runtime).__name__
    return CostModel(tuple(isotonic(raw)), tuple(raw), context=context, runtime=name, repeats=repeats)


def measure_draft(proposer: Any, pipeline: Any, vocab_size: int, context: int = 128, k: int = 4,
                  repeats: int = 3) -> tuple[float, float]:
    """(seconds per propose() call, extra seconds per drafted token), from propose() with budgets
    1 and k on a repetitive context. Model-free drafters come out near (tens of us, 0)."""
    from spec_plugins.proposers.base import ProposeContext

    if k < 2:
        raise ValueError(f"k must be >= 2 to separate the per-token cost, got {k}")
    seq = _context_tokens(vocab_size, context)

    def once(budget: int) -> float:
        proposer.begin([seq[:-1]])
        ctx = ProposeContext([seq], [budget], pipeline)
        proposer.propose(ctx)  # catch-up (indexing / feeding the context) is not a per-round cost
        t0 = time.perf_counter()
        draft = proposer.propose(ctx)
        if draft is not None:
            _sync(draft.tokens)
        return time.perf_counter() - t0

    once(1)
    once(k)  # warm-up
    # at least 5 interleaved pairs: a propose() call is cheap, and one outlier in a median of 1
    # would read as "drafting a token costs nothing"
    pairs = [(once(1), once(k)) for _ in range(max(5, repeats))]
    t1 = statistics.median(a for a, _ in pairs)
    tk = statistics.median(b for _, b in pairs)
    step = max(0.0, (tk - t1) / (k - 1))
    return max(0.0, t1 - step), step


class OnlineCost:
    """The measured curve, corrected by the forwards the decode loop actually runs.

    The load-time curve is timed at one context length, best of a few repeats, and fitted
    monotone; the forwards of a real generation differ (longer contexts, memory-bound single
    tokens, and matmul kernels that make some widths cheaper than narrower ones: measured on
    this CPU, verifying 4 positions cost 1.28x one position in a bench run where the load-time
    curve said 1.67x, and 3 positions 1.45x). Each observed forward updates a forgetting mean of
    observed / curve for its width N; a width not seen yet takes the ratio interpolated between
    the nearest seen widths, so the relative costs start as the curve's and move toward what the
    generations measure.
    Cached per runtime (``online_cost_for``), so what one generation learns carries to the next."""

    def __init__(self, base: CostModel, prior_weight: float = 1.0, decay: float = 0.98) -> None:
        if prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"prior_weight must be > 0 and decay in (0, 1], got {prior_weight}, {decay}")
        self.base, self.prior_weight, self.decay = base, prior_weight, decay
        n = base.max_positions
        self._sum, self._cnt = [0.0] * n, [0.0] * n  # forgetting sums of observed / curve, per N
        self._cache: tuple[list[float], list[float]] | None = None  # (seconds, ratio) per N

    @property
    def max_positions(self) -> int:
        return self.base.max_positions

    def observe(self, positions: int, seconds: float) -> None:
        """One verify forward over ``positions`` positions took ``seconds``."""
        if 1 <= positions <= self.max_positions and seconds > 0:
            self.observe_ratio(positions, seconds / self.base.target(positions))

    def observe_ratio(self, positions: int, r: float) -> None:
        """One forward over ``positions`` positions took ``r`` times what the curve predicts
        (for callers whose prediction is not ``base``: the server's per-batch-size grid)."""
        if not 1 <= positions <= self.max_positions or not r > 0:
            return  # beyond the curve (nothing to correct) or a clock glitch
        i, lam = positions - 1, self.decay
        self._sum[i] = lam * self._sum[i] + r
        self._cnt[i] = lam * self._cnt[i] + 1.0
        self._cache = None

    def ratio(self, positions: int) -> float:
        """Observed / curve for width N, shrunk toward the ratio interpolated from the nearest
        observed widths on either side (costs change smoothly between kernel steps; one side
        only: its ratio; none yet: 1, the curve as measured)."""
        return self._table()[1][min(max(positions, 1), self.max_positions) - 1]

    def _table(self) -> tuple[list[float], list[float]]:
        """(corrected seconds, ratio) per width, rebuilt in O(max_positions) after observations:
        the policy prices every draft length of every row each round."""
        if self._cache is None:
            n, w = self.max_positions, self.prior_weight
            mean = [self._sum[j] / self._cnt[j] if self._cnt[j] >= 0.5 else None for j in range(n)]
            below: list[int | None] = [None] * n  # nearest seen width under each one
            above: list[int | None] = [None] * n
            for j in range(1, n):
                below[j] = j - 1 if mean[j - 1] is not None else below[j - 1]
            for j in range(n - 2, -1, -1):
                above[j] = j + 1 if mean[j + 1] is not None else above[j + 1]
            ratios = []
            for j in range(n):
                lo, hi = below[j], above[j]
                if lo is None and hi is None:
                    prior = 1.0
                elif lo is None or hi is None:
                    prior = mean[hi if lo is None else lo]  # type: ignore[index]
                else:
                    prior = mean[lo] + (j - lo) / (hi - lo) * (mean[hi] - mean[lo])  # type: ignore[operator]
                ratios.append((self._sum[j] + w * prior) / (self._cnt[j] + w))
            self._cache = ([self.base.target(j + 1) * r for j, r in enumerate(ratios)], ratios)
        return self._cache

    def target(self, n: float) -> float:
        """Corrected seconds of a forward over ``n`` positions (fractional n interpolates; the
        last width's ratio beyond the curve)."""
        if n < 1:
            raise ValueError(f"a forward covers at least 1 position, got {n}")
        c, lo = self._table()[0], int(n)
        if lo >= len(c):
            return self.base.target(n) * self.ratio(len(c))
        t = c[lo - 1]
        return t if n == lo else t + (n - lo) * (c[lo] - t)


@dataclass
class _Entry:
    model: CostModel
    drafts: "weakref.WeakKeyDictionary[Any, tuple[float, float]]" = field(
        default_factory=weakref.WeakKeyDictionary)  # proposer -> (per call, per token) seconds
    online: OnlineCost | None = None  # the curve as corrected by real forwards (``online_cost_for``)


_CACHE: "weakref.WeakKeyDictionary[Any, _Entry]" = weakref.WeakKeyDictionary()


def cost_model_for(runtime: Any, proposer: Any = None, pipeline: Any = None, max_positions: int = 17,
                   context: int = 128, repeats: int = 3) -> CostModel:
    """The runtime's cost model (measured on first use, then cached on the runtime object),
    with the proposer's draft costs filled in when one is given."""
    entry = _CACHE.get(runtime)
    if entry is None or entry.model.max_positions < max_positions:
        entry = _Entry(measure_target(runtime, max_positions, context, repeats))
        _CACHE[runtime] = entry
    model = entry.model
    if proposer is None:
        return model
    if proposer not in entry.drafts:
        if pipeline is None:
            from spec_plugins.config import SamplingConfig
            from spec_plugins.sampling import LogitsPipeline

            pipeline = LogitsPipeline(SamplingConfig())
        entry.drafts[proposer] = measure_draft(proposer, pipeline, runtime.vocab_size, context, repeats=repeats)
    fixed, step = entry.drafts[proposer]
    return CostModel(model.target_seconds, model.raw_target_seconds, fixed, step, model.context, model.runtime,
                     model.repeats)


def online_cost_for(runtime: Any, model: CostModel) -> OnlineCost:
    """The runtime's online-corrected forward curve over ``model`` (from ``cost_model_for``),
    shared by every generation and proposer on that runtime (draft costs stay the model's)."""
    entry = _CACHE.get(runtime)
    if entry is None:
        return OnlineCost(model)  # a model not measured through cost_model_for: nothing to share
    if entry.online is None or entry.online.base.target_seconds != model.target_seconds:
        entry.online = OnlineCost(model)
    return entry.online


def forget(runtime: Any) -> None:
    """Drop a runtime's cached measurements (e.g. after changing threads or device)."""
    _CACHE.pop(runtime, None)
