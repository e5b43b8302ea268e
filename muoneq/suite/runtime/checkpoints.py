"""Checkpoint files a run can trust: written whole, checked before a resume, old ones pruned.

* **Written whole.** :class:`ChecksummedCheckpointIO` writes each checkpoint to a temporary file
  in its own folder and renames it into place (atomic on every file system; Lightning's writer
  stages it under ``$TMPDIR`` and moves it, a copy when that is another file system), and
  removes the temporary file when the write fails.
* **Checked.** Beside every checkpoint ``X`` it writes ``X.sha256`` (``sha256sum`` format, so
  ``cd checkpoints && sha256sum -c X.sha256`` checks it by hand) with the SHA-256 of the bytes
  written, computed while writing. :func:`resume_point` verifies them before a resume: a
  checkpoint whose bytes differ (a flipped byte, a file cut short) is *damaged*; it is named,
  kept as ``X.damaged`` (never deleted) and the previous intact one is used. A checkpoint
  without ``X.sha256`` (written before this check existed) is checked with the CRC-32 that
  ``torch.save`` records for every record of its zip archive (a distributed FSDP2 checkpoint,
  a folder, by its ``.metadata``, written last).
* **Pruned.** :class:`LastCheckpoint` deletes every older ``last-step<N>.ckpt`` once a newer
  one is complete, those of earlier sessions included, so a run keeps one resume point.
* **Stamped.** :class:`RunStamp` writes into every checkpoint the run it belongs to (the
  fingerprint of its ``config.yaml``), the step it holds and the data it trained on (the task's
  :meth:`~muoneq.suite.runtime.TaskDataModule.data_identity`, e.g. the language task's shard
  names and sizes); :func:`read_stamp` reads them back before a resume, so that a checkpoint of
  another run, one renamed to another step, or data changed since it was saved are refused
  (:func:`muoneq.suite.runtime.run.train`) instead of resumed from. A checkpoint without a stamp
  (a run started by a version that stamped none) is checked for what it holds
  (:func:`unstamped_mismatch`: its step, weights' shapes and optimizer's hyper-parameters).

torch's own integrity data is not enough alone: ``torch.load`` does not check the CRC-32s, so a
flipped byte in a tensor loads without a word; a SHA-256 is recorded here because no Lightning
or torch writer records one.
"""

from __future__ import annotations

import hashlib
import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from muoneq.suite.errors import UserError
from muoneq.suite.files import NO_ACCESS, atomic_open, reporting_full_disk, temporary_path
from muoneq.suite.runtime.written import Written

#: Files of a run folder's ``checkpoints/``.
CHECKPOINT_DIR = "checkpoints"
LAST_PREFIX = "last-step"
#: ``best.ckpt``: the weights with the best ``monitor`` value of the run.
BEST_NAME = "best"
CHECKSUM_SUFFIX = ".sha256"
DAMAGED_SUFFIX = ".damaged"
_LAST = re.compile(re.escape(LAST_PREFIX) + r"(\d+)\.ckpt")
#: A line of a ``.sha256`` file (``sha256sum``'s format: text mode ``<hash>  <name>``, binary
#: mode ``<hash> *<name>``, as ``sha256sum -b`` writes it).
_SUM_LINE = re.compile(r"([0-9a-f]{64}) [ *](\S.*)")


