"""How long to draft: one forward-cost model (``cost``), acceptance estimates (``acceptance``) and
one draft-length policy interface (``draft_length``)."""

from spec_plugins.policy.cost import DraftCost, ForwardCost, OnlineCost, cost_for, measure
from spec_plugins.policy.draft_length import AutoDraftLength, DraftPolicy, FixedLength

__all__ = ["AutoDraftLength", "DraftCost", "DraftPolicy", "FixedLength", "ForwardCost", "OnlineCost", "cost_for",
           "measure"]
