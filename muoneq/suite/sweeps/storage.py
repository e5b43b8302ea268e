"""Where a study lives: Optuna's journal file by default, or any RDB URL shared by many machines.

* no ``--storage``: ``JournalStorage`` on ``<runs>/<study>/optuna.journal`` — no server, safe
  for several driver processes on one machine (Optuna's file lock), and for several machines
  when the runs folder is on a shared file system;
* ``journal:<path>``: the same on an explicit file (e.g. on a shared file system);
* ``postgresql://user@host:port/db`` (``pip install 'muoneq[postgres]'``), ``mysql://…``,
  ``sqlite:///path.db``: Optuna's ``RDBStorage`` — the way to share one study between workers
  on many machines (SQLite is for one machine only).

A journal whose last record was cut short (a crash or a full disk during an append), or with a
line that is not an Optuna record, is repaired before it is opened: Optuna would append the next
record onto a partial line, and stop at a line it cannot read, so the study could never be read
again. :func:`repair_journal` does it under Optuna's own journal lock.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
from sqlalchemy.exc import IntegrityError, ProgrammingError

from muoneq.suite.errors import UserError
from muoneq.suite.files import atomic_open, reporting_full_disk

JOURNAL_NAME = "optuna.journal"


class JournalError(UserError, ValueError):
    """A journal file Optuna cannot read (the message names the file and what to do)."""


#: How every record of Optuna's journal begins (``json.dumps`` of a dict whose first key is
#: the operation).
_RECORD_START = b'{"op_code"'


def _is_record(line: bytes) -> bool:
    """Whether ``line`` has the shape of a record of Optuna's journal: a JSON object with an
    integer ``op_code`` and the ``worker_id`` that wrote it (any operation: a newer Optuna's are
    kept too; Optuna itself checks the rest when it reads them)."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return (isinstance(record, dict) and type(record.get("op_code")) is int
            and isinstance(record.get("worker_id"), str))


def _salvage(line: bytes) -> bytes | None:
    """The whole record at the end of a damaged line (a record cut short, then appended onto:
    what older versions did after a crash), or None."""
    start = line.rfind(_RECORD_START)
    while start > 0:
        if _is_record(line[start:]):
            return line[start:]
        start = line.rfind(_RECORD_START, 0, start)
    return None


def repair_journal(path: Path) -> None:
    """Repair the journal at ``path`` before Optuna reads it, under Optuna's own journal lock
    (appends by other drivers wait, so the tail seen here is not one in progress):

    * a last record cut short (everything after its last newline: Optuna writes each record as
      one line, so such a tail was never a whole record) is dropped, with a one-line note;
    * a complete line that is not a record (a cut record that was appended onto, garbage, JSON
      of another shape) is dropped, keeping the whole record at its end if there is one, with a
      one-line note naming the lines and a copy of the journal as it was
      (``<name>.damaged-<time>``).
    """
    if not path.is_file() or path.stat().st_size == 0:
        return
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        lines = data[:end].splitlines(keepends=True)
        bad = [n for n, line in enumerate(lines, start=1) if not _is_record(line)]
        if bad:
            _drop_lines(path, data, lines, bad)
        elif end < len(data):
            _drop_tail(path, end, len(data) - end)
    finally:
        lock.release()


def _drop_tail(path: Path, end: int, cut: int) -> None:
    try:
        os.truncate(path, end)
    except OSError as err:
        raise JournalError(
            f"{path}: its last record was cut short ({cut} bytes after the last newline) and "
            f"cannot be removed here ({err.strerror}); remove it: truncate -s {end} "
            f"{shlex.quote(str(path))}") from None
    print(f"muoneq: note: {path}: dropped a last record cut short by a crash or a full disk "
          f"({cut} bytes, an operation that never completed)", file=sys.stderr)