#: What a run stopped by a full disk says to do once there is room.
FULL_DISK_THEN = "then continue the run with resume=auto"
#: The key of a checkpoint holding its :class:`RunStamp`.
STAMP_KEY = "muoneq_run"
#: The file of a distributed checkpoint (a folder) that holds everything but the tensors
#: (Lightning's ``ModelParallelStrategy``).
_FOLDER_METADATA = "meta.pt"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded (the message names the file)."""


def step_of(path: Path) -> int | None:
    """The step a ``last-step<N>.ckpt`` name says (None for another name)."""
    match = _LAST.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_checksums(checkpoint: Path, sums: dict[str, str]) -> None:
    """``checkpoint.sha256``: one ``<sha256>  <path relative to the checkpoints folder>`` line
    per file, written durably (on the disk, then renamed into place: a power cut leaves the old
    file or the new one, never an empty one)."""
    with atomic_open(checksum_path(checkpoint), fsync=True) as f:
        f.write("".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items())))


def _listed(checkpoint: Path, sums: Path) -> dict[str, str] | str:
    """The files ``sums`` lists for ``checkpoint`` (name → SHA-256), or why it cannot be
    trusted: every line ``<64 hex digits>  <name>``, at least one, each name the checkpoint
    itself (a file) or inside it (a folder)."""
    text = sums.read_text(errors="replace")
    listed = {}
    for line in text.splitlines():
        match = _SUM_LINE.fullmatch(line)
        if match is None:
            return f"its checksum file {sums.name} is malformed (a write cut short or edited)"
        listed[match.group(2)] = match.group(1)
    if not listed:
        return f"its checksum file {sums.name} is empty (a write cut short)"
    inside = (checkpoint.name,) if not checkpoint.is_dir() else ()
    for name in listed:
        if name not in inside and not name.startswith(f"{checkpoint.name}/"):
            return f"its checksum file {sums.name} lists {name}, not a file of {checkpoint.name}"
    return listed


def record_folder_checksums(checkpoint: Path) -> None:
    """The checksums of a distributed checkpoint (a folder of files), once it is complete."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    _write_checksums(checkpoint, {str(p.relative_to(checkpoint.parent)): _sha256(p)
                                  for p in files})


