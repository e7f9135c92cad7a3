"""EAGLE: a one-layer drafter continues the target's features autoregressively.

State: the drafter's own KV cache over committed positions only. Each round it first catches
up on the pairs (f_j, x_{j+1}) the target committed last round (``ctx.hidden``: the features of
the root and accepted nodes, whose next tokens are now known), then drafts from the feature it
predicts for the pending token's position. Draft steps attend to the cache plus their own
ancestors and are never written to the cache, so rejected drafts need no rollback.

Modes: ``chain`` (top-1, ``num_draft_tokens`` deep) and ``tree`` (EAGLE-2 dynamic tree: at
each depth expand the ``top_k`` nodes with the highest cumulative draft log-probability, each
into its ``top_k`` best children; finally keep the ``tree_nodes`` best nodes overall, which is
closed under ancestors since a child never scores above its parent). Drafts are deterministic,
hence point masses (``probs=None``) for the exact verifier.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, model_validator

from spec_plugins.backends import torch_kernels
from spec_plugins.slots import HOST, KVSlots, additive, pad_slots
from spec_plugins.config import ProposerConfig
from spec_plugins.heads.eagle import EagleDrafter
from spec_plugins.heads.runner import OrtEagleLayer, head_session, pick_engine
from spec_plugins.policy.tree_size import MAX_AUTO_NODES
from spec_plugins.proposers.base import ProposeContext, Proposer
from spec_plugins.proposers.medusa import resolve_head_dir
from spec_plugins.registry import register_proposer
from spec_plugins.tree import rank_paths
from spec_plugins.types import Ranked, RankedRow

NEG = float("-inf")


@register_proposer("eagle")
class EagleProposer(Proposer):
    needs_hidden = True
    ranks = True

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
                 **_: object) -> None:
        self.config = config
        if drafter is None:
            if target is None:
                raise ValueError("eagle needs the target (its LM head and embeddings are shared with the drafter)")
            drafter = EagleDrafter.from_pretrained(str(resolve_head_dir(config.heads)), target)
        self.drafter = drafter.eval()
        self.feature_layers = drafter.config.feature_layers  # () = the target's last hidden state
        self.layer: Any = self.drafter  # the drafter's layer, in PyTorch or ONNX Runtime
        self.kernels = self.drafter.use_measured_kernels()  # few-row matmuls (the LM head runs in PyTorch always)
        if pick_engine(config.engine, target) == "onnxruntime":
            self.layer = OrtEagleLayer(head_session(self.drafter))
        self.tree = config.mode == "tree"
        self.dtype = drafter.lm_weight.dtype
        self.device = drafter.lm_weight.device  # the target's: the head was built there
        self.k, self.v = drafter.empty_past(0, self.dtype)  # [B, H, S, D] over the slot layer's slots
        self.slots = KVSlots()  # position of each cached pair, -1 = hole (``spec_plugins/slots.py``)
        self.fed: list[int] = []  # per row: pairs (f_j, x_{j+1}) cached for j < fed

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
        idx, plan = idx.to(self.device), plan.to(self.device)
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

    def _catch_up(self, ctx: ProposeContext) -> torch.Tensor:
        """Feed last round's committed pairs; returns the predicted feature at each row's
        pending position [B, H]. Token ids and positions are laid out on the host (slot
        bookkeeping) and moved once; features stay on the drafter's device."""
        B = len(ctx.sequences)
        rows = []
        for b, seq in enumerate(ctx.sequences):
            n = len(seq) - 1 - self.fed[b]
            hid = ctx.hidden[b]
            m = min(n, hid.shape[0])  # a round without propose() leaves a gap: skip it
            start = len(seq) - 1 - m
            rows.append((hid[hid.shape[0] - m:], list(seq[start + 1: len(seq)]), start, m))
            self.fed[b] = len(seq) - 1
        N = max(1, max(r[3] for r in rows))
        F = self.drafter.config.feature_size  # target features: last hidden, or the fused layers
        feat = torch.zeros(B, N, F, dtype=self.dtype, device=self.device)
        tok = torch.zeros(B, N, dtype=torch.long, device=HOST)
        pos = torch.full((B, N), -1, dtype=torch.long, device=HOST)
        for b, (hid, nxt, start, m) in enumerate(rows):  # right-aligned: the last pair sits at N-1
            if m:
                feat[b, N - m:] = hid.to(self.dtype)
                tok[b, N - m:] = torch.as_tensor(nxt, device=HOST)
                pos[b, N - m:] = torch.arange(start, start + m, device=HOST)
        new_ok = (pos >= 0)[:, None, :] & torch.ones(N, N, dtype=torch.bool, device=HOST).tril()[None]
        new_ok |= torch.eye(N, dtype=torch.bool, device=HOST)[None]  # padding queries see themselves
        ok = torch.cat([self.slots.past_ok(N), new_ok[:, None]], -1).to(self.device)
        out, k, v = self.layer(self.drafter.project(feat), tok.to(self.device), pos.clamp_min(0).to(self.device),
                               self.k, self.v, additive(ok, self.dtype))
        self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        self.slots.append(pos)
        self._compact()
        self._past = (self.slots.pos >= 0).to(self.device)  # [B, S] cached pairs each draft step may see
        return out[:, -1]

    # ---- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> Ranked | None:
        """Each row's chain or tree best-first with the drafter's path probabilities; the draft
        policy sizes it (``tree_nodes: auto``) and merges the rows."""
        if ctx.hidden is None:
            raise RuntimeError("eagle needs target hidden states (needs_hidden) but the loop passed none")
        with torch_kernels.active():
            f = self._catch_up(ctx)
            depth = max(ctx.budgets, default=0)
            if depth <= 0:
                return None
            base = torch.tensor([len(s) - 1 for s in ctx.sequences], dtype=torch.long, device=self.device)  # pending
            if self.tree and ctx.tree_ok:
                return self._tree(f, base, list(ctx.budgets), depth)
            return self._chain(f, base, list(ctx.budgets), depth)

    def _step(self, feat: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
              anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One drafter call for F new nodes per row [B, F]; ``anc`` [B, F, E] marks which of the
        E earlier draft slots (dk, dv) each new node may see (its ancestors)."""
        B, F = tok.shape
        past = self._past[:, None, None, :].expand(B, 1, F, self._past.shape[1])
        ok = torch.cat([past, anc[:, None], torch.eye(F, dtype=torch.bool, device=self.device).expand(B, 1, F, F)], -1)
        out, k, v = self.layer(feat, tok, pos, torch.cat([self.k, dk], 2), torch.cat([self.v, dv], 2),
                               additive(ok, self.dtype))
        return out, k, v

    def _chain(self, f: torch.Tensor, base: torch.Tensor, budgets: list[int], depth: int) -> Ranked:
        B = f.shape[0]
        vocab = self.drafter.vocab_ids
        toks = torch.zeros(B, depth, dtype=torch.long, device=self.device)
        path_p = torch.zeros(B, depth, device=self.device)  # probability of the path up to each node, by the drafter
        run = torch.ones(B, device=self.device)
        dk, dv = self.drafter.empty_past(B, self.dtype)
        for d in range(depth):
            top = self.drafter.logits(f).float().softmax(-1).max(-1)
            toks[:, d] = vocab[top.indices]
            run = run * top.values
            path_p[:, d] = run
            if d + 1 == depth:
                break
            anc = torch.ones(B, 1, d, dtype=torch.bool, device=self.device)
            out, k, v = self._step(f[:, None], toks[:, d: d + 1], (base + d)[:, None], dk, dv, anc)
            dk, dv, f = torch.cat([dk, k], 2), torch.cat([dv, v], 2), out[:, 0]
        chain = [(0,) * (d + 1) for d in range(depth)]
        rows = [[RankedRow(t[:n], chain[:n], p[:n])] for t, p, n in zip(toks.tolist(), path_p.tolist(), budgets)]
        return Ranked(rows, auto=False)

    def _tree(self, f: torch.Tensor, base: torch.Tensor, budgets: list[int], depth: int) -> Ranked:
        B, kk = f.shape[0], self.config.top_k
        vocab = self.drafter.vocab_ids
        # all candidate nodes, per row: token, cumulative log-prob, parent (-1 root), rank, depth
        lp = self.drafter.logits(f).float().log_softmax(-1)
        top = lp.topk(kk, -1)
        tok, score = vocab[top.indices], top.values  # [B, k]
        parent = torch.full((B, kk), -1, dtype=torch.long, device=self.device)
        rank = torch.arange(kk, device=self.device).expand(B, kk)
        dep = [0] * kk
        feat_of = f[:, None].expand(B, kk, -1)  # feature each node's token was drawn from
        level = torch.arange(kk, device=self.device).expand(B, kk)  # node ids of the newest level
        dk, dv = self.drafter.empty_past(B, self.dtype)
        slot_anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=self.device)  # [B, E, E] ancestry among expanded nodes
        slot_of = torch.full((B, kk), -1, dtype=torch.long, device=self.device)  # node -> draft slot once expanded
        rows = torch.arange(B, device=self.device)[:, None]
        for d in range(1, depth):
            # expand the top_k newest nodes by cumulative score
            lvl_score = score.gather(1, level)
            pick = level.gather(1, lvl_score.topk(min(kk, level.shape[1]), -1).indices)  # [B, F] node ids
            F = pick.shape[1]
            E = dk.shape[2]
            par_slot = slot_of.gather(1, parent.gather(1, pick).clamp_min(0))  # parent's slot (or junk for roots)
            is_root = parent.gather(1, pick) < 0
            anc = torch.zeros(B, F, E, dtype=torch.bool, device=self.device)
            if E:
                from_par = slot_anc[rows, par_slot.clamp_min(0)]  # [B, F, E] parent's ancestry row
                anc = torch.where(is_root[..., None], anc, from_par)
            out, k, v = self._step(feat_of[rows, pick], tok.gather(1, pick), base[:, None] + d - 1, dk, dv, anc)
            # register the new slots: ancestry = parent's ancestry + itself
            new_anc = torch.cat([anc, torch.eye(F, dtype=torch.bool, device=self.device).expand(B, F, F)], -1)  # [B, F, E+F]
            slot_anc = torch.cat([torch.cat([slot_anc, torch.zeros(B, E, F, dtype=torch.bool, device=self.device)], -1), new_anc], 1)
            dk, dv = torch.cat([dk, k], 2), torch.cat([dv, v], 2)
            slot_of = slot_of.scatter(1, pick, E + torch.arange(F, device=self.device).expand(B, F))
            # children: top_k of each expanded node
            lp = self.drafter.logits(out).float().log_softmax(-1)  # [B, F, Vd]
            top = lp.topk(kk, -1)
            n0 = tok.shape[1]
            tok = torch.cat([tok, vocab[top.indices].reshape(B, F * kk)], 1)
            score = torch.cat([score, (score.gather(1, pick)[..., None] + top.values).reshape(B, F * kk)], 1)
            parent = torch.cat([parent, pick[..., None].expand(B, F, kk).reshape(B, F * kk)], 1)
            rank = torch.cat([rank, torch.arange(kk, device=self.device).expand(B, F, kk).reshape(B, F * kk)], 1)
            dep += [d] * (F * kk)
            feat_of = torch.cat([feat_of, out[:, :, None].expand(B, F, kk, -1).reshape(B, F * kk, -1)], 1)
            slot_of = torch.cat([slot_of, torch.full((B, F * kk), -1, dtype=torch.long, device=self.device)], 1)
            level = torch.arange(n0, n0 + F * kk, device=self.device).expand(B, F * kk)
        # keep the best tree_nodes per row within its depth budget; ties favour shallower nodes
        dep_t = torch.tensor(dep, device=self.device)
        key = score - 1e-6 * dep_t[None]
        key = key.masked_fill(dep_t[None] >= torch.tensor(budgets, device=self.device)[:, None], NEG)
        auto = self.config.tree_nodes == "auto"
        keep = key.topk(min(MAX_AUTO_NODES if auto else self.config.tree_nodes, key.shape[1]), -1)
        par_l, rank_l, tok_l, score_l = parent.tolist(), rank.tolist(), tok.tolist(), score.tolist()
        cand = [[n for n, s in zip(idx, val) if s != NEG] for idx, val in zip(keep.indices.tolist(), keep.values.tolist())]
        rows = []
        for b in range(B):  # best-first: every prefix is a tree (a child never scores above its parent)
            rows.append([RankedRow([tok_l[b][n] for n in cand[b]], rank_paths(par_l[b], rank_l[b], cand[b]),
                                   [min(1.0, math.exp(score_l[b][n])) for n in cand[b]])])
        return Ranked(rows, auto=auto)
