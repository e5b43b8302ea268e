"""Typed run configs composed from ``conf/`` and command-line overrides.

A run config has six sections (see :class:`RunConfig`): ``task`` (typed by the task's own
dataclass), ``optimizer`` (typed by :func:`~muoneq.suite.runtime.optim.optimizer_schema`),
``schedule``, ``trainer``, ``spectra`` and ``run``, plus ``seed`` and ``resume``.
:func:`compose` builds it from the command line, as in lightning-hydra-template::

    experiment=cifar10_resnet18 optimizer=muoneq_nes optimizer.lr=5e-2 trainer.devices=4 seed=1

``<group>=<file>`` (``experiment``, ``task``, ``optimizer``, ``trainer``) selects
``conf/<group>/<file>.yaml`` (or a path to a ``.yaml`` file); every other ``key=value`` is an
OmegaConf dotlist override. Precedence, lowest first: the dataclass defaults, the trainer, task
and optimizer files, the experiment file, the experiment's entry for the chosen optimizer
(``optimizers: {<optimizer>: {...}}``), the command line. An experiment chooses its default
groups with ``defaults: {task: ..., optimizer: ..., trainer: ...}``.

Unknown keys, wrong types and invalid values raise :class:`ConfigError` naming the key, the
file it came from and the allowed keys or values.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from muoneq.suite.errors import UserError
from muoneq.suite.folders import suite_folder
from muoneq.suite.runtime.optim import check_optimizer_config, optimizer_schema
from muoneq.suite.runtime.schedule import ScheduleInterval, ScheduleName
from muoneq.suite.runtime.tasks import task_config

GROUPS = ("experiment", "task", "optimizer", "trainer")
DEFAULT_CHOICES = {
    "experiment": None, "task": None, "optimizer": "muoneq_nes", "trainer": "default",
}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")

#: Keys (or sections, ending in ".") of a run config that cannot change what a run computes:
#: where it is written, how progress is shown, how often it logs and checkpoints (resume is
#: exact from any checkpoint), the loader's worker processes (every task's data order and
#: augmentation are functions of the seed, epoch and sample only) and whether data may be
#: downloaded. They are left out of a run's fingerprint (:mod:`muoneq.suite.runtime.record`) and of
#: its default folder name; every other key, the device layout included (``trainer.devices``,
#: ``trainer.num_nodes``, ``trainer.strategy``: they change the per-device batch, hence
#: BatchNorm statistics and the order of reductions), is part of what a run is.
NON_RESULT_KEYS = (
    "run.", "resume", "trainer.progress", "trainer.log_every_n_steps",
    "trainer.checkpoint_every_n_steps", "task.data.num_workers", "task.data.download",
)


def is_result_key(key: str) -> bool:
    """Whether the dotted config ``key`` can change what a run computes (see NON_RESULT_KEYS)."""
    return not any(key == k or (k.endswith(".") and key.startswith(k)) for k in NON_RESULT_KEYS)


class ConfigError(UserError, ValueError):
    """A config that cannot run; the message names the key and the allowed keys/values."""


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
SUITE_TRAINER_KEYS = ("compile", "checkpoint_every_n_steps", "progress", "divergence_patience")


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
    #: ``torch.compile`` the network (the optimizer step stays eager).
    compile: bool = False
    #: Save ``last`` every N optimizer steps; ``None``: at the end of every epoch.
    checkpoint_every_n_steps: int | None = None
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

    def __post_init__(self) -> None:
        if self.name is not None and (
                not RUN_NAME.fullmatch(self.name) or self.name in (".", "..")):
            raise ValueError(
                f"run.name={self.name!r}: a run name is one folder name of letters, digits and "
                "'-', '_', '.', '=' (not '.' or '..'), so that the run stays inside run.root; "
                "pass another run.name, or run.dir=<folder> to choose the folder itself")


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


# --------------------------------------------------------------------------- locating files
def conf_dir() -> Path:
    """``$MUONEQ_CONF_DIR`` if set (a config folder of one's own, used instead), else the
    suite's ``conf/`` (shipped with the package, or the checkout's: :mod:`muoneq.suite.folders`)."""
    if env := os.environ.get("MUONEQ_CONF_DIR"):
        return Path(env)
    return suite_folder("conf")


def group_file(group: str, choice: str, root: Path) -> Path:
    """``conf/<group>/<choice>.yaml``, or ``choice`` itself when it is a path to a YAML file."""
    if choice.endswith((".yaml", ".yml")):
        path = Path(choice)
    else:
        path = root / group / f"{choice}.yaml"
    if not root.is_dir():
        raise ConfigError(
            f"config folder {root} does not exist; point MUONEQ_CONF_DIR at a folder of configs "
            "(<group>/<name>.yaml), or unset it to use the configs muoneq ships"
        )
    if not path.is_file():
        known = sorted(p.stem for p in (root / group).glob("*.yaml"))
        hint = difflib.get_close_matches(choice, known, n=1)
        raise ConfigError(
            f"{group}={choice}: no such file {path}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f"; available: {', '.join(known) or '(none)'}"
        )
    return path


def _load_yaml(path: Path) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml syntax errors come in several types
        raise ConfigError(f"{path}: cannot parse YAML: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return loaded


# --------------------------------------------------------------------------- errors
def _allowed_keys(schema: DictConfig, full_key: str) -> list[str]:
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    node = OmegaConf.select(schema, parent) if parent else schema
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def _config_error(err: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    message = f"{source}: {key}: {first}"
    if "not in" in first or "Missing key" in first:
        allowed = _allowed_keys(schema, key)
        if allowed:
            message += f"; allowed keys: {', '.join(allowed)}"
    return ConfigError(message)


def _merge(cfg: DictConfig, update: dict | DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, update)
    except OmegaConfBaseException as err:
        raise _config_error(err, cfg, source) from None


# --------------------------------------------------------------------------- composition
def split_args(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Group selections (``optimizer=muoneq_nes``) and dotlist overrides (everything else)."""
    choices, overrides = {}, []
    for arg in args:
        if "=" not in arg:
            raise ConfigError(
                f"argument {arg!r}: expected key=value (a group such as optimizer=muoneq_nes, or "
                "an override such as optimizer.lr=0.05)"
            )
        key, value = arg.split("=", 1)
        if key in GROUPS:
            choices[key] = value
        else:
            overrides.append(arg)
    return choices, overrides


