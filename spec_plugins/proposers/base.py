"""The proposer contract: ``propose(ctx) -> Draft | None`` and ``observe(record)``.

The loop never knows which proposer it runs. Inputs travel in one frozen dataclass so adding a
proposer (or a field a new proposer needs) never changes the loop's call sites. Everything else
is optional and declared, not probed: the protocols below are checked once, when the proposer
class registers (``check_proposer_class``) and when a batch is built (``ProposerTraits``).

- ``RowAware``: per-row state that must follow rows joining (``admit``) and leaving
  (``select_rows``) the batch. A proposer without it is stateless per row (Medusa).
- ``Keyed``: cheap per-row classes of the coming draft and free point-mass drafts, which the
  ``auto`` draft-length policy learns from (n-gram).
- ``Remembers``: cross-request memory that a caller can drop (``forget``): the bench between
  independent requests, a tenant's reset.
- ``ReportsMetrics``: gauges and counters of its own for ``/metrics`` (suffix decoding's index).
- ``needs_hidden`` / ``tree`` / ``ranks`` class flags: target features are carried per row; drafts
  are trees; ``propose`` returns ranked candidates (``types.Ranked``) for the draft policy to size.
  ``tree`` and ``ranks`` may follow the instance's config (EAGLE's chain mode is no tree; a
  recycling tree of fixed size is a plain ``Draft``); ``ranks_with(config)`` tells from a config
  alone, so a composition refuses a child that would not rank when its config is validated.
  A feature drafter that reads decoder-layer outputs rather than the last hidden state names
  them in ``feature_layers`` (EAGLE-3). ``point_masses = False``: its drafts carry their own
  distribution (``Draft.probs``, a draft model's), so seeded rows beside it draw from their
  stream generators rather than keyed samples (``keyed_draws``).
- ``features_pending(sequences)``: per row, how many trailing committed target features the batch
  keeps for it (``ProposeContext.hidden``): the last round's by default, every position not fed
  yet for a drafter with its own cache (EAGLE), the most any child needs for a composition.
- ``sources()``: the drafters the draft policy runs, each where it pays: the proposer itself, or
  a composition's children (a hybrid).
- ``to_fetch(z)``: device tensors the proposer's ``observe`` reads (its draft's scores, the
  processed logits' argmax), read in the round's one copy and handed back in
  ``RoundRecord.fetched`` under the names it gave (names unique to the proposer).

A proposer is a subclass of ``Proposer`` (the flags have their defaults there), checked once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

import torch

from spec_plugins.types import Draft, ProposeContext, RoundRecord

__all__ = ["Draft", "ProposeContext", "RoundRecord", "Proposer", "RowAware", "Keyed", "Remembers", "ReportsMetrics",
           "Metric", "ProposerTraits", "check_proposer_class"]


class Proposer:
    """Base class: subclasses implement ``propose`` and, if they learn, ``observe``."""

    Config: ClassVar[Any]
    config: Any  # the proposer's own section (a ``Config``): its draft policy is built from it
    needs_hidden: bool = False  # ask the target for hidden states (a hybrid: if a child does)
    tree: bool = False  # drafts trees (needs a runtime with tree masks)
    continues_ahead: ClassVar[bool] = False  # drafts after ``ProposeContext.ahead`` (a grammar's forced tokens)
    ranks: bool = False  # propose() returns ranked candidates (types.Ranked), sized by the policy
    point_masses: bool = True  # drafts carry no distribution (probs None): seeded rows draw keyed samples
    feature_layers: tuple[int, ...] = ()  # decoder-layer outputs it reads instead of the last hidden state

    @classmethod
    def ranks_with(cls, config: Any) -> bool:
        """Whether a proposer built from ``config`` returns ranked candidates: the ``ranks`` flag,
        unless a subclass's config decides it (it then sets ``ranks`` from this)."""
        return cls.ranks

    def propose(self, ctx: ProposeContext) -> Draft | None:
        raise NotImplementedError

    def features_pending(self, sequences: Sequence[Sequence[int]]) -> list[int | None]:
        """Per row: how many trailing committed target features the batch must still hold for this
        proposer (the positions it has not consumed), read on the host once a round's tokens are
        appended; None: the last round's (its root and accepted nodes). A drafter with a cache of
        its own (EAGLE) counts what it has not fed, so rounds it did not draft leave no gap."""
        return [None] * len(sequences)

    def sources(self) -> "Sequence[Proposer]":
        """The drafters the draft policy runs (a composition: its children)."""
        return (self,)

    def to_fetch(self, z: "torch.Tensor") -> "dict[str, torch.Tensor]":
        """Device tensors ``observe`` will read, given the round's processed logits ``z`` [B, N, V]
        (module docstring); none by default."""
        return {}

    def observe(self, record: RoundRecord) -> None:
        """Learn from a round (adaptive state, rolling back a draft model's cache). Also called at
        an admission where a new row finished at its first token: a record with no draft and no
        logits (``draft``, ``target_logits`` None) whose emissions are the new rows' first tokens."""

    @property
    def draft_forward_time(self) -> float:
        """Seconds spent in draft-model forwards so far (0 for model-free proposers)."""
        return 0.0


