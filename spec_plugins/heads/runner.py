"""Where a trained head runs: in PyTorch, or in ONNX Runtime next to an ONNX Runtime target.

The proposers call a head through one signature whichever engine runs it, so ``backend:
onnxruntime`` in the target section is the only change a config needs. The ONNX graph of a head
is exported on first use (``EXPORTERS['onnx_head']``) into the cache, keyed by the head's
weights, and reused afterwards.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import torch

Engine = Literal["auto", "torch", "onnxruntime"]


def pick_engine(engine: Engine, target: Any) -> str:
    """``auto``: the head runs on ONNX Runtime when the target does, else in PyTorch."""
    if engine != "auto":
        return engine
    name = getattr(getattr(target, "capabilities", None), "name", "")
    return "onnxruntime" if name == "onnxruntime" else "torch"


def weights_key(module: torch.nn.Module) -> str:
    """A digest of everything a head's graph bakes in (the export cache key): its config, its
    parameters and all its buffers, the non-persistent ones too (an EAGLE layer's target
    embeddings and LM head are not in ``state_dict`` but are constants of its graph)."""
    h = hashlib.sha1(repr(getattr(module, "config", None)).encode())
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, t in sorted(tensors.items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def session_threads(target: Any) -> tuple[int | None, bool]:
    """The intra-op threads (None: onnxruntime's default) and spinning of the target's ONNX Runtime
    session: a head runs beside the target on the same cores, so it takes the target's settings."""
    session = getattr(target, "session", None)
    if session is None:
        return None, False
    options = session.get_session_options()
    try:
        spinning = options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    except RuntimeError:  # a session made without the entry: onnxruntime's default, which spins
        spinning = True
    return options.intra_op_num_threads or None, spinning


def head_session(module: torch.nn.Module, target: Any = None) -> Any:
    """An ONNX Runtime session of ``module``'s head graph, exported on first use, with the threads
    and spinning of ``target``'s session (``session_threads``)."""
    from spec_plugins.backends.onnxruntime_runtime import create_session, import_ort
    from spec_plugins.graphs.manifest import EXPORTER_VERSION
    from spec_plugins.models import cache_root
    from spec_plugins.registry import EXPORTERS

    import_ort()
    kind = type(module).__name__.lower()
    directory = cache_root() / "onnx-heads" / f"{kind}-{weights_key(module)}-v{EXPORTER_VERSION}"
    path = directory / "head.onnx"
    if not path.is_file():
        EXPORTERS.get("onnx_head")(module, path)
    threads, spinning = session_threads(target)
    return create_session(path, "cpu", threads=threads, spinning=spinning)


class OrtEagleLayer:
    """The EAGLE drafter's layer in ONNX Runtime, called like ``EagleDrafter.forward``."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.names = [i.name for i in session.get_inputs()]

    def __call__(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
                 past_v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        args = (features.float(), tokens.long(), positions.long(), past_k.float(), past_v.float(), mask.float())
        feeds = {n: a.contiguous().numpy() for n, a in zip(self.names, args)}
        out, k, v = self.session.run(["features_out", "new_key", "new_value"], feeds)
        return torch.from_numpy(out), torch.from_numpy(k), torch.from_numpy(v)


class OrtBlockRefiner:
    """A parallel drafter's block layers in ONNX Runtime, called like ``BlockRefiner.forward``."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def __call__(self, x: torch.Tensor, *context: torch.Tensor) -> torch.Tensor:
        """``context``: positions, past keys, past values and the mask (``block_context``), or none."""
        args = (x.float(), *(a.long() if i == 0 else a.float() for i, a in enumerate(context)))
        feeds = {i.name: a.contiguous().numpy() for i, a in zip(self.session.get_inputs(), args)}
        return torch.from_numpy(self.session.run(["features_out"], feeds)[0])


class OrtMedusaHeads:
    """Medusa heads in ONNX Runtime, called like ``MedusaHeads.forward``."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session.run(["logits"], {"hidden": hidden.float().contiguous().numpy()})[0])
