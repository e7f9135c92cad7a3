"""Connection limits for ``spec-plugins serve``: what a client may hold before it sends a request.

uvicorn bounds the time between requests of a kept-alive connection (``timeout_keep_alive``) and
nothing else: a socket that never sends, a request line and headers dripped a byte a second, a
64 MiB header and ten thousand idle sockets are all held as long as the client likes, until the
process runs out of file descriptors and every socket is refused, ``/health`` included. This
module is uvicorn's own httptools protocol with these limits added where the bytes arrive:

- **header timeout**: a request line and headers must complete within ``header_timeout`` seconds
  of the connection opening (or of the first byte after the previous request, or of its answer
  when that byte came before it); else 408 and close. Up to two CRLFs after a request are
  ignored (RFC 9112 2.2), the idle timeout running on; blank lines past those start the deadline;
- **header size**: one header line over ``max_header_bytes``, or all of a request's headers over
  ``max_headers_bytes``, is a 431 and a close, counted as the bytes come (nothing is buffered
  past the cap), a request pipelined behind another in one read too: the parser is fed up to
  where a request's headers or body end (``BodyEnd``), then the counting goes on; a body framing
  it cannot read is a 400 and a close, and so is a body of too many tiny chunks (``BodyEnd``:
  each chunk is Python work on the event loop), at once unless a response has begun; trailers
  are capped as headers. A refusal due while a response is in progress follows it;
- **idle timeout**: uvicorn's keep-alive timeout, between requests;
- **unread body**: a request answered before its body came whole (a 415, a 404, a GET with a
  body) has ``header_timeout`` seconds more to send the rest, read and dropped, or its connection
  closes: the parser cannot tell where the next request starts until the body ends, and a body
  dripped a byte at a time would otherwise hold the connection (each byte stops uvicorn's
  keep-alive timer); once it ends, the connection goes on as after any request;
- **connection cap**: past ``max_connections`` open connections, a new one closes the oldest
  connection that holds no request in progress (idle, or still sending its headers); when every
  connection is busy, up to ``reserve`` more are let in for ``/health`` and ``/metrics`` only
  (others get a 503 while the cap is full; once it has room, the connection counts against it
  and is served), and beyond that a new connection gets a 503 at once. Idle connections past
  the cap close each other, oldest first, so a flood of silent sockets holds at most one slot
  more than the cap. A socket is never refused, and the open-file limit is never reached by
  connections. No connection leaves the cap's count but by closing: an upgrade offer (h2c,
  websocket) is ignored, its request served as plain HTTP on its body; a CONNECT, whose bytes
  after its head are no requests, is a 501 and a close (``BodyReading``).

Each kind of event is logged once per client address and interval (``ThrottledLog``), with the
count of the ones it stood for, not once per connection.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from spec_plugins.server.body_end import BodyEnd, BodyReading, stray_crlf
from spec_plugins.server.schemas import ApiError, error_bytes, request_line_path

log = logging.getLogger("spec_plugins.server")

PROBES = ("/health", "/metrics")
FD_MARGIN = 64  # open files the process keeps for its own use (models, logs, worker threads)
BUSY = "the server holds its maximum of connections; retry"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # seconds for a request line and its headers
    max_header_bytes: int = 8 << 10  # one header line (nginx's large_client_header_buffers: 8 KiB)
    max_headers_bytes: int = 64 << 10  # the request line and every header of one request
    idle_timeout: float = 5.0  # seconds a kept-alive connection may wait between requests (uvicorn's)
    max_connections: int = 1024
    reserve: int = 32  # connections let in past the cap, when every connection is busy, for /health and /metrics
    log_interval: float = 60.0  # seconds between two log lines of one kind for one client address

    def check(self) -> None:
        """Refuse limits that cannot work, naming the option."""
        for name in ("header_timeout", "idle_timeout", "log_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_header_bytes < 256 or self.max_headers_bytes < self.max_header_bytes:
            raise ValueError(f"--max-header-bytes ({self.max_header_bytes}) must be >= 256 and at most "
                             f"--max-headers-bytes ({self.max_headers_bytes})")
        if self.max_connections < 1 or self.reserve < 0:
            raise ValueError(f"--max-connections must be >= 1 (got {self.max_connections}) and the reserve >= 0 "
                             f"(got {self.reserve})")


def ensure_file_limit(limits: ConnectionLimits) -> int:
    """Raise the process's open-file soft limit to what the connection cap needs (up to the hard
    limit), or refuse the cap; returns the soft limit in force."""
    need = limits.max_connections + limits.reserve + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(f"--max-connections {limits.max_connections} needs {need} open files, but the "
                             f"process may open at most {hard} (ulimit -n); lower --max-connections to "
                             f"{max(1, hard - limits.reserve - FD_MARGIN)} or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        soft = need
    return soft


class ThrottledLog:
    """One warning per (kind, client address) and interval, saying how many events it stands for."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 4096) -> None:
        self.interval, self.clock, self.max_keys = interval, clock, max_keys
        self.seen: dict[tuple[str, str], list[float]] = {}  # (kind, address) -> [last logged, events since]

    def event(self, kind: str, address: str, message: str) -> bool:
        """Count an event; log it if this kind for this address was not logged within the
        interval. Returns whether it was logged."""
        now = self.clock()
        entry = self.seen.get((kind, address))
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            return False
        more = int(entry[1]) if entry is not None else 0
        if len(self.seen) >= self.max_keys:  # addresses rotate: keep only the ones inside the interval
            self.seen = {k: v for k, v in self.seen.items() if now - v[0] < self.interval}
        self.seen[(kind, address)] = [now, 0]
        log.warning("%s from %s%s", message, address,
                    f" (and {more} more in the last {self.interval:g} s)" if more else "")
        return True


