"""Per-row draft trees on the drafting device, and the helpers that take either kind of topology.

A ``Draft``'s ``parents`` is one tuple for every row (chains, static trees, host-merged trees:
``tree.py``) or ``RowTrees``: each row's own parents over one layered shape (node i at the same
depth in every row), kept where the drafter built them (EAGLE-2's dynamic trees, a hybrid's rows
taking different drafters), so no tree crosses to the host. Depths are host data either way:
positions, logits-processor groups and acceptance-by-depth counts are built from them there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence, Union

import torch

from spec_plugins.tree import TreeLayout, layout, with_root


@dataclass(frozen=True)
class RowTrees:
    """Per-row draft trees over one layered shape: node i sits at ``depth[i]`` in every row (depths
    non-decreasing), its parent is each row's own, kept where the drafter built it.

    parents [B, n] long: per row, each node's parent node (-1 = child of the pending token)"""

    parents: torch.Tensor
    depth: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.depth)

    def to(self, device: torch.device) -> "RowTrees":
        from spec_plugins.transfer import upload

        return RowTrees(upload(self.parents, device), self.depth)

    def select(self, rows: Any) -> "RowTrees":
        """These rows' trees (``rows``: an index or a slice)."""
        return RowTrees(self.parents[rows], self.depth)

    def with_root(self) -> "RowTrees":
        """[root] + nodes, the root being the pending token: forward indices."""
        B = self.parents.shape[0]
        root = torch.full((B, 1), -1, dtype=torch.long, device=self.parents.device)
        return RowTrees(torch.cat([root, self.parents + 1], 1), (0,) + tuple(d + 1 for d in self.depth))

    def ancestors(self) -> torch.Tensor:
        """[B, n, n] bool, [b, i, j]: node j is i or an ancestor of i in row b (parent pointers
        followed max(depth) times on the device)."""
        B, n = self.parents.shape
        dev = self.parents.device
        anc = torch.eye(n, dtype=torch.bool, device=dev).expand(B, n, n).clone()
        cur = self.parents
        for _ in range(max(self.depth, default=0)):
            up = cur >= 0
            anc |= torch.nn.functional.one_hot(cur.clamp_min(0), n).bool() & up[..., None]
            cur = torch.where(up, self.parents.gather(1, cur.clamp_min(0)), cur)
        return anc


Parents = Union[tuple[int, ...], RowTrees]  # one topology for every row, or each row its own


def keep_slots(parents: Parents, slots: Sequence[int], valid: torch.Tensor | None, device: torch.device
               ) -> tuple[Parents, torch.Tensor | None]:
    """The topology of a draft cut to ``slots`` (host indices, ascending), and its valid mask: a
    kept node whose parent was cut is no longer valid (each row's own parents: checked on the
    device, level by level)."""
    where = {j: k for k, j in enumerate(slots)}
    if isinstance(parents, tuple):
        kept = tuple(where[parents[j]] if parents[j] >= 0 else -1 for j in slots)
        return kept, (valid[:, upload_index(slots, valid.device)] if valid is not None else None)
    remap = torch.full((len(parents) + 1,), -2, dtype=torch.long, device="cpu")  # cut parents -> -2, root -1
    remap[-1] = -1
    remap[list(slots)] = torch.arange(len(slots), device="cpu")
    idx = upload_index(slots, device)
    old = parents.parents[:, idx]
    new = upload_index(remap.tolist(), device)[old]  # old -1 indexes the last entry: the root
    ok = new >= -1
    if valid is not None:
        ok &= valid[:, idx]
    depth = tuple(parents.depth[j] for j in slots)
    for d in sorted(set(depth)):  # a node whose parent is no longer valid is not either
        at = [k for k, dk in enumerate(depth) if dk == d]
        if d:
            at_t = upload_index(at, device)
            par = new[:, at_t].clamp_min(0)
            ok[:, at_t] &= ok.gather(1, par)
    return RowTrees(new.clamp_min(-1), depth), ok


