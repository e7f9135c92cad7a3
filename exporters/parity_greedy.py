"""The greedy half of ``export check``: speculative decoding through an exported graph must emit
the very tokens its source model does (``GreedyCase``), over as many new tokens as the graph's
context leaves after the check's prompt (``greedy_room``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GreedyCase:
    graph: str
    tokens: int
    identical: bool
    first_difference: int | None = None


def greedy_tokens(runtime: Any, prompt: list[int], max_new: int, draft_runtime: Any = None,
                  plain: bool = False) -> list[int]:
    """Greedy speculative decoding: n-gram drafts, or a draft model on ``draft_runtime``;
    ``plain``: no drafts at all."""
    from spec_plugins.config import SamplingConfig
    from spec_plugins.loop import decode
    from spec_plugins.policy import FixedLength
    from spec_plugins.proposers.draft_model import DraftModelProposer
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.sampling import LogitsPipeline
    from spec_plugins.verifiers import ExactVerifier

    if plain:
        prop: Any = None
    elif draft_runtime is not None:
        prop = DraftModelProposer(None, target=runtime, runtime=draft_runtime)
    else:
        prop = NgramProposer(NgramProposer.Config(num_draft_tokens=5))
    toks: list[int] = []
    for step in decode(runtime, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), [prompt], max_new,
                       (), None, None, FixedLength(5)):
        toks.extend(step.emitted.get(0, []))
    return toks


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_room(graph: str, prompt: int, max_new_tokens: int, context: int) -> int:
    """``max_new_tokens`` capped at what ``context`` leaves after the check's ``prompt`` tokens (the
    decode loop refuses a request past it); ValueError where the prompt leaves no room at all."""
    if prompt >= context:
        raise ValueError(f"graph {graph!r} holds {context} positions of context; export check's prompt of {prompt} "
                         "tokens leaves none for a new token, so its outputs cannot be compared: export the model "
                         "with a longer context")
    return min(max_new_tokens, context - prompt)
