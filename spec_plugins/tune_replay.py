"""tune's predictions by replay (``bench.replay``): a proposer whose drafts read only the sequence
is scored over a runtime's recorded plain outputs at its measured costs, decoded with the limits
those outputs were decoded with, so a turn that ended on EOS before ``max_new`` drafts its last
rounds as the engine did. Other proposers (recycling and lookahead read the target's logits,
EAGLE and Medusa its hidden states) are measured by a real run in ``tune``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spec_plugins.tune_budget import Budget, _spent


def replayable(section: dict[str, Any]) -> bool:
    """Whether the proposer ``section`` (tune's ``PROPOSERS`` entry) is predicted by replay: the
    replay's point-mass logits only stand in for the model, so only ``bench.replay.SEQUENCE_ONLY``
    drafts as it would with the model."""
    from spec_plugins.bench.replay import SEQUENCE_ONLY

    return section["type"] in SEQUENCE_ONLY


def needs_features(section: dict[str, Any]) -> bool:
    """Whether the proposer ``section`` drafts from the target's hidden states (a runtime that
    returns none cannot run it)."""
    from spec_plugins.registry import PROPOSERS as REGISTRY

    return bool(REGISTRY.get(section["type"]).needs_hidden)


def replay_factory(section: dict[str, Any]) -> Callable[[], Any]:
    """Fresh proposers of ``section`` for the replay, built from the section as it is, so what is
    replayed is what tune confirms and writes. A tree cut by cost each round (``tree_nodes:
    auto``) is refused: the decode prices that cut with costs it corrects from its rounds' real
    times, which the replay's simulated clock does not reproduce, so its prediction would describe
    a config that never ran (tune's replayed sections fix their node count)."""
    from spec_plugins.registry import PROPOSERS as REGISTRY

    if section.get("tree_nodes") == "auto":
        raise ValueError(f"proposer {section['type']}: the replay cannot predict tree_nodes: auto (the decode "
                         "cuts the tree by costs it learns from real round times); give a fixed tree_nodes")
    pcls = REGISTRY.get(section["type"])
    cfg = pcls.Config.model_validate(section)
    return lambda: pcls(cfg)


def _replay(prompts: Sequence[list[int]], outputs: Sequence[list[int]], make: Callable[[], Any], cost: Any,
            overhead: float, vocab: int) -> dict[str, float]:
    """``_replay_counted`` over every prompt, without the count."""
    return _replay_counted(prompts, outputs, make, cost, overhead, vocab)[0]


def _replay_counted(prompts: Sequence[list[int]], outputs: Sequence[list[int]], make: Callable[[], Any],
                    cost: Any, overhead: float, vocab: int, budget: Budget | None = None,
                    max_new: int | None = None, eos_ids: Sequence[int] = ()) -> tuple[dict[str, float], int]:
    """Simulated tokens/s of plain, fixed draft lengths 1..8 and auto over the recorded outputs, as
    ``_plain_outputs`` measures plain: every new token over the whole generation, prefill included
    (``bench.replay.rates``); and how many prompts were replayed (every policy on the same prompts,
    as many as ``budget`` allows, at least one). ``max_new``/``eos_ids``: the limits the outputs
    were decoded with (``bench.replay.recorded_limit``; None: each output's length)."""
    from spec_plugins.bench.replay import auto, fixed, rates, replay_turn
    from spec_plugins.stats import DecodeStats

    policies = {"plain": fixed(0), **{str(k): fixed(k) for k in range(1, 9)}, "auto": auto(cost)}
    totals = {name: DecodeStats() for name in policies}
    done = 0
    for p, o in zip(prompts, outputs):
        if done and _spent(budget):
            break
        for name, factory in policies.items():
            st = replay_turn(p, o, make(), factory(), cost, overhead, max_new=max_new, eos_ids=eos_ids,
                             vocab_size=vocab)
            totals[name] = totals[name].merge(st)
        done += 1
    return {name: rates(t)["tokens_per_s"] for name, t in totals.items()}, done
