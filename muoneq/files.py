"""Writing files so that a crash or a full disk leaves no half-written file: a temporary file
in the destination folder renamed into place (:func:`atomic_write`), and a full disk reported
as one line naming the path (:func:`reporting_full_disk`, :class:`~muoneq.errors.DiskFull`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from muoneq.errors import DiskFull

#: ``errno`` values of a full disk or an exhausted quota.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


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


def full_disk(path: str | os.PathLike, then: str = "") -> DiskFull:
    """The :class:`DiskFull` error for a write under ``path`` that found no space."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 2**30
    return DiskFull(f"no space left on the disk holding {path} ({free:.2f} GiB free); free "
                    f"space there (old runs, checkpoints) or write to a larger disk"
                    f"{'; ' + then if then else ''}")


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a kill leaves the old file or the new one, whole (a
    full disk: :class:`~muoneq.errors.DiskFull` naming ``path``, nothing half-written left).
    Processes writing the same file at once each use their own temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with reporting_full_disk(path):
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
