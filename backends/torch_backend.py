"""The ``torch`` backend as the registry knows it: one config, two runtimes.

A torch config runs on the growing transformers cache (``torch_runtime.TorchRuntime``) or on the
static, compiled one (``torch_static.StaticTorchRuntime``, a subclass); this entry is where the
config's ``kv`` / ``compile`` settings choose, so neither runtime module imports the other's
caller."""

from __future__ import annotations

from spec_plugins.backends.torch_runtime import TorchRuntime, selects_static
from spec_plugins.backends.torch_static import StaticTorchRuntime
from spec_plugins.registry import register_backend


@register_backend("torch")
class TorchBackend(TorchRuntime):
    """Registered as ``torch``; never built itself: ``from_config`` returns the runtime the config
    selects (``torch_runtime.selects_static``)."""

    @classmethod
    def from_config(cls, config: TorchRuntime.Config) -> TorchRuntime:
        chosen = StaticTorchRuntime if selects_static(config) else TorchRuntime
        return chosen.from_config(config)
