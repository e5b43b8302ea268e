"""Where a study lives: Optuna's journal file by default, or any RDB URL shared by many machines.

* no ``--storage``: ``JournalStorage`` on ``<runs>/<study>/optuna.journal`` — no server, safe
  for several driver processes on one machine (Optuna's file lock), and for several machines
  when the runs folder is on a shared file system;
* ``journal:<path>``: the same on an explicit file (e.g. on a shared file system);
* ``postgresql://user@host:port/db`` (``pip install 'muoneq[postgres]'``), ``mysql://…``,
  ``sqlite:///path.db``: Optuna's ``RDBStorage`` — the way to share one study between workers
  on many machines (SQLite is for one machine only).

A journal whose last record was cut short (a crash or a full disk during an append) is repaired
before it is opened: Optuna would append the next record onto the partial line and the study
could never be read again. :func:`repair_journal` does it under Optuna's own journal lock.
"""

from __future__ import annotations

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

JOURNAL_NAME = "optuna.journal"


class JournalError(UserError, ValueError):
    """A journal file Optuna cannot read (the message names the line and the command to fix it)."""


def repair_journal(path: Path) -> None:
    """Drop a cut-short last record of the journal at ``path`` (everything after its last
    newline: Optuna writes each record as one line, so such a tail was never a whole record),
    with a one-line note; refuse a damaged complete line with the ``sed`` command that removes
    it (a cut record that was then appended to: the study cannot be read past it)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()  # appends by other drivers wait: the tail seen here is not one in progress
    try:
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        for number, line in enumerate(data[:end].splitlines(), start=1):
            try:
                json.loads(line)
            except ValueError:
                raise JournalError(
                    f"{path}: line {number} is not a whole Optuna journal record (a write was "
                    "cut short, then appended to), so the study cannot be read; remove that "
                    f"line to recover every other record: sed -i '{number}d' "
                    f"{shlex.quote(str(path))}") from None
        if end < len(data):
            try:
                os.truncate(path, end)
            except OSError as err:
                raise JournalError(
                    f"{path}: its last record was cut short ({len(data) - end} bytes after the "
                    f"last newline) and cannot be removed here ({err.strerror}); remove it: "
                    f"truncate -s {end} {shlex.quote(str(path))}") from None
            print(f"muoneq: note: {path}: dropped a last record cut short by a crash or a full "
                  f"disk ({len(data) - end} bytes, an operation that never completed)",
                  file=sys.stderr)
    finally:
        lock.release()


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
        path.parent.mkdir(parents=True, exist_ok=True)
        repair_journal(path)
        return JournalStorage(JournalFileBackend(str(path)))
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

