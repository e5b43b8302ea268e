"""The training runtime: typed configs composed from ``conf/``, the Lightning trainer factory,
the base classes every workload derives from, and the ``muoneq train`` command.

A workload (a *task*) needs only a network, a data module and a config dataclass::

    from muoneq.suite.runtime import TaskDataModule, TaskModule, TaskSpec, register_task

    @dataclass
    class MyTaskConfig:
        name: str = "my_task"
        ...

    class MyModule(TaskModule):        # builds its optimizer from the optimizer config
        monitor, monitor_mode = "val/loss", "min"
        def training_step(self, batch, batch_idx): ...

    register_task("my_task", TaskSpec(MyTaskConfig, build=lambda cfg: (MyModule(...), MyData(...))))

and is run with ``muoneq train task=my_task optimizer=muoneq_nes trainer.max_steps=1000``.
"""

from muoneq.suite.runtime.config import ConfigError, RunConfig, compose, conf_dir
from muoneq.suite.runtime.optim import build_optimizer_from_config, optimizer_schema
from muoneq.suite.runtime.record import RunFolderError
from muoneq.suite.runtime.schedule import build_scheduler, lr_factor
from muoneq.suite.runtime.tasks import TASKS, TaskSpec, get_task, register_task

#: Names whose modules import Lightning, loaded on first use (PEP 562): composing and checking
#: configs (``--print-config``, ``--help``, a sweep's checks) never pays for it.
_LAZY = {
    "ResumableSampler": "muoneq.suite.runtime.data", "TaskDataModule": "muoneq.suite.runtime.data",
    "TaskModule": "muoneq.suite.runtime.module", "train": "muoneq.suite.runtime.run",
    "build_trainer": "muoneq.suite.runtime.trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'muoneq.suite.runtime' has no attribute {name!r}")


__all__ = [
    "TASKS",
    "ConfigError",
    "ResumableSampler",
    "RunConfig",
    "RunFolderError",
    "TaskDataModule",
    "TaskModule",
    "TaskSpec",
    "build_optimizer_from_config",
    "build_scheduler",
    "build_trainer",
    "compose",
    "conf_dir",
    "get_task",
    "lr_factor",
    "optimizer_schema",
    "register_task",
    "train",
]
