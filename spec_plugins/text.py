"""One incremental text stream per row: tokens in, the text they complete out, stop strings
turned into row stops. Used by ``generate``, ``stream``, ``generate_batch`` and the server.

Decoding the whole output again every round is quadratic in its length (2,000 tokens: two
million characters decoded). Instead each token is decoded in a short window: ``prefix``..``read``
is text already emitted, decoding ``prefix``..end and removing that part gives the new text (the
offsets of TGI's and vLLM's detokenizers), held back while it ends in an incomplete UTF-8
character (U+FFFD). Work per token is the window, so a stream is linear in its length.

Stop strings are searched only in text not searched before (plus the longest stop's length
minus one, for a stop spanning two tokens). A hit becomes a row stop (``StopStrings``, a
``types.RowStop``): the row keeps its tokens up to the one that completed the stop string and
finishes with reason ``"stop"``, inside the round, so no token past the stop is ever computed.
"""

from __future__ import annotations

from typing import Any, Sequence


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
        self._prefix = self._read = 0
        self._searched = 0  # text before this index was searched for stops

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes ("" while a character is incomplete).
        After a stop string was found, nothing more is emitted."""
        self.ids.append(int(token))
        self.pieces.append(self._decode_new())
        return self.pieces[-1]

    def _decode_new(self) -> str:
        if self.stop_at is not None:
            return ""
        done = self.tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        if len(full) <= len(done) or full.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        new = full[len(done):]
        self.text += new
        self._find_stop()
        return new

    def flush(self) -> str:
        """The held-back tail at the end of the row (an incomplete character, shown as U+FFFD)."""
        if self.stop_at is not None or self._read == len(self.ids):
            return ""
        done = self.tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        self._prefix = self._read = len(self.ids)
        self.text += full[len(done):]
        return full[len(done):]

    def _find_stop(self) -> None:
        if not self.stops:
            return
        start = max(0, self._searched - self._span)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i != -1]
        self._searched = len(self.text)
        if hits:
            self.stop_at = min(hits)

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
    stop string (its text then holds the stop string; ``stream.visible`` the text before it)."""

    def __init__(self, stream: TextStream) -> None:
        self.stream = stream

    def __call__(self, tokens: Sequence[int], n_new: int) -> int | None:
        for i, t in enumerate(tokens[len(tokens) - n_new:]):
            self.stream.add(t)
            if self.stream.stop_at is not None:
                return i + 1
        return None
