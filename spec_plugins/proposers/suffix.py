"""Suffix decoding (Oliaro et al., NeurIPS 2025): tree drafts from this request's own text and
from the text of every request seen before, no model, no training.

Each row keeps a suffix index over its prompt and output (``RequestIndex``); finished requests
go into a global index (``GlobalIndex``) shared by every row of the proposer, under a token cap
that evicts the oldest request first. Each round, per row:
1. the longest suffix of the context that was seen before with a continuation is matched in
   both indexes (at most ``max_match`` tokens, so the index depth leaves room to continue);
2. from each match a tree grows best-first by empirical continuation frequency
   (``suffix_trees.speculate``), at most ``max_spec_factor`` x match length nodes (longer
   matches are trusted with bigger trees), none below ``min_token_prob``;
3. the two trees are drafted as one (``suffix_trees.union``: a path in both keeps its higher
   estimate), trimmed by the cost model (``tree_nodes: auto``) or to ``tree_nodes``.
Drafts are point masses, so greedy output is plain greedy and sampling stays exact.

Scope of the cross-request memory (``scope``): ``request`` (none: only the row's own text),
``global`` (every request), or ``tenant`` (requests with the same tenant key only). A shared
index leaks timing: a request runs faster when similar text was seen before, so a multi-tenant
deployment should keep ``request`` (the default) or ``tenant``.
"""

from __future__ import annotations

from typing import Any, Hashable, Literal, Sequence

from pydantic import Field, model_validator

from spec_plugins.config import ProposerConfig
from spec_plugins.policy.tree_size import MAX_AUTO_NODES
from spec_plugins.proposers.base import Metric, ProposeContext, Proposer, RoundRecord
from spec_plugins.registry import register_proposer
from spec_plugins.suffix_global import GlobalIndex
from spec_plugins.suffix_index import Cursor, RequestIndex, Trie
from spec_plugins.suffix_trees import EMPTY, Speculation, speculate, union
from spec_plugins.tree import ordinal_paths
from spec_plugins.types import Ranked, RankedRow
FINISHED = ("eos_token", "length", "stop")  # rows that end so go into the global index


