"""Composing a run config from ``conf/`` and command-line overrides.

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

from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from muoneq.suite.runtime.config.config_error import ConfigError, config_error
from muoneq.suite.runtime.config.identity import default_run_name
from muoneq.suite.runtime.config.schema import RunConfig
from muoneq.suite.runtime.config.sources import GROUPS, conf_dir, group_file, load_yaml
from muoneq.suite.runtime.optim import check_optimizer_config, optimizer_schema
from muoneq.suite.runtime.tasks import task_config

DEFAULT_CHOICES = {
    "experiment": None, "task": None, "optimizer": "muoneq_nes", "trainer": "default",
}

def _merge(cfg: DictConfig, update: dict | DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, update)
    except OmegaConfBaseException as err:
        raise config_error(err, cfg, source) from None


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
    _note_half_precision_on_cpu(cfg, chosen, dotlist, cache)
    if cfg.run.name is None:
        cfg.run.name = default_run_name(chosen, cfg, args)
    OmegaConf.set_struct(cfg, True)
    return cfg


#: precisions that autocast to a 16-bit type: on a CPU about twice as slow as float32
HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16")


def _note_half_precision_on_cpu(cfg: DictConfig, chosen: dict, dotlist: DictConfig,
                                cache: dict | None) -> None:
    """One line when a CPU run keeps a 16-bit precision that a file set (an experiment's
    ``bf16-mixed`` under ``trainer=cpu``, whose own precision the experiment's overrides): on
    a CPU, bf16 autocast runs about half as fast as float32 for the same result. Once per
    ``cache`` (a sweep composing many points)."""
    if (str(cfg.trainer.accelerator.value) != "cpu" or cfg.trainer.precision not in
            HALF_PRECISIONS or OmegaConf.select(dotlist, "trainer.precision") is not None):
        return
    if cache is not None:
        if cache.get("noted_half_precision"):
            return
        cache["noted_half_precision"] = True
    source = (f"experiment {chosen['experiment']}" if chosen.get("experiment")
              else f"trainer {chosen['trainer']}")
    print(f"muoneq: note: trainer.precision={cfg.trainer.precision} (from {source}) on a CPU "
          "(trainer.accelerator=cpu), where 16-bit autocast is about half as fast as float32; "
          "add trainer.precision=32-true to train in float32")


def _compose_files(choices: dict[str, str], root: Path) -> tuple[dict, DictConfig]:
    """The group choices in effect and the config of the files alone (every layer below the
    command line)."""
    chosen = dict(DEFAULT_CHOICES)
    experiment = None
    per_optimizer: dict = {}
    if choices.get("experiment"):
        path = group_file("experiment", choices["experiment"], root)
        experiment = load_yaml(path)
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
    task_yaml, optimizer_yaml, trainer_yaml = (load_yaml(files[g]) for g in files)
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
        raise config_error(err, cfg, "config") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.trainer.max_epochs in (None, -1) and cfg.trainer.max_steps == -1:
        raise ConfigError(
            f"trainer.max_epochs={cfg.trainer.max_epochs} / trainer.max_steps=-1: set at least "
            "one to a number of epochs or steps (-1 and null set none, and the LR schedule needs "
            "a budget)"
        )
    try:
        check_optimizer_config(cfg.optimizer)
    except ValueError as err:
        raise ConfigError(str(err)) from None
