"""The Lightning ``Trainer`` of every run, built from the ``trainer`` config (task-agnostic).

Accelerators: ``cpu``, ``cuda`` (alias ``gpu``), ``npu`` (Ascend, see
:mod:`muoneq.suite.runtime.accelerators`), ``mps``, ``auto``. Strategies:

* ``single``: one device;
* ``ddp``: ``DDPStrategy`` (NCCL on CUDA, gloo on CPU, HCCL on NPU);
* ``fsdp2``: ``ModelParallelStrategy`` with a 1-D data-parallel mesh over all processes; the
  module shards itself with ``fully_shard`` in ``configure_model``
  (:class:`~muoneq.suite.runtime.TaskModule`);
* ``auto``: Lightning's choice (one device → single, several → DDP).

Multi-node runs need nothing more than ``trainer.num_nodes``: Lightning detects torchrun
(``TorchElasticEnvironment``), SLURM and other launchers from their environment variables.
"""

from __future__ import annotations

import logging
import secrets
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from muoneq.suite.files import reporting_full_disk
from muoneq.suite.runtime.accelerators import NPU_BACKEND, NPUAccelerator, torch_npu
from muoneq.suite.runtime.callbacks import (
    Divergence,
    Interruption,
    LastValidation,
    LogLines,
    StepLearningRate,
    StepStats,
)
from muoneq.suite.runtime.checkpoints import (
    CHECKPOINT_DIR,
    FULL_DISK_THEN,
    BestCheckpoint,
    ChecksummedCheckpointIO,
    LastCheckpoint,
    record_folder_checksums,
)
from muoneq.suite.runtime.config import (
    SUITE_TRAINER_KEYS,
    AcceleratorName,
    ConfigError,
    ProgressMode,
    StrategyName,
)
from muoneq.suite.runtime.metrics import TENSORBOARD_DIR
from muoneq.suite.runtime.optim import check_ns_backend
from muoneq.suite.runtime.written import Written

# Lightning advertises a hosted logger on every Trainer construction; runs log to TensorBoard.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
    lambda record: not str(record.msg).startswith("💡 Tip")
)

