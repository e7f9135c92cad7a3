"""Wiring a loaded decoder into a server: the batch, its draft policy (from the one factory,
with the forward costs of every batch size measured once, here), the scheduler and the state the
HTTP app serves. Used by ``spec-plugins serve`` and by each Ray Serve replica."""

from __future__ import annotations

from typing import Any

DRAFT_POLICIES = ("load", "fixed")  # how a server sizes drafts (build_state's docstring)


def build_state(decoder: Any, max_batch: int = 8, max_input_tokens: int | None = None,
                max_total_tokens: int | None = None, draft_policy: str = "load", model_id: str = "",
                calibrate_context: int = 32, max_queue: int = 1024, cpu_workers: int = 2) -> Any:
    """Wire a SpeculativeDecoder into a Batch + Scheduler + ServerState.

    ``draft_policy='load'``: ``AutoDraftLength`` over the forward cost measured once at startup
    per (batch rows, positions per row), corrected online by the served forwards: per-row keys,
    shadow drafts, and shorter drafts as the batch grows, down to none. ``'fixed'``: always the
    configured length (``policy.draft_policy.build_policy``)."""
    from spec_plugins.loop import Batch
    from spec_plugins.policy import DEFAULTS
    from spec_plugins.policy.draft_length import FixedLength
    from spec_plugins.server.app import ServerState
    from spec_plugins.server.scheduler import Scheduler
    from spec_plugins.wiring import wire

    target = decoder.target
    total = max_total_tokens or min(target.max_context, 2048)
    if total > target.max_context:
        raise ValueError(f"--max-total-tokens {total} exceeds the model's context of {target.max_context}")
    inputs = max_input_tokens or max(1, total // 2)
    if draft_policy not in DRAFT_POLICIES:
        raise ValueError(f"draft policy must be 'load' or 'fixed', got {draft_policy!r}")
    # the forward costs of every batch size the server runs (measured once, here)
    sizes = sorted({b for b in (1, 4, 16, 64) if b < max_batch} | {max_batch})
    wiring = wire(target, decoder.section, proposer=decoder.proposer, costs=decoder.costs, sizer=decoder.sizer,
                  rows=sizes, length=draft_policy, context=calibrate_context)
    proposer, section, costs = wiring.proposer, wiring.section, wiring.costs
    policy = wiring.policy()
    k = policy.length.max_k if not isinstance(policy.length, FixedLength) else policy.length.k
    cost_table = costs.forward.base.to_dict()["table"] if costs is not None else {}
    seed = decoder.config.sampling.seed if decoder.config else 0
    batch = Batch(target, proposer, decoder.verifier, decoder.eos_ids(), seed=seed, traits=wiring.traits)
    # the runtime's generation lock, shared with every decoder over it (``decoder_lock``)
    sched = Scheduler(batch, max_batch, max_queue, policy, lock=decoder.generation_lock)
    info = {"speculation": {"proposer": section.type if section is not None else None, "max_draft_length": k,
                            "draft_policy": draft_policy if k else "off", "lossy": batch.lossy,
                            "forward_cost_seconds": cost_table, "defaults": vars(DEFAULTS)}}
    return ServerState(sched, decoder.tokenizer, model_id or "spec-plugins", inputs, total,
                       policy=policy if proposer is not None else None, max_draft_length=k, info_extra=info,
                       cpu_workers=cpu_workers)