class ConnectionGuard:
    """The open connections of one server, oldest first, and what the limits did (counters)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: OrderedDict[int, "GuardedHttpTools"] = OrderedDict()
        self.over = 0  # open connections let in past the cap (the reserve for /health and /metrics)
        self.log = ThrottledLog(limits.log_interval)
        self.counts = {"header_timeout": 0, "header_too_large": 0, "evicted": 0, "over_capacity": 0}

    def opened(self, conn: "GuardedHttpTools") -> None:
        self.open[id(conn)] = conn
        if len(self.open) <= self.limits.max_connections:
            return
        victim = next((c for c in self.open.values() if c is not conn and not c.busy), None)
        if victim is not None:
            self.counts["evicted"] += 1
            self.event("evicted", victim, f"connection cap ({self.limits.max_connections}) reached: closed the "
                                          "oldest connection without a request in progress")
            if victim.in_headers and victim.header_bytes:
                victim.refuse(503, BUSY)
            else:
                victim.transport.close()  # idle: nothing was asked, nothing to answer
            return
        conn.over_cap = True
        self.over += 1
        if self.over > self.limits.reserve:
            self.counts["over_capacity"] += 1
            self.event("over_capacity", conn, f"connection cap ({self.limits.max_connections}) and its reserve "
                                              "are busy: 503")
            conn.refuse(503, BUSY)

    def admit(self, conn: GuardedHttpTools) -> bool:
        """Count a connection let in past the cap against the cap once it has room, so that its
        requests other than /health and /metrics are served; False while the cap is still full."""
        if len(self.open) - self.over >= self.limits.max_connections:
            return False
        conn.over_cap = False
        self.over -= 1
        return True

    def closed(self, conn: "GuardedHttpTools") -> None:
        if self.open.pop(id(conn), None) is not None and conn.over_cap:
            self.over -= 1

    def event(self, kind: str, conn: "GuardedHttpTools", message: str) -> None:
        self.log.event(kind, conn.client[0] if conn.client else "unknown", message)


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """What a request on a connection past the cap gets, unless it asks for /health or /metrics: a
    503 in its path's error shape (``error_body``), and the connection closes after it."""
    busy = ApiError(503, BUSY, "overloaded", headers={"connection": "close", "retry-after": "1"})
    await busy.response(scope)(scope, receive, send)


