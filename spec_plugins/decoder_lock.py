"""One runtime's generations in one thread at a time.

A runtime holds one batch's rows and KV cache; a second thread starting a generation on it would
decode over the first one's rows and fail somewhere unrelated (a tensor size mismatch, a commit
without its forward). So the lock belongs to the runtime, not to a decoder: every decoder built over
one runtime (``from_config(..., target=rt)``, ``without_speculation()``) and the server's scheduler
share it (``runtime_lock``), and a draft model's runtime given to several decoders is locked the
same way. ``GenerationLock`` refuses that second thread at once. A caller
does not block on it: the holder may be a stream generator suspended in the caller's own thread,
or one another thread keeps unfinished, which waiting would never see end (a stream frees it just
before yielding its last event, the one with a ``finish_reason``: a reader may stop there without
closing it). Generations in the holder's thread go on (two interleaved streams there are caught by
the runtime's lease, ``loop.ownership``). A server's decode thread holds it while its batch has
work and waits for it (``wait`` with a ``timeout``, so it can stop and say why it is not serving)
when a direct generation on the same runtime holds it: that generation runs while the server is
idle.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from spec_plugins.weak_cache import WeakCache

BUSY = ("this decoder's runtime is generating in another thread; use one runtime (and one decoder) per thread or "
        "serialize the calls (a stream holds the runtime until it finishes or is closed)")


class GenerationLock:
    """Held by the generations running in one thread (a count: streams of that thread may
    overlap); free again when the last one ends. Released from whichever thread ends a
    generation, since a stream abandoned without ``close()`` ends where it is garbage collected."""

    def __init__(self) -> None:
        # reentrant: garbage collection may finalize an abandoned stream, which releases, while
        # this thread is inside ``acquire``
        self._guard = threading.RLock()
        self._free = threading.Condition(self._guard)  # notified when the last holder releases
        self._owner: int | None = None  # the holding thread's ident
        self._count = 0  # generations holding it

    def acquire(self, wait: bool = False, timeout: float | None = None) -> bool:
        """Hold it for a generation in this thread; where another thread holds it, ``RuntimeError``
        (``wait``: block until it is free, or False after ``timeout`` seconds)."""
        me = threading.get_ident()
        with self._guard:
            while self._count and self._owner != me:
                if not wait:
                    raise RuntimeError(BUSY)
                if not self._free.wait(timeout) and timeout is not None:
                    return False
            self._owner = me
            self._count += 1
            return True

    def release(self) -> None:
        """One generation ended (in any thread)."""
        with self._guard:
            self._count -= 1
            if self._count <= 0:
                self._count, self._owner = 0, None
                self._free.notify_all()

    @property
    def held(self) -> bool:
        return self._count > 0

    @contextmanager
    def holding(self, wait: bool = False) -> Iterator[None]:
        """Held around one generation; released however it ends (finished, raised, closed)."""
        self.acquire(wait)
        try:
            yield
        finally:
            self.release()


class JointLock(GenerationLock):
    """Several runtimes' locks held together (a target's and the draft model's it drafts with),
    taken in one order so two joint holders never wait on each other for good."""

    def __init__(self, locks: list[GenerationLock]) -> None:
        self.locks = sorted(locks, key=id)

    def acquire(self, wait: bool = False, timeout: float | None = None) -> bool:
        got: list[GenerationLock] = []
        try:
            for lock in self.locks:
                if not lock.acquire(wait, timeout):
                    break
                got.append(lock)
        finally:
            if len(got) < len(self.locks):  # refused (raised) or timed out: let the others go
                for lock in reversed(got):
                    lock.release()
        return len(got) == len(self.locks)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    @property
    def held(self) -> bool:
        return any(lock.held for lock in self.locks)


_LOCKS: WeakCache = WeakCache()  # runtime -> its GenerationLock, dropped with the runtime
_BY_ID: dict[int, GenerationLock] = {}  # runtimes that cannot be weakly keyed (``__slots__``, unhashable)
_MAKING = threading.Lock()


def _lock_of(runtime: Any) -> GenerationLock:
    with _MAKING:
        try:
            lock = _LOCKS.get(runtime)
            if lock is None:
                lock = _LOCKS[runtime] = GenerationLock()
        except TypeError:
            # keyed by identity: a lock outliving its runtime is free (nothing generates on a dead
            # runtime), so a later runtime reusing the id may take it over
            lock = _BY_ID.setdefault(id(runtime), GenerationLock())
        return lock


def runtime_lock(*runtimes: Any) -> GenerationLock:
    """The lock every decoder over these runtimes shares (None and repeats skipped): one
    runtime's own, or several held together (``JointLock``)."""
    distinct = list({id(r): r for r in runtimes if r is not None}.values())
    locks = [_lock_of(r) for r in distinct]
    return locks[0] if len(locks) == 1 else JointLock(locks)