@runtime_checkable
class RowAware(Protocol):
    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        """New rows join after the existing ones (on an empty batch: a fresh start), before
        their first token is emitted."""
        ...

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (others finished or left)."""
        ...

    def num_rows(self) -> int:
        """Rows followed now (the batch checks it against its own after every change)."""
        ...


@runtime_checkable
class Keyed(Protocol):
    def draft_keys(self, sequences: Sequence[Sequence[int]]) -> list[int]:
        """A small integer per row classing how promising this round's draft is before it is
        made (n-gram: the matched suffix length and its agreement). ``auto`` keeps one
        acceptance estimate per key."""
        ...

    def free_drafts(self, sequences: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """The point-mass chains of up to ``k`` tokens this proposer would draft for each row,
        when drafting costs nothing and changes no state; ``auto`` scores them against the
        tokens the rows emit next, so a key learns even in rounds it did not draft."""
        ...


@runtime_checkable
class Remembers(Protocol):
    def forget(self) -> None:
        """Drop every cross-request memory (rows in flight keep their own state)."""
        ...


# (name, kind "gauge" | "counter", help, value)
Metric = tuple[str, str, str, float]


@runtime_checkable
class ReportsMetrics(Protocol):
    def metrics(self) -> list[Metric]:
        """The proposer's own gauges and counters, for the server's ``/metrics``."""
        ...


_GROUPS = {"RowAware": ("admit", "select_rows", "num_rows"), "Keyed": ("draft_keys", "free_drafts"),
           "Remembers": ("forget",), "ReportsMetrics": ("metrics",)}


def check_proposer_class(cls: type) -> None:
    """Refuse a proposer class that breaks the contract: a ``Proposer`` subclass with
    ``propose``/``observe``, and each optional protocol implemented whole or not at all."""
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(f"proposer {getattr(cls, '__name__', cls)} must subclass spec_plugins.proposers.base.Proposer")
    for name in ("propose", "observe"):
        if not callable(getattr(cls, name, None)):
            raise TypeError(f"proposer {cls.__name__} has no {name}()")
    for proto, methods in _GROUPS.items():
        have = [m for m in methods if callable(getattr(cls, m, None))]
        if have and len(have) != len(methods):
            missing = sorted(set(methods) - set(have))
            raise TypeError(f"proposer {cls.__name__} implements {proto} partly: {', '.join(have)} without "
                            f"{', '.join(missing)}")


@dataclass(frozen=True)
class ProposerTraits:
    """What the batch needs to know about its proposer, read once when it is built."""

    row_aware: bool = False
    keyed: bool = False
    needs_hidden: bool = False
    tree: bool = False
    feature_layers: tuple[int, ...] = ()  # decoder-layer outputs instead of the last hidden state (EAGLE-3)
    ranks: bool = False
    remembers: bool = False
    reports: bool = False
    sources: tuple = ()  # the drafters the draft policy runs (``Proposer.sources``)
    point_masses: bool = True  # no drafter of it drafts distributions (``loop.verdicts``: keyed draws)

    @property
    def want_hidden(self) -> "bool | tuple[int, ...]":
        """What the batch asks the runtime for besides logits (``backends.base.Want``)."""
        return self.feature_layers or self.needs_hidden

    @staticmethod
    def of(proposer: Any) -> "ProposerTraits":
        if proposer is None:
            return ProposerTraits()
        check_proposer_class(type(proposer))
        return ProposerTraits(isinstance(proposer, RowAware), isinstance(proposer, Keyed), bool(proposer.needs_hidden),
                              bool(proposer.tree), tuple(proposer.feature_layers), bool(proposer.ranks),
                              isinstance(proposer, Remembers), isinstance(proposer, ReportsMetrics),
                              tuple(proposer.sources()),
                              all(getattr(p, "point_masses", True) for p in (proposer, *proposer.sources())))


def check_pairing(runtime: Any, proposer: Any) -> ProposerTraits:
    """The proposer's traits, refused where the runtime cannot serve them (checked once)."""
    traits = ProposerTraits.of(proposer)
    caps = runtime.capabilities
    if traits.tree and not caps.tree_mask:
        raise ValueError(f"proposer {type(proposer).__name__} drafts token trees, but the {caps.name or 'target'} "
                         "runtime cannot verify a tree mask; use a chain proposer on this runtime")
    if traits.needs_hidden and not caps.hidden_states:
        raise ValueError(f"proposer {type(proposer).__name__} needs the target's hidden states, which the "
                         f"{caps.name or 'target'} runtime does not return")
    if proposer is not None and not getattr(caps, "batch_invariant", True):
        raise ValueError(f"the {caps.name or 'target'} runtime computes a position differently in a one-position "
                         "forward than in a wider one (quantized kernels with int8 activations), so speculative "
                         "output would leave its plain output; set pad_single: true (or auto) on the target, or "
                         "decode without speculation")
    if traits.feature_layers and not caps.serves(traits.feature_layers):
        if caps.feature_layers is None:
            raise ValueError(f"proposer {type(proposer).__name__} reads decoder layers {list(traits.feature_layers)}, "
                             f"but the target has layers 1..{caps.num_layers}: it was trained for another target")
        have = "none" if not caps.feature_layers else list(caps.feature_layers)
        raise ValueError(f"proposer {type(proposer).__name__} reads decoder layers {list(traits.feature_layers)}, "
                         f"but the {caps.name or 'target'} runtime returns {have}; export the target again with "
                         f"--feature-layers {','.join(map(str, traits.feature_layers))} (exported on first use: set "
                         f"target.feature_layers: {list(traits.feature_layers)})")
    return traits
