"""The one parity rule for exported graphs, shared by the decoder graphs' check
(``exporters.parity``) and the heads' (``exporters.onnx_heads``): max |got - want| relative to
max |want|, per logits comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class ParityCase:
    graph: str
    case: str
    max_abs: float  # max |ort - torch| over the logits
    ref_scale: float  # max |torch logits|
    ok: bool
    reported: bool = False  # a quantized graph against fp32: measured, not held to rtol

    @property
    def rel(self) -> float:
        return self.max_abs / self.ref_scale if self.ref_scale else self.max_abs



def compare(graph: str, case: str, got: Any, want: Any, rtol: float) -> ParityCase:
    """The one parity rule: max |got - want| <= rtol * max |want| (both logits, any shape)."""
    g = torch.as_tensor(np.asarray(got) if not isinstance(got, torch.Tensor) else got).float()
    w = torch.as_tensor(np.asarray(want) if not isinstance(want, torch.Tensor) else want).float()
    if g.shape != w.shape:
        return ParityCase(graph, f"{case} (shape {tuple(g.shape)} != {tuple(w.shape)})", float("inf"), 0.0, False)
    max_abs = float((g - w).abs().max()) if g.numel() else 0.0
    scale = float(w.abs().max()) if w.numel() else 0.0
    return ParityCase(graph, case, max_abs, scale, bool(max_abs <= rtol * max(scale, 1e-6)))
