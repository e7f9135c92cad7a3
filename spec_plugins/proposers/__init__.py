"""Draft sources. Each module registers its proposer by name."""

from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundRecord

__all__ = ["Draft", "ProposeContext", "Proposer", "RoundRecord"]
