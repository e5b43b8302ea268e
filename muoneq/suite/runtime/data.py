"""Data-module base class: per-rank sharding done by the task, and exact mid-epoch resume.

The trainer factory sets ``use_distributed_sampler=False``: each task shards its own data by
``(rank, world_size)`` (the language tasks need that for their token streams anyway). For
map-style datasets :class:`ResumableSampler` does it, with the order a function of
``(seed, epoch)`` only, so a run restarted from a mid-epoch checkpoint sees exactly the batches
an uninterrupted run would have seen.

How the resume position is kept: at every checkpoint Lightning stores
``TaskDataModule.state_dict()`` — the epoch and the number of batches already processed in it,
read from the trainer's loop progress. On restart, :meth:`TaskDataModule.resume_position` gives
the epoch Lightning is about to run (``epoch_progress.current.processed``, the value Lightning
passes to ``set_epoch``) and how many of its batches to skip (those of the saved position, if it
is the same epoch). This works for any number of loader workers, which a loader that counts its
own batches cannot do: Lightning fetches one batch ahead of the step it is running.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
import warnings
from collections.abc import Iterator

import lightning as L
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import Sampler

# Mid-epoch resume is handled by TaskDataModule (see the module docstring), not by a stateful
# loader, which is what this Lightning warning looks for.
warnings.filterwarnings(
    "ignore", message=r".*resuming from a checkpoint that ended before the epoch ended.*"
)


#: Seconds a loader worker keeps serving after SIGINT/SIGTERM reached it (:func:`worker_init`).
WORKER_GRACE_S = 60.0


def _exit_later(signum, frame) -> None:
    timer = threading.Timer(WORKER_GRACE_S, os._exit, (0,))
    timer.daemon = True
    timer.start()


def worker_init(worker_id: int, *, rank: int) -> None:
    """The start of a loader worker process. SIGINT and SIGTERM reach the workers too (a
    terminal's Ctrl-C, SLURM's SIGTERM to every process of a job): a worker keeps serving
    batches, so that the main process can finish its step and save it
    (:class:`~muoneq.suite.runtime.callbacks.Interruption`) and then shut the workers down; one left
    behind exits after :data:`WORKER_GRACE_S`. Then Lightning's seeding of workers, which it adds
    only to loaders without a ``worker_init_fn`` of their own."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_later)
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank=rank)


class ResumableSampler(Sampler[int]):
    """Indices of one rank for one epoch: a seeded permutation, sharded, optionally skipped.

    Like ``DistributedSampler(drop_last=False)``: the permutation of ``range(size)`` (seeded by
    ``seed + epoch``; identity without ``shuffle``) is padded by wrapping around to a multiple of
    ``num_replicas`` and rank ``r`` takes positions ``r, r + R, ...``. ``skip`` leading indices
    of epoch ``skip_epoch`` are left out (a run resumed mid-epoch); ``len()`` stays the full
    per-rank length, as Lightning counts the resumed epoch's batches from the saved position.
    """

    def __init__(
        self, size: int, *, seed: int, shuffle: bool = True, num_replicas: int = 1, rank: int = 0,
        epoch: int = 0, skip: int = 0,
    ):
        if size < 1:
            raise ValueError(f"ResumableSampler: size must be ≥ 1, got {size}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler: rank {rank} outside [0, {num_replicas})")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = epoch
        self.skip_epoch, self.skip = epoch, skip

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.size / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        total = len(self) * self.num_replicas
        if total > self.size:
            order = torch.cat([order, order[: total - self.size]])
        mine = order[self.rank :: self.num_replicas]
        if self.epoch == self.skip_epoch and self.skip:
            mine = mine[self.skip :]
        return iter(mine.tolist())


class TaskDataModule(L.LightningDataModule):
    """Base of every task's data module: rank/world helpers and the resume position."""

    def __init__(self) -> None:
        super().__init__()
        self._saved_position: tuple[int, int] | None = None

    # ------------------------------------------------------------------ distribution
    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def data_identity(self) -> dict | None:
        """What identifies the data this run trains and validates on, as plain JSON data (e.g.
        file names and sizes), or None when the task does not say. Every checkpoint records it
        (:class:`~muoneq.suite.runtime.checkpoints.RunStamp`) and a resume whose data changed is
        refused (``run.accept_changed_data=true`` continues on the new data knowingly). Called
        before ``setup``, on every process."""
        return None

    def worker_init_fn(self):
        """The ``worker_init_fn`` of this process's loaders (:func:`worker_init`)."""
        return functools.partial(worker_init, rank=self.rank)

    def per_rank(self, global_batch_size: int, what: str = "task.data.batch_size") -> int:
        """The per-rank share of a global batch size (which must divide evenly)."""
        if global_batch_size % self.world_size:
            raise ValueError(
                f"{what}={global_batch_size} is the global batch; it must be divisible by the "
                f"number of processes ({self.world_size})"
            )
        return global_batch_size // self.world_size

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        trainer = self.trainer
        if trainer is None:
            return {}
        # ``ready - 1`` is the epoch whose batches ``batch_progress.current`` counts, also at an
        # end-of-epoch checkpoint (where ``epoch_progress.current.processed`` is already +1).
        epoch = trainer.fit_loop.epoch_progress.current.ready - 1
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": epoch, "batches": batches}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            self._saved_position = (int(state_dict["epoch"]), int(state_dict["batches"]))

    def resume_position(self) -> tuple[int, int]:
        """``(epoch, batches to skip)`` for the training loader being built now."""
        trainer = self.trainer
        epoch = trainer.fit_loop.epoch_progress.current.processed if trainer is not None else 0
        if self._saved_position is not None and self._saved_position[0] == epoch:
            return epoch, self._saved_position[1]
        return epoch, 0

    def train_sampler(self, size: int, *, batch_size: int, seed: int) -> ResumableSampler:
        """A shuffled, sharded :class:`ResumableSampler` positioned where training resumes."""
        epoch, skip_batches = self.resume_position()
        return ResumableSampler(
            size, seed=seed, num_replicas=self.world_size, rank=self.rank, epoch=epoch,
            skip=skip_batches * batch_size,
        )

    def eval_indices(self, size: int) -> range:
        """This rank's share of an evaluation set, without padding (metrics stay exact)."""
        return range(self.rank, size, self.world_size)
