"""What a training run reads, checked before it trains: the feature stores and the target they
name. Its own module because it joins the stores (``features``), the held-out checks
(``heldout``) and the weights' fingerprint (``target_check``), which ``features`` itself uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_for_training(features: Path, heldout: Path | None, layers: bool) -> tuple[Any, Any, Any]:
    """The training features, the held-out ones (checked against them, ``check_heldout``; their
    layers only where the head reads them: ``layers``) and the target they name, refused where its
    weights are not those either store was made from (``target_check``)."""
    from spec_plugins.backends.torch_runtime import load_hf
    from spec_plugins.training.features import FeatureStore
    from spec_plugins.training.heldout import check_heldout
    from spec_plugins.training.target_check import check_features_model

    store = FeatureStore(features)
    held = FeatureStore(heldout) if heldout else None
    if held is not None:
        check_heldout(store, held, layers)
    model, _ = load_hf(store.meta["target"], "float32", "cpu")
    for s in (store, held):
        if s is not None:
            check_features_model(s.meta, model, s.directory)
    return store, held, model
