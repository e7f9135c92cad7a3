"""Where a request's body ends in the bytes that follow its headers, and where the next begins
(``connections``).

``GuardedHttpTools`` feeds uvicorn's parser up to the end of each request's body, so that the
header bytes of a request pipelined behind it are counted against the header caps before the
parser sees them. ``BodyEnd`` finds that end from the request's framing as llhttp reads it
(RFC 9112 7.1): a ``Content-Length``, or chunks whose size is hex digits ended by ``;`` or CR,
then trailer lines up to a blank one. A framing it cannot read sets ``lost``: the cut then stops
just past the bytes at fault (which the parser rejects too), never further, since where the next
request starts is then unknown and its header bytes could not be counted. Up to two CRLFs ahead
of a request are no part of it (``stray_crlf``).
"""

from __future__ import annotations

import re

HEX_DIGITS = re.compile(rb"[0-9A-Fa-f]*")
MAX_SIZE_DIGITS = 16  # significant hex digits of a chunk size: more is past 64 bits, llhttp's "Chunk size overflow"
STRAY_CRLF = re.compile(rb"[\r\n]*")
STRAY_BYTES = 4  # two CRLFs (RFC 9112 2.2: a server ignores at least one empty line ahead of a request)
SIZE, EXTENSION, TRAILER, DONE = "size", "extension", "trailer", "done"  # where in the framing the next byte is


class BodyEnd:
    """Where one request's body ends in what comes next, read as it comes (``cut``), keeping only
    a chunk size's significant digits between reads: no line is buffered."""

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        names = dict(headers)
        self.chunked, self.lost = b"transfer-encoding" in names, False
        self.left = 0  # bytes left of a Content-Length body, or of a chunk's data and its CRLF
        self.digits = b""  # the significant digits (leading zeros dropped) of the chunk size being read
        self.sized = False  # the chunk size being read has a digit (a zero too)
        self.blank = True  # the trailer line being read is empty so far (its CR aside)
        self.phase = SIZE
        if not self.chunked:  # llhttp has checked it: digits only; anything else is no length we can follow
            length = names.get(b"content-length", b"0").strip()
            self.lost = not length.isdigit()
            self.left = int(length) if not self.lost else 0
            self.phase = DONE  # nothing to read but its ``left`` bytes

    def cut(self, data: bytes) -> int:
        """How many bytes of ``data`` to feed: up to the end of the body, else all of it; once
        ``lost`` is set, up to the bytes at fault (none when they were in an earlier read, or when
        the parser went on past the end found here)."""
        i = 0
        while i < len(data) and not self.lost:
            if self.left:
                step = min(self.left, len(data) - i)
                self.left, i = self.left - step, i + step
                if not self.left and not self.chunked:
                    self.phase = DONE
                    return i
            elif self.phase == SIZE:
                i = self._size(data, i)
            elif self.phase in (EXTENSION, TRAILER):
                nl = data.find(b"\n", i)
                if self.phase == TRAILER:
                    self.blank = self.blank and not data[i:len(data) if nl < 0 else nl].strip(b"\r")
                if nl < 0:
                    return len(data)
                i = nl + 1
                if self.phase == EXTENSION:
                    self._size_line_ends()
                elif self.blank:  # the blank line after the last chunk and its trailers: the body's end
                    self.phase = DONE
                    return i
                else:
                    self.blank = True
            else:  # the parser did not end the request where the framing did
                self.lost = True
        return i

    def _size(self, data: bytes, i: int) -> int:
        """Read a chunk size's digits from ``data[i:]``; returns where they stop. Anything but a
        hex digit, ``;`` or CR (a sign, a space, ``0x``, no digit at all) loses the framing."""
        end = HEX_DIGITS.match(data, i).end()  # type: ignore[union-attr]  # (``*``: always matches)
        if end > i:
            self.sized = True
            self.digits += data[i:end].lstrip(b"0") if not self.digits else data[i:end]
            self.digits = self.digits[:MAX_SIZE_DIGITS + 1]
            if len(self.digits) > MAX_SIZE_DIGITS:
                self.lost = True
                return end
        if end < len(data):
            if not self.sized or data[end] not in b";\r":
                self.lost = True
                return end + 1
            self.phase = EXTENSION  # up to the line's end: its extensions (``;name=value``) and CRLF
        return end

    def _size_line_ends(self) -> None:
        """A chunk size line ended: its data and CRLF follow, or, for size 0, the trailers."""
        size = int(self.digits or b"0", 16)
        self.digits, self.sized = b"", False
        if size:
            self.left, self.phase = size + 2, SIZE
        else:
            self.phase, self.blank = TRAILER, True


def stray_crlf(data: bytes, dropped: int) -> int:
    """How many CR and LF bytes that lead ``data`` are stray ones, ignored ahead of a request (a
    client may end a body with a CRLF; the parser skips them too), given the ``dropped`` ones
    ahead of the same request: at most ``STRAY_BYTES`` in all, so that a client dripping blank
    lines is not ignored for good."""
    return STRAY_CRLF.match(data, 0, max(0, STRAY_BYTES - dropped)).end()  # type: ignore[union-attr]
