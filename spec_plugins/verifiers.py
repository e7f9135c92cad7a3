"""Registered verifiers: thin objects that pick the right pure function from ``verify``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch
from pydantic import Field

from spec_plugins.config import VerifierConfig
from spec_plugins.registry import register_verifier
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.verify import Verdict, greedy_verify, rejection_verify, typical_verify


class _Verifier(ABC):
    """The verifier protocol: greedy match at temperature 0, else ``sample`` over the target's
    probabilities. ``target_logits`` [B, n+1, V] are already processed by ``pipeline``."""

    lossy: ClassVar[bool]
    Config: ClassVar[type[VerifierConfig]]

    def __init__(self, config: VerifierConfig | None = None) -> None:
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
        if pipeline.greedy:
            return greedy_verify(x, parents, target_logits, valid)
        return self.sample(x, parents, target_logits.float().softmax(-1), q, generator, valid)

    @abstractmethod
    def sample(self, x: torch.Tensor, parents: tuple[int, ...], p: torch.Tensor, q: torch.Tensor | None,
               generator: torch.Generator | None, valid: torch.Tensor | None) -> Verdict:
        """The rule at temperature > 0 over the target's probabilities ``p`` [B, n+1, V]."""


@register_verifier("exact")
class ExactVerifier(_Verifier):
    """Lossless: greedy match at temperature 0, exact rejection sampling otherwise."""

    lossy: ClassVar[bool] = False
    keyed_draws: ClassVar[bool] = True  # takes seeded rows' ``KeyedDraws`` for its generator (this class only)

    class Config(VerifierConfig):
        type: Literal["exact"] = "exact"

    def sample(self, x: torch.Tensor, parents: tuple[int, ...], p: torch.Tensor, q: torch.Tensor | None,
               generator: torch.Generator | None, valid: torch.Tensor | None) -> Verdict:
        return rejection_verify(x, parents, p, q, generator, valid)


@register_verifier("typical")
class TypicalVerifier(_Verifier):
    """LOSSY: Medusa's typical acceptance at temperature > 0 (greedy match at temperature 0).

    Output no longer follows the target distribution exactly; ``DecodeStats.lossy`` is True."""

    lossy: ClassVar[bool] = True

    class Config(VerifierConfig):
        type: Literal["typical"] = "typical"
        epsilon: float = Field(0.09, gt=0.0, le=1.0,
                               description="Hard probability threshold (Medusa's posterior_threshold).")
        delta: float = Field(0.3, gt=0.0, lt=1.0,
                             description="Entropy-scaled threshold factor (Medusa's posterior_alpha).")
        lossy: Literal[True] = Field(True,
                                     description="Always true: typical acceptance changes the output distribution.")

    def sample(self, x: torch.Tensor, parents: tuple[int, ...], p: torch.Tensor, q: torch.Tensor | None,
               generator: torch.Generator | None, valid: torch.Tensor | None) -> Verdict:
        """``q`` is ignored: the rule only looks at p."""
        return typical_verify(x, parents, p, self.config.epsilon, self.config.delta, generator, valid)
