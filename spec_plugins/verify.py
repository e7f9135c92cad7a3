"""Accept/reject math, written once, over tensors. Every runtime only supplies logits.

Notation (Leviathan et al. / Chen et al.): ``p`` target probabilities, ``q`` draft
probabilities, ``x`` drafted tokens. A draft is a tree of ``n`` nodes given by ``parents``
(-1 = child of the root); node ``i``'s target distribution sits at forward index ``i + 1``
(index 0 is the root: the pending token whose logits score the first draft level).

Chain rule (exact): accept x_i with probability min(1, p(x_i) / q(x_i)); at the first
rejection emit a token from norm(max(0, p - q)); if every draft token passes, emit a bonus
token from p at the last node. ``q is None`` means each node is a point mass (n-gram, tree
drafters): then accept with probability p(x_i) and the residual is p with x_i removed.

Tree rule (exact, recursive rejection sampling over siblings). At a node with residual
distribution r (initially p at that node), try its children c_1..c_m in order:
accept c_k with probability min(1, r(x_k) / q(x_k)); on rejection r <- norm(max(0, r - q)).
If a child is accepted, descend with r = p at that child; if all are rejected (or there are
no children), emit a token from r.

Proof sketch for the tree rule with point-mass children (distinct tokens t_1..t_m): the
probability of emitting t_k is prod_{j<k} (1 - r_j(t_j)) * r_k(t_k), and since
r_k = r / (1 - sum_{j<k} r(t_j)) this telescopes to r(t_k); a token y outside the candidates
is emitted with probability (1 - sum_j r(t_j)) * r(y) / (1 - sum_j r(t_j)) = r(y). With
stochastic children drawn i.i.d. from q the same holds by the one-step argument applied
repeatedly (each step's output is r; the residual after a rejection is exactly r's
distribution conditioned on rejection), which is SpecInfer's multi-round theorem. Greedy
decoding is the temperature-0 limit: accept while x equals the target argmax.
"""

from __future__ import annotations

import torch

from spec_plugins.sampling import sample
from spec_plugins.tree import children, layout, path_to
from spec_plugins.types import Verdict

__all__ = ["Verdict", "greedy_verify", "rejection_verify", "typical_verify"]


def greedy_verify(
    x: torch.Tensor, parents: tuple[int, ...], target: torch.Tensor, valid: torch.Tensor | None = None
) -> Verdict:
    """x [B, n] drafted tokens; target [B, n+1, V] processed logits (or [B, n+1] argmax ids)."""
    top = target.argmax(-1) if target.dim() == 3 else target  # [B, n+1]
    B, n = x.shape
    if n == 0:
        return Verdict([[] for _ in range(B)], top[:, 0].tolist())
    if layout(parents).is_chain:
        match = x == top[:, :-1]
        if valid is not None:
            match &= valid
        a = match.long().cumprod(1).sum(1)  # leading matches per row
        nxt = top.gather(1, a[:, None]).squeeze(1)
        return Verdict([list(range(k)) for k in a.tolist()], nxt.tolist())
    kids = children(parents)
    xs, tops = x.tolist(), top.tolist()
    ok = valid.tolist() if valid is not None else None
    accepted, nxt = [], []
    for b in range(B):
        path, node = [], -1  # node -1 = root
        while True:
            want = tops[b][node + 1]
            nxt_node = next((c for c in kids[node] if xs[b][c] == want and (ok is None or ok[b][c])), None)
            if nxt_node is None:
                break
            path.append(nxt_node)
            node = nxt_node
        accepted.append(path)
        nxt.append(tops[b][node + 1])
    return Verdict(accepted, nxt)


def rejection_verify(
    x: torch.Tensor,
    parents: tuple[int, ...],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    valid: torch.Tensor | None = None,
) -> Verdict:
    """Exact speculative sampling. x [B, n]; p [B, n+1, V] target probs; q [B, n, V] or None."""
    B, n = x.shape
    if n == 0:
        return Verdict([[] for _ in range(B)], sample(p[:, 0], generator).tolist())
    if layout(parents).is_chain:
        return _chain(x, p, q, generator, valid)
    return _tree(x, parents, p, q, generator, valid)


