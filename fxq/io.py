"""Atomic writes: one file, or a set of files committed together (an export's ``.param`` / ``.bin`` / ``.table``).

Every write goes to temp files in the target's directory (named ``.<name>.<pid>.<random>.fxq-tmp``), which are
fsynced, then renamed over the targets under an exclusive ``flock`` on ``<dir>/.fxq.lock``; so concurrent writers
of one set never interleave their renames: the last to take the lock wins with its whole set.

Guarantee for a set of several files (:func:`atomic_file_set`): before the first rename, each existing target
is hard-linked (copied where links are unsupported) to a backup and a journal ``.<first>.<pid>.<random>.fxq-journal``
naming targets, temps and backups is written, fsynced and renamed into place; the journal is removed once every
member is renamed (the commit point), then the backups. A handled error during the renames restores the old set
at once. If the process is killed (or the machine loses power) between two renames, a reader looking at the
files directly sees some members new and some old, next to the journal; the next atomic write into that
directory (any fxq export or save there) or :func:`recover_file_sets` first rolls every journal back, restoring
the complete old set, and deletes the temps and backups that dead processes left behind. A reader that wants a
consistent set calls :func:`recover_file_sets` first. Assumes a local file system (flock, same-host pids).

A set may also delete files (:func:`atomic_file_set` with ``None``: a large ONNX export's stale ``.onnx.data`` when
a smaller model is written there): they are backed up and journaled like the others, and restored on rollback.

Write failures (disk full, ``ulimit -f``, quota, permissions) become :class:`ExportError` naming the file and the
fix; the old file or set is left as it was and no temp file remains.

:func:`model_file_kind` reads a file's first bytes so that a reader handed the other tool's file can say which
reader it needs.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from fxq.errors import ExportError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no inter-process lock, the journal still applies
    fcntl = None  # type: ignore[assignment]

__all__ = ["atomic_path", "atomic_paths", "atomic_file_set", "atomic_write_bytes", "atomic_write_text",
           "check_writable_dir", "check_output_dir", "ensure_dir", "recover_file_sets", "write_error",
           "model_file_kind"]

LOCK_NAME = ".fxq.lock"
_TMP, _BAK, _JOURNAL = ".fxq-tmp", ".fxq-bak", ".fxq-journal"
_NEAR_FULL = 16 << 20  # free bytes under which a failed opaque write (torch.save) is reported as a full disk


def model_file_kind(path: str | os.PathLike) -> str | None:
    """``"zip"`` (a torch.save archive: what fxq.save writes), ``"onnx"`` (a protobuf opening with
    ``ModelProto.ir_version``, as onnx and torch.onnx write it) or None (unknown or unreadable), from the first bytes.

    Only a hint for error messages: the readers still decide by parsing.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return None
    if head == b"PK\x03\x04":
        return "zip"
    if head[:1] == b"\x08" and len(head) > 1:  # field 1 (ir_version), varint: onnx writes it first
        return "onnx"
    return None


def check_writable_dir(directory: str | os.PathLike) -> Path:
    """Raise :class:`ExportError` unless ``directory`` exists and is writable."""
    d = Path(directory)
    if not d.is_dir():
        raise ExportError(f"output directory {str(d)!r} does not exist; create it first")
    if not os.access(d, os.W_OK):
        raise ExportError(f"output directory {str(d)!r} is not writable")
    return d


def check_output_dir(directory: str | os.PathLike) -> Path:
    """Raise :class:`ExportError` unless ``directory`` is writable or can be created (see :func:`ensure_dir`)."""
    d = Path(directory)
    if d.is_dir():
        return check_writable_dir(d)
    existing = d
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ExportError(f"cannot create output folder {str(d)!r}: {str(existing)!r} is a file, not a folder; "
                          f"remove it or choose another output path")
    if not os.access(existing, os.W_OK):
        raise ExportError(f"cannot create output folder {str(d)!r}: {str(existing)!r} is not writable")
    return d


