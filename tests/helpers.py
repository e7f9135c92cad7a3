"""Reference computations the tests compare against (plain decoding, exact distributions)."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from spec_plugins.sampling import LogitsPipeline


@torch.no_grad()
def full_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits after ``ids`` from a full forward without any cache."""
    return model(torch.tensor([list(ids)])).logits[0, -1].float()


@torch.no_grad()
def plain_greedy(model, ids: Sequence[int], n: int, eos: Sequence[int] = ()) -> list[int]:
    seq, out = list(ids), []
    for _ in range(n):
        t = int(full_logits(model, seq).argmax())
        out.append(t)
        seq.append(t)
        if t in eos:
            break
    return out


@torch.no_grad()
def exact_joint(model, prompt: Sequence[int], n_tokens: int, pipeline: LogitsPipeline) -> dict[tuple, float]:
    """P(t_1..t_n | prompt) under the pipeline, by enumeration (tiny vocabularies only)."""
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(n_tokens):
        nxt: dict[tuple, float] = {}
        for pre, pp in probs.items():
            if pp == 0.0:
                continue
            seq = list(prompt) + list(pre)
            z = pipeline.process_rows(full_logits(model, seq)[None], [seq])[0]
            p = z.float().softmax(-1).tolist()
            for t, pt in enumerate(p):
                if pt > 0:
                    nxt[pre + (t,)] = pp * pt
        probs = nxt
    return probs


def chi_square_pvalue(samples: Sequence[tuple], exact: dict[tuple, float], min_expected: float = 5.0) -> float:
    """Pearson chi-square of samples against the exact law, pooling cells with < min_expected."""
    from scipy.stats import chisquare

    n = len(samples)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    obs, exp = [], []
    pool_o, pool_e = 0, 0.0
    for cell, p in exact.items():
        e = p * n
        if e >= min_expected:
            obs.append(counts.get(cell, 0))
            exp.append(e)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += e
    # samples outside the exact support (impossible under the target) land in the pool
    pool_o += sum(c for cell, c in counts.items() if cell not in exact)
    if pool_e > 0 or pool_o > 0:
        obs.append(pool_o)
        exp.append(max(pool_e, 1e-12))
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def all_sequences(vocab: int, n: int):
    return itertools.product(range(vocab), repeat=n)
