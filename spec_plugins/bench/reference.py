"""transformers' own greedy ``generate()`` as the independent reference, and the one rule for
comparing an output with it.

Comparing speculative decoding with plain decoding on the same runtime proves little: a bug both
share (a cache the model ignores, a wrong mask) passes. The reference here runs the model through
transformers alone, one prompt at a time, and keeps its per-step logits, so a split can be judged:
allowed only where the reference itself had a near-tie between the two tokens, since a wider
forward (a verify pass, a batch with padding) may rank those the other way in finite precision.
Used by ``scripts/gpu_check.py`` and ``scripts/reference_check.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class Reference:
    """One prompt's greedy continuation by transformers and the logits of each step."""

    tokens: list[int]
    logits: list[torch.Tensor]  # [V] float32 per new token


@torch.inference_mode()
def greedy_reference(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     eos_ids: Sequence[int] = ()) -> list[Reference]:
    """``model.generate`` greedy, one prompt at a time (no padding), stopping at ``eos_ids``."""
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids) or None,
                           pad_token_id=eos_ids[0] if eos_ids else 0, output_logits=True,
                           return_dict_in_generate=True)
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)], device=dev)
        g = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        out.append(Reference(g.sequences[0, len(p):].tolist(), [z[0].float().cpu() for z in g.logits]))
    return out


def near_tie_bound(z: torch.Tensor, dtype: torch.dtype) -> float:
    """A logit gap this small can flip between a one-token forward and a wider one in ``dtype``:
    about eight bf16/fp16 rounding steps of the largest logit; 1e-3 (+1e-5 relative) in fp32."""
    scale = float(z.abs().max())
    return scale / 32 if dtype in (torch.bfloat16, torch.float16) else 1e-3 + 1e-5 * scale


@dataclass
class Comparison:
    verdict: str  # "exact" | "near-tie" (split at a near-tie of the reference) | "FAIL"
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict != "FAIL"


def compare(outputs: Sequence[Sequence[int]], refs: Sequence[Reference], dtype: torch.dtype) -> Comparison:
    """Outputs (one per prompt) against their references; the note names the first split and its gap."""
    worst = ""
    for b, (o, ref) in enumerate(zip(outputs, refs)):
        first = next((i for i, (x, y) in enumerate(zip(o, ref.tokens)) if x != y), None)
        if first is None:
            if len(o) != len(ref.tokens):
                return Comparison("FAIL", f"row {b}: {len(o)} tokens, reference {len(ref.tokens)}")
            continue
        z = ref.logits[first]
        gap, bound = float(z[ref.tokens[first]] - z[o[first]]), near_tie_bound(z, dtype)
        if gap > bound:
            return Comparison("FAIL", f"row {b} splits at token {first}: gap {gap:.4f} > near-tie bound {bound:.4f}")
        worst = f"row {b} splits at token {first}, a near-tie (gap {gap:.4f} <= {bound:.4f})"
    return Comparison("near-tie", worst) if worst else Comparison("exact")