def resolved_value(cfg: DictConfig, key: str):
    """The plain, resolved value of a dotted key (enums as their names, containers as lists
    and dicts)."""
    wrapped = OmegaConf.create({"value": OmegaConf.select(cfg, key)})
    return OmegaConf.to_container(wrapped, resolve=True, enum_to_str=True)["value"]


def default_run_name(choices: dict, cfg: DictConfig, args: Sequence[str]) -> str:
    """``<experiment or task>-<optimizer>-seed<seed>``, then, for command-line settings that can
    change the result (group choices such as ``trainer=gpu`` and overrides, see
    :data:`NON_RESULT_KEYS`), a readable summary cut at 60 characters and an 8-digit hash of
    their resolved values (``optimizer.lr=5e-2`` and ``optimizer.lr=0.05`` are the same run).
    Only letters, digits and ``-_.=`` are used, so the name is safe in any shell and path."""
    base = Path(choices["experiment"] or choices["task"]).stem
    name = f"{base}-{Path(choices['optimizer']).stem}-seed{cfg.seed}"
    settings: dict[str, object] = {}
    for arg in args:
        key, value = arg.split("=", 1)
        if key in GROUPS:
            if key not in ("experiment", "optimizer"):
                settings[key] = Path(value).stem
        elif key != "seed" and is_result_key(key):
            settings[key] = resolved_value(cfg, key)
    if not settings:
        return name
    items = sorted(settings.items())
    digest = hashlib.sha256(json.dumps(items, default=str).encode()).hexdigest()[:8]
    readable = re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(
        f"{k}={json.dumps(v) if isinstance(v, list | dict) else v}" for k, v in items))
    readable = re.sub(r"_+", "_", readable)[:60].strip("_-")
    return f"{name}-{readable}-{digest}"


