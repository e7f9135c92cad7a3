"""Registered verifiers: thin objects that pick the right pure function from ``verify``."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from spec_plugins.config import VerifierConfig
from spec_plugins.registry import register_verifier
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verify import Verdict, greedy_verify, rejection_verify


@register_verifier("exact")
class ExactVerifier:
    """Lossless: greedy match at temperature 0, exact rejection sampling otherwise."""

    lossy: ClassVar[bool] = False

    class Config(VerifierConfig):
        type: Literal["exact"] = "exact"

    def __init__(self, config: "ExactVerifier.Config | None" = None) -> None:
        self.config = config or self.Config()

    def __call__(
        self,
        x: torch.Tensor,
        parents: tuple[int, ...],
        target_logits: torch.Tensor,
        q: torch.Tensor | None,
        pipeline: LogitsPipeline,
        generator: torch.Generator | None,
        valid: torch.Tensor | None = None,
    ) -> Verdict:
        """``target_logits`` [B, n+1, V] are already processed by ``pipeline``."""
        if pipeline.greedy:
            return greedy_verify(x, parents, target_logits, valid)
        p = target_logits.float().softmax(-1)
        return rejection_verify(x, parents, p, q, generator, valid)
