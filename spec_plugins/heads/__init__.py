"""Trained draft heads that read the target's own hidden states (Medusa, EAGLE).

Plain ``torch.nn.Module``s with fixed-shape forwards (no Python branching on data, no caches
inside the module) so exporters can trace them; the proposers own all state.
"""

from spec_plugins.heads.common import HeadFiles, load_head, save_head, target_lm_parts
from spec_plugins.heads.eagle import EagleConfig, EagleDrafter
from spec_plugins.heads.medusa import MedusaConfig, MedusaHeads

__all__ = ["EagleConfig", "EagleDrafter", "HeadFiles", "MedusaConfig", "MedusaHeads", "load_head", "save_head",
           "target_lm_parts"]
