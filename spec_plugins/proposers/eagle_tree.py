"""EAGLE-2's dynamic draft tree, built and laid out on the drafter's device.

``expand`` grows the candidates as EAGLE-2 does: at each depth the ``top_k`` newest candidates
with the highest cumulative draft log-probability are expanded, each into its ``top_k`` best
children; every draft step has the same shape (``top_k`` new nodes per row), so it can be
compiled or captured. ``select`` lays each row's best candidates over a layered shape chosen on
the host, ``widths[d]`` slots at depth d: slot (d, r) holds the r-th best candidate at depth d
among the children of the candidates kept at depth d - 1 (a row's own parents: ``RowTrees``),
invalid where the row has none or its depth budget ends. Nothing is read back to the host.

What each slot is worth is the drafter's own estimate, its path probability; ``SlotMeans`` keeps
the running mean per (depth, rank) from the scores the round's one fetch reads, which is how the
host chooses the widths (the best slots by mean) and how the draft policy prices the slots
(``types.Shaped``), without reading the draft.

Where the drafter runs on the host, its candidates cost nothing to read, and each row's actual
scores price its tree better than running means: ``ranked_rows`` hands the policy each row's best
candidates with their own path probabilities (``types.Ranked``), for a cut by this round's data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from spec_plugins.transfer import upload_tensor
from spec_plugins.row_trees import RowTrees
from spec_plugins.types import Ranked, RankedRow

NEG = float("-inf")


@dataclass(frozen=True)
class Candidates:
    """Every candidate of the expansion, per row: tokens, cumulative draft log-probability, parent
    candidate (-1: child of the pending token); ``depth`` per candidate (the same in every row)."""

    tokens: torch.Tensor  # [B, C] long
    logp: torch.Tensor  # [B, C] float
    parent: torch.Tensor  # [B, C] long
    depth: tuple[int, ...]


def expand(step: Callable, head: Callable, f: torch.Tensor, base: torch.Tensor, depth: int, top_k: int,
           vocab: torch.Tensor) -> Candidates:
    """The candidates of a ``depth``-deep EAGLE-2 expansion from the predicted features ``f``
    [B, H] at positions ``base`` [B] (the pending token's). ``head(features) -> logits`` over the
    draft vocabulary ``vocab``; ``step(features, tokens, positions, ancestry) -> features`` feeds
    F new nodes per row (``ancestry`` [B, F, E]: which earlier draft slots each may see)."""
    B, kk, dev = f.shape[0], top_k, f.device
    top = head(f).float().log_softmax(-1).topk(kk, -1)
    tok, logp = vocab[top.indices], top.values  # [B, k]
    parent = torch.full((B, kk), -1, dtype=torch.long, device=dev)
    feat_of = f[:, None].expand(B, kk, -1)  # the feature each candidate's token was drawn from
    level = torch.arange(kk, device=dev).expand(B, kk)  # candidate ids of the newest depth
    dep = [0] * kk
    anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)  # [B, E, E] ancestry among expanded slots
    slot_of = torch.full((B, kk), -1, dtype=torch.long, device=dev)  # candidate -> draft slot once expanded
    rows = torch.arange(B, device=dev)[:, None]
    for d in range(1, depth):
        pick = level.gather(1, logp.gather(1, level).topk(kk, -1).indices)  # [B, k]: the expanded candidates
        E = anc.shape[1]
        par = parent.gather(1, pick)
        own = torch.zeros(B, kk, E, dtype=torch.bool, device=dev)
        if E:
            own = torch.where((par < 0)[..., None], own, anc[rows, slot_of.gather(1, par.clamp_min(0)).clamp_min(0)])
        out = step(feat_of[rows, pick], tok.gather(1, pick), base[:, None] + d - 1, own)
        eye = torch.eye(kk, dtype=torch.bool, device=dev).expand(B, kk, kk)
        anc = torch.cat([torch.cat([anc, torch.zeros(B, E, kk, dtype=torch.bool, device=dev)], -1),
                         torch.cat([own, eye], -1)], 1)
        slot_of = slot_of.scatter(1, pick, E + torch.arange(kk, device=dev).expand(B, kk))
        top = head(out).float().log_softmax(-1).topk(kk, -1)  # [B, k, k]: children of each expanded candidate
        tok, logp, parent, level = _grow(tok, logp, parent, pick, vocab[top.indices], top.values)
        feat_of = torch.cat([feat_of, out[:, :, None].expand(B, kk, kk, -1).reshape(B, kk * kk, -1)], 1)
        slot_of = torch.cat([slot_of, torch.full((B, kk * kk), -1, dtype=torch.long, device=dev)], 1)
        dep += [d] * (kk * kk)
    return Candidates(tok, logp, parent, tuple(dep))


def _grow(tok: torch.Tensor, logp: torch.Tensor, parent: torch.Tensor, pick: torch.Tensor, child_tok: torch.Tensor,
          child_logp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Append the children [B, k, k] (tokens, log-probabilities given their parent) of the k
    expanded candidates ``pick`` [B, k]; returns the grown (tokens, logp, parent) and the ids of
    the new level."""
    B, kk = pick.shape
    n0 = tok.shape[1]
    tok = torch.cat([tok, child_tok.reshape(B, kk * kk)], 1)
    logp = torch.cat([logp, (logp.gather(1, pick)[..., None] + child_logp).reshape(B, kk * kk)], 1)
    parent = torch.cat([parent, pick[..., None].expand(B, kk, kk).reshape(B, kk * kk)], 1)
    return tok, logp, parent, torch.arange(n0, n0 + kk * kk, device=tok.device).expand(B, kk * kk)


def marginal_candidates(logq: torch.Tensor, vocab: torch.Tensor, top_k: int) -> Candidates:
    """The candidates of a parallel draft: ``logq`` [B, D, Vd] holds one log-distribution per
    depth that does not depend on the path, so every expanded candidate at depth d - 1 gets the
    same ``top_k`` children, scored by the product of the marginals along its path (DDTree's
    best-first tree over per-position marginals, laid out as ``expand``'s so ``select`` and
    ``ranked_rows`` serve both)."""
    B, D, _ = logq.shape
    top = logq.float().topk(top_k, -1)  # [B, D, k]
    toks = vocab[top.indices]
    tok, logp = toks[:, 0], top.values[:, 0]
    parent = torch.full((B, top_k), -1, dtype=torch.long, device=logq.device)
    level = torch.arange(top_k, device=logq.device).expand(B, top_k)
    dep = [0] * top_k
    for d in range(1, D):
        pick = level.gather(1, logp.gather(1, level).topk(top_k, -1).indices)
        kids = (B, top_k, top_k)
        tok, logp, parent, level = _grow(tok, logp, parent, pick, toks[:, d, None].expand(kids),
                                         top.values[:, d, None].expand(kids))
        dep += [d] * (top_k * top_k)
    return Candidates(tok, logp, parent, tuple(dep))


def select(c: Candidates, widths: tuple[int, ...], budgets: list[int]
           ) -> tuple[torch.Tensor, RowTrees, torch.Tensor, torch.Tensor]:
    """Each row's candidates over the layered shape ``widths`` (module docstring): tokens [B, S],
    parents, valid [B, S] and each slot's path probability [B, S] (0 where invalid)."""
    B, dev = c.tokens.shape[0], c.tokens.device
    budget = upload_tensor(budgets, dev)[:, None]
    kept = torch.zeros(B, c.tokens.shape[1], dtype=torch.bool, device=dev)  # candidates kept so far
    slot_of = torch.full((B, c.tokens.shape[1]), -1, dtype=torch.long, device=dev)
    toks, pars, oks, probs, depth = [], [], [], [], []
    start = 0
    for d, w in enumerate(widths):
        ids = [j for j, dj in enumerate(c.depth) if dj == d]
        if not w or not ids:
            continue
        at = upload_tensor(ids, dev)
        par = c.parent[:, at]
        ok = par.lt(0) | kept.gather(1, par.clamp_min(0))  # a child of a kept candidate (or of the root)
        ok &= d < budget
        key = torch.where(ok, c.logp[:, at], NEG)
        top = key.topk(min(w, len(ids)), -1)
        chosen = at[top.indices]  # [B, w]: candidate ids, best first
        valid = top.values > NEG
        kept = kept.scatter(1, chosen, valid)
        slot_of = slot_of.scatter(1, chosen, start + torch.arange(chosen.shape[1], device=dev).expand_as(chosen))
        cp = c.parent.gather(1, chosen)
        toks.append(c.tokens.gather(1, chosen))
        pars.append(torch.where(cp < 0, -1, slot_of.gather(1, cp.clamp_min(0))))
        oks.append(valid)
        probs.append(torch.where(valid, top.values.exp(), 0.0))
        depth += [d] * chosen.shape[1]
        start += chosen.shape[1]
    return (torch.cat(toks, 1), RowTrees(torch.cat(pars, 1), tuple(depth)), torch.cat(oks, 1), torch.cat(probs, 1))


def ranked_rows(c: Candidates, nodes: int, budgets: list[int], auto: bool) -> Ranked:
    """Each row's ``nodes`` best candidates within its depth budget, best-first (a child never
    scores above its parent, so every prefix is a tree), with their path probabilities: read
    from candidates that live on the host (module docstring). Ties favour shallower nodes; a
    candidate scored NaN or +inf (a broken or overflowing drafter) is never drafted."""
    from spec_plugins.tree import rank_paths

    C = c.tokens.shape[1]
    depth = torch.tensor(c.depth, device=c.logp.device)
    key = (c.logp - 1e-6 * depth[None]).masked_fill(depth[None] >= torch.tensor(budgets, device=c.logp.device)[:, None],
                                                     NEG)
    key = key.nan_to_num(nan=NEG, posinf=NEG, neginf=NEG)  # a broken drafter's NaN scores draft nothing (topk ranks NaN first)
    keep = key.topk(min(nodes, C), -1)
    rank = [j if d == 0 else (j - c.depth.index(d)) % _width0(c) for j, d in enumerate(c.depth)]
    parent, tok, logp = c.parent.tolist(), c.tokens.tolist(), c.logp.tolist()
    rows = []
    for b, (idx, val) in enumerate(zip(keep.indices.tolist(), keep.values.tolist())):
        cand = [n for n, v in zip(idx, val) if v != NEG]
        rows.append([RankedRow([tok[b][n] for n in cand], rank_paths(parent[b], rank, cand),
                               [min(1.0, math.exp(logp[b][n])) for n in cand])])
    return Ranked(rows, auto=auto)


def _width0(c: Candidates) -> int:
    """Children per expanded candidate (the expansion's top_k): the depth-0 candidates."""
    return sum(1 for d in c.depth if d == 0)


class SlotMeans:
    """Running mean of the drafter's path probability per (depth, rank) slot (module docstring).
    Starts from a prior that halves per depth and per rank; unseen slots keep it."""

    def __init__(self, top_k: int, decay: float = 0.9, prior: float = 0.5) -> None:
        self.top_k, self.decay, self.prior = top_k, decay, prior
        self.means: dict[tuple[int, int], float] = {}

    def mean(self, d: int, r: int) -> float:
        """The slot's estimate: its running mean, capped by every better-ranked slot at its depth and
        the best slot of each shallower depth. In every row a slot's path probability is at most
        those (its parent's is at most the best one a depth up), but each slot's mean is over the
        rows that reached it (a short budget stops at depth 0) or is still its prior, so the raw
        means can rise along a path; capped, a slot never outranks the slots above it."""
        return min([self._raw(k, 0) for k in range(d)] + [self._raw(d, q) for q in range(r + 1)])

    def _raw(self, d: int, r: int) -> float:
        return self.means.get((d, r), self.prior * 0.5 ** (d + r))

    def widths(self, nodes: int, depth: int) -> tuple[int, ...]:
        """Slots per depth of the ``nodes`` best (depth, rank) slots by their means (a depth has
        at most top_k candidates at depth 0 and top_k^2 below)."""
        grid = [(self.mean(d, r), -d, -r, d) for d in range(depth) for r in range(self.top_k * (self.top_k if d else 1))]
        out = [0] * depth
        for *_, d in sorted(grid, reverse=True)[:nodes]:
            out[d] += 1
        while out and not out[-1]:
            out.pop()
        return tuple(out)

    def estimates(self, widths: tuple[int, ...]) -> tuple[float, ...]:
        """Each slot's mean, in slot order (depth by depth)."""
        return tuple(self.mean(d, r) for d, w in enumerate(widths) for r in range(w))

    def observe(self, probs: np.ndarray, widths: tuple[int, ...]) -> None:
        """The slots' path probabilities of one round, [B, S] (0: invalid: not counted)."""
        at = 0
        for d, w in enumerate(widths):
            for r in range(w):
                col = probs[:, at]
                col = col[col > 0]
                if col.size:
                    old = self._raw(d, r)
                    self.means[(d, r)] = self.decay * old + (1 - self.decay) * float(col.mean())
                at += 1
