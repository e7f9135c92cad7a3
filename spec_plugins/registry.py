"""Name -> plugin registries for proposers, verifiers and runtimes.

Built-ins register with a decorator; third-party packages add entries through the entry-point
groups ``spec_plugins.proposers``, ``spec_plugins.verifiers``, ``spec_plugins.backends`` and
``spec_plugins.exporters``
(value ``"pkg.module:Class"``), loaded lazily the first time a name is looked up. Every plugin
class carries a pydantic ``Config`` model whose ``type`` (or ``backend``) field names it.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, TypeVar

T = TypeVar("T")


class RegistryError(LookupError):
    pass


class Registry(Generic[T]):
    """One kind of plugin. Duplicate names are refused; lookups load entry points on a miss."""

    def __init__(self, kind: str, group: str, builtins: Mapping[str, str] | None = None,
                 check: Callable[[Any], None] | None = None) -> None:
        self.kind = kind
        self.group = group
        self._check = check  # the contract every entry must meet, checked when it registers or loads
        self._entries: dict[str, T] = {}
        # Lazy built-ins: name -> "module:attr" (imported on first use, e.g. optional runtimes).
        self._lazy: dict[str, str] = dict(builtins or {})
        self._hints: dict[str, str] = {}
        self._entry_points_loaded = False

    def register(self, name: str, *, install_hint: str | None = None) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise RegistryError(f"{self.kind} {name!r} is already registered ({self._entries[name]!r})")
            if self._check is not None:
                self._check(obj)
            self._entries[name] = obj
            self._lazy.pop(name, None)
            if install_hint:
                self._hints[name] = install_hint
            return obj

        return deco

    def add_lazy(self, name: str, target: str, install_hint: str | None = None) -> None:
        """Register ``"module:attr"`` without importing it (optional dependencies)."""
        if name in self._entries:
            raise RegistryError(f"{self.kind} {name!r} is already registered")
        self._lazy[name] = target
        if install_hint:
            self._hints[name] = install_hint

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in metadata.entry_points(group=self.group):
            if ep.name not in self._entries and ep.name not in self._lazy:
                self._lazy[ep.name] = ep.value

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(set(self._entries) | set(self._lazy))

    def get(self, name: str) -> T:
        if name not in self._entries:
            self._load_entry_points()
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            target = self._lazy[name]
            module, _, attr = target.partition(":")
            try:
                mod = importlib.import_module(module)
            except ImportError as exc:
                hint = self._hints.get(name, "")
                raise RegistryError(
                    f"{self.kind} {name!r} needs a package that is not installed ({exc.name or exc})."
                    + (f" {hint}" if hint else "")
                ) from exc
            obj: Any = getattr(mod, attr) if attr else mod
            # Importing the module may have registered it already through the decorator.
            if name not in self._entries and self._check is not None:
                self._check(obj)
            self._entries.setdefault(name, obj)
            self._lazy.pop(name, None)
            return self._entries[name]
        raise RegistryError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or 'none'}")

    def view(self) -> Mapping[str, T]:
        """Read-only view of the loaded entries."""
        return MappingProxyType(self._entries)


def _check_proposer(cls: Any) -> None:
    from spec_plugins.proposers.base import check_proposer_class

    check_proposer_class(cls)


def _check_runtime(cls: Any) -> None:
    from spec_plugins.backends.base import check_runtime_class

    check_runtime_class(cls)


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
                                                   "typical": "spec_plugins.verifiers:TypicalVerifier"}
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
