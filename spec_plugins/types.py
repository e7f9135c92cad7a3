"""The data that travels between the steps of a round, as small dataclasses with shape comments.

Where each tensor lives (one place, so the round is device-correct by construction):

| tensor | device | why |
|---|---|---|
| ``Draft.tokens/probs/valid`` as a proposer returns them | any | drafters run where they like |
| forward input ``tokens`` [B, N] (root + drafted nodes) | the runtime's ``device`` | ``Batch.verify_input`` moves the draft once |
| ``StepOutput.logits`` [B, N, V], ``hidden`` [B, N, H] | the runtime's ``device`` | the logits' device is the round's device |
| processed logits ``z``, probabilities, uniforms, residuals | the logits' device | the verifier and sampler never move them |
| generators | the logits' device | ``torch.rand``/``multinomial`` need the generator on the tensor's device |
| ``DeviceVerdict.path/next`` | the logits' device | the verifier's decision, before the round reads it |
| ``Verdict.accepted/next_tokens/tokens`` | host lists | fetched once (``DeviceVerdict.fetch``): the round emits, stops and commits from them |
| KV slot positions ``pos`` [B, S] | host | bookkeeping only; masks are built from it (the static cache: on the device) |

The only device -> host transfer of a round is the verdict's one copy (the accepted paths, their
tokens, the next tokens, the rows whose logits failed), plus the logprobs of emitted tokens for
rows that ask for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

import torch

from spec_plugins.transfer import HOST, upload

if TYPE_CHECKING:
    from spec_plugins.config import SamplingConfig
    from spec_plugins.sampling import LogitsPipeline, LogitsProcessorFn
    from spec_plugins.row_trees import Parents


@dataclass(frozen=True)
class Draft:
    """One round's draft for a batch: a chain or a tree, shared by all rows or each row's own.

    tokens  [B, n] long
    parents tuple of n ints, -1 = child of the pending token (chain: -1, 0, 1, ...), the same for
            every row; or ``tree.RowTrees``: each row's own parents, where the drafter built them
    probs   [B, n, V] the distribution each node's token was drawn from, or None (point mass)
    valid   [B, n] bool, rows may draft fewer nodes (None = all valid)
    """

    tokens: torch.Tensor
    parents: "Parents"
    probs: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    host_valid: torch.Tensor | None = field(default=None, compare=False, repr=False)  # ``valid`` before ``to``

    @property
    def size(self) -> int:
        return len(self.parents)

    def valid_on_host(self) -> torch.Tensor | None:
        """``valid`` where reading it needs no device sync (drafts are sized on the host)."""
        return self.host_valid if self.host_valid is not None else self.valid

    def row_sizes(self) -> list[int]:
        """Nodes each row actually drafted (its valid ones)."""
        if self.valid is None:
            return [self.size] * int(self.tokens.shape[0])
        return self.valid_on_host().sum(1).tolist()

    def to(self, device: torch.device) -> "Draft":
        """The same draft with every tensor on ``device`` (a no-op where they already are); a
        host ``valid`` is kept for the host-side statistics."""
        move = lambda t: t if t is None else upload(t, device)  # noqa: E731
        host = self.valid if self.valid is not None and self.valid.device == HOST else self.host_valid
        parents = self.parents if isinstance(self.parents, tuple) else self.parents.to(device)
        return Draft(move(self.tokens), parents, move(self.probs), move(self.valid), host)

    @staticmethod
    def from_chains(chains: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> "Draft | None":
        """Pad per-row token chains of different lengths into one draft (None if all empty)."""
        n = max((len(c) for c in chains), default=0)
        if n == 0:
            return None
        toks = torch.zeros(len(chains), n, dtype=torch.long, device="cpu")
        valid = torch.zeros(len(chains), n, dtype=torch.bool, device="cpu")
        for b, c in enumerate(chains):
            if c:
                toks[b, : len(c)] = torch.as_tensor(list(c), dtype=torch.long, device="cpu")
                valid[b, : len(c)] = True
        return Draft(toks.to(device), tuple(range(-1, n - 1)), None, None if bool(valid.all()) else valid.to(device))


@dataclass(frozen=True)
class RankedRow:
    """One row's candidate draft, best-first: every prefix of its nodes is a valid tree (a child
    never precedes its parent nor scores above it). ``paths[i]`` is node i's rank path, the key
    ``tree.merge_trees`` places it by; ``estimates[i]`` the drafter's probability that node i is
    accepted (uncalibrated); ``source`` which drafter made it (a hybrid's child index), so each
    source's estimates are calibrated on their own."""

    tokens: Sequence[int]
    paths: Sequence[tuple[int, ...]]
    estimates: Sequence[float]
    source: int = 0

    @property
    def size(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> "RankedRow":
        return RankedRow(self.tokens[:n], self.paths[:n], self.estimates[:n], self.source)


@dataclass(frozen=True)
class Shaped:
    """A drafter's draft over one static shape of node slots, built where the drafter runs (every
    row has the same slots at the same depths; each row's own tokens, parents and valid mask), with
    the drafter's estimate that each slot is accepted: host data, the same for every row (a static
    tree's priors, or a model drafter's running means of its own scores), so the draft policy can
    keep the slots that pay without reading the draft (``TreeSizer``)."""

    draft: "Draft"
    estimates: tuple[float, ...]  # per slot
    source: int = 0  # which drafter made it (a composition's child index)

    def order(self) -> list[int]:
        """Slots best-first (ties: the shallower, then the earlier slot)."""
        from spec_plugins.row_trees import node_depths

        depth = node_depths(self.draft.parents)
        return sorted(range(len(self.estimates)), key=lambda j: (-self.estimates[j], depth[j], j))


@dataclass(frozen=True)
class Ranked:
    """What a tree drafter returns instead of a ``Draft``: per row, its candidates best-first with
    their estimates (several alternatives per row when several drafters offered one), not yet
    sized. The draft policy picks each row's alternative, cuts the trees against the cost model
    (``auto``) or keeps them whole (a fixed ``tree_nodes`` the drafter already applied) and merges
    them into the ``Draft`` the target verifies."""

    rows: Sequence[Sequence[RankedRow]]  # per row: its alternatives ([] or empty rows: nothing)
    auto: bool = False  # cut by the cost model (tree_nodes: auto), else keep every node given
    shaped: Sequence[Shaped] = ()  # drafts built on a device: an alternative for every row

    def tagged(self, source: int) -> "Ranked":
        """The same candidates tagged as coming from ``source`` (a composition's child)."""
        return Ranked([[RankedRow(r.tokens, r.paths, r.estimates, source) for r in alts if r.size] for alts in self.rows],
                      self.auto, [Shaped(s.draft, s.estimates, source) for s in self.shaped])

    def __bool__(self) -> bool:
        return bool(self.shaped) or any(r.size for alts in self.rows for r in alts)


@dataclass(frozen=True)
class ProposeContext:
    """What a proposer may look at. ``sequences[b]`` is row b's prompt + output so far; its
    last token is the pending one (emitted, not yet in the target's cache)."""

    sequences: Sequence[Sequence[int]]
    budgets: Sequence[int]  # max draft depth per row this round (0 = this row drafts nothing)
    pipeline: "LogitsPipeline | Any"  # the rows' sampling (``RowPipelines``: one per row)
    generator: torch.Generator | None = None
    tree_ok: bool = False  # the target runtime can verify a tree in one forward
    hidden: Sequence[torch.Tensor] | None = None  # per row: target hidden states not yet consumed
    tenants: Sequence[Hashable] | None = None  # per row: whose traffic it is (cross-request memory scope)
    ahead: Sequence[Sequence[int]] = ()  # per row: tokens drafted ahead of this draft (a grammar's forced
    # tokens); a proposer that ``continues_ahead`` drafts what follows sequence + ahead
    generators: Sequence[torch.Generator | None] | None = None  # per row: the generator its verdict draws
    # from (a seeded row's own; None: ``generator`` for every row); a drafter that samples draws from it
    processor_prefix: Sequence[Sequence[int]] = ()  # per row: tokens its user processors see before the
    # prompt (transformers' left pads); a drafter running the rows' processors gives them the same prefixes


@dataclass
class Verdict:
    """Per row: accepted draft nodes (root-to-leaf order) and the token emitted after them, on
    the host. ``tokens``: the accepted nodes' tokens (None: read them from the draft)."""

    accepted: list[list[int]]
    next_tokens: list[int]
    tokens: list[list[int]] | None = None

    def keep(self) -> list[list[int]]:
        """Forward indices whose KV survives: the root plus every accepted node."""
        return [[0] + [i + 1 for i in acc] for acc in self.accepted]

    @staticmethod
    def of(host: dict[str, Any]) -> "Verdict":
        """A verdict from the host arrays of ``DeviceVerdict.parts`` (the round's one fetch)."""
        path, toks = host["path"], host["accepted_tokens"]
        accepted = [[int(j) for j in row.nonzero()[0]] for row in path]
        return Verdict(accepted, host["next"].tolist(), [[int(t) for t in tr[acc]] for tr, acc in zip(toks, accepted)])


@dataclass(frozen=True)
class DeviceVerdict:
    """A verifier's decision still on the logits' device (no host sync yet).

    path [B, n] bool: the nodes of the accepted root-to-leaf path
    next [B] long: the token emitted after them"""

    path: torch.Tensor
    next: torch.Tensor

    def fetch(self, x: torch.Tensor, flags: torch.Tensor | None = None) -> "tuple[Verdict, list[bool]]":
        """The verdict on the host in ONE device-to-host copy: path, the accepted tokens of ``x``
        [B, n], the next tokens and per-row ``flags`` [B] bool (e.g. rows whose logits failed)."""
        from spec_plugins.transfer import fetch

        f = flags if flags is not None else torch.zeros(self.next.shape[0], dtype=torch.bool, device=self.next.device)
        host = fetch(self.parts(x) | {"flags": f})
        return Verdict.of(host), host["flags"].tolist()

    def parts(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the host needs of this verdict (``transfer.fetch``; ``Verdict.of`` reads it back)."""
        return {"path": self.path, "accepted_tokens": torch.where(self.path, x, 0), "next": self.next}


# stop(row_tokens, n_new) -> None to go on, or how many of the row's n_new newest tokens to keep
# (the row then finishes with reason "stop"): external stopping criteria (transformers')
RowStop = Callable[[Sequence[int], int], "int | None"]


@dataclass
class RowRequest:
    """A sequence to decode: prompt token ids, a limit, its own sampling and seed."""

    key: Hashable
    prompt: list[int]
    max_new_tokens: int
    sampling: "SamplingConfig | None" = None  # None: greedy
    seed: int | None = None  # own generator (reproducible per request); None = the batch's
    lane: int = 0  # rows sharing one seed each take their own lane of it (``keyed_draws``)
    processors: "Sequence[LogitsProcessorFn]" = ()  # user logits processors for this row
    prefix: Sequence[int] = ()  # tokens the processors see before the prompt (transformers' left pads)
    stop: RowStop | None = None
    logprobs: bool = False  # report log p of each emitted token
    pipeline: "LogitsPipeline | None" = None  # a ready pipeline to use as is (overrides sampling, processors)
    tenant: Hashable = None  # whose traffic this is: proposers with cross-request memory keep tenants apart
    grammar: Any = None  # ``grammar.RowGrammar``: a constraint on the output, applied at every drafted node


@dataclass
class Emission:
    """Tokens one row emitted in one prefill/round (with their log-probabilities if asked)."""

    key: Hashable
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "eos_token" | "length" | "stop" | "error" when the row finished
    error: str | None = None  # why this row failed (alone: the other rows of the round carry on)


@dataclass(frozen=True)
class BatchView:
    """What a draft-length policy sees before a round (rows in batch order)."""

    sequences: list[list[int]]
    room: list[int]  # per row: the most draft tokens its limits allow this round
    keys: list[int] | None = None  # the Keyed proposer's class of each row's coming draft
    # (rows, k) -> the point-mass chains those rows would draft, free (a Keyed proposer's lookup)
    free_drafts: Callable[[list[int], int], list[list[int]]] | None = None

    @property
    def rows(self) -> int:
        return len(self.sequences)


@dataclass
class RoundTimes:
    """Seconds of one round's steps (wall clock of the round's ``clock``)."""

    draft: float = 0.0  # policy + propose + the proposer's observe (a draft model's forwards included)
    forward: float = 0.0  # the one target forward
    verify: float = 0.0  # logits processing + accept/reject
    commit: float = 0.0  # KV commit of the target cache
    total: float = 0.0
    draft_forward: float = 0.0  # of ``draft``: draft-model forwards


@dataclass
class RoundRecord:
    """What one round did, per row; observers (stats, policy, proposer, metrics) read it.

    Row lists are in batch order; ``sequences`` are the rows' token lists after the round
    (held by reference: they keep growing), ``target_logits`` [B, N, V] the processed logits.
    An admission where a new row finished at its first token is recorded for the proposer alone
    (``Batch._observe_prefill``): no draft, no logits, ``positions`` 1."""

    keys: list[Hashable]
    sequences: list[list[int]]
    budgets: list[int]  # draft depth each row was allowed
    draft_keys: list[int] | None  # the Keyed proposer's class of each row's draft, or None
    draft: Draft | None  # on the runtime's device
    accepted: list[list[int]]  # accepted node indices per row
    emitted: list[list[int]]  # tokens appended to each row this round
    emissions: list[Emission]
    positions: int  # N: positions per row in the forward (1 + drafted nodes)
    target_logits: torch.Tensor | None = None
    times: RoundTimes = field(default_factory=RoundTimes)
    lossy: bool = False
    tenants: list[Hashable] | None = None  # per row (``RowRequest.tenant``)
    fetched: dict[str, Any] = field(default_factory=dict)  # host arrays of the round's one read (``loop.verdicts``)
    ahead: list[int] = field(default_factory=list)  # per row: forced tokens drafted ahead of the proposer's (a grammar)
    _by_depth: list[list[int]] | None = field(default=None, init=False, repr=False)

    @property
    def rows(self) -> int:
        return len(self.keys)

    def drafted(self) -> list[int]:
        """Nodes each row drafted."""
        return self.draft.row_sizes() if self.draft is not None else [0] * self.rows

    def drafted_by_depth(self) -> list[list[int]]:
        """Per row: how many nodes it drafted at each depth (computed once; stats and policy read it)."""
        if self._by_depth is None:
            from spec_plugins.row_trees import depth_counts

            d = self.draft
            if d is None:
                self._by_depth = [[] for _ in range(self.rows)]
            elif d.valid is None:
                self._by_depth = [depth_counts(d.parents)] * self.rows
            else:
                valid = d.valid_on_host()  # the host copy (sized there, or read in the round's one fetch)
                self._by_depth = [depth_counts(d.parents, valid[b]) for b in range(self.rows)]
        return self._by_depth
