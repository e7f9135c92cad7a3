"""Pydantic configs: one model per plugin, chosen by its ``type`` (or ``backend``) field.

The top-level :class:`SpecConfig` does not list the plugins statically: each section is
dispatched through the registry, so a third-party proposer registered by entry point is
configured exactly like a built-in one. Errors name the field and the allowed values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    model_validator,
)

from spec_plugins.registry import BACKENDS, PROPOSERS, VERIFIERS, Registry, RegistryError


class ConfigError(ValueError):
    """A config that does not validate; the message names the field."""


class PluginConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class RuntimeConfig(PluginConfig):
    """Common fields of every runtime section."""

    backend: str = Field(description="Runtime name: torch, llamacpp, onnxruntime, tensorrt or a plugin.")
    model: str = Field(
        description="Built-in model name (smollm2-135m-instruct, gemma-3-270m), a .gguf path or a transformers dir."
    )


class ProposerConfig(PluginConfig):
    """Common fields of every proposer section."""

    type: str = Field(description="Proposer name: ngram, draft_model or a registered plugin.")
    num_draft_tokens: int | Literal["auto"] = Field(
        5, description="Draft length per round (gamma), or 'auto' to pick it from the cost model each round."
    )

    @model_validator(mode="after")
    def _check_k(self) -> "ProposerConfig":
        k = self.num_draft_tokens
        if k != "auto" and not (0 <= k <= 64):
            raise ValueError(f"num_draft_tokens must be 'auto' or an integer in 0..64, got {k}")
        return self


class VerifierConfig(PluginConfig):
    type: str = Field("exact", description="Verifier name: exact (lossless) or a registered plugin.")


class SamplingConfig(PluginConfig):
    """Target sampling; the speculative output follows exactly this distribution."""

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy (argmax).")
    top_k: int | None = Field(None, ge=1, description="Keep the k most likely tokens.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    repetition_penalty: float | None = Field(None, gt=0.0, description="CTRL-style penalty (1 = none).")
    seed: int | None = Field(0, description="Seed of the sampling generator (reproducible runs).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _dispatch(registry: Registry[Any], key: str, default: str | None = None):
    """Validator that routes a dict section to the Config of the plugin it names."""

    def validate(value: Any) -> Any:
        if isinstance(value, PluginConfig) or value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping with a {key!r} field, got {type(value).__name__}")
        name = value.get(key, default)
        if name is None:
            raise ValueError(f"missing field {key!r}; allowed values: {', '.join(registry.names())}")
        try:
            cls = registry.get(name)
        except RegistryError as exc:
            raise ValueError(f"{key}={name!r} is not a known {registry.kind}; allowed values: "
                             f"{', '.join(registry.names())}") from exc
        try:
            return cls.Config.model_validate({key: name, **value})
        except ValidationError as exc:
            # name nested fields relative to this section: "proposer: max_ngram: ..." reads well
            raise ValueError(_format_errors(exc)) from None

    return BeforeValidator(validate)


def _format_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


TargetField = Annotated[SerializeAsAny[RuntimeConfig], _dispatch(BACKENDS, "backend")]
ProposerField = Annotated[SerializeAsAny[ProposerConfig] | None, _dispatch(PROPOSERS, "type")]
VerifierField = Annotated[SerializeAsAny[VerifierConfig], _dispatch(VERIFIERS, "type", default="exact")]


class SpecConfig(PluginConfig):
    """The whole job: target runtime, proposer (None = plain decoding), verifier, sampling."""

    target: TargetField
    proposer: ProposerField = None
    verifier: VerifierField = Field(default_factory=lambda: VERIFIERS.get("exact").Config())
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)

    @classmethod
    def from_file(cls, path: str | Path) -> "SpecConfig":
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        return cls.parse(data, source=str(path))

    @classmethod
    def parse(cls, data: Any, source: str = "config") -> "SpecConfig":
        """Validate a dict, raising ConfigError with every failing field named."""
        if isinstance(data, SpecConfig):
            return data
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"invalid {source}: {_format_errors(exc)}") from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def default_config() -> SpecConfig:
    """The built-in default: SmolLM2-135M-Instruct on PyTorch with the n-gram proposer."""
    return SpecConfig.parse(
        {
            "target": {"backend": "torch", "model": "smollm2-135m-instruct", "dtype": "float32"},
            "proposer": {"type": "ngram", "num_draft_tokens": 5, "max_ngram": 3},
            "verifier": {"type": "exact"},
            "sampling": {"temperature": 0.0, "seed": 0},
        },
        source="built-in default config",
    )
