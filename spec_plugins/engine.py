"""The decode loop: prefill, then rounds of propose -> one target forward -> verify -> commit.

Batched from the start: each row accepts its own number of tokens per round, and rows that
finish leave the batch (runtime and proposer both drop them). The loop yields, per round,
the tokens each row emitted, so ``generate``, streaming and servers are thin layers on top.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from spec_plugins.backends.base import Runtime
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundResult
from spec_plugins.sampling import LogitsPipeline, sample
from spec_plugins.stats import DecodeStats
from spec_plugins.tree import layout, with_root


@dataclass
class Row:
    """One sequence being decoded. ``tokens[-1]`` is pending (emitted, not yet cached)."""

    tokens: list[int]
    prompt_len: int
    max_new: int
    done: bool = False
    finish_reason: str | None = None

    @property
    def new(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class Step:
    """Tokens emitted in one step, per original row index."""

    emitted: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)


# policy(stats) -> draft length for this round. A policy may also offer per_row(stats, keys) ->
# lengths and observe_rows(keys, budgets, drafted, accepted) (``adaptive.AutoDraftLength``); the
# loop then uses them with chain proposers whose draft_keys() classes each row's round
DraftLengthPolicy = Callable[[DecodeStats], int]
# stop(row_index, row_tokens, n_new) -> None to go on, or how many of the row's n_new newest tokens
# to keep (the row then finishes with reason "stop"); external stopping criteria (transformers')
StopFn = Callable[[int, Sequence[int], int], "int | None"]


def fixed_length(k: int) -> DraftLengthPolicy:
    return lambda stats: k


def decode(
    target: Runtime,
    proposer: Proposer | None,
    verifier: Callable,
    pipeline: LogitsPipeline,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    eos_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    stats: DecodeStats | None = None,
    draft_length: DraftLengthPolicy = fixed_length(5),
    processor_prefix: Sequence[Sequence[int]] | None = None,
    stop: StopFn | None = None,
) -> Iterator[Step]:
    """Generate for a batch of token-id prompts; yields a Step per prefill/round.

    ``processor_prefix[i]``: tokens prepended to row i's sequence where the target's user
    processors see it (e.g. transformers' left pads), never fed to a model. ``stop``: see StopFn."""
    stats = stats if stats is not None else DecodeStats()
    stats.lossy = bool(getattr(verifier, "lossy", False))
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= target.max_context:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the context holds {target.max_context}")
        if limits[i] < 0:
            raise ValueError("max_new_tokens must be >= 0")
    rows = [Row(list(p), len(p), min(m, target.max_context - len(p))) for p, m in zip(prompts, limits)]
    eos = set(int(e) for e in eos_ids)
    active = [i for i, r in enumerate(rows) if r.max_new > 0]
    for i, r in enumerate(rows):
        if r.max_new == 0:
            r.done, r.finish_reason = True, "length"
    if not active:
        return
    want_hidden = bool(proposer is not None and proposer.needs_hidden)
    # per-row draft lengths: a policy with per_row() and a chain proposer that classes its rows
    per_row = bool(proposer is not None and not proposer.tree and hasattr(draft_length, "per_row"))
    t_start = time.perf_counter()

    # 1. prefill: the first token comes from the prompt's last position
    t0 = time.perf_counter()
    out = target.prefill([rows[i].tokens for i in active], want_hidden=want_hidden)
    stats.time_prefill += time.perf_counter() - t0
    stats.prefill_forwards += 1
    t0 = time.perf_counter()
    seqs = [rows[i].tokens for i in active]
    z = pipeline.process_tree(out.logits[:, -1:], _seen(seqs, active, processor_prefix, pipeline),
                              torch.tensor([[s[-1]] for s in seqs]), (-1,))[:, 0]
    first = z.argmax(-1) if pipeline.greedy else sample(z.float().softmax(-1), generator)
    stats.time_verify += time.perf_counter() - t0
    hidden = [out.hidden[b] for b in range(len(active))] if out.hidden is not None else None
    if proposer is not None:
        t0 = time.perf_counter()
        proposer.begin([rows[i].tokens for i in active])
        stats.time_draft += time.perf_counter() - t0
    step = Step()
    for b, i in enumerate(active):
        _emit(rows[i], [int(first[b])], eos, step, i, stop)
    stats.new_tokens += len(active)
    yield step
    stats.time_total += time.perf_counter() - t_start

    # 2. rounds
    while True:
        t_round = time.perf_counter()
        keep_rows = [b for b, i in enumerate(active) if not rows[i].done]
        if len(keep_rows) < len(active):
            if not keep_rows:
                break
            target.select_rows(keep_rows)
            if proposer is not None:
                proposer.select_rows(keep_rows)
            if hidden is not None:
                hidden = [hidden[b] for b in keep_rows]
            active = [active[b] for b in keep_rows]
        seqs = [rows[i].tokens for i in active]
        # 2a. draft
        draft: Draft | None = None
        keys: list[int] | None = None
        if proposer is not None:
            t0 = time.perf_counter()
            if per_row:  # the policy picks a length per row from the proposer's cheap row keys
                keys = proposer.draft_keys(seqs)
            stats.time_draft += time.perf_counter() - t0
            ks = draft_length.per_row(stats, keys) if keys is not None else [draft_length(stats)] * len(active)
            if keys is not None and hasattr(draft_length, "shadow") and 0 in ks:
                t0 = time.perf_counter()
                free = proposer.free_drafts(seqs, draft_length.max_k)
                if free is not None:  # counterfactual evidence for rows that do not draft this round
                    idle = [b for b, k in enumerate(ks) if k == 0]
                    draft_length.shadow([keys[b] for b in idle], [seqs[b] for b in idle], [free[b] for b in idle])
                stats.time_draft += time.perf_counter() - t0
            budgets = [max(0, min(k, rows[i].max_new - len(rows[i].new) - 1)) for k, i in zip(ks, active)]
            if max(budgets) > 0:
                t0 = time.perf_counter()
                fwd0 = proposer.draft_forward_time
                ctx = ProposeContext(seqs, budgets, pipeline, generator, target.capabilities.tree_mask, hidden)
                draft = proposer.propose(ctx)
                stats.time_draft += time.perf_counter() - t0
                stats.time_draft_forward += proposer.draft_forward_time - fwd0
        parents = draft.parents if draft is not None else ()
        pending = torch.tensor([[s[-1]] for s in seqs], dtype=torch.long)
        tokens = torch.cat([pending, draft.tokens.cpu()], 1) if draft is not None else pending
        full = layout(with_root(parents))
        # 2b. one target forward over the root and every drafted node
        t0 = time.perf_counter()
        out = target.forward(tokens, tree=None if full.is_chain else full, want_hidden=want_hidden)
        stats.time_target_forward += time.perf_counter() - t0
        stats.target_forwards += 1
        stats.verify_positions += tokens.shape[1]
        # 2c. process logits with per-node prefixes, then accept/reject
        t0 = time.perf_counter()
        z = pipeline.process_tree(out.logits, _seen(seqs, active, processor_prefix, pipeline), tokens, full.parents)
        if draft is not None:
            verdict = verifier(draft.tokens.cpu(), parents, z, draft.probs, pipeline, generator, draft.valid)
        else:
            nxt = z[:, 0].argmax(-1) if pipeline.greedy else sample(z[:, 0].float().softmax(-1), generator)
            from spec_plugins.verify import Verdict

            verdict = Verdict([[] for _ in active], nxt.tolist())
        stats.time_verify += time.perf_counter() - t0
        # 2d. commit the accepted path in the target cache, emit tokens
        t0 = time.perf_counter()
        keep = verdict.keep()
        target.commit(keep)
        stats.time_cache += time.perf_counter() - t0
        step = Step()
        emitted_rows = []
        depth_count = _depth_counts(draft) if draft is not None else []
        for b, i in enumerate(active):
            acc = verdict.accepted[b]
            toks = [int(tokens[b, j + 1]) for j in acc] + [verdict.next_tokens[b]]
            n_emit = _emit(rows[i], toks, eos, step, i, stop)
            emitted_rows.append(toks[:n_emit])
            row_drafted = depth_count if draft is None or draft.valid is None else _depth_counts(draft, b)
            stats.observe_round(row_drafted, len(acc), n_emit)
            stats.new_tokens += n_emit
        if keys is not None:
            drafted_n = draft.row_sizes() if draft is not None else [0] * len(active)
            draft_length.observe_rows(keys, budgets, drafted_n, [len(a) for a in verdict.accepted])
        if out.hidden is not None:
            hidden = [out.hidden[b, k] for b, k in enumerate(keep)]
        # 2e. let the proposer learn / roll back its own cache
        if proposer is not None:
            t0 = time.perf_counter()
            fwd0 = proposer.draft_forward_time
            proposer.observe(RoundResult(draft, verdict.accepted, emitted_rows, [rows[i].tokens for i in active], z))
            stats.time_draft += time.perf_counter() - t0
            stats.time_draft_forward += proposer.draft_forward_time - fwd0
        stats.time_total += time.perf_counter() - t_round
        yield step


def _seen(seqs: list[list[int]], active: list[int], prefix: Sequence[Sequence[int]] | None,
          pipeline: LogitsPipeline) -> list[list[int]]:
    """The sequences the target's user processors see: ``prefix[i]`` + row i's tokens."""
    if prefix is None or not pipeline.needs_prefix:
        return seqs
    return [list(prefix[i]) + s for i, s in zip(active, seqs)]


def _emit(row: Row, toks: list[int], eos: set[int], step: Step, i: int, stop: StopFn | None = None) -> int:
    """Append tokens to a row, stopping at EOS, the row's limit or ``stop``; returns how many."""
    room = row.max_new - len(row.new)
    out = []
    for t in toks[:room]:
        out.append(t)
        if t in eos:
            row.done, row.finish_reason = True, "eos_token"
            break
    row.tokens.extend(out)
    if stop is not None and out:
        keep = stop(i, row.tokens, len(out))
        if keep is not None:
            del row.tokens[len(row.tokens) - len(out) + keep :]
            out = out[:keep]
            row.done, row.finish_reason = True, "stop"
    if not row.done and len(row.new) >= row.max_new:
        row.done, row.finish_reason = True, "length"
    step.emitted[i] = out
    if row.done:
        step.finished[i] = row.finish_reason or "length"
    return len(out)


def _depth_counts(draft: Draft, row: int | None = None) -> list[int]:
    lay = layout(draft.parents)
    depth = lay.depth
    if row is not None and draft.valid is not None:
        depth = depth[draft.valid[row].cpu()]
    if depth.numel() == 0:
        return []
    return torch.bincount(depth).tolist()
