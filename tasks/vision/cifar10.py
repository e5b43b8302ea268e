"""The ``cifar10`` task: ResNet-18 (CIFAR variant) on CIFAR-10, top-1 test accuracy.

The paper's recipe (Table ``tab:resnet18_cifar10_hyperparameters``) is
``conf/experiment/cifar10_resnet18.yaml``. The monitored metric is ``val/acc``: accuracy on the
validation split when ``task.data.val_size > 0``, otherwise on the test set after every epoch
(the paper has no held-out split). ``test/acc`` in ``metrics.json`` is the accuracy of the final
weights on the full test set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from muoneq.runtime import TaskModule, TaskSpec
from muoneq.tasks.vision.cifar10_data import Cifar10DataConfig, Cifar10DataModule
from muoneq.tasks.vision.resnet import CifarResNet

NUM_CLASSES = 10


@dataclass
class ResNetConfig:
    #: BasicBlocks per stage: (2, 2, 2, 2) is ResNet-18.
    blocks: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    #: Channels of the first stage (doubled at every stage); 64 is ResNet-18.
    width: int = 64

    def __post_init__(self) -> None:
        if not self.blocks or min(self.blocks) < 1:
            raise ValueError(f"task.model.blocks: expected counts ≥ 1, got {self.blocks}")
        if self.width < 1:
            raise ValueError(f"task.model.width: must be ≥ 1, got {self.width}")


@dataclass
class Cifar10TaskConfig:
    name: str = "cifar10"
    data: Cifar10DataConfig = field(default_factory=Cifar10DataConfig)
    model: ResNetConfig = field(default_factory=ResNetConfig)


class Cifar10Module(TaskModule):
    """Cross-entropy training; loss and top-1 accuracy on validation and test."""

    monitor = "val/acc"
    monitor_mode = "max"
    hparam_metrics = ("test/acc", "test/loss")

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        for stage in ("val", "test"):
            self.add_module(f"{stage}_acc", MulticlassAccuracy(NUM_CLASSES, average="micro"))
            self.add_module(f"{stage}_loss", MeanMetric())

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        accuracy = (logits.argmax(-1) == labels).float().mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", accuracy)
        return loss

    def _evaluate(self, batch, stage: str) -> None:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        accuracy, mean_loss = getattr(self, f"{stage}_acc"), getattr(self, f"{stage}_loss")
        accuracy.update(logits, labels)
        mean_loss.update(loss, weight=len(labels))
        self.log(f"{stage}/acc", accuracy, prog_bar=stage == "val")
        self.log(f"{stage}/loss", mean_loss)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")


def build(cfg) -> tuple[Cifar10Module, Cifar10DataModule]:
    """The network (initialized from ``cfg.seed`` alone, so every optimizer of a seed starts
    from the same weights), its module and the data module."""
    task: Cifar10TaskConfig = OmegaConf.to_object(cfg.task)
    torch.manual_seed(cfg.seed)
    model = CifarResNet(blocks=task.model.blocks, width=task.model.width, num_classes=NUM_CLASSES)
    module = Cifar10Module(
        model, optimizer=cfg.optimizer, schedule=cfg.schedule, compile=cfg.trainer.compile
    )
    return module, Cifar10DataModule(task.data, seed=cfg.seed)


TASK = TaskSpec(Cifar10TaskConfig, build, "ResNet-18 (CIFAR variant) on CIFAR-10: top-1 accuracy")
