"""The round: one function, read top to bottom, that every caller runs.

``generate``, ``stream``, ``generate_batch``, the transformers plugin, the parity check and the
bench run it over a fixed batch (``decode``); the server runs it over a batch that rows join
and leave between rounds; the replay drives it over a runtime that replays recorded outputs.
Timing is the batch's clock read between steps; stats, the policy, the proposer and any
observer learn from the ``RoundRecord`` it returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from spec_plugins.loop.batch import Batch
from spec_plugins.policy.draft_length import LengthPolicy
from spec_plugins.policy.draft_policy import DraftPolicy, build_policy
from spec_plugins.proposers.base import ProposerTraits
from spec_plugins.sampling import LogitsPipeline
from spec_plugins.stats import DecodeStats
from spec_plugins.types import Emission, RoundRecord, RoundTimes, RowRequest


def run_round(batch: Batch, policy: DraftPolicy) -> RoundRecord | None:
    """One round for every live row: choose, draft, size, one target forward, verify, commit, emit,
    observe."""
    batch.check_owner()  # the runtime's caches still hold this batch's rows (no later batch took them)
    batch.drop_finished()
    if not batch.rows:
        return None
    clock = batch.clock
    t0, f0 = clock(), _draft_forward_time(batch)
    view = batch.view()
    ks = policy.choose(view)                                     # 1. per-row draft depths (0 = none)
    budgets, proposed = batch.draft(view, ks, policy)            # 2. each paying source drafts
    ahead = [len(f) for f in batch.forced]                      #    grammar-forced tokens go ahead of each row's draft
    draft = batch.place(policy.size(proposed, clock() - t0, budgets))  # 3. cut + merged by cost, fit to the runtime, on the device
    policy.placed(draft, ahead)                                  #    the policy learns from the nodes placed alone
    t1 = clock()
    tokens, tree = batch.verify_input(draft)                     # 4. pending token + drafted nodes
    out = batch.runtime.forward(tokens, None if tree.is_chain else tree, want_hidden=batch.traits.want_hidden)
    t2 = clock()
    z = batch.process(out.logits, tokens, tree)                  # 5. sampling + processors per node
    verdict = batch.verify(draft, z)                             # 6. the only accept/reject code, one host read
    draft = batch.seen(draft)
    t3 = clock()
    keep = verdict.keep()
    batch.runtime.commit(keep)                                   # 7. KV of the accepted paths
    t4 = clock()
    emissions = batch.emit(verdict, keep, tokens, z, out.hidden)  # 8. EOS, limits, stop rules, logprobs
    times = RoundTimes(draft=t1 - t0, forward=t2 - t1, verify=t3 - t2, commit=t4 - t3, total=clock() - t0,
                       draft_forward=_draft_forward_time(batch) - f0)  # propose()'s; observe() adds its own
    record = RoundRecord(keys=batch.keys(), sequences=[r.tokens for r in batch.rows], budgets=budgets,
                         draft_keys=view.keys, draft=draft, accepted=verdict.accepted,
                         emitted=[e.tokens for e in emissions], emissions=emissions, positions=int(tokens.shape[1]),
                         target_logits=z, times=times, lossy=batch.lossy, tenants=[r.tenant for r in batch.rows],
                         fetched=batch.fetched, ahead=[len(f) for f in batch.forced])
    batch.observe(record)                                        # 9. proposer, stats, observers learn
    policy.observe(record)
    return record


def _draft_forward_time(batch: Batch) -> float:
    """The proposer's draft-model forward seconds so far, read around a round's drafting so the
    forwards ``propose()`` makes count in ``RoundTimes.draft_forward`` (0 without a proposer)."""
    return batch.proposer.draft_forward_time if batch.proposer is not None else 0.0


@dataclass
class Step:
    """Tokens emitted in one prefill/round, per original row index."""

    emitted: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # why a row finished with "error"

    @staticmethod
    def of(emissions: Sequence[Emission]) -> "Step":
        step = Step()
        for e in emissions:
            step.emitted[int(e.key)] = e.tokens  # type: ignore[call-overload]
            if e.finish_reason is not None:
                step.finished[int(e.key)] = e.finish_reason  # type: ignore[call-overload]
            if e.error:
                step.errors[int(e.key)] = e.error  # type: ignore[call-overload]
        return step


# stop(row_index, row_tokens, n_new) -> None to go on, or how many of the row's n_new newest tokens
# to keep (the row then finishes with reason "stop"); external stopping criteria (transformers')
StopFn = Callable[[int, Sequence[int], int], "int | None"]


def decode(
    target: Any,
    proposer: Any,
    verifier: Callable,
    pipeline: LogitsPipeline | Sequence[LogitsPipeline],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    eos_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    stats: DecodeStats | None = None,
    draft_length: DraftPolicy | LengthPolicy | None = None,
    processor_prefix: Sequence[Sequence[int]] | None = None,
    stop: StopFn | None = None,
    seeds: Sequence[int | None] | None = None,
    observers: Sequence[Any] = (),
    clock: Callable[[], float] = time.perf_counter,
    traits: ProposerTraits | None = None,
    grammars: Sequence[Any] | None = None,
    seed: int | None = None,
) -> Iterator[Step]:
    """A fixed batch: add every prompt, run rounds until no row is left; yields a Step per
    prefill/round. ``pipeline``: one for all rows or one per row; ``seeds[i]``: row i's own
    generator (None: the shared ``generator``, or lane i of ``seed`` where one is given: every row
    then draws as a seeded row, ``keyed_draws``); ``processor_prefix[i]``: tokens prepended to row
    i's sequence where its user processors see it (transformers' left pads); ``traits``: the
    pairing already checked (``wiring.wire``); ``grammars[i]``: row i's ``grammar.RowGrammar`` or None."""
    n = len(prompts)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    pipes = [pipeline] * n if isinstance(pipeline, LogitsPipeline) else list(pipeline)
    batch = Batch(target, proposer, verifier, eos_ids, seed=None, generator=generator, stats=stats,
                  observers=observers, clock=clock, traits=traits)  # generator None: torch's global RNG, as plain generate()
    own = [seeds[i] if seeds else None for i in range(n)]
    requests = [RowRequest(i, list(p), limits[i], seed=own[i] if own[i] is not None else seed,
                           lane=0 if own[i] is not None else i, pipeline=pipes[i],
                           prefix=processor_prefix[i] if processor_prefix else (), stop=_row_stop(stop, i),
                           grammar=grammars[i] if grammars else None)
                for i, p in enumerate(prompts)]
    if draft_length is None and proposer is not None:
        raise ValueError("decode() with a proposer needs its draft policy (policy.draft_policy.build_policy)")
    policy = DraftPolicy.of(draft_length) if draft_length is not None else build_policy(None, None)
    yield Step.of(batch.add(requests))
    while any(not r.done for r in batch.rows) and (record := run_round(batch, policy)) is not None:
        yield Step.of(record.emissions)
    # the runtime keeps the last rows (inspectable) until the next batch on it starts, which drops them


def _row_stop(stop: StopFn | None, i: int) -> Any:
    return None if stop is None else (lambda tokens, n, i=i: stop(i, tokens, n))
