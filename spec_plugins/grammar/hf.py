"""A grammar as a transformers ``LogitsProcessor``: for ``model.generate()``, with or without our
``custom_generate``.

Grammar processors of other libraries keep a matcher that advances one token per call, which
holds only when each call extends the previous one by a token. Under speculation, processors are
called for every drafted node, in depth groups, with prefixes that branch and that a later round
may discard; such a processor drifts out of step. This one is a function of each row's prefix: it
keeps a matcher per row and, on each call, rolls it back to what that row's prefix shares with
the last prefix it saw, then consumes the rest. Any call order is exact.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from spec_plugins.grammar.matcher import ll_tokenizer, words_for
from spec_plugins.grammar.spec import GrammarLimits, GrammarSpec, compile_grammar


class GrammarLogitsProcessor:
    """Tokens the grammar does not allow after a row's completion go to -inf.

    ``prompt_len``: where completions start in ``input_ids`` (the padded prompt's width); None:
    the first call's width (one processor per ``generate()`` call). Rows whose completion holds an
    end-of-sequence token are finished and left as they are."""

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab: int | None = None, eos_ids: Sequence[int] = (),
                 prompt_len: int | None = None, limits: GrammarLimits = GrammarLimits()) -> None:
        vocab = vocab if vocab is not None else len(tokenizer)
        eos = list(eos_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.compiled = compile_grammar(spec, ll_tokenizer(tokenizer, vocab, eos), limits)
        self.eos, self.words, self.prompt_len = frozenset(int(e) for e in eos), words_for(vocab), prompt_len
        self._rows: dict[tuple[int, ...], tuple[Any, list[int]]] = {}  # by the row's prompt: matcher, consumed

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_len is None:
            self.prompt_len = int(input_ids.shape[1])
        ids = input_ids.tolist()
        masks = torch.full((len(ids), self.words), -1, dtype=torch.int32, device="cpu")  # the grammar's, on the host
        for r, row in enumerate(ids):
            done = row[self.prompt_len:]
            if any(t in self.eos for t in done):
                continue
            bits = self._matcher(tuple(row[: self.prompt_len]), done)
            if bits is not None:
                masks[r] = torch.frombuffer(bytearray(bits), dtype=torch.int32)[: self.words]
        shifts = torch.arange(32, dtype=torch.int32, device="cpu")
        allowed = ((masks[..., None] >> shifts) & 1).bool().reshape(len(ids), -1)[:, : scores.shape[-1]]
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def _matcher(self, prompt: tuple[int, ...], done: list[int]) -> bytes | None:
        """The bitmask after ``done``, from the row's matcher moved there by rollback and consume
        (None where ``done`` leaves the grammar)."""
        if prompt not in self._rows:
            self._rows[prompt] = (self.compiled.matcher(), [])
        m, seen = self._rows[prompt]
        common = 0
        while common < min(len(seen), len(done)) and seen[common] == done[common]:
            common += 1
        if len(seen) > common:
            m.rollback(len(seen) - common)
            del seen[common:]
        for t in done[common:]:
            if m.validate_tokens([int(t)]) != 1:
                return None  # a drafted node the grammar refuses: the verifier rejects it, its mask is moot
            m.consume_token(int(t))
            seen.append(int(t))
        return m.compute_bitmask()
