"""Vision workloads: the ``cifar10`` task, ResNet-18 (CIFAR variant) on CIFAR-10.

``TASK`` is what the ``muoneq.tasks`` entry point ``cifar10`` names; this module imports no
Lightning (the builder does, when a run is built)."""

from muoneq.suite.runtime.tasks import TaskSpec
from muoneq_tasks.vision.config import Cifar10TaskConfig


def build(cfg):
    """The run's module and data module: :func:`muoneq_tasks.vision.cifar10.build`."""
    from muoneq_tasks.vision.cifar10 import build

    return build(cfg)


def metrics(cfg) -> tuple[str, ...]:
    """What :class:`muoneq_tasks.vision.cifar10.Cifar10Module` adds to ``metrics.json``: training
    and test loss and accuracy, and the validation ones with a validation split."""
    validation = ("val/acc", "val/loss") if cfg.task.data.val_size > 0 else ()
    return ("train/loss", "train/acc", "test/acc", "test/loss", "best_val_acc", *validation)


def synthetic_data(cfg, folder):
    """Random CIFAR-shaped images for the run ``cfg``: :func:`.cifar10_data.write_synthetic`."""
    from muoneq_tasks.vision.cifar10_data import write_synthetic

    return write_synthetic(cfg, folder)


def check_data(cfg) -> None:
    """Where the run will find its images: :func:`.cifar10_data.check_data`."""
    from muoneq_tasks.vision.cifar10_data import check_data

    check_data(cfg.task.data)


def mini_data(folder):
    """scikit-learn's handwritten digits in CIFAR-10's format: :func:`.digits.mini_data`."""
    from muoneq_tasks.vision.digits import mini_data

    return mini_data(folder)


TASK = TaskSpec(Cifar10TaskConfig, build, "ResNet-18 (CIFAR variant) on CIFAR-10: top-1 accuracy",
                metrics, synthetic_data, check_data=check_data, lean_imports=True,
                mini_data=mini_data)
