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
from spec_plugins.grammar.spec import GrammarError, GrammarLimits, GrammarSpec, compile_grammar


ONE_CALL = "a GrammarLogitsProcessor serves one generate() call; build a new one per call"


class _Row:
    """A prompt's state: its cursor, and the completions processed after it (their hashes)."""

    def __init__(self, origin: Any) -> None:
        self.cursor = Cursor(origin)
        self.seen: set[int] = set()


class GrammarLogitsProcessor:
    """Tokens the grammar does not allow after a row's completion go to -inf, across the scores'
    whole width: the columns past the grammar's vocabulary (a model's padded vocabulary has them)
    are never allowed.

    ``vocab``: the grammar's vocabulary (default ``len(tokenizer)``). ``prompt_len``: where
    completions start in ``input_ids`` (the padded prompt's width); None: the first call's width.
    Rows whose completion holds an end-of-sequence token are finished and left as they are. A
    completion with a token the matcher refuses although the grammar allowed it (one of
    llguidance's limits) leaves the matcher in error, which allows end-of-sequence only: the row
    ends there, since a processor cannot report an error.

    One processor serves one ``generate()`` call: it cannot see where a call starts, and a later
    call's prompt read as a completion would leave its rows unconstrained. Within a call, every
    prefix after the first call's extends one it processed by a token (a step, or a drafted
    node's parent); a call that does not (narrower than the prompt, or a row no prefix it
    processed leads to) raises ``GrammarError`` naming ``ONE_CALL``, before any state changes."""

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab: int | None = None, eos_ids: Sequence[int] = (),
                 prompt_len: int | None = None, limits: GrammarLimits = GrammarLimits()) -> None:
        vocab = vocab if vocab is not None else len(tokenizer)
        eos = list(eos_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.compiled = compile_grammar(spec, ll_tokenizer(tokenizer, vocab, eos), limits)
        self.eos, self.prompt_len = frozenset(int(e) for e in eos), prompt_len
        self._rows: dict[tuple[int, ...], _Row] = {}  # by the row's prompt

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self._rows:  # the first call: it sets the prompt width where none was given
            given = self.prompt_len
            try:
                return self._masked(input_ids, scores, first=True)
            except GrammarError:
                self._rows.clear()
                self.prompt_len = given
                raise
        return self._masked(input_ids, scores, first=False)

    def _masked(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, first: bool) -> torch.FloatTensor:
        if self.prompt_len is None:
            self.prompt_len = int(input_ids.shape[1])
        if input_ids.shape[1] < self.prompt_len:
            raise GrammarError(f"{ONE_CALL}: input_ids has {input_ids.shape[1]} columns, fewer than the "
                               f"{self.prompt_len} of the prompt it started on")
        ids = [(tuple(row[: self.prompt_len]), row[self.prompt_len:]) for row in input_ids.tolist()]
        if not first:
            self._check_continues(ids)
        words = words_for(scores.shape[-1])
        masks = np.full((len(ids), words), ALL, dtype=np.int32)  # the grammar's, on the host
        for r, (prompt, done) in enumerate(ids):
            row = self._rows.setdefault(prompt, _Row(self.compiled.matcher))
            row.seen.add(hash(tuple(done)))
            if any(t in self.eos for t in done):
                continue
            bits = self._bits(row.cursor, done, words, first)
            if bits is not None:
                masks[r] = bits
        return apply_masks(scores[:, None], torch.from_numpy(masks).to(scores.device)[:, None])[:, 0]

    def _check_continues(self, ids: Sequence[tuple[tuple[int, ...], list[int]]]) -> None:
        """Raise where a row's prefix extends none this processor processed by a token: a later
        ``generate()`` call's prompt, not a completion (the class docstring)."""
        for r, (prompt, done) in enumerate(ids):
            row = self._rows.get(prompt)
            if done and (row is None or hash(tuple(done[:-1])) not in row.seen):
                raise GrammarError(f"{ONE_CALL}: row {r} of input_ids does not continue a prefix this processor "
                                   "processed (the prompt of another generate() call?)")

    def _bits(self, cursor: Cursor, done: list[int], words: int, first: bool) -> np.ndarray | None:
        """The bitmask [words] after ``done``; None where the grammar does not allow a token of it:
        a drafted node the verifier rejects (its mask is moot). On the first call no token is
        drafted: there such a completion (after an explicit ``prompt_len``) is an error."""
        if not cursor.move(done) and not cursor.matcher.is_error():
            if first:
                raise GrammarError(f"the completion after prompt_len={self.prompt_len} holds a token the grammar "
                                   "does not allow there")
            return None
        return mask_of(cursor.matcher, words)
