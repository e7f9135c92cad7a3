"""How many threads the llama.cpp runtime gives llama.cpp when its config leaves them unset."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (taskset, cgroup cpusets), not the machine's
    count, since threads beyond the allowed cores only wait for one another."""
    count = getattr(os, "process_cpu_count", None)  # Python 3.13+: affinity-aware
    if count is not None:
        return count() or 1
    if hasattr(os, "sched_getaffinity"):  # Linux and some Unixes
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def thread_counts(threads: int | None, threads_batch: int | None) -> tuple[int, int]:
    """(one-token, multi-token) decode threads: unset ``threads`` is every usable core, unset
    ``threads_batch`` follows ``threads``."""
    one = threads or usable_cores()
    return one, threads_batch or one
