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

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from spec_plugins.config import ProposerConfig
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
    if proposer is not None:
        section = _checked_section(proposer, section)
    traits = check_pairing(runtime, proposer)
    costs = setup_costs(runtime, proposer, section, rows=rows, costs=costs, length=length, context=context)
    return Wiring(runtime, proposer, section, traits, costs, sizer if sizer is not None else TreeSizer(), length)


def _checked_section(proposer: Any, section: Any) -> ProposerConfig | None:
    """The section a proposer instance's draft policy is built from (``section``, else its own
    ``config``): a ``ProposerConfig`` (its class's ``Config``) or None (``build_policy``'s default length),
    refused naming the proposer class where it is anything else, rather than failing on a missing
    field deep inside the policy."""
    section = getattr(proposer, "config", None) if section is None else section
    if section is not None and not isinstance(section, ProposerConfig):
        name = type(proposer).__name__
        raise TypeError(f"proposer {name}: its config must be a ProposerConfig (its config section, such as "
                        f"{name}.Config(num_draft_tokens=4)), got {type(section).__name__}")
    return section


def drafter_layers(section: Any) -> tuple[int, ...]:
    """The decoder layers a proposer section's trained drafter reads (its heads' ``config.json``:
    an EAGLE-3 or parallel drafter; a hybrid's children), read without loading weights; () where
    none does or the file is not there (building the proposer then says why)."""
    from spec_plugins.proposers.medusa import resolve_head_dir

    if section is None:
        return ()
    subs = getattr(section, "proposers", None) or [section]
    for sub in subs:
        kind = sub.get("type") if isinstance(sub, dict) else getattr(sub, "type", None)
        heads = sub.get("heads") if isinstance(sub, dict) else getattr(sub, "heads", None)
        if kind in ("eagle", "parallel") and heads:
            config = resolve_head_dir(str(heads)) / "config.json"
            if config.is_file():
                return tuple(json.loads(config.read_text()).get("feature_layers") or ())
    return ()


def target_for(target: Any, section: Any) -> Any:
    """The target section a runtime is built from: one that exports on first use (an onnxruntime
    target without ``path`` or ``feature_layers``) returns the layers the section's drafter reads,
    as ``export onnx --feature-layers auto`` does; any other as given."""
    fields = getattr(type(target), "model_fields", {})
    if "feature_layers" not in fields or target.feature_layers is not None or getattr(target, "path", None):
        return target
    layers = drafter_layers(section)
    return target.model_copy(update={"feature_layers": list(layers)}) if layers else target
