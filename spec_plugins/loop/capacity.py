"""Fitting rows and drafts into a runtime whose cache is one shared pool (llama.cpp).

A runtime with a pool (``backends.base.SharedPool``) keeps every row's cache in ``cells`` KV
positions in all and gives a tree one sequence id per leaf (``sequences`` ids in all, at least one
per row). Two rules keep every round inside it, so no round fails for room:

1. admission reserves each row's prompt + token limit in cells, and one sequence id, in the
   target's pool and in a draft model's (which caches the same sequences): a request that does not
   fit beside the running rows waits (the server) or is refused (a fixed batch);
2. each round's draft is cut to its longest node prefix whose leaves fit the sequence ids and whose
   nodes fit the cells left after the rows' caches. Every prefix of a draft is a tree (a parent
   precedes its children) and drafters order nodes best-first, so the cut keeps the best part.

A runtime with fixed-shape steps (a TensorRT engine, ``max_draft_nodes``) scores at most so many
nodes a forward: each round's draft is cut to them the same way (``max_nodes``).

Cutting a draft changes which tokens are verified, never the output.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from spec_plugins.row_trees import RowTrees
from spec_plugins.types import Draft


def pool_of(holder: Any) -> Any:
    """The shared pool of a runtime, or of a proposer that caches rows in one (a llama.cpp draft
    model); None where each row has a context of its own."""
    return getattr(holder, "pool", None)


def shortfall(pool: Any, held: Sequence[int], new: Sequence[int], whose: str = "the runtime's") -> str | None:
    """Why rows reserving ``new`` cells cannot join rows holding ``held`` in ``whose`` pool (None:
    they fit). A reservation is a row's prompt + token limit (rule 1)."""
    if pool is None:
        return None
    rows = len(held) + len(new)
    if rows > pool.sequences:
        return (f"{len(held)} running + {len(new)} new rows exceed {whose} {pool.sequences} sequences "
                "(max_sequences)")
    cells = sum(held) + sum(new)
    if cells > pool.cells:
        return (f"{len(held)} running + {len(new)} new rows reserve {cells} KV cells (prompt + max_new_tokens "
                f"each); {whose} cache holds {pool.cells} (n_ctx)")
    return None


def max_nodes(runtime: Any) -> int | None:
    """The most drafted nodes one forward of ``runtime`` scores (a TensorRT engine's ``max_draft``:
    its profiles run at most that many positions past the pending token); None: no bound."""
    return getattr(runtime, "max_draft_nodes", None)


def fit(draft: Draft | None, pool: Any, lengths: Sequence[int], most: int | None = None) -> Draft | None:
    """``draft`` cut to what the pool holds this round (rule 2) and to ``most`` nodes (``max_nodes``,
    the widest forward the runtime runs): None when not one node fits."""
    if draft is not None and most is not None and draft.size > most:
        draft = cut(draft, most) if most > 0 else None
    if draft is None or pool is None:
        return draft
    B = len(lengths)
    free_cells = pool.cells - sum(lengths) - B  # the pending tokens take one cell per row
    width = min(draft.size, max(0, free_cells // B), _leaf_width(draft, pool.sequences))  # a round has rows
    if width == draft.size:
        return draft
    if width == 0:
        return None
    return cut(draft, width)


def cut(draft: Draft, width: int) -> Draft:
    """The first ``width`` nodes of ``draft`` (a tree: parents precede their children)."""
    parents = draft.parents
    parents = (parents[:width] if isinstance(parents, tuple)
               else RowTrees(parents.parents[:, :width], parents.depth[:width]))
    head = lambda t: None if t is None else t[:, :width]  # noqa: E731
    return replace(draft, tokens=draft.tokens[:, :width], parents=parents, probs=head(draft.probs),
                   valid=head(draft.valid), host_valid=head(draft.host_valid))


def _leaf_width(draft: Draft, sequences: int) -> int:
    """The most leading nodes whose leaves, summed over the rows, fit ``sequences`` ids."""
    parents = draft.parents
    rows = ([list(parents)] * int(draft.tokens.shape[0]) if isinstance(parents, tuple)
            else parents.parents.tolist())  # per-row trees: a host read (pool runtimes live on the host)
    leaves = [0] * len(rows)
    has_child = [set() for _ in rows]
    for w in range(draft.size):
        for b, par in enumerate(rows):
            p = par[w]
            leaves[b] += 1
            if p >= 0 and p not in has_child[b]:
                has_child[b].add(p)
                leaves[b] -= 1  # its parent stops being a leaf
        if sum(leaves) > sequences:
            return w
    return draft.size
