"""What a row reports with each emitted token when it asks: the target's log-probability of it
(and, optionally, the best alternatives), by one documented rule."""

from __future__ import annotations

import math
import torch


class TokenLogprob(float):
    """An emitted token's log-probability; ``top``: the most likely tokens at its position,
    ``(id, logprob)`` best first (``Batch.top_logprobs`` of them, none by default)."""

    top: tuple[tuple[int, float], ...] = ()


def _finite(x: float) -> float:
    # a finite float for JSON: the floor only guards the serialisation
    return x if math.isfinite(x) else -1e30


def emitted_logprobs(logits: torch.Tensor, x: torch.Tensor, path: torch.Tensor, nxt: torch.Tensor,
                     depths: tuple[int, ...], top: int = 0) -> dict[str, torch.Tensor]:
    """On the logits' device, for the round's one fetch: each row's emitted tokens in order (the
    accepted path's nodes by depth, then the next token) scored by the target's log p at the
    position each was emitted from: log-softmax of the raw logits (``logits`` [B, N, V]), before
    repetition penalty, temperature, top-k and top-p, so every sampling setting that emits a token
    reports the same number for it. ``depths``: each drafted node's (host data). ``lp`` [B, D+1]
    (D: draft depths), with ``top`` the best alternatives ``top_ids`` / ``top_lp`` [B, D+1, top]."""
    from spec_plugins.transfer import upload_tensor

    B, n = x.shape
    pos, tok = torch.zeros(B, 1, dtype=torch.long, device=x.device), nxt[:, None]  # no draft: the next token
    if n:
        D = max(depths) + 1
        depth, levels = upload_tensor(list(depths), x.device), torch.arange(D, device=x.device)
        at_depth = path[:, None, :] & (depth[None, None, :] == levels[None, :, None])  # [B, D, n]
        node = torch.where(at_depth.any(-1), at_depth.long().argmax(-1), -1)  # the accepted node at each depth
        pos = torch.cat([pos, node + 1], 1).clamp_min(0)  # [B, D+1]: where each emitted token was scored
        step = torch.arange(D + 1, device=x.device)[None]
        drafted = x.gather(1, torch.cat([node, node[:, -1:]], 1).clamp_min(0))
        tok = torch.where(step < path.sum(1)[:, None], drafted, nxt[:, None])
    lp = logits.gather(1, pos[..., None].expand(*pos.shape, logits.shape[-1])).float().log_softmax(-1)
    out = {"lp": lp.gather(-1, tok[..., None]).squeeze(-1)}
    if top > 0:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        out |= {"top_ids": ids, "top_lp": vals}
    return out


def row_logprobs(host: dict, b: int, count: int) -> list[float]:
    """Row ``b``'s first ``count`` emitted tokens' logprobs from the fetched ``emitted_logprobs``."""
    out = [TokenLogprob(_finite(float(v))) for v in host["lp"][b, :count]]
    if "top_ids" in host:
        for o, ts, vs in zip(out, host["top_ids"][b, :count], host["top_lp"][b, :count]):
            o.top = tuple((int(t), _finite(float(v))) for t, v in zip(ts, vs))
    return out
