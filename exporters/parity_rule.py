"""The one parity rule for exported graphs, shared by the decoder graphs' check
(``exporters.parity``) and the heads' (``exporters.onnx_heads``): max |got - want| relative to
max |want|, per output comparison (logits, hidden states, features, a head's outputs); and, for a
quantized graph, the temperature of its next-token distributions against its float source's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# max |diff| <= rtol * max |reference|, by graph dtype, on random inputs (``export check``'s cases, and
# the exporter's own check of a traced graph). float16 keeps 11 bits, and on the random-past cases its
# rounding alone moves the logits by a sizeable share of their scale, while a wrong graph is off by
# about their whole scale: the float16 bound sits between (the measurements that place it are in
# docs/runtimes/onnxruntime.md).
RTOL = {"float32": 1e-4, "float16": 0.2}


@dataclass
class ParityCase:
    graph: str
    case: str
    max_abs: float  # max |ort - torch| over the output
    ref_scale: float  # max |torch output| (1 for a logit scale, whose max_abs is |scale - 1|)
    ok: bool
    reported: bool = False  # a quantized graph against fp32: measured, not held to rtol
    output: str = "logits"  # which output: logits, hidden, features, scale (``compare_scale``)

    @property
    def rel(self) -> float:
        return self.max_abs / self.ref_scale if self.ref_scale else self.max_abs


def _tensor(x: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).float()


def compare(graph: str, case: str, got: Any, want: Any, rtol: float, output: str = "logits") -> ParityCase:
    """The one parity rule: max |got - want| <= rtol * max |want| (the same output of both, any shape)."""
    g, w = _tensor(got), _tensor(want)
    if g.shape != w.shape:
        return ParityCase(graph, f"{case} (shape {tuple(g.shape)} != {tuple(w.shape)})", float("inf"), 0.0, False,
                          output=output)
    max_abs = float((g - w).abs().max()) if g.numel() else 0.0
    scale = float(w.abs().max()) if w.numel() else 0.0
    return ParityCase(graph, case, max_abs, scale, bool(max_abs <= rtol * max(scale, 1e-6)), output=output)


def logit_scale(got: Any, want: Any) -> float:
    """The factor by which ``got`` scales ``want`` (least squares over every position, each
    position's logits centred first, as softmax ignores a shift): softmax(got) ~ softmax(s * want),
    so 1/s is the temperature ``got`` samples at relative to ``want``."""
    g, w = _tensor(got), _tensor(want)
    g, w = g - g.mean(-1, keepdim=True), w - w.mean(-1, keepdim=True)
    return float((g * w).sum() / (w * w).sum().clamp_min(1e-30))


def compare_scale(graph: str, case: str, got: Any, want: Any, bound: float) -> ParityCase:
    """The next-token distributions' temperature: ``logit_scale`` within a factor ``bound`` of 1
    (max_abs: |scale - 1|). A relative logit bound loose enough for quantization's rounding also
    passes logits scaled by a constant (a baked-in temperature: every argmax kept, every sampled
    distribution moved); rounding noise leaves the scale near 1 on any vocabulary, where the
    probabilities' own distance depends on how peaked the model's distributions are."""
    g, w = _tensor(got), _tensor(want)
    if g.shape != w.shape or not g.numel():
        return ParityCase(graph, f"{case} logit scale (shape {tuple(g.shape)} != {tuple(w.shape)})", float("inf"),
                          1.0, False, output="scale")
    s = logit_scale(g, w)
    return ParityCase(graph, f"{case} logit scale {s:.3f}", abs(s - 1.0), 1.0, bool(1 / bound <= s <= bound),
                      output="scale")
