"""Weight-only quantization of exported graphs with ONNX Runtime's own quantizers.

``int4`` / ``int8``: every MatMul with a constant weight becomes a ``MatMulNBits`` (blockwise,
``block_size`` weights share a scale, symmetric or with zero points; ``accuracy_level`` 4 lets the
CPU kernels run int8 dot products on the activations). The LM head is a MatMul like the others and
is quantized with them unless ``lm_head`` is False (it then stays fp32: 28M of SmolLM2's 135M
parameters, about 113 MB read per step); this holds for both grids (``_excluded``). Embedding
lookups (Gather) stay fp32: they read only the rows of the tokens fed.

Exactness is relative to the quantized model itself: speculative decoding on a quantized graph
gives exactly that graph's plain output. Its distance from fp32 is measured, not assumed
(``spec-plugins export check``, and the README's quality table).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, Sequence

from spec_plugins.graphs.quant import QuantScheme, gguf_conflicts

LM_HEAD = "/lm_head/MatMul"


CARRIED = frozenset({"Q4_1", "Q8_0"})  # the GGUF block types the gguf grid carries across (``carry_gguf_grid``)


def gguf_block_types(gguf_path: str | Path) -> set[str]:
    """The tensor types a GGUF file holds (its header only: the data is memory-mapped, not read)."""
    from gguf import GGUFReader

    return {t.tensor_type.name for t in GGUFReader(str(gguf_path)).tensors}


def quantize_graph(src: str | Path, dst: str | Path, scheme: QuantScheme, gguf_path: str | Path | None = None
                   ) -> dict[str, Any]:
    """Quantize the graph ``src`` into ``dst`` (weights in ``dst.data``); returns what it did.
    ``grid: gguf`` carries the blocks of ``gguf_path`` (the model the graph was exported from)."""
    import onnx

    if scheme.grid == "gguf":
        bad = gguf_conflicts(scheme)
        if bad:
            raise ValueError(f"grid 'gguf' carries the GGUF's own blocks (Q4_1 4-bit, Q8_0 8-bit, 32 weights a block), "
                             f"so it takes no {', '.join(f'{f}={getattr(scheme, f)}' for f in bad)}: use bits 4 with "
                             "the default block and symmetry, or the rtn grid")
        if gguf_path is None:
            raise ValueError("grid 'gguf' needs the source GGUF file; the model was not loaded from one")
        kinds = gguf_block_types(gguf_path)
        if not kinds & CARRIED:
            raise ValueError(f"grid 'gguf' carries {' and '.join(sorted(CARRIED))} blocks; {Path(gguf_path).name} holds "
                             f"{', '.join(sorted(kinds)) or 'no tensors'}: export with the default int4 grid "
                             "(re-quantized) or int8 instead")
        return {**scheme.to_dict(), **carry_gguf_grid(src, dst, gguf_path, scheme.accuracy_level, _excluded(scheme))}
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    model = onnx.load(str(src))
    q = MatMulNBitsQuantizer(model, bits=scheme.bits, block_size=scheme.block_size, is_symmetric=scheme.symmetric,
                             accuracy_level=scheme.accuracy_level, nodes_to_exclude=_excluded(scheme))
    q.process()
    return {**scheme.to_dict(), **_save(q.model.model, Path(dst)), "seconds": round(time.perf_counter() - t0, 1)}


def _excluded(scheme: QuantScheme) -> list[str]:
    """The MatMul nodes both grids leave in fp32: the LM head when the scheme keeps it so."""
    return [] if scheme.lm_head else [LM_HEAD]


def _save(model: Any, dst: Path) -> dict[str, Any]:
    """Write ``model`` to ``dst`` with its weights in ``dst.data``; what it holds."""
    import onnx

    dst.parent.mkdir(parents=True, exist_ok=True)
    data = dst.with_name(dst.name + ".data")
    for old in (dst, data):
        old.unlink(missing_ok=True)
    onnx.save(model, str(dst), save_as_external_data=True, location=data.name)
    # onnx creates the external data file owner-only; it gets the graph file's mode (the umask's)
    os.chmod(data, stat.S_IMODE(dst.stat().st_mode))
    kinds = [n.op_type for n in model.graph.node]
    return {"quantized_matmuls": kinds.count("MatMulNBits"), "float_matmuls": kinds.count("MatMul"),
            "size_bytes": dst.stat().st_size + data.stat().st_size}


# ---- the GGUF's own grid ------------------------------------------------------------------------------
def _blocks(data: Any, qtype: str) -> tuple[Any, Any, Any]:
    """Raw GGUF blocks of a [rows, bytes] tensor -> (codes [rows, blocks, 32] uint8, scale, min)
    as float32 [rows, blocks]: Q4_1 w = d*q + m (q in 0..15); Q8_0 w = d*q (q int8, min 0)."""
    import numpy as np

    rows = data.shape[0]
    if qtype == "Q4_1":
        b = data.reshape(rows, -1, 20)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:20]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # byte j: element j (low), j + 16 (high)
        return codes, d, m
    if qtype == "Q8_0":
        b = data.reshape(rows, -1, 34)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # zero point 128
        return codes, d, np.zeros_like(d)
    raise ValueError(f"GGUF tensor type {qtype} has no MatMulNBits equivalent here (Q4_1 and Q8_0 do)")


def _pack(codes: Any, bits: int) -> Any:
    """[N, blocks, 32] codes -> MatMulNBits' B: [N, blocks, 32 * bits / 8] (element 2i low nibble)."""
    import numpy as np

    if bits == 8:
        return codes.astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def carry_gguf_grid(src: str | Path, dst: str | Path, gguf_path: str | Path, accuracy_level: int = 4,
                    exclude: Sequence[str] = ()) -> dict[str, Any]:
    """Rewrite every MatMul whose constant weight is a GGUF tensor dequantized (the fp32 export of
    a GGUF model) over that tensor's own blocks, so the graph holds the GGUF's weights exactly:
    - Q8_0 (w = d q): a MatMulNBits of 8-bit codes;
    - Q4_1 (w = d q + m per block of 32): a MatMulNBits of the 4-bit codes with zero point 0 (the
      d q part) plus the block sums of the input times m (a [.., K/32] x [K/32, N] MatMul). A float
      zero point (-m/d) would say the same in one op, but ONNX Runtime's CPU kernels take a slow
      path for it (measured: 2.2 ms against 0.27 ms for a 576 x 1536 layer at one position).
    Rows are matched by value, so the loader's q/k row permutation is followed. With accuracy
    level 4 the activations are quantized to int8 per block inside the kernel, as llama.cpp's own
    Q4_1 x Q8_1 dot products do. MatMuls named in ``exclude`` stay as they are (fp32 weights, which
    for a GGUF model are its blocks dequantized, so the same values computed in fp32). Any other MatMul
    with a constant weight that no Q4_1 / Q8_0 tensor holds is refused by name, before anything is
    written: left float, it would sit under a label that says quantized."""
    import numpy as np
    import onnx
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from onnx import helper, numpy_helper

    t0 = time.perf_counter()
    model = onnx.load(str(src))
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    reader = GGUFReader(str(gguf_path))
    by_shape: dict[tuple[int, int], list[Any]] = {}
    for t in reader.tensors:
        if len(t.shape) == 2:  # matrices; norms and biases are 1-D
            by_shape.setdefault((int(t.shape[1]), int(t.shape[0])), []).append(t)  # (rows N, cols K)
    new_nodes, dropped, done, left = [], set(), 0, []
    for node in g.node:
        carry = node.op_type == "MatMul" and len(node.input) == 2 and node.name not in exclude
        w = inits.get(node.input[1]) if carry else None
        if w is None or len(w.dims) != 2:
            new_nodes.append(node)
            continue
        W = numpy_helper.to_array(w).T  # [N, K], the torch weight
        same_shape = by_shape.get(W.shape, [])
        found = _match(W, [t for t in same_shape if t.tensor_type.name in CARRIED], dequantize)
        if found is None:
            left.append((node.name, sorted({t.tensor_type.name for t in same_shape})))
            new_nodes.append(node)
            continue
        t, perm = found
        codes, d, m = _blocks(np.asarray(t.data)[perm], t.tensor_type.name)
        bits = 4 if t.tensor_type.name == "Q4_1" else 8
        N, K = W.shape
        base = node.name.strip("/").replace("/", "_")
        x, y = node.input[0], node.output[0]
        g.initializer.extend([numpy_helper.from_array(_pack(codes, bits), base + "_B"),
                              numpy_helper.from_array(d.reshape(-1), base + "_scales")])
        ins = [x, base + "_B", base + "_scales"]
        if bits == 4:  # zero point 0 (two per byte) and the mins as a side MatMul
            g.initializer.extend([
                numpy_helper.from_array(np.zeros(N * ((K // 32 + 1) // 2), np.uint8), base + "_zp"),
                numpy_helper.from_array(m.T.astype(np.float32).copy(), base + "_mins"),
                numpy_helper.from_array(np.array([0, 0, K // 32, 32], np.int64), base + "_blocks"),
                numpy_helper.from_array(np.array([-1], np.int64), base + "_last")])
            ins.append(base + "_zp")
            new_nodes += [
                helper.make_node("Reshape", [x, base + "_blocks"], [base + "_xb"], name=base + "_xb"),
                helper.make_node("ReduceSum", [base + "_xb", base + "_last"], [base + "_xs"], name=base + "_xs",
                                 keepdims=0),
                helper.make_node("MatMul", [base + "_xs", base + "_mins"], [base + "_ym"], name=base + "_ym")]
        out = base + "_yq" if bits == 4 else y
        new_nodes.append(helper.make_node("MatMulNBits", ins, [out], name=base + "_gguf", domain="com.microsoft",
                                          K=K, N=N, bits=bits, block_size=32, accuracy_level=accuracy_level))
        if bits == 4:
            new_nodes.append(helper.make_node("Add", [out, base + "_ym"], [y], name=base + "_add"))
        dropped.add(node.input[1])
        done += 1
    if left:
        raise ValueError(_uncarried(left, Path(gguf_path).name))
    del g.node[:]
    g.node.extend(new_nodes)
    used = {i for n in g.node for i in n.input}
    keep = [i for i in g.initializer if i.name not in dropped or i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {**_save(model, Path(dst)), "carried": done, "seconds": round(time.perf_counter() - t0, 1)}


def _uncarried(left: list[tuple[str, list[str]]], gguf_name: str) -> str:
    """Why a graph with MatMuls the grid could not carry is refused: they would stay float under a
    quantized label. Names them, the GGUF types of their shape, and the way out."""
    what = "; ".join(f"{name} ({'tensors of its shape: ' + ', '.join(types) if types else 'no tensor of its shape'})"
                     for name, types in left[:5])
    more = f" and {len(left) - 5} more" if len(left) > 5 else ""
    ways = []
    if any(name == LM_HEAD for name, _ in left):
        ways.append("keep the LM head float with --fp32-lm-head (quant_lm_head: false)")
    if any(name != LM_HEAD for name, _ in left):
        ways.append("export with the rtn grid (re-quantized)")
    return (f"grid 'gguf' carries {' and '.join(sorted(CARRIED))} blocks, and no such tensor of {gguf_name} holds "
            f"the weights of {what}{more}; they would stay float under a quantized label: {' or '.join(ways)}")


def _match(W: Any, candidates: list[Any], dequantize: Any) -> tuple[Any, Any] | None:
    """The GGUF tensor whose dequantized rows are W's rows (in some order), and the order."""
    import numpy as np

    want: dict[bytes, list[int]] = {}
    for i in range(W.shape[0]):
        want.setdefault(W[i].tobytes(), []).append(i)  # equal rows (unused tokens) share one GGUF row
    for t in candidates:
        deq = dequantize(np.asarray(t.data), t.tensor_type).reshape(W.shape).astype(np.float32)
        perm = np.zeros(W.shape[0], dtype=np.int64)
        hit = np.zeros(W.shape[0], dtype=bool)
        for j in range(deq.shape[0]):
            rows = want.get(deq[j].tobytes())
            if rows is None:
                break
            perm[rows] = j
            hit[rows] = True
        if hit.all():
            return t, perm
    return None
