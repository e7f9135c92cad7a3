"""How much to draft, in one place: the draft policy of a round and the one factory that builds it
from a config for every caller (decoder, server, transformers plugin, bench, tune).

A ``DraftPolicy`` is three steps of the round and what they learn from, and owns every decision
of how much to draft:
1. ``choose(view)``: each row's draft depth before the drafter runs (0 = no draft), by a length
   policy: ``FixedLength`` or ``AutoDraftLength``, which prices the drafter's own seconds, so not
   drafting at all is the same decision as drafting k;
2. ``draft(sources, ctx)``: the proposer's sources (itself, or a composition's children) draft,
   each where its drafting pays (``SourceGate``, ``policy/sources.py``);
3. ``size(draft, spent)``: ranked candidates (``types.Ranked``) picked per row and cut against
   the cost model (``TreeSizer``), merged into the ``Draft`` the target verifies; ``placed(draft)``:
   that draft as the runtime's room cut it (``loop.capacity``), what the sizer learns from;
4. ``observe(record)``: the costs correct themselves (``Costs.observe``), the length policy and the
   sizer's calibrations learn.

Defaults, one set for every caller (``DEFAULTS``): ``auto`` drafts up to 16 positions (the cost
model is measured to 17) and a draft must beat no draft by 5 % in expected tokens per second
(what the estimates miss: a padded verify's logits processing, a drafter's variance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from spec_plugins.policy.cost import DraftCost
from spec_plugins.policy.costs import Costs
from spec_plugins.policy.draft_length import AutoDraftLength, FixedLength, LengthPolicy
from spec_plugins.policy.sources import SourceGate
from spec_plugins.policy.tree_size import MAX_AUTO_NODES, TreeSizer
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.types import BatchView, Draft, ProposeContext, Ranked, RoundRecord


@dataclass(frozen=True)
class PolicyDefaults:
    max_k: int = 16  # deepest auto draft (the cost model covers max_k + 1 positions)
    fixed_k: int = 5  # the draft length where a fixed one is asked of an 'auto' section (server --draft-policy fixed)
    min_gain: float = 1.05  # a draft must beat no draft by this factor in expected tokens per second
    context: int = 128  # tokens of context the forward costs are measured at


DEFAULTS = PolicyDefaults()


class DraftPolicy:
    """A length policy, the sources' gate, a tree sizer and the costs they price against (module docstring)."""

    def __init__(self, length: LengthPolicy, sizer: TreeSizer | None = None, costs: Costs | None = None,
                 gated: bool = False, probe_every: int = 16, min_gain: float = DEFAULTS.min_gain) -> None:
        """``gated``: a source may be skipped in a round where its drafting does not pay
        (``policy.sources``); otherwise every source drafts every round it is asked to.
        ``min_gain``: what a tree the sizer keeps must beat no draft by, as a length must."""
        self.length = length
        self.costs = costs if costs is not None else length.costs if isinstance(length, AutoDraftLength) else None
        # a long-lived sizer's calibrations, priced with this policy's costs and margin (a server's
        # policy and its decoder's share one sizer's calibrations, each pricing with its own costs)
        self.sizer = (sizer if sizer is not None else TreeSizer()).sharing(self.costs, min_gain)
        self.gated, self.probe_every = gated, probe_every
        self.gate: SourceGate | None = None  # built for the proposer's sources when they first draft

    @classmethod
    def of(cls, policy: "DraftPolicy | LengthPolicy") -> "DraftPolicy":
        """A full policy from a bare length policy (tests and replays that fix the length)."""
        return policy if isinstance(policy, DraftPolicy) else cls(policy)

    @property
    def last(self) -> dict[str, float]:
        return self.length.last  # type: ignore[attr-defined]

    def choose(self, view: BatchView) -> list[int]:
        return self.length.choose(view)

    def draft(self, sources: Sequence[Any], ctx: ProposeContext) -> Draft | Ranked | None:
        """The proposer's sources draft, each where it pays (``policy.sources``)."""
        if self.gate is None or self.gate.sources != list(sources):
            self.gate = SourceGate(sources, self.sizer, self.costs, self.gated, self.probe_every)
        return self.gate.draft(ctx)

    def size(self, draft: Draft | Ranked | None, spent: float = 0.0,
             budgets: Sequence[int] | None = None) -> Draft | None:
        """The round's drafted candidates sized within each row's draft depth ``budgets`` (the
        round's, as its sources drafted them; None: unbounded)."""
        if not isinstance(draft, Ranked):
            return draft
        return self.sizer.size(draft, spent, budgets)

    def placed(self, draft: Draft | None, ahead: Sequence[int] = ()) -> None:
        """The sized draft as the runtime placed it (``Batch.place``: ``ahead[b]`` forced tokens
        ahead of row b's nodes, cut to its pool and widest forward): the sizer counts only the
        nodes placed (``TreeSizer.placed``)."""
        self.sizer.placed(draft, ahead)

    def observe(self, record: RoundRecord) -> None:
        if self.costs is not None:
            self.costs.observe(record)
        self.length.observe(record)
        self.sizer.observe(record)

    def preview(self, rows: int) -> int:
        """The draft length ``choose`` would pick for ``rows`` rows now (``/metrics``)."""
        return self.length.preview(rows)  # type: ignore[attr-defined]


Length = Literal["config", "load", "fixed"]  # how a section's num_draft_tokens is read (build_policy)


def wants_costs(section: Any, length: Length = "config") -> bool:
    """Whether a proposer section's policy prices anything by measured costs: ``auto`` anywhere,
    or (a server's load-aware policy) a fixed draft length that is only the upper bound."""
    if section is None:
        return False
    if length == "fixed":
        return section.auto_tree
    return length == "load" or section.num_draft_tokens == "auto" or section.auto_tree


