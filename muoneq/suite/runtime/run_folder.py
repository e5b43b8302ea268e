"""A run folder's one writer, where its paths lead, and what is ever cleaned in it.

* **One writer** (:func:`hold`). A run holds an exclusive ``flock`` on ``<run dir>/.run.lock``
  for its whole life (rank 0 of a distributed run: the other processes are its own), with who
  holds it written inside (process, host, start, command), and one on ``.run.lock`` in each
  folder its ``checkpoints/`` or ``tensorboard/`` link leads to (where its files really go). A
  second ``muoneq train`` on the same folder, or linking to one such folder, is refused before it
  reads or writes anything there, with one line naming the holder.
  The kernel releases the lock of a process that ends, however it ends (a SIGKILL, a node that
  reboots), so a lock file a dead run left behind is taken over by the next one, with a note
  naming the dead holder. It is the kind of lock a sweep's trial holds (``.trial.lock``,
  :mod:`muoneq.suite.sweeps.launch`); ``flock`` works across machines on NFS (the client emulates
  it with POSIX locks) and on local disks. Written on ``fcntl.flock`` directly, as that one is:
  the lock file also says who holds it, for the refusal to name (``filelock``'s locks carry no
  holder).
* **Where its paths lead** (:func:`check_paths`). ``run.root``, the run folder, ``checkpoints/``
  and ``tensorboard/`` must each be a folder or not exist yet: a file, a symbolic link to nothing
  or a loop of links there is one line naming the path. A run named by ``run.name`` stays inside
  ``run.root``: a run folder there that is a link to elsewhere is refused (``run.dir=`` names the
  folder to write through it). Links the user made for writing (``run.dir`` itself, or
  ``checkpoints/`` on a scratch disk) are followed, and a note says where the files go.
* **Cleaning** (:func:`clear_attempt`, :func:`remove_partial_writes`). Only the files this run
  listed as it wrote them are ever removed (:mod:`muoneq.suite.runtime.written`: its
  checkpoints, their ``.sha256``, its TensorBoard event files, the temporary files of its cut
  writes), never a folder's contents wholesale, never a file named like them that the run did
  not write, and a link is removed as a link. A run folder made before the list existed is
  cleaned by those names, in its own folders only (never in a link's target).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig

from muoneq.suite.files import reporting_full_disk
from muoneq.suite.runtime.checkpoints import CHECKPOINT_DIR, DAMAGED_SUFFIX
from muoneq.suite.runtime.record import RunFolderError
from muoneq.suite.runtime.trainer import TENSORBOARD_DIR
from muoneq.suite.runtime.written import Written

LOCK_NAME = ".run.lock"
#: What a run writes in ``checkpoints/`` (a temporary file of a cut write: ``.<name>.<pid>.tmp``,
#: :func:`muoneq.suite.files.atomic_open`).
CHECKPOINT_FILES = re.compile(
    r"(last-step\d+|best)\.ckpt(\.sha256)?|\.(last-step\d+|best)\.ckpt(\.sha256)?\.\d+\.tmp")
#: What a run writes in ``tensorboard/`` (Lightning's TensorBoard logger, the spectral monitor).
TENSORBOARD_FILES = re.compile(r"events\.out\.tfevents\..+|hparams\.yaml|spectra\.csv")
#: The temporary files of a cut write of the run folder's own files (``config.yaml``,
#: ``metrics.json``, ``routing.txt``).
PARTIAL_WRITES = re.compile(r"\.(config\.yaml|metrics\.json|routing\.txt)\.\d+\.tmp")


# --------------------------------------------------------------------------- one writer
def _read_holder(fd: int) -> dict | None:
    """Who holds (or held) the lock file open as ``fd`` (None: nobody wrote it, or it is cut)."""
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 65536)
    try:
        holder = json.loads(data)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def describe_holder(holder: dict | None) -> str:
    if holder is None:
        return "another process (it has not said who it is yet)"
    return (f"process {holder.get('pid')} on {holder.get('host')} (since "
            f"{holder.get('started')}: {holder.get('command')})")


def _make_folders(folder: Path) -> list[Path]:
    """``mkdir -p folder``; the folders it made, deepest first."""
    made = []
    for path in [folder, *folder.parents]:
        if path.exists():
            break
        made.append(path)
    for path in reversed(made):
        path.mkdir(exist_ok=True)
    return made


def _open_locked(path: Path, link: Path | None = None) -> int:
    """The lock file ``path`` open and locked (an ``fd``); :class:`RunFolderError` naming the
    holder when a live process holds it (``link``: the run's link that leads to its folder)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if link is not None:
                raise RunFolderError(
                    f"{link.resolve()}, where {link} leads, is being written by "
                    f"{describe_holder(holder)}, and runs that wrote one folder at once would mix "
                    f"their files; link {link.name}/ to a folder of its own, or wait for that run "
                    "to end (or stop it)") from None
            raise RunFolderError(
                f"{path.parent} is being written by {describe_holder(holder)}, and a run folder "
                "has one writer; wait for that run to end (or stop it), or start this one in "
                "another folder (another run.name or run.dir)") from None
        # the holder may have released and removed the file between our open and our lock:
        # then the lock is on a file nobody else will open, and we try again
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _linked_folders(run_dir: Path) -> list[Path]:
    """The run's ``checkpoints/`` and ``tensorboard/`` that are links to folders outside the run
    folder (where its files really go), one per folder they lead to."""
    own, found = run_dir.resolve(), {}
    for path in (run_dir / CHECKPOINT_DIR, run_dir / TENSORBOARD_DIR):
        target = path.resolve()
        if path.is_symlink() and target != own and own not in target.parents:
            found.setdefault(target, path)
    return list(found.values())


def holds_tensorboard_files(run_dir: Path) -> bool:
    """Whether the run folder's ``tensorboard/`` holds what a run writes there: a folder of its
    own does when it exists; one it links to (a scratch disk, a shared folder of logs) when it
    holds files named as a run names its files there (:data:`TENSORBOARD_FILES`), as a
    ``checkpoints/`` link does when it holds checkpoints."""
    folder = Path(run_dir) / TENSORBOARD_DIR
    if not folder.is_dir():
        return False
    if not folder.is_symlink():
        return True
    return any(TENSORBOARD_FILES.fullmatch(p.name) for p in folder.iterdir())


@contextlib.contextmanager
def hold(run_dir: Path, argv: list[str] | None) -> Iterator[None]:
    """Be the one writer of ``run_dir``, and of the folders its links lead to, while the block
    runs (module docstring): the folder is made if needed (and removed again, when it is left
    empty, with the folders made for it)."""
    run_dir = Path(run_dir)
    made = _make_folders(run_dir)
    held: list[tuple[Path, int]] = []
    try:
        held.append((run_dir / LOCK_NAME, _open_locked(run_dir / LOCK_NAME)))
        for link in _linked_folders(run_dir):
            held.append((link / LOCK_NAME, _open_locked(link / LOCK_NAME, link)))
        command = " ".join(["muoneq", "train", *argv]) if argv is not None else " ".join(sys.argv)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        for path, fd in held:
            left = _read_holder(fd)
            if left is not None:
                print(f"muoneq: note: {path} was left by {describe_holder(left)}, which ended "
                      "without releasing it (killed?); this run takes it over")
            with reporting_full_disk(path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        for path, fd in reversed(held):
            path.unlink(missing_ok=True)  # before the lock goes: the next run makes a new file
            os.close(fd)
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders :func:`_make_folders` made, deepest first, while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


# --------------------------------------------------------------------------- where paths lead
def folder_problem(path: Path) -> tuple[Path, str, str] | None:
    """The first component of ``path`` that cannot be (part of) a folder to write in, what it
    is and how to fix it: a file, a symbolic link to nothing, a loop of links. None when every
    existing component is a folder (the rest can be made)."""
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        prefix = Path(*parts[:i])
        try:
            mode = os.stat(prefix).st_mode
        except FileNotFoundError:
            if os.path.islink(prefix):
                return (prefix, f"is a symbolic link to {os.readlink(prefix)}, which does not "
                        "exist", "create that folder or remove the link")
            return None
        except OSError as err:
            if err.errno == errno.ELOOP:
                return prefix, "is a loop of symbolic links", "remove the link"
            raise
        if not stat.S_ISDIR(mode):
            return prefix, "is a file, not a folder", "move it away"
    return None


def check_paths(cfg: DictConfig, run_dir: Path) -> list[str]:
    """Refuse (:class:`RunFolderError`, one line) a run folder whose paths cannot be written as
    asked (module docstring); return the notes to print: the links followed for writing."""
    run_dir = Path(run_dir)
    keys = "run.dir" if cfg.run.dir else "run.root / run.name"
    for path in (run_dir, run_dir / CHECKPOINT_DIR, run_dir / TENSORBOARD_DIR):
        problem = folder_problem(path)
        if problem is not None:
            where, what, fix = problem
            raise RunFolderError(f"{where} {what}, so the run folder {run_dir} cannot be written; "
                                 f"{fix}, or choose another run folder ({keys})")
    if not cfg.run.dir and run_dir.is_symlink():
        raise RunFolderError(
            f"{run_dir} is a symbolic link to {os.readlink(run_dir)}, so a run named "
            f"run.name={cfg.run.name} would be written outside run.root={cfg.run.root}; pass "
            f"run.dir={run_dir} to write there through the link, or remove the link")
    notes = []
    for path in (run_dir, run_dir / CHECKPOINT_DIR, run_dir / TENSORBOARD_DIR):
        if path.is_symlink():
            notes.append(f"muoneq: note: {path} is a symbolic link: the run writes to "
                         f"{path.resolve()} (and removes there only the files it wrote)")
    return notes


# --------------------------------------------------------------------------- cleaning
def _remove(path: Path) -> None:
    """Remove one entry the project wrote: a link as a link, a folder (a distributed
    checkpoint) with its contents, a file."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _named_ours(run_dir: Path) -> list[Path]:
    """What a run folder made before the list of written files existed holds of the project's
    files, by their names (:data:`CHECKPOINT_FILES`, :data:`TENSORBOARD_FILES`), in its own
    ``checkpoints/`` and ``tensorboard/`` only: never in a link's target, where others write."""
    found = []
    for folder, names in ((run_dir / CHECKPOINT_DIR, CHECKPOINT_FILES),
                          (run_dir / TENSORBOARD_DIR, TENSORBOARD_FILES)):
        if folder.is_dir() and not folder.is_symlink():
            found += sorted(p for p in folder.iterdir() if names.fullmatch(p.name))
    return found


def _written(run_dir: Path) -> list[Path]:
    """The files this run wrote in ``checkpoints/`` and ``tensorboard/`` that are still there
    (:mod:`muoneq.suite.runtime.written`; by name in a run folder made before the list)."""
    written = Written(run_dir)
    return written.files() if written.exists() else _named_ours(run_dir)


def clear_attempt(run_dir: Path) -> None:
    """Remove what an earlier attempt in this run folder wrote when it left no checkpoint to
    resume from (its curves would mix with this run's): its checkpoints and TensorBoard files,
    exactly those it listed (module docstring). Called only for a folder whose ``config.yaml``
    is ours (:func:`muoneq.suite.runtime.record.read_record`); checkpoints set aside as damaged
    are kept."""
    tensorboard = run_dir / TENSORBOARD_DIR
    made = [p for p in _written(run_dir) if not p.name.endswith(DAMAGED_SUFFIX)]
    if made:
        print(f"muoneq: note: {run_dir} holds an earlier attempt that left no checkpoint to "
              "resume from; starting over (its checkpoints and TensorBoard files are removed)")
    for path in made:
        _remove(path)
    Written(run_dir).forget()
    if tensorboard.is_dir() and not tensorboard.is_symlink() and not any(tensorboard.iterdir()):
        tensorboard.rmdir()


def remove_partial_writes(run_dir: Path) -> list[Path]:
    """Delete the temporary files of writes a kill cut short (``.<name>.<pid>.tmp`` of a file
    the run wrote) from the run folder and its ``checkpoints/``; return them."""
    partial = [p for p in _written(run_dir) if p.name.endswith(".tmp")]
    partial += sorted(p for p in run_dir.iterdir() if PARTIAL_WRITES.fullmatch(p.name))
    for path in partial:
        _remove(path)
    return partial
