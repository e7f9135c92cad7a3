"""The one batch: rows that join and leave between rounds, over one runtime and one proposer.

A fixed batch (``generate``, ``generate_batch``, the transformers plugin) is a batch with no
arrivals; the server adds and removes rows between rounds. Each row carries its own sampling
pipeline and generator, its processor prefix, stop rule, limit and (for feature drafters) the
target hidden states its proposer has not consumed yet. The round (``loop.round``) calls the
steps below in order; they hold the mechanics, the round holds the order.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Hashable, Sequence

import torch

from spec_plugins.api_inputs import check_draft, foreign
from spec_plugins.config import SamplingConfig
from spec_plugins.grammar import rounds as grammar
from spec_plugins.keyed_draws import lane_seed
import spec_plugins.loop.processing as processing
from spec_plugins.loop.capacity import fit as fit_pool, max_nodes, pool_of, shortfall as pool_shortfall
from spec_plugins.loop.ownership import Lease, check_held, holders
from spec_plugins.loop.rows import Row, seen_sequences
from spec_plugins.loop.verdicts import broken_nodes, failures, read_round, verify_groups
from spec_plugins.proposers.base import ProposerTraits, check_pairing
from spec_plugins.sampling import LogitsPipeline, RowPipelines
from spec_plugins.stats import DecodeStats
from spec_plugins.row_trees import Parents, RowTrees, forward_layout
from spec_plugins.tree import TreeLayout, layout
from spec_plugins.types import BatchView, Draft, Emission, ProposeContext, Ranked, RoundRecord, RowRequest, Verdict
from spec_plugins.transfer import HOST, upload_tensor

GREEDY = SamplingConfig()


class Batch:
    """Rows decoded together: one target forward per round for all of them."""

    def __init__(self, runtime: Any, proposer: Any, verifier: Callable, eos_ids: Sequence[int] = (),
                 seed: int | None = 0, generator: torch.Generator | None = None, stats: DecodeStats | None = None,
                 observers: Sequence[Any] = (), clock: Callable[[], float] = time.perf_counter,
                 traits: ProposerTraits | None = None) -> None:
        """``traits``: the pairing already checked (``wiring.wire``); checked here otherwise."""
        self.runtime, self.proposer, self.verifier = runtime, proposer, verifier
        self.traits = traits if traits is not None else check_pairing(runtime, proposer)
        self._foreign = proposer is not None and foreign([proposer, *self.traits.sources])  # ``place``
        self._budgets: list[int] | None = None  # this round's, set by ``draft``
        self.device = torch.device(getattr(runtime, "device", "cpu"))
        self.eos = {int(e) for e in eos_ids}
        self.lossy = bool(getattr(verifier, "lossy", True))  # undeclared: not known to be exact
        self.generator = generator if generator is not None else (
            torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None)
        self.stats = stats if stats is not None else DecodeStats()
        self.stats.lossy = self.stats.lossy or self.lossy
        self.observers = list(observers)
        self.clock = clock
        self.rows: list[Row] = []
        self._pipes: dict[tuple, LogitsPipeline] = {}
        self._rp: tuple[tuple, RowPipelines] | None = None  # the current rows' RowPipelines, by pipeline ids
        self.top_logprobs = 0  # alternatives reported with each emitted token's logprob (a server sets it)
        self._logits: torch.Tensor | None = None  # this round's raw target logits: logprobs read them
        self.fetched: dict = {}  # what the round's one fetch read (``loop.verdicts.read_round``)
        self.forced: list[list[int]] = []  # this round's forced tokens per row (``grammar.rounds``)
        self._masks: torch.Tensor | None = None  # this round's grammar masks per node
        self._raised: processing.Raised | None = None  # this round's nodes whose processing raised
        self._failing: dict[int, tuple[int, str]] = {}  # this round's failing rows (``verdicts.failures``)
        # what holds this batch's rows besides itself: the runtime's caches, and a row-aware
        # proposer's per-row state (a draft model's own runtime and cache)
        self._lease = Lease()
        self._claim()

    def __len__(self) -> int:
        return len(self.rows)

    def keys(self) -> list[Hashable]:
        return [r.key for r in self.rows]

    # ---- ownership ----------------------------------------------------------------------------------
    @property
    def owns_runtime(self) -> bool:
        """Whether the runtime and proposer still hold this batch's rows: a batch built later over
        them (another generation on the same decoder) takes them over."""
        return self._lease.held

    def check_owner(self) -> None:
        """Refuse to go on over a runtime another batch took over while this one holds rows: its
        caches now hold that batch's rows, so a round here would decode on them. A batch holding
        no rows has nothing there to lose; ``add`` takes the runtime back."""
        if self.rows:
            self._lease.check()

    def _claim(self) -> None:
        """Take the runtime (a row-aware proposer, a draft model's runtime: ``holders``) over, holding no
        rows: a batch that had them before (one built earlier, another generation) refuses to go on."""
        self._lease.claim(holders(self.runtime, self.proposer, self.traits))
        self._select([])

    # ---- rows join --------------------------------------------------------------------------------
    def add(self, requests: Sequence[RowRequest]) -> list[Emission]:
        """Prefill new rows into the batch; returns each one's first token (a row asking for no
        tokens finishes at once, without touching the runtime). Every request is checked before
        any is admitted, so one bad request refuses them all."""
        self.check_owner()
        for r in requests:
            self._check_request(r)
        self.drop_finished()  # their cache makes room first (as a round starts by doing)
        short = self.shortfall([r for r in requests if r.max_new_tokens > 0])
        if short is not None:
            raise ValueError(f"cannot admit {len(requests)} request(s): {short}")
        out = [Emission(r.key, [], [], "length") for r in requests if r.max_new_tokens == 0]
        live = [r for r in requests if r.max_new_tokens > 0]
        if not live:
            return out
        if not self.rows and not self.owns_runtime:  # another generation used the runtime while this batch was empty
            self._claim()
        t0 = self.clock()
        new = [self._row(r) for r in live]
        n0 = len(self.rows)
        step = self.runtime.add_rows([r.prompt for r in live], want_hidden=self.traits.want_hidden)
        try:
            if self.traits.row_aware:
                self.proposer.admit([r.prompt for r in live])
            pending = upload_tensor([[r.tokens[-1]] for r in new], self.device)
            masks = grammar.round_masks(new, None, self.device)
            z = self._process(new, grammar.apply_masks(step.logits[:, -1:], masks), pending, (-1,))
            verdict, host = self._verify(new, None, z, step.logits[:, -1:])
        except BaseException:
            self._select(list(range(n0)))  # admission is atomic: the running rows as before
            raise
        for b, r in enumerate(new):
            r.hidden = step.hidden[b] if step.hidden is not None else None
        self.rows += new
        first = [r.emit([verdict.next_tokens[b]], self.eos, host, b, self._failing.get(b)) for b, r in enumerate(new)]
        self._observe_prefill(n0, first)
        self.stats.observe_admit(sum(1 for e in first if e.tokens), self.clock() - t0)  # rows that emitted a token
        return out + first

    def _observe_prefill(self, n0: int, first: list[Emission]) -> None:
        """Rows that finished at their first token never reach a round, so the proposer sees them
        finish here (suffix decoding indexes finished requests): a record of the whole batch, no
        draft, no logits, only the new rows' emissions. Stats and the policy learn nothing from it."""
        if self.proposer is None or not any(e.finish_reason for e in first):
            return
        n = len(self.rows)
        emissions = [Emission(r.key, []) for r in self.rows[:n0]] + first
        self.proposer.observe(RoundRecord(self.keys(), [r.tokens for r in self.rows], [0] * n, None, None,
                                          [[] for _ in range(n)], [e.tokens for e in emissions], emissions, 1,
                                          lossy=self.lossy, tenants=[r.tenant for r in self.rows]))

    def _check_request(self, r: RowRequest) -> None:
        """Refuse a request the runtime cannot run whole: its prompt + max_new_tokens must fit the context."""
        if not r.prompt:
            raise ValueError(f"request {r.key!r}: prompt is empty")
        if len(r.prompt) > self.runtime.max_context:
            raise ValueError(f"request {r.key!r}: prompt has {len(r.prompt)} tokens; the context holds "
                             f"{self.runtime.max_context}")
        if r.max_new_tokens < 0:
            raise ValueError(f"request {r.key!r}: max_new_tokens must be >= 0")
        if len(r.prompt) + r.max_new_tokens > self.runtime.max_context:
            # refused, not cut at the context: a shorter output would read as the limit asked for
            raise ValueError(f"request {r.key!r}: a prompt of {len(r.prompt)} tokens plus max_new_tokens "
                             f"{r.max_new_tokens} runs past the context of {self.runtime.max_context} positions: "
                             "lower max_new_tokens or shorten the prompt")

    def shortfall(self, requests: Sequence[RowRequest], leaving: Sequence[Hashable] = (),
                  alone: bool = False) -> str | None:
        """Why ``requests`` cannot join the running rows (but ``leaving``; none if ``alone``) in the
        runtime's shared pool or its draft model's, where they have one (``loop.capacity``); None
        when they fit."""
        gone = set(leaving)
        held = [] if alone else [r.prompt_len + r.max_new for r in self.rows if r.key not in gone and not r.done]
        new = [len(r.prompt) + r.max_new_tokens for r in requests]
        return (pool_shortfall(pool_of(self.runtime), held, new)
                or pool_shortfall(pool_of(self.proposer), held, new, "the draft model's"))

    def _row(self, r: RowRequest) -> Row:
        pipeline = r.pipeline
        if pipeline is None:
            sampling = r.sampling or GREEDY
            # rows with equal settings share one pipeline, hence one processing group (the seed is
            # the generator's, not the pipeline's); the cache stays bounded in a long-lived server
            key = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty,
                   tuple(id(p) for p in r.processors))
            if key not in self._pipes:
                if len(self._pipes) >= 1024:
                    self._pipes.clear()  # rows hold their pipelines; only sharing restarts
                self._pipes[key] = LogitsPipeline(sampling, r.processors)
            pipeline = self._pipes[key]
        gen, seed = self.generator, None
        if r.seed is not None:  # its samples keyed on (seed, lane), its stream for the other draws
            gen, seed = torch.Generator(device=self.device).manual_seed(lane_seed(r.seed, r.lane)), (r.seed, r.lane)
        return Row(r.key, list(r.prompt), len(r.prompt), r.max_new_tokens, pipeline, gen, tuple(r.prefix), r.stop,
                   r.logprobs, r.tenant, grammar=r.grammar, seed=seed)

    # ---- rows leave -------------------------------------------------------------------------------
    def remove(self, keys: Sequence[Hashable]) -> None:
        """Drop rows (finished or cancelled) from the runtime and proposer at once."""
        gone = set(keys)
        keep = [b for b, r in enumerate(self.rows) if r.key not in gone]
        if len(keep) < len(self.rows):
            t0 = self.clock()
            if self.owns_runtime:  # else the runtime holds another batch's rows, left as they are
                self._select(keep)
            self.rows = [self.rows[b] for b in keep]
            self.stats.observe_compaction(self.clock() - t0)  # cache work between rounds, in no round's times

    def drop_finished(self) -> None:
        self.remove([r.key for r in self.rows if r.done])

    def close(self) -> None:
        """Release every row (the runtime then holds nothing of this batch; one another batch took
        over holds that batch's rows, left as they are)."""
        if self.owns_runtime:
            self._select([])
        self.rows = []

    def _select(self, keep: list[int]) -> None:
        self.runtime.select_rows(keep)
        if self.traits.row_aware:
            self.proposer.select_rows(keep)

    # ---- the steps of a round -----------------------------------------------------------------------
    def view(self) -> BatchView:
        """What the draft-length policy sees: sequences, room under each row's limit, draft keys."""
        seqs = [r.tokens for r in self.rows]
        room = [max(0, r.max_new - r.n_new - 1) for r in self.rows]
        if not self.traits.keyed:
            return BatchView(seqs, room)
        free = lambda rows, k: self.proposer.free_drafts([seqs[b] for b in rows], k)  # noqa: E731
        return BatchView(seqs, room, self.proposer.draft_keys(seqs), free)

    def draft(self, view: BatchView, ks: Sequence[int], policy: Any) -> tuple[list[int], Draft | Ranked | None]:
        """Per-row budgets (lengths within each row's room) and the proposer's draft (a tree
        drafter's ranked candidates, for the policy to size), or None; the policy runs the
        proposer's sources (``DraftPolicy.draft``)."""
        budgets = [max(0, min(int(k), room)) for k, room in zip(ks, view.room)]
        self.forced = []
        if grammar.constrained(self.rows) and (self.proposer is None or type(self.proposer).continues_ahead):
            self.forced = grammar.forced(self.rows, view.room)  # drafted ahead; the proposer goes on after
            budgets = [max(0, min(k, room - len(f))) for k, room, f in zip(budgets, view.room, self.forced)]
        self._budgets = budgets  # the deepest draft each row may hold (``_check_draft``)
        if self.proposer is None or max(budgets, default=0) == 0:
            return budgets, None
        hidden = [r.hidden for r in self.rows] if self.traits.needs_hidden else None
        ctx = ProposeContext(view.sequences, budgets, self._row_pipelines(self.rows),
                             self.generator, self.runtime.capabilities.tree_mask, hidden,
                             [r.tenant for r in self.rows], self.forced, [r.generator for r in self.rows],
                             [r.prefix for r in self.rows])
        return budgets, policy.draft(self.traits.sources, ctx)

    def place(self, draft: Draft | None) -> Draft | None:
        """The sized draft (forced tokens ahead), cut to what the runtime's shared pool holds and to
        the widest forward it runs (``loop.capacity``), on the runtime's device (moved once), and its rows' grammar masks
        built where its tokens are. The proposer's draft is checked first (``api_inputs.check_draft``):
        its values only where reading them costs no device sync or the drafter is not the package's own."""
        self._check_draft(draft)
        draft = grammar.splice(draft, self.forced)
        draft = fit_pool(draft, pool_of(self.runtime), [len(r.tokens) - 1 for r in self.rows], max_nodes(self.runtime))
        if self.forced:
            self.forced = [f[: draft.size if draft is not None else 0] for f in self.forced]
        self._masks = grammar.round_masks(self.rows, draft, self.device)
        return draft.to(self.device) if draft is not None else None

    def _check_draft(self, draft: Any) -> None:
        """``api_inputs.check_draft``: shapes always; values where the draft is on the host (free)
        or the drafter is not the package's own (a read that syncs: its drafts are not known right)."""
        if self.proposer is None:
            return
        tensors = (draft.tokens, draft.probs, draft.valid) if isinstance(draft, Draft) else ()
        on_host = all(not isinstance(t, torch.Tensor) or t.device == HOST for t in tensors)
        check_draft(draft, len(self.rows), self.runtime.vocab_size, type(self.proposer).__name__,
                    values=on_host or self._foreign, budgets=self._budgets)

    def verify_input(self, draft: Draft | None) -> tuple[torch.Tensor, TreeLayout]:
        """The forward's input [B, 1 + n] (pending token + drafted nodes) on the runtime's device,
        and the layout of root + nodes (each row's own, for per-row trees)."""
        pending = upload_tensor([[r.tokens[-1]] for r in self.rows], self.device)
        if draft is None:
            return pending, layout((-1,))
        return torch.cat([pending, draft.tokens.to(torch.long)], 1), forward_layout(draft.parents)

    def process(self, logits: torch.Tensor, tokens: torch.Tensor, tree: TreeLayout) -> torch.Tensor:
        """Each row's sampling pipeline over every node, with the prefix that node would have."""
        self._logits = logits
        parents = tree.parents if tree.rows is None else RowTrees(tree.rows, tuple(tree.depth.tolist()))
        return self._process(self.rows, grammar.apply_masks(logits, self._masks), tokens, parents)

    def _process(self, rows: Sequence[Row], logits: torch.Tensor, tokens: torch.Tensor,
                 parents: Parents) -> torch.Tensor:
        """Processed logits of ``rows``; the nodes whose processing raises (``loop.processing``)
        are kept for ``_verify``, which fails a row at one only where its verdict reads it (rows
        whose result is not a distribution are found there, on the device, without a sync)."""
        pipes = self._row_pipelines(rows)
        seen = seen_sequences(rows, self.device) if pipes.needs_prefix else [r.tokens for r in rows]  # else read by none
        z, self._raised = processing.process(pipes, rows, logits, seen, tokens, parents)
        return z

    def verify(self, draft: Draft | None, z: torch.Tensor) -> Verdict:
        """The only accept/reject code (``verify.py``) over the rows, read in the round's one fetch
        (kept for ``emit`` and the round's record: ``fetched``)."""
        verdict, self.fetched = self._verify(self.rows, draft, z, self._logits)
        return verdict

    def seen(self, draft: Draft | None) -> Draft | None:
        """The draft as the round's record keeps it: its valid mask on the host too, where the
        round's one fetch read it."""
        if draft is None or "valid" not in self.fetched:
            return draft
        return replace(draft, host_valid=torch.from_numpy(self.fetched["valid"]))

    def check(self) -> None:
        """The batch's invariants: the runtime holds exactly its rows, each live row's cache is its
        sequence minus the pending token, and a RowAware proposer follows the same rows. A batch
        another took the runtime from holds nothing there: none if it holds no rows, refused
        (``check_owner``) if it does."""
        if not self.owns_runtime:
            self.check_owner()
            return
        check_held(self.runtime, self.rows, self.proposer if self.traits.row_aware else None)

    def emit(self, verdict: Verdict, keep: list[list[int]], tokens: torch.Tensor, z: torch.Tensor,
             hidden: torch.Tensor | None) -> list[Emission]:
        """Append each row's accepted tokens and its next token, stopping at EOS, its limit or its
        stop rule; keep the target features of the committed path for the proposer."""
        kept = self._kept_hidden(hidden, keep)
        out = []
        for b, r in enumerate(self.rows):
            if r.error is not None:
                out.append(Emission(r.key, [], [], "error", r.error))
                continue
            out.append(r.emit(verdict.tokens[b] + [verdict.next_tokens[b]], self.eos, self.fetched, b,
                              self._failing.get(b)))
        if kept is not None and self.proposer is not None:  # on the host: no device sync
            need = self.proposer.features_pending([r.tokens for r in self.rows])
            for b, r in enumerate(self.rows):
                if not r.done:  # a finished row leaves before the next draft
                    r.keep_features(kept[b, : len(keep[b])], need[b])
        self._logits = None  # not held between rounds
        return out

    def _kept_hidden(self, hidden: torch.Tensor | None, keep: list[list[int]]) -> torch.Tensor | None:
        """The target features of each row's committed nodes [B, max kept, H], gathered on the device
        with one index upload (each row then reads its first len(keep) of them)."""
        if hidden is None:
            return None
        width = max(len(k) for k in keep)
        idx = upload_tensor([list(k) + [0] * (width - len(k)) for k in keep], hidden.device)
        return hidden.gather(1, idx[..., None].expand(*idx.shape, hidden.shape[-1]))

    def observe(self, record: RoundRecord) -> None:
        """The proposer learns (and rolls back its own cache) first, then stats and observers."""
        if self.proposer is not None:
            t0, f0 = self.clock(), self.proposer.draft_forward_time
            self.proposer.observe(record)
            spent = self.clock() - t0
            record.times.draft += spent  # drafting's share of the round ...
            record.times.total += spent  # ... and of its total, taken before this step
            record.times.draft_forward += self.proposer.draft_forward_time - f0
        self.stats.observe(record)
        for o in self.observers:
            o.observe(record)

    # ---- mechanics ----------------------------------------------------------------------------------
    def _row_pipelines(self, rows: Sequence[Row]) -> RowPipelines:
        """The rows' pipelines seen as one, built once per batch composition (a round reads it
        twice: the proposer's context and the logits processing)."""
        key = tuple(id(r.pipeline) for r in rows)
        if self._rp is None or self._rp[0] != key:
            self._rp = (key, RowPipelines([r.pipeline for r in rows]))
        return self._rp[1]

    def _verify(self, rows: Sequence[Row], draft: Draft | None, z: torch.Tensor, logits: torch.Tensor | None
                ) -> tuple[Verdict, dict]:
        """The registered verifier on row groups (greedy rows together, sampled rows by
        generator), read in the round's one fetch with the nodes whose processed logits are
        unusable (``broken_nodes``) that a row's path reads (the root or an accepted node, as plain
        decoding would read them): such a row keeps its accepted tokens before the first and then
        fails alone (``verdicts.failures``, ``Row.emit``). Such a node off the path (after a drafted
        token its parent never allows) is a placeholder the verdict does not read."""
        broken = broken_nodes(rows, z)  # [B, 1 + n] nodes, on the device
        known = [b for b, r in enumerate(rows) if r.error is not None]
        if known:
            broken[upload_tensor(known, broken.device)] = True
        z = torch.where(broken[..., None], torch.zeros((), dtype=z.dtype, device=z.device), z)
        dv = verify_groups(self.verifier, rows, draft, z, lambda r: "greedy" if r.pipeline.greedy else id(r.generator),
                           self.traits.point_masses)
        bad = torch.cat([broken[:, :1], broken[:, 1:] & dv.path], 1)  # [B, 1 + n]: the root, or a node on the path
        lp = logits if any(r.logprobs for r in rows) else None
        extra = {k: v for src in self.traits.sources for k, v in src.to_fetch(z).items()}
        raised, self._raised = self._raised, None
        verdict, host = read_round(dv, draft, z, bad, lp, self.top_logprobs, extra)
        self._failing = failures(verdict, host["bad"], raised.errors if raised is not None else {})
        return verdict, host

