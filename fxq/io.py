"""Atomic file writes: a temp file in the target directory, then ``os.replace``."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from fxq.errors import ExportError

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text", "check_writable_dir"]


def check_writable_dir(directory: str | os.PathLike) -> Path:
    """Raise :class:`ExportError` unless ``directory`` exists and is writable."""
    d = Path(directory)
    if not d.is_dir():
        raise ExportError(f"output directory {str(d)!r} does not exist; create it first")
    if not os.access(d, os.W_OK):
        raise ExportError(f"output directory {str(d)!r} is not writable")
    return d


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; it replaces ``path`` only if the block succeeds."""
    target = Path(path)
    check_writable_dir(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as fh:  # on disk before it replaces the target
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_umask() -> int:
    mask = os.umask(0)  # read once at import: changing it later would race with other threads' file creation
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
