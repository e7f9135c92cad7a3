"""Trained draft heads that read the target's own hidden states (Medusa, EAGLE, parallel).

Plain ``torch.nn.Module``s with fixed-shape forwards (no Python branching on data, no caches
inside the module) so exporters can trace them; the proposers own all state.
"""

from spec_plugins.heads.common import HeadFiles, load_head, save_head, target_lm_parts
from spec_plugins.heads.eagle import EagleConfig, EagleDrafter
from spec_plugins.heads.medusa import MedusaConfig, MedusaHeads
from spec_plugins.heads.parallel import ParallelConfig, ParallelDrafter


def drafter_class(directory: str) -> type[EagleDrafter]:
    """The class of the EAGLE-layer drafter saved in ``directory`` (its config's ``kind``)."""
    from spec_plugins.heads.common import load_head

    kind = load_head(directory)[0].get("kind", "eagle")
    return ParallelDrafter if kind == "parallel" else EagleDrafter

__all__ = ["EagleConfig", "EagleDrafter", "HeadFiles", "MedusaConfig", "MedusaHeads", "ParallelConfig",
           "ParallelDrafter", "drafter_class", "load_head", "save_head", "target_lm_parts"]
