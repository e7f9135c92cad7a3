"""Lookahead decoding (Fu et al., 2024), compacted to one target forward per round.

Lookahead runs two branches in one forward: a *lookahead* branch that refines a window of W
guessed future tokens by Jacobi iteration (every guess is re-predicted from the guesses before
it) and a *verification* branch that checks n-grams collected from the Jacobi trajectory.

Here both branches are draft nodes of one tree rooted at the pending token:

* the Jacobi window is a chain of W guesses for positions P+1..P+W (P = the pending token's
  position). The forward over that chain IS a Jacobi step: the target's argmax at the root and
  at each window node are the next iterate's guesses for positions P+1..P+W+1. Like any draft
  node, the window can itself be accepted when the iteration has converged;
* the verification branch is up to G candidates ``(c_1..c_{N-1})`` from the n-gram pool whose
  key is the pending token, merged into a trie with the window.

After the round, n-grams are read along the diagonals of the last N iterates (absolute
positions, so accepted tokens simply shift the window): the guess at position i of iterate s,
then i+1 of iterate s+1, ... each was predicted right after its predecessor, which is how
lookahead harvests plausible n-grams. The pool is also filled with the n-grams of the prompt and
the output (as the reference implementation does), most recent first, ``pool_size`` per key.
Positions past the previous iterate are filled with tokens drawn from the sequence (the paper
initialises guesses from the prompt), with a generator seeded from ``seed`` and the row's prompt
(``row_seed``), so runs are reproducible and a row's guesses do not depend on its batch neighbours.
Drafts are point masses depending only on the past, so the exact verifier applies unchanged.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict, deque
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, model_validator

from spec_plugins.config import ProposerConfig
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundRecord
from spec_plugins.registry import register_proposer
from spec_plugins.tree import merge_trees, ordinal_paths


class _RowState:
    """One row: its n-gram pool, Jacobi iterates (start position, guesses) and window node ids."""

    def __init__(self, n: int, pool_size: int, seed: int) -> None:
        self.n, self.pool_size = n, pool_size
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.iterates: deque[tuple[int, list[int]]] = deque(maxlen=n)  # the last N iterates
        self.seen = 0  # sequence tokens already scanned for n-grams
        self.window: list[int] = []  # window tokens of the current draft
        self.window_nodes: list[int] = []  # their node ids in this row's trie
        self.rng = random.Random(seed)

    def add(self, gram: Sequence[int]) -> None:
        key, cont = int(gram[0]), tuple(int(t) for t in gram[1:])
        slot = self.pool.setdefault(key, OrderedDict())
        slot.pop(cont, None)
        slot[cont] = None  # most recent last
        while len(slot) > self.pool_size:
            slot.popitem(last=False)

    def scan(self, seq: Sequence[int]) -> None:
        """Add the n-grams of the sequence completed since the last scan."""
        n = self.n
        for end in range(max(self.seen, n), len(seq) + 1):
            self.add(seq[end - n : end])
        self.seen = max(self.seen, len(seq))

    def candidates(self, key: int, g: int) -> list[tuple[int, ...]]:
        slot = self.pool.get(key)
        return list(reversed(slot))[:g] if slot else []

    def guess(self, pos: int, seq: Sequence[int]) -> int:
        """The latest iterate's guess for an absolute position, or a token drawn from the sequence."""
        if self.iterates:
            start, toks = self.iterates[-1]
            if start <= pos < start + len(toks):
                return toks[pos - start]
        return int(seq[self.rng.randrange(len(seq))])

    def harvest(self, start: int, new: list[int]) -> None:
        """Store a new iterate and add the n-grams ending in it along the diagonals."""
        self.iterates.append((start, new))
        its = list(self.iterates)
        n = self.n
        if len(its) < n:
            return
        for j, _ in enumerate(new):
            gram = []
            for lvl in range(n):  # iterate (len-n+lvl) at position (pos - (n-1) + lvl)
                s, toks = its[len(its) - n + lvl]
                i = start + j - (n - 1) + lvl - s
                if not 0 <= i < len(toks):
                    break
                gram.append(toks[i])
            if len(gram) == n:
                self.add(gram)


