"""Typed run configs composed from ``conf/`` and command-line overrides, one job per module:

* :mod:`~muoneq.suite.runtime.config.schema` – the sections and :class:`RunConfig`;
* :mod:`~muoneq.suite.runtime.config.sources` – where config files are and reading them;
* :mod:`~muoneq.suite.runtime.config.composition` – :func:`compose`: files, experiment and command
  line merged in order, type-checked and validated;
* :mod:`~muoneq.suite.runtime.config.identity` – which keys make a run (its fingerprint) and its
  default name;
* :mod:`~muoneq.suite.runtime.config.config_error` – :class:`ConfigError`, one line naming the key.
"""

from muoneq.suite.runtime.config.composition import compose, split_args, validate
from muoneq.suite.runtime.config.config_error import ConfigError
from muoneq.suite.runtime.config.identity import NON_RESULT_KEYS, default_run_name, is_result_key
from muoneq.suite.runtime.config.schema import (
    PRECISIONS,
    RUN_NAME,
    SUITE_TRAINER_KEYS,
    AcceleratorName,
    ProgressMode,
    Resume,
    RunConfig,
    RunSection,
    ScheduleConfig,
    SpectraConfig,
    StrategyName,
    TrainerConfig,
)
from muoneq.suite.runtime.config.sources import GROUPS, conf_dir, group_file

__all__ = [
    "GROUPS",
    "NON_RESULT_KEYS",
    "PRECISIONS",
    "RUN_NAME",
    "SUITE_TRAINER_KEYS",
    "AcceleratorName",
    "ConfigError",
    "ProgressMode",
    "Resume",
    "RunConfig",
    "RunSection",
    "ScheduleConfig",
    "SpectraConfig",
    "StrategyName",
    "TrainerConfig",
    "compose",
    "conf_dir",
    "default_run_name",
    "group_file",
    "is_result_key",
    "split_args",
    "validate",
]