def damage(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be trusted, or None when it is intact (see the module
    docstring for what is checked)."""
    sums = checksum_path(checkpoint)
    if not checkpoint.exists():
        return "it is missing"
    if sums.is_file():
        listed = _listed(checkpoint, sums)
        if isinstance(listed, str):
            return listed
        for name, digest in listed.items():
            part = checkpoint.parent / name
            if not part.is_file():
                return f"{name} is missing"
            if _sha256(part) != digest:
                return f"the SHA-256 of {name} differs from the one in {sums.name}"
        if checkpoint.is_dir() and not (checkpoint / ".metadata").is_file():
            return "its .metadata is missing"
        return None
    if checkpoint.is_dir():
        return None if (checkpoint / ".metadata").is_file() else "it was not written to the end"
    try:
        with zipfile.ZipFile(checkpoint) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        if isinstance(err, OSError) and err.errno in NO_ACCESS:
            raise  # unreadable is not damaged: said by the command (no_access)
        return "it is not a complete checkpoint (cut short or overwritten)"
    return None if bad is None else f"the CRC-32 of its record {bad} does not match"


class RunStamp(L.Callback):
    """Writes ``{"fingerprint", "step", "data"}`` under :data:`STAMP_KEY` into every checkpoint
    of the run: the run's fingerprint (its ``config.yaml``'s), the global step and the identity
    of its data (None: the task does not say)."""

    def __init__(self, fingerprint: str, data: dict | None) -> None:
        self.fingerprint, self.data = fingerprint, data

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[STAMP_KEY] = {"fingerprint": self.fingerprint, "step": trainer.global_step,
                                 "data": self.data}


def read_checkpoint(checkpoint: Path) -> dict:
    """What a checkpoint holds, its tensors not loaded (memory-mapped; a distributed checkpoint,
    a folder: its metadata). Read as Lightning reads it to resume right after
    (``weights_only=False``: a checkpoint whose checksums were just verified, and may hold the
    hyper-parameters Lightning saves)."""
    path = checkpoint / _FOLDER_METADATA if checkpoint.is_dir() else checkpoint
    try:
        saved = torch.load(path, map_location="cpu", mmap=not checkpoint.is_dir(),
                           weights_only=False)
    except Exception as err:
        if isinstance(err, OSError) and err.errno in NO_ACCESS:
            raise  # unreadable: said by the command (no_access)
        raise CheckpointError(
            f"{checkpoint} cannot be read ({type(err).__name__}): it is damaged or not a "
            "checkpoint of muoneq train; move it out of the checkpoints folder to resume from "
            "the previous one, or start the run again in another folder") from None
    return saved if isinstance(saved, dict) else {}


def read_stamp(saved: dict) -> tuple[int | None, dict | None]:
    """The global step a checkpoint holds and its :class:`RunStamp` (None for a checkpoint
    written before stamps), from what :func:`read_checkpoint` read."""
    stamp = saved.get(STAMP_KEY)
    return saved.get("global_step"), stamp if isinstance(stamp, dict) else None


def _plain(value: Any) -> Any:
    """A saved hyper-parameter as comparable data: a tensor as its number(s), a tuple as a
    list."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def unstamped_mismatch(saved: dict, module: torch.nn.Module, groups: Sequence[dict], *,
                       max_steps: int, max_epochs: int, resumed: Sequence[str]) -> str | None:
    """Why a checkpoint without a :class:`RunStamp` (``saved``: :func:`read_checkpoint`) cannot
    be this run's, from what can be checked without one, or None when nothing says so: the step
    and epoch it holds against the run's budget (``max_steps``, ``max_epochs``; -1: none) and
    against the checkpoints its earlier sessions resumed from (``resumed``, their names: each
    prunes the older ones once it saves, so a checkpoint before the last of them is not the
    run's), its weights' names and shapes against ``module``'s, and its optimizer's param groups
    (their sizes, and every hyper-parameter; the lr as the schedule's peak, ``initial_lr``)
    against ``groups``, those of an optimizer built from this run's config (a key an older
    version did not save is not compared). A distributed checkpoint (a folder) is checked by its
    step and epoch only."""
    step, epoch = saved.get("global_step"), saved.get("epoch")
    if isinstance(step, int) and 0 < max_steps < step:
        return f"it holds step {step}, past this run's trainer.max_steps={max_steps}"
    if isinstance(epoch, int) and 0 < max_epochs < epoch:
        return f"it holds epoch {epoch}, past this run's trainer.max_epochs={max_epochs}"
    earlier = max((s for s in map(step_of, resumed) if s is not None), default=None)
    if isinstance(step, int) and earlier is not None and step < earlier:
        return (f"it holds step {step}, before step {earlier}, which this run already resumed "
                "from (its config.yaml)")
    weights = saved.get("state_dict")
    if isinstance(weights, dict):
        own = module.state_dict()
        for name in [*own, *(k for k in weights if k not in own)]:  # the model's order
            if name not in weights or name not in own:
                has, lacks = ("this run's model", "it") if name in own else (
                    "it", "this run's model")
                return f"{has} holds the weight {name}, which {lacks} lacks"
            if tuple(own[name].shape) != tuple(weights[name].shape):
                return (f"its weight {name} has the shape {list(weights[name].shape)}, where "
                        f"this run's model has {list(own[name].shape)}")
    states = saved.get("optimizer_states")
    kept = states[0].get("param_groups") if isinstance(states, list) and states and isinstance(
        states[0], dict) else None
    if not isinstance(kept, list):
        return None
    sizes = [len(g["params"]) for g in kept], [len(g["params"]) for g in groups]
    if sizes[0] != sizes[1]:
        return (f"its optimizer's param groups hold {sizes[0]} parameters, where this run's "
                f"config gives {sizes[1]}")
    for i, (theirs, mine) in enumerate(zip(kept, groups, strict=True)):
        for key, value in mine.items():
            saved_key = "initial_lr" if key == "lr" and "initial_lr" in theirs else key
            if key == "params" or saved_key not in theirs:
                continue
            if _plain(theirs[saved_key]) != _plain(value):
                return (f"its optimizer's param group {mine.get('name', i)!r} was saved with "
                        f"{key}={_plain(theirs[saved_key])!r}, where this run's config gives "
                        f"{_plain(value)!r}")
    return None


