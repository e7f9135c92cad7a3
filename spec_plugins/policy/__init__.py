"""How much to draft: one forward-cost model (``cost``), the costs of a runtime as an object
(``costs``), acceptance estimates (``acceptance``), one objective (``objective``), length policies
(``draft_length``), tree sizing (``tree_size``) and the policy of a round with its one factory
(``draft_policy``)."""

from spec_plugins.policy.cost import DraftCost, ForwardCost, OnlineCost, measure
from spec_plugins.policy.costs import Costs
from spec_plugins.policy.draft_length import AutoDraftLength, FixedLength, LengthPolicy
from spec_plugins.policy.draft_policy import DEFAULTS, DraftPolicy, build_policy, setup_costs

__all__ = ["AutoDraftLength", "Costs", "DEFAULTS", "DraftCost", "DraftPolicy", "FixedLength", "ForwardCost",
           "LengthPolicy", "OnlineCost", "build_policy", "measure", "setup_costs"]
