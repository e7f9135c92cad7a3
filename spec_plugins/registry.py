"""Name -> plugin registries for proposers, verifiers and runtimes.

Built-ins register with a decorator; third-party packages add entries through the entry-point
groups ``spec_plugins.proposers``, ``spec_plugins.verifiers``, ``spec_plugins.backends`` and
``spec_plugins.exporters``
(value ``"pkg.module:Class"``), loaded lazily the first time a name is looked up. Every plugin
class carries a pydantic ``Config`` model whose ``type`` (or ``backend``) field names it; a
verifier also declares ``lossy`` (a bool), what stats report.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, TypeVar

from pydantic import BaseModel

T = TypeVar("T")


class RegistryError(LookupError):
    pass


class Registry(Generic[T]):
    """One kind of plugin. Duplicate names are refused; lookups load entry points on a miss."""

    def __init__(self, kind: str, group: str, builtins: Mapping[str, str] | None = None,
                 check: Callable[[str, Any], None] | None = None) -> None:
        self.kind = kind
        self.group = group
        # the contract every entry must meet, checked (given the name it registers under and the
        # entry) when it registers or loads
        self._check = check
        self._entries: dict[str, T] = {}
        # Lazy built-ins: name -> "module:attr" (imported on first use, e.g. optional runtimes).
        self._lazy: dict[str, str] = dict(builtins or {})
        self._hints: dict[str, str] = {}
        self._entry_points_loaded = False
        self._from_entry_points: set[str] = set()  # names that entry points added
        self._loaded_from: dict[str, str] = {}  # name -> the "module:attr" a lazy entry was imported from
        self._clashes: dict[str, list[str]] = {}  # name -> entry points naming it beside what it is

    def register(self, name: str, *, install_hint: str | None = None) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise RegistryError(f"{self.kind} {name!r} is already registered ({self._entries[name]!r})")
            if name in self._lazy and name not in self._entries:
                self._refuse_other(name, obj)
            if self._check is not None:
                self._check(name, obj)  # a class written against the wrong contract: the plugin author's TypeError
            self._entries[name] = obj
            self._lazy.pop(name, None)
            if install_hint:
                self._hints[name] = install_hint
            return obj

        return deco

    def _refuse_other(self, name: str, obj: Any) -> None:
        """Refuse registering ``obj`` under a name a lazy entry (a built-in or an entry point not
        imported yet) holds, unless that entry is ``obj`` itself: taking the name would replace the
        entry unseen, and the entry's own module would fail to register it when imported later. The
        entry's module, where it is being imported right now (the decorator runs inside it, or a
        package re-exporting it), cannot be compared yet and is let through; an entry that cannot be
        imported because it re-exports ``obj`` from the module being imported is compared on first
        use (``_check_clashes``)."""
        target = self._lazy[name]
        if target == f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}":
            return  # the entry's own class, registered by its module's decorator
        loading = sys.modules.get(target.partition(":")[0])
        if loading is not None and getattr(getattr(loading, "__spec__", None), "_initializing", False):
            return
        try:
            other = self._import(name, target)
        except RegistryError as exc:
            if _needs_itself(exc, obj):  # the target re-exports ``obj`` from the module running this decorator
                self._clashes.setdefault(name, []).append(target)  # compared on first use (``_check_clashes``)
                return
            other = None  # it does not load here (a missing optional package): the name is taken all the same
        if other is not obj:
            raise RegistryError(f"{self.kind} {name!r} is already registered ({self._origin(name)}); register "
                                "yours under another name")

    def add_lazy(self, name: str, target: str, install_hint: str | None = None) -> None:
        """Register ``"module:attr"`` without importing it (optional dependencies)."""
        if name in self._entries:
            raise RegistryError(f"{self.kind} {name!r} is already registered")
        self._lazy[name] = target
        if install_hint:
            self._hints[name] = install_hint

    def _checked(self, name: str, obj: Any, origin: str) -> None:
        """The contract check, its failure a ``RegistryError`` naming the entry and where it came
        from, so a config naming a broken plugin is refused as a config error, not a traceback."""
        if self._check is None:
            return
        try:
            self._check(name, obj)
        except TypeError as exc:
            raise RegistryError(f"{self.kind} {name!r} ({origin}) cannot be used: {exc}") from exc

    def _target(self, name: str) -> str | None:
        """The ``"module:attr"`` ``name`` stands for (None: not registered), to tell an entry point
        that points at the same object (an installed copy of a built-in) from one that does not."""
        if name in self._lazy or name in self._loaded_from:
            return self._lazy.get(name) or self._loaded_from[name]
        if name in self._entries:
            obj = self._entries[name]
            return f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
        return None

    def _origin(self, name: str) -> str:
        """Where ``name`` comes from, for messages: its entry point, or its ``"module:attr"``."""
        target = self._target(name) or "?"
        return f"entry point {name} = {target} in group {self.group}" if name in self._from_entry_points else target

    def _load_entry_points(self) -> None:
        """Add the group's entry points as lazy entries. One whose name is taken (a built-in, a class
        registered by decorator, an earlier entry point) is kept as a clash and checked when that
        name is looked up: the same object (a package re-exporting its class) is fine, another
        object is refused naming both, and a clash never blocks the other names."""
        if self._entry_points_loaded:
            return
        for ep in metadata.entry_points(group=self.group):
            value = f"{ep.module}:{ep.attr}" if ep.attr else ep.module  # its object; extras name no object
            if self._target(ep.name) is None:
                self._lazy[ep.name] = value
                self._from_entry_points.add(ep.name)
            elif self._target(ep.name) != value:
                self._clashes.setdefault(ep.name, []).append(value)
        self._entry_points_loaded = True

    def _import(self, name: str, target: str, origin: str | None = None) -> Any:
        """The object ``"module:attr"`` names (``attr`` may be dotted: ``Outer.Inner``); any failure to
        import it (a missing package with its install hint, a module raising at import, a missing
        attribute) a ``RegistryError`` naming it."""
        module, _, attr = target.partition(":")
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            hint = self._hints.get(name, "")
            raise RegistryError(f"{self.kind} {name!r} needs a package that is not installed ({exc.name or exc})."
                                + (f" {hint}" if hint else "")) from exc
        except Exception as exc:  # noqa: BLE001 - a plugin module may raise anything at import
            raise RegistryError(f"{self.kind} {name!r} ({origin or self._origin(name)}) cannot be loaded: importing "
                                f"{module} raised {type(exc).__name__}: {exc}") from exc
        obj: Any = mod
        done: list[str] = []
        for part in attr.split(".") if attr else ():
            if not hasattr(obj, part):
                where = f"{module}:{'.'.join(done)}" if done else f"module {module}"
                raise RegistryError(f"{self.kind} {name!r} ({origin or self._origin(name)}) cannot be loaded: "
                                    f"{where} has no attribute {part!r}")
            obj = getattr(obj, part)
            done.append(part)
        return obj

    def _check_clashes(self, name: str, obj: Any) -> None:
        """Entry points naming ``name`` beside ``obj``: each must load to ``obj`` itself."""
        for value in self._clashes.get(name, ()):
            other = self._import(name, value, f"entry point {name} = {value} in group {self.group}")
            if other is not obj:
                raise RegistryError(f"{self.kind} entry point {name} = {value} (group {self.group}): the name "
                                    f"{name!r} is already the {self.kind} {self._target(name)}; rename the entry point")
        self._clashes.pop(name, None)  # each one is the same object: nothing to check again

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(set(self._entries) | set(self._lazy))

    def get(self, name: str) -> T:
        """The entry ``name``, imported on first use; a ``RegistryError`` for a name that is not a
        string or not registered, a missing package, or an entry that does not load or breaks the
        plugin contract (naming the entry point it came from)."""
        if not isinstance(name, str):
            raise RegistryError(f"a {self.kind} name must be a string, got {type(name).__name__} {name!r}")
        if name not in self._entries:
            self._load_entry_points()
        if name in self._lazy:
            target = self._lazy[name]
            obj: Any = self._import(name, target)
            # Importing the module may have registered it already through the decorator.
            if name not in self._entries:
                self._checked(name, obj, self._origin(name))
            self._entries.setdefault(name, obj)
            self._lazy.pop(name, None)  # (a decorator run by the import has removed it already)
            self._loaded_from[name] = target
        if name in self._entries:
            self._load_entry_points()
            self._check_clashes(name, self._entries[name])
            return self._entries[name]
        raise RegistryError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or 'none'}")

    def view(self) -> Mapping[str, T]:
        """Read-only view of the loaded entries."""
        return MappingProxyType(self._entries)


def _needs_itself(exc: BaseException, obj: Any) -> bool:
    """Whether importing a lazy entry failed on ``obj``'s own module, half imported because the
    decorator registering ``obj`` runs inside it (an entry point naming a re-export of ``obj``):
    the entry can be compared with ``obj`` only once that import has finished."""
    module = sys.modules.get(getattr(obj, "__module__", ""))
    cause: BaseException | None = exc.__cause__
    seen: set[int] = set()  # a chain may loop (``raise e from e``)
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ImportError) and cause.name == getattr(obj, "__module__", None):
            return True
        if isinstance(cause, AttributeError) and module is not None and getattr(cause, "obj", None) is module:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def check_config_class(kind: str, cls: Any, name: str, key: str, base: str) -> None:
    """Refuse a plugin class whose ``Config`` is not a subclass of ``base`` (named
    ``module.Class``: ``spec_plugins.config`` imports this module, so it is matched by name along
    the MRO) defaulting ``key`` to ``name``: a config section naming the plugin is validated by
    ``cls.Config.model_validate`` with ``{key: name}``, where a missing or non-pydantic Config
    would fail as a raw AttributeError and a foreign or mismatched one as a field error that never
    names the plugin's mistake."""
    label = getattr(cls, "__name__", repr(cls))
    config = getattr(cls, "Config", None)
    bases = {f"{c.__module__}.{c.__qualname__}" for c in getattr(config, "__mro__", ())}
    if not (isinstance(config, type) and issubclass(config, BaseModel) and base in bases):
        got = "none" if config is None else getattr(config, "__qualname__", type(config).__name__)
        raise TypeError(f"{kind} {label} must carry a Config class subclassing {base} "
                        f"(its config section, with {key} defaulting to {name!r}); got {got}")
    field = config.model_fields.get(key)
    if field is None or field.is_required() or field.default != name:
        got = "no default" if field is None or field.is_required() else f"the default {field.default!r}"
        raise TypeError(f"{kind} {label}: its Config's {key} must default to {name!r}, the name it is registered "
                        f"under; it has {got}")


