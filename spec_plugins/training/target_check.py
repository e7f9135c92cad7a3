"""Features hold the hidden states of one model's weights, but name that model by its path: a model
re-saved there with other weights would train a head on one model's states with another's labels.
So ``train features`` records a fingerprint of the target's weights in the features' meta (a hash
of every tensor's name, shape, dtype and a few sampled entries), and training, held-out scoring
and a resumed extraction refuse a target whose fingerprint differs. Stores written before record
none and are taken as they are."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

FINGERPRINT = "target (fingerprint)"  # the meta field, named as the prompts' and token shards' are
ENTRIES = 16  # sampled entries of each tensor


def model_fingerprint(model: Any) -> str:
    """A short hash of every tensor of ``model``'s state dict (by name, in sorted order): its name,
    shape, dtype and ``ENTRIES`` entries at seeded positions. Hidden states depend on every layer,
    so a fine-tune of the decoder layers alone (a merged LoRA) changes it too; the same weights
    loaded again (both sides load fp32 on the CPU) give the same hash. A change that misses every
    sampled entry is not seen. Unlike the heads' ``target_fingerprint`` (float values of the LM
    head and embeddings, compared within a tolerance on a target of any dtype or device: what a
    head's fit depends on), this compares exactly, and costs milliseconds (no tensor is read whole)."""
    digest = hashlib.sha256()
    gen = torch.Generator().manual_seed(0)
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        if flat.numel():
            pos = torch.randint(flat.numel(), (ENTRIES,), generator=gen)
            digest.update(flat[pos.to(flat.device)].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def check_features_model(meta: dict, model: Any, directory: Path) -> None:
    """Refuse ``model`` for features ``directory`` (their ``meta``) made from other weights."""
    recorded = meta.get(FINGERPRINT)
    if recorded is None:  # features written before the fingerprint was recorded
        return
    now = model_fingerprint(model)
    if now != recorded:
        raise ValueError(f"features {directory} were extracted from other weights than the model now at "
                         f"{meta.get('target')!r} ({FINGERPRINT}, a hash of its tensors' names, shapes and sampled "
                         f"entries: {recorded!r} recorded in {directory}, this model's is {now!r}): their hidden "
                         "states are not this model's; extract the features again into a new --out with this "
                         "model, or use the model they were made from")


def rerun_meta(was: dict, meta: dict) -> dict:
    """``meta`` of a rerun as the earlier extraction's ``was`` records the same facts: its target
    path (a rerun may name the model another way; an older run recorded paths as typed), and no
    fingerprint where the older store records none (its shards cannot be checked)."""
    from spec_plugins.models import same_model

    target = was.get("target")
    if "target" in meta and target is not None and same_model(str(target), str(meta["target"])):
        meta = {**meta, "target": target}
    if FINGERPRINT not in was:
        meta = {k: v for k, v in meta.items() if k != FINGERPRINT}
    return meta
