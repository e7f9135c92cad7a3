"""The proposer contract: ``propose(ctx) -> Draft | None`` and ``observe(record)``.

The loop never knows which proposer it runs. Inputs travel in one frozen dataclass so adding a
proposer (or a field a new proposer needs) never changes the loop's call sites. Everything else
is optional and declared, not probed: the protocols below are checked once, when the proposer
class registers (``check_proposer_class``) and when a batch is built (``ProposerTraits``).

- ``RowAware``: per-row state that must follow rows joining (``admit``) and leaving
  (``select_rows``) the batch. A proposer without it is stateless per row (Medusa).
- ``Keyed``: cheap per-row classes of the coming draft and free point-mass drafts, which the
  ``auto`` draft-length policy learns from (n-gram).
- ``needs_hidden`` / ``tree`` class flags: target features are carried per row; drafts are trees.
  A feature drafter that reads decoder-layer outputs rather than the last hidden state names
  them in ``feature_layers`` (EAGLE-3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

from spec_plugins.types import Draft, ProposeContext, RoundRecord

__all__ = ["Draft", "ProposeContext", "RoundRecord", "Proposer", "RowAware", "Keyed", "ProposerTraits",
           "check_proposer_class"]


class Proposer:
    """Base class: subclasses implement ``propose`` and, if they learn, ``observe``."""

    Config: ClassVar[Any]
    needs_hidden: ClassVar[bool] = False  # ask the target for hidden states
    tree: ClassVar[bool] = False  # drafts trees (needs a runtime with tree masks)

    def propose(self, ctx: ProposeContext) -> Draft | None:
        raise NotImplementedError

    def observe(self, record: RoundRecord) -> None:
        """Learn from a round (adaptive state, rolling back a draft model's cache)."""

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


_GROUPS = {"RowAware": ("admit", "select_rows", "num_rows"), "Keyed": ("draft_keys", "free_drafts")}


def check_proposer_class(cls: type) -> None:
    """Refuse a proposer class that breaks the contract: ``propose``/``observe`` callable, and
    each optional protocol implemented whole or not at all."""
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

    @property
    def want_hidden(self) -> "bool | tuple[int, ...]":
        """What the batch asks the runtime for besides logits (``backends.base.Want``)."""
        return self.feature_layers or self.needs_hidden

    @staticmethod
    def of(proposer: Any) -> "ProposerTraits":
        if proposer is None:
            return ProposerTraits()
        check_proposer_class(type(proposer))
        return ProposerTraits(isinstance(proposer, RowAware), isinstance(proposer, Keyed),
                              bool(getattr(proposer, "needs_hidden", False)), bool(getattr(proposer, "tree", False)),
                              tuple(getattr(proposer, "feature_layers", ()) or ()))
