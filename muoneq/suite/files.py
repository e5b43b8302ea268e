"""File names from free text (:func:`slug`), and writing files so that a crash or a full disk
leaves no half-written file: a temporary file in the destination folder renamed into place
(:func:`atomic_open`, :func:`atomic_write`), and a full disk reported as one line naming the
path (:func:`reporting_full_disk`, :class:`~muoneq.suite.errors.DiskFull`)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from muoneq.suite.errors import DiskFull, UserError


def slug(text: str, *, keep: str = "A-Za-z0-9.=+-", sep: str = "_", empty: str = "") -> str:
    """``text`` as one file name: each run of characters outside ``keep`` (the body of a regex
    character class) becomes ``sep``, trimmed at both ends; ``empty`` when nothing is left."""
    return re.sub(f"[^{keep}]+", sep, text).strip(sep) or empty


#: ``errno`` values of a full disk or an exhausted quota.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
#: ``errno`` values of a file or folder this user may not read or write (or a read-only disk).
NO_ACCESS = (errno.EACCES, errno.EPERM, errno.EROFS)


def no_access(err: OSError) -> UserError:
    """The one-line :class:`~muoneq.suite.errors.UserError` for an ``OSError`` of
    :data:`NO_ACCESS`, naming the file or folder."""
    where = err.filename or "a file or folder"
    if err.errno == errno.EROFS:
        return UserError(f"{where} is on a read-only file system, so it cannot be written; write "
                         "to a writable disk (run.root, run.dir or --runs-dir) or remount it")
    return UserError(f"{where}: permission denied ({err.strerror}); give your user access to it "
                     "(ls -l, chmod, chown), or choose another file or folder")


@contextlib.contextmanager
def reporting_full_disk(path: str | os.PathLike, then: str = "") -> Iterator[None]:
    """Turn a full-disk ``OSError`` raised inside into :class:`DiskFull` naming ``path``, the
    free space left there and what to do (``then``: how to continue afterwards)."""
    try:
        yield
    except OSError as err:
        if err.errno not in FULL_DISK or isinstance(err, DiskFull):
            raise
        raise full_disk(path, then) from None


@contextlib.contextmanager
def full_disk_in_threads_said_once() -> Iterator[None]:
    """While the block runs, a thread that dies of a full disk prints no traceback: the writer
    threads that meet one (TensorBoard's event writer) hand their error to the thread that waits
    on them, where :func:`reporting_full_disk` says it as one line."""
    previous = threading.excepthook

    def hook(args) -> None:
        if not (isinstance(args.exc_value, OSError) and args.exc_value.errno in FULL_DISK):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def full_disk(path: str | os.PathLike, then: str = "") -> DiskFull:
    """The :class:`DiskFull` error for a write under ``path`` that found no space."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 2**30
    return DiskFull(f"no space left on the disk holding {path} ({free:.2f} GiB free); free "
                    f"space there (old runs, checkpoints) or write to a larger disk"
                    f"{'; ' + then if then else ''}")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, fsync: bool = False,
                then: str = "", **open_args) -> Iterator[IO]:
    """A file to write ``path`` through: a temporary file beside it (``.<name>.<pid>.tmp``,
    one per process, so processes writing the same file at once never mix), renamed over
    ``path`` when the block ends without an error and deleted otherwise, so a kill or an error
    leaves the old file or the new one, whole. ``fsync``: the data reach the disk before the
    rename, and the rename before the block returns (a power cut too keeps one whole file).
    A full disk raises
    :class:`~muoneq.suite.errors.DiskFull` naming ``path`` (``then``: see
    :func:`reporting_full_disk`). ``open_args`` go to :func:`open`
    (``newline=""`` for :mod:`csv`)."""
    path = Path(path)
    tmp = temporary_path(path)
    with reporting_full_disk(path, then):
        try:
            with open(tmp, mode, **open_args) as f:
                yield f
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if fsync:
                _fsync_folder(path.parent)
        finally:
            tmp.unlink(missing_ok=True)


def temporary_path(path: str | os.PathLike) -> Path:
    """The temporary file :func:`atomic_open` writes ``path`` through, in this process."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable (its entry table on the disk)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:  # a file system that cannot sync a folder (some network ones)
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_open`."""
    with atomic_open(path) as f:
        f.write(text)
