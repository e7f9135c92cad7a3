"""The verifier over a batch's row groups, and the round's one read of the device.

Rows are verified in groups (greedy rows together, sampled rows by generator: each group's
verifier draws from its own generator). The groups' decisions are laid out over the whole batch
on the logits' device, and everything the host needs of the round is read in ONE copy
(``transfer.fetch``): the accepted paths, their tokens and the next tokens, the nodes each
row's path reads whose processed logits are no distribution (``failures``), the logprobs of the
emitted tokens for rows that ask, the draft's valid mask where only the device has it, and what
the proposer reads (``to_fetch``).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np
import torch

from spec_plugins.keyed_draws import KeyedDraws
from spec_plugins.loop.logprobs import emitted_logprobs
from spec_plugins.transfer import HOST, fetch, upload_tensor
from spec_plugins.row_trees import node_depths, rows_of
from spec_plugins.types import DeviceVerdict, Draft, Verdict


_KEYED = "keyed"  # the group of seeded rows drawing keyed samples (``keyed_draws``)
NO_DISTRIBUTION = "sampling failed: the processed logits are not finite (NaN, inf, or every token masked)"


def verify_groups(verifier: Callable, rows: Sequence[Any], draft: Draft | None, z: torch.Tensor,
                  generator_of: Callable[[Any], Hashable], point_masses: bool = True) -> DeviceVerdict:
    """The verifier on each group of rows (``generator_of(row)``: the group's key), its decisions
    laid out over the batch on the logits' device (no host read). Seeded rows of a proposer that
    drafts point masses (``point_masses``: every round, so a row draws one way throughout) are one
    group whose samples are keyed on their positions where the verifier takes that
    (``keyed_draws``): independent of the draft schedule and of the rows beside them."""
    B, dev = len(rows), z.device
    x = draft.tokens if draft is not None else torch.zeros(B, 0, dtype=torch.long, device=dev)
    parents = draft.parents if draft is not None else ()
    keyed = point_masses and takes_keyed_draws(verifier) and (draft is None or draft.probs is None)
    groups: dict[Hashable, list[int]] = {}
    for b, r in enumerate(rows):
        key = generator_of(r)
        groups.setdefault(_KEYED if keyed and r.seed is not None and key != "greedy" else key, []).append(b)
    parts = []
    for key, idx in groups.items():
        r0 = rows[idx[0]]
        sel: Any = slice(None) if len(groups) == 1 else upload_tensor(idx, dev)
        q = draft.probs[sel] if draft is not None and draft.probs is not None else None
        valid = draft.valid[sel] if draft is not None and draft.valid is not None else None
        gen = KeyedDraws(tuple(rows[b].seed for b in idx), tuple(len(rows[b].tokens) for b in idx)) \
            if key is _KEYED else r0.generator
        v = verifier(x[sel], rows_of(parents, sel), z[sel], q, r0.pipeline, gen, valid)
        parts.append((idx, v if isinstance(v, DeviceVerdict) else _on_device(v, x[sel].shape, dev)))
    if len(parts) == 1:
        return parts[0][1]
    path = torch.zeros(B, x.shape[1], dtype=torch.bool, device=dev)
    nxt = torch.zeros(B, dtype=torch.long, device=dev)
    for idx, v in parts:
        at = upload_tensor(idx, dev)
        path[at], nxt[at] = v.path, v.next
    return DeviceVerdict(path, nxt)


def takes_keyed_draws(verifier: Any) -> bool:
    """Whether the verifier's own class says it takes ``KeyedDraws`` for its generator: a subclass
    (a user's verifier drawing from ``generator`` itself) inherits no such promise."""
    return bool(type(verifier).__dict__.get("keyed_draws", False))


def _on_device(v: Verdict, shape: torch.Size, device: torch.device) -> DeviceVerdict:
    """A host verdict (a verifier written that way, in tests) as the device form the round reads."""
    path = torch.zeros(shape, dtype=torch.bool, device="cpu")
    for b, acc in enumerate(v.accepted):
        path[b, list(acc)] = True
    return DeviceVerdict(upload_tensor(path.tolist(), device, torch.bool), upload_tensor(list(v.next_tokens), device))


def read_round(verdict: DeviceVerdict, draft: Draft | None, z: torch.Tensor, bad: torch.Tensor,
               logits: torch.Tensor | None = None, top: int = 0, extra: dict[str, torch.Tensor] | None = None
               ) -> tuple[Verdict, dict[str, np.ndarray]]:
    """Everything the host needs of the round, in one read (module docstring). ``bad`` [B, 1 + n]:
    the nodes with no distribution that each row's verdict reads (``failures``); ``logits``: the
    raw logits, when some row reports logprobs (``top`` alternatives each); ``extra``: what the
    proposer's ``observe`` reads (``Proposer.to_fetch``)."""
    B, dev = bad.shape[0], z.device
    x = draft.tokens if draft is not None else torch.zeros(B, 0, dtype=torch.long, device=dev)
    reads = verdict.parts(x) | {"bad": bad}
    if logits is not None:
        depths = node_depths(draft.parents) if draft is not None else ()
        reads |= emitted_logprobs(logits, x, verdict.path, verdict.next, depths, top)
    if draft is not None and draft.valid is not None and draft.host_valid is None and draft.valid.device != HOST:
        reads["valid"] = draft.valid
    reads |= extra or {}
    host = fetch(reads)
    return Verdict.of(host), host


def broken_nodes(rows: Sequence[Any], z: torch.Tensor) -> torch.Tensor:
    """Nodes [B, 1 + n] whose processed logits ``z`` pick no token: NaN or every token masked, and
    for a sampled row +inf too (its softmax is NaN). A greedy row takes its argmax, the first +inf
    token where a processor forces one, as transformers' greedy ``generate()`` does."""
    top = z.amax(-1)  # NaN where any logit is NaN
    broken = top.isnan() | (top == float("-inf"))
    sampled = [not r.pipeline.greedy for r in rows]
    if any(sampled):
        inf = top == float("inf")
        if not all(sampled):
            inf &= upload_tensor(sampled, z.device, torch.bool)[:, None]
        broken |= inf
    return broken


def failures(verdict: Verdict, bad: np.ndarray, errors: Mapping[tuple[int, int], str]) -> dict[int, tuple[int, str]]:
    """The rows whose verdict reads a node with no distribution (``bad`` [B, 1 + n] on the host:
    the root, or a node on the accepted path), each as (k, error): plain decoding emits the k
    accepted tokens up to the first such node, then reaches it and fails there, with the error its
    processing raised (``errors``, by (row, node)) or as no distribution (``Row.emit`` keeps them)."""
    out = {}
    for b in np.flatnonzero(bad.any(-1)).tolist():
        n = int(np.flatnonzero(bad[b])[0])  # 0: the root; j + 1: drafted node j (a path's nodes in order)
        out[b] = (sum(1 for j in verdict.accepted[b] if j < n), errors.get((b, n), NO_DISTRIBUTION))
    return out
