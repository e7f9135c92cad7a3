"""Small pieces several test files share: a call run in another thread, a logits processor that
raises at a length, a third-party package with an entry point on sys.path, a free port and a
server started in a thread."""

from __future__ import annotations

import socket
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch


def in_thread(fn: Callable[[], Any]) -> dict:
    """``fn`` run to the end in another thread: its value (``"value"``) or its exception (``"error"``)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=300)
    assert not t.is_alive()
    return out


class RaisesAt:
    """Raises once the sequence is ``length`` tokens long, naming the length: the row ends with
    finish reason error, and plain decoding reads the same message."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] >= self.length:
            raise ValueError(f"at length {ids.shape[1]}")
        return scores


def fake_dist(root: Path, monkeypatch: Any, name: str, module: str, entry_points: str) -> None:
    """A third-party package ``name`` on sys.path with a real dist-info entry point (no pip needed)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.py").write_text(textwrap.dedent(module))
    dist = root / f"{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    monkeypatch.syspath_prepend(str(root))


def free_port() -> int:
    """A localhost port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(server: Any, run: Callable[[], Any] | None = None) -> threading.Thread:
    """A uvicorn ``server`` running in a daemon thread (``run``: its run method, by default
    ``server.run``), returned once it has started; a server that dies first fails the test."""
    thread = threading.Thread(target=run or server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return thread
