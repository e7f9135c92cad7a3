"""Draft/target vocabulary agreement: same token -> id map, logits widths reconciled."""

from __future__ import annotations

from typing import Any

import torch


class VocabMismatch(ValueError):
    pass


def check_vocab_compatible(target_tok: Any, draft_tok: Any, a: str = "target", b: str = "draft") -> None:
    """Refuse a draft whose tokenizer maps a token both tokenizers hold to another id, or gives
    an id the target holds to another token: its drafts would mean other text. Tokens only one of
    them holds, at ids only it holds (added tokens past the other's vocabulary: a fine-tune's pad
    token) are accepted, and the output stays exact: the draft's logits are cut or -inf-padded to
    the target's width (``fit_vocab``), and a draft model reading a target token past its own
    vocabulary stops drafting for that row (``DraftModelProposer._blind``)."""
    va, vb = target_tok.get_vocab(), draft_tok.get_vocab()
    if va == vb:
        return
    diffs = [(t, i, vb[t]) for t, i in va.items() if t in vb and vb[t] != i]
    by_id = {i: t for t, i in va.items()}
    reused = sorted((j, by_id[j], t) for t, j in vb.items() if t not in va and j in by_id)
    if not diffs and not reused:
        return
    said = []
    if diffs:
        sample = ", ".join(f"{t!r}: {a} id {i}, {b} id {j}" for t, i, j in sorted(diffs, key=lambda d: d[1])[:3])
        said.append(f"{len(diffs)} tokens both hold have different ids ({sample})")
    if reused:
        sample = ", ".join(f"id {j}: {a} {ta!r}, {b} {tb!r}" for j, ta, tb in reused[:3])
        said.append(f"{len(reused)} ids name other tokens ({sample})")
    raise VocabMismatch(
        f"tokenizer/vocabulary mismatch between {a} ({len(va)} tokens) and {b} ({len(vb)} tokens): "
        + "; ".join(said) + ". Speculative decoding needs the same tokenizer for both models (tokens "
        "only one of them holds, at ids only it holds, are fine)."
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
