"""spec-plugins: exact speculative decoding with pluggable proposers, one verifier, many runtimes."""

from spec_plugins.config import ConfigError, SpecConfig, default_config
from spec_plugins.decoder import GenerationResult, SpeculativeDecoder, StreamEvent
from spec_plugins.registry import (
    BACKENDS,
    PROPOSERS,
    VERIFIERS,
    register_backend,
    register_proposer,
    register_verifier,
)
from spec_plugins.stats import DecodeStats

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "ConfigError",
    "DecodeStats",
    "GenerationResult",
    "PROPOSERS",
    "SpecConfig",
    "SpeculativeDecoder",
    "StreamEvent",
    "VERIFIERS",
    "default_config",
    "register_backend",
    "register_proposer",
    "register_verifier",
]
