"""The schema of a run config: the sections the suite types itself (``schedule``, ``trainer``,
``spectra``, ``run``) and :class:`RunConfig`, the whole. ``task`` and ``optimizer`` are typed when
the config is composed, by the task's own dataclass and the optimizer's constructor
(:mod:`muoneq.suite.runtime.config.composition`). Value checks beyond types are the dataclasses'
``__post_init__``: each raises one ``ValueError`` naming the key and the allowed values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from muoneq.suite.runtime.schedule import ScheduleInterval, ScheduleName

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


class AcceleratorName(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    gpu = "gpu"
    npu = "npu"
    mps = "mps"


class StrategyName(Enum):
    auto = "auto"
    single = "single"
    ddp = "ddp"
    fsdp2 = "fsdp2"


class ProgressMode(Enum):
    auto = "auto"  # a bar on a terminal, plain log lines otherwise
    bar = "bar"
    log = "log"
    quiet = "quiet"


class Resume(Enum):
    never = "never"  # refuse a run folder that already holds checkpoints or metrics
    auto = "auto"  # continue from the newest complete checkpoint of the run folder, if any


@dataclass
class ScheduleConfig:
    """Learning-rate schedule by optimizer step or epoch (see
    :mod:`muoneq.suite.runtime.schedule`)."""

    name: ScheduleName = ScheduleName.cosine
    #: ``step``: the lr changes every optimizer step; ``epoch``: once per epoch, and
    #: ``warmup_steps`` / ``total_steps`` count epochs.
    interval: ScheduleInterval = ScheduleInterval.step
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    #: Length of the whole schedule; ``None``: the trainer's budget (steps: max_steps or
    #: max_epochs × batches; epochs: max_epochs).
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps: must be ≥ 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"schedule.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"schedule.total_steps: must be ≥ 1 or null, got {self.total_steps}")


#: ``trainer`` keys that are not ``lightning.Trainer`` arguments: the suite acts on them itself.
SUITE_TRAINER_KEYS = ("compile", "checkpoint_every_n_steps", "save_best", "progress",
                      "divergence_patience")


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings (see :func:`muoneq.suite.runtime.build_trainer`).

    A field named like a ``lightning.Trainer`` argument is that argument, passed through as is
    (:func:`muoneq.suite.runtime.trainer.trainer_arguments`); the others
    (:data:`SUITE_TRAINER_KEYS`) are the suite's own. Adding a Lightning option is one field here.
    """

    accelerator: AcceleratorName = AcceleratorName.auto
    devices: int | str = "auto"
    num_nodes: int = 1
    strategy: StrategyName = StrategyName.auto
    precision: str = "32-true"
    max_epochs: int | None = None
    max_steps: int = -1
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int = 0
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    log_every_n_steps: int = 50
    deterministic: bool = False
    benchmark: bool | None = None
    #: ``torch.compile`` the network (the optimizer step stays eager): true, false, or ``auto``
    #: (compiled on CUDA, eager elsewhere: :func:`muoneq.suite.runtime.module.compiles`); the
    #: run's ``config.yaml`` records what ``auto`` became (``provenance.resolved.compile``).
    compile: bool | str = "auto"
    #: Save ``last`` every N optimizer steps; ``None``: at the end of every epoch.
    checkpoint_every_n_steps: int | None = None
    #: Write ``best.ckpt`` at each validation that improves on the run's best; ``false``: the
    #: best value is still tracked and recorded (``metrics.json``'s ``best``), no file written
    #: (a sweep's trials, which report their metrics; each write costs a checkpoint).
    save_best: bool = True
    progress: ProgressMode = ProgressMode.auto
    #: Optimizer steps (a non-finite loss in any micro-batch) or validations with a NaN/inf
    #: value in a row that a run tolerates before it stops as diverged
    #: (:class:`muoneq.suite.runtime.callbacks.Divergence`); 0: the first stops it; ``None``: never.
    divergence_patience: int | None = 0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"trainer.precision: unknown {self.precision!r}; allowed: {', '.join(PRECISIONS)}"
            )
        if isinstance(self.devices, str) and self.devices != "auto" and not re.fullmatch(
            r"\d+(,\d+)*,?|-1", self.devices
        ):
            raise ValueError(
                f"trainer.devices: {self.devices!r}; allowed: a count, 'auto', -1 or indices "
                "such as '0,2'"
            )
        if isinstance(self.compile, str) and self.compile != "auto":
            raise ValueError(f"trainer.compile: {self.compile!r}; allowed: true, false, auto")
        for key in ("num_nodes", "accumulate_grad_batches", "log_every_n_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key}: must be ≥ 1, got {getattr(self, key)}")
        if self.checkpoint_every_n_steps is not None and self.checkpoint_every_n_steps < 1:
            raise ValueError(
                f"trainer.checkpoint_every_n_steps: must be ≥ 1 or null, "
                f"got {self.checkpoint_every_n_steps}"
            )
        if self.divergence_patience is not None and self.divergence_patience < 0:
            raise ValueError(f"trainer.divergence_patience: must be ≥ 0 or null, "
                             f"got {self.divergence_patience}")
        self._check_budget()

    def _check_budget(self) -> None:
        """A run trains at least one step: a budget of zero steps would report the initial
        weights' metrics as a finished run's."""
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(
                f"trainer.max_steps={self.max_steps}: "
                + ("a run of zero steps trains nothing; " if self.max_steps == 0 else "")
                + "must be ≥ 1, or -1 to let trainer.max_epochs set the budget")
        if self.max_epochs == 0 or (self.max_epochs is not None and self.max_epochs < -1):
            raise ValueError(
                f"trainer.max_epochs={self.max_epochs}: a run of zero epochs trains nothing; "
                "must be ≥ 1, or null (or -1) to let trainer.max_steps set the budget")
        if self.limit_train_batches == 0:
            raise ValueError(
                f"trainer.limit_train_batches={self.limit_train_batches}: a run of zero "
                "batches per epoch trains nothing; must be > 0, or null for every batch")


