"""A grammar as a transformers ``LogitsProcessor``: for ``model.generate()``, with or without our
``custom_generate``.

Grammar processors of other libraries keep a matcher that advances one token per call, which
holds only when each call extends the previous one by a token. Under speculation, processors are
called for every drafted node, in depth groups, with prefixes that branch and that a later round
may discard; such a processor drifts out of step. This one is a function of each row's prefix: it
keeps a ``Cursor`` per row, moved on each call to that row's prefix (rolled back to what it shares
with the last prefix, the rest consumed, rebuilt where a drafted branch left the matcher in
error). Any call order is exact.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from spec_plugins.grammar.matcher import ALL, Cursor, ll_tokenizer, mask_of, words_for
from spec_plugins.grammar.rounds import apply_masks
from spec_plugins.grammar.spec import GrammarLimits, GrammarSpec, compile_grammar


class GrammarLogitsProcessor:
    """Tokens the grammar does not allow after a row's completion go to -inf, across the scores'
    whole width: the columns past the grammar's vocabulary (a model's padded vocabulary has them)
    are never allowed.

    ``vocab``: the grammar's vocabulary (default ``len(tokenizer)``). ``prompt_len``: where
    completions start in ``input_ids`` (the padded prompt's width); None: the first call's width
    (one processor per ``generate()`` call). Rows whose completion holds an end-of-sequence token
    are finished and left as they are. A completion with a token the matcher refuses although the
    grammar allowed it (one of llguidance's limits) leaves the matcher in error, which allows
    end-of-sequence only: the row ends there, since a processor cannot report an error."""

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab: int | None = None, eos_ids: Sequence[int] = (),
                 prompt_len: int | None = None, limits: GrammarLimits = GrammarLimits()) -> None:
        vocab = vocab if vocab is not None else len(tokenizer)
        eos = list(eos_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.compiled = compile_grammar(spec, ll_tokenizer(tokenizer, vocab, eos), limits)
        self.eos, self.prompt_len = frozenset(int(e) for e in eos), prompt_len
        self._rows: dict[tuple[int, ...], Cursor] = {}  # by the row's prompt

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_len is None:
            self.prompt_len = int(input_ids.shape[1])
        ids = input_ids.tolist()
        words = words_for(scores.shape[-1])
        masks = np.full((len(ids), words), ALL, dtype=np.int32)  # the grammar's, on the host
        for r, row in enumerate(ids):
            done = row[self.prompt_len:]
            if any(t in self.eos for t in done):
                continue
            bits = self._bits(tuple(row[: self.prompt_len]), done, words)
            if bits is not None:
                masks[r] = bits
        return apply_masks(scores[:, None], torch.from_numpy(masks).to(scores.device)[:, None])[:, 0]

    def _bits(self, prompt: tuple[int, ...], done: list[int], words: int) -> np.ndarray | None:
        """The bitmask [words] after ``done``; None where the grammar does not allow a token of it
        (a drafted node the verifier rejects: its mask is moot)."""
        if prompt not in self._rows:
            self._rows[prompt] = Cursor(self.compiled.matcher)
        cursor = self._rows[prompt]
        if not cursor.move(done) and not cursor.matcher.is_error():
            return None
        return mask_of(cursor.matcher, words)
