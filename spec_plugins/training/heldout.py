"""Held-out features checked against the training features they score, before any training runs:
from the training split they measure memorisation, from another target nothing, with other
layers or width the evaluation fails, after the whole training run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spec_plugins.training.features import FeatureStore


def heldout_share(meta: dict) -> float | None:
    """The ``--heldout-share`` that split the ShareGPT conversations features were made from: the
    token shards' own for ``--source tokens``; None where none split them (the prompts source, or
    token shards that do not record one)."""
    if meta.get("source") == "tokens":
        meta = meta.get("token_meta") or {}
    return None if meta.get("source") == "prompts" else meta.get("heldout_share")


def same_data(train: FeatureStore, held: FeatureStore) -> str | None:
    """What makes ``held`` the training features' own conversations, or None: the same directory,
    the same prompts file or token shards (by fingerprint, recorded whatever their split), or both
    of ShareGPT's held-out split (a hash threshold: the smaller share's conversations are in both)."""
    if train.directory.resolve() == held.directory.resolve():
        return "the training features themselves (the same directory)"
    for key in ("prompts (fingerprint)", "token shards (fingerprint)"):
        if train.meta.get(key) is not None and train.meta.get(key) == held.meta.get(key):
            return f"the same {key.removesuffix(' (fingerprint)')} (fingerprint {held.meta[key]})"
    both = [m.get("split") == "heldout" and m.get("source") != "prompts" for m in (train.meta, held.meta)]
    if all(both):
        return ("ShareGPT's held-out split, which the training features were made from too (--split heldout; "
                f"heldout_share {heldout_share(train.meta)} and {heldout_share(held.meta)})")
    return None


def check_heldout(train: FeatureStore, held: FeatureStore, layers: bool = True) -> None:
    """Held-out features score the head trained on ``train``: refused when made from the training
    split, with a larger ``--heldout-share`` than the training split's (the split is a hash
    threshold, so the conversations between the two shares are in both), of another target, of
    another width, or, where the head reads them (``layers``), of other layers; also when they hold
    the training features' own conversations (``same_data``). Features that record no split (token
    shards that do not say, a prompts file of the user's) are otherwise taken as the user says."""
    shared = same_data(train, held)
    if shared:
        raise ValueError(f"held-out features {held.directory} hold {shared} (training features: {train.directory}): "
                         "held-out numbers would be measured on training data; score on features of other "
                         "conversations (train on `train features --split train`, score on `--split heldout`)")
    split = held.meta.get("split")
    if split == "train":
        made = {"tokens": f"token shards of the training split ({held.meta.get('tokens')})",
                "prompts": "the shipped training prompts"}.get(held.meta.get("source"), "the training split")
        raise ValueError(f"held-out features {held.directory} were made from {made}: held-out numbers would be "
                         "measured on training data; make them with `train features --split heldout` (or from "
                         "token shards of `train self-distill --split heldout`)")
    mine_share, their_share = heldout_share(train.meta), heldout_share(held.meta)
    if (split == "heldout" and train.meta.get("split") == "train" and None not in (mine_share, their_share)
            and their_share > mine_share):  # type: ignore[operator]
        raise ValueError(f"held-out features {held.directory} were split with heldout_share {their_share}, the "
                         f"training features {train.directory} with heldout_share {mine_share}: the conversations "
                         "between the two shares are in both splits, so held-out numbers would be measured partly "
                         f"on training data; extract the held-out features with --heldout-share {mine_share} "
                         "(or less)")

    def facts(store: FeatureStore) -> dict[str, Any]:
        read = {"layers": store.meta.get("layers")} if layers else {}
        return {"target": store.meta["target"], **read, "hidden width": store.hidden_size}

    from spec_plugins.models import same_model

    mine, theirs = facts(train), facts(held)
    same = {"target": same_model(mine["target"], theirs["target"])}
    bad = [f"{k} {theirs[k]!r} (training features: {mine[k]!r})" for k in mine
           if not same.get(k, theirs[k] == mine[k])]
    if bad:
        raise ValueError(f"held-out features {held.directory} do not match the training features {train.directory}: "
                         + "; ".join(bad))
