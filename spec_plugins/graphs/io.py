"""The verify-graph layout, shared by the exporters that write it and the runtimes that run it.

    inputs   input_ids       [B, N]          int64
             position_ids    [B, N]          int64
             attention_mask  [B, 1, N, P+N]  float, additive (0 = attend, finfo.min = masked)
             past_key.i      [B, H_kv, P, D] per layer i (past_value.i likewise)
    outputs  logits          [B, N, V]       float32
             hidden          [B, N, H]       last hidden state (feature-level drafters)
             features        [B, N, L*H]     outputs of L decoder layers (EAGLE-3), only when the
                                             graph was exported with ``feature_layers``
             present_key.i   [B, H_kv, P+N, D] = past + new (present_value.i likewise)

The mask is what ``spec_plugins/slots.py`` builds, so it carries tree masks and holes (left padding,
rejected nodes). B, N and P are dynamic axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPSET = 17
# opsets the exporter writes: 14 is the lowest this layout's ops export at, 20 the highest of
# torch.onnx.export(dynamo=False) (it warns above 20 and fails on opsets ONNX does not know)
MIN_OPSET, MAX_OPSET = 14, 20
GRAPH_DTYPES = ("float32", "float16")  # decoder graph dtypes (ONNX Runtime's CPU kernels lack bfloat16)
Port = tuple[str, list]  # one graph input/output: (dtype name, shape of ints and symbolic names)


@dataclass(frozen=True)
class DecoderShape:
    """What a runtime needs to know to feed a decoder graph."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int

    @classmethod
    def of(cls, model: Any) -> "DecoderShape":
        cfg = model.config.get_text_config(decoder=True)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            num_layers=int(cfg.num_hidden_layers),
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            max_context=int(getattr(cfg, "max_position_embeddings", 2048)),
        )


def input_names(num_layers: int) -> list[str]:
    past = [f"past_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "position_ids", "attention_mask", *past]


def present_names(num_layers: int) -> list[str]:
    return [f"present_{kv}.{i}" for i in range(num_layers) for kv in ("key", "value")]


def output_names(num_layers: int, features: bool = False) -> list[str]:
    return ["logits", "hidden", *(["features"] if features else []), *present_names(num_layers)]


def io_spec(shape: DecoderShape, dtype: str, feature_layers: tuple[int, ...] = ()) -> tuple[list[dict], list[dict]]:
    """Manifest description of the graph's inputs and outputs (symbolic dims B, N, P, T=P+N)."""
    L = shape.num_layers
    kv_in = ["B", shape.num_kv_heads, "P", shape.head_dim]
    kv_out = ["B", shape.num_kv_heads, "T", shape.head_dim]
    ins = [
        {"name": "input_ids", "dtype": "int64", "shape": ["B", "N"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["B", "N"]},
        {"name": "attention_mask", "dtype": dtype, "shape": ["B", 1, "N", "T"]},
    ] + [{"name": n, "dtype": dtype, "shape": kv_in} for n in input_names(L)[3:]]
    outs = [
        {"name": "logits", "dtype": "float32", "shape": ["B", "N", shape.vocab_size]},
        {"name": "hidden", "dtype": dtype, "shape": ["B", "N", shape.hidden_size]},
    ] + ([{"name": "features", "dtype": dtype, "shape": ["B", "N", shape.hidden_size * len(feature_layers)]}]
         if feature_layers else []) + [{"name": n, "dtype": dtype, "shape": kv_out} for n in present_names(L)]
    return ins, outs


def layout_fields(inputs: dict[str, Port], outputs: dict[str, Port]) -> dict[str, object]:
    """The decoder fields a verify-layout graph's own inputs and outputs imply (None where the
    graph leaves a dimension symbolic): the inverse of :func:`io_spec`."""
    missing = [n for n in input_names(0) if n not in inputs] + [n for n in ("logits", "hidden") if n not in outputs]
    if missing:
        raise ValueError(f"the graph lacks {', '.join(missing)} of the verify-graph layout")

    def dim(port: Port | None, i: int) -> int | None:
        shape = port[1] if port is not None else []
        return shape[i] if len(shape) > i and isinstance(shape[i], int) else None

    hidden = dim(outputs["hidden"], 2)
    width = dim(outputs.get("features"), 2)
    features = 0 if "features" not in outputs else (width // hidden if width and hidden else None)
    kv = inputs.get("past_key.0")
    return {"num_layers": sum(n.startswith("past_key.") for n in inputs), "num_kv_heads": dim(kv, 1),
            "head_dim": dim(kv, 3), "hidden_size": hidden, "vocab_size": dim(outputs["logits"], 2),
            "dtype": inputs["attention_mask"][0], "feature_layers": features}
