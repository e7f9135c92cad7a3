"""A row's grammar state: masks for every node of a round's draft, forced tokens, and commits.

The committed state advances only by emitted tokens (``advance``). A round's masks are built by a
``Cursor`` on a copy of that state: each node's mask is the grammar state after the node's path,
reached by rolling back to what the path shares with the last node walked and consuming the rest.
A drafted branch never touches the committed state; where one leaves the cursor's matcher in an
error state (which no llguidance rollback leaves), the cursor rebuilds it.

Masks and forced tokens are computed on a throwaway copy of the matcher they describe (``mask_of``):
llguidance's ``consume_token`` after a mask computed at the same state runs a forced-token step,
which fails on llguidance's item limit where the forced text never ends (``start: "a" start``),
while the same tokens consumed with no mask computed in between succeed. Every matcher here only
consumes, as a fresh one fed the whole output does, so a row follows the same grammar however its
masks were asked for (a copy is cheap beside the mask it serves: docs/structured-outputs.md).

A drafted token the mask does not allow after its parent is never consumed: that node and its
subtree get the all-allowed mask, since the verifier rejects the node already (its probability
under the masked target is 0) and an all-masked row would read as a failed sampling. So does a
node the matcher refuses to consume although its mask allowed it; where the target takes it,
``advance`` refuses it too and the row ends with ``error``. A state with no way on (no token of
the vocabulary continues the grammar) has a mask allowing end-of-sequence only, and ``advance``
ends that row with ``error``, naming the cause, not as a finished output (the tokens before the
refused one are still emitted: ``loop.rows.Row.emit``). llguidance does not always see such a
state up front: inside a JSON string whose pattern no token can go on with (``"ab`` under
``^abz$``), its mask allows the closing quote, which its parser then refuses; ``advance`` names
that cause too, where no token the mask allows can be consumed. A token refused on one of
llguidance's complexity limits (its lexer's: then it consumes nothing more) is named as that limit.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import numpy as np

from spec_plugins.grammar.spec import _CAUSES, Compiled, GrammarError, error_of, too_complex

ALL = -1  # an int32 word with every bit set: 32 tokens allowed


def words_for(vocab: int) -> int:
    """int32 words of a bitmask over ``vocab`` tokens."""
    return (vocab + 31) // 32


def mask_of(matcher: Any, words: int) -> np.ndarray:
    """The bitmask [words] int32 of the tokens allowed after ``matcher``'s state, computed on a
    copy (module docstring). The columns past the grammar's tokenizer are disallowed: a model's
    logits are often wider than its tokenizer."""
    out = np.frombuffer(matcher.deep_copy().compute_bitmask(), dtype=np.int32)
    if out.shape[0] < words:
        out = np.concatenate([out, np.zeros(words - out.shape[0], np.int32)])
    return out[:words]


class Cursor:
    """A matcher moved between token paths from one origin state (what ``origin()`` builds), by
    rolling back to what the new path shares with the last and consuming the rest. A matcher in
    error never leaves it (llguidance's rollback fails there): such a matcher, or one whose
    rollback fails, is replaced by a fresh ``origin()`` and the path is consumed again."""

    def __init__(self, origin: Callable[[], Any]) -> None:
        self.origin = origin
        self.matcher = origin()
        self.path: list[int] = []  # the tokens consumed from the origin state

    def move(self, path: Sequence[int]) -> bool:
        """Put the matcher at the state after ``path``; False where the grammar refuses one of its
        tokens (not allowed there, or not consumable): the path is dead."""
        common = 0
        while common < min(len(self.path), len(path)) and self.path[common] == path[common]:
            common += 1
        back = len(self.path) - common
        if self.matcher.is_error() or (back and not self.matcher.rollback(back)):
            self.matcher, self.path, common = self.origin(), [], 0
        else:
            del self.path[common:]
        for t in path[common:]:
            if self.matcher.validate_tokens([int(t)]) != 1 or not self.matcher.consume_token(int(t)):
                return False  # a refused consume leaves the matcher in error: the next move rebuilds it
            self.path.append(int(t))
        return True


class RowGrammar:
    """One row's matcher over a ``vocab``-wide logits row (module docstring)."""

    def __init__(self, compiled: Compiled, eos_ids: Sequence[int], vocab: int, draft_forced: bool = True) -> None:
        """``draft_forced``: draft the tokens the grammar forces (``grammar.rounds``)."""
        self.matcher = compiled.matcher()
        self.origin = compiled.matcher
        self.tokens: list[int] = []  # the committed tokens: a refusal replays them (``_refusal``)
        self.draft_forced = draft_forced
        self.eos = frozenset(int(e) for e in eos_ids)
        self.vocab, self.words = vocab, words_for(vocab)
        self.error = ""  # why the output cannot go on in its grammar, if it cannot (``advance``)

    def mask(self) -> np.ndarray:
        """The bitmask [words] int32 of the tokens allowed next."""
        return mask_of(self.matcher, self.words)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar allows alone from the committed state (computed on a
        copy, as masks are: module docstring)."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return [int(t) for t in self.matcher.deep_copy().compute_ff_tokens()[:limit]]

    def advance(self, tokens: Sequence[int]) -> int:
        """Commit emitted tokens; returns how many the grammar accepted: all of them, or those
        before the first it refuses (``error`` says why): a token the matcher refuses, or an end of
        sequence where the output is not complete in the grammar. A round emits several tokens, so
        the ones before a refused token stay the output, as one-token rounds would have left them.
        An end-of-sequence token it allows ends the grammar, and the row (``Row.emit`` cuts there,
        also where the decoder's own end-of-sequence ids are others)."""
        for i, t in enumerate(tokens):
            if t in self.eos:
                self.tokens.extend(map(int, tokens[:i]))
                return len(tokens) if self._may_end(int(t)) else i
            if not self.matcher.consume_token(int(t)):
                self.error = f"token {t}: {self._refusal(tokens[:i])}"
                return i
        self.tokens.extend(map(int, tokens))
        return len(tokens)

    def _refusal(self, before: Sequence[int]) -> str:
        """Why the matcher refused the token after the committed tokens and ``before``: one of
        llguidance's complexity limits, named as such (its lexer then refuses every token, which
        is no fault of the vocabulary); where no token the mask there allows can be consumed, the
        grammar has no way on (module docstring); else llguidance's error. The state is rebuilt by
        replaying the tokens from the origin (a matcher in error cannot roll back): only a failing
        row pays for it."""
        if too_complex(self.matcher):
            return error_of(self.matcher)
        state = self.origin()
        if not state.consume_tokens(self.tokens + list(map(int, before))) or state.is_accepting():
            return error_of(self.matcher)
        probe = state.deep_copy()
        bits = np.unpackbits(np.frombuffer(probe.compute_bitmask(), np.uint8), bitorder="little")[: self.vocab]
        if probe.is_error():  # the mask allows end-of-sequence only: llguidance names why
            return error_of(probe)
        if any(state.validate_tokens([int(t)]) == 1 for t in np.flatnonzero(bits) if int(t) not in self.eos):
            return error_of(self.matcher)
        return (f"{_CAUSES['NoExtensionBias']} (llguidance's mask allows tokens its parser then refuses: "
                f"{error_of(self.matcher)})")

    def _may_end(self, eos: int) -> bool:
        """Whether the output may end here: only where it is complete in its grammar. The masks
        allow end-of-sequence elsewhere only where the grammar has no way on (llguidance's error
        state, met on the mask's copy): that row ends with ``error`` naming why."""
        if self.matcher.is_accepting():
            return True
        probe = self.matcher.deep_copy()
        probe.compute_bitmask()
        why = error_of(probe) if probe.is_error() else "the output is not complete in its grammar"
        self.error = f"token {eos} (end of sequence): {why}"
        return False

    def masks(self, tokens: Sequence[int], parents: Sequence[int], valid: Sequence[bool] | None = None) -> np.ndarray:
        """[1 + n, words] int32: row 0 the root's mask (the committed state), row j + 1 that after
        node j's path (``parents[j]``: -1 = the root; a parent precedes its children)."""
        n = len(tokens)
        out = np.full((1 + n, self.words), ALL, dtype=np.int32)
        out[0] = self.mask()
        if self.matcher.is_stopped():
            return out  # nothing but end-of-sequence can follow: no drafted node survives it
        walk = Cursor(self.matcher.deep_copy)  # the committed state is never walked
        paths: list[tuple[int, ...] | None] = [None] * n  # each live node's tokens from the root
        for j in range(n):
            p, t = int(parents[j]), int(tokens[j])
            base = () if p < 0 else paths[p]
            if base is None or (valid is not None and not valid[j]) or t in self.eos or not _allowed(out[p + 1], t):
                continue
            if walk.move(base + (t,)):
                paths[j] = base + (t,)
                out[j + 1] = mask_of(walk.matcher, self.words)
        return out


def _allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> Any:
    """The llguidance tokenizer of a Hugging Face fast tokenizer over ``vocab`` logits, built
    once per (tokenizer, vocab, eos) (building reads the whole vocabulary: about 0.4 s). No
    ``eos_ids`` is a ``GrammarError``: a grammar's output ends with end-of-sequence."""
    import llguidance.hf

    if not eos_ids:  # llguidance would take token 0 as the end, which the decoder does not end on
        raise GrammarError("a grammar needs an end-of-sequence token id to end its output, and this model/"
                           "tokenizer has none; set the tokenizer's eos_token (or the model's eos_token_id)")
    key = (vocab, tuple(sorted(int(e) for e in eos_ids)))
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in per:
        tokens = max(tokenizer.get_vocab().values(), default=-1) + 1
        if tokens > vocab:  # its ids past the logits could never be sampled: not this model's tokenizer
            raise GrammarError(f"the tokenizer has {tokens} tokens but the model's vocabulary (its logits) has "
                               f"{vocab}; the tokenizer does not belong to this model")
        try:
            per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(key[1]))
        except ValueError as exc:
            raise GrammarError(f"grammars need a fast (Rust) Hugging Face tokenizer: {exc}") from None
    return per[key]
