"""How far a runtime's model is from another's: perplexity on held-out text and greedy agreement.

Speculative decoding is exact relative to the model it verifies with, so a quantized graph is
exact to itself; what quantization costs is measured here, against fp32, on text no drafter or
scheme was chosen on (held-out ShareGPT conversations) and on the dev prompts' greedy outputs.
Both functions drive any runtime through the runtime contract (``prefill`` + ``forward``), so
torch, ONNX Runtime and llama.cpp are measured the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@torch.inference_mode()
def token_logprobs(runtime: Any, ids: Sequence[int], chunk: int = 64) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i = 1..len-1, scored in chunks of ``chunk`` positions."""
    ids = list(ids)
    out = runtime.prefill([ids[:1]])
    logits = [out.logits[0, -1:].float()]
    for s in range(1, len(ids) - 1, chunk):
        part = ids[s: min(s + chunk, len(ids) - 1)]
        logits.append(runtime.forward(torch.tensor([part])).logits[0].float())
        runtime.commit([list(range(len(part)))])
    lp = torch.cat(logits).log_softmax(-1)
    runtime.select_rows([])
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@dataclass
class Perplexity:
    tokens: int
    nll: float  # mean negative log-likelihood per token

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def perplexity(runtime: Any, texts: Sequence[Sequence[int]], mask: Sequence[Sequence[bool]] | None = None,
               chunk: int = 64) -> Perplexity:
    """Mean NLL over the scored tokens of ``texts`` (``mask[i][j]``: score token j of text i).

    Scoring no token is refused: its mean is undefined, and reporting ppl 1.0 would read as a
    perfect model rather than a missing measurement."""
    total, n = 0.0, 0
    for i, ids in enumerate(texts):
        lp = token_logprobs(runtime, ids, chunk)
        keep = torch.tensor(list(mask[i][1:]), dtype=torch.bool) if mask is not None else torch.ones_like(lp, dtype=torch.bool)
        total += float(-lp[keep].sum())
        n += int(keep.sum())
    if n == 0:
        raise ValueError(f"perplexity: no token scored in {len(texts)} text(s): no texts, texts of one token, "
                         "or a mask that selects no token after the first (no assistant tokens)")
    return Perplexity(n, total / n)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Identical outputs and where each one first leaves the reference."""
    firsts = [first_difference(a, b) for a, b in zip(outputs, reference)]
    return {"identical": sum(f is None for f in firsts), "of": len(firsts),
            "first_difference": firsts}
