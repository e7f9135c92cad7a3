"""Where a request's body ends in the bytes that follow its headers, and where the next begins
(``connections``).

``GuardedHttpTools`` feeds uvicorn's parser up to the end of each request's body, so that the
header bytes of a request pipelined behind it are counted against the header caps before the
parser sees them. ``BodyEnd`` finds that end from the request's framing as llhttp reads it
(RFC 9112 7.1): a ``Content-Length``, or chunks whose size is hex digits ended by ``;`` or CR,
then trailer lines up to a blank one. A framing it cannot read sets ``lost``: the cut then stops
just past the bytes at fault (which the parser rejects too), never further, since where the next
request starts is then unknown and its header bytes could not be counted. Each chunk costs
Python work on the event loop (here and in the parser's callback), so a body of more than
``MAX_CHUNKS`` chunks whose data averages under ``MIN_CHUNK_MEAN`` bytes a chunk sets ``refused``
(``BodyReading`` answers 400 and closes). Each trailer line becomes a header of the request's
scope, so trailers past ``max_trailer_bytes`` (the header cap) set ``refused`` too (a 431). Up to
two CRLFs ahead of a request are no part of it (``stray_crlf``).

``BodyReading`` is ``GuardedHttpTools``'s body phase: the body cut where it ends, or refused; the
parser's body handed to uvicorn once per read (uvicorn copies the body so far for every chunk);
an upgrade offer's (h2c, websocket: none is supported) read as its body, where httptools ends
such a request at its headers and would parse its body as the next request. A refused body of a
request queued behind a response in progress takes that request off uvicorn's pipeline (its
handler never starts): the refusal follows the response. A body read and dropped after its
request was answered (``_linger``) that is refused, or whose framing is lost, closes the
connection without a second answer to that request.
"""

from __future__ import annotations

import re
from typing import Any

import httptools

HEX_DIGITS = re.compile(rb"[0-9A-Fa-f]*")
MAX_SIZE_DIGITS = 16  # significant hex digits of a chunk size: more is past 64 bits, llhttp's "Chunk size overflow"
STRAY_CRLF = re.compile(rb"[\r\n]*")
STRAY_BYTES = 4  # two CRLFs (RFC 9112 2.2: a server ignores at least one empty line ahead of a request)
MAX_CHUNKS = 4096  # chunks of any size a body may hold; past it, they must average MIN_CHUNK_MEAN bytes
MIN_CHUNK_MEAN = 256  # bytes of data a chunk, on average, past MAX_CHUNKS (each chunk is Python work on the loop)
SIZE, EXTENSION, TRAILER, DONE = "size", "extension", "trailer", "done"  # where in the framing the next byte is