@register_proposer("lookahead")
class LookaheadProposer(Proposer):
    """Jacobi-window + n-gram-pool drafts in one tree (no model, no training)."""

    tree = True

    class Config(ProposerConfig):
        type: Literal["lookahead"] = "lookahead"
        num_draft_tokens: int | Literal["auto"] = Field(
            8, description="Depth limit of the draft tree (tokens that can be accepted per round).")
        window: int = Field(4, ge=1, le=32, description="W: Jacobi guesses refined per round (lookahead branch).")
        ngram: int = Field(4, ge=2, le=16, description="N: n-gram size; candidates draft N-1 tokens.")
        candidates: int = Field(3, ge=0, le=32, description="G: pool candidates verified per round.")
        pool_size: int = Field(8, ge=1, le=256, description="n-grams kept per key token (most recent).")
        seed: int = Field(0, description="Seed for the initial guesses drawn from the sequence (mixed with each row's prompt).")

        @model_validator(mode="after")
        def _check_window(self) -> LookaheadProposer.Config:
            """Refuse a ``window`` deeper than an integer ``num_draft_tokens``: the guesses past the
            depth limit would be drawn every round and thrown away. The default window is a cap (a
            smaller depth limit cuts it), also when a dumped config carries it back; ``auto`` and 0
            (no drafting asked) set no fixed limit."""
            k = self.num_draft_tokens
            default = type(self).model_fields["window"].default
            if self.window != default and isinstance(k, int) and 0 < k < self.window:
                raise ValueError(f"window={self.window} is deeper than num_draft_tokens={k} (the depth limit): "
                                 f"guesses past depth {k} would never be verified; set window <= {k} or "
                                 f"num_draft_tokens >= {self.window}")
            return self

    def __init__(self, config: "LookaheadProposer.Config | None" = None, **_: Any) -> None:
        self.config = config or self.Config()
        self.rows: list[_RowState] = []
        self._node_maps: list[list[int]] = []  # per row: own trie node -> node of the shared draft

    def _new_row(self, prompt: Sequence[int]) -> _RowState:
        c = self.config
        st = _RowState(c.ngram, c.pool_size, row_seed(c.seed, prompt))
        st.scan(prompt)
        return st

    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        self.rows.extend(self._new_row(p) for p in prompts)

    def select_rows(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def num_rows(self) -> int:
        return len(self.rows)

    def propose(self, ctx: ProposeContext) -> Draft | None:
        c = self.config
        if max(ctx.budgets, default=0) <= 0:
            return None
        trees = []
        for st, seq, budget in zip(self.rows, ctx.sequences, ctx.budgets):
            st.scan(seq)
            P = len(seq) - 1  # position of the pending token
            st.window = [st.guess(P + 1 + j, seq) for j in range(c.window)]
            chains = [list(g) for g in st.candidates(int(seq[-1]), c.candidates)]
            if not ctx.tree_ok:  # chain runtime: the best pool candidate, else the window
                toks, par, ends = _trie(chains[:1] or [st.window], [budget])
                st.window_nodes = [] if chains else ends[0]
            else:
                toks, par, ends = _trie([st.window] + chains, [budget] * (1 + len(chains)))
                st.window_nodes = ends[0]
            trees.append((toks, ordinal_paths(par)))
        merged = merge_trees(trees)
        self._node_maps = merged.index
        if merged.tokens.shape[1] == 0:
            return None
        return Draft(merged.tokens, merged.parents, None, merged.valid)

    def to_fetch(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """The Jacobi update reads the target's argmax at the root and every node."""
        return {"lookahead.argmax": z.argmax(-1)}

    def observe(self, result: RoundRecord) -> None:
        if result.draft is None:
            return
        top = result.fetched["lookahead.argmax"]  # [B, n+1] on the host (the round's one read)
        size = result.draft.size  # the verified draft: a shared pool (``loop.capacity``) may have cut it
        for b, (st, seq, em) in enumerate(zip(self.rows, result.sequences, result.emitted)):
            if not st.window_nodes:
                continue
            P = len(seq) - len(em) - 1  # the pending position when the draft was made
            drafted = _verified(self._node_maps[b], st.window_nodes, size)
            # guess for P+1 comes from the root; for P+2+j from window node j
            new = [int(top[b][0])] + [int(top[b][n + 1]) for n in drafted]
            st.harvest(P + 1, new)


def row_seed(seed: int, prompt: Sequence[int]) -> int:
    """A row's guess generator seed, from the configured seed and the row's own prompt: the same
    request draws the same guesses (and accepts as much) alone or in any batch, whatever rows were
    admitted before it. A stable digest of the ints (not ``hash()``, which varies per process)."""
    text = ",".join(str(int(t)) for t in (seed, *prompt))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _verified(node_map: Sequence[int], window_nodes: Sequence[int], size: int) -> list[int]:
    """The shared-draft nodes of the window's leading guesses that the forward scored. A cut keeps
    the first ``size`` nodes and the window is a chain (each node after its parent), so the scored
    ones are a prefix: the next iterate is the root's guess plus theirs, one per position."""
    out: list[int] = []
    for j in window_nodes:
        if node_map[j] >= size:
            break
        out.append(node_map[j])
    return out


def _trie(chains: Sequence[Sequence[int]], depth_caps: Sequence[int]):
    """Merge chains into a prefix tree; returns (tokens, parents, node ids per chain), each chain
    cut at its depth cap."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    ends: list[list[int]] = []
    for ci, ch in enumerate(chains):
        cap = depth_caps[ci]
        node, ids = -1, []
        for t in list(ch)[:cap]:
            key = (node, int(t))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(t))
                parents.append(node)
            node = index[key]
            ids.append(node)
        ends.append(ids)
    return tokens, tuple(parents), ends