def _drop_lines(path: Path, data: bytes, lines: list[bytes], bad: list[int]) -> None:
    """Rewrite the journal without the lines ``bad`` (numbered from 1; a whole record at the end
    of one is kept) and without a cut last record, keeping a copy of it as it was."""
    kept, salvaged = [], 0
    for number, line in enumerate(lines, start=1):
        if number in bad:
            record = _salvage(line.rstrip(b"\n"))
            if record is not None:
                kept.append(record + b"\n")
                salvaged += 1
        else:
            kept.append(line)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    copy = path.with_name(f"{path.name}.damaged-{stamp}")
    with atomic_open(copy, "wb", fsync=True) as f:
        f.write(data)
    with atomic_open(path, "wb", fsync=True) as f:
        f.write(b"".join(kept))
    which = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
    kept_note = f", keeping the whole record at the end of {salvaged}" if salvaged else ""
    print(f"muoneq: note: {path}: dropped line {which}, not a whole Optuna journal record (a "
          f"write cut short, then appended onto, or other text){kept_note}; the journal as it "
          f"was is kept as {copy.name}", file=sys.stderr)


#: What a sweep stopped by a full disk says to do once there is room.
FULL_DISK_THEN = "then run the same sweep command to continue"


class _JournalFile(JournalFileBackend):
    """Optuna's journal file, whose full disk names the journal
    (:class:`~muoneq.suite.errors.DiskFull`): Optuna's append raises the bare ``OSError`` of a
    write, which names no file, and the journal may be on another disk than the runs."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path

    def append_logs(self, logs: list[dict]) -> None:
        with reporting_full_disk(self.path, FULL_DISK_THEN):
            super().append_logs(logs)


def default_journal(study_dir: Path) -> Path:
    return Path(study_dir) / JOURNAL_NAME


def storage_label(url: str | None, study_dir: Path) -> str:
    """The storage as a user would type it, without a password."""
    if url is None:
        return f"journal:{default_journal(study_dir)}"
    return re.sub(r"://([^:/@]+):[^@/]*@", r"://\1:***@", url)


def open_storage(url: str | None, study_dir: Path) -> BaseStorage:
    """Open (creating when needed) the storage named by ``url`` (see the module docstring)."""
    if url is None or url.startswith("journal:"):
        path = default_journal(study_dir) if url is None else Path(url[len("journal:"):])
        try:
            with reporting_full_disk(path, FULL_DISK_THEN):
                path.parent.mkdir(parents=True, exist_ok=True)
                repair_journal(path)
                return JournalStorage(_JournalFile(path))
        except (KeyError, TypeError, ValueError, AssertionError) as err:  # a record Optuna
            raise JournalError(  # cannot apply, though it has a record's shape
                f"{path}: Optuna cannot read its records ({type(err).__name__}: {err}); restore "
                "it from a backup, or move it away to start the study again") from None
    if "://" not in url:
        raise ValueError(
            f"--storage {url!r}: expected journal:<file>, sqlite:///<file>, "
            "postgresql://user@host:port/db or mysql://…"
        )
    scheme = url.split("://", 1)[0]
    if scheme in ("postgres", "postgresql"):
        # Name the driver we ship in the `postgres` extra (psycopg 3): SQLAlchemy < 2.1 would
        # otherwise look for psycopg2, and knows no "postgres://" spelling at all.
        url, scheme = "postgresql+psycopg://" + url.split("://", 1)[1], "postgresql+psycopg"
    if scheme == "postgresql+psycopg":
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise ValueError(
                f"--storage {storage_label(url, study_dir)} needs the PostgreSQL driver: "
                "pip install 'muoneq[postgres]' (psycopg 3)"
            ) from None
    # pool_pre_ping: workers that sit in a long trial must not reuse a connection the server
    # dropped meanwhile. Workers started together on a fresh database race to create Optuna's
    # tables (a unique-violation on the schema): the losers retry once it exists.
    attempt = 0
    while True:
        try:
            return RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
        except (IntegrityError, ProgrammingError):
            attempt += 1
            if attempt == 5:
                raise
            time.sleep(0.5 * attempt)

