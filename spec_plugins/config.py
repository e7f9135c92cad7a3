"""Pydantic configs: one model per plugin, chosen by its ``type`` (or ``backend``) field.

The top-level :class:`SpecConfig` does not list the plugins statically: each section is
dispatched through the registry, so a third-party proposer registered by entry point is
configured exactly like a built-in one. Errors name the field and the allowed values.
"""

from __future__ import annotations

import json
import re
import types
import typing
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


class DuplicateKey(ValueError):
    """A mapping that names a key twice (the key is the message): a parser keeping the last value
    would silently drop the first, so config files and the server's JSON bodies refuse it."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, or ``DuplicateKey`` naming the key."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key a mapping names twice, at the second one's line and
    column (a merged ``<<`` key that a mapping overrides is YAML's own overriding, and stays)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                twice = key in seen
            except TypeError:  # an unhashable key: ``super()`` refuses it with its own message
                break
            if twice:
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        f"duplicate key `{key}`", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.2's exponent floats that YAML 1.1 (PyYAML) reads as strings: ``1e3``, ``-2E+4``, ``1.5e3`` (1.1
# wants a dot and a signed exponent), so a config JSON accepts is read alike from YAML. Added after
# PyYAML's own resolvers, it only sees what they leave as strings; ints (``1_000`` too) stay ints.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def _json_text(text: str) -> bool:
    """Whether ``text`` is a JSON object (a YAML flow mapping such as ``{a: 1}`` is not; nor is
    text with ``NaN``/``Infinity``, which JSON lacks and YAML reads as it always did)."""
    if not text.lstrip().startswith("{"):
        return False
    try:
        json.loads(text, parse_constant=_not_json)
    except ValueError:  # json.JSONDecodeError too
        return False
    return True


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def load_file(path: str | Path, what: str = "config") -> Any:
    """A YAML or JSON file's data (JSON by a ``.json`` suffix in any case, or by text that parses as
    JSON: a pipe has no suffix, and YAML refuses JSON's tab indentation) with no key named twice in a
    mapping; a ``ConfigError`` naming ``what``, the file and, where the parser knows them, the
    line and column, for a file that is missing, unreadable, not UTF-8 or not valid."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} file not found: {path}")
    if path.is_dir():  # anything else is read: a pipe (``--config <(...)``) holds a file's text too
        raise ConfigError(f"{what} {path} is a directory, not a YAML/JSON file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading BOM dropped: json refuses one, YAML skips it
        if path.suffix.lower() == ".json" or _json_text(text):
            return json.loads(text, object_pairs_hook=unique_keys)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKey as exc:
        raise ConfigError(f"{what} {path} cannot be read: duplicate key `{exc}` in a JSON object") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{what} {path} cannot be read{at}: {reason}") from None


def _switch_from_yaml(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads an unquoted ``on``/``off`` (and ``yes``/``no``, ``true``/``false``) as a
    boolean, so ``compile: on`` arrives as ``True``: a switch maps booleans to its ``on``/``off``
    explicitly; every other value is checked against the switch's own choices."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


# An ``auto | on | off`` field (and any extra choices it lists) that takes what YAML gives for it.
SWITCH = BeforeValidator(_switch_from_yaml)


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes an int or a float and no bool (``int | Literal["auto"]``,
    ``float | None``, under ``Annotated``, or as the items of lists and tuples such as
    ``list[list[int]]``): pydantic would read ``True`` there as 1."""
    leaves, todo = set(), [annotation]
    while todo:
        t = todo.pop()
        origin = typing.get_origin(t)
        if origin is Annotated:
            todo.append(typing.get_args(t)[0])
        elif origin in (typing.Union, types.UnionType, list, tuple):
            todo.extend(a for a in typing.get_args(t) if a is not Ellipsis)
        else:
            leaves.add(t)
    return bool(leaves & {int, float}) and bool not in leaves


def _boolean_in(value: Any, where: str) -> str | None:
    """Where the first boolean in ``value`` (a scalar, or nested lists and tuples) sits, as
    ``paths[1][0]``, with its value; None when there is none."""
    if isinstance(value, bool):
        return f"{where}: expected a number, got the boolean {value}"
    if isinstance(value, (list, tuple)):
        return next((hit for i, v in enumerate(value) if (hit := _boolean_in(v, f"{where}[{i}]"))), None)
    return None


class PluginConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """YAML 1.1 reads an unquoted ``yes``/``no``/``on``/``off``/``true``/``false`` as a boolean,
        which pydantic would take as 1 or 0 for a number (``num_draft_tokens: yes`` drafting 1
        token): a boolean given to a numeric field is refused, naming the field. On/off switches
        (``SWITCH``) are text fields, and keep taking YAML's booleans."""
        if not isinstance(data, dict):
            return data
        bad = [hit for name, field in cls.model_fields.items()
               if _numeric(field.annotation) and (hit := _boolean_in(data.get(field.alias or name), name))]
        if bad:
            raise ValueError("; ".join(bad) + " (YAML reads unquoted yes/no/on/off/true/false as booleans)")
        return data


class RuntimeConfig(PluginConfig):
    """Common fields of every runtime section."""

    backend: str = Field(description="Runtime name: torch, llamacpp, onnxruntime, tensorrt or a plugin.")
    model: str = Field(
        min_length=1, description="Built-in model name (smollm2-135m-instruct, gemma-3-270m), a .gguf path or a transformers dir."
    )


class ProposerConfig(PluginConfig):
    """Common fields of every proposer section."""

    type: str = Field(description="Proposer name: ngram, draft_model or a registered plugin.")
    num_draft_tokens: int | Literal["auto"] = Field(
        "auto", description="Draft length per round (gamma), or 'auto' (the default) to pick it each round from "
                            "the runtime's measured cost model, so drafting never costs more than it saves."
    )

    @property
    def auto_tree(self) -> bool:
        """Whether the drafter's tree width is cut by measured costs each round (``tree_nodes: auto``)."""
        return False

    @model_validator(mode="after")
    def _check_k(self) -> "ProposerConfig":
        k = self.num_draft_tokens
        if k != "auto" and not (0 <= k <= 64):
            raise ValueError(f"num_draft_tokens must be 'auto' or an integer in 0..64, got {k}")
        return self


class VerifierConfig(PluginConfig):
    type: str = Field("exact", description="Verifier name: exact (lossless) or a registered plugin.")


# Temperatures below this are greedy: the T -> 0 limit of sampling, as vLLM does (its
# _SAMPLING_EPS). Dividing logits by a smaller T overflows float32 (1e-40 gave inf and NaN
# probabilities, which failed whole server batches), while a point mass at the argmax is what
# sampling at such a T means.
GREEDY_BELOW_TEMPERATURE = 1e-5
# A CTRL penalty divides (or multiplies) a seen token's logit; outside this range float32 logits
# overflow or vanish (1e-40 gave inf), so it is refused rather than run.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_SEED = 2**63 - 1


class SamplingConfig(PluginConfig):
    """Target sampling; the speculative output follows exactly this distribution."""

    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                               description=f"0 = greedy (argmax); below {GREEDY_BELOW_TEMPERATURE:g} also greedy.")
    top_k: int | None = Field(None, ge=1, description="Keep the k most likely tokens.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass.")
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                             allow_inf_nan=False, description="CTRL-style penalty (1 = none).")
    seed: int | None = Field(0, ge=0, le=MAX_SEED, description="Seed of the sampling generator (reproducible runs).")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def plugin_class(registry: Registry[Any], key: str, name: Any) -> Any:
    """The class a section's ``key`` field names, or a ``ValueError`` naming the field: missing,
    not a string (a YAML list or mapping), not registered (with the allowed values), or
    registered but failing to load (the registry's reason, naming the entry point)."""
    names = registry.names()
    allowed = f"allowed values: {', '.join(names)}"
    if name is None:
        raise ValueError(f"missing field {key!r}; {allowed}")
    if not isinstance(name, str):
        raise ValueError(f"{key} must be a {registry.kind} name (a string), got {type(name).__name__} {name!r}; "
                         f"{allowed}")
    if name not in names:
        raise ValueError(f"{key}={name!r} is not a known {registry.kind}; {allowed}")
    try:
        return registry.get(name)
    except RegistryError as exc:
        raise ValueError(f"{key}={name!r}: {exc}") from exc


