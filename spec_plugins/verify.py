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
no children), emit a token from r. Every tree drafter here drafts point masses (top-k of a head,
lookups), for which the rule below is exact; a tree of sampled nodes is refused by name.

Point-mass drafts (every model-free proposer and the trained heads' top-k) make this rule a
one-liner over tensors: sample one token y_j from p at every position j at once; a node is
followed iff its token equals the sample at its parent (the first such sibling), and the emitted
token is the sample at the last followed node. The law is the rule's: at a node, child k is taken
with probability p(t_k), and a token y outside the children is emitted with probability p(y)
(below), exactly the distribution of one sample from p. Greedy decoding is the same walk with
each position's argmax in place of its sample. No Python loop and no host sync: the verdict stays
on the logits' device until the round fetches it once (``types.Verdict.fetch``).

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

from functools import lru_cache

import torch

from spec_plugins.keyed_draws import KeyedDraws
from spec_plugins.sampling import sample
from spec_plugins.transfer import upload, upload_tensor
from spec_plugins.row_trees import Parents, node_depths
from spec_plugins.tree import layout
from spec_plugins.types import DeviceVerdict, Verdict

__all__ = ["DeviceVerdict", "Verdict", "greedy_verify", "rejection_verify", "typical_verify"]


@lru_cache(maxsize=256)
def _shared(parents: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """On ``device``, once per draft shape: each node's parent's forward index [1, n], its ancestors
    (itself included) [1, n, n], its earlier siblings [1, n, n] and its depth [n]."""
    lay = layout(parents)
    n = len(parents)
    par = torch.tensor([p + 1 for p in parents], dtype=torch.long, device="cpu")
    earlier = torch.zeros(n, n, dtype=torch.bool, device="cpu")
    for i, p in enumerate(parents):
        for j in range(i):
            earlier[i, j] = parents[j] == p
    return tuple(upload(t, device) for t in (par[None], lay.ancestors[None], earlier[None], lay.depth))


def _topology(parents: Parents, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``_shared``'s tensors, or per row [B, ...] for ``RowTrees`` (computed on their device)."""
    if isinstance(parents, tuple):
        return _shared(parents, device)
    par = parents.parents
    n = par.shape[1]
    earlier = (par[:, :, None] == par[:, None, :]) & torch.ones(n, n, dtype=torch.bool, device=par.device).tril(-1)
    return par + 1, parents.ancestors(), earlier, upload(torch.tensor(parents.depth, dtype=torch.long,
                                                                         device="cpu"), par.device)


def follow(x: torch.Tensor, parents: Parents, y: torch.Tensor, valid: torch.Tensor | None = None
           ) -> DeviceVerdict:
    """The walk from the root: a node is taken iff its token equals ``y`` at its parent's forward
    position (the first such sibling, skipping invalid nodes); the emitted token is ``y`` at the
    last node taken. x [B, n] drafted tokens; y [B, n+1] one token per forward position."""
    B, n = x.shape
    if n == 0:
        return DeviceVerdict(torch.zeros(B, 0, dtype=torch.bool, device=y.device), y[:, 0])
    par, anc, earlier, depth = _topology(parents, y.device)  # leading dim 1 (shared) or B (per row)
    match = x == y.gather(1, par.expand(B, n))  # [B, n]
    if valid is not None:
        match &= valid
    first = match & ~(match[:, None, :] & earlier).any(-1)  # no earlier sibling matched
    on_path = ~(anc & ~first[:, None, :]).any(-1)  # every node from the root to it was taken
    reach = torch.where(on_path, depth[None] + 1, 0)  # [B, n]: the taken nodes form one root path
    got, leaf = reach.max(1)
    taken = got > 0
    path = anc.expand(B, n, n).gather(1, leaf[:, None, None].expand(B, 1, n))[:, 0] & taken[:, None]  # [B, n]
    nxt = y.gather(1, torch.where(taken, leaf + 1, 0)[:, None]).squeeze(1)
    return DeviceVerdict(path, nxt)


def greedy_verify(x: torch.Tensor, parents: Parents, target: torch.Tensor,
                  valid: torch.Tensor | None = None) -> DeviceVerdict:
    """x [B, n] drafted tokens; target [B, n+1, V] processed logits (or [B, n+1] argmax ids)."""
    return follow(x, parents, target.argmax(-1) if target.dim() == 3 else target, valid)


def rejection_verify(
    x: torch.Tensor,
    parents: Parents,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | KeyedDraws | None,
    valid: torch.Tensor | None = None,
) -> DeviceVerdict:
    """Exact speculative sampling. x [B, n]; p [B, n+1, V] target probs; q [B, n, V] or None.
    ``generator``: a stream, or seeded rows' ``KeyedDraws`` for point masses (each sample keyed on
    its absolute position, so a row's output does not depend on the draft schedule)."""
    B, n = x.shape
    if q is None or n == 0:  # point masses, chain or tree: one sample per position, follow the matches
        if isinstance(generator, KeyedDraws):
            offsets = upload_tensor([0, *(d + 1 for d in node_depths(parents))], p.device)
            y = generator.sample(p, offsets)
        else:
            y = sample(p.reshape(B * (n + 1), -1), generator).view(B, n + 1)
        return follow(x, parents, y, valid)
    if not (isinstance(parents, tuple) and layout(parents).is_chain):
        raise ValueError("drafts with their own distributions (a draft model's) are verified as chains; "
                         "a tree of sampled nodes has no drafter here")
    return _chain(x, p, q, generator, valid)


def _chain(x, p, q, generator, valid) -> DeviceVerdict:
    """Drafts drawn from q (a draft model): accept x_i with probability min(1, p/q), at the first
    rejection sample norm(max(0, p - q)); all on the device, no branch on tensor values. Each q row
    is normalised first: a drafter samples from q / sum(q) (``torch.multinomial``), and a row whose
    sum misses 1 (within ``api_inputs.Q_SUM_TOLERANCE``) would otherwise bias the output law."""
    B, n = x.shape
    q = q.float()
    q = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)  # an all-zero row stays zero
    p_x = p[:, :n].gather(-1, x[..., None]).squeeze(-1)  # p(x_i | prefix, x_<i)
    q_x = q.gather(-1, x[..., None]).squeeze(-1)
    u = torch.rand(B, n, generator=generator, device=p.device)
    ok = u * q_x < p_x  # u < p/q  <=>  accept with probability min(1, p/q)
    if valid is not None:
        ok &= valid
    a = ok.long().cumprod(1).sum(1)  # [B] accepted count
    rows = torch.arange(B, device=p.device)
    p_a = p[rows, a]  # target distribution where the first rejection happened (or the bonus)
    rejected = a < n  # a real draft token was rejected (not just the end of the draft)
    if valid is not None:
        rejected &= valid[rows, a.clamp(max=n - 1)]
    resid = (p_a - q[rows, a.clamp(max=n - 1)]).clamp_min(0.0)  # norm(max(0, p - q))
    # p == q exactly would leave nothing; that case cannot reject (u < 1), but be safe
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_a)
    nxt = sample(torch.where(rejected[:, None], resid, p_a), generator)
    path = torch.arange(n, device=p.device)[None] < a[:, None]
    return DeviceVerdict(path, nxt)


def typical_verify(
    x: torch.Tensor,
    parents: Parents,
    p: torch.Tensor,
    epsilon: float,
    delta: float,
    generator: torch.Generator | None,
    valid: torch.Tensor | None = None,
) -> DeviceVerdict:
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
    path = torch.zeros(B, n, dtype=torch.bool, device=p.device)
    if n > 0:
        par_fwd, anc, _, depth = _topology(parents, p.device)
        par_fwd = par_fwd.expand(B, n)
        p_x = p.gather(1, par_fwd[..., None].expand(B, n, p.shape[-1])).gather(-1, x[..., None]).squeeze(-1)  # [B, n]
        ok = p_x > thresh.gather(1, par_fwd)
        if valid is not None:
            ok &= valid
        path_ok = ~(anc & ~ok[:, None, :]).any(-1)  # every node on the path passes
        length = torch.where(path_ok, depth[None] + 1, 0)
        path_lp = (anc.float() * p_x.clamp_min(1e-30).log()[:, None, :]).sum(-1)
        key = torch.where(path_ok, path_lp, torch.full_like(path_lp, float("-inf")))
        longest = length.max(1, keepdim=True).values
        key = torch.where(length == longest, key, torch.full_like(key, float("-inf")))
        cand = key.argmax(1)
        best = torch.where(longest.squeeze(1) > 0, cand, best)
        path = anc.expand(B, n, n).gather(1, best.clamp_min(0)[:, None, None].expand(B, 1, n))[:, 0] & (best >= 0)[:, None]
    p_last = p[rows, best + 1]  # [B, V]
    keep = p_last > thresh[rows, best + 1][:, None]
    keep |= torch.nn.functional.one_hot(p_last.argmax(-1), p_last.shape[-1]).bool()
    nxt = sample(p_last * keep, generator)
    return DeviceVerdict(path, nxt)