def combine(parts: Sequence[tuple[torch.Tensor, Parents, torch.Tensor | None]], owner: Sequence[int],
            device: torch.device) -> tuple[torch.Tensor, RowTrees, torch.Tensor]:
    """Per row one of several drafts (``owner[b]``: the index of the part row b takes, -1: none)
    as one draft over the union of their layered shapes, each depth as wide as its widest part:
    tokens [B, U], each row's own parents and its valid mask, built on ``device`` from host-known
    slot maps (no read)."""
    B = len(owner)
    slots, width = union_layout([par for _, par, _ in parts])
    levels = len(width)
    U = sum(width)
    tokens = torch.zeros(B, U, dtype=torch.long, device=device)
    parents = torch.full((B, U), -1, dtype=torch.long, device=device)
    valid = torch.zeros(B, U, dtype=torch.bool, device=device)
    for p, ((tok, par, val), slot) in enumerate(zip(parts, slots)):
        rows = upload_index([b for b, o in enumerate(owner) if o == p], device)
        idx = upload_index(slot, device)
        if isinstance(par, tuple):
            mapped = upload_index([slot[q] if q >= 0 else -1 for q in par], device).expand(rows.shape[0], -1)
        else:
            lut = upload_index(slot + [-1], device)  # a parent of -1 reads the last entry: the root
            mapped = lut[par.parents[rows]]
        pv = val[rows] if val is not None else torch.ones(rows.shape[0], len(slot), dtype=torch.bool, device=device)
        tokens[rows[:, None], idx[None]] = tok[rows]
        parents[rows[:, None], idx[None]] = mapped
        valid[rows[:, None], idx[None]] = pv
    depth_u = tuple(lev for lev in range(levels) for _ in range(width[lev]))
    return tokens, RowTrees(parents, depth_u), valid


def union_layout(parents: Sequence[Parents]) -> tuple[list[list[int]], list[int]]:
    """The union of several layered shapes, each depth as wide as its widest part: per part the
    slot of each of its nodes (a part's nodes in their order within a depth), and each depth's
    width. ``combine`` lays drafts out by it; the tree sizer maps its estimates through it."""
    shapes = [node_depths(par) for par in parents]
    levels = max((max(d, default=-1) for d in shapes), default=-1) + 1
    width = [max(sum(1 for x in d if x == lev) for d in shapes) for lev in range(levels)]
    start = [sum(width[:lev]) for lev in range(levels)]
    slots = []
    for depth in shapes:
        seen = [0] * levels
        slot = []
        for d in depth:
            slot.append(start[d] + seen[d])
            seen[d] += 1
        slots.append(slot)
    return slots, width


def upload_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    from spec_plugins.transfer import upload_tensor

    return upload_tensor(list(values), device)


def rows_of(parents: Parents, rows: Any) -> Parents:
    """The topology of some rows (``rows``: an index, a list or a slice): per-row trees selected,
    a shared one as it is."""
    return parents.select(rows) if isinstance(parents, RowTrees) else parents


def node_depths(parents: Parents) -> tuple[int, ...]:
    """Depth of each node (0 = child of the pending token); the same in every row."""
    return parents.depth if isinstance(parents, RowTrees) else _depths(parents)


@lru_cache(maxsize=256)
def _depths(parents: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(layout(parents).depth.tolist())


def forward_layout(parents: Parents) -> TreeLayout:
    """The runtime's layout of a forward over the pending token and the draft ``parents``."""
    if not isinstance(parents, RowTrees):
        return layout(with_root(parents))
    full = parents.with_root()
    depth = torch.tensor(full.depth, dtype=torch.long, device="cpu")
    return TreeLayout(None, depth, full.ancestors(), False, full.parents)


def depth_counts(parents: Parents, valid: torch.Tensor | None = None) -> list[int]:
    """Nodes per depth (``valid`` [n] bool on the host: only those), for acceptance-by-position counts."""
    depth = torch.tensor(node_depths(parents), dtype=torch.long, device="cpu")
    if valid is not None:
        depth = depth[valid]
    return torch.bincount(depth).tolist() if depth.numel() else []


@dataclass(frozen=True)
class LeafPaths:
    """One row's tree by its leaves: the nodes on each leaf's path and, per node, the leaves whose
    paths hold it (llama.cpp gives each leaf a sequence), and each node's depth along this row's
    own parents. That depth is the layered one for every valid node; a padding slot of a per-row
    tree (``combine``, ``keep_slots``: parent -1 at a layered depth > 0) sits shallower, and
    positions must follow it, or its leaf's sequence would skip positions."""

    parents: list[int]
    leaves: list[int]
    paths: list[set[int]]
    on_leaf: list[list[int]]
    depth: list[int]

    @staticmethod
    def of(tree: TreeLayout, b: int) -> "LeafPaths":
        parents = tree.row_parents(b)  # host lists (per-row trees: read off their device)
        has_child = {p for p in parents if p >= 0}
        leaves = [i for i in range(len(parents)) if i not in has_child]
        paths = []
        for leaf in leaves:
            nodes, j = set(), leaf
            while j >= 0:
                nodes.add(j)
                j = parents[j]
            paths.append(nodes)
        depth: list[int] = []
        for p in parents:  # topological: a parent precedes its children
            depth.append(depth[p] + 1 if p >= 0 else 0)
        on_leaf = [[k for k, p in enumerate(paths) if j in p] for j in range(len(parents))]
        return LeafPaths(parents, leaves, paths, on_leaf, depth)
