"""EAGLE: a one-layer drafter continues the target's features autoregressively.

State: the drafter's own KV cache over committed positions only. Each round it first catches
up on the pairs (f_j, x_{j+1}) the target committed since it last drafted (``ctx.hidden``: the
features of the root and accepted nodes, whose next tokens are now known, kept by the batch
through rounds it did not draft: ``features_pending``), then drafts from the feature it
predicts for the pending token's position. Draft steps attend to the cache plus their own
ancestors and are never written to the cache, so rejected drafts need no rollback.

Modes: ``chain`` (top-1, ``num_draft_tokens`` deep) and ``tree`` (EAGLE-2 dynamic tree: at
each depth expand the ``top_k`` nodes with the highest cumulative draft log-probability, each
into its ``top_k`` best children), built on the drafter's device and laid over a layered shape
of ``tree_nodes`` slots chosen on the host (``proposers/eagle_tree.py``); a chain is the same with
one candidate per depth. The draft stays on the device: the policy prices its slots by the
drafter's running mean scores, which the round's one fetch brings back (``to_fetch``). Drafts
are deterministic, hence point masses (``probs=None``) for the exact verifier.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, model_validator

from spec_plugins.backends import torch_kernels
from spec_plugins.fixed_steps import ROW_BUCKETS, FixedSteps, Mode
from spec_plugins.slots import KVSlots, additive, pad_slots
from spec_plugins.config import ProposerConfig
from spec_plugins.heads.eagle import EagleDrafter
from spec_plugins.heads.runner import OrtEagleLayer, head_session, pick_engine
from spec_plugins.policy.tree_size import MAX_AUTO_NODES
from spec_plugins.proposers.base import ProposeContext, Proposer, RoundRecord
from spec_plugins.proposers.eagle_tree import Candidates, SlotMeans, expand, ranked_rows, select
from spec_plugins.proposers.medusa import resolve_head_dir
from spec_plugins.registry import register_proposer
from spec_plugins.transfer import HOST, upload, upload_tensor
from spec_plugins.types import Draft, Ranked, Shaped

_INSTANCES = itertools.count()  # numbers each drafter's fetch name (``to_fetch``)
# one more catch-up forward, in padded queries' worth: large enough that running rows (backlogs of
# 1..depth+1) share one forward at any batch size a server runs, so only a long backlog (a joining
# prompt, a child the gate skipped for many rounds) runs apart; a launch-bound GPU forward costs many queries
CATCH_UP_FORWARD_COST = 512


def backlog_groups(pending: Sequence[int], forward_cost: int = CATCH_UP_FORWARD_COST) -> list[tuple[list[int], int]]:
    """The rows to catch up in one forward each, as (rows ascending, width = the group's longest
    backlog, at least 1): of the splits into runs of backlogs by size, the one with the fewest
    queries (rows x width) plus ``forward_cost`` per forward, fewest forwards on a tie. A long
    backlog (a joining prompt) thus never pads the short ones, while close backlogs share one
    forward. A dynamic programme over the distinct backlogs (few: running rows have 1..depth+1)."""
    width = [max(1, n) for n in pending]
    sizes = sorted(set(width), reverse=True)
    count = [width.count(w) for w in sizes]
    best, cut = [0.0] * (len(sizes) + 1), [len(sizes)] * (len(sizes) + 1)  # from size i on: least cost, next cut
    for i in reversed(range(len(sizes))):
        best[i], rows = math.inf, 0
        for j in range(i, len(sizes)):
            rows += count[j]
            cost = rows * sizes[i] + forward_cost + best[j + 1]
            if cost <= best[i]:
                best[i], cut[i] = cost, j + 1
    groups, i = [], 0
    while i < len(sizes):
        members = set(sizes[i:cut[i]])
        groups.append(([b for b, w in enumerate(width) if w in members], sizes[i]))
        i = cut[i]
    return groups


@register_proposer("eagle")
class EagleProposer(Proposer):
    needs_hidden = True
    ranks = True
    drafter_class: type[EagleDrafter] = EagleDrafter

    class Config(ProposerConfig):
        type: Literal["eagle"] = "eagle"
        heads: str = Field(description="Directory of a trained drafter (head.safetensors + config.json), "
                                       "from `spec-plugins train eagle`.")
        mode: Literal["tree", "chain"] = Field("tree", description="EAGLE-2 dynamic tree, or a top-1 chain.")
        tree_nodes: int | Literal["auto"] = Field(
            16, description="Tree mode: nodes kept after reranking; 'auto' picks per round and row the "
            "count with the most expected tokens per second from the drafter's own path probabilities "
            "(calibrated online) and the runtime's measured forward-cost curve.")
        top_k: int = Field(4, ge=1, le=16, description="Tree mode: children per expanded node and nodes expanded per depth.")
        engine: Literal["auto", "torch", "onnxruntime"] = Field(
            "auto", description="Where the drafter runs; auto = ONNX Runtime when the target runs there, else PyTorch.")

        @property
        def auto_tree(self) -> bool:
            return self.tree_nodes == "auto" and self.mode == "tree"

        @model_validator(mode="after")
        def _check(self) -> "EagleProposer.Config":
            if self.tree_nodes != "auto" and not (1 <= self.tree_nodes <= 256):
                raise ValueError(f"tree_nodes must be 'auto' or 1..256, got {self.tree_nodes}")
            return self

    def __init__(self, config: "EagleProposer.Config", target: Any = None, drafter: EagleDrafter | None = None,
                 step_mode: Mode | None = None, **_: object) -> None:
        """``step_mode``: how the draft steps run (``fixed_steps``); by default as the target's verify
        step does (compiled or captured over a static cache), eagerly in ONNX Runtime."""
        self.config = config
        if drafter is None:
            if target is None:
                raise ValueError("eagle needs the target (its LM head and embeddings are shared with the drafter)")
            drafter = self.drafter_class.from_pretrained(str(resolve_head_dir(config.heads)), target)
        self.drafter = drafter.eval()
        vocab = drafter.vocab_ids.numel()
        if config.mode == "tree" and config.top_k > vocab:
            raise ValueError(f"{config.type}: top_k={config.top_k} children per node, but the drafter's draft "
                             f"vocabulary has {vocab} tokens; set top_k to at most {vocab}")
        self.feature_layers = drafter.config.feature_layers  # () = the target's last hidden state
        self.layer: Any = self.drafter  # the drafter's layer, in PyTorch or ONNX Runtime
        ort = pick_engine(config.engine, target) == "onnxruntime"
        self.step_mode: Mode = "eager" if ort else step_mode or getattr(target, "step_mode", "eager")
        # few-row matmuls measured for eager steps (a compiled or captured step runs native kernels)
        self.kernels = self.drafter.use_measured_kernels() if self.step_mode == "eager" else None
        if ort:
            self.layer = OrtEagleLayer(head_session(self.drafter, target))
        # rows in the verify step's buckets: the step mixes no rows and writes no cache (``_fixed_step``)
        self._draft_step = FixedSteps(self._fixed_step, self.step_mode, row_buckets=ROW_BUCKETS)
        self._padded: tuple[torch.Tensor, ...] = ()  # the cache padded to its capacity bucket (fixed steps)
        self.tree = config.mode == "tree"
        self.dtype = drafter.lm_weight.dtype
        self.device = drafter.lm_weight.device  # the target's: the head was built there
        self.k, self.v = drafter.empty_past(0, self.dtype)  # [B, H, S, D] over the slot layer's slots
        self.slots = KVSlots()  # position of each cached pair, -1 = hole (``spec_plugins/slots.py``)
        self.fed: list[int] = []  # per row: pairs (f_j, x_{j+1}) cached for j < fed
        self.means = SlotMeans(config.top_k if self.tree else 1)  # the drafter's mean score per slot
        self._scored: tuple[torch.Tensor, tuple[int, ...]] | None = None  # last draft's slot scores, to fetch
        # the scores' name in the round's fetch, this drafter's own (a hybrid fetches two side by side)
        self._fetch_name = f"{config.type}.scores.{next(_INSTANCES)}"
        self.max_depth = 1 << 30  # a sequential drafter drafts as deep as the policy asks
        self.catch_up_forward_cost = CATCH_UP_FORWARD_COST  # how ``backlog_groups`` splits the catch-up

    # ---- cache: the shared slot layer, one drafter layer ------------------------------------------
    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        """New rows start with an empty drafter cache; their prompt pairs are fed by the next
        ``propose`` (catch-up), from the target features of their prefill."""
        new = KVSlots.empty(len(prompts))
        pad_old, pad_new = self.slots.append_rows(new)
        k, v = self.drafter.empty_past(len(prompts), self.dtype)
        self.k = torch.cat([pad_slots(self.k, pad_old), pad_slots(k, pad_new)], 0)
        self.v = torch.cat([pad_slots(self.v, pad_old), pad_slots(v, pad_new)], 0)
        self.fed += [0] * len(prompts)

    def select_rows(self, rows: Sequence[int]) -> None:
        idx, plan = self.slots.select_rows(rows)
        idx, plan = upload(idx, self.device), plan.to(self.device)
        self.k, self.v = plan.apply(self.k[idx]), plan.apply(self.v[idx])
        self.fed = [self.fed[r] for r in rows]
        self._compact()

    def num_rows(self) -> int:
        return self.slots.rows

    def _compact(self) -> None:
        """Squeeze out holes once they are the majority (rows accept different counts)."""
        if self.slots.mostly_holes():
            plan = self.slots.compact().to(self.device)
            self.k, self.v = plan.apply(self.k), plan.apply(self.v)

    def features_pending(self, sequences: Sequence[Sequence[int]]) -> list[int]:
        """The pairs (f_j, x_{j+1}) not fed yet, j = fed..len(seq)-2: their features are what the
        next catch-up reads, however many rounds passed without a draft."""
        if len(sequences) != len(self.fed):
            raise ValueError(f"{self.config.type}: {len(sequences)} sequences for {len(self.fed)} rows followed")
        return [len(seq) - 1 - fed for seq, fed in zip(sequences, self.fed)]

    def _catch_up(self, ctx: ProposeContext) -> torch.Tensor:
        """Feed the pairs committed since each row was last fed; returns the predicted feature at
        each row's pending position [B, H]. Rows run in groups of similar backlog
        (``backlog_groups``), so a joining prompt never pads the running rows to its length; every
        group's keys and values land right-aligned in the same new slots of the one cache. Token
        ids and positions are laid out on the host (slot bookkeeping) and moved once; features
        stay on the drafter's device."""
        B = len(ctx.sequences)
        pending = self.features_pending(ctx.sequences)
        if len(ctx.hidden) != B:
            raise ValueError(f"{self.config.type}: target features for {len(ctx.hidden)} rows, sequences for {B}")
        for b, (n, hid) in enumerate(zip(pending, ctx.hidden)):  # checked whole: no row fed on a refusal
            if hid.shape[0] < n:
                raise ValueError(f"{self.config.type}: row {b} has {n} committed positions the drafter has not fed, "
                                 f"but {hid.shape[0]} target features were passed; pass the features of those {n} "
                                 "positions (Proposer.features_pending)")
        rows = []
        for b, (seq, m, hid) in enumerate(zip(ctx.sequences, pending, ctx.hidden)):
            start = len(seq) - 1 - m
            rows.append((hid[hid.shape[0] - m:], list(seq[start + 1: len(seq)]), start, m))
            self.fed[b] = len(seq) - 1
        N = max(1, max(pending))
        pos = torch.full((B, N), -1, dtype=torch.long, device=HOST)  # the new slots: each row's pairs right-aligned
        for b, (_, _, start, m) in enumerate(rows):
            pos[b, N - m:] = torch.arange(start, start + m, device=HOST)
        groups = backlog_groups(pending, self.catch_up_forward_cost)
        fed = [self._feed_group(rows, g, pos[g, N - w:]) for g, w in groups]
        # _anchor: the last committed pair's input, per row (a parallel drafter's blocks read it)
        if len(groups) == 1:
            out, self._anchor, k, v = fed[0]
        else:  # back to row order, each group's keys behind hole slots up to the widest group's N
            order = upload(torch.argsort(torch.as_tensor([b for g, _ in groups for b in g], device=HOST)), self.device)
            out, self._anchor = (torch.cat([f[i] for f in fed])[order] for i in (0, 1))
            k, v = (torch.cat([pad_slots(f[i], N - w) for f, (_, w) in zip(fed, groups)])[order] for i in (2, 3))
        self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        self.slots.append(pos)
        self._compact()
        self._past = upload(self.slots.pos >= 0, self.device)  # [B, S] cached pairs each draft step may see
        if self.step_mode != "eager":  # fixed shapes: the cache padded to a power of two (few shapes)
            pad = max(64, 1 << (self._past.shape[1] - 1).bit_length()) - self._past.shape[1]
            pad4 = (0, 0, 0, pad)
            pad_ = torch.nn.functional.pad
            self._padded = (pad_(self.k, pad4), pad_(self.v, pad4), pad_(self._past, (0, pad)))
        return out

    def _feed_group(self, rows: list[tuple[torch.Tensor, list[int], int, int]], group: list[int], pos: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
        """One drafter forward over the rows ``group`` (ascending) and their pairs right-aligned in
        ``pos`` [G, n] (-1 = padding), over their cached pairs: (each row's last output [G, H], its
        last projected input [G, H], the new keys and values [G, h, n, d])."""
        G, n = pos.shape
        feat = torch.zeros(G, n, self.drafter.config.feature_size, dtype=self.dtype, device=self.device)
        tok = torch.zeros(G, n, dtype=torch.long, device=HOST)
        for i, b in enumerate(group):
            hid, nxt, _, m = rows[b]
            if m:
                feat[i, n - m:] = hid.to(self.dtype)
                tok[i, n - m:] = torch.as_tensor(nxt, device=HOST)
        new_ok = (pos >= 0)[:, None, :] & torch.ones(n, n, dtype=torch.bool, device=HOST).tril()[None]
        new_ok |= torch.eye(n, dtype=torch.bool, device=HOST)[None]  # padding queries see themselves
        past_ok, k, v = self.slots.past_ok(n), self.k, self.v
        if G < self.slots.rows:  # only this group's rows of the cache
            idx = torch.as_tensor(group, dtype=torch.long, device=HOST)
            past_ok, (k, v) = past_ok[idx], (t[upload(idx, self.device)] for t in (self.k, self.v))
        ok = upload(torch.cat([past_ok, new_ok[:, None]], -1), self.device)
        proj = self.drafter.project(feat)
        out, k, v = self.layer(proj, upload(tok, self.device), upload(pos.clamp_min(0), self.device), k, v,
                               additive(ok, self.dtype))
        return out[:, -1], proj[:, -1], k, v

    # ---- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> Ranked | None:
        """Each row's chain or tree over the shape the host chose, on the device, with each slot's
        estimate (the drafter's mean score there) for the draft policy to keep what pays."""
        if ctx.hidden is None:
            raise RuntimeError("eagle needs target hidden states (needs_hidden) but the loop passed none")
        with torch_kernels.active():
            f = self._catch_up(ctx)
            depth = min(max(ctx.budgets, default=0), self.max_depth)
            if depth <= 0:
                return None
            tree = self.tree and ctx.tree_ok
            nodes = (MAX_AUTO_NODES if self.config.tree_nodes == "auto" else self.config.tree_nodes) if tree else depth
            widths = self.means.widths(nodes, depth) if tree else (1,) * depth
            B = len(ctx.sequences)
            base = upload_tensor([len(s) - 1 for s in ctx.sequences], self.device)  # the pending token's position
            host = self.device == HOST  # reading the candidates is free: each row priced by its own scores
            cands = self._candidates(f, base, depth if host else len(widths), self.config.top_k if tree else 1)
            if host:
                return ranked_rows(cands, nodes, list(ctx.budgets), tree and self.config.tree_nodes == "auto")
            tokens, parents, valid, probs = select(cands, widths, list(ctx.budgets))
        self._scored = (probs, widths)
        shape = parents if tree else tuple(range(-1, len(widths) - 1))  # a chain: one topology for every row
        draft = Draft(tokens, shape, None, valid)
        return Ranked([[] for _ in range(B)], tree and self.config.tree_nodes == "auto",
                      [Shaped(draft, self.means.estimates(widths))])

    def _candidates(self, f: torch.Tensor, base: torch.Tensor, depth: int, top_k: int) -> Candidates:
        """EAGLE-2's expansion: one drafter step per depth, each feeding the expanded nodes."""
        past = list(self.drafter.empty_past(f.shape[0], self.dtype))

        def step(feat: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
            out, k, v = self._step(feat, tok, pos, past[0], past[1], anc)
            past[0], past[1] = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
            return out

        return expand(step, self.drafter.logits, f, base, depth, top_k, self.drafter.vocab_ids)

    def to_fetch(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """The last draft's slot scores, read in the round's one fetch (they update the means)."""
        return {self._fetch_name: self._scored[0]} if self._scored is not None else {}

    def observe(self, record: RoundRecord) -> None:
        scores = record.fetched.get(self._fetch_name)
        if scores is not None and self._scored is not None:
            self.means.observe(scores, self._scored[1])
        self._scored = None

    def _step(self, feat: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
              anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One drafter call for F new nodes per row [B, F]; ``anc`` [B, F, E] marks which of the
        E earlier draft slots (dk, dv) each new node may see (its ancestors). Eager, or compiled
        / captured per shape over the padded cache (``step_mode``)."""
        if self.step_mode == "eager":
            return self._fixed_step(feat, tok, pos, self.k, self.v, self._past, dk, dv, anc, self.layer)
        return self._draft_step(feat, tok, pos, *self._padded, dk, dv, anc)

    def _fixed_step(self, feat: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    past: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, anc: torch.Tensor, layer: Any = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft step as a function of tensors only (what is compiled or captured): the cached
        pairs ``k``, ``v`` [B, h, S, d] with ``past`` [B, S] saying which are live. Each row reads its
        own rows only and nothing is written in place (the new keys are returned), so compiled or
        captured calls run padded to a row bucket (``FixedSteps`` ``row_buckets``)."""
        B, F_ = tok.shape
        seen = past[:, None, None, :].expand(B, 1, F_, past.shape[1])
        ok = torch.cat([seen, anc[:, None], torch.eye(F_, dtype=torch.bool, device=tok.device).expand(B, 1, F_, F_)], -1)
        return (layer or self.drafter)(feat, tok, pos, torch.cat([k, dk], 2), torch.cat([v, dv], 2),
                                       additive(ok, self.dtype))
