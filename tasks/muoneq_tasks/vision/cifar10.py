"""The ``cifar10`` task: ResNet-18 (CIFAR variant) on CIFAR-10, top-1 test accuracy.

The paper's recipe (Table 7) is
``conf/experiment/cifar10_resnet18.yaml``. The reported metric is the paper's: ``test/acc``, the
top-1 accuracy of the final weights on the 10,000 test images. The test set never selects
anything: with ``task.data.val_size = N > 0`` the last N training images are held out, validated
after every epoch (``val/acc``, ``best_val_acc``) and pick ``best.ckpt``; with the default
``val_size = 0`` there is no validation and no model selection during training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from muoneq.suite.runtime import TaskModule
from muoneq_tasks.vision.cifar10_data import Cifar10DataModule
from muoneq_tasks.vision.config import Cifar10TaskConfig
from muoneq_tasks.vision.resnet import CifarResNet

NUM_CLASSES = 10


class Cifar10Module(TaskModule):
    """Cross-entropy training; loss and top-1 accuracy on the held-out validation split (when
    there is one: ``validation``) and on the test set."""

    monitor_mode = "max"
    paper_metric = "test/acc"
    hparam_metrics = ("test/acc", "test/loss")

    def __init__(self, model, *, validation: bool, **kwargs):
        super().__init__(model, **kwargs)
        self.monitor = "val/acc" if validation else None
        self.best_val_acc: float | None = None
        for stage in ("val", "test"):
            self.add_module(f"{stage}_acc", MulticlassAccuracy(NUM_CLASSES, average="micro"))
            self.add_module(f"{stage}_loss", MeanMetric())

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        if self.logs_step():
            self.log("train/loss", loss, prog_bar=True)
            self.log("train/acc", (logits.argmax(-1) == labels).float().mean())
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

    def on_validation_epoch_end(self) -> None:
        accuracy = float(self.val_acc.compute())  # all processes' counts (a collective)
        if not self.trainer.sanity_checking:
            self.best_val_acc = max(accuracy, self.best_val_acc or accuracy)
            self.log("best_val_acc", self.best_val_acc)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["cifar10"] = {"best_val_acc": self.best_val_acc}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.best_val_acc = checkpoint.get("cifar10", {}).get("best_val_acc")

    def final_metrics(self) -> dict:
        return {**super().final_metrics(), "best_val_acc": self.best_val_acc}

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")


def build(cfg) -> tuple[Cifar10Module, Cifar10DataModule]:
    """The network (initialized from ``cfg.seed`` alone, so every optimizer of a seed starts
    from the same weights), its module and the data module."""
    task: Cifar10TaskConfig = OmegaConf.to_object(cfg.task)
    torch.manual_seed(cfg.seed)
    model = CifarResNet(blocks=task.model.blocks, width=task.model.width, num_classes=NUM_CLASSES)
    module = Cifar10Module(
        model, validation=task.data.val_size > 0, optimizer=cfg.optimizer, schedule=cfg.schedule,
        compile=cfg.trainer.compile,
    )
    return module, Cifar10DataModule(task.data, seed=cfg.seed)