def _chain(x, p, q, generator, valid) -> Verdict:
    B, n = x.shape
    p_x = p[:, :n].gather(-1, x[..., None]).squeeze(-1)  # p(x_i | prefix, x_<i)
    q_x = q.gather(-1, x[..., None]).squeeze(-1) if q is not None else torch.ones_like(p_x)
    u = torch.rand(B, n, generator=generator, device=p.device)
    ok = u * q_x < p_x  # u < p/q  <=>  accept with probability min(1, p/q)
    if valid is not None:
        ok &= valid
    a = ok.long().cumprod(1).sum(1)  # [B] accepted count
    rows = torch.arange(B, device=p.device)
    p_a = p[rows, a]  # target distribution where the first rejection happened (or the bonus)
    resid = p_a.clone()
    rejected = a < n  # a real draft token was rejected (not just the end of the draft)
    if valid is not None:
        rejected &= valid[rows, a.clamp(max=n - 1)]
    if rejected.any():
        r = rows[rejected]
        ar = a[rejected]
        if q is not None:
            resid[r] = (p_a[r] - q[r, ar]).clamp_min(0.0)  # norm(max(0, p - q))
        else:
            resid[r, x[r, ar]] = 0.0  # point mass: p without the rejected token
        # p == q exactly would leave nothing; that case cannot reject (u < 1), but be safe
        empty = resid[r].sum(-1) <= 0
        if empty.any():
            resid[r[empty]] = p_a[r[empty]]
    nxt = sample(resid, generator)
    return Verdict([list(range(k)) for k in a.tolist()], nxt.tolist())


def _tree(x, parents, p, q, generator, valid) -> Verdict:
    kids = children(parents)
    B, _ = x.shape
    xs = x.tolist()
    ok = valid.tolist() if valid is not None else None
    accepted, nxt = [], []
    for b in range(B):
        path, node = [], -1
        while True:
            r = p[b, node + 1].clone()  # residual starts as the target distribution here
            chosen = None
            for c in kids[node]:
                if ok is not None and not ok[b][c]:
                    continue
                t = xs[b][c]
                u = torch.rand((), generator=generator, device=p.device)
                if q is None:
                    if u < r[t]:
                        chosen = c
                        break
                    r[t] = 0.0
                else:
                    qc = q[b, c]
                    if u * qc[t] < r[t]:
                        chosen = c
                        break
                    r = (r - qc).clamp_min(0.0)
                s = r.sum()
                if s <= 0:  # nothing left to reject into: only possible if r was fully covered
                    r = p[b, node + 1].clone()
                    break
                r = r / s
            if chosen is None:
                nxt.append(int(sample(r[None], generator)[0]))
                break
            path.append(chosen)
            node = chosen
        accepted.append(path)
    return Verdict(accepted, nxt)


def typical_verify(
    x: torch.Tensor,
    parents: tuple[int, ...],
    p: torch.Tensor,
    epsilon: float,
    delta: float,
    generator: torch.Generator | None,
    valid: torch.Tensor | None = None,
) -> Verdict:
    """LOSSY typical acceptance (Medusa, Cai et al. 2024): NOT the target's distribution.

    A drafted token x is accepted where ``p(x) > min(epsilon, delta * exp(-H(p)))``, p being the
    target distribution at x's parent; of the root-to-node paths whose every node passes, the
    longest wins (ties: the higher sum of log p). The next token is sampled from p at the last
    accepted node, restricted to the tokens that would pass the same test (the argmax always
    does when delta < 1, since exp(-H) <= max p). Cheap and accepts more than the exact rule at
    high temperature, but the output law changes; stats and configs say ``lossy``.
    x [B, n]; p [B, n+1, V] target probabilities (index 0 = root)."""
    B, n = x.shape
    logp = p.clamp_min(1e-30).log()
    entropy = -(p * logp).sum(-1)  # [B, n+1]
    thresh = torch.clamp(delta * torch.exp(-entropy), max=epsilon)  # min(epsilon, delta * exp(-H))
    rows = torch.arange(B, device=p.device)
    best = torch.full((B,), -1, dtype=torch.long, device=p.device)
    accepted: list[list[int]] = [[] for _ in range(B)]
    if n > 0:
        lay = layout(parents)
        par_fwd = torch.tensor([q + 1 for q in parents], device=p.device)  # forward index of each parent
        p_x = p[:, par_fwd].gather(-1, x[..., None]).squeeze(-1)  # [B, n]
        ok = p_x > thresh[:, par_fwd]
        if valid is not None:
            ok &= valid
        anc = lay.ancestors.to(p.device)[None]  # [1, n, n]
        path_ok = ~(anc & ~ok[:, None, :]).any(-1)  # every node on the path passes
        length = torch.where(path_ok, lay.depth.to(p.device)[None] + 1, 0)
        path_lp = (anc.float() * p_x.clamp_min(1e-30).log()[:, None, :]).sum(-1)
        key = torch.where(path_ok, path_lp, torch.full_like(path_lp, float("-inf")))
        longest = length.max(1, keepdim=True).values
        key = torch.where(length == longest, key, torch.full_like(key, float("-inf")))
        cand = key.argmax(1)
        best = torch.where(longest.squeeze(1) > 0, cand, best)
        accepted = [path_to(parents, int(j)) if j >= 0 else [] for j in best.tolist()]
    p_last = p[rows, best + 1]  # [B, V]
    keep = p_last > thresh[rows, best + 1][:, None]
    keep |= torch.nn.functional.one_hot(p_last.argmax(-1), p_last.shape[-1]).bool()
    nxt = sample(p_last * keep, generator)
    return Verdict(accepted, nxt.tolist())
