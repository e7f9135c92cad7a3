"""Hybrid drafting: two proposers as one composition, each row taking the draft with the most
expected accepted tokens per unit of verify cost (SuffixDecoding's pairing with a model drafter).

The hybrid only composes: its children follow the batch's rows, learn from every round and report
their metrics. Everything about how much to draft is the draft policy's (``policy/``): it asks
each child to draft where its drafting pays, cheapest first (``policy/sources.py``), and its tree
sizer (``policy/tree_size.py``) picks per row the alternative with the most

    (1 + scale_c x expected_c) / T(1, 1 + nodes_c)

(``scale_c``: the child's own calibration; T: the runtime's forward costs), so a long suffix match
wins with a big tree and free text goes to the model drafter; the chosen trees are cut for the
batch and merged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, ValidationError, model_validator

from spec_plugins.config import ProposerConfig, _format_errors, plugin_class
from spec_plugins.proposers.base import Metric, ProposeContext, Proposer, ProposerTraits, RoundRecord, RowAware
from spec_plugins.registry import PROPOSERS, register_proposer
from spec_plugins.types import Ranked, RankedRow


DEFAULT_NODES = 16  # a child's tree size inside a hybrid, where its own default is 'auto'
RANKING = "suffix, eagle, parallel, or recycling with tree_size: auto"  # the children that rank as configured


def child_config(section: dict[str, Any], num_draft_tokens: int | str,
                 index: int | None = None) -> tuple[type[Proposer], ProposerConfig]:
    """A child's class and config as the hybrid builds it: the hybrid's depth unless the section
    sets its own, and a fixed tree size where the child's default is 'auto' (the hybrid sizes).
    A section that does not validate is a ValueError naming it (``proposers[1] (suffix): ...``):
    the child's own field errors would otherwise read as the hybrid's."""
    where = "proposers" + (f"[{index}]" if index is not None else "")
    try:
        cls = plugin_class(PROPOSERS, "type", section.get("type"))
    except ValueError as exc:
        raise ValueError(f"hybrid: {where}: {exc}") from exc
    try:
        sub = cls.Config.model_validate({"num_draft_tokens": num_draft_tokens, **section})
    except ValidationError as exc:
        raise ValueError(f"{where} ({section.get('type')}): {_format_errors(exc)}") from None
    if getattr(sub, "tree_nodes", None) == "auto":  # a default 'auto' (an explicit one is refused)
        sub = sub.model_copy(update={"tree_nodes": DEFAULT_NODES})
    return cls, sub


def _unranked(name: Any) -> str:
    """The refusal of a child that would draft a plain ``Draft``, which the policy cannot choose by."""
    return (f"hybrid: proposer {name} does not rank its candidates as configured (best-first nodes with "
            f"acceptance estimates, for the policy to choose between the children); use {RANKING}")


def _one_feature_kind(children: Sequence[Proposer], traits: Sequence[ProposerTraits]) -> tuple[int, ...]:
    """The decoder layers the children read (() = the last hidden state): the target returns one
    kind of feature per forward, so children that read different ones are refused, each named."""
    readers = [(c, t.feature_layers) for c, t in zip(children, traits) if t.needs_hidden or t.feature_layers]
    if len({layers for _, layers in readers}) > 1:
        said = "; ".join(f"{_named(c)} reads " + (f"decoder layers {list(layers)}" if layers
                                                    else "the last hidden state") for c, layers in readers)
        raise ValueError(f"hybrid: the children read different target features ({said}); the target returns one "
                         "kind per forward, so pair drafters trained on the same features")
    return readers[0][1] if readers else ()


def _named(child: Proposer) -> str:
    """A child as its config names it: its type, and its heads where it has some."""
    config = getattr(child, "config", None)
    name = getattr(config, "type", type(child).__name__)
    heads = getattr(config, "heads", None)
    return f"{name} ({heads})" if heads else name


def _per_child(name: str, i: int) -> str:
    """Child ``i``'s own name for a metric: ``spec_child{i}_`` before the rest of its name."""
    return f"spec_child{i}_{name.removeprefix('spec_')}"