def _dispatch(registry: Registry[Any], key: str, default: str | None = None):
    """Validator that routes a dict section to the Config of the plugin it names. A config instance
    (the Python API) passes as it is only where it is the named plugin's own Config; any other (a
    base ``ProposerConfig(type="ngram")``, another plugin's Config) is validated again from its
    fields like a dict, so an unknown name or a field the plugin lacks is refused here, not at build."""

    def validate(value: Any) -> Any:
        if value is None:
            return value
        given = value if isinstance(value, PluginConfig) else None
        if given is not None:  # the fields it was given (defaults stay unset, as from a dict; nested
            # configs as they are) and its name
            value = {k: getattr(given, k) for k in given.model_fields_set} | {key: getattr(given, key)}
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping with a {key!r} field, got {type(value).__name__}")
        name = value.get(key, default)
        cls = plugin_class(registry, key, name)
        if given is not None and isinstance(given, cls.Config):
            return given
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
        """A YAML or JSON config file (``load_file``), validated."""
        data = load_file(path)
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping with a `target` section, got {type(data).__name__}")
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


def default_config() -> SpecConfig:
    """The built-in default: SmolLM2-135M-Instruct on PyTorch with the n-gram proposer."""
    return SpecConfig.parse(
        {
            "target": {"backend": "torch", "model": "smollm2-135m-instruct", "dtype": "float32"},
            "proposer": {"type": "ngram", "num_draft_tokens": "auto", "max_ngram": 3},
            "verifier": {"type": "exact"},
            "sampling": {"temperature": 0.0, "seed": 0},
        },
        source="built-in default config",
    )
