"""One wiring of a runtime with its proposer, costs and draft policy, for every caller that owns a
runtime: the decoder, the transformers plugin and the server.

``wire`` builds a proposer section's proposer over the runtime (unless one is given), checks the
pairing once (``proposers.base.check_pairing``: trees need tree masks, feature drafters hidden
states, ...), and measures what its policy will price, once (``policy.setup_costs``, reusing the
costs given when they cover it). The ``Wiring`` it returns keeps all of it with the tree sizer
whose calibrations carry across generations; ``Wiring.policy()`` is a fresh draft policy for one
generation (or a server's lifetime) over them, from the one factory (``policy.build_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from spec_plugins.proposers.base import check_pairing
from spec_plugins.policy import Costs, DraftPolicy, build_policy, setup_costs
from spec_plugins.policy.draft_policy import Length
from spec_plugins.policy.tree_size import TreeSizer
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.registry import PROPOSERS


@dataclass
class Wiring:
    runtime: Any
    proposer: Any  # None: plain decoding
    section: Any  # the proposer's config section (None: plain decoding)
    traits: ProposerTraits
    costs: Costs | None
    sizer: TreeSizer = field(default_factory=TreeSizer)
    length: Length = "config"

    def policy(self) -> DraftPolicy:
        """A fresh draft policy (new acceptance estimates) over the kept costs and sizer."""
        return build_policy(self.section, self.proposer, self.costs, self.sizer, self.length)


def wire(runtime: Any, section: Any, proposer: Any = None, costs: Costs | None = None, sizer: TreeSizer | None = None,
         rows: Sequence[int] = (1,), length: Length = "config", context: int | None = None, **build: Any) -> Wiring:
    """``section``'s proposer over ``runtime`` (built with ``build`` unless ``proposer`` is given),
    its pairing checked and its costs measured (module docstring)."""
    if proposer is None and section is not None:
        proposer = PROPOSERS.get(section.type)(section, target=runtime, **build)
    if proposer is not None and section is None:
        section = proposer.config
    traits = check_pairing(runtime, proposer)
    costs = setup_costs(runtime, proposer, section, rows=rows, costs=costs, length=length, context=context)
    return Wiring(runtime, proposer, section, traits, costs, sizer if sizer is not None else TreeSizer(), length)