@register_proposer("hybrid")
class HybridProposer(Proposer):
    """Per row, the better of two proposers' drafts (module docstring)."""

    tree = True
    ranks = True

    class Config(ProposerConfig):
        type: Literal["hybrid"] = "hybrid"
        proposers: list[dict[str, Any]] = Field(
            description="The two proposer sections, e.g. [{type: suffix, scope: global}, {type: eagle, heads: DIR}]; "
                        f"each must rank its candidates ({RANKING}) and use a fixed tree_nodes.")
        tree_nodes: Literal["auto"] = Field("auto", description="Always 'auto': the draft policy picks each row's "
                                                                 "child and cuts the trees by the measured costs.")

        @property
        def auto_tree(self) -> bool:
            return True

        @model_validator(mode="after")
        def _two(self) -> "HybridProposer.Config":
            if len(self.proposers) != 2:
                raise ValueError(f"hybrid takes exactly two proposers, got {len(self.proposers)}")
            for i, p in enumerate(self.proposers):
                if p.get("type") == "hybrid":
                    raise ValueError("a hybrid cannot contain a hybrid")
                if p.get("tree_nodes") == "auto":
                    raise ValueError(f"{p.get('type')}: tree_nodes must be a number inside a hybrid "
                                     "(the hybrid sizes by choosing between the drafts)")
                cls, sub = child_config(p, self.num_draft_tokens, i)
                if not cls.ranks_with(sub):
                    raise ValueError(_unranked(p.get("type")))
            return self

    def __init__(self, config: "HybridProposer.Config", target: Any = None, children: Sequence[Any] | None = None,
                 **kw: Any) -> None:
        self.config = config
        if children is None:
            children = []
            for i, section in enumerate(config.proposers):
                cls, sub = child_config(section, config.num_draft_tokens, i)
                children.append(cls(sub, target=target, **kw))
        self.children = list(children)
        for c in self.children:
            if not ProposerTraits.of(c).ranks:
                raise ValueError(_unranked(type(c).__name__))
        traits = [ProposerTraits.of(c) for c in self.children]
        self.needs_hidden = any(t.needs_hidden for t in traits)
        self.feature_layers = _one_feature_kind(self.children, traits)

    def sources(self) -> list[Proposer]:
        """The children: the draft policy asks each to draft where it pays."""
        return self.children

    def forget(self) -> None:
        """Drop the children's cross-request memory."""
        for c in self.children:
            if ProposerTraits.of(c).remembers:
                c.forget()

    def metrics(self) -> list[Metric]:
        """Every child's own metrics (suffix decoding's index inside a suffix + EAGLE hybrid). A name
        both children report (two suffix children) is made per child (``_per_child``): /metrics
        gives a family one HELP and TYPE, and Prometheus refuses a family that comes twice."""
        per = [c.metrics() if ProposerTraits.of(c).reports else [] for c in self.children]
        shared = Counter(name for ms in per for name in {m[0] for m in ms})
        out: list[Metric] = []
        for i, (child, ms) in enumerate(zip(self.children, per)):
            for name, kind, help_, value in ms:
                if shared[name] > 1:
                    name, help_ = _per_child(name, i), f"{help_.rstrip('.')} (hybrid child {i}, {_named(child)})."
                out.append((name, kind, help_, value))
        return out

    # ---- rows: every child follows the batch ---------------------------------------------------------
    def admit(self, prompts: Sequence[Sequence[int]]) -> None:
        for c in self.children:
            if isinstance(c, RowAware):
                c.admit(prompts)

    def select_rows(self, rows: Sequence[int]) -> None:
        for c in self.children:
            if isinstance(c, RowAware):
                c.select_rows(rows)

    def num_rows(self) -> int:
        return next((c.num_rows() for c in self.children if isinstance(c, RowAware)), 0)

    def features_pending(self, sequences: Sequence[Sequence[int]]) -> list[int | None]:
        """Per row, the most any child still needs: a child the policy's gate skipped keeps its
        features until it drafts again. A child's None (the last round's) is within any count,
        since a counting child has not fed the last round either."""
        per = [c.features_pending(sequences) for c in self.children]
        return [max((n for n in ns if n is not None), default=None) for ns in zip(*per)]

    # ---- drafting ---------------------------------------------------------------------------------
    def propose(self, ctx: ProposeContext) -> Ranked | None:
        """Every child's candidates per row, tagged with the child as their source (what the draft
        policy's gate does with the children that pay; this is the composition drafted whole, as
        a caller without a policy sees it)."""
        alts: list[list[RankedRow]] = [[] for _ in ctx.sequences]
        shaped = []
        for i, c in enumerate(self.children):
            ranked = c.propose(ctx)
            if ranked:
                tagged = ranked.tagged(i)
                for b, row in enumerate(tagged.rows):
                    alts[b] += row
                shaped += tagged.shaped
        out = Ranked(alts, True, shaped)
        return out if out else None

    def to_fetch(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for c in self.children:
            out |= c.to_fetch(z)
        return out

    def observe(self, record: RoundRecord) -> None:
        """Each child learns from the round (suffix: finished rows enter its index)."""
        for c in self.children:
            c.observe(record)