def compose(args: Sequence[str] = (), root: Path | None = None, *,
            cache: dict | None = None) -> DictConfig:
    """Compose, type-check and validate the run config described by ``args``.

    ``cache``: a dict kept by a caller that composes many configs in a row (a sweep validating
    its points); the layers below the command line are composed once per set of group choices.
    """
    root = Path(root) if root is not None else conf_dir()
    choices, overrides = split_args(args)
    key = (str(root), tuple(sorted(choices.items())))
    if cache is not None and key in cache:
        chosen, base = cache[key]
    else:
        chosen, base = _compose_files(choices, root)
        if cache is not None:
            cache[key] = chosen, base
    try:
        dotlist = OmegaConf.from_dotlist(overrides)
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"command line: a value is not valid YAML ({err}); quote lists of "
                          "strings, e.g. \"spectra.modules=['*conv*']\"") from None
    for name in ("task.name", "optimizer.name"):
        if OmegaConf.select(dotlist, name) is not None:
            group = name.split(".")[0]
            raise ConfigError(f"{name}: choose the {group} with {group}=<file> instead")
    cfg = _merge(base, dotlist, "command line")
    validate(cfg)
    if cfg.run.name is None:
        cfg.run.name = default_run_name(chosen, cfg, args)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _compose_files(choices: dict[str, str], root: Path) -> tuple[dict, DictConfig]:
    """The group choices in effect and the config of the files alone (every layer below the
    command line)."""
    chosen = dict(DEFAULT_CHOICES)
    experiment = None
    per_optimizer: dict = {}
    if choices.get("experiment"):
        path = group_file("experiment", choices["experiment"], root)
        experiment = _load_yaml(path)
        defaults = OmegaConf.to_container(experiment.pop("defaults", None) or OmegaConf.create())
        for group in defaults:
            if group not in GROUPS[1:]:
                raise ConfigError(
                    f"{path}: defaults.{group}: unknown group; allowed: {', '.join(GROUPS[1:])}"
                )
        chosen.update(defaults)
        per_optimizer = OmegaConf.to_container(
            experiment.pop("optimizers", None) or OmegaConf.create()
        )
    chosen.update(choices)
    if not chosen["task"]:
        raise ConfigError(
            "no task chosen: pass task=<name> or experiment=<name>; experiments: "
            + ", ".join(sorted(p.stem for p in (root / "experiment").glob("*.yaml")))
        )

    files = {g: group_file(g, chosen[g], root) for g in ("task", "optimizer", "trainer")}
    task_yaml, optimizer_yaml, trainer_yaml = (_load_yaml(files[g]) for g in files)
    task_name = task_yaml.get("name", files["task"].stem)
    optimizer_name = optimizer_yaml.get("name", files["optimizer"].stem)
    try:
        task_schema = task_config(task_name)
        opt_schema = optimizer_schema(optimizer_name)
    except ValueError as err:
        raise ConfigError(str(err)) from None

    cfg = OmegaConf.structured(RunConfig)
    cfg.task = OmegaConf.structured(task_schema)
    cfg.optimizer = OmegaConf.structured(opt_schema)
    cfg = _merge(cfg, {"trainer": trainer_yaml}, str(files["trainer"]))
    cfg = _merge(cfg, {"task": task_yaml}, str(files["task"]))
    cfg = _merge(cfg, {"optimizer": optimizer_yaml}, str(files["optimizer"]))
    if experiment is not None:
        source = str(group_file("experiment", chosen["experiment"], root))
        cfg = _merge(cfg, experiment, source)
        opt_choice = Path(chosen["optimizer"]).stem
        if opt_choice in per_optimizer:
            cfg = _merge(
                cfg, {"optimizer": per_optimizer[opt_choice]}, f"{source} optimizers.{opt_choice}"
            )
        elif per_optimizer:
            print(
                f"muoneq: note: experiment {chosen['experiment']} pins no hyper-parameters for "
                f"optimizer {opt_choice} (it pins: {', '.join(per_optimizer)}); using "
                f"{files['optimizer']} as it is"
            )
    return chosen, cfg


def validate(cfg: DictConfig) -> None:
    """Value checks beyond types: the dataclasses' ``__post_init__`` and the optimizer's own."""
    try:
        OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError):
            raise ConfigError(str(cause)) from None
        raise _config_error(err, cfg, "config") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.trainer.max_epochs is None and cfg.trainer.max_steps == -1:
        raise ConfigError(
            "trainer.max_epochs / trainer.max_steps: set at least one (the LR schedule needs a "
            "budget)"
        )
    try:
        check_optimizer_config(cfg.optimizer)
    except ValueError as err:
        raise ConfigError(str(err)) from None
