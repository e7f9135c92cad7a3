"""What a round costs on one runtime, as an explicit object: measured once at setup, handed to the
policy that sizes drafts, corrected online by the rounds it prices, and kept by whoever owns the
runtime (the decoder, the server, the transformers plugin per loaded model), so a second
generation starts from what the first learnt instead of measuring again.

A round of B rows and k drafted positions per row pays

    T(B, 1 + k)            the target forward (``policy.cost.OnlineCost``: measured, corrected)
    + draft_c(k)           the drafter's own seconds (``DraftCost``, measured per drafter)
    + overhead             seconds outside forwards and drafting (Python, emission), learnt

Nothing here measures during a round: ``measure`` and ``measure_drafter`` are setup steps, and a
policy that needs a drafter's cost it was not given refuses to be built.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from spec_plugins.policy.cost import DraftCost, ForwardCost, OnlineCost, measure, measure_draft, runtime_name
from spec_plugins.types import RoundRecord


class Costs:
    """Forward costs (online-corrected), per-drafter costs and the per-round overhead of one runtime."""

    def __init__(self, forward: ForwardCost | OnlineCost, overhead_decay: float = 0.9, frozen: bool = False) -> None:
        """``frozen``: price with ``forward`` exactly as given, learning nothing from the rounds
        (a cost model that stands for another machine: a test's, a what-if)."""
        self.forward = forward if isinstance(forward, OnlineCost) else OnlineCost(forward)
        self.frozen = frozen
        self.overhead = 0.0  # seconds per round outside forwards and drafting (verify, commit, Python)
        self._decay = overhead_decay
        self._drafts: "weakref.WeakKeyDictionary[Any, DraftCost]" = weakref.WeakKeyDictionary()
        self._drafted: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()  # seconds per call, seen
        self.context = forward.context if isinstance(forward, ForwardCost) else forward.base.context

    # ---- setup ------------------------------------------------------------------------------------
    @classmethod
    def measure(cls, runtime: Any, rows: Sequence[int] = (1,), max_positions: int = 17, context: int = 128,
                repeats: int = 3) -> "Costs":
        """Time the runtime's forwards over (rows, 1..max_positions) (seconds; empties its rows)."""
        return cls(measure(runtime, rows, range(1, max_positions + 1), context, repeats))

    def measure_drafter(self, proposer: Any, runtime: Any, pipeline: Any = None) -> DraftCost:
        """Time ``proposer``'s drafting once (setup) and keep it for every policy pricing it."""
        if proposer not in self._drafts:
            if pipeline is None:
                from spec_plugins.config import SamplingConfig
                from spec_plugins.sampling import LogitsPipeline

                pipeline = LogitsPipeline(SamplingConfig())
            self._drafts[proposer] = measure_draft(proposer, pipeline, runtime, self.context or 128)
        return self._drafts[proposer]

    def set_drafter(self, proposer: Any, cost: DraftCost) -> None:
        """A drafter's cost known otherwise (a replay's recorded one, a test's)."""
        self._drafts[proposer] = cost

    def check_runtime(self, runtime: Any) -> None:
        """Refuse to price ``runtime`` with forwards timed on another kind of runtime (a llama.cpp
        curve on a torch runtime): its costs differ by orders of magnitude and in shape, and the
        online correction would take many rounds to undo them. Costs that record no runtime (a
        hand-made curve, a replay's) are taken as given; no model is recorded, so none is compared."""
        recorded, wired = self.forward.base.runtime, runtime_name(runtime)
        if recorded and recorded != wired:
            raise ValueError(f"these costs were measured on runtime {recorded!r}, but the runtime being wired is "
                             f"{wired!r}: give costs measured on this runtime, or none to measure them at setup")

    def covers(self, rows: Sequence[int], max_positions: int) -> bool:
        base = self.forward.base
        return set(rows) <= set(base.rows) and base.max_positions >= max_positions

    # ---- reading ----------------------------------------------------------------------------------
    @property
    def max_positions(self) -> int:
        return self.forward.max_positions

    def drafter(self, proposer: Any) -> DraftCost:
        """The drafter's measured cost; a policy built without it is refused (it would price
        drafting as free and draft where drafting loses)."""
        if proposer is None:
            return DraftCost()
        try:
            return self._drafts[proposer]
        except KeyError:
            raise ValueError(f"no measured drafting cost for {type(proposer).__name__}: call "
                             "costs.measure_drafter(proposer, runtime) at setup") from None

    def draft_seconds(self, proposer: Any, depth: float) -> float:
        """Seconds of one of ``proposer``'s drafting calls: what its calls took in the rounds (their
        catch-up included), or before any, its measured cost at ``depth``."""
        seen = self._drafted.get(proposer)
        if seen is not None:
            return seen
        return self._drafts[proposer](depth) if proposer in self._drafts else 0.0

    def __call__(self, rows: float, positions: float) -> float:
        """Seconds of the target forward over ``rows`` x ``positions`` (corrected)."""
        return self.forward(rows, positions)

    # ---- learning ---------------------------------------------------------------------------------
    def observe(self, record: RoundRecord) -> None:
        """Correct the forward curve by the width-dependent part of the round (the forward plus
        what scales with its B x N logits: processing, accept/reject, the KV commit, which a wider
        draft makes dearer too), and learn the rest as a per-round overhead equal for every width."""
        if self.frozen:
            return
        t = record.times
        width = t.forward + t.verify + t.commit
        spent = max(0.0, t.total - width - t.draft)
        lam = self._decay
        self.overhead = spent if self.overhead == 0.0 else lam * self.overhead + (1 - lam) * spent
        self.forward.observe(record.rows, record.positions, width)

    def observe_drafter(self, proposer: Any, seconds: float) -> None:
        """One drafting call of ``proposer`` took ``seconds`` (a round's clock): smoothed, it prices
        the next decision whether to pay that drafter (``policy.sources``)."""
        if self.frozen:
            return
        seen = self._drafted.get(proposer)
        lam = self._decay
        self._drafted[proposer] = seconds if seen is None else lam * seen + (1 - lam) * seconds

    def to_dict(self) -> dict[str, Any]:
        return {**self.forward.base.to_dict(), "overhead_seconds": self.overhead}