@dataclass
class SpectraConfig:
    """Spectral diagnostics of the pre-NS momentum during training: the paper's Figures 2 and 7
    (:class:`muoneq.suite.spectra.SpectralMonitor`; CSV
    ``spectra.csv`` and TensorBoard ``spectra/*`` in the run's log folder)."""

    enabled: bool = False
    #: Module-name patterns (fnmatch) whose weights are measured, e.g. ``["*.mlp.*"]``.
    modules: list[str] = field(default_factory=lambda: ["*"])
    #: Fractions of the optimizer steps at which to measure (ignored when ``steps`` is set).
    fractions: list[float] = field(default_factory=lambda: [0.01, 0.1, 0.5, 1.0])
    steps: list[int] | None = None
    modes: list[str] = field(default_factory=lambda: ["none", "R", "C", "RC"])
    #: dtype of the measured Newton–Schulz iteration (float64: the exact error of Theorem 3.1).
    ns_dtype: str = "float64"
    log_figures: bool = True

    def __post_init__(self) -> None:
        if self.enabled:
            try:
                self.monitor()
            except ValueError as err:
                raise ValueError(f"spectra.{err}") from None

    def monitor(self):
        """The callback these settings describe."""
        from muoneq.suite.spectra import SpectralMonitor  # pulls in Lightning: only when enabled

        return SpectralMonitor(
            modules=list(self.modules), fractions=list(self.fractions),
            steps=None if self.steps is None else list(self.steps), modes=list(self.modes),
            ns_dtype=self.ns_dtype, log_figures=self.log_figures,
        )


#: The characters of a run name: one folder name, safe in any shell (never ``.`` or ``..``).
RUN_NAME = re.compile(r"[A-Za-z0-9_.=-]+")
#: The longest folder name file systems take (``NAME_MAX`` of Linux, macOS and Windows).
MAX_NAME_BYTES = 255
#: The seeds numpy accepts (``np.random.seed``, which Lightning's ``seed_everything`` calls).
SEED_RANGE = (0, 2**32 - 1)


@dataclass
class RunSection:
    #: Run name; default ``<experiment or task>-<optimizer>-seed<seed>``, followed, when the
    #: command line sets anything else that changes the result, by those settings (shortened)
    #: and a hash of their resolved values (:func:`default_run_name`). One folder name of
    #: :data:`RUN_NAME`'s characters, so ``<root>/<name>`` stays inside ``root``.
    name: str | None = None
    #: Run folder; default ``<root>/<name>``.
    dir: str | None = None
    root: str = "runs"
    #: Resume although the data changed since the checkpoint was saved (the task's
    #: ``data_identity``, e.g. shards added by ``muoneq data --tokens``): the rest of the run
    #: trains on the new data; the session is recorded in ``config.yaml``. Default: refuse.
    accept_changed_data: bool = False

    def __post_init__(self) -> None:
        if self.name is not None and (
                not RUN_NAME.fullmatch(self.name) or self.name in (".", "..")):
            raise ValueError(
                f"run.name={self.name!r}: a run name is one folder name of letters, digits and "
                "'-', '_', '.', '=' (not '.' or '..'), so that the run stays inside run.root; "
                "pass another run.name, or run.dir=<folder> to choose the folder itself")
        if self.name is not None and len(self.name.encode()) > MAX_NAME_BYTES:
            raise ValueError(
                f"run.name={self.name[:40]}…: {len(self.name.encode())} bytes, and a folder name "
                f"holds at most {MAX_NAME_BYTES}; pass a shorter run.name")


@dataclass
class RunConfig:
    """The whole config of one run. ``task`` and ``optimizer`` are typed at composition time."""

    seed: int = 0
    resume: Resume = Resume.never
    run: RunSection = field(default_factory=RunSection)
    task: Any = None
    optimizer: Any = None
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    spectra: SpectraConfig = field(default_factory=SpectraConfig)

    def __post_init__(self) -> None:
        check_seed(self.seed, "seed")


def check_seed(seed: int, key: str) -> None:
    """``ValueError`` naming ``key`` when ``seed`` is outside :data:`SEED_RANGE` (Lightning would
    replace it by 0 with a warning, and runs of two seeds would be one)."""
    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise ValueError(f"{key}={seed}: a seed must lie in [{low}, {high}] (numpy's range)")
