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
the lease on the target's and the draft model's runtimes, ``loop.ownership``). A server's decode
thread holds it while its batch has work and waits for it (``wait`` with a ``timeout``, so it can
stop and say why it is not serving) when a direct generation on the same runtime holds it: that
generation runs while the server is idle. A waiter over several runtimes (``JointLock``) holds
none of them while it waits, so generations on the ones that are idle go on meanwhile.
"""
from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

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
        with self._guard:
            if not self._open():
                if not wait:
                    raise RuntimeError(BUSY)
                if not self._free.wait_for(self._open, timeout):
                    return False
            self._owner = threading.get_ident()
            self._count += 1
            return True

    def _open(self) -> bool:
        """Whether this thread may take it: free, or held by this thread."""
        return not self._count or self._owner == threading.get_ident()

    def _wait_open(self, timeout: float | None) -> bool:
        """Wait until this thread may take it, without taking it; False after ``timeout`` seconds."""
        with self._guard:
            return self._free.wait_for(self._open, timeout)

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
    all or none: a waiter holding one while it waits for another would refuse generations on the
    runtime it holds but does not use yet (a server waiting for a shared draft model's runtime
    would lock its idle target away from ``without_speculation()``)."""

    def __init__(self, locks: list[GenerationLock]) -> None:
        # taken in one order: of two joint waiters, the one refused first holds nothing
        self.locks = sorted(locks, key=id)

    def acquire(self, wait: bool = False, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            busy = self._take_all()
            if busy is None:
                return True
            if not wait:
                raise RuntimeError(BUSY)
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not busy._wait_open(left):
                return False

    def _take_all(self) -> GenerationLock | None:
        """Take every lock without waiting; where one is held in another thread, let the ones
        taken go and return it (None: all taken). Looked at first, so a lock seen held takes none
        (only a lock taken in between makes it let some go)."""
        busy = next((lock for lock in self.locks if not lock._open()), None)
        if busy is not None:
            return busy
        got: list[GenerationLock] = []
        for lock in self.locks:
            try:
                lock.acquire()
            except RuntimeError:
                for taken in reversed(got):
                    taken.release()
                return lock
            got.append(lock)
        return None

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    @property
    def held(self) -> bool:
        return any(lock.held for lock in self.locks)


# id(runtime) -> its lock: keyed by identity (a runtime's ``__eq__`` neither merges two runtimes'
# locks nor refuses an unhashable one), the entry dropped as the runtime dies, before a later
# runtime can reuse its id and find a lock the dead one left held
_LOCKS: dict[int, GenerationLock] = {}
_MAKING = threading.Lock()


def _lock_of(runtime: Any) -> GenerationLock:
    with _MAKING:
        lock = _LOCKS.get(id(runtime))
        if lock is None:
            try:
                ends = weakref.finalize(runtime, _LOCKS.pop, id(runtime), None)
            except TypeError:
                raise TypeError(f"runtime {type(runtime).__qualname__} cannot be weakly referenced, so its generation "
                                "lock could not end with it: add '__weakref__' to its __slots__") from None
            ends.atexit = False
            lock = _LOCKS[id(runtime)] = GenerationLock()
        return lock


def runtime_lock(*runtimes: Any) -> GenerationLock:
    """The lock every decoder over these runtimes shares (None and repeats skipped): one
    runtime's own, or several held together (``JointLock``)."""
    distinct = list({id(r): r for r in runtimes if r is not None}.values())
    locks = [_lock_of(r) for r in distinct]
    return locks[0] if len(locks) == 1 else JointLock(locks)
