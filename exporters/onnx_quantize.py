"""Weight-only quantization of exported graphs with ONNX Runtime's own quantizers.

``int4`` / ``int8``: every MatMul with a constant weight becomes a ``MatMulNBits`` (blockwise,
``block_size`` weights share a scale, symmetric or with zero points; ``accuracy_level`` 4 lets the
CPU kernels run int8 dot products on the activations). The LM head is a MatMul like the others and
is quantized with them unless ``lm_head`` is False (it then stays fp32: 28M of SmolLM2's 135M
parameters, about 113 MB read per step). Embedding lookups (Gather) stay fp32: they read only the
rows of the tokens fed.

Exactness is relative to the quantized model itself: speculative decoding on a quantized graph
gives exactly that graph's plain output. Its distance from fp32 is measured, not assumed
(``spec-plugins export check``, and the README's quality table).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from spec_plugins.graphs.quant import QuantScheme

LM_HEAD = "/lm_head/MatMul"


def quantize_graph(src: str | Path, dst: str | Path, scheme: QuantScheme) -> dict[str, Any]:
    """Quantize the graph ``src`` into ``dst`` (weights in ``dst.data``); returns what it did."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    model = onnx.load(str(src))
    exclude = [] if scheme.lm_head else [LM_HEAD]
    q = MatMulNBitsQuantizer(model, bits=scheme.bits, block_size=scheme.block_size, is_symmetric=scheme.symmetric,
                             accuracy_level=scheme.accuracy_level, nodes_to_exclude=exclude)
    q.process()
    out = q.model.model
    kinds = [n.op_type for n in out.graph.node]
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    for old in (dst, dst.with_name(dst.name + ".data")):
        old.unlink(missing_ok=True)
    onnx.save(out, str(dst), save_as_external_data=True, location=dst.name + ".data")
    size = dst.stat().st_size + dst.with_name(dst.name + ".data").stat().st_size
    return {**scheme.to_dict(), "quantized_matmuls": kinds.count("MatMulNBits"),
            "float_matmuls": kinds.count("MatMul"), "seconds": round(time.perf_counter() - t0, 1),
            "size_bytes": size}
