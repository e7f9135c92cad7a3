"""Whole-file writes a reader never sees half done: reports, docs pages and summaries are written
to a new file beside the target and renamed over it, so a write that fails part way (a full disk,
a killed run) leaves the old file whole and no temporary file behind."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Callable


class WriteError(OSError):
    """A file could not be written (``write_atomic``): what a command reports as "cannot write",
    where another OSError (an input that cannot be read) keeps its own message."""


def temp_beside(path: Path) -> Path:
    """A new empty file of a name no other run holds, in ``path``'s directory (so a rename onto
    ``path`` stays on one file system), with the mode a plain write would give (the umask applied
    to 0666, not mkstemp's 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place. An existing file
    keeps its permissions (set once the text is written, so a read-only one is replaced, not
    refused); a symlink is written through (its target replaced), as ``Path.write_text`` does.
    A path that is not a regular file (a pipe), or a stream's name (``/dev/stdout``, ``/dev/fd/N``,
    ``/proc/self/fd/N``, which may name a pipe or a redirected file), is written as it stands:
    replacing what it resolves to would lose what the stream carried before."""
    path = Path(path)
    if path.exists() and (not path.is_file() or path.absolute().parts[1:2] in (("dev",), ("proc",))):
        with path.open("a", encoding="utf-8") as f:  # "w" would truncate a redirected file
            f.write(text)
        return
    _replace(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then renamed onto it: a reader never
    sees half a file. A write that fails (a full disk: an OSError, ``torch.save``'s RuntimeError,
    safetensors' own error) deletes the temporary file and raises ``WriteError`` naming ``path``.
    As ``write_text_atomic``: an existing file keeps its permissions and a symlink is written
    through; a new file gets a plain write's mode (``temp_beside``'s), even where ``write``
    recreated the temporary file (safetensors' ``save_file`` makes it 0600 again)."""
    from safetensors import SafetensorError

    try:
        _replace(path, write)
    except (OSError, RuntimeError, SafetensorError) as exc:
        path = path.resolve() if path.is_symlink() else path
        raise WriteError(f"{path}: {type(exc).__name__}: {exc}") from exc


def _replace(path: Path, write: Callable[[Path], Any]) -> None:
    """The rule both writers follow, in one place: ``write(tmp)`` beside ``path`` (through a
    symlink, beside its target), the temporary file given the existing file's mode (or a plain
    write's, even where ``write`` recreated it), renamed over ``path``; on any failure the
    temporary file is deleted and the error raised as it came."""
    path = path.resolve() if path.is_symlink() else path
    tmp = temp_beside(path)
    try:
        mode = (path if path.is_file() else tmp).stat().st_mode & 0o7777
        write(tmp)
        tmp.chmod(mode)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
