"""Names and configs of the bench's methods: the plain reference of a runtime group, ``ours_k<N>``,
the ``--methods`` entries (their configs and labels, checked before any model loads) and the
``--compare-config`` runtimes (their sampling and verifier, which must be the primary's)."""

from __future__ import annotations

import re
from typing import Any, Sequence

from spec_plugins.bench.baselines import BASELINES


def plain_of(group: str) -> str:
    """The plain-decoding method a runtime group's speedups and outputs are measured against."""
    return f"plain@{group}" if group else "plain"


def ours_name(gamma: int | str) -> str:
    return f"ours_k{gamma}" if gamma != "auto" else "ours_auto"


def method_config(base: Any, section: dict, source: str) -> Any:
    """The SpecConfig a ``--methods`` entry runs: ``base`` with ``section`` as its proposer,
    validated (a ``ConfigError`` naming ``source``); the CLI checks each entry this way before
    any model loads."""
    from spec_plugins.config import SpecConfig

    return SpecConfig.parse({**base.model_dump(mode="json", exclude={"proposer"}), "proposer": section}, source)


def check_labels(labels: Sequence[str], built: Sequence[str]) -> None:
    """``--methods`` labels key the results with the built-in methods' names, so a label equal to
    one of those (or to a name the bench gives its own methods: a registered baseline,
    ``ours_k<N>``, ``ours_auto``, ``<name>@<runtime>``) or to another label would merge two
    methods' runs; it is refused, naming it."""
    taken = set(built) | set(BASELINES.names())
    seen: set[str] = set()
    for label in labels:
        if label in taken or re.fullmatch(r"ours_(k\d+|auto)", label) or "@" in label:
            raise ValueError(f"--methods label {label!r} is the name of a method the bench runs itself "
                             f"(built in this run: {', '.join(built)}; also reserved: registered baselines, "
                             "ours_k<N>, ours_auto, <name>@<runtime>); rename it")
        if label in seen:
            raise ValueError(f"--methods label {label!r} is given twice; labels name one method each")
        seen.add(label)


def check_compare_sampling(primary: Any, other: Any, name: str) -> None:
    """A compare config (``SpecConfig``) decodes as the primary one does, or ``plain@<runtime>``'s
    speedup would be over other decoding settings and its outputs would be checked for greedy
    identity (or not) by the primary's; refused, naming both settings. Under greedy decoding the
    seed draws nothing and may differ. Sampled, its verifier must be the primary's too: a lossy one
    on one side only would set a lossy method's speedup beside lossless ones as if they decoded alike."""
    def decoding(cfg: Any) -> dict:
        s = cfg.sampling.model_dump(mode="json")
        return {**s, "seed": None} if cfg.sampling.greedy else s

    if decoding(primary) != decoding(other):
        raise ValueError(f"{name}: its sampling {other.sampling.model_dump(mode='json')} differs from the primary "
                         f"config's {primary.sampling.model_dump(mode='json')}; the bench compares runtimes under "
                         "the same decoding settings: give it the primary's sampling section")
    mine, theirs = primary.verifier.model_dump(mode="json"), other.verifier.model_dump(mode="json")
    if mine != theirs and not primary.sampling.greedy:  # greedy: every verifier matches the argmax
        raise ValueError(f"{name}: its verifier {theirs} differs from the primary config's {mine}; the bench "
                         "compares runtimes under the same verifier: give it the primary's verifier section")
