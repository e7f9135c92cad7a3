"""The target's sampling distribution, applied identically to target and draft logits.

User ``LogitsProcessor``s see the exact prefix each drafted node would have in plain decoding
(committed tokens + the path to that node), so penalties and bans stay exact. Temperature,
top-k and top-p do not depend on the prefix and are applied to all nodes at once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterator, Sequence

import torch

from spec_plugins.config import SamplingConfig
from spec_plugins.transfer import upload_tensor
from spec_plugins.row_trees import Parents, rows_of
from spec_plugins.tree import paths

# transformers-compatible: processor(input_ids [R, L] long, scores [R, V] float) -> scores
LogitsProcessorFn = Callable[[torch.LongTensor, torch.FloatTensor], torch.FloatTensor]

# Temperatures above this sample as at it. Above float32's max (3.4e38) T itself becomes inf in the
# division: every logit 0 and a banned -inf logit NaN, so top-k and top-p would keep the whole
# vocabulary. At 2**100 softmax is already uniform to float32 precision (for
# logits less than 1e22 apart), and dividing by a power of two is exact, so distinct logits keep
# their order (any two of size above 2**-26) and top_k 1 stays greedy, as at any T > 0.
MAX_TEMPERATURE = 2.0 ** 100


def warped_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``LogitsPipeline.warp`` samples in: at least float32. The runtimes give float32
    logits (``StepOutput``); float16 ones divided by a temperature overflow (T = 1e-4) or vanish
    (T = 1e9), losing the order top-k and top-p select by."""
    return torch.promote_types(dtype, torch.float32)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``, the temperature capped at ``MAX_TEMPERATURE``."""
    t = min(temperature, MAX_TEMPERATURE)
    return logits / t if t != 1.0 else logits


def checked_processors(processors: Sequence[LogitsProcessorFn]) -> list[LogitsProcessorFn]:
    """``processors`` as a list, refused before any row runs unless it is a list or tuple of
    callables (else every row would fail mid-decode with an error that never names them)."""
    if callable(processors) and not isinstance(processors, (list, tuple)):
        raise TypeError(f"processors must be a list of logits processors, got a single "
                        f"{type(processors).__name__}: pass [processor]")
    if not isinstance(processors, (list, tuple)):
        raise TypeError(f"processors must be a list of logits processors, got {type(processors).__name__}")
    for i, p in enumerate(processors):
        if not callable(p):
            raise TypeError(f"processors[{i}] is {p!r} ({type(p).__name__}), not callable: a logits processor "
                            "is called as processor(input_ids, scores) -> scores")
    return list(processors)


class LogitsPipeline:
    """user processors -> temperature -> top-k -> top-p, in transformers' order."""

    def __init__(self, sampling: SamplingConfig, processors: Sequence[LogitsProcessorFn] = ()) -> None:
        self.sampling = sampling
        self.processors: list[LogitsProcessorFn] = checked_processors(processors)
        if sampling.repetition_penalty not in (None, 1.0):
            from transformers import RepetitionPenaltyLogitsProcessor

            self.processors.insert(0, RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    @property
    def needs_prefix(self) -> bool:
        return bool(self.processors)

    # ---- prefix-independent warpers, vectorised over any leading dims -----------------------
    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature (``tempered``), top-k, top-p, in ``warped_dtype`` (float32 logits: no copy)."""
        s = self.sampling
        x = logits.to(warped_dtype(logits.dtype))
        if s.greedy:
            return x
        x = tempered(x, s.temperature)
        if s.top_k is not None and s.top_k < x.shape[-1]:
            kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if s.top_p is not None and s.top_p < 1.0:
            # transformers' rule to the float and the tie: ascending, a token goes while the mass
            # up to and including it is <= 1 - top_p, the largest always stays (exactly tied
            # logits at the edge keep the later index, as there)
            sorted_x, order = torch.sort(x, dim=-1, descending=False)
            drop_sorted = sorted_x.softmax(-1).cumsum(-1) <= 1 - s.top_p
            drop_sorted[..., -1] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        return x

    def apply_user(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Run the user processors on ``logits`` [R, V] whose rows continue ``prefix`` [R, L]; each
        result is taken in the logits' dtype (transformers accepts a processor returning another
        float dtype) and must keep their shape (one that does not is named)."""
        for proc in self.processors:
            out = proc(prefix, logits)
            if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                name = getattr(proc, "__qualname__", None) or type(proc).__name__
                raise ValueError(f"logits processor {name} returned {got}; it must return the scores "
                                 f"{list(logits.shape)} it was given ([rows, vocabulary])")
            logits = out.to(logits.dtype)
        return logits

    def process(self, logits: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, V] of R nodes that continue ``prefix`` [R, L] -> processed logits."""
        if self.processors:
            assert prefix is not None, "user processors need the prefix"
            logits = self.apply_user(prefix, logits)
        return self.warp(logits)

    def process_rows(self, logits: torch.Tensor, prefixes: Sequence[Sequence[int] | torch.Tensor]) -> torch.Tensor:
        """Logits [R, V], row r continuing ``prefixes[r]`` (ragged: token lists, or 1-D tensors on
        the logits' device, as a draft model keeps them) -> processed logits. Rows with equal
        prefix length go through each user processor in one call."""
        if self.processors:
            logits = logits.clone()
            by_len: dict[int, list[int]] = {}
            for r, pre in enumerate(prefixes):
                by_len.setdefault(len(pre), []).append(r)
            for rows in by_len.values():
                if isinstance(prefixes[rows[0]], torch.Tensor):
                    prefix = torch.stack([prefixes[r] for r in rows])
                else:
                    prefix = upload_tensor([list(prefixes[r]) for r in rows], logits.device)
                at = upload_tensor(rows, logits.device)
                logits[at] = self.apply_user(prefix, logits[at])
        return self.warp(logits)

    def process_tree(
        self,
        logits: torch.Tensor,
        sequences: Sequence[Sequence[int]],
        tokens: torch.Tensor,
        parents: Parents,
    ) -> torch.Tensor:
        """Process target logits [B, N, V] of a forward over ``tokens`` [B, N] (node 0 = root,
        whose prefix is the row's whole sequence ``sequences[b]``; ``parents`` over all N nodes,
        shared or per row).

        Node prefixes are built on the logits' device, from each row's sequence there (the batch
        keeps it, extended by the new tokens only) and the drafted tokens along each node's path:
        no sequence crosses to or from the host. User processors run once per (row length,
        depth) group: a node's depth is the same in every row, its path may be each row's own."""
        if not self.processors:
            return self.warp(logits)
        out = logits.clone()
        for rows, ridx, _, nodes, prefix, scores in _tree_groups(logits, sequences, tokens, parents):
            out[ridx[:, None], nodes[None, :]] = self.apply_user(prefix, scores).reshape(len(rows), -1, logits.shape[2])
        return self.warp(out)

    def process_tree_apart(self, logits: torch.Tensor, sequences: Sequence[Sequence[int]], tokens: torch.Tensor,
                           parents: Parents) -> tuple[torch.Tensor, dict[tuple[int, int], Exception]]:
        """``process_tree``, and where a group's processing raises, each of its nodes alone: the
        nodes whose own processing raises get NaN logits (no distribution, as the batch's NaN
        policy reads it: the row fails only where its verdict reads such a node) and are returned
        as {(row, node): the exception}. A processor raising at a drafted node plain decoding
        never reaches (after a drafted token that is not accepted) then fails nothing."""
        if not self.processors:
            return self.warp(logits), {}
        out, raised = logits.clone(), {}
        for rows, ridx, at, nodes, prefix, scores in _tree_groups(logits, sequences, tokens, parents):
            # the processors get copies: one that changes its scores in place before a later one
            # raises must leave ``scores`` as they were for the retry of each node
            try:
                z = self.apply_user(prefix, scores.clone())
            except Exception:  # noqa: BLE001 - find the nodes it fails for, one at a time
                z, n = scores.clone(), len(at)
                for i in range(z.shape[0]):  # row-major: rows[i // n], node at[i % n]
                    try:
                        z[i:i + 1] = self.apply_user(prefix[i:i + 1], scores[i:i + 1].clone())
                    except Exception as exc:  # noqa: BLE001
                        raised[(rows[i // n], at[i % n])] = exc
            out[ridx[:, None], nodes[None, :]] = z.reshape(len(rows), -1, logits.shape[2])
        out = self.warp(out)
        if raised:
            at = upload_tensor(list(raised), logits.device)  # [k, 2]: (row, node)
            out[at[:, 0], at[:, 1]] = float("nan")
        return out, raised


def _tree_groups(logits: torch.Tensor, sequences: Sequence[Sequence[int]], tokens: torch.Tensor, parents: Parents
                 ) -> Iterator[tuple[list[int], torch.Tensor, tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The nodes of ``process_tree``'s forward by (row length, depth) group: the group's rows and
    its n nodes (each on the host and the device: the host's copies name a failing node without a
    read back), and the prefixes [R * n, L + d] and logits [R * n, V] of its R x n nodes,
    row-major. The user processors run once per group."""
    B, _, V = logits.shape
    dev = logits.device
    seqs = [s if isinstance(s, torch.Tensor) else upload_tensor(list(s), dev)
            for s in sequences]
    by_len: dict[int, list[int]] = {}
    for b, s in enumerate(seqs):
        by_len.setdefault(int(s.shape[0]), []).append(b)
    groups = _depth_groups(parents, dev)
    for L, rows in by_len.items():
        ridx = upload_tensor(rows, dev)
        seq, tok = torch.stack([seqs[b] for b in rows]), tokens[ridx]  # [R, L], [R, N]
        R = len(rows)
        for at, nodes, path in groups:  # path [1 or B, n, d]: forward indices of each node's path
            n, d = int(nodes.shape[0]), int(path.shape[2])
            path = path.expand(B, n, d)[ridx] if path.shape[0] > 1 else path.expand(R, n, d)
            steps = tok.gather(1, path.reshape(R, n * d)).reshape(R, n, d)
            prefix = torch.cat([seq[:, None, :].expand(R, n, L), steps], -1).reshape(R * n, L + d)
            yield rows, ridx, at, nodes, prefix, logits[ridx][:, nodes].reshape(R * n, V)


class RowPipelines:
    """Per-row pipelines seen as one: what the batch processes logits with, and what a proposer's
    ``ctx.pipeline`` is. Rows sharing a pipeline object are processed together (a fixed batch
    with one sampling setting is one group).

    ``greedy`` only if every row is greedy; in a mixed batch the greedy rows' logits become a
    point mass at their argmax, so a sampling drafter drafts exactly what a greedy one would."""

    def __init__(self, pipelines: Sequence[LogitsPipeline]) -> None:
        self.pipelines = list(pipelines)
        self.greedy = all(p.greedy for p in self.pipelines)
        self.needs_prefix = any(p.needs_prefix for p in self.pipelines)
        self.sampling = self.pipelines[0].sampling if self.pipelines else SamplingConfig()
        groups: dict[int, list[int]] = {}
        for r, p in enumerate(self.pipelines):
            groups.setdefault(id(p), []).append(r)
        self.groups = list(groups.values())

    def process_rows(self, logits: torch.Tensor, prefixes: Sequence[Sequence[int] | torch.Tensor]) -> torch.Tensor:
        if len(self.groups) == 1:
            return self._point_mass(self.pipelines[0], self.pipelines[0].process_rows(logits, prefixes))
        out = logits.new_empty(logits.shape, dtype=warped_dtype(logits.dtype))
        for rows in self.groups:
            p = self.pipelines[rows[0]]
            at = upload_tensor(rows, logits.device)
            out[at] = self._point_mass(p, p.process_rows(logits[at], [prefixes[r] for r in rows]))
        return out

    def process_tree(self, logits: torch.Tensor, sequences: Sequence[Sequence[int]], tokens: torch.Tensor,
                     parents: tuple[int, ...]) -> torch.Tensor:
        if len(self.groups) == 1:
            return self.pipelines[0].process_tree(logits, sequences, tokens, parents)
        out = logits.new_empty(logits.shape, dtype=warped_dtype(logits.dtype))
        for rows in self.groups:
            idx = upload_tensor(rows, logits.device)
            out[idx] = self.pipelines[rows[0]].process_tree(logits[idx], [sequences[r] for r in rows], tokens[idx],
                                                            rows_of(parents, idx))
        return out

    def _point_mass(self, p: LogitsPipeline, z: torch.Tensor) -> torch.Tensor:
        if p.greedy and not self.greedy:
            return z.masked_fill(z < z.max(-1, keepdim=True).values, float("-inf"))
        return z


def process_rows_apart(pipeline: "LogitsPipeline | RowPipelines", logits: torch.Tensor,
                       prefixes: Sequence[Sequence[int] | torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """``pipeline.process_rows``, and where it raises, each row alone: the rows whose own
    processing raises are returned, their logits left unprocessed (a placeholder nothing may be
    drafted from: the drafter ends that row's draft there), so one row's failing processor does
    not end the other rows' drafting. Whether the row fails is the batch's to decide, as for any
    node (``LogitsPipeline.process_tree_apart``)."""
    try:
        return pipeline.process_rows(logits, prefixes), []
    except Exception:  # noqa: BLE001 - find the rows it fails for, one at a time
        out, failed = logits.to(warped_dtype(logits.dtype), copy=True), []
        for b in range(logits.shape[0]):
            own = pipeline.pipelines[b] if isinstance(pipeline, RowPipelines) else pipeline
            try:
                z = own.process_rows(logits[b:b + 1], [prefixes[b]])
                out[b:b + 1] = pipeline._point_mass(own, z) if isinstance(pipeline, RowPipelines) else z
            except Exception:  # noqa: BLE001 - the row fails alone when the batch processes its logits
                failed.append(b)
        return out, failed


def _depth_groups(parents: Parents, device: torch.device
                  ) -> list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]]:
    """Nodes of a forward grouped by depth (root = node 0, depth 0), on the host and on ``device``,
    each with the forward indices of the drafted tokens on its path ([1, n, depth], or
    [B, n, depth] for per-row trees): the tokens its prefix adds to the row's sequence. A group's
    nodes go up once, without waiting (indexing a device tensor with a host list would copy it
    blocking: a stream sync per depth).

    Per-row trees hold invalid slots whose parent was cut or never chosen (the root here), so
    their walk up reaches the root early and then its parent, -1: such a walk stays at the root.
    Their prefix is then a placeholder, which is harmless: a valid node's parents are valid and
    one depth up all the way to the root, and the verdict never takes an invalid node, so it
    never reads the logits at one."""
    if isinstance(parents, tuple):
        return _shared_groups(parents, device)
    depth = parents.depth
    out = []
    for d in sorted(set(depth)):
        at = tuple(j for j, dj in enumerate(depth) if dj == d)
        nodes = upload_tensor(list(at), device)
        cur = parents.parents[:, nodes]  # [B, n]: walking up from each node, one step per depth
        steps = [nodes[None].expand_as(cur)]
        for _ in range(d - 1):
            cur = cur.clamp_min(0)  # past the root: stay there (an invalid node, docstring)
            steps.append(cur)
            cur = parents.parents.gather(1, cur)
        path = torch.stack(steps[::-1], -1) if d else cur.new_zeros(cur.shape + (0,))
        out.append((at, nodes, path))
    return out


@lru_cache(maxsize=256)
def _shared_groups(parents: tuple[int, ...], device: torch.device
                   ) -> list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]]:
    """``_depth_groups`` of one topology for every row, cached per draft shape and device."""
    groups: dict[int, list[tuple[int, ...]]] = {}
    for j, path in enumerate(paths(parents)):
        groups.setdefault(len(path) - 1, []).append((j,) + path[1:])
    return [(tuple(p[0] for p in g), upload_tensor([p[0] for p in g], device),
             upload_tensor([p[1:] for p in g], device).reshape(1, len(g), d)) for d, g in sorted(groups.items())]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (point masses included)."""
    return torch.multinomial(probs.float(), 1, generator=generator).squeeze(-1)


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V], row b drawing from ``generators[b]``: rows sharing a
    generator draw together, so a seeded row's draws do not depend on its neighbours."""
    gen_device = next((g.device for g in generators if g is not None), probs.device)
    if (gen_device.type, gen_device.index or 0) != (probs.device.type, probs.device.index or 0):
        # a drafter on another device than the rows' generators (cpu and cpu:0 are one): draw there
        return sample_rows(probs.to(gen_device), generators).to(probs.device)
    groups: dict[int, list[int]] = {}
    for b, g in enumerate(generators):
        groups.setdefault(id(g), []).append(b)
    if len(groups) == 1:
        return sample(probs, generators[0])
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for rows in groups.values():
        at = upload_tensor(rows, probs.device)
        out[at] = sample(probs[at], generators[rows[0]])
    return out