def _check_proposer(name: str, cls: Any) -> None:
    from spec_plugins.proposers.base import check_proposer_class

    check_proposer_class(cls)
    check_config_class("proposer", cls, name, "type", "spec_plugins.config.ProposerConfig")


def _check_runtime(name: str, cls: Any) -> None:
    from spec_plugins.backends.base import check_runtime_class

    check_runtime_class(cls)
    check_config_class("runtime", cls, name, "backend", "spec_plugins.config.RuntimeConfig")


def _check_verifier(name: str, cls: Any) -> None:
    """A verifier must also say whether it changes the output law: ``lossy`` (a bool class
    attribute) is what stats, configs and ``/metrics`` report, and a verifier that never declares
    it would otherwise be counted exact."""
    check_config_class("verifier", cls, name, "type", "spec_plugins.config.VerifierConfig")
    label = getattr(cls, "__name__", repr(cls))
    if not isinstance(getattr(cls, "lossy", None), bool):
        got = "nothing" if not hasattr(cls, "lossy") else repr(getattr(cls, "lossy"))
        raise TypeError(f"verifier {label} must declare lossy: ClassVar[bool] = False if its output follows the "
                        f"target distribution exactly, True if it changes it; it declares {got}")


PROPOSERS: Registry[Any] = Registry(
    "proposer",
    "spec_plugins.proposers",
    builtins={
        "ngram": "spec_plugins.proposers.ngram:NgramProposer",
        "draft_model": "spec_plugins.proposers.draft_model:DraftModelProposer",
        "recycling": "spec_plugins.proposers.recycling:RecyclingProposer",
        "lookahead": "spec_plugins.proposers.lookahead:LookaheadProposer",
        "medusa": "spec_plugins.proposers.medusa:MedusaProposer",
        "eagle": "spec_plugins.proposers.eagle:EagleProposer",
        "parallel": "spec_plugins.proposers.parallel:ParallelProposer",
        "suffix": "spec_plugins.proposers.suffix:SuffixProposer",
        "hybrid": "spec_plugins.proposers.hybrid:HybridProposer",
    },
    check=_check_proposer,
)
VERIFIERS: Registry[Any] = Registry(
    "verifier", "spec_plugins.verifiers", builtins={"exact": "spec_plugins.verifiers:ExactVerifier",
                                                   "typical": "spec_plugins.verifiers:TypicalVerifier"},
    check=_check_verifier,
)
BACKENDS: Registry[Any] = Registry(
    "backend", "spec_plugins.backends", builtins={"torch": "spec_plugins.backends.torch_backend:TorchBackend",
                                                 "onnxruntime": "spec_plugins.backends.onnxruntime_runtime:OnnxRuntime"},
    check=_check_runtime,
)
BACKENDS._hints["onnxruntime"] = "install the [onnx] extra: pip install 'spec-plugins[onnx]'"
BACKENDS.add_lazy("llamacpp", "spec_plugins.backends.llamacpp_runtime:LlamaCppRuntime",
                  install_hint="install the [llamacpp] extra: pip install 'spec-plugins[llamacpp]'")
# imports tensorrt only when a runtime is built; that step gives the install hint where it is missing
BACKENDS.add_lazy("tensorrt", "spec_plugins.backends.tensorrt_runtime:TensorRTRuntime",
                  install_hint="install the [tensorrt] extra on a GPU machine: pip install 'spec-plugins[tensorrt]'")

# artifacts a runtime builds on first use (an ONNX export for ``backend: onnxruntime`` without a
# path), looked up by name so that runtimes never import the exporters package
EXPORTERS: Registry[Any] = Registry(
    "exporter", "spec_plugins.exporters", builtins={"onnx": "spec_plugins.exporters.onnx_export:export_model",
                                                "onnx_head": "spec_plugins.exporters.onnx_heads:export_head_file"})

register_proposer = PROPOSERS.register
register_verifier = VERIFIERS.register
register_backend = BACKENDS.register