@register_proposer("suffix")
class SuffixProposer(Proposer):
    """Point-mass draft trees from suffix indexes over this request and earlier ones."""

    tree = True
    ranks = True
    measuring = False  # True while ``policy.cost.measuring`` times it: those lookups are no traffic

    class Config(ProposerConfig):
        type: Literal["suffix"] = "suffix"
        num_draft_tokens: int | Literal["auto"] = Field(16, description="Depth limit of the draft tree.")
        tree_nodes: int | Literal["auto"] = Field(
            "auto", description="Most draft nodes per row and round; 'auto' keeps the count with the most expected "
                                "tokens per second under the runtime's measured cost curve.")
        scope: Literal["request", "global", "tenant"] = Field(
            "request", description="Cross-request memory: none, every request, or requests of the same tenant.")
        max_spec_factor: float = Field(2.0, gt=0.0, le=16.0,
                                       description="At most this x match length nodes per tree (SuffixDecoding's alpha; "
                                                   "2 measured faster than 1 on both prompt sets, docs/proposers.md).")
        min_token_prob: float = Field(0.1, ge=0.0, le=1.0,
                                      description="Nodes whose estimated acceptance probability is lower are not drafted.")
        depth: int = Field(32, ge=2, le=128, description="Longest substring the indexes hold (work per token).")
        max_match: int = Field(12, ge=1, le=127, description="Longest suffix matched (the rest of depth is for drafts).")
        global_max_tokens: int = Field(200_000, ge=1, description="Token cap of the global index (oldest "
                                                                  "evicted); about 1.8 KB a token: about 350 MiB at 200,000.")
        global_max_nodes: int | None = Field(None, ge=1, description="Trie-node cap of the global index (oldest "
                                                                     "evicted), about 69 bytes a node; none: the "
                                                                     "token cap alone bounds it.")
        max_tenants: int = Field(10_000, ge=1, description="scope: tenant: tenants whose finished requests are "
                                                             "held at once; a new one evicts the least recently "
                                                             "used tenant with all its requests.")

        @property
        def auto_tree(self) -> bool:
            return self.tree_nodes == "auto"

        @model_validator(mode="after")
        def _check(self) -> "SuffixProposer.Config":
            if self.tree_nodes != "auto" and not (1 <= self.tree_nodes <= 256):
                raise ValueError(f"tree_nodes must be 'auto' or 1..256, got {self.tree_nodes}")
            if self.max_match >= self.depth:
                raise ValueError(f"max_match ({self.max_match}) must be < depth ({self.depth})")
            return self._check_scope_fields()

        def _check_scope_fields(self) -> SuffixProposer.Config:
            """The global index's caps do nothing with ``scope: request`` (no global index), nor
            ``max_tenants`` outside ``scope: tenant``: refused by field, not silently unused. Only
            changed values count: a dumped config carries every field at its default."""
            applies = {"global_max_tokens": ("global", "tenant"), "global_max_nodes": ("global", "tenant"),
                       "max_tenants": ("tenant",)}
            fields = type(self).model_fields
            given = sorted(f for f in self.model_fields_set & applies.keys()
                           if self.scope not in applies[f] and getattr(self, f) != fields[f].default)
            if given:
                named = ", ".join(f"{f} (scope: {' or '.join(applies[f])} only)" for f in given)
                raise ValueError(f"{named} {'does' if len(given) == 1 else 'do'} nothing with scope: {self.scope}: "
                                 "set the scope it applies to, or leave it out")
            return self

    def __init__(self, config: "SuffixProposer.Config | None" = None, target: Any = None, **_: object) -> None:
        self.config = config or self.Config()
        self.index = self._new_index()
        self.rows: list[RequestIndex] = []
        self.cursors: list[Cursor | None] = []  # per row: its context in the global trie of its scope key
        self.keys: list[Hashable] = []
        self.epochs: list[int] = []  # the global index's epoch each cursor is in sync with
        self.last: list[Speculation] = []  # per row: what the last propose offered (for stats)

    def forget(self) -> None:
        """Drop the cross-request memory (the bench's independent requests; a tenant's reset)."""
        self.index = self._new_index()
        self.cursors = [None] * len(self.rows)

    def _new_index(self) -> GlobalIndex:
        c = self.config
        return GlobalIndex(c.depth, c.global_max_tokens, c.max_tenants if c.scope == "tenant" else None,
                           c.global_max_nodes)

    def metrics(self) -> list[Metric]:
        """The global index's size and hit rate, for ``/metrics``."""
        st, index = self.index.stats, self.index
        return [
            ("spec_suffix_index_requests", "gauge", "Finished requests held by the global suffix index.", st.requests),
            ("spec_suffix_index_tokens", "gauge", "Tokens held by the global suffix index.", st.tokens),
            ("spec_suffix_index_max_tokens", "gauge", "Token cap of the global suffix index.", index.max_tokens),
            ("spec_suffix_index_nodes", "gauge", "Trie nodes of the global suffix index.", st.nodes),
            ("spec_suffix_index_evicted_requests_total", "counter", "Requests evicted from the global suffix index.",
             st.evicted_requests),
            ("spec_suffix_index_keys", "gauge", "Scope keys (tenants) with requests in the global suffix index.",
             len(index.tries)),
            ("spec_suffix_index_evicted_keys_total", "counter", "Tenants evicted whole from the global suffix index "
             "(least recently used, over max_tenants).", st.evicted_keys),
            ("spec_suffix_index_lookups_total", "counter", "Global suffix index lookups (one per row and round).",
             st.lookups),
            ("spec_suffix_index_hits_total", "counter", "Lookups that matched a suffix with a continuation.", st.hits),
            ("spec_suffix_index_hit_rate", "gauge", "Hits / lookups of the global suffix index.", st.hit_rate),
        ]

    # ---- rows -----------------------------------------------------------------------------------
    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        for p in prompts:
            idx = RequestIndex(self.config.depth)
            idx.extend(list(p))
            self.rows.append(idx)
            self.cursors.append(None)
            self.keys.append(None)
            self.epochs.append(-1)

    def select_rows(self, rows: Sequence[int]) -> None:
        for name in ("rows", "cursors", "keys", "epochs"):
            old = getattr(self, name)
            setattr(self, name, [old[r] for r in rows])

    def num_rows(self) -> int:
        return len(self.rows)

    def _scope_key(self, tenant: Hashable) -> Hashable | None:
        scope = self.config.scope
        return None if scope == "request" else ("*" if scope == "global" else ("tenant", tenant))

    # ---- drafting -------------------------------------------------------------------------------
    def _sync(self, b: int, seq: Sequence[int], tenant: Hashable) -> None:
        """Catch row b's indexes up with the tokens emitted since the last round."""
        idx = self.rows[b]
        new = list(seq[idx.length:])
        idx.extend(new)
        key = self._scope_key(tenant)
        if key is None:
            return
        cur = self.cursors[b]
        if cur is None or self.keys[b] != key or self.epochs[b] != self.index.epoch:
            cur = self.cursors[b] = Cursor(self.index.trie(key))
            cur.resync(seq)
            self.keys[b], self.epochs[b] = key, self.index.epoch
        else:
            for t in new:
                cur.follow(t)

    def speculations(self, ctx: ProposeContext) -> list[Speculation]:
        """Per row: the own-text and the cross-request trees as one (not yet sized)."""
        c = self.config
        tenants = ctx.tenants or [None] * len(ctx.sequences)
        out = []
        for b, (seq, budget, tenant) in enumerate(zip(ctx.sequences, ctx.budgets, tenants)):
            self._sync(b, seq, tenant)
            if budget <= 0:
                out.append(EMPTY)
                continue
            cap = MAX_AUTO_NODES if c.tree_nodes == "auto" else c.tree_nodes
            own = self.rows[b]
            specs = [speculate(trie, node, n, min(cap, max(1, int(c.max_spec_factor * n))), min(budget, c.depth - n),
                               c.min_token_prob)
                     for trie, n, node in ((own.trie, *own.match(c.max_match)), self._global_match(b))
                     if node is not None]
            out.append(_prefix(union(specs), cap))
        return out

    def _global_match(self, b: int) -> tuple[Trie | None, int, int | None]:
        """Row b's match in the global trie of its scope: (that trie, length, node id or None)."""
        cur = self.cursors[b]
        if cur is None:
            return None, 0, None
        n, node = cur.match(self.config.max_match)
        if not self.measuring:  # /metrics counts the lookups of requests only
            self.index.stats.lookups += 1
            self.index.stats.hits += node is not None
        return cur.trie, n, node

    def propose(self, ctx: ProposeContext) -> Ranked | None:
        """Each row's tree best-first with its frequency estimates; the draft policy sizes it."""
        specs = self.last = self.speculations(ctx)
        if not any(s.tokens for s in specs):
            return None
        rows = [[RankedRow(s.tokens, ordinal_paths(s.parents), s.probs)] for s in specs]
        return Ranked(rows, auto=self.config.tree_nodes == "auto")

    def observe(self, record: RoundRecord) -> None:
        """Finished rows go into the global index of their scope."""
        if self.config.scope == "request":
            return
        tenants = record.tenants or [None] * record.rows
        for e, seq, tenant in zip(record.emissions, record.sequences, tenants):
            if e.finish_reason in FINISHED:
                self.index.add(self._scope_key(tenant), seq)


def _prefix(spec: Speculation, n: int) -> Speculation:
    """The first n nodes (best-first order: a valid tree)."""
    return Speculation(spec.tokens[:n], spec.parents[:n], spec.probs[:n], spec.match_length)
