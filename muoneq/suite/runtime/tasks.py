"""Workloads by name: ``task.name`` → its config dataclass and a builder.

A builder receives the fully composed run config (``cfg.task`` typed by the task's own
dataclass, ``cfg.optimizer``, ``cfg.schedule``, ``cfg.trainer``, ``cfg.seed``) and returns
``(module, datamodule)``: a :class:`~muoneq.suite.runtime.TaskModule` and a
:class:`~muoneq.suite.runtime.TaskDataModule`.

Tasks are found in one of two ways, both ending in :data:`TASKS`:

* the entry points of the group ``muoneq.tasks`` (``name = "package.module:TASK"`` in a
  distribution's ``pyproject.toml``): the suite's own tasks (``tasks/``) and any installed
  third-party package, loaded on first use by name;
* :func:`register_task`, for a workload defined in the running program.

A task's ``TASK`` lives in a module that imports no Lightning (its package's ``__init__``) and
its builder imports the heavy modules when called, so composing a config stays light and a
language run never imports torchvision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, is_dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

#: The entry-point group tasks are declared in.
ENTRY_POINT_GROUP = "muoneq.tasks"


@dataclass(frozen=True)
class TaskCommand:
    """A ``muoneq <name>`` command a task brings (the language task's ``muoneq data``):
    ``module`` exposes ``main(argv) -> int`` and is imported when the command runs."""

    module: str
    description: str


@dataclass(frozen=True)
class TaskSpec:
    """A workload: its typed config (a dataclass with a ``name`` field), its builder, and the
    numeric keys its runs add to ``metrics.json`` with a value on this machine
    (``metrics(cfg)``, from the composed config: what its module logs and its
    ``final_metrics``; :func:`muoneq.suite.runtime.metrics.metric_keys` adds the runtime's
    own). A sweep checks its objective against them before anything runs; None: not
    declared, nothing is checked. ``check_data(cfg)``, when given, raises what a run of the
    composed config would raise about its data before its first step (a
    :class:`~muoneq.suite.errors.DataError` when it is missing, another
    :class:`~muoneq.suite.errors.UserError` when it is unusable), cheaply (file headers, no
    training): a sweep runs it before any run starts.

    Optional: ``synthetic_data(cfg, folder)`` writes random inputs in the task's data format
    into ``folder``, as many as the run ``cfg`` reads, and returns the overrides that point the
    run at them (for throughput checks such as ``muoneq gpu-check``, never for results);
    ``mini_data(folder)`` writes a small *real* data set available offline (one that ships with
    Python or a declared dependency) in the task's format into ``folder``, unless it is already
    there, and returns the overrides that point a run at it and one line naming it (for the
    sweeps' miniatures, :mod:`muoneq.suite.sweeps.miniature`, and ``make demo``); and
    ``commands``, the ``muoneq`` commands the task brings, by name.

    ``lean_imports``: the task's runs use none of the packages torchmetrics imports only for
    its optional metrics (torchvision, transformers, scipy, matplotlib) through torchmetrics, so
    their processes import Lightning without them (:mod:`muoneq.suite.runtime.lean_imports`);
    they may still import any of them themselves."""

    config: type
    build: Callable[[Any], tuple[Any, Any]]
    description: str = ""
    metrics: Callable[[Any], Iterable[str]] | None = None
    synthetic_data: Callable[[Any, Path], list[str]] | None = None
    commands: dict[str, TaskCommand] = field(default_factory=dict)
    check_data: Callable[[Any], None] | None = None
    lean_imports: bool = False
    mini_data: Callable[[Path], MiniData] | None = None

    def __post_init__(self) -> None:
        if not is_dataclass(self.config):
            raise TypeError(f"TaskSpec.config must be a dataclass, got {self.config!r}")


@dataclass(frozen=True)
class MiniData:
    """What a task's ``mini_data`` prepared: the overrides that point a run at it, and one line
    naming it (a miniature's report says what it ran on)."""

    overrides: list[str]
    description: str


#: Tasks loaded or registered so far in this process.
TASKS: dict[str, TaskSpec] = {}


def _declared() -> dict[str, Any]:
    """The installed entry points of :data:`ENTRY_POINT_GROUP`, by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def register_task(name: str, spec: TaskSpec) -> None:
    """Make ``task.name=<name>`` available (for a workload defined in the running program)."""
    if name in TASKS or name in _declared():
        raise ValueError(f"task name {name!r} is already registered")
    TASKS[name] = spec


def task_names() -> list[str]:
    return sorted({*TASKS, *_declared()})


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` called ``name`` (``ValueError`` listing the known names)."""
    if name not in TASKS:
        declared = _declared()
        if name not in declared:
            known = ", ".join(task_names()) or f"(none: no {ENTRY_POINT_GROUP} entry points)"
            raise ValueError(f"task.name: unknown task {name!r}; known: {known}")
        try:
            spec = declared[name].load()
        except ImportError as err:
            raise ValueError(
                f"task.name: task {name!r} ({declared[name].value}) cannot be imported: {err}; "
                "reinstall the package that declares it (a module of yours with the same name "
                "shadows it when it lies in the folder you run from)") from None
        if not isinstance(spec, TaskSpec):
            raise TypeError(f"entry point {declared[name].value} of {ENTRY_POINT_GROUP} "
                            f"({name}) is a {type(spec).__name__}, not a TaskSpec")
        TASKS[name] = spec
    return TASKS[name]


def task_config(name: str) -> type:
    """The config dataclass of task ``name`` (without importing the task's Lightning code)."""
    return get_task(name).config


def task_commands() -> tuple[dict[str, tuple[str, TaskCommand]], list[str]]:
    """The ``muoneq`` commands the tasks bring, name → (task, command), and a line for each task
    that cannot be loaded (its commands are missing; the others' still work). ``ValueError``
    when two tasks bring the same name."""
    commands: dict[str, tuple[str, TaskCommand]] = {}
    broken = []
    for task in task_names():
        try:
            spec = get_task(task)
        except (ValueError, TypeError) as err:
            broken.append(str(err))
            continue
        for name, command in spec.commands.items():
            if name in commands:
                raise ValueError(f"tasks {commands[name][0]!r} and {task!r} both bring the "
                                 f"command {name!r}")
            commands[name] = (task, command)
    return commands, broken