def data_changes(before: dict | None, now: dict | None) -> list[str]:
    """What changed between two data identities (:class:`RunStamp`), one line each: a list of
    ``[name, size]`` pairs (files) compared file by file, any other value as a whole; nothing
    when either is unknown (None)."""
    if before is None or now is None:
        return []
    lines = []
    for key in sorted(before.keys() | now.keys()):
        old, new = before.get(key), now.get(key)
        if old == new:
            continue
        if _files(old) and _files(new):
            was, is_ = dict(map(tuple, old)), dict(map(tuple, new))
            lines += [f"{key}: {name} removed" if name not in is_ else
                      f"{key}: {name} added ({is_[name]} bytes)" if name not in was else
                      f"{key}: {name} {was[name]} → {is_[name]} bytes"
                      for name in sorted(was.keys() | is_.keys())
                      if was.get(name) != is_.get(name)] or [f"{key}: the files' order changed"]
        else:
            lines.append(f"{key}: {_short(old)} → {_short(new)}")
    return lines


def _short(value) -> str:
    """A value for a message: a long text (a hash) by its first 12 characters."""
    return f"{value[:12]}…" if isinstance(value, str) and len(value) > 16 else str(value)


def _files(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) for item in value)


def last_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``last-step<N>.ckpt`` of a run folder, newest first."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    found = [(int(m.group(1)), p) for p in folder.glob(f"{LAST_PREFIX}*.ckpt")
             if (m := _LAST.fullmatch(p.name))]
    return sorted(found, reverse=True)


