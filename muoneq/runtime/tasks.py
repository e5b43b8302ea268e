"""Workloads by name: ``task.name`` → its config dataclass and a builder.

A builder receives the fully composed run config (``cfg.task`` typed by the task's own
dataclass, ``cfg.optimizer``, ``cfg.schedule``, ``cfg.trainer``, ``cfg.seed``) and returns
``(module, datamodule)``: a :class:`~muoneq.runtime.TaskModule` and a
:class:`~muoneq.runtime.TaskDataModule`. The built-in tasks are imported only when asked for,
so a language run never imports torchvision and a vision run never imports tiktoken.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any


@dataclass(frozen=True)
class TaskSpec:
    """A workload: its typed config (a dataclass with a ``name`` field) and its builder."""

    config: type
    build: Callable[[Any], tuple[Any, Any]]
    description: str = ""

    def __post_init__(self) -> None:
        if not is_dataclass(self.config):
            raise TypeError(f"TaskSpec.config must be a dataclass, got {self.config!r}")


#: Built-in tasks: name → "module:attribute" of their TaskSpec (imported on first use).
BUILTIN_TASKS: dict[str, str] = {
    "cifar10": "muoneq.tasks.vision.cifar10:TASK",
    "language": "muoneq.tasks.language.task:TASK",
}
#: Their config dataclasses, in modules without Lightning: composing a config stays light.
BUILTIN_CONFIGS: dict[str, str] = {
    "cifar10": "muoneq.tasks.vision.config:Cifar10TaskConfig",
    "language": "muoneq.tasks.language.config:LanguageTaskConfig",
}

#: Tasks already imported or registered at run time.
TASKS: dict[str, TaskSpec] = {}


def register_task(name: str, spec: TaskSpec) -> None:
    """Make ``task.name=<name>`` available (for workloads outside this package)."""
    if name in TASKS or name in BUILTIN_TASKS:
        raise ValueError(f"task name {name!r} is already registered")
    TASKS[name] = spec


def task_names() -> list[str]:
    return sorted({*BUILTIN_TASKS, *TASKS})


def _load(reference: str):
    module, attr = reference.split(":")
    return getattr(importlib.import_module(module), attr)


def task_config(name: str) -> type:
    """The config dataclass of task ``name``, without importing the task's modules."""
    if name in TASKS:
        return TASKS[name].config
    if name in BUILTIN_CONFIGS:
        return _load(BUILTIN_CONFIGS[name])
    return get_task(name).config


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` called ``name`` (``ValueError`` listing the known names)."""
    if name not in TASKS:
        if name not in BUILTIN_TASKS:
            raise ValueError(f"task.name: unknown task {name!r}; known: {', '.join(task_names())}")
        TASKS[name] = _load(BUILTIN_TASKS[name])
    return TASKS[name]
