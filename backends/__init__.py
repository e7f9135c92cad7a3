"""Runtimes (imported as ``spec_plugins.backends``): one contract, many engines."""

from __future__ import annotations

from typing import Any

from spec_plugins.backends.base import Runtime, RuntimeCapabilities, StepOutput
from spec_plugins.registry import BACKENDS


def build_runtime(config: Any) -> Runtime:
    """Instantiate the runtime a config section names (``backend: torch`` ...)."""
    return BACKENDS.get(config.backend).from_config(config)


__all__ = ["Runtime", "RuntimeCapabilities", "StepOutput", "build_runtime"]
