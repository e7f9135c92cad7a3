"""Reference computations the tests compare against (plain decoding, exact distributions)."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from spec_plugins.sampling import LogitsPipeline


@torch.no_grad()
def full_logits(model, ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits after ``ids`` from a full forward without any cache."""
    dev = getattr(model, "device", None) or "cpu"  # a wrapper (tests of the plugin) has none: the CPU
    return model(torch.tensor([list(ids)], device=dev)).logits[0, -1].float()


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
def hf_generate(model, prompts: Sequence[Sequence[int]], n: int, pad: int) -> list[list[int]]:
    """transformers' own greedy ``generate`` over left-padded ``prompts`` (the independent
    reference): the ``n`` new tokens of each row."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=pad)
    return out[:, width:].tolist()


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


# ---- every proposer over one target, heads from disk as trained ones load -----------------------------
EVERY_PROPOSER = ("ngram", "suffix", "recycling", "lookahead", "draft", "medusa-tree", "medusa-chain",
                  "eagle-chain", "eagle-tree", "parallel-chain", "parallel-tree", "hybrid")


def save_random_heads(model, directory):
    """A random EAGLE-3 drafter (fused layers 1, 2) and random Medusa heads for ``model``, saved as
    trained heads are, and a random parallel drafter (fused layers 1, 2, a block of 4, one block
    layer); returns
    ``{"eagle": dir, "medusa": dir, "parallel": dir}``. Built on the host from the model's host
    weights (as training does)."""
    from pathlib import Path

    from test_heads import eagle, medusa
    from test_parallel import drafter

    from spec_plugins.heads import save_head

    directory = Path(directory)
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("save_random_heads takes the model on the CPU (move it to its device afterwards)")
    d, m = eagle(model, layers=(1, 2)), medusa(model)
    save_head(d, d.config.to_dict(), directory / "eagle")
    save_head(m, m.config.to_dict(), directory / "medusa")
    p = drafter(model, block_layers=1)
    save_head(p, p.config.to_dict(), directory / "parallel")
    return {"eagle": directory / "eagle", "medusa": directory / "medusa", "parallel": directory / "parallel"}


def every_proposer(kind, target, heads, draft=None):
    """The proposer ``kind`` (one of EVERY_PROPOSER) over ``target`` as a config builds it: heads
    load from ``heads`` (``save_random_heads``) onto the target's device; ``draft()`` gives the
    draft model's runtime."""
    from spec_plugins.proposers.draft_model import DraftModelProposer
    from spec_plugins.proposers.eagle import EagleProposer
    from spec_plugins.proposers.hybrid import HybridProposer
    from spec_plugins.proposers.lookahead import LookaheadProposer
    from spec_plugins.proposers.medusa import MedusaProposer
    from spec_plugins.proposers.ngram import NgramProposer
    from spec_plugins.proposers.parallel import ParallelProposer
    from spec_plugins.proposers.recycling import RecyclingProposer
    from spec_plugins.proposers.suffix import SuffixProposer

    e = dict(heads=str(heads["eagle"]), top_k=2)
    m = str(heads["medusa"])
    p = dict(heads=str(heads["parallel"]), top_k=2)
    build = {
        "ngram": lambda: NgramProposer(NgramProposer.Config()),
        "suffix": lambda: SuffixProposer(SuffixProposer.Config(tree_nodes=6, min_token_prob=0.0), target=target),
        "recycling": lambda: RecyclingProposer(RecyclingProposer.Config(), target=target),
        "lookahead": lambda: LookaheadProposer(LookaheadProposer.Config(), target=target),
        "draft": lambda: DraftModelProposer(None, target=target, runtime=draft()),
        "medusa-tree": lambda: MedusaProposer(MedusaProposer.Config(heads=m, tree_nodes=6), target=target),
        "medusa-chain": lambda: MedusaProposer(MedusaProposer.Config(heads=m, mode="chain"), target=target),
        "eagle-chain": lambda: EagleProposer(EagleProposer.Config(mode="chain", **e), target=target),
        "eagle-tree": lambda: EagleProposer(EagleProposer.Config(tree_nodes=6, **e), target=target),
        "parallel-chain": lambda: ParallelProposer(ParallelProposer.Config(mode="chain", **p), target=target),
        "parallel-tree": lambda: ParallelProposer(ParallelProposer.Config(tree_nodes=6, **p), target=target),
        "hybrid": lambda: HybridProposer(HybridProposer.Config(proposers=[
            {"type": "suffix", "tree_nodes": 6, "min_token_prob": 0.0}, {"type": "eagle", "tree_nodes": 6, **e}]),
            target=target),
    }
    return build[kind]()


def greedy_run(target, prop, prompts, n, k=6, policy=None):
    """Greedy outputs of ``decode`` and its stats; ``policy``: a DraftPolicy (default: FixedLength(k))."""
    from spec_plugins.config import SamplingConfig
    from spec_plugins.loop import decode
    from spec_plugins.policy import FixedLength
    from spec_plugins.stats import DecodeStats
    from spec_plugins.verifiers import ExactVerifier

    outs = [[] for _ in prompts]
    stats = DecodeStats()
    for step in decode(target, prop, ExactVerifier(), LogitsPipeline(SamplingConfig()), prompts, n, (), None,
                       stats, policy if policy is not None else FixedLength(k)):
        for i, t in step.emitted.items():
            outs[i].extend(t)
    return outs, stats


class Built(Exception):
    """Raised by a builder patched with :func:`stop_at_build`: the caller reached the build."""


def stop_at_build(monkeypatch, owner, name: str, *, static: bool = False) -> list:
    """Patch ``owner.name`` to record its one argument and raise :class:`Built`, so a test sees
    what a script would build without loading a model. Returns the list the arguments land in."""
    seen: list = []

    def build(arg):
        seen.append(arg)
        raise Built

    monkeypatch.setattr(owner, name, staticmethod(build) if static else build)
    return seen
