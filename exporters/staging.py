"""Writing an export's directory atomically, shared by the ONNX export (and its first use in the
cache) and the TensorRT build.

An export fills a new temporary directory beside its target (``staged``) and renames it into place
at the end (``move_into_place``), so an interrupted export (an error, Ctrl-C, SIGTERM:
``sigterm_unwinds``) never leaves a half-written directory. One killed outright (SIGKILL, or SIGTERM
inside a long native call) leaves its temporary one, named for its process (``staging_prefix``),
which the next export to that target removes once that process is gone (``remove_stale``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

# Linux: a new random id at every boot. Every host's initial pid namespace has the same inode, so
# host name and namespace alone do not tell apart hosts of one name sharing a file system.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished output ``tmp`` onto ``out``. What ``out`` held (a previous output or an
    empty directory: ``check_out_dir``) is renamed aside first, put back if the rename fails, and
    deleted only once the new output is in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = tmp.with_name(tmp.name + "-old")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` with its missing parents; returns those it created, deepest first,
    for ``remove_made`` to take back when the export or build fails."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def remove_made(made: Sequence[Path]) -> None:
    """Remove the directories ``make_parents`` created, deepest first, stopping at one that is
    no longer empty (something else wrote there meanwhile) or already gone."""
    for p in made:
        try:
            p.rmdir()
        except OSError:
            return


def boot_id() -> str:
    """This boot's id (16 hex digits of it), "" where the system has none (not Linux)."""
    try:
        digits = re.sub(r"[^0-9a-f]", "", BOOT_ID.read_text().lower())
    except OSError:
        return ""
    return digits[:16] if len(digits) >= 8 else ""


def _host() -> str:
    """This host, boot and (Linux) pid namespace: where the pid in a temporary directory's name is valid."""
    try:
        ns = f".{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        ns = ""
    boot = boot_id()
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) + (f".{boot}" if boot else "") + ns


def staging_prefix(out: Path, pid: int | None = None) -> str:
    """How the temporary directory of an export to ``out`` is named: ``.{name}.tmp-{pid}@{host}-``
    (``mkdtemp`` adds the rest), so that a later export can tell a killed one's from a running one's."""
    return f".{out.name}.tmp-{os.getpid() if pid is None else pid}@{_host()}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove the temporary directories beside ``out`` left by exports of this boot of this host
    whose process is gone (killed by SIGKILL, or by SIGTERM inside a long native call); returns
    them. A directory of a running process, of another host, boot or container (a shared file
    system), or named without a pid is kept; without a boot id (not Linux) none is removed, as
    hosts of one name cannot be told apart."""
    if not boot_id():
        return []
    stale = re.compile(re.escape(f".{out.name}.tmp-") + r"(\d+)@([A-Za-z0-9_.]*)-[a-z0-9_]+(-old)?")
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    removed = []
    for p in entries:
        m = stale.fullmatch(p.name)
        if m and m.group(2) == _host() and not _running(int(m.group(1))) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM (a timeout, ``docker stop``, a scheduler) raises SystemExit(143)
    instead of ending the process where it stands, so cleanup clauses remove what the export wrote;
    further SIGTERMs are ignored meanwhile. On leaving, the handler is put back unless the block
    installed its own, and a SIGTERM that came is delivered again with the default action: the
    process dies by it whoever catches the SystemExit (a test runner, a notebook, a program with a
    non-daemon thread), as it would have without the handler (exit status 143 in a shell, -15 as a
    subprocess's returncode). Only in the main thread (Python's signal thread) and where SIGTERM
    would end the process (a program's own handler, or SIG_IGN, is left alone)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    fired = False

    def unwind(signum: int, _: Any) -> None:
        nonlocal fired
        fired = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup this starts runs to its end
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        now = signal.getsignal(signal.SIGTERM)
        if now is unwind or (fired and now == signal.SIG_IGN):
            signal.signal(signal.SIGTERM, previous)
        if fired:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A new temporary directory beside ``out`` (and its missing parents) for an export or build to
    fill and ``move_into_place``: killed exports' leftovers are removed first (``remove_stale``), and
    on any failure, SIGTERM included (``sigterm_unwinds``), it and the parents made are removed."""
    remove_stale(out)
    made: list[Path] = []
    tmp: Path | None = None
    with sigterm_unwinds():
        try:
            made = make_parents(out.parent)
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=staging_prefix(out)))
            yield tmp
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            remove_made(made)
            raise