class BodyEnd:
    """Where one request's body ends in what comes next, read as it comes (``cut``), keeping only
    a chunk size's significant digits between reads: no line is buffered."""

    def __init__(self, headers: list[tuple[bytes, bytes]], max_trailer_bytes: int | None = None) -> None:
        names = dict(headers)
        self.chunked, self.lost = b"transfer-encoding" in names, False
        self.refused: tuple[int, str] | None = None  # the status and why (too many chunks, too many trailers)
        self.chunks = self.chunk_bytes = 0  # chunks of data so far, and their data's bytes
        self.max_trailer_bytes = max_trailer_bytes  # None: trailers uncapped (the server passes its header cap)
        self.trailer_bytes = 0  # bytes of trailer lines (the blank one that ends them too) so far
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
        the parser went on past the end found here); once ``refused`` is, up to the size line or
        the trailer bytes that set it."""
        i = 0
        while i < len(data) and not self.lost and self.refused is None:
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
                    if self._trailers_too_large((len(data) if nl < 0 else nl + 1) - i):
                        return i
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
            self.chunks, self.chunk_bytes = self.chunks + 1, self.chunk_bytes + size
            if self.chunks > MAX_CHUNKS and self.chunk_bytes < MIN_CHUNK_MEAN * self.chunks:
                self.refused = (400, f"a chunked body of more than {MAX_CHUNKS} chunks averaging under "
                                     f"{MIN_CHUNK_MEAN} bytes: send it in fewer, larger chunks")
        else:
            self.phase, self.blank = TRAILER, True

    def _trailers_too_large(self, n: int) -> bool:
        """Count ``n`` more trailer bytes; past ``max_trailer_bytes``, set ``refused`` (each trailer
        line is a header of the request's scope, so they are capped as headers are)."""
        self.trailer_bytes += n
        if self.max_trailer_bytes is None or self.trailer_bytes <= self.max_trailer_bytes:
            return False
        self.refused = (431, f"request header fields too large: trailers over {self.max_trailer_bytes} bytes")
        return True


def stray_crlf(data: bytes, dropped: int) -> int:
    """How many CR and LF bytes that lead ``data`` are stray ones, ignored ahead of a request (a
    client may end a body with a CRLF; the parser skips them too), given the ``dropped`` ones
    ahead of the same request: at most ``STRAY_BYTES`` in all, so that a client dripping blank
    lines is not ignored for good."""
    return STRAY_CRLF.match(data, 0, max(0, STRAY_BYTES - dropped)).end()  # type: ignore[union-attr]


def without_upgrade(method: bytes, url: bytes, version: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A request's head as uvicorn read it (names lowercased), less its upgrade offer: the
    ``upgrade`` header and the ``upgrade`` token of ``connection``. httptools ends an upgrade
    offer's message at its headers, so that its body would be parsed as the next request; a
    fresh parser fed this head reads the body as a body."""
    lines = [b"%s %s HTTP/%s\r\n" % (method, url, version.encode("ascii"))]
    for name, value in headers:
        if name == b"connection":
            value = b",".join(t for t in value.split(b",") if t.strip().lower() != b"upgrade")
            if not value.strip():
                continue
        if name != b"upgrade":
            lines.append(b"%s: %s\r\n" % (name, value))
    return b"".join(lines) + b"\r\n"


class BodyReading:
    """A mixin ahead of uvicorn's ``HttpToolsProtocol`` (module docstring). ``data_received``
    cuts a body with ``_cut_body`` and feeds the parser through ``_feed``; ``on_headers_complete``
    returns at once when ``_take_offer`` does, ``on_message_complete`` while ``_offer`` is set,
    and ``_offer`` is passed to ``_ignore_upgrade`` after the feed that set it."""

    parser: Any
    refuse: Any
    guard: Any
    transport: Any
    cycle: Any  # uvicorn's cycle of the request whose headers came last
    pipeline: Any  # uvicorn's requests queued behind the response in progress, newest first
    _body_end: BodyEnd
    _ahead: Any = None  # ``cycle`` as it was before the latest request's headers (``_unqueue``)
    _offer: bytes | None  # an upgrade offer's head less the offer, until ``_ignore_upgrade``
    _parts: list[bytes]  # body bytes the parser gave since the last ``_flush_body``

    def on_headers_complete(self) -> None:
        self._ahead = self.cycle
        super().on_headers_complete()  # type: ignore[misc]

    def _cut_body(self, data: bytes) -> int:
        """How many bytes of ``data`` are the body's (``BodyEnd.cut``), or -1 once it is refused."""
        n = self._body_end.cut(data)
        end = self._body_end
        if (end.lost or end.refused) and self.cycle is not None and self.cycle.response_complete:
            what = end.refused[1] if end.refused else "request body framing not understood"
            self.guard.event("answered", self, f"{what} in a body read after its answer: closed")
            self.transport.close()  # its request has its answer: no second one
        elif end.lost:
            self._framing_lost(data[:n])
        elif end.refused:
            status, why = end.refused
            if status == 431:
                self.guard.counts["header_too_large"] += 1
            self.guard.event("header_too_large" if status == 431 else "chunks", self, f"{why}: {status}, closed")
            self.refuse(status, why, mid_body=not self._unqueue())
        return -1 if end.lost or end.refused else n

    def _unqueue(self) -> bool:
        """Take the request whose body is refused off uvicorn's pipeline, where it waits for the
        response in progress: its handler never starts, and the refusal follows that response.
        Returns whether it was queued."""
        if not self.pipeline or self.pipeline[0][0] is not self.cycle:
            return False
        self.pipeline.popleft()
        self.cycle = self._ahead
        return True

    def _framing_lost(self, fault: bytes) -> None:
        """The body's framing cannot be read (``BodyEnd.lost``: a chunk size that is no hex number):
        the parser is fed up to the bytes at fault, which it rejects (uvicorn's 400); should it
        not, the connection is refused all the same, as where the next request starts is unknown
        and its header bytes could not be counted."""
        if fault:
            self._feed(fault)
        if not self.transport.is_closing():
            self.guard.event("bad_framing", self, "request body framing not understood: 400, closed")
            self.refuse(400, "the request body's framing (Content-Length or chunk sizes) could not be read")

    def on_body(self, body: bytes) -> None:
        """Kept for ``_flush_body``: uvicorn's ``+=`` per call copies the body so far each time."""
        self._parts.append(body)

    def _flush_body(self) -> None:
        if self._parts:
            body, self._parts = b"".join(self._parts), []
            super().on_body(body)  # type: ignore[misc]

    def _feed(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        self._flush_body()

    def _take_offer(self) -> bool:
        """At the headers: an upgrade no protocol takes (no websocket one is configured) is kept
        less its offer for ``_ignore_upgrade``."""
        if not self.parser.should_upgrade() or self._should_upgrade():  # type: ignore[attr-defined]
            return False
        self._offer = without_upgrade(self.parser.get_method(), self.url,  # type: ignore[attr-defined]
                                      self.parser.get_http_version(), self.headers)  # type: ignore[attr-defined]
        return True

    def _ignore_upgrade(self) -> None:
        """A fresh parser reads the offer's head less the offer, then its body as a body. What is
        still an upgrade then, a CONNECT (a tunnel: the bytes after its head are no requests), is
        a 501 and a close."""
        head, self._offer = self._offer or b"", None
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn sets its own
        self._feed(head)
        if self._offer is not None:
            self._offer = None
            self.refuse(501, "CONNECT (a tunnel) is not supported")
