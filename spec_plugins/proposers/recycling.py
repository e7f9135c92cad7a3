"""Token recycling (Luo et al., 2024): the target's own top-k candidates, kept for reuse.

Every verify pass scores the pending token and every drafted node; the top-k of each of those
distributions are the tokens most likely to follow that node's token. They are "recycled" into
an adjacency table ``M[token] -> k successor candidates`` (the latest observation wins, as in the
paper). With ``keep_table`` (the default) one table is shared by all rows and kept across
generations (hot start); without it each row has a table of its own, filled only from its own
request's verify passes and dropped when the row leaves, so no request drafts from what another
produced. A draft is a static tree grown from the pending token by breadth-first lookups: node
``(r1, r2)`` is ``M[M[pending][r1]][r2]``. No model, no training; drafts are point masses, so
the exact verifier needs no ``q``. Nodes whose lookup is missing (a token never scored yet) are
marked invalid.

The tree's shape is ``best_static_tree`` over per-(depth, rank) acceptance priors. Its size is
``tree_size`` nodes, or with ``tree_size: auto`` a cut the draft policy makes every round: the
proposer offers the 32-node tree best-first with each node's prior (the product of the priors
along its path) and the policy's tree sizer keeps what pays against the runtime's forward costs,
its calibration correcting the priors online.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from pydantic import Field, model_validator

from spec_plugins.config import ProposerConfig
from spec_plugins.policy.tree_size import MAX_AUTO_NODES
from spec_plugins.proposers.base import Draft, ProposeContext, Proposer, RoundRecord
from spec_plugins.registry import register_proposer
from spec_plugins.tree import StaticTree, best_static_tree, path_scores, static_tree
from spec_plugins.transfer import upload, upload_tensor
from spec_plugins.types import Ranked, Shaped

# P(rank-r successor is the target's token | parent accepted), per depth, for shaping and sizing
# the static tree (depth 0, then every deeper depth): acceptance rates read with ``rank_stats``
# on a default-size tree; ranks that tree did not hold are extrapolated downwards.
DEFAULT_ACCEPT: tuple[tuple[float, ...], ...] = (
    (0.29, 0.11, 0.045, 0.03, 0.02, 0.015, 0.01, 0.01),
    (0.55, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01),
)
PRIOR_RANKS = len(DEFAULT_ACCEPT[0])  # ranks with a prior: a shaped tree never holds a deeper rank
AUTO_DEPTH = 6  # the depth limit of the shaped tree when num_draft_tokens is 'auto'


@register_proposer("recycling")
class RecyclingProposer(Proposer):
    """Static draft trees read from an adjacency table of the target's recent top-k tokens."""

    tree = True

    class Config(ProposerConfig):
        type: Literal["recycling"] = "recycling"
        num_draft_tokens: int | Literal["auto"] = Field(
            6, description="Depth limit of the draft tree (tokens that can be accepted per round).")
        tree_size: int | Literal["auto"] = Field(
            12, description="Draft nodes per round; 'auto' sizes the tree from the cost model of the runtime.")
        candidates: int = Field(8, ge=1, le=64, description="Successor candidates kept per token (k of top-k).")
        paths: list[list[int]] | None = Field(
            None, description="Explicit static tree as Medusa-style rank paths (overrides tree_size).")
        keep_table: bool = Field(True, description="One adjacency table shared by every request and kept across "
                                 "generations (hot start); false: a table per request, from its own output alone.")

        @property
        def auto_tree(self) -> bool:
            return self.tree_size == "auto" and self.paths is None

        @model_validator(mode="after")
        def _check(self) -> "RecyclingProposer.Config":
            if self.tree_size != "auto" and not (1 <= self.tree_size <= 128):
                raise ValueError(f"tree_size must be 'auto' or 1..128, got {self.tree_size}")
            if self.paths is not None:
                if not self.paths:
                    raise ValueError("paths is empty: give at least one rank path (e.g. [[0], [0, 0]]), or leave "
                                     "paths out to shape the tree by tree_size")
                tree = static_tree(self.paths)  # raises on malformed paths
                if max(tree.ranks) >= self.candidates:
                    raise ValueError(f"paths use rank {max(tree.ranks)} but candidates={self.candidates}")
                _check_paths_depth(tree.depth, self.num_draft_tokens)
            elif self.tree_size not in ("auto", type(self).model_fields["tree_size"].default):
                # the default is a cap, also when a dumped config carries it back
                _check_reachable(self.tree_size, self.candidates, self.num_draft_tokens)
            return self

    @classmethod
    def ranks_with(cls, config: "RecyclingProposer.Config") -> bool:
        """Only ``tree_size: auto`` offers ranked slots for the policy to cut; a fixed tree (a size
        or ``paths``) is verified whole, as a plain ``Draft``."""
        return config.auto_tree

    def __init__(self, config: "RecyclingProposer.Config | None" = None, target: Any = None, **_: object) -> None:
        self.config = config or self.Config()
        self._rows = 0  # rows in the batch
        self.vocab_size: int | None = getattr(target, "vocab_size", None)
        # int32 token ids, -1 = unknown; keep_table: [V + 1, k], shared; otherwise [slabs, V + 1, k],
        # a slab per row
        self.table: torch.Tensor | None = None
        self._slabs: list[int] = []  # without keep_table: each row's slab of the table
        self._spare: list[int] = []  # slabs of rows that left, to hand to rows that join
        self.auto = self.config.auto_tree  # the policy cuts the tree every round
        self.ranks = self.ranks_with(self.config)
        self.shape = self._shape()
        self._layers = _layers(self.shape)
        # 'auto': each node's prior (the product of the priors along its path: a child never scores
        # above its parent, so the policy's best-first cut keeps ancestors)
        self._prior = tuple(path_scores(self.shape, DEFAULT_ACCEPT))
        # (depth, rank) -> [times reachable, times accepted]: acceptance statistics of the shape
        self.rank_stats: dict[tuple[int, int], list[int]] = {}

    def forget(self) -> None:
        """Drop the cross-request memory (``Remembers``): the table every row and request shares
        (``keep_table``) and the rank statistics read on it, so the next request starts cold, as
        on a fresh proposer (the bench's independent requests; a tenant's reset). Per-row tables
        are the rows' own state and stay."""
        if self.config.keep_table:
            self.table = None
        self.rank_stats = {}

    def _shape(self) -> StaticTree:
        c = self.config
        if c.paths is not None:
            return static_tree(c.paths)
        size = MAX_AUTO_NODES if self.auto else int(c.tree_size)
        return best_static_tree(DEFAULT_ACCEPT, size, _depth(c.num_draft_tokens), max_rank=c.candidates)

    # ---- table --------------------------------------------------------------------------------
    def _ensure_table(self, vocab: int, device: torch.device) -> torch.Tensor:
        """The table lives where the target's logits are: recycling them is then a device scatter.
        Row ``vocab`` is scratch: writes of invalid nodes land there (no data-dependent shapes).
        Token ids are int32 (half of int64's memory; any vocabulary fits), read back as int64."""
        t, slabs = self.table, () if self.config.keep_table else (self._capacity(),)
        if t is None or t.shape[-2] < vocab + 1 or t.device != device or t.shape[:-2] != slabs:
            self.table = torch.full((*slabs, vocab + 1, self.config.candidates), -1, dtype=torch.int32, device=device)
        return self.table

    def _capacity(self) -> int:
        """Slabs the per-row table holds: one per slab id handed out (at least one)."""
        return max(1, len(self._slabs) + len(self._spare))

    def _views(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table as [slabs, V + 1, k] and each row's slab [rows, 1]: slab 0 for every row when
        the table is shared, the row's own otherwise."""
        assert self.table is not None
        if self.config.keep_table:
            return self.table[None], torch.zeros(rows, 1, dtype=torch.long, device=device)
        if len(self._slabs) != rows:
            raise RuntimeError(f"recycling with keep_table: false follows its rows: {rows} rows given but "
                               f"{len(self._slabs)} admitted (admit them first)")
        return self.table, upload_tensor(self._slabs, device)[:, None]

    def update(self, tokens: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Recycle: ``M[tokens[b, i]] <- top-k of logits[b, i]`` (tokens [B, N], logits [B, N, V]),
        into row b's slab (the shared table with ``keep_table``)."""
        table = self._ensure_table(logits.shape[-1], logits.device)
        tables, slab = self._views(tokens.shape[0], table.device)
        k = min(self.config.candidates, logits.shape[-1])
        top = logits.topk(k, dim=-1)
        idx = top.indices.masked_fill(top.values == float("-inf"), -1)  # banned tokens are not candidates
        toks = tokens.to(table.device)
        if valid is not None:
            toks = torch.where(valid.to(table.device), toks, table.shape[-2] - 1)
        tables[slab.expand_as(toks).reshape(-1), toks.reshape(-1), :k] = idx.reshape(-1, k).to(table.dtype)

    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        """With ``keep_table`` rows need no state of their own (the table is shared). Without it
        each new row gets an empty slab: one a row that left held (cleared), or a new one."""
        self._rows += len(prompts)
        if self.config.keep_table:
            return
        for _ in prompts:
            s = self._spare.pop() if self._spare else len(self._slabs) + len(self._spare)
            self._slabs.append(s)
            if self.table is not None and s < self.table.shape[0]:
                self.table[s].fill_(-1)
        if self.table is not None and self.table.shape[0] < self._capacity():
            self._grow()

    def _grow(self) -> None:
        """Add empty slabs to the per-row table, doubling it, so rows joining one by one copy it
        amortised O(1) times each (the copy briefly holds the old table beside the new one)."""
        t = self.table
        assert t is not None
        self.table = t.new_full((max(self._capacity(), 2 * t.shape[0]), *t.shape[1:]), -1)
        self.table[:t.shape[0]] = t
        self._spare.extend(range(len(self._slabs) + len(self._spare), self.table.shape[0]))

    def _shrink(self) -> None:
        """Halve the per-row table (at least) once its rows hold under a quarter of its slabs, so
        it follows the rows running now, not their peak: the rows' slabs are renumbered 0..n-1,
        each row's table copied along, and room is kept for as many rows again (no regrow at once)."""
        n, size = len(self._slabs), self._capacity()
        if 4 * n >= size:
            return
        t = self.table
        if t is not None:
            self.table = t.new_full((2 * n, *t.shape[1:]), -1)
            torch.index_select(t, 0, upload_tensor(self._slabs, t.device), out=self.table[:n])
        self._slabs, self._spare = list(range(n)), list(range(n, 2 * n))

    def select_rows(self, rows: Sequence[int]) -> None:
        self._rows = len(rows)
        if self.config.keep_table:
            return
        kept = [self._slabs[r] for r in rows]
        self._spare.extend(set(self._slabs) - set(kept))
        self._slabs = kept
        if not kept:  # an empty batch frees the per-row tables' memory
            self.table, self._spare = None, []
        else:
            self._shrink()

    def num_rows(self) -> int:
        return self._rows

    # ---- draft --------------------------------------------------------------------------------
    def propose(self, ctx: ProposeContext) -> Draft | Ranked | None:
        """The static tree filled from the table, breadth-first, on the table's device (nothing is
        read back: a node whose lookup is missing is marked invalid); with ``tree_size: auto`` a
        shaped draft with each node's prior, for the draft policy to cut."""
        if self.table is None or max(ctx.budgets, default=0) <= 0 or self.shape.size == 0:
            return None
        B, n, dev = len(ctx.sequences), self.shape.size, self.table.device
        tables, slab = self._views(B, dev)
        pending = upload_tensor([s[-1] for s in ctx.sequences], dev)
        budget = upload_tensor(list(ctx.budgets), dev)
        toks = torch.zeros(B, n, dtype=torch.long, device=dev)
        ok = torch.zeros(B, n, dtype=torch.bool, device=dev)
        for depth, (nodes, parents, ranks) in enumerate(self._layers_on(dev)):  # breadth-first, a gather per depth
            if parents is None:
                src, src_ok = pending[:, None].expand(B, len(nodes)), torch.ones(B, len(nodes), dtype=torch.bool,
                                                                                  device=dev)
            else:
                src, src_ok = toks[:, parents], ok[:, parents]
            cand = tables[slab, src, ranks.expand(B, -1)].long()
            ok[:, nodes] = src_ok & (cand >= 0) & (depth < budget)[:, None]
            toks[:, nodes] = cand.clamp_min(0)
        draft = Draft(toks, self.shape.parents, None, ok)
        return Ranked([[] for _ in range(B)], True, [Shaped(draft, self._prior)]) if self.auto else draft

    def observe(self, result: RoundRecord) -> None:
        z = result.target_logits
        if z is None:
            return
        roots = [seq[len(seq) - len(em) - 1] for seq, em in zip(result.sequences, result.emitted)]
        root = upload_tensor(roots, z.device)[:, None]
        d = result.draft
        if d is None or d.size == 0:
            self.update(root, z[:, :1])
            return
        tokens = torch.cat([root, d.tokens.to(z.device)], 1)
        valid = None
        if d.valid is not None:
            valid = torch.cat([torch.ones(len(roots), 1, dtype=torch.bool, device=z.device), d.valid.to(z.device)], 1)
        self.update(tokens, z, valid)
        if d.parents == self.shape.parents:
            self._count(result.accepted, d.valid_on_host())

    def _layers_on(self, device: torch.device) -> list:
        """The per-depth index tensors on ``device`` (moved once, not every round)."""
        if self._layers[0][0].device != device:
            self._layers = [tuple(None if t is None else upload(t, device) for t in lay) for lay in self._layers]
        return self._layers

    def _count(self, accepted: Sequence[Sequence[int]], valid: torch.Tensor | None) -> None:
        """Per (depth, rank): how often a node was reachable (parent accepted) and accepted."""
        paths, parents = self.shape.paths, self.shape.parents
        ok = valid.tolist() if valid is not None else None  # host data: the round's one fetch read it
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)
        for b, acc in enumerate(accepted):
            for parent in [-1] + list(acc):
                for c in kids.get(parent, []):
                    if ok is not None and not ok[b][c]:
                        continue
                    key = (len(paths[c]) - 1, paths[c][-1])
                    cell = self.rank_stats.setdefault(key, [0, 0])
                    cell[0] += 1
                    cell[1] += int(c in acc)


def _depth(num_draft_tokens: int | str) -> int:
    """The depth limit of the shaped tree."""
    return num_draft_tokens if isinstance(num_draft_tokens, int) else AUTO_DEPTH


def _check_reachable(tree_size: int, candidates: int, num_draft_tokens: int | str) -> None:
    """Refuse a fixed ``tree_size`` the shaped tree cannot hold: it has at most min(candidates,
    PRIOR_RANKS) children per node and ``num_draft_tokens`` levels, and a smaller tree would be
    drafted without a word. Depth 0 (no drafting asked) drafts nothing whatever the size."""
    depth = _depth(num_draft_tokens)
    if depth == 0:
        return
    most = best_static_tree(DEFAULT_ACCEPT, tree_size, depth, max_rank=candidates).size  # short only when exhausted
    if most < tree_size:
        raise ValueError(
            f"tree_size={tree_size} cannot be reached: with candidates={candidates} and num_draft_tokens="
            f"{num_draft_tokens} (depth {depth}) the tree holds at most {most} nodes (up to {PRIOR_RANKS} "
            f"ranks per node: ranks from {PRIOR_RANKS} on have no acceptance prior); set tree_size <= {most}, "
            "or raise num_draft_tokens or candidates")


def _check_paths_depth(depth: int, num_draft_tokens: int | str) -> None:
    """Refuse ``paths`` deeper than an integer ``num_draft_tokens``: every forward would verify
    nodes below the depth limit, which can never be accepted. ``auto`` (the policy's budget) and
    0 (no drafting asked) are not a fixed limit to check against."""
    if isinstance(num_draft_tokens, int) and 0 < num_draft_tokens < depth:
        raise ValueError(
            f"paths are {depth} deep but num_draft_tokens={num_draft_tokens} (the depth limit): nodes deeper than "
            f"{num_draft_tokens} would be verified every round and never accepted; shorten the paths to at most "
            f"{num_draft_tokens} ranks or set num_draft_tokens >= {depth}")


def _layers(tree: StaticTree) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """Per depth: node ids, their parents' ids (None at depth 0) and their ranks."""
    out = []
    for d in range(tree.depth):
        nodes = [i for i, p in enumerate(tree.paths) if len(p) == d + 1]
        par = None if d == 0 else torch.tensor([tree.parents[i] for i in nodes], dtype=torch.long, device="cpu")
        out.append((torch.tensor(nodes, dtype=torch.long, device="cpu"), par,
                    torch.tensor([tree.paths[i][-1] for i in nodes], dtype=torch.long, device="cpu")[None]))
    return out
