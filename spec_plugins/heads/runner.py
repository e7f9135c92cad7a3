"""Where a trained head runs: in PyTorch, or in ONNX Runtime next to an ONNX Runtime target.

The proposers call a head through one signature whichever engine runs it, so ``backend:
onnxruntime`` in the target section is the only change a config needs. The ONNX graph of a head
is the one the target's export directory holds (``export onnx`` of the proposer's config) where
that graph computes this head, else exported on first use (``EXPORTERS['onnx_head']``) into the
cache, keyed by the head's weights, and reused afterwards.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Literal

import torch

Engine = Literal["auto", "torch", "onnxruntime"]
log = logging.getLogger(__name__)


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
    """An ONNX Runtime session of ``module``'s head graph: the target's export's own graph of it
    (``export_graph``), else the cache's, exported on first use; with the threads and spinning of
    ``target``'s session (``session_threads``)."""
    from spec_plugins.backends.onnxruntime_runtime import create_session, import_ort
    from spec_plugins.graphs.manifest import EXPORTER_VERSION, ManifestError
    from spec_plugins.models import cache_dir
    from spec_plugins.registry import EXPORTERS

    import_ort()
    threads, spinning = session_threads(target)
    path = export_graph(module, getattr(target, "export_dir", None))
    if path is not None:
        return create_session(path, "cpu", threads=threads, spinning=spinning)
    kind = type(module).__name__.lower()
    path = cache_dir("onnx-heads", f"{kind}-{weights_key(module)}-v{EXPORTER_VERSION}", "head.onnx")
    if not path.is_file():
        EXPORTERS.get("onnx_head")(module, path)
    try:
        return create_session(path, "cpu", threads=threads, spinning=spinning)
    except ManifestError as exc:  # damaged in the cache (its weights lost, truncated): no command re-exports it
        log.warning("the cached head graph %s cannot be loaded (%s): exporting it again", path, exc)
        EXPORTERS.get("onnx_head")(module, path)
        return create_session(path, "cpu", threads=threads, spinning=spinning)


def export_graph(module: torch.nn.Module, directory: Path | None) -> Path | None:
    """The graph of ``module`` in the export ``directory`` (the ONNX Runtime target's): a head entry
    of its kind whose inputs and outputs are the module's and whose outputs are the module's on
    random inputs (``export check``'s head check). The graph was traced over the export's target
    weights, float16 ones in a float16 export, and ``module`` here over the float32 model, so the
    outputs are held to the real-input tolerance of the target's dtype (float32: 1e-4, float16:
    2e-2; another head's weights are off by about their scale). None where the export holds no
    such entry (a head it was not made with: the cache serves). An entry made from the head
    directory that now holds ``module``'s weights but computing something else (the head was
    retrained after the export) is an error: running it would draft from other weights."""
    from spec_plugins.exporters.onnx_heads import _io, _kind, check_head
    from spec_plugins.exporters.parity import target_dtype, tolerance
    from spec_plugins.graphs.manifest import Manifest, ManifestError

    if directory is None:
        return None
    kind = _kind(module)
    vd = int(module.vocab_ids.numel()) if hasattr(module, "vocab_ids") else 0
    ins, outs, _ = _io(kind, module.config, vd)
    man = Manifest.read(directory)
    rtol = tolerance(target_dtype(man), real=True)
    for entry in (g for g in man.graphs if g.kind == kind):
        same_io = (entry.inputs, entry.outputs) == (ins, outs)
        if same_io and all(c.ok for c in check_head(directory, entry, None, rtol, module)):
            return Path(directory) / entry.file
        if holds_weights(entry.source_heads, kind, module):
            raise ManifestError(f"{Path(directory) / entry.file} (graph {entry.name!r}) was exported from "
                                f"{entry.source_heads}, which now holds other weights (this proposer's head) than "
                                "the graph computes; export again (spec-plugins export onnx) or give the "
                                "onnxruntime target a path without this head")
    return None


def holds_weights(heads: str | None, kind: str, module: torch.nn.Module) -> bool:
    """Whether the trained head directory ``heads`` holds ``module``'s trained weights (a block
    refiner's: its drafter's ``refiner.`` tensors), as loading it would give them."""
    from spec_plugins.heads.common import HeadFiles, load_head

    if not heads or not HeadFiles(Path(heads)).exists():
        return False
    state = load_head(heads)[1]
    if kind == "block_refiner":
        state = {k.removeprefix("refiner."): v for k, v in state.items() if k.startswith("refiner.")}
    mine = module.state_dict()
    return state.keys() == mine.keys() and all(
        state[k].shape == mine[k].shape and torch.equal(state[k].to(mine[k].dtype), mine[k].detach().cpu())
        for k in state)


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
