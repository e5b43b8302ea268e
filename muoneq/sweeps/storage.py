"""Where a study lives: Optuna's journal file by default, or any RDB URL shared by many machines.

* no ``--storage``: ``JournalStorage`` on ``<runs>/<study>/optuna.journal`` — no server, safe
  for several driver processes on one machine (Optuna's file lock), and for several machines
  when the runs folder is on a shared file system;
* ``journal:<path>``: the same on an explicit file (e.g. on a shared file system);
* ``postgresql://user@host:port/db`` (``pip install 'muoneq[postgres]'``), ``mysql://…``,
  ``sqlite:///path.db``: Optuna's ``RDBStorage`` — the way to share one study between workers
  on many machines (SQLite is for one machine only).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from sqlalchemy.exc import IntegrityError, ProgrammingError

JOURNAL_NAME = "optuna.journal"


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

