"""How much to draft, in one place: the draft policy of a round and the one factory that builds it
from a config for every caller (decoder, server, transformers plugin, bench, tune).

A ``DraftPolicy`` is two steps of the round and what they learn from:
1. ``choose(view)``: each row's draft depth before the drafter runs (0 = no draft), by a length
   policy: ``FixedLength`` or ``AutoDraftLength``, which prices the drafter's own seconds, so not
   drafting at all is the same decision as drafting k;
2. ``size(draft, spent)``: a tree drafter's ranked candidates (``types.Ranked``) picked per row and
   cut against the cost model (``TreeSizer``), merged into the ``Draft`` the target verifies;
3. ``observe(record)``: the costs correct themselves (``Costs.observe``), the length policy and the
   sizer's calibrations learn.

Defaults, one set for every caller (``DEFAULTS``): ``auto`` drafts up to 16 positions (the cost
model is measured to 17) and a draft must beat no draft by 5 % in expected tokens per second
(what the estimates miss: a padded verify's logits processing, a drafter's variance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from spec_plugins.policy.costs import Costs
from spec_plugins.policy.draft_length import AutoDraftLength, FixedLength, LengthPolicy
from spec_plugins.policy.tree_size import MAX_AUTO_NODES, TreeSizer
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.types import BatchView, Draft, Ranked, RoundRecord


@dataclass(frozen=True)
class PolicyDefaults:
    max_k: int = 16  # deepest auto draft (the cost model covers max_k + 1 positions)
    fixed_k: int = 5  # the draft length where a fixed one is asked of an 'auto' section (server --draft-policy fixed)
    min_gain: float = 1.05  # a draft must beat no draft by this factor in expected tokens per second
    context: int = 128  # tokens of context the forward costs are measured at


DEFAULTS = PolicyDefaults()
NEGLIGIBLE = 0.02  # a drafter whose whole depth costs less than this share of one forward is not gated


class DraftPolicy:
    """A length policy, a tree sizer and the costs both price against (module docstring)."""

    def __init__(self, length: LengthPolicy, sizer: TreeSizer | None = None, costs: Costs | None = None) -> None:
        self.length = length
        self.costs = costs if costs is not None else length.costs if isinstance(length, AutoDraftLength) else None
        self.sizer = sizer if sizer is not None else TreeSizer()
        self.sizer.costs = self.costs  # a long-lived sizer prices with the costs of the policy using it

    @classmethod
    def of(cls, policy: "DraftPolicy | LengthPolicy") -> "DraftPolicy":
        """A full policy from a bare length policy (tests and replays that fix the length)."""
        return policy if isinstance(policy, DraftPolicy) else cls(policy)

    @property
    def last(self) -> dict[str, float]:
        return self.length.last  # type: ignore[attr-defined]

    def choose(self, view: BatchView) -> list[int]:
        return self.length.choose(view)

    def size(self, draft: Draft | Ranked | None, spent: float = 0.0) -> Draft | None:
        return self.sizer.size(draft, spent) if isinstance(draft, Ranked) else draft

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


def setup_costs(runtime: Any, proposer: Any, section: Any, pipeline: Any = None, rows: Sequence[int] = (1,),
                costs: Costs | None = None, length: Length = "config", context: int | None = None,
                defaults: PolicyDefaults = DEFAULTS) -> Costs | None:
    """Measure what a section's policy needs, once, at setup: the runtime's forward costs for
    ``rows`` x positions (reusing ``costs`` when they cover them) and the drafter's own cost.
    ``costs`` as given when the section prices nothing."""
    if proposer is None or not wants_costs(section, length):
        return costs
    positions = max(defaults.max_k, MAX_AUTO_NODES if section.auto_tree else 0) + 1
    positions = min(positions, runtime.max_context // 2)  # a short context: fewer widths (auto drafts less)
    if costs is None or not costs.covers(rows, positions):
        have = set(costs.forward.base.rows) if costs is not None else set()
        context = min(context or defaults.context, runtime.max_context - positions)
        costs = Costs.measure(runtime, sorted(set(rows) | have), positions, context)
    costs.measure_drafter(proposer, runtime, pipeline)
    return costs


def build_policy(section: Any, proposer: Any, costs: Costs | None = None, sizer: TreeSizer | None = None,
                 length: Length = "config", defaults: PolicyDefaults = DEFAULTS) -> DraftPolicy:
    """The policy of a proposer section (``None``: plain decoding).

    ``length="config"``: ``num_draft_tokens: auto`` -> ``AutoDraftLength`` up to ``defaults.max_k``;
    a fixed length is drafted as is (``FixedLength``), except under a tree sized by cost
    (``tree_nodes: auto``), where whether to pay the drafter at all is priced too: each round
    ``AutoDraftLength`` chooses between that depth and no draft (its width is the sizer's). ``"load"`` (a server's load-aware policy): the fixed length is
    an upper bound for ``AutoDraftLength``. ``"fixed"``: always the fixed length (``auto``:
    ``defaults.fixed_k``), trees still cut by cost where ``tree_nodes: auto``. ``costs`` must come
    from ``setup_costs`` when anything is priced; ``sizer``: a long-lived one whose calibrations
    carry across generations (a decoder's, a loaded model's)."""
    if proposer is None or section is None:
        return DraftPolicy(FixedLength(0), sizer, costs)
    k = section.num_draft_tokens
    if wants_costs(section, length) and costs is None:
        raise ValueError(f"proposer {section.type}: sizing by cost needs the runtime's measured costs "
                         "(policy.draft_policy.setup_costs) before its policy is built")
    if length == "fixed" or not wants_costs(section, length):
        return DraftPolicy(FixedLength(defaults.fixed_k if k == "auto" else int(k)), sizer, costs)
    max_k = defaults.max_k if k == "auto" else int(k)
    if max_k == 0:
        return DraftPolicy(FixedLength(0), sizer, costs)
    gate = k != "auto" and length == "config"  # a configured depth over a cost-cut tree: draft it, or not
    draft = costs.drafter(proposer)
    if gate and (ProposerTraits.of(proposer).prices_drafting or draft(max_k) < NEGLIGIBLE * costs(1, 1)):
        # nothing for the gate to decide: the proposer prices its drafters itself per round (a hybrid;
        # gated on their summed cost it drafted nothing), or drafting costs next to nothing and the
        # sizer's cut can keep no node (suffix; gated on a chain estimate it lost drafts the sizer keeps)
        return DraftPolicy(FixedLength(max_k), sizer, costs)
    auto = AutoDraftLength(costs, draft, max_k=max_k, min_gain=defaults.min_gain,
                           all_or_nothing=gate)
    return DraftPolicy(auto, sizer, costs)
