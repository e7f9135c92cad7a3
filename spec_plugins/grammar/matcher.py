"""A row's grammar state: masks for every node of a round's draft, forced tokens, and commits.

The committed state advances only by emitted tokens (``advance``). A round's masks are built by
walking the drafted tree from that state: each node's mask is the grammar state after the node's
path, reached by rolling back to the common ancestor of the last node walked and consuming the
rest, then rolled back to the committed state at the end. A drafted token the grammar does not
allow after its parent is never consumed (a matcher that consumes one stays in error): that node
and its subtree get the all-allowed mask, since the verifier rejects the node already (its
probability under the masked target is 0) and an all-masked row would read as a failed sampling.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from spec_plugins.grammar.spec import Compiled, GrammarError

ALL = -1  # an int32 word with every bit set: 32 tokens allowed


def words_for(vocab: int) -> int:
    """int32 words of a bitmask over ``vocab`` tokens."""
    return (vocab + 31) // 32


class RowGrammar:
    """One row's matcher over a ``vocab``-wide logits row (module docstring)."""

    def __init__(self, compiled: Compiled, eos_ids: Sequence[int], vocab: int, draft_forced: bool = True) -> None:
        """``draft_forced``: draft the tokens the grammar forces (``grammar.rounds``)."""
        self.matcher = compiled.matcher()
        self.draft_forced = draft_forced
        self.eos = frozenset(int(e) for e in eos_ids)
        self.vocab, self.words = vocab, words_for(vocab)
        self.error = ""  # why the output left the grammar, if it did (``advance``)

    def mask(self) -> np.ndarray:
        """The bitmask [words] int32 of the tokens allowed next."""
        out = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        if out.shape[0] < self.words:  # the grammar's tokenizer is narrower than the logits
            out = np.concatenate([out, np.zeros(self.words - out.shape[0], np.int32)])
        return out[: self.words]

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar allows alone from the committed state."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]

    def advance(self, tokens: Sequence[int]) -> bool:
        """Commit emitted tokens (up to an end-of-sequence token, which ends the row); False if
        one left the grammar (``error`` says which: the masks make that a bug, never a choice)."""
        for t in tokens:
            if t in self.eos:
                return True
            if not self.matcher.consume_token(int(t)):
                self.error = f"token {t}: {self.matcher.get_error().strip().splitlines()[0]}"
                return False
        return True

    def masks(self, tokens: Sequence[int], parents: Sequence[int], valid: Sequence[bool] | None = None) -> np.ndarray:
        """[1 + n, words] int32: row 0 the root's mask (the committed state), row j + 1 that after
        node j's path (``parents[j]``: -1 = the root; a parent precedes its children)."""
        n = len(tokens)
        out = np.full((1 + n, self.words), ALL, dtype=np.int32)
        out[0] = self.mask()
        if self.matcher.is_stopped():
            return out  # nothing but end-of-sequence can follow: no drafted node survives it
        paths: list[tuple[int, ...] | None] = [None] * n  # node ids from the root down, live nodes only
        walked: tuple[int, ...] = ()  # nodes the matcher has consumed beyond the committed state
        for j in range(n):
            p, t = int(parents[j]), int(tokens[j])
            base = () if p < 0 else paths[p]
            if base is None or (valid is not None and not valid[j]) or t in self.eos or not _allowed(out[p + 1], t):
                continue
            walked = self._walk(walked, base, tokens)
            self.matcher.consume_token(t)
            walked = base + (j,)
            paths[j] = walked
            out[j + 1] = self.mask()
        self.matcher.rollback(len(walked))
        return out

    def _walk(self, walked: tuple[int, ...], base: tuple[int, ...], tokens: Sequence[int]) -> tuple[int, ...]:
        """Move the matcher from the state after ``walked`` to that after ``base``."""
        common = 0
        while common < min(len(walked), len(base)) and walked[common] == base[common]:
            common += 1
        if len(walked) > common:
            self.matcher.rollback(len(walked) - common)
        for node in base[common:]:
            self.matcher.consume_token(int(tokens[node]))
        return base


def _allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> Any:
    """The llguidance tokenizer of a Hugging Face fast tokenizer over ``vocab`` logits, built
    once per (tokenizer, vocab, eos) (building reads the whole vocabulary: about 0.4 s)."""
    import llguidance.hf

    key = (vocab, tuple(sorted(int(e) for e in eos_ids)))
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in per:
        try:
            per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(key[1]) or None)
        except ValueError as exc:
            raise GrammarError(f"grammars need a fast (Rust) Hugging Face tokenizer: {exc}") from None
    return per[key]
