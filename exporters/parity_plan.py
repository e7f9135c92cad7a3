"""The steps of ``export check``'s real-input check (``parity.check_runtimes``), drawn before it
runs (``RuntimePlan``) so that a --gamma whose steps the runtimes would refuse is refused first,
naming it (``check_gamma``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_plugins.exporters.parity_greedy import greedy_room

RANDOM_PAST = 7  # cached positions under check_random's cases


def random_tree(n: int, gen: torch.Generator) -> tuple[int, ...]:
    """Parents of a random tree of n nodes rooted at node 0 (topological order)."""
    return (-1,) + tuple(int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n))


@dataclass
class RuntimePlan:
    """The random draws of ``check_runtimes``, in the order it has always drawn them from one
    generator (a seed's cases stay the same), made up front so the positions its steps start at
    are known before anything runs (``starts``)."""

    chains: list[tuple[torch.Tensor, tuple[int, int]]]  # N = 1..gamma+1: tokens [2, N], tokens each row keeps
    parents: tuple[int, ...]  # the tree step's nodes
    tree_tokens: torch.Tensor  # [2, nodes]
    last_tokens: torch.Tensor  # [2, 2]: the chain after the tree commit and the rollback

    @classmethod
    def draw(cls, gamma: int, vocab: int, seed: int = 0) -> "RuntimePlan":
        gen = torch.Generator().manual_seed(seed)
        chains = []
        for n in range(1, gamma + 2):
            toks = torch.randint(0, vocab, (2, n), generator=gen)
            keep = tuple(int(torch.randint(1, n + 1, (1,), generator=gen)) for _ in range(2))
            chains.append((toks, (keep[0], keep[1])))
        parents = random_tree(max(gamma + 1, 3), gen)
        tree_tokens = torch.randint(0, vocab, (2, len(parents)), generator=gen)
        return cls(chains, parents, tree_tokens, torch.randint(0, vocab, (2, 2), generator=gen))

    def path(self) -> list[int]:
        """The nodes row 0 commits after the tree step: its last node and that node's ancestors."""
        leaf, out = len(self.parents) - 1, []
        while leaf >= 0:
            out.append(leaf)
            leaf = self.parents[leaf]
        return sorted(out)

    def starts(self, prompt: int) -> list[int]:
        """The position each forward step starts at (the runtimes' pending position: the longest
        row's length), with a ``prompt``-token row and its half beside it: each step's commits
        (the tree's: ``path`` and one node) and the rollback to 3 tokens less, as they run."""
        lengths, out = [prompt, max(1, prompt // 2)], []
        for _, keep in self.chains:
            out.append(max(lengths))
            lengths = [n + k for n, k in zip(lengths, keep)]
        out.append(max(lengths))
        lengths = [lengths[0] + len(self.path()), lengths[1] + 1]
        out.append(max(min(n, max(1, n - 3)) for n in lengths))
        return out


def check_gamma(graph: str, gamma: int, prompt: int, context: int, vocab: int, past: int = RANDOM_PAST) -> None:
    """Refuse a ``gamma`` whose cases the graph's ``context`` cannot hold, naming --gamma, the
    positions needed and the largest gamma that fits: check_random's ``past`` + N nodes, and the
    runtimes' own rule for check_runtimes' steps (each starts below the context: a node past it is
    clamped to its last position, as in decoding); first ``greedy_room``'s refusal of a prompt
    that fills it."""
    greedy_room(graph, prompt, 1, context)

    def need(g: int) -> int:
        return max(past + g + 1, max(RuntimePlan.draw(g, vocab).starts(prompt)) + 1)

    if need(gamma) <= context:
        return
    fits = [g for g in range(gamma - 1, 0, -1) if need(g) <= context][:1]
    raise ValueError(f"--gamma {gamma}: the chain and tree cases of graph {graph!r} (N = 1..{gamma + 1} nodes after its "
                     f"{prompt}-token prompt) need {need(gamma)} positions, but it holds {context} positions of context; "
                     + (f"use --gamma {fits[0]} or less" if fits else "no --gamma fits: export with a longer context"))