def resume_point(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact ``last-step<N>.ckpt`` (or None) and the damaged ones newer than it,
    with why. Reads each candidate once, newest first, until one is intact."""
    damaged = []
    for _, path in last_checkpoints(run_dir):
        reason = damage(path)
        if reason is None:
            return path, damaged
        damaged.append((path, reason))
    return None, damaged


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint (and its checksums) to ``*.damaged``: kept for inspection,
    never resumed from, pruned or cleared."""
    kept = path.with_name(path.name + DAMAGED_SUFFIX)
    os.replace(path, kept)
    sums = checksum_path(path)
    if sums.exists():
        os.replace(sums, sums.with_name(sums.name + DAMAGED_SUFFIX))
    return kept


class _HashingWriter:
    """A binary file that also hashes what is written to it (``torch.save`` writes its zip
    archive front to back, so the digest is the file's), and keeps the first error of the file
    (:attr:`error`): torch's zip writer, cleaning up after it, tries to finish the archive and
    raises its own ``RuntimeError`` ("unexpected pos") in its place."""

    def __init__(self, file) -> None:
        self.file, self.digest = file, hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.digest.update(data)
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.file.flush()


class ChecksummedCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` writing in place with checksums, and reading with
    one-line errors (module docstring). With ``written`` (a run's list,
    :mod:`muoneq.suite.runtime.written`), every file it writes in the run's ``checkpoints/`` is
    listed there first."""

    def __init__(self, written: Written | None = None) -> None:
        super().__init__()
        self.written = written

    def record(self, path: Path) -> None:
        """List the checkpoint ``path`` (a file, or a distributed checkpoint's folder), its
        checksums and their temporary files in the run's list, when it goes to the run's
        ``checkpoints/``."""
        folder = None if self.written is None else self.written.run_dir / CHECKPOINT_DIR
        if folder is None or Path(path).parent.resolve() != folder.resolve():
            return
        sums = checksum_path(Path(path))
        self.written.record(CHECKPOINT_DIR, *(p.name for p in (
            path, temporary_path(path), sums, temporary_path(sums))))

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("storage_options are not supported by ChecksummedCheckpointIO")
        path = Path(path)
        self.record(path)
        then = FULL_DISK_THEN
        with reporting_full_disk(path, then):
            path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb", fsync=True, then=then) as f:
            writer = _HashingWriter(f)
            try:
                torch.save(checkpoint, writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None  # a full disk, said as one (atomic_open)
            # the checksums first: a checkpoint never exists without them
            _write_checksums(path, {path.name: writer.digest.hexdigest()})

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        try:
            return super().load_checkpoint(path, map_location=map_location,
                                           weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as err:  # torch's text advises weights_only=False: not for a damaged file
            raise CheckpointError(
                f"{path} cannot be loaded ({type(err).__name__}): it is damaged or not a "
                "checkpoint of this run; move it out of the checkpoints folder to resume from "
                "the previous one, or start the run again in another folder") from None

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        checksum_path(Path(path)).unlink(missing_ok=True)


class BestCheckpoint(ModelCheckpoint):
    """``best.ckpt``: Lightning's ``ModelCheckpoint`` on the run's ``monitor``, the one best
    checkpoint; ``write=False`` (``trainer.save_best=false``) keeps every bit of its bookkeeping
    (the best score, what a resumed run restores) and writes no file. A ``best.ckpt`` that an
    earlier session of the run wrote (``written``: the run's list) is removed, with a note, as
    soon as a better validation comes in such a session: the file would name weights that are
    no longer the best."""

    def __init__(self, dirpath: Path, monitor: str, mode: str, write: bool = True,
                 written: Written | None = None) -> None:
        super().__init__(
            dirpath=dirpath, filename=BEST_NAME, monitor=monitor, mode=mode, save_top_k=1,
            auto_insert_metric_name=False, save_on_train_epoch_end=False,
            enable_version_counter=False,
        )
        self.write, self.written = write, written

    @property
    def state_key(self) -> str:
        """The key ``ModelCheckpoint`` saves its state under (Lightning prefixes the class name):
        a run checkpointed before this class existed resumes with its best score."""
        return ModelCheckpoint.__qualname__ + super().state_key.removeprefix(
            type(self).__qualname__)

    def save_best(self, trainer, filepath: str) -> None:
        """Save (or, with ``write=False``, record) the current weights as the best."""
        self._save_checkpoint(trainer, filepath)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if self.write:
            super()._save_checkpoint(trainer, filepath)
            return
        # what ModelCheckpoint records after a save, without the file
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        path = Path(filepath)
        stale = trainer.is_global_zero and path.exists() and (
            self.written is None or self.written.wrote(CHECKPOINT_DIR, path.name))
        if trainer.strategy.broadcast(stale):
            trainer.strategy.remove_checkpoint(path)
            if trainer.is_global_zero:
                print(f"muoneq: note: {path} removed: it held an earlier best of the run, and "
                      f"{self.monitor} is better at step {trainer.global_step}, which "
                      "trainer.save_best=false does not save")


class LastCheckpoint(ModelCheckpoint):
    """The run's resume point, ``last-step<N>.ckpt``: Lightning's ``ModelCheckpoint`` without a
    monitor that, once a new one is complete, prunes every older one (earlier sessions'
    included). :meth:`save_now` saves one at the current step (an interruption)."""

    def __init__(self, dirpath: Path, every_n_train_steps: int | None) -> None:
        super().__init__(
            dirpath=dirpath, filename=LAST_PREFIX + "{step:09d}", auto_insert_metric_name=False,
            monitor=None, save_top_k=1, every_n_train_steps=every_n_train_steps,
            save_on_train_epoch_end=None if every_n_train_steps else True,
            enable_version_counter=False,
        )

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        step = int(_LAST.fullmatch(Path(filepath).name).group(1))
        for older, path in last_checkpoints(Path(filepath).parents[1]):
            if older < step:
                trainer.strategy.remove_checkpoint(path)

    def save_now(self, trainer) -> Path:
        """Save ``last-step<N>.ckpt`` for the current step (unless it is saved already)."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_none_monitor_checkpoint(trainer, self._monitor_candidates(trainer))
        return Path(self.dirpath) / f"{LAST_PREFIX}{trainer.global_step:09d}{self.FILE_EXTENSION}"