def _single_device(devices: int | str) -> bool:
    """Whether Lightning's ``devices`` flag names exactly one device (1, "1", "0,", "3,")."""
    if isinstance(devices, int):
        return devices == 1
    if "," in devices:
        return len([d for d in devices.split(",") if d.strip()]) == 1
    return devices.strip() == "1"


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` as pure FSDP2: one data-parallel mesh dimension over every
    process (Lightning's ``"auto"`` sizes would make it ``num_nodes`` × tensor parallel)."""

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1
        super().setup_environment()

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """A distributed checkpoint (a folder) gets its checksums once every rank's file and
        the metadata are written (:mod:`muoneq.suite.runtime.checkpoints`)."""
        path = Path(filepath)
        if self.global_rank == 0 and isinstance(self.checkpoint_io, ChecksummedCheckpointIO):
            self.checkpoint_io.record(path)  # listed before it is written (every rank writes)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self._save_distributed_checkpoint:
            self.barrier("checksums")
            if self.global_rank == 0:
                record_folder_checksums(path)


class GlobalStepLogger(TensorBoardLogger):
    """TensorBoard at the run's global step: the number of optimizer steps done, as the console
    lines, ``metrics.json`` and the reports count. A value belongs to the step that produced or
    used it: the training loss and the lr of the k-th optimizer step are logged at k, a
    validation after k steps at k. While fitting, Lightning passes the index of the batch that
    steps (k − 1, ``_batches_that_stepped``), and after fitting (``validate``, ``test``) the
    global step itself; this logger adds the one while the fit loop runs.

    Its event files end in a suffix of this session's own (:attr:`events`: their names, for the
    run's list of what it wrote, :mod:`muoneq.suite.runtime.written`), and a full disk while it
    creates or writes them names its folder (:class:`~muoneq.suite.errors.DiskFull`)."""

    def __init__(self, *args, **kwargs):
        self.session = secrets.token_hex(4)
        super().__init__(*args, filename_suffix=f".{self.session}", **kwargs)
        self.trainer: L.Trainer | None = None

    @property
    def events(self) -> str:
        """The names of this session's event files (a pattern: the writer picks the rest)."""
        return f"events.out.tfevents.*.{self.session}"

    @property
    def experiment(self):
        with reporting_full_disk(self.log_dir, FULL_DISK_THEN):
            return super().experiment

    @rank_zero_only
    def log_metrics(self, metrics, step=None) -> None:
        t = self.trainer
        fitting = t is not None and t.state.fn == TrainerFn.FITTING and (
            t.state.status == TrainerStatus.RUNNING)
        with reporting_full_disk(self.log_dir, FULL_DISK_THEN):
            super().log_metrics(metrics, step + 1 if fitting and step is not None else step)


def lightning_config_error(err: Exception, fix: str) -> ConfigError:
    """Lightning's error for settings it rejects, as one line: its first line, then ``fix``."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ConfigError(f"trainer: {first.rstrip('.')}; {fix}")


def check_accelerator(t: DictConfig) -> None:
    """A clear error for an accelerator this machine does not have (before Lightning's)."""
    if t.accelerator is AcceleratorName.npu:
        try:
            torch_npu()
        except RuntimeError as err:
            raise ConfigError(str(err)) from None
    elif t.accelerator in (AcceleratorName.cuda, AcceleratorName.gpu) and (
            not torch.cuda.is_available()):
        raise ConfigError(
            f"trainer.accelerator={t.accelerator.value}: this machine has no usable CUDA GPU "
            "(torch.cuda.is_available() is False); run on a GPU machine, or use trainer=cpu "
            "(or trainer.accelerator=auto)")
    elif t.accelerator is AcceleratorName.mps and not torch.backends.mps.is_available():
        raise ConfigError("trainer.accelerator=mps: this machine has no Apple GPU; use "
                          "trainer=cpu (or trainer.accelerator=auto)")


def build_strategy(t: DictConfig):
    """The strategy object (or Lightning name) for ``trainer.strategy`` on its accelerator."""
    npu = t.accelerator is AcceleratorName.npu
    backend = NPU_BACKEND if npu else None
    if t.strategy is StrategyName.ddp:
        return DDPStrategy(process_group_backend=backend)
    if t.strategy is StrategyName.fsdp2:
        return FSDP2Strategy(process_group_backend=backend)
    if t.strategy is StrategyName.single:
        if t.num_nodes != 1 or not (t.devices == "auto" or _single_device(t.devices)):
            raise ConfigError(
                f"trainer.strategy=single runs on one device, got trainer.devices={t.devices} "
                f"trainer.num_nodes={t.num_nodes}; use trainer.strategy=ddp or fsdp2 for several"
            )
        return "auto"
    if npu and (t.num_nodes > 1 or not _single_device(t.devices)):
        return DDPStrategy(process_group_backend=backend)  # Lightning would pick gloo
    return "auto"


#: The ``trainer`` keys :func:`build_trainer` translates before Lightning sees them.
TRANSLATED_KEYS = ("accelerator", "devices", "strategy", "precision", "limit_val_batches")


def trainer_arguments(t: DictConfig) -> dict:
    """The ``trainer`` settings passed to ``lightning.Trainer`` as they are: every key but the
    suite's own (:data:`~muoneq.suite.runtime.config.SUITE_TRAINER_KEYS`) and those
    :func:`build_trainer` translates (:data:`TRANSLATED_KEYS`)."""
    return {key: t[key] for key in t if key not in (*SUITE_TRAINER_KEYS, *TRANSLATED_KEYS)}


def build_trainer(
    cfg: DictConfig, run_dir: Path, *, monitor: str, monitor_mode: str, callbacks=(),
) -> L.Trainer:
    """A ``Trainer`` writing TensorBoard logs and checkpoints under ``run_dir``.

    Checkpoints (``run_dir/checkpoints``, each with its SHA-256, see
    :mod:`muoneq.suite.runtime.checkpoints`): ``last-step<N>.ckpt`` at the end of every epoch, or
    every ``trainer.checkpoint_every_n_steps`` steps, and when SIGINT/SIGTERM stops the run
    (:class:`~muoneq.suite.runtime.callbacks.Interruption`), the older ones deleted only after the
    new one is complete; ``best.ckpt`` on the best ``monitor`` value after a validation (and
    after the final one :func:`muoneq.suite.runtime.train` adds), unless ``trainer.save_best`` is
    false (the best value is still tracked). ``monitor=None``: the task has no
    validation set (e.g. CIFAR-10 without ``task.data.val_size``); no validation runs and no
    ``best.ckpt`` is kept. A NaN/inf loss or validation metric stops the run
    (:class:`~muoneq.suite.runtime.callbacks.Divergence`). Settings Lightning rejects (e.g. more
    devices than the machine has), and an ``optimizer.ns_backend`` the run's device cannot run
    (:func:`~muoneq.suite.runtime.optim.check_ns_backend`), raise :class:`ConfigError`.
    """
    t = cfg.trainer
    check_accelerator(t)
    accelerator = NPUAccelerator() if t.accelerator is AcceleratorName.npu else (
        "cuda" if t.accelerator is AcceleratorName.gpu else t.accelerator.value
    )
    precision, plugins = t.precision, []
    if t.accelerator is AcceleratorName.npu and precision.endswith("-mixed"):
        precision, plugins = None, [MixedPrecision(t.precision, device="npu")]
    devices = 1 if t.strategy is StrategyName.single and t.devices == "auto" else t.devices

    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    last = LastCheckpoint(ckpt_dir, t.checkpoint_every_n_steps)
    written = Written(run_dir)
    best = [] if monitor is None else [BestCheckpoint(ckpt_dir, monitor, monitor_mode,
                                                      write=t.save_best, written=written)]
    progress = t.progress
    if progress is ProgressMode.auto:
        progress = ProgressMode.bar if sys.stdout.isatty() else ProgressMode.log
    extra = [TQDMProgressBar()] if progress is ProgressMode.bar else []
    if progress is ProgressMode.log:
        extra.append(LogLines(t.log_every_n_steps))
    if t.divergence_patience is not None:
        extra.append(Divergence(t.divergence_patience, monitor))

    logger = GlobalStepLogger(save_dir=run_dir, name=TENSORBOARD_DIR, version="",
                              default_hp_metric=False)
    strategy = build_strategy(t)
    try:
        trainer = L.Trainer(
            **trainer_arguments(t),
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            precision=precision,
            plugins=[*plugins, ChecksummedCheckpointIO(written)],
            limit_val_batches=0 if monitor is None else t.limit_val_batches,
            default_root_dir=run_dir,
            logger=logger,
            callbacks=[
                last, *best, StepStats(), LastValidation(), StepLearningRate(),
                *extra, *callbacks, Interruption(last.save_now),
            ],
            enable_progress_bar=progress is ProgressMode.bar,
            # Tasks shard their own data (muoneq.suite.runtime.data), so resumed runs replay
            # exactly.
            use_distributed_sampler=False,
        )
        # what Lightning checks only when fit() launches, after the run folder is written:
        # the launcher's process counts (e.g. SLURM's --ntasks-per-node) against ours
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if environment is not None:
            environment.validate_settings(trainer.num_devices, trainer.num_nodes)
    except (MisconfigurationException, ValueError) as err:
        # e.g. more devices than this machine has, or trainer.devices ≠ SLURM's ntasks-per-node
        raise lightning_config_error(
            err, f"check trainer.accelerator ({t.accelerator.value}), trainer.devices "
                 f"({t.devices}), trainer.num_nodes ({t.num_nodes}) and trainer.strategy "
                 f"({t.strategy.value}) against this machine") from None
    try:  # the device is known once the strategy is
        check_ns_backend(cfg.optimizer, trainer.strategy.root_device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    logger.trainer = trainer
    return trainer
