"""The decode thread: admits waiting requests into the running batch between rounds, runs rounds,
hands each request its tokens through an asyncio queue, and frees slots at once.

Model work is CPU/GPU-bound, so it runs in one thread of its own; the HTTP handlers only wait on
their queues. A request leaves the batch as soon as it finishes or is cancelled (stop string,
client gone): the next loop iteration drops its row before the round.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from spec_plugins.decoder_lock import GenerationLock
from spec_plugins.loop import Batch, run_round
from spec_plugins.policy import DraftPolicy, build_policy
from spec_plugins.types import Emission, RowRequest

log = logging.getLogger("spec_plugins.server")

UNHEALTHY_AFTER = 3  # consecutive failed rounds or admissions after which the server reports itself unhealthy
UNHEALTHY_FOR = 30.0  # seconds it stays so without a newer failure (an idle server runs no round to clear it)


class TooLarge(ValueError):
    """A request that could never run here: more rows than the batch has slots, or more KV cells
    than the runtime's shared cache holds with nothing else running."""


@dataclass
class Job:
    """One request's life in the scheduler; events arrive on ``queue`` in the handler's loop.

    Events: ("tokens", ids, logprobs, finish_reason | None) and ("error", message)."""

    row: RowRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finished: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def push(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is gone (shutdown)
            pass


class Scheduler:
    """Owns a Batch and its draft-length policy; ``submit`` / ``cancel`` are safe from any thread."""

    def __init__(self, batch: Batch, max_batch: int, max_queue: int = 1024, policy: DraftPolicy | None = None,
                 lock: GenerationLock | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.batch, self.max_batch, self.max_queue = batch, max_batch, max_queue
        self.policy = policy if policy is not None else build_policy(None, None)  # plain decoding
        # the runtimes' (the target's and a draft model's, ``decoder_lock``): held by the decode thread
        # while its batch has work, so a direct generation on them runs only while the server is idle
        # (``_hold``)
        self.lock = lock if lock is not None else GenerationLock()
        self._holds = False  # the decode thread holds ``lock``
        self.waiting_since: float | None = None  # when it began to wait for a direct generation
        self._cv = threading.Condition()
        self._waiting: list[list[Job]] = []  # requests waiting for slots, oldest first: each its jobs
        self._jobs: dict[int, Job] = {}  # running, by row key
        self._admitting: list[Job] = []  # taken off ``_waiting``, prefill in progress, not yet in ``_jobs``
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.failures = 0  # consecutive failed rounds and admissions; a round that runs resets it (``unhealthy``)
        self.last_failure = ""  # what the latest of them was (exception type, request id of its log line)
        self.last_failure_at = 0.0  # when (time.monotonic())

    # ---- called from HTTP handlers ------------------------------------------------------------
    def new_key(self) -> int:
        return next(self._ids)

    def submit(self, job: Job | list[Job]) -> None:
        """Queue a job, or a request's jobs at once (its choices: admitted together, in one round,
        so their rows share a draft schedule; ``_take``)."""
        jobs = job if isinstance(job, list) else [job]
        if len(jobs) > self.max_batch:  # it could never be admitted whole, and would hold the queue
            raise TooLarge(f"a request of {len(jobs)} rows cannot join a batch of {self.max_batch} slots")
        alone = self.batch.shortfall([j.row for j in jobs], alone=True)  # reads no running row
        if alone is not None:  # it would not fit even in an empty batch
            raise TooLarge(f"this request cannot run on this server: {alone}")
        with self._cv:
            if self._stop:
                raise RuntimeError("the server is shutting down")
            if self._queued() + len(jobs) > self.max_queue:
                raise OverflowError(f"queue is full ({self.max_queue} requests waiting)")
            self._waiting.append(jobs)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            if not job.finished:
                job.cancelled = True
                self._cv.notify()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def unhealthy(self) -> str | None:
        """Why this server cannot serve, or None. The decode thread survives a failed round
        (``_fail_all``), so a runtime that fails every round (a sticky device error) would
        leave it alive while every request fails: ``UNHEALTHY_AFTER`` failures in a row, with
        no success between them, count as down too (``/health``, Ray's ``check_health``), for
        ``UNHEALTHY_FOR`` seconds after the latest: an idle server runs no round that would clear
        it, so a probe lets traffic back then, and a runtime still broken fails 3 more."""
        if not self.alive:
            return "decode thread is not running"
        if (since := self.waiting_since) is not None:
            return (f"waiting {time.monotonic() - since:.0f} s for a direct generation on this server's decoder to "
                    "end (a stream holds the decoder until it finishes or is closed)")
        if self.failures >= UNHEALTHY_AFTER and time.monotonic() - self.last_failure_at < UNHEALTHY_FOR:
            return (f"the last {self.failures} decode rounds or admissions failed (latest: {self.last_failure}; "
                    "the server log has the details)")
        return None

    def snapshot(self) -> dict[str, Any]:
        with self._cv:
            return {"batch": len(self._jobs), "queue": self._queued(), "max_batch": self.max_batch,
                    "draft_length": int(self.policy.last.get("draft_length", 0))}

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish in-flight requests for up to ``timeout`` seconds, then cancel the rest."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        deadline = time.monotonic() + timeout
        while self.alive and time.monotonic() < deadline:
            with self._cv:
                if not self._busy():
                    break
            time.sleep(0.02)
        with self._cv:
            for job in [*self._jobs.values(), *self._admitting, *(j for jobs in self._waiting for j in jobs)]:
                if not job.finished:
                    job.finished = True
                    job.push(("error", "the server shut down before this request finished"))
            self._waiting.clear()
            self._jobs.clear()
            self._admitting = []
            self._halt = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- the decode thread ----------------------------------------------------------------------
    _halt = False

    def _run(self) -> None:
        try:
            while self._step():
                pass
        finally:
            self._let_go()

    def _step(self) -> bool:
        """One pass of the decode thread: admit, run a round, dispatch; False when it ends."""
        with self._cv:
            if self._halt or (self._stop and not self._busy()):
                return False
            if not self._waiting and not self._jobs:
                self._let_go()  # idle: a direct generation on the decoder may run now
                self._cv.wait(timeout=0.5)
                return True
            if not self._hold():  # such a generation holds it: its rows own the runtime until it ends
                return True
            # drop cancelled rows, waiting or running, before the round
            self._waiting = [left for jobs in self._waiting if (left := [j for j in jobs if not j.cancelled])]
            gone = [k for k, j in self._jobs.items() if j.cancelled or j.finished]
            admit = self._take(self.max_batch - (len(self._jobs) - len(gone)), gone)
            self._admitting = [j for jobs in admit for j in jobs]  # in flight: ``stop`` drains or fails them too
            if not gone and not admit and not self._jobs:
                self._cv.wait(timeout=0.5)
                return True
        try:
            for k in gone:
                self._jobs.pop(k, None)
            self.batch.remove(gone)
            if admit:
                self._admit(admit)
            record = run_round(self.batch, self.policy)
            if record is not None:
                self.failures = 0  # a round ran: the server serves (a prefill that ran is no proof of it)
                self._dispatch(record.emissions)
        except Exception as exc:  # noqa: BLE001 - a failed round must not kill the server
            rid = uuid.uuid4().hex[:12]
            log.exception("decode round failed (request id %s)", rid)
            self._failed("round", exc, rid)
            self._fail_all(f"generation failed (request id {rid}); the server log has the details")
        return True

    def _hold(self) -> bool:
        """Hold the runtimes' generation lock for the batch's work (the caller holds ``_cv``): at
        once, or False after a short wait, holding none of them, while a direct generation holds
        one (``unhealthy`` says so meanwhile; the caller comes back, or stops)."""
        if self._holds:
            return True
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        self._cv.release()  # requests queue and ``stop`` proceeds meanwhile
        try:
            got = self.lock.acquire(wait=True, timeout=0.25)
        finally:
            self._cv.acquire()
        if got:
            self._holds, self.waiting_since = True, None
        return got

    def _let_go(self) -> None:
        """Release the generation lock where the decode thread holds it (idle, or ending)."""
        if self._holds:
            self._holds = False
            self.lock.release()

    def _busy(self) -> bool:
        """Work in flight: running, being admitted (its prefill runs outside the lock) or waiting;
        ``stop`` drains all three (the caller holds the lock)."""
        return bool(self._jobs or self._admitting or self._waiting)

    def _queued(self) -> int:
        """Jobs waiting for a slot (the caller holds the lock)."""
        return sum(len(jobs) for jobs in self._waiting)

    def _take(self, room: int, leaving: list[int]) -> list[list[Job]]:
        """The jobs of the oldest waiting requests that fit in ``room`` slots and in the runtime's
        shared pool beside the running rows but ``leaving`` (``Batch.shortfall``), each request
        whole (its choices share a round, so a seed reproduces its output). The oldest request
        that does not fit waits for room to free, and the requests behind it wait with it: none
        overtakes another, so none waits forever (``submit`` refuses a request larger than an
        empty batch). Returns each request's jobs. The caller holds the lock."""
        admit: list[list[Job]] = []
        taken: list[Job] = []
        while self._waiting and len(taken) + len(self._waiting[0]) <= room and self.batch.shortfall(
                [j.row for j in taken + self._waiting[0]], leaving) is None:
            admit.append(self._waiting.pop(0))
            taken += admit[-1]
        return admit

    def _admit(self, requests: list[list[Job]]) -> None:
        """Admission is atomic (``Batch.add``): if it fails for several requests, each is tried
        again alone, so only the requests that fail by themselves fail, with the reason, and the
        running rows carry on. Jobs stay in ``_admitting`` until they run or fail, so a ``stop``
        during the prefill waits for them; one that ``stop`` already ended is not run on."""
        jobs = [j for js in requests for j in js]
        try:
            ems = self.batch.add([j.row for j in jobs])
        except Exception as exc:  # noqa: BLE001
            self.batch.check()  # atomic admission: the running rows exactly as before
            if len(requests) > 1:  # one request's failure must not end the requests beside it
                for js in requests:
                    self._admit([js])
                return
            rid = uuid.uuid4().hex[:12]
            log.exception("admission failed (request id %s)", rid)
            # a request's own input, refused, or too large for the memory free now: no sign of a broken server
            if not isinstance(exc, (ValueError, TypeError, torch.OutOfMemoryError)):
                self._failed("admission", exc, rid)
            with self._cv:
                for j in jobs:
                    if not j.finished:
                        j.finished = True
                        j.push(("error", f"could not start this request (request id {rid}): {type(exc).__name__}"))
                self._settled(jobs)
            return
        with self._cv:
            for j in jobs:
                if not j.finished:  # ``stop`` ended it (error event sent) while its prefill ran
                    self._jobs[j.row.key] = j
            self._settled(jobs)
        self._dispatch(ems)

    def _failed(self, what: str, exc: Exception, rid: str) -> None:
        """Count a failed round or admission (``unhealthy``), named as the request's error names it."""
        self.failures += 1
        self.last_failure = f"{what} {type(exc).__name__}, request id {rid}"
        self.last_failure_at = time.monotonic()

    def _settled(self, jobs: list[Job]) -> None:
        """``jobs`` run or failed: no longer in ``_admitting`` (the caller holds the lock)."""
        gone = {id(j) for j in jobs}
        self._admitting = [j for j in self._admitting if id(j) not in gone]

    def _dispatch(self, ems: list[Emission]) -> None:
        done = []
        for em in ems:
            job = self._jobs.get(em.key)
            if job is None:
                continue
            if em.error is not None:
                if em.tokens and not job.cancelled:  # what the grammar took before it failed streams first
                    job.push(("tokens", em.tokens, em.logprobs, None))
                job.push(("error", em.error))
            elif not job.cancelled:
                job.push(("tokens", em.tokens, em.logprobs, em.finish_reason))
            if em.finish_reason is not None:
                job.finished = True
                done.append(em.key)
        if done:  # free the slots now, not at the next round
            for k in done:
                self._jobs.pop(k, None)
            self.batch.remove(done)

    def _fail_all(self, message: str) -> None:
        """A round failed for every row (not a row's own sampling, which fails alone): every running
        job gets the error and the batch starts empty (runtime and proposer hold no rows)."""
        with self._cv:
            jobs = [j for j in [*self._jobs.values(), *self._admitting] if not j.finished]
            self._jobs.clear()
            self._admitting = []
        for j in jobs:
            j.finished = True
            j.push(("error", message))
        try:
            self.batch.close()
            self.batch.check()  # holds by construction; a violation here is a bug worth a loud log
        except Exception:  # noqa: BLE001 - the decode thread must survive to serve the next request
            log.exception("could not reset the batch after a failed round")