def measured_positions(section: Any, length: Length = "config", defaults: PolicyDefaults = DEFAULTS) -> int:
    """Forward widths a priced section's policy needs measured: one past its deepest draft, so
    ``AutoDraftLength`` never has to clamp it to the cost model. The deepest is ``defaults.max_k``,
    a load-aware policy's configured upper bound where that is deeper, and an auto tree's
    ``MAX_AUTO_NODES``."""
    k = section.num_draft_tokens
    bound = int(k) if length == "load" and k != "auto" else 0
    return max(defaults.max_k, bound, MAX_AUTO_NODES if section.auto_tree else 0) + 1


def setup_costs(runtime: Any, proposer: Any, section: Any, pipeline: Any = None, rows: Sequence[int] = (1,),
                costs: Costs | None = None, length: Length = "config", context: int | None = None,
                defaults: PolicyDefaults = DEFAULTS) -> Costs | None:
    """Measure what a section's policy needs, once, at setup: the runtime's forward costs for
    ``rows`` x positions (reusing ``costs`` when they cover them) and the drafter's own cost.
    ``costs`` as given when the section prices nothing. Costs measured on another runtime are
    refused (``Costs.check_runtime``), not reused."""
    if costs is not None:
        costs.check_runtime(runtime)
    if proposer is None or not wants_costs(section, length):
        return costs
    positions = measured_positions(section, length, defaults)
    positions = min(positions, runtime.max_context // 2)  # a short context: fewer widths (auto drafts less)
    from spec_plugins.loop.capacity import max_nodes

    widest = max_nodes(runtime)
    if widest is not None:  # an engine's widest step: drafts are cut to it (loop.capacity)
        positions = min(positions, widest + 1)
    if positions < 2:
        raise ValueError(f"an auto draft length or tree measures forwards of 2 and more positions in half the "
                         f"context, but the runtime's context holds {runtime.max_context} positions: set a fixed "
                         "num_draft_tokens (and no auto tree) or a larger max_context")
    if costs is None or not costs.covers(rows, positions):
        have = set(costs.forward.base.rows) if costs is not None else set()
        context = min(context or defaults.context, runtime.max_context - positions)
        costs = Costs.measure(runtime, sorted(set(rows) | have), positions, context)
    sources = ProposerTraits.of(proposer).sources
    for drafter in sources if len(sources) > 1 else (proposer,):  # a composition: its children (the gate's)
        costs.measure_drafter(drafter, runtime, pipeline)
    return costs


def drafting_cost(costs: Costs, proposer: Any) -> DraftCost:
    """What a round's drafting costs the length policy: the proposer's own measured cost; for a
    composition its cheapest source's. Whether a dearer child pays is the gate's decision
    (``policy.sources``); pricing the depth at what all children cost together decided "no draft"
    before the gate could ask the cheap child, which paid on its own."""
    sources = ProposerTraits.of(proposer).sources
    if len(sources) > 1:
        return min((costs.drafter(s) for s in sources), key=lambda c: c(1))
    return costs.drafter(proposer)


def build_policy(section: Any, proposer: Any, costs: Costs | None = None, sizer: TreeSizer | None = None,
                 length: Length = "config", defaults: PolicyDefaults = DEFAULTS) -> DraftPolicy:
    """The policy of a proposer section (no proposer: plain decoding; a proposer without a
    section, an instance built without its config: ``defaults.fixed_k`` a round).

    ``length="config"``: ``num_draft_tokens: auto`` -> ``AutoDraftLength`` up to ``defaults.max_k``
    (the depth, its drafting cost included, is chosen each round); a fixed length is drafted as
    is (``FixedLength``). ``"load"`` (a server's load-aware policy): the fixed length is an upper
    bound for ``AutoDraftLength``. ``"fixed"``: always the fixed length (``auto``:
    ``defaults.fixed_k``). Trees with ``tree_nodes: auto`` are cut by cost in every mode (to nothing
    where no node pays). Whether a composition's child pays for its drafting at all is the gate's
    decision (``policy.sources``); a single source drafts every round it is asked to: its evidence
    would be what the cut kept, which a stale calibration keeps small, so a skipped drafter could
    not tell when the text turned its way again. ``costs`` must come from ``setup_costs`` when anything is priced; ``sizer``: a
    long-lived one whose calibrations carry across generations (a decoder's, a loaded model's)."""
    if proposer is None:
        return DraftPolicy(FixedLength(0), sizer, costs)
    if section is None:  # an instance built without its config section: the default length, not none
        return DraftPolicy(FixedLength(defaults.fixed_k), sizer, costs)
    k = section.num_draft_tokens
    priced = wants_costs(section, length)
    if priced and costs is None:
        raise ValueError(f"proposer {section.type}: sizing by cost needs the runtime's measured costs "
                         "(policy.draft_policy.setup_costs) before its policy is built")
    gated = priced and len(ProposerTraits.of(proposer).sources) > 1
    if length == "fixed" or not priced:
        length_policy: LengthPolicy = FixedLength(defaults.fixed_k if k == "auto" else int(k))
    elif k != "auto" and length == "config" or k == 0:
        length_policy = FixedLength(int(k))
    else:
        max_k = defaults.max_k if k == "auto" else int(k)
        length_policy = AutoDraftLength(costs, drafting_cost(costs, proposer), max_k=max_k, min_gain=defaults.min_gain)
    return DraftPolicy(length_policy, sizer, costs, gated=gated, min_gain=defaults.min_gain)
