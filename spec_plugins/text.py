"""One incremental text stream per row: tokens in, the text they complete out, stop strings
turned into row stops. Used by ``generate``, ``stream``, ``generate_batch`` and the server.

Decoding the whole output again every round is quadratic in its length (2,000 tokens: two
million characters decoded). Instead each token is decoded in a short window: its first ``read``
tokens are text already emitted, decoding all of it and removing that part gives the new text (the
offsets of TGI's and vLLM's detokenizers), held back while it ends in an incomplete UTF-8
character (U+FFFD). Work per token is the window, so a stream is linear in its length. Two things
would grow the window without bound, so they are kept out of it: tokens ``decode`` leaves out
(special tokens with ``skip_special_tokens``) never enter it, costing no decode (dropping them is
what ``decode`` does); and held-back tokens are released once they cannot change any more
(``_release``): a UTF-8 character has at most 4 bytes, so of a long held run only the last 3
tokens can still complete one, the text before them shows U+FFFD for good (byte-level decoders
per ill-formed sequence, byte-fallback ones for every byte of a run holding one).

Stop strings are searched only in text not searched before (plus the longest stop's length
minus one, for a stop spanning two tokens), also while a character is held back: the complete
text before it (a space in the token that starts an emoji) may finish a stop string, and the
incomplete tail a row ends on (``flush``) is searched too (only a stop string holding U+FFFD
can start there; the text then ends before it, the row having finished already). A hit becomes
a row stop (``StopStrings``, a ``types.RowStop``): the row keeps its tokens up to the one that
completed the stop string and finishes with reason ``"stop"`` (on text that spells special
tokens, a stop the EOS token completes leaves ``"eos_token"``: ``StopStrings.eos_first``), inside
the round, so no token past the stop is ever computed.

The stream's text is the row's text: ``generate``, ``stream``, ``generate_batch`` and the
server's OpenAI routes (streamed or not) all return it. It is ``decode`` of the row's ids except
where that would change text already emitted (``_window``): a byte-fallback run that a later byte
makes invalid, which ``decode`` shows as one U+FFFD per byte, characters before the bad byte
included; the stream keeps the characters it emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_BAD = "\ufffd"  # what decode shows for bytes that are not (yet) a whole UTF-8 character
_TAIL = 3  # held tokens that may still complete a character (its bytes but the last, one a token)
_CONTEXT = 4  # held tokens kept as the context of a released run: one character's bytes


def _special_ids(tok: Any) -> set[int]:
    """The ids a tokenizer lists as special (``decode`` may leave them out): transformers keeps
    some only in ``added_tokens_decoder`` (SmolLM2's ``<repo_name>``), some only in
    ``all_special_ids``."""
    ids = set(getattr(tok, "all_special_ids", None) or ())
    added = getattr(tok, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return ids


class TextStream:
    """Incremental detokenization of one row (module docstring)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.stops = [s for s in stops if s]
        self._span = max((len(s) for s in self.stops), default=1) - 1  # a stop may span two pushes
        self.ids: list[int] = []
        self.pieces: list[str] = []  # per token: the text it completed ("" while held back or after a stop)
        self.text = ""  # everything emitted so far
        self.stop_at: int | None = None  # index in ``text`` where the first stop string starts
        self._win: list[int] = []  # the decode window: emitted context, then held-back tokens
        self._read = 0  # index in ``_win`` where the tokens not yet emitted start
        self._searched = 0  # text before this index was searched for stops
        self._ahead = 0  # characters of the held-back text emitted already (``_settled_stop``)
        self._specials: set[int] | None = None  # listed special ids, read on first use
        self._left: dict[int, bool] = {}  # per special id: whether decode leaves it out

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes ("" while a character is incomplete).
        After a stop string was found, nothing more is emitted."""
        self.ids.append(int(token))
        self.pieces.append(self._decode_new(int(token)))
        return self.pieces[-1]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def _decode_new(self, token: int) -> str:
        if self.stop_at is not None or self._left_out(token):
            return ""
        self._win.append(token)
        done, full = self._window()
        if len(full) <= len(done):
            return ""
        if full.endswith(_BAD):
            head = self._release(done, full)
            if self.stop_at is not None:
                return head
            return head + self._settled_stop(full[len(done) + len(head):].rstrip(_BAD))
        self._win, self._read = self._win[self._read:], len(self._win) - self._read
        return self._append(full[len(done):])

    def _window(self) -> tuple[str, str]:
        """The window's emitted text (its first ``_read`` tokens) and its whole text. Where the whole
        no longer begins with the emitted text, the emitted tokens leave the window and the rest is
        decoded on its own (``""`` then emitted): text already emitted never changes, so it cannot
        be cut off by length. That happens where a byte-fallback run holding characters already
        emitted gets a byte that makes it invalid (``<0xC3><0x9F>`` "ß", then ``<0xFF>``): ``decode``
        then shows every byte of the run as U+FFFD, the stream shows "ß" and the new byte's own
        U+FFFD."""
        done, full = self._decode(self._win[:self._read]), self._decode(self._win)
        if full.startswith(done):
            return done, full
        self._win, self._read = self._win[self._read:], 0
        return "", self._decode(self._win)

    def _left_out(self, token: int) -> bool:
        """Whether ``decode`` drops this token wherever it stands (a special token, skipped):
        then it adds no text and changes none, so it stays out of the window. Checked once per
        id, alone, so a listed token that decode keeps (or shows) is decoded as any other."""
        if not self.skip:
            return False
        if self._specials is None:
            self._specials = _special_ids(self.tok)
        if token not in self._specials:
            return False
        if token not in self._left:
            self._left[token] = self._decode([token]) == ""
        return self._left[token]

    def _release(self, done: str, full: str) -> str:
        """Emit a long held-back run up to its last ``_TAIL`` tokens (returned; "" while it may
        still change), keeping ``_CONTEXT`` tokens before them as the window's context.

        Released only when each of those context tokens adds exactly one U+FFFD, both in the
        window and alone, and the released text begins ``full``: then no later token changes it
        (byte-level decoders render each ill-formed sequence on its own; byte-fallback ones show
        one U+FFFD per byte for a whole run once it cannot become valid, which those U+FFFDs,
        in place and alone, prove; an encoded U+FFFD character shows fewer and is held)."""
        cut = len(self._win) - _TAIL - _CONTEXT
        if cut < self._read:
            return ""
        ctx = self._win[cut:cut + _CONTEXT]
        if any(self._decode(ctx[:j]) != _BAD * j for j in range(1, _CONTEXT + 1)):
            return ""
        base = self._decode(self._win[:cut])
        if any(self._decode(self._win[:cut + j]) != base + _BAD * j for j in range(1, _CONTEXT + 1)):
            return ""
        settled = base + _BAD * _CONTEXT
        if not (full.startswith(settled) and settled.startswith(done)):
            return ""
        self._win, self._read = self._win[cut:], _CONTEXT
        return self._append(settled[len(done):])

    def _settled_stop(self, settled: str) -> str:
        """While a character is held back, the complete text before it may already finish a stop
        string (``" "`` in a token that also starts an emoji): that text is emitted then, so the
        row stops at this token. Otherwise nothing is emitted and the window waits."""
        at = self._stop_in(settled) if settled else None
        if at is None:
            return ""
        self.text += settled
        self._searched, self.stop_at, self._ahead = len(self.text), at, len(settled)
        return settled

    def flush(self, past_stop: bool = False) -> str:
        """The held-back tail at the end of the row (an incomplete character, shown as U+FFFD),
        searched for stop strings as any other text. After a stop string it is "" unless
        ``past_stop``: TGI's token texts spell the whole ``decode`` of the row's tokens, so the
        token completing a stop also carries the bytes after it that it holds back (``" \ufffd"``
        of SmolLM2's ``"ĠðŁ"`` ending ``", "``), less the text before them emitted already."""
        if (self.stop_at is not None and not past_stop) or self._read == len(self._win):
            return ""
        done, full = self._window()
        self._win, self._read, ahead, self._ahead = [], 0, self._ahead, 0
        if self.stop_at is None:
            return self._append(full[len(done):])
        self.text += full[len(done) + ahead:]
        return full[len(done) + ahead:]

    def _append(self, new: str) -> str:
        """Emit ``new``, the first stop string it completes becoming ``stop_at``."""
        at = self._stop_in(new)
        self.text += new
        self._searched, self.stop_at = len(self.text), at
        return new

    def _stop_in(self, new: str) -> int | None:
        """Where the first stop string starts in ``text + new``, searching only text not searched
        before (plus a stop's length minus one before it, for a stop spanning two pieces)."""
        if not self.stops:
            return None
        start = max(0, self._searched - self._span)
        window = self.text[start:] + new
        hits = [i for i in (window.find(s) for s in self.stops) if i != -1]
        return start + min(hits) if hits else None

    @property
    def visible(self) -> str:
        """The text up to the first stop string (the whole text when none was found)."""
        return self.text if self.stop_at is None else self.text[: self.stop_at]


class StopFreeText:
    """The text a client that must never see a stop string (OpenAI's routes) is sent, piece by
    piece: up to where the first stop string starts, and, while the row runs, without a tail that
    may still grow into one (``" of"`` waits while ``"of N"`` is a stop). Fed a row's
    ``TextStream.pieces`` in order with the stream's ``stop_at``; any thread may read those.

    The tail that may grow into a stop is tracked per stop as the text arrives (Knuth-Morris-Pratt:
    the longest prefix of the stop that ends the text), so a piece costs its own length, never the
    text's or a long stop's: the server runs this on its event loop for every token."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self._fail = [_failure(s) for s in self.stops]
        self._ends = [0] * len(self.stops)  # per stop: the length of its longest prefix ending the text

    def push(self, piece: str, stop_at: int | None, final: bool) -> str:
        """Add a token's piece; the text that may be shown now (``final``: the row's last token)."""
        self.text += piece
        self._track(piece)
        end = len(self.text) if stop_at is None else min(len(self.text), stop_at)
        if stop_at is None and not final:
            end -= self._partial()
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _track(self, piece: str) -> None:
        """Each stop's longest prefix ending the text, moved on over ``piece``."""
        for i, (stop, fail) in enumerate(zip(self.stops, self._fail)):
            k = self._ends[i]
            for ch in piece:
                if k == len(stop):  # a whole stop ended the text: go on from its longest border
                    k = fail[k - 1]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
            self._ends[i] = k

    def _partial(self) -> int:
        """Length of the longest tail of the text that begins some stop string (asked only while
        the text holds no whole stop string: one there is ``stop_at``'s)."""
        return max(self._ends, default=0)


def _failure(stop: str) -> list[int]:
    """Knuth-Morris-Pratt's table: entry ``i`` is the length of the longest proper prefix of
    ``stop[:i + 1]`` that is also its suffix (where a partial match goes on after a mismatch)."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    """A ``RowStop`` over a row's ``TextStream``: the row stops at the token that completes a
    stop string (its text then holds the stop string; ``stream.visible`` the text before it).
    Over a stream that spells special tokens (TGI's routes) ``eos_first``: a stop the EOS token
    itself completes leaves the row's end to the EOS (``Row.emit``), as TGI checks EOS first;
    where the text skips them, an EOS that completes a stop shows as text and the stop stands."""

    def __init__(self, stream: TextStream) -> None:
        self.stream = stream
        self.eos_first = not stream.skip

    def __call__(self, tokens: Sequence[int], n_new: int) -> int | None:
        for i, t in enumerate(tokens[len(tokens) - n_new:]):
            self.stream.add(t)
            if self.stream.stop_at is not None:
                return i + 1
        return None