def ensure_dir(directory: str | os.PathLike) -> Path:
    """Create ``directory`` and its parents if missing (as the CLI does); :class:`ExportError` if impossible."""
    d = check_output_dir(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(d, exc, what="creating folder") from exc
    return d


def write_error(path: str | os.PathLike, exc: OSError, *, what: str = "writing") -> ExportError:
    """An :class:`ExportError` naming ``path``, the cause of ``exc`` and what to do about it."""
    p = str(path)
    code = exc.errno
    if code == errno.ENOSPC:
        msg = f"no space left on device while {what} {p!r}; free space or choose another directory"
    elif code == errno.EFBIG:
        msg = (f"file size limit exceeded while {what} {p!r} (ulimit -f / RLIMIT_FSIZE); raise the limit or "
               f"choose another directory")
    elif code == errno.EDQUOT:
        msg = f"disk quota exceeded while {what} {p!r}; free space or choose another directory"
    elif code == errno.EROFS:
        msg = f"read-only file system while {what} {p!r}; choose another directory"
    elif code in (errno.EACCES, errno.EPERM):
        msg = f"permission denied while {what} {p!r}; check the permissions or choose another directory"
    elif code == errno.EISDIR:
        msg = f"{p!r} is a directory; give a file path inside it"
    else:
        msg = f"cannot finish {what} {p!r}: {exc.strerror or exc}"
    return ExportError(msg)


# ----------------------------------------------------------------------------------------------- one mechanism
@contextlib.contextmanager
def atomic_paths(paths: Sequence[str | os.PathLike], remove: Sequence[str | os.PathLike] = ()) -> Iterator[list[Path]]:
    """Yield one temp path per target (all in one existing directory); if the block succeeds, the temps replace
    the targets and the files in ``remove`` (same folder) are deleted, as one set (see the module docstring),
    else the temps are deleted and the targets are untouched.

    An ``OSError`` in the block, or a failed write reported otherwise (``torch.save``'s ``RuntimeError``) on a
    full disk or past ``ulimit -f``, becomes an :class:`ExportError` naming the target.
    """
    targets = [Path(p) for p in paths]
    gone = [Path(p) for p in remove]
    if not targets:
        raise ValueError("atomic_paths needs at least one path")
    directory = targets[0].parent
    members = targets + gone
    if any(t.parent != directory for t in members) or len({t.name for t in members}) != len(members):
        raise ValueError(f"atomic_paths: the files of one set must be distinct and in one folder: {members}")
    check_writable_dir(directory)
    _check_not_dirs(targets)
    tmps: list[Path] = []
    try:
        for t in targets:
            tmps.append(_mktemp(t, _TMP))
        try:
            yield tmps
        except OSError as exc:
            raise write_error(_target_of(exc, targets, tmps), exc) from exc
        except RuntimeError as exc:
            cause = _opaque_write_failure(tmps)
            if cause is None:
                raise
            raise write_error(targets[0], cause) from exc
        _commit(directory, list(zip(targets, tmps)), gone)
    finally:
        for tmp in tmps:
            _unlink(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; it replaces ``path`` only if the block succeeds."""
    with atomic_paths([path]) as (tmp,):
        yield tmp


def atomic_file_set(files: Mapping[str | os.PathLike, bytes | bytearray | str | None]) -> list[Path]:
    """Write ``{path: bytes-like | str}`` (str as UTF-8; buffers without a copy) as one set: all new files or all
    old ones; a ``None`` value deletes that file (if present) in the same set. Returns the paths written."""
    targets = [Path(p) for p, data in files.items() if data is not None]
    contents = [data for data in files.values() if data is not None]
    with atomic_paths(targets, [Path(p) for p, data in files.items() if data is None]) as tmps:
        for target, tmp, data in zip(targets, tmps, contents):
            try:
                _write_data(tmp, data.encode("utf-8") if isinstance(data, str) else memoryview(data))
            except OSError as exc:
                raise write_error(target, exc) from exc
    return targets


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_file_set({path: data})[0]


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_file_set({path: text})[0]


def recover_file_sets(directory: str | os.PathLike) -> int:
    """Roll back every set whose commit was interrupted in ``directory`` and delete dead writers' temp files;
    returns the number of sets rolled back. Writers do this themselves before each commit."""
    d = Path(directory)
    if not d.is_dir():
        return 0
    with _dir_lock(d):
        return _recover_locked(d)


# ----------------------------------------------------------------------------------------------- internals
def _write_data(tmp: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``tmp`` (tests patch this to simulate a full disk); the caller fsyncs it once."""
    fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _mktemp(target: Path, suffix: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    return Path(tmp)


def _check_not_dirs(targets: Sequence[Path]) -> None:
    for t in targets:
        if t.is_dir():
            raise ExportError(f"{str(t)!r} is a directory; give a file path inside it, or remove the folder")


def _target_of(exc: OSError, targets: Sequence[Path], tmps: Sequence[Path]) -> Path:
    for target, tmp in zip(targets, tmps):
        if exc.filename is not None and os.fspath(exc.filename) == os.fspath(tmp):
            return target
    return targets[0] if len(targets) == 1 else targets[0].parent


def _opaque_write_failure(tmps: Sequence[Path]) -> OSError | None:
    """The likely OSError behind a write that failed without one (torch.save's C++ writer), or None."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = None if limit == resource.RLIM_INFINITY else limit
    except (ImportError, OSError, ValueError):
        limit = None
    for tmp in tmps:
        try:
            size = tmp.stat().st_size
        except OSError:
            continue
        if limit is not None and size >= limit:
            return OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(tmp))
    try:
        st = os.statvfs(tmps[0].parent)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    except (AttributeError, OSError):
        return None
    if free < _NEAR_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmps[0]))
    return None


def _commit(directory: Path, pairs: list[tuple[Path, Path]], remove: Sequence[Path] = ()) -> None:
    """Rename every temp over its target and delete ``remove`` under the directory lock; roll back on any error
    (see module docs)."""
    mode = 0o666 & ~_UMASK
    for target, tmp in pairs:
        try:
            _fsync_file(tmp)  # on disk before it replaces the target
            os.chmod(tmp, mode)  # mkstemp creates 0600; give the file the usual permissions
        except OSError as exc:
            raise write_error(target, exc) from exc
    with _dir_lock(directory):
        _recover_locked(directory)
        _check_not_dirs([t for t, _ in pairs])
        steps: list[tuple[Path, Path | None]] = [*pairs, *((r, None) for r in remove
                                                                  if os.path.lexists(r) and not r.is_dir())]
        if len(steps) == 1:  # one rename is atomic by itself
            target, tmp = pairs[0]
            try:
                os.replace(tmp, target)
            except OSError as exc:
                raise write_error(target, exc) from exc
            _fsync_dir(directory)
            return
        entries, journal = _begin(directory, steps)
        try:
            for target, tmp in steps:
                _after_rename_hook(target)
                if tmp is None:
                    os.unlink(target)
                else:
                    os.replace(tmp, target)
            _after_rename_hook(None)
            _fsync_dir(directory)
        except BaseException as exc:
            _rollback(directory, entries, journal)
            if isinstance(exc, OSError):
                raise write_error(target, exc) from exc
            raise
        os.unlink(journal)  # the commit point
        _fsync_dir(directory)
        for e in entries:
            if e["backup"]:
                _unlink(directory / e["backup"])


def _after_rename_hook(target: Path | None) -> None:
    """Called before each member's rename and after the last one (tests patch it to kill the process there)."""


def _begin(directory: Path, pairs: list[tuple[Path, Path | None]]) -> tuple[list[dict], Path]:
    """Back up the existing targets and write the journal; returns (entries, journal path)."""
    entries: list[dict] = []
    try:
        for target, tmp in pairs:
            backup = None
            if os.path.lexists(target):
                backup = _mktemp(target, _BAK)
                _unlink(backup)
                try:
                    os.link(target, backup, follow_symlinks=False)
                except OSError:  # no hard links here: copy instead
                    shutil.copy2(target, backup, follow_symlinks=False)
                    if not backup.is_symlink():
                        _fsync_file(backup)
            entries.append({"target": target.name, "tmp": tmp.name if tmp else None,  # None: a deletion
                            "backup": backup.name if backup else None})
        journal_tmp = _mktemp(pairs[0][0], _TMP)
        try:
            _write_data(journal_tmp, json.dumps({"fxq_file_set": 1, "members": entries}).encode())
            _fsync_file(journal_tmp)
            journal = journal_tmp.with_name(journal_tmp.name[: -len(_TMP)] + _JOURNAL)
            os.replace(journal_tmp, journal)
        finally:
            _unlink(journal_tmp)
        _fsync_dir(directory)
    except OSError as exc:
        for e in entries:
            if e["backup"]:
                _unlink(directory / e["backup"])
        raise write_error(pairs[0][0], exc) from exc
    return entries, journal


def _rollback(directory: Path, entries: list[dict], journal: Path) -> None:
    """Restore every target from its backup (delete it where there was none), then drop temps and journal.

    Idempotent: a rollback interrupted by a kill is finished by the next one."""
    for e in entries:
        target = directory / e["target"]
        if e["backup"]:
            backup = directory / e["backup"]
            if os.path.lexists(backup):
                os.replace(backup, target)
                _unlink(backup)  # a member not renamed yet is a hard link of its backup: rename(2) did nothing
        else:
            _unlink(target)
    _fsync_dir(directory)
    for e in entries:
        if e["tmp"]:
            _unlink(directory / e["tmp"])
    _unlink(journal)
    _fsync_dir(directory)


def _recover_locked(directory: Path) -> int:
    ours = sorted(e.name for e in os.scandir(directory) if e.name.startswith(".") and ".fxq-" in e.name)
    rolled = 0
    for journal in [directory / n for n in ours if n.endswith(_JOURNAL)]:
        try:
            entries = json.loads(journal.read_text(encoding="utf-8"))["members"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ExportError(f"cannot read the interrupted export's journal {str(journal)!r} ({exc}); check the "
                              f"files it names, then delete it") from exc
        _rollback(directory, entries, journal)
        rolled += 1
    for name in ours:  # temps and backups of writers that died
        if name.endswith((_TMP, _BAK)) and not _pid_alive(_pid_of(name)):
            _unlink(directory / name)
    return rolled


def _pid_of(name: str) -> int | None:
    parts = name.rsplit(".", 3)  # ".<target>", "<pid>", "<random>", "fxq-tmp"
    try:
        return int(parts[1])
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int | None) -> bool:
    if pid is None or pid <= 0:
        return True  # not ours to judge: keep it
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextlib.contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """Exclusive flock on ``directory/.fxq.lock``; the file is removed on release (waiters then retry)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    path = directory / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~_UMASK)
        except OSError as exc:
            raise write_error(path, exc, what="creating the lock file") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            mine = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # the holder before us removed this lock file: take the new one
    try:
        yield
    finally:
        _unlink(path)
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _read_umask() -> int:
    mask = os.umask(0)  # read once at import: changing it later would race with other threads' file creation
    os.umask(mask)
    return mask


_UMASK = _read_umask()
