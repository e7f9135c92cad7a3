"""``generate()``'s batch (``input_ids`` and ``attention_mask``) as rows of real tokens: left
padding is stripped, anything else a mask could mean is refused with the reason."""

from __future__ import annotations

import torch


def split_left_padding(input_ids: torch.Tensor, mask: torch.Tensor | None, pad_id: int | None
                        ) -> tuple[list[list[int]], list[list[int]]]:
    """Per row: the real tokens and the left pads before them. Right or inner padding is refused."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    ids = input_ids.tolist()
    if mask is None:
        return ids, [[] for _ in ids]
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(input_ids.shape)}")
    m = (mask != 0).long().cpu()
    n_pad = (m.cumsum(1) == 0).sum(1).tolist()  # leading zeros
    rows, pads = [], []
    for b, (row, k) in enumerate(zip(ids, n_pad)):
        if k == len(row):
            raise ValueError(f"row {b} of attention_mask is all zeros: the row has no prompt token to continue "
                             "(an empty prompt); give every row at least one token with mask 1 (e.g. a BOS token)")
        if int(m[b, k:].sum()) != len(row) - k:
            raise ValueError(_inner_zero(b, k, m, input_ids, pad_id))
        rows.append(row[k:])
        pads.append(row[:k])
    return rows, pads


def _inner_zero(b: int, k: int, m: torch.Tensor, input_ids: torch.Tensor, pad_id: int | None) -> str:
    """Why row ``b``'s mask, with a zero after its first one, is refused. Without an
    ``attention_mask``, ``generate()`` infers one from ``pad_token_id`` (``input_ids != pad``), so
    a pad id inside a prompt masks that token out: say so when the mask is exactly that."""
    zeros = (m[b, k:] == 0).nonzero().flatten()
    at = k + int(zeros[0])
    inner = int(m[b, at:].sum()) > 0  # a one after the zero: not right padding
    if inner and pad_id is not None and torch.equal(m, input_ids.ne(pad_id).long().cpu()):
        return (f"row {b} of the attention mask has a zero inside the prompt (position {at}): if you passed no "
                f"attention_mask, generate() inferred it from pad_token_id={pad_id}, which also occurs inside the "
                "prompt there, and masked that token out; pass an explicit attention_mask (1 for every prompt "
                "token, 0 for the left pads): this engine strips left padding only")
    return (f"row {b} of attention_mask is not left-padded (a zero at position {at}, after the first one); "
            "use tokenizer.padding_side = 'left' for decoder-only generation")
