"""ONNX graphs of the trained draft heads (``spec_plugins.heads``): Medusa heads, EAGLE layer,
a parallel drafter's block layers.

    medusa  hidden [B, H]                                 -> logits [B, K, Vd]
    eagle   features [B, T, H], tokens [B, T], positions [B, T],
            past_key / past_value [B, kv, S, d], attention_mask [B, 1, T, S+T] (additive)
                                                          -> features [B, T, H],
                                                             new_key / new_value [B, kv, T, d]
            (kv: the cache's heads, ``cache_heads``)
    block   features [B, T, H]                            -> features [B, T, H]
            (with block_context also positions, past_key / past_value [B, L*kv, S, d],
            attention_mask [B, 1, T, S+T])

Medusa logits are over the head's draft vocabulary (``vocab_ids`` in the head directory). The
EAGLE graph is the drafter's layer alone: its input features are already in the drafter's
space (``EagleDrafter.project``) and the draft-vocabulary LM head on its output is one matmul
the proposer does where it needs it (the last catch-up position, the expanded nodes), rather
than on every position in the graph. A parallel drafter is the EAGLE layer's graph plus, with
block layers, the block graph (``BlockRefiner``: its own entry, ``<name>-block``). The heads are
plain modules without caches, so the tracer sees every shape; B, T and S are dynamic.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from spec_plugins.exporters.onnx_verify import gather_weights
from spec_plugins.graphs.manifest import GraphEntry, graph_files
from spec_plugins.graphs.io import OPSET


def _io(kind: str, c: Any, vd: int) -> tuple[list[dict], list[dict], dict]:
    if kind == "medusa_heads":
        ins = [{"name": "hidden", "dtype": "float32", "shape": ["B", c.hidden_size]}]
        outs = [{"name": "logits", "dtype": "float32", "shape": ["B", c.num_heads, vd]}]
        return ins, outs, {"hidden": {0: "B"}, "logits": {0: "B"}}
    feats = {"name": "features", "dtype": "float32", "shape": ["B", "T", c.hidden_size]}
    outs = [{"name": "features_out", "dtype": "float32", "shape": ["B", "T", c.hidden_size]}]
    axes = {"features": {0: "B", 1: "T"}, "features_out": {0: "B", 1: "T"}}
    if kind == "block_refiner" and not getattr(c, "block_context", False):
        return [feats], outs, axes
    heads = c.cache_heads - c.num_kv_heads if kind == "block_refiner" else c.cache_heads
    kv_in, kv_new = ["B", heads, "S", c.head_dim], ["B", heads, "T", c.head_dim]
    ins = [feats] + [{"name": "tokens", "dtype": "int64", "shape": ["B", "T"]}] * (kind == "eagle_layer") + [
        {"name": "positions", "dtype": "int64", "shape": ["B", "T"]},
        {"name": "past_key", "dtype": "float32", "shape": kv_in},
        {"name": "past_value", "dtype": "float32", "shape": kv_in},
        {"name": "attention_mask", "dtype": "float32", "shape": ["B", 1, "T", "S+T"]}]
    axes |= {"tokens": {0: "B", 1: "T"}, "positions": {0: "B", 1: "T"}, "past_key": {0: "B", 2: "S"},
             "past_value": {0: "B", 2: "S"}, "attention_mask": {0: "B", 2: "T", 3: "ST"}}
    if kind == "block_refiner":
        del axes["tokens"]
        return ins, outs, axes
    outs += [{"name": "new_key", "dtype": "float32", "shape": kv_new},
             {"name": "new_value", "dtype": "float32", "shape": kv_new}]
    return ins, outs, axes | {"new_key": {0: "B", 2: "T"}, "new_value": {0: "B", 2: "T"}}


def head_inputs(kind: str, module: Any, B: int = 2, T: int = 3, S: int = 4, seed: int = 0) -> tuple:
    """Random inputs for a head graph; with a cache (EAGLE, block layers with context) each row at
    its own positions under its own mask (``row_context``), so a graph that mixes rows fails."""
    g = torch.Generator().manual_seed(seed)
    c = module.config
    if kind == "medusa_heads":
        return (torch.randn(B, c.hidden_size, generator=g),)
    refiner = kind == "block_refiner"
    if refiner and not getattr(c, "block_context", False):
        return (torch.randn(B, T, c.hidden_size, generator=g),)
    heads = c.cache_heads - c.num_kv_heads if refiner else c.cache_heads
    feats = torch.randn(B, T, c.hidden_size, generator=g)
    tokens = () if refiner else (torch.randint(0, module.embed_weight.shape[0], (B, T), generator=g),)
    past = torch.randn(B, heads, S, c.head_dim, generator=g), torch.randn(B, heads, S, c.head_dim, generator=g)
    positions, mask = row_context(g, B, T, S)
    return (feats, *tokens, positions, *past, mask)


def row_context(g: torch.Generator, B: int, T: int, S: int, holes: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, T] and an additive mask [B, 1, T, S+T] as the runtime feeds batched rows of
    unlike lengths: each row at its own offset (distinct, from S on), and its own holes among the
    cached slots and the causal new ones (slots a row does not hold, padding, tree nodes off a
    node's path). Every query sees itself, as the runtime's padding queries do, so no query's
    attention is empty."""
    offsets = S + torch.randperm(4 * B, generator=g)[:B]
    positions = offsets[:, None] + torch.arange(T)
    causal = torch.cat([torch.ones(T, S, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()], -1)
    ok = causal & (torch.rand(B, T, S + T, generator=g) >= holes)
    ok[:, :, S:] |= torch.eye(T, dtype=torch.bool)
    mask = torch.zeros(B, 1, T, S + T).masked_fill_(~ok[:, None], torch.finfo(torch.float32).min)
    return positions, mask


def _kind(module: Any) -> str:
    from spec_plugins.heads import EagleDrafter, MedusaHeads
    from spec_plugins.heads.parallel import BlockRefiner

    if isinstance(module, MedusaHeads):
        return "medusa_heads"
    if isinstance(module, EagleDrafter):
        return "eagle_layer"
    if isinstance(module, BlockRefiner):
        return "block_refiner"
    raise TypeError(f"cannot export {type(module).__name__}: expected MedusaHeads, EagleDrafter or BlockRefiner")


@contextmanager
def float_eval(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` in float32 and eval mode while the block runs, then as it was: its own tensors
    back (a live drafter exported on first use may be float16, and its embeddings are the
    target's own tensor, which a converted copy would no longer share) and its training flag."""
    params = [(p, p.data) for p in module.parameters()]
    buffers = [(m, name, b) for m in module.modules() for name, b in m._buffers.items()]
    training = module.training
    try:
        yield module.float().eval()
    finally:
        for p, data in params:
            p.data = data
        for m, name, b in buffers:
            m._buffers[name] = b
        module.train(training)


def head_graphs(name: str, module: Any) -> list[tuple[str, Any]]:
    """The graphs a trained head exports as: (graph name, module) pairs."""
    refiner = getattr(module, "refiner", None)
    return [(name, module)] + ([(f"{name}-block", refiner)] if refiner is not None else [])


@torch.no_grad()
def export_head(module: Any, path: str | Path, name: str, source_model: str, source_heads: str | None,
                opset: int = OPSET) -> GraphEntry:
    """Trace a Medusa or EAGLE head into ``path`` and validate it with onnx.checker."""
    import onnx

    kind = _kind(module)
    vd = int(module.vocab_ids.numel()) if hasattr(module, "vocab_ids") else 0
    ins, outs, axes = _io(kind, module.config, vd)
    path = Path(path)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), float_eval(module):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, head_inputs(kind, module), str(path), input_names=[i["name"] for i in ins],
                          output_names=[o["name"] for o in outs], dynamic_axes=axes, opset_version=opset,
                          dynamo=False)
    drop_noop_casts(path)
    size = gather_weights(path)
    onnx.checker.check_model(str(path))
    return GraphEntry(name=name, kind=kind, file=path.name, source_model=source_model, dtype="float32", inputs=ins,
                      outputs=outs, size_bytes=size,
                      export_seconds=round(time.perf_counter() - t0, 3), hidden_size=module.config.hidden_size,
                      vocab_size=vd, source_heads=source_heads)


def export_head_file(module: Any, path: str | Path) -> Path:
    """Export a head graph to ``path`` atomically (a proposer's export on first use)."""
    import os
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        export_head(module, tmp / path.name, path.stem, "", None)
        files = graph_files(tmp / path.name)
        for f in files[1:] + files[:1]:  # the graph last: it appears with its weights in place
            os.replace(f, path.parent / f.name)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def drop_noop_casts(path: Path) -> int:
    """Remove Cast nodes to the type their input already has (the heads' RMSNorm casts to float
    and back). ONNX Runtime 1.32's Cast-chain elimination breaks on them ("node input ... is not
    a graph input") at any optimisation level above 'disable'. Returns how many were removed."""
    import onnx

    # weights stay where they are: a graph above 2 GiB keeps them in files of its own
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]}
    types.update({t.name: t.data_type for t in g.initializer})
    outputs = {o.name for o in g.output}
    rename: dict[str, str] = {}
    keep = []
    for node in g.node:
        node.input[:] = [rename.get(i, i) for i in node.input]
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        noop = node.op_type == "Cast" and to is not None and types.get(node.input[0]) == to
        if noop and node.output[0] not in outputs:
            rename[node.output[0]] = node.input[0]
            continue
        keep.append(node)
    if rename:
        del g.node[:]
        g.node.extend(keep)
        del g.value_info[:]
        onnx.save(model, str(path))
    return len(rename)


def load_head_module(entry: GraphEntry, model: Any) -> Any:
    from spec_plugins.heads import MedusaHeads, drafter_class

    if entry.source_heads is None:
        raise ValueError(f"graph {entry.name!r} has no source_heads directory to compare against")
    cls = MedusaHeads if entry.kind == "medusa_heads" else drafter_class(entry.source_heads)
    module = cls.from_pretrained(entry.source_heads, model)
    return module.refiner if entry.kind == "block_refiner" else module


@torch.no_grad()
def check_head(directory: str | Path, entry: GraphEntry, model: Any, rtol: float, module: Any = None) -> list:
    """ORT vs the PyTorch head on random inputs of a few shapes, every output (Medusa: logits;
    EAGLE: the drafter's output features, which its LM head reads, and the keys and values it
    caches); batched rows at positions and under masks of their own (``head_inputs``)."""
    from spec_plugins.backends.onnxruntime_runtime import create_session

    module = module if module is not None else load_head_module(entry, model)
    session = create_session(Path(directory) / entry.file, "cpu")
    with float_eval(module):
        return _head_cases(entry, module, session, rtol)


def _head_cases(entry: GraphEntry, module: Any, session: Any, rtol: float) -> list:
    """``check_head``'s cases: ``module`` (float32, eval) against ``session`` at a few shapes."""
    from spec_plugins.exporters.parity_rule import compare

    names = [i["name"] for i in entry.inputs]
    cases = []
    for B, T, S in ((1, 1, 0), (2, 3, 5), (3, 6, 9)):
        args = head_inputs(entry.kind, module, B, T, S, seed=B + T + S)
        want = module(*args)
        outs = [o["name"] for o in entry.outputs]
        got = session.run(outs, {n: a.numpy() for n, a in zip(names, args)})
        label = f"random B={B}" if entry.kind == "medusa_heads" else f"random B={B} T={T}" + f" S={S}" * (len(args) > 1)
        for name, g, w in zip(outs, got, want if isinstance(want, tuple) else (want,)):
            cases.append(compare(entry.name, label + f" {name}" * (name != outs[0]), g, w, rtol))
    return cases
