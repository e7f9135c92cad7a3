"""Draft/target vocabulary agreement: same token -> id map, logits widths reconciled."""

from __future__ import annotations

from typing import Any

import torch


class VocabMismatch(ValueError):
    pass


def check_vocab_compatible(target_tok: Any, draft_tok: Any, a: str = "target", b: str = "draft") -> None:
    """Refuse a draft whose tokenizer maps tokens to different ids. Padding rows in the
    embedding/LM head (logits wider than the vocabulary) are fine and handled by fit_vocab."""
    va, vb = target_tok.get_vocab(), draft_tok.get_vocab()
    if va == vb:
        return
    diffs = [(t, i, vb.get(t)) for t, i in va.items() if vb.get(t) != i]
    only_b = [t for t in vb if t not in va]
    sample = ", ".join(f"{t!r}: {a} id {i}, {b} id {j}" for t, i, j in sorted(diffs, key=lambda d: d[1])[:3])
    raise VocabMismatch(
        f"tokenizer/vocabulary mismatch between {a} ({len(va)} tokens) and {b} ({len(vb)} tokens): "
        f"{len(diffs)} tokens differ" + (f" ({sample})" if sample else "")
        + (f"; {len(only_b)} tokens only in {b}" if only_b else "")
        + ". Speculative decoding needs the same tokenizer for both models."
    )


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Crop or -inf-pad the last dim of draft logits to the target's logits width."""
    v = logits.shape[-1]
    if v == width:
        return logits
    if v > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - v), float("-inf"))
    return torch.cat([logits, pad], -1)