class GuardedHttpTools(BodyReading, HttpToolsProtocol):
    """uvicorn's httptools protocol with the header timeout, header caps and the connection cap
    (module docstring), its bodies read by ``BodyReading``. ``guard`` is set per server by
    ``protocol_class``."""

    guard: ConnectionGuard

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.over_cap = False
        self._timer: Any = None
        self._lingering = False  # answered before its body came whole (``_linger``; module docstring)
        self._body_end = BodyEnd([])  # the current request's body framing (``data_received``; set per request)
        self._refused: tuple[int, str] | None = None  # a refusal that waits for the response in progress
        self._offer, self._parts = None, []  # (``BodyReading``)
        self._headers_open(arm=True)
        self.guard.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self)
        self._disarm()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        """uvicorn hands the transport to its websocket protocol (only when a ``ws`` protocol is
        configured: ``uvicorn_config`` sets none), and this one never sees the connection close:
        it leaves the guard and stops its timer now, or it would hold a slot of the cap for good."""
        self.guard.closed(self)
        self._disarm()
        super().handle_websocket_upgrade()

    def _unsupported_upgrade_warning(self) -> None:
        """An upgrade (websocket, h2c) is answered as plain HTTP: logged once per client address and
        interval, not uvicorn's two lines per request (one naming a missing websocket library)."""
        self.guard.event("upgrade", self, "upgrade request not supported: answered as plain HTTP")

    @property
    def busy(self) -> bool:
        """A request is in progress (its headers came, its response has not ended)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    # ---- the header phase ----------------------------------------------------------------------
    def _headers_open(self, arm: bool) -> None:
        self.in_headers, self.header_bytes, self._line, self._request_line = True, 0, 0, False
        self._stray = 0  # blank-line bytes dropped ahead of this request (``_drop_stray_crlf``)
        self._head = b""  # its request line as it comes, capped as a header line (the shape of ``refuse``)
        if arm:
            self._arm()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self.guard.limits.header_timeout, self._header_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if self.in_headers and not self.transport.is_closing():
            self.guard.counts["header_timeout"] += 1
            self.guard.event("header_timeout", self, f"request line and headers not complete in "
                                                     f"{self.guard.limits.header_timeout:g} s: 408, closed")
            self.refuse(408, "the request line and headers did not arrive in time")

    def data_received(self, data: bytes) -> None:
        """Feed the parser in slices that end where a request's headers or body end, so that the
        header bytes of every request, one pipelined behind another in this read too, are counted
        before the parser sees them."""
        while data and self._refused is None and not self.transport.is_closing():
            if self.in_headers:
                data = self._drop_stray_crlf(data)
                if not data:
                    return
                if not self.busy:  # any other byte between requests, a blank line too, starts the deadline
                    self._arm()
                n = self._count_header_bytes(data)
                if n < 0:
                    return
            else:
                n = self._cut_body(data)
                if n < 0:
                    return
            self._feed(data[:n])
            if self._offer is not None:
                self._ignore_upgrade()
            elif self.parser is None or self.parser.should_upgrade():
                return  # handed to uvicorn's websocket protocol
            data = data[n:]

    def _drop_stray_crlf(self, data: bytes) -> bytes:
        """``data`` less the stray CRLFs ahead of a request (``stray_crlf``), neither counted nor fed
        to uvicorn (which stops its keep-alive timer on any byte): they leave the idle timeout
        running. Blank lines past those are header bytes, timed like any."""
        n = 0 if self.header_bytes else stray_crlf(data, self._stray)
        self._stray += n
        return data[n:] if n else data

    def _count_header_bytes(self, data: bytes) -> int:
        """Count the header bytes in ``data`` up to the blank line that ends them; returns where the
        counting stopped (past that line, or ``len(data)``), or -1 after a 431 when a cap is passed."""
        lim = self.guard.limits
        start = 0
        while True:
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl + 1
            self._line += end - start
            self.header_bytes += end - start
            if not self._request_line:
                self._head += data[start:min(end, start + lim.max_header_bytes - len(self._head))]
            if self._line > lim.max_header_bytes or self.header_bytes > lim.max_headers_bytes:
                self.guard.counts["header_too_large"] += 1
                what = (f"a header line over {lim.max_header_bytes} bytes" if self._line > lim.max_header_bytes
                        else f"headers over {lim.max_headers_bytes} bytes")
                self.guard.event("header_too_large", self, f"{what}: 431, closed")
                self.refuse(431, f"request header fields too large: {what}")
                return -1
            if nl < 0:
                return end
            blank = self._line <= 2  # "\n" or "\r\n": the end of the headers, once a request line came
            self._line = 0
            start = end
            if blank and self._request_line:
                return end  # the rest is body or the next request: the parser says which
            self._request_line = self._request_line or not blank

    def on_headers_complete(self) -> None:
        if self._take_offer():
            return  # read again by a fresh parser (``_ignore_upgrade``)
        self.in_headers = False
        self._disarm()
        self._body_end = BodyEnd(self.headers, self.guard.limits.max_headers_bytes)  # trailers capped as headers
        if self.transport.is_closing():  # pipelined behind an unread body that just ended: never served
            return
        if (self.over_cap and httptools.parse_url(self.url).path.decode("ascii", "replace") not in PROBES
                and not self.guard.admit(self)):
            self.guard.counts["over_capacity"] += 1
            self.guard.event("over_capacity", self, f"connection cap ({self.guard.limits.max_connections}) busy: "
                                                    "503 for a request other than /health or /metrics")
            self.app = _over_capacity  # this connection's only request: it closes after the 503
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._offer is not None:
            return  # an upgrade offer's, ended at its headers: a fresh parser reads it (``_ignore_upgrade``)
        self._flush_body()
        super().on_message_complete()
        self._headers_open(arm=False)  # the next bytes are the next request's, counted from here
        if self._lingering:  # the rest of a body its answer did not read has come, read and dropped
            self._lingering = False
            self._disarm()
            if not self.busy:  # until the next request's first byte, the idle timeout:
                self._unset_keepalive_if_required()
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        started = bool(self.pipeline) and not self.transport.is_closing()  # super() starts the next request
        super().on_response_complete()
        if self._refused is not None:
            self.refuse(*self._refused)
        if started or self.pipeline or self.transport.is_closing():
            return  # a pipelined request is in progress (its body may still be coming): its answer decides
        if self.cycle.more_body:  # the answered request's body has not all come
            self._linger()
        elif self.header_bytes:  # the next request began while this one was answered: its deadline runs
            self._unset_keepalive_if_required()
            self._arm()
        # else, until the next request's first byte, uvicorn's keep-alive timer (the idle timeout) runs

    def _linger(self) -> None:
        """Answered before its body came whole: read and drop the rest for up to ``header_timeout``
        seconds, then close; when it ends sooner, the connection goes on as after any request
        (``on_message_complete``). Closing at once would reset a client still sending, which then
        never sees its answer, and a kept-alive client would send its next request into a closed
        socket."""
        self._lingering = True
        self._disarm()
        self._timer = self.loop.call_later(self.guard.limits.header_timeout, self.transport.close)

    def refuse(self, status: int, message: str, mid_body: bool = False) -> None:
        """Answer ``status`` with ``message`` and close, outside any request cycle, as JSON in the
        error shape of the request's path (``error_bytes``; TGI's while no path came); while a
        response is in progress, after it (HTTP answers in order), reading nothing more meanwhile. A
        refusal of the body being read (``mid_body``) is its request's answer, at once unless a
        response has begun (the handler then sees a disconnect)."""
        if self.transport.is_closing():
            return
        if self.busy and not (mid_body and not self.pipeline and not self.cycle.response_started):
            self._refused = (status, message)
            self.flow.pause_reading()
            return
        self._refused = None
        scope = {"path": request_line_path(self._head)} if self.in_headers else self.scope
        headers = {"connection": "close", **({"retry-after": "1"} if status == 503 else {})}  # as _over_capacity's
        error = ApiError(status, message, "overloaded" if status == 503 else "http", headers)
        self.transport.write(error_bytes(STATUS_LINE[status], error, scope))
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> tuple[type[GuardedHttpTools], ConnectionGuard]:
    """A protocol class bound to one server's guard (uvicorn builds one protocol per connection)."""
    guard = ConnectionGuard(limits)
    return type("GuardedHttpToolsProtocol", (GuardedHttpTools,), {"guard": guard}), guard


def uvicorn_config(app: Any, host: str, port: int, limits: ConnectionLimits = ConnectionLimits(),
                   **kwargs: Any) -> tuple[Any, ConnectionGuard]:
    """A ``uvicorn.Config`` serving ``app`` under ``limits`` (``spec-plugins serve`` and the tests)."""
    import uvicorn

    limits.check()
    ensure_file_limit(limits)
    cls, guard = protocol_class(limits)
    kwargs.setdefault("ws", "none")  # the app has no websocket route: an upgrade is answered as plain HTTP
    config = uvicorn.Config(app, host=host, port=port, http=cls, timeout_keep_alive=limits.idle_timeout,  # type: ignore[arg-type]
                            **kwargs)
    return config, guard
