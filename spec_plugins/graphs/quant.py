"""The weight quantization scheme of an exported graph: what the manifest records, what the
export cache is keyed by, and what the quantizer (``exporters/onnx_quantize.py``) applies."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# the block sizes ONNX Runtime's blockwise quantizer (MLAS) takes; others fail inside it after export
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4  # 4 or 8
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4  # ORT's: 0 = unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations
    lm_head: bool = True  # quantize the LM head too
    grid: str = "rtn"  # rtn: round to nearest on a new grid; gguf: the source GGUF's own blocks (Q4_1, Q8_0)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]} (the sizes "
                             f"ONNX Runtime's MatMulNBits quantizer takes), got {self.block_size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy_level must be 0..4, got {self.accuracy_level}")
        if self.grid not in ("rtn", "gguf"):
            raise ValueError(f"grid must be rtn or gguf, got {self.grid!r}")

    @property
    def name(self) -> str:
        """A short stable name (cache keys, labels): int4-b32-sym-acc4[-fp32head], int4-gguf-acc4[-fp32head].
        Every field that changes the graph is in it, so two schemes never share an export cache entry."""
        head = "" if self.lm_head else "-fp32head"
        if self.grid == "gguf":
            return f"int{self.bits}-gguf-acc{self.accuracy_level}{head}"
        return f"int{self.bits}-b{self.block_size}-{'sym' if self.symmetric else 'asym'}-acc{self.accuracy_level}{head}"

    def to_dict(self) -> dict:
        return {**asdict(self), "name": self.name, "method": "onnxruntime MatMulNBits (weight-only)"}


# what the gguf grid carries over from the GGUF's blocks (Q4_1 4-bit, 32 weights a block, Q8_0's
# symmetric 8-bit LM head), so a scheme asking for anything else cannot be honoured on it
GGUF_FIXED = {"bits": 4, "block_size": 32, "symmetric": True}


def gguf_conflicts(scheme: QuantScheme) -> list[str]:
    """The fields of ``scheme`` the gguf grid cannot honour (:data:`GGUF_FIXED`), in that order."""
    return [f for f, v in GGUF_FIXED.items() if getattr(scheme, f) != v]


def scheme_name(fields: dict | None) -> str:
    """The name of a scheme given as ``QuantScheme`` fields, ``none`` for no quantization."""
    return QuantScheme(**fields).name if fields else "none"


def check_gguf_source(scheme: QuantScheme | None, model: str, name: str = "target") -> None:
    """Refuse the GGUF grid for a ``model`` that is no GGUF file, before it loads: the grid carries
    the source GGUF's blocks, which the quantizer (``exporters.onnx_quantize``) looks for only after
    the whole graph is traced. ``name``: the config section the model is in, for the message."""
    from spec_plugins.models import resolve_model

    if scheme is not None and scheme.grid == "gguf" and resolve_model(model).gguf_path is None:
        raise ValueError(f"the GGUF grid (--gguf-grid, quant_grid: gguf) carries the source GGUF's own blocks, "
                         f"but the {name} model {model!r} is not a GGUF file; export it with --quantize int4 "
                         "(re-quantized) or int8 instead")
